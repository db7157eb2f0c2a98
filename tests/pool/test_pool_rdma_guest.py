"""The RDMA data plane on a real kernel verbs stack: soft-RoCE (`rdma_rxe`), in the QEMU guest of
`make test-rdma` (tests/guest/rdma_guest.py), or on any host with an RDMA device.

Every test here is marked `rdma` (skipped where pyverbs opens no device). Each runs a real
`kvtier pool serve --transport rdma --verbs pyverbs` subprocess and this process as its client:
queue pairs through RESET -> INIT -> RTR -> RTS with the GID chosen from the device's own table,
one-sided READ/WRITE with selective signalling, an access outside a memory region refused by the
NIC, the transport contract suite that TCP and the fake NIC pass, zero copy from registered memory
and the fall-back where the kernel refuses to register it (`ulimit -l`, an unprivileged process),
a `KVTier` whose pool tier runs over RDMA, a node killed mid-transfer, and `kvtier doctor` /
`kvtier info` naming the device. The fake NIC (`kvtier.testing.fake_verbs`) is held to what is
seen here: the same statuses, states and GID types (see test_pool_rdma.py for its side).
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.config import config_from_dict
from kvtier.pool.client.api import PoolClient
from kvtier.pool.client.rdma import STAGING_BYTES, RDMATransport
from kvtier.pool.verbs import Device, GidType, QueuePair, init_attr, load_verbs, rtr_attr, rts_attr
from kvtier.runtime import KVTier
from kvtier.testing.pool import rdma_node
from kvtier.testing.transport_contract import TransportContract
from kvtier.tiers.base import TierKind
from support.runtime import BLOCK, LAYOUT, WAIT_S, blocks

pytestmark = pytest.mark.rdma
P = TierKind.POOL
SYSFS = Path("/sys/class/infiniband")


@pytest.fixture(scope="module")
def v():
    return load_verbs("pyverbs")


@pytest.fixture(scope="module")
def node() -> Iterator:
    with rdma_node("pyverbs", capacity="16MiB", region_size="256KiB") as n:
        yield n


@pytest.fixture
def device(v) -> Iterator[Device]:
    d = Device(v)
    yield d
    d.close()


def _buffer(mr) -> memoryview:
    return memoryview((ctypes.c_char * mr.length).from_address(mr.buf)).cast("B")


def _poll(dev: Device, want: int, tries: int = 200_000) -> list:
    got: list = []
    for _ in range(tries):
        n, wcs = dev.cq.poll(16)
        got += list(wcs[:n])
        if len(got) >= want:
            return got
    raise AssertionError(f"{len(got)} of {want} completions")


# ---- the device as the kernel exposes it -------------------------------------------------------


def test_the_gid_is_the_roce_v2_ipv4_entry_of_the_real_table(device) -> None:
    gid = device.gid
    port = SYSFS / device.name / "ports" / str(gid.port)
    assert gid.gid_type is GidType.ROCE_V2
    assert (port / "gid_attrs" / "types" / str(gid.index)).read_text().strip() == "RoCE v2"
    assert (port / "gids" / str(gid.index)).read_text().strip() == gid.gid
    assert gid.gid.startswith("0000:0000:0000:0000:0000:ffff:"), "an IPv4-mapped GID (RoCE v2 over IPv4)"
    assert (port / "state").read_text().strip() == "4: ACTIVE"


def test_a_queue_pair_steps_reset_init_rtr_rts_and_refuses_a_skipped_step(v, device) -> None:
    e = v.e
    a, b = QueuePair(device), QueuePair(device)
    try:
        assert a.qp.qp_state == e.IBV_QPS_RESET
        with pytest.raises(v.Error):
            a.qp.modify(*rts_attr(v, a.psn))  # RESET -> RTS: refused by the kernel
        assert a.qp.qp_state == e.IBV_QPS_RESET, "a refused step changes nothing"
        peer = b.local_info()
        for attr_mask, state in ((init_attr(v, device.gid.port), e.IBV_QPS_INIT),
                                 (rtr_attr(v, device.gid, peer, min(int(device.mtu), peer.mtu)), e.IBV_QPS_RTR),
                                 (rts_attr(v, a.psn), e.IBV_QPS_RTS)):
            a.qp.modify(*attr_mask)
            assert a.qp.qp_state == state
        b.connect(a.local_info())
        assert b.qp.qp_state == e.IBV_QPS_RTS
    finally:
        a.close()
        b.close()


def test_one_sided_write_and_read_with_selective_signalling_and_an_access_past_the_mr(v, device) -> None:
    e = v.e
    a, b = QueuePair(device), QueuePair(device)
    try:
        a.connect(b.local_info())
        b.connect(a.local_info())
        n = 1 << 20
        src, dst, back = device.register(n), device.register(n), device.register(n)
        _buffer(src)[:] = os.urandom(n)
        chunk = n // 4
        wrs = []
        for i in range(4):  # four WRITEs, only the last signalled: one completion for the chain
            wr = v.SendWR(wr_id=i, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1,
                          sg=[v.SGE(src.buf + i * chunk, chunk, src.lkey)],
                          send_flags=e.IBV_SEND_SIGNALED if i == 3 else 0)
            wr.set_wr_rdma(dst.rkey, dst.buf + i * chunk)
            wrs.append(wr)
        for first, then in zip(wrs, wrs[1:]):
            first.next_wr = then
        a.qp.post_send(wrs[0])
        [wc] = _poll(device, 1)
        assert (wc.wr_id, wc.status) == (3, e.IBV_WC_SUCCESS) and device.cq.poll(16)[0] == 0
        assert bytes(_buffer(dst)) == bytes(_buffer(src)), "byte-exact"
        read = v.SendWR(wr_id=7, opcode=e.IBV_WR_RDMA_READ, num_sge=1, sg=[v.SGE(back.buf, n, back.lkey)],
                        send_flags=e.IBV_SEND_SIGNALED)
        read.set_wr_rdma(dst.rkey, dst.buf)
        a.qp.post_send(read)
        [wc] = _poll(device, 1)
        assert (wc.wr_id, wc.status) == (7, e.IBV_WC_SUCCESS) and bytes(_buffer(back)) == bytes(_buffer(src))
        past = v.SendWR(wr_id=9, opcode=e.IBV_WR_RDMA_READ, num_sge=1, sg=[v.SGE(back.buf, 4096, back.lkey)])
        past.set_wr_rdma(dst.rkey, dst.buf + n - 1024)  # 3 KiB past the end of the remote MR
        a.qp.post_send(past)  # unsignalled: an error completes anyway
        [wc] = _poll(device, 1)
        assert (wc.wr_id, wc.status) == (9, e.IBV_WC_REM_ACCESS_ERR)
        assert a.qp.query(e.IBV_QP_STATE)[0].qp_state == e.IBV_QPS_ERR, "an error completion kills the QP"
    finally:
        a.close()
        b.close()


# ---- the transport against a node in another process -------------------------------------------


@pytest.fixture
def client(node) -> Iterator[PoolClient]:
    with PoolClient([node.address], timeout_s=30) as c:
        yield c


class TestRealVerbsTransport(TransportContract):
    """The contract TCP and the fake NIC pass (`kvtier.testing.transport_contract`), on rxe."""

    @pytest.fixture
    def client(self, node) -> Iterator[PoolClient]:
        with PoolClient([node.address], timeout_s=30) as c:
            yield c

    @pytest.fixture
    def transport(self, client: PoolClient) -> Iterator[RDMATransport]:
        t = RDMATransport(client.links[0], verbs="pyverbs")
        yield t
        t.close()


def test_registered_memory_moves_zero_copy_and_batches_complete(client) -> None:
    t = RDMATransport(client.links[0], verbs="pyverbs")
    try:
        slab = torch.zeros(16 * BLOCK, dtype=torch.uint8)
        t.register_memory(slab.data_ptr(), slab.numel(), slab)
        rows = blocks(range(8))
        view = memoryview(slab.numpy())
        locs = [client.alloc(os.urandom(16), BLOCK).location for _ in range(8)]
        from kvtier.pool.base import RemoteIO

        slab[: 8 * BLOCK] = rows.reshape(-1)
        assert t.write_many([RemoteIO(loc, view[i * BLOCK:(i + 1) * BLOCK]) for i, loc in enumerate(locs)]) == [True] * 8
        assert t.read_many([RemoteIO(loc, view[(8 + i) * BLOCK:(9 + i) * BLOCK]) for i, loc in enumerate(locs)]) \
            == [True] * 8
        assert torch.equal(slab[8 * BLOCK:].reshape(8, BLOCK), rows), "byte-exact, straight into the slab"
        assert (t.zero_copy_bytes, t.staged_bytes) == (16 * BLOCK, 0), "no staging copy"
        assert t.zero_copy_error is None
    finally:
        t.close()


_UNPRIVILEGED = textwrap.dedent("""
    import json, os, resource, sys, torch
    from kvtier.pool.base import RemoteIO
    from kvtier.pool.client.api import PoolClient
    from kvtier.pool.client.rdma import RDMATransport
    with PoolClient([sys.argv[1]], timeout_s=30) as client:
        t = RDMATransport(client.links[0], verbs="pyverbs")
        slab = torch.zeros(64 << 20, dtype=torch.uint8)  # far past what the locked-memory limit allows
        t.register_memory(slab.data_ptr(), slab.numel(), slab)
        loc = client.alloc(os.urandom(16), 4096).location
        view = memoryview(slab.numpy())
        view[:4096] = os.urandom(4096)
        ok = t.write(loc, view[:4096]) and t.read(loc, view[4096:8192])
        print(json.dumps({"ok": bool(ok), "same": bytes(view[:4096]) == bytes(view[4096:8192]),
                          "zero_copy": t.zero_copy_bytes, "staged": t.staged_bytes, "error": t.zero_copy_error}))
        t.close()
