"""The RDMA data plane on this machine: real pyverbs objects where no device is needed, GID
selection on sample tables, the "no device" path, the QP state machine on the fake, and (marked
`rdma`, skipped without a device) the real device. Cost: about 2 s (one node subprocess).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvtier.errors import ConfigError
from kvtier.testing import fake_verbs
from kvtier.testing.devices import has_rdma_device
from kvtier.testing.pool import FAKE_VERBS
from kvtier.pool.detect import TransportKind, choose_transport
from kvtier.pool.verbs import (
    Device,
    GidEntry,
    GidType,
    NoRDMADevice,
    PeerInfo,
    QueuePair,
    device_names,
    init_attr,
    load_verbs,
    rtr_attr,
    rts_attr,
    select_gid,
)

pyverbs = pytest.importorskip("pyverbs")




V4 = "0000:0000:0000:0000:0000:ffff:0a00:0001"
LL = "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
V6 = "2001:0db8:0000:0000:0000:0000:0000:0001"
ZERO = "0000:0000:0000:0000:0000:0000:0000:0000"


def test_real_pyverbs_builds_qp_and_address_attributes_without_a_device() -> None:
    v = load_verbs("pyverbs")
    local = GidEntry(1, 3, V4, GidType.ROCE_V2, True)
    peer = PeerInfo(qpn=0x1234, psn=77, gid=V4, lid=0, mtu=int(v.e.IBV_MTU_1024))
    attr, mask = rtr_attr(v, local, peer, peer.mtu)
    assert attr.dest_qp_num == 0x1234 and attr.rq_psn == 77 and mask & v.e.IBV_QP_DEST_QPN
    assert attr.ah_attr.sgid_index == 3 and str(attr.ah_attr.dgid) == V4 and attr.ah_attr.port_num == 1
    assert init_attr(v, 1)[0].qp_state == v.e.IBV_QPS_INIT and rts_attr(v, 5)[0].sq_psn == 5
    cap = v.QPCap(max_send_wr=64, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    assert v.QPInitAttr(qp_type=v.e.IBV_QPT_RC, cap=cap, sq_sig_all=0).qp_type == v.e.IBV_QPT_RC
    wr = v.SendWR(wr_id=1, opcode=v.e.IBV_WR_RDMA_READ, num_sge=1, sg=[v.SGE(0x1000, 64, 9)])
    wr.set_wr_rdma(7, 0x2000)
    assert wr.wr_id == 1


@pytest.mark.skipif(has_rdma_device(), reason="this host has an RDMA device")
def test_no_device_is_reported_and_auto_falls_back_to_tcp(monkeypatch) -> None:
    with pytest.raises(NoRDMADevice, match="no RDMA device"):
        device_names(load_verbs("pyverbs"))
    kind, why = choose_transport(TransportKind.AUTO)
    assert kind is TransportKind.TCP and "no RDMA device" in why
    with pytest.raises(ConfigError, match="transport rdma: no RDMA device"):
        choose_transport(TransportKind.RDMA)


@pytest.mark.skipif(has_rdma_device(), reason="this host has an RDMA device")
def test_serve_with_transport_rdma_refuses_clearly_without_a_device() -> None:
    run = subprocess.run([sys.executable, "-m", "kvtier", "pool", "serve", "--listen", "127.0.0.1:0",
                          "--capacity", "4MiB", "--transport", "rdma"], check=False, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode != 0 and "no RDMA device" in run.stderr


@pytest.mark.parametrize("table,want", [
    ([GidEntry(1, 0, LL, GidType.ROCE_V1, True), GidEntry(1, 1, LL, GidType.ROCE_V2, True),
      GidEntry(1, 2, V4, GidType.ROCE_V1, True), GidEntry(1, 3, V4, GidType.ROCE_V2, True)], 3),
    ([GidEntry(1, 0, LL, GidType.ROCE_V2, True), GidEntry(1, 1, V6, GidType.ROCE_V2, True)], 1),
    ([GidEntry(1, 3, V4, GidType.ROCE_V2, False), GidEntry(2, 1, LL, GidType.ROCE_V2, True)], 1),
    ([GidEntry(1, 0, LL, GidType.IB, True)], 0),
    ([GidEntry(1, 0, ZERO, GidType.ROCE_V2, True), GidEntry(1, 1, V4, GidType.ROCE_V2, False)], None),
    ([], None),
], ids=["v2-ipv4-mapped", "v2-global-over-link-local", "active-port-only", "infiniband", "none-usable", "empty"])
def test_gid_selection(table, want) -> None:
    got = select_gid(table)
    assert (got.index if got else None) == want


@pytest.fixture
def fabric(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_FAKE_FABRIC", str(tmp_path))
    return load_verbs(FAKE_VERBS)


def test_fake_device_picks_the_roce_v2_ipv4_gid(fabric) -> None:
    dev = Device(fabric)
    assert dev.gid.gid_type is GidType.ROCE_V2 and dev.gid.index == 1


def test_fake_qp_state_machine_refuses_illegal_steps_and_changes_nothing(fabric) -> None:
    dev = Device(fabric)
    qp = QueuePair(dev)
    attr, mask = rts_attr(fabric, 1)
    with pytest.raises(fabric.Error):
        qp.qp.modify(attr, mask)  # RESET -> RTS
    assert qp.qp.qp_state == fake_verbs.IBV_QPS_RESET


def test_fake_one_sided_copy_between_two_connected_qps(fabric) -> None:
    dev = Device(fabric)
    a, b = QueuePair(dev), QueuePair(dev)
    a.connect(b.local_info())
    b.connect(a.local_info())
    src, dst = dev.register(64), dev.register(64)
    src_view = memoryview((fake_verbs.ctypes.c_char * 64).from_address(src.buf)).cast("B")
    src_view[:] = bytes(range(64))
    e = fabric.e
    wrs = [fabric.SendWR(wr_id=i, opcode=e.IBV_WR_RDMA_WRITE, sg=[fabric.SGE(src.buf + 32 * i, 32, src.lkey)],
                         send_flags=e.IBV_SEND_SIGNALED if i else 0) for i in range(2)]
    for i, wr in enumerate(wrs):
        wr.set_wr_rdma(dst.rkey, dst.buf + 32 * i)
    wrs[0].next_wr = wrs[1]
    a.qp.post_send(wrs[0])
    n, wcs = dev.cq.poll(16)
    assert n == 1 and wcs[0].wr_id == 1 and wcs[0].status == e.IBV_WC_SUCCESS  # selective signalling
    assert bytes((fake_verbs.ctypes.c_char * 64).from_address(dst.buf)) == bytes(range(64))
    bad = fabric.SendWR(wr_id=9, opcode=e.IBV_WR_RDMA_READ, sg=[fabric.SGE(src.buf, 64, src.lkey)])
    bad.set_wr_rdma(dst.rkey, dst.buf + 1)  # past the MR
    a.qp.post_send(bad)
    assert dev.cq.poll(16)[1][0].status == e.IBV_WC_REM_ACCESS_ERR  # an error always completes


@pytest.mark.rdma
def test_real_device_loopback_qp_reaches_rts() -> None:
    v = load_verbs("pyverbs")
    dev = Device(v)
    try:
        a, b = QueuePair(dev), QueuePair(dev)
        a.connect(b.local_info())
        b.connect(a.local_info())
        assert a.qp.qp_state == v.e.IBV_QPS_RTS
    finally:
        dev.close()


def test_every_verbs_constant_of_the_fake_has_the_value_real_pyverbs_gives_it() -> None:
    # The fake stands in for the device in most tests: an enum that drifted from rdma-core's
    # (a status, a state, a mask bit) would make it pass where the real device fails.
    real = load_verbs("pyverbs").e
    names = [n for n in dir(fake_verbs) if n.startswith("IBV_")]
    assert len(names) > 30
    assert {n: getattr(fake_verbs, n) for n in names} == {n: getattr(real, n) for n in names}


def test_a_gid_type_is_read_as_rdma_core_answers_it() -> None:
    # `ibv_query_gid_type` answers in `ibv_gid_type_sysfs` (RoCE v2 is 1), not `ibv_gid_type`
    # (RoCE v2 is 2): read the other way, every GID of the rxe guest was RoCE v1.
    from types import SimpleNamespace

    from kvtier.pool.verbs import _gid_type

    v = load_verbs("pyverbs")
    ethernet = SimpleNamespace(link_layer=v.e.IBV_LINK_LAYER_ETHERNET)
    assert _gid_type(v, v.e.IBV_GID_TYPE_SYSFS_ROCE_V2, ethernet) is GidType.ROCE_V2
    assert _gid_type(v, v.e.IBV_GID_TYPE_SYSFS_IB_ROCE_V1, ethernet) is GidType.ROCE_V1
    assert _gid_type(v, 1, SimpleNamespace(link_layer=v.e.IBV_LINK_LAYER_INFINIBAND)) is GidType.IB