""")


def _without_ipc_lock() -> None:
    """In the child, before exec: room to lock the staging buffer only, and no CAP_IPC_LOCK (root
    has it, and it lifts the limit): dropped from the bounding set, so the exec'd process lacks it."""
    import ctypes
    import resource

    limit = STAGING_BYTES + (256 << 10)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, limit))
    PR_CAPBSET_DROP, CAP_IPC_LOCK = 24, 14
    if ctypes.CDLL(None, use_errno=True).prctl(PR_CAPBSET_DROP, CAP_IPC_LOCK, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_IPC_LOCK)")


@pytest.mark.skipif(os.geteuid() != 0, reason="drops CAP_IPC_LOCK from a child: needs root")
def test_memory_the_kernel_refuses_to_register_is_staged_and_the_reason_names_ulimit(node) -> None:
    run = subprocess.run([sys.executable, "-c", _UNPRIVILEGED, node.address], capture_output=True, text=True,
                         timeout=300, preexec_fn=_without_ipc_lock)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["ok"] and got["same"], got
    assert got["zero_copy"] == 0 and got["staged"] == 8192, "staged, not lost"
    assert "cannot register" in got["error"] and "ulimit -l" in got["error"], got["error"]


# ---- the runtime over RDMA -----------------------------------------------------------------------


def _runtime(address: str, timeout_s: float = WAIT_S, ssd: Path | None = None) -> KVTier:
    marks = {"high_watermark": 1.0, "low_watermark": 1.0}
    tiers = {"dram": {"capacity": 2 * BLOCK, **marks},
             "pool": {"capacity": 8 * BLOCK, "nodes": [address], "transport": "rdma", "verbs": "pyverbs",
                      "timeout_s": timeout_s, "reconnect_s": 0, **marks}}
    if ssd is not None:
        tiers["ssd"] = {"capacity": 16 * BLOCK, "path": str(ssd), **marks}
    return KVTier(config_from_dict({"model": "kvtier-tiny", "tiers": tiers}), layout=LAYOUT)


def test_a_kvtier_whose_pool_tier_runs_over_rdma_stores_and_loads_byte_exact(node) -> None:
    keys = list(range(8))
    with _runtime(node.address) as kv:
        for k in keys:
            assert kv.store([k], blocks([k])).wait(WAIT_S)
            kv.quiesce(WAIT_S)
        assert kv.where(keys).count(P) == 6
        out = torch.zeros(len(keys), BLOCK, dtype=torch.uint8)
        assert kv.load(keys, out).wait(WAIT_S) and torch.equal(out, blocks(keys))
        pool = next(t for t in kv.describe()["tiers"] if t["tier"] == "pool")
        assert pool["transport"] == "rdma" and "rxe" in pool["transport_reason"], pool
        assert pool["rdma_zero_copy"] == "on" and pool["rdma_zero_copy_bytes"] > 0, "DRAM slot <-> pool, no staging"


def test_a_node_killed_mid_transfer_costs_a_load_of_its_blocks_never_the_blocks(tmp_path) -> None:
    with rdma_node("pyverbs", capacity="16MiB", region_size="256KiB") as node, \
            _runtime(node.address, 3.0, ssd=tmp_path) as kv:
        keys = list(range(8))
        for k in keys:
            assert kv.store([k], blocks([k])).wait(WAIT_S)
            kv.quiesce(WAIT_S)
        on_node = [k for k, t in zip(keys, kv.where(keys)) if t is P]
        assert on_node
        out = torch.zeros(len(on_node), BLOCK, dtype=torch.uint8)
        handle = kv.load(on_node, out)  # in flight when the node dies
        node.kill()
        handle.wait(60)  # returns: the client's 3 s timeout bounds every wait on the dead node
        assert set(handle.failed) <= set(on_node)
        served = [i for i, k in enumerate(on_node) if k not in handle.failed]
        if served:  # what landed before the kill is whole and right, never wrong bytes
            assert torch.equal(out[served], blocks([on_node[i] for i in served]))
        kv.quiesce(60)
        back = torch.zeros(len(keys), BLOCK, dtype=torch.uint8)  # the SSD kept a copy of each
        assert kv.load(keys, back).wait(60) and torch.equal(back, blocks(keys))
        assert kv.stats.num_dropped == 0, kv.snapshot()["dropped"]


# ---- the operator's tools ------------------------------------------------------------------------


def test_doctor_and_info_name_the_device_and_the_transport(device, tmp_path) -> None:
    doctor = subprocess.run([sys.executable, "-m", "kvtier", "doctor", "--json"], capture_output=True, text=True,
                            timeout=300)
    checks = {c["name"]: c for c in json.loads(doctor.stdout)}
    port = checks[f"rdma {device.name} port {device.gid.port}"]
    assert port["status"] == "ok", port
    assert checks[f"rdma {device.name} GID"]["status"] == "ok"
    info = subprocess.run([sys.executable, "-m", "kvtier", "info", "--json"], capture_output=True, text=True,
                          timeout=300)
    env = json.loads(info.stdout)["environment"]
    assert device.name in env["rdma_devices"] and env["pool_transport"].startswith("rdma"), env
