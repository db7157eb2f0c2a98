"""The Mooncake Store backend against a real `mooncake_master` subprocess (every port set here).

Also pins the facts of mooncake 0.3.13.post1 the backend relies on (put keeps, upsert replaces,
-704 for a missing key), and `MooncakeTier` shared by key between two tiers of one client. Cost:
about 45 s, most of it the failed-transfer test (with the master gone, calls after the first few
wait ~4 s each on Mooncake's reconnect, and `close()` ~15 s) and a second client process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("mooncake.store")

from kvtier.errors import TierIOError, TransferError  # noqa: E402
from kvtier.pool.mooncake import MooncakeClient, MooncakeTier, OBJECT_NOT_FOUND, Outcome  # noqa: E402
from kvtier.testing.mooncake_master import MasterProcess  # noqa: E402
from kvtier.tiers.base import SpanIO  # noqa: E402

pytestmark = pytest.mark.slow  # seconds per test here: kept out of `make test-fast`

SIZES = [1, 4096, 64 << 10, 1 << 20, 4 << 20]


@pytest.fixture(scope="module")
def master() -> Iterator[MasterProcess]:
    m = MasterProcess()
    yield m
    m.close()


def connect(master: MasterProcess, **kw) -> MooncakeClient:
    return MooncakeClient(master.address, master.metadata_server,
                          **kw)


@pytest.fixture(scope="module")
def client(master: MasterProcess) -> Iterator[MooncakeClient]:
    c = connect(master, segment_bytes=128 << 20, staging_bytes=32 << 20)
    yield c
    c.close()


@pytest.mark.parametrize("size", SIZES)
def test_round_trip_is_byte_identical(client: MooncakeClient, size: int) -> None:
    data = os.urandom(size)
    into = bytearray(size)
    assert client.put(b"rt%d" % size, data)
    assert client.get(b"rt%d" % size, into) and bytes(into) == data


def test_batches_larger_than_staging_are_split(client: MooncakeClient) -> None:
    blocks = [os.urandom(4 << 20) for _ in range(10)]  # 40 MiB through a 32 MiB staging region
    keys = [b"batch%d" % i for i in range(10)]
    assert client.batch_put(keys, blocks) == [True] * 10
    intos = [bytearray(4 << 20) for _ in range(10)]
    assert client.batch_get(keys, intos) == [True] * 10
    assert all(bytes(a) == b for a, b in zip(intos, blocks))


def test_upsert_overwrites(client: MooncakeClient) -> None:
    into = bytearray(1000)
    assert client.put(b"up", b"a" * 1000) and client.put(b"up", b"b" * 1000)
    assert client.get(b"up", into) and bytes(into) == b"b" * 1000


def test_store_facts_put_keeps_upsert_replaces(client: MooncakeClient) -> None:
    """The 0.3.13.post1 behaviour that makes the backend upsert: plain put keeps the old value."""
    store, base, name = client._store, client._base, "kvtier-facts/put"
    with client._lock:
        client._staging[:16] = 1
        assert store.batch_put_from([name], [base], [16]) == [0]
        client._staging[:16] = 2
        assert store.batch_put_from([name], [base], [16]) == [0]  # "succeeds"...
        assert store.batch_get_into([name, "kvtier-facts/none"], [base + 64, base + 128], [16, 16]) == \
            [16, OBJECT_NOT_FOUND]
        assert client._staging[64] == 1  # ...but kept the old bytes
        assert store.batch_upsert_from([name], [base], [16]) == [0]
        assert store.batch_get_into([name], [base + 64], [16]) == [16] and client._staging[64] == 2


def test_missing_key_is_a_miss_and_counted(client: MooncakeClient) -> None:
    before = client.counters.get("misses", 0)
    assert client.batch_get_outcomes([b"never-put"], [bytearray(8)]) == [Outcome.MISS]
    assert client.counters["misses"] == before + 1
    assert client.contains([b"never-put"]) == [False]


def test_corrupt_bytes_are_a_miss(client: MooncakeClient) -> None:
    assert client.put(b"corrupt", b"x" * 100)
    with client._lock:  # rewrite the object with a wrong trailer, behind the client's back
        client._staging[:108] = 7
        assert client._store.batch_upsert_from([client.key(b"corrupt")], [client._base], [108]) == [0]
    before = client.counters.get("checksum_errors", 0)
    assert client.batch_get_outcomes([b"corrupt"], [bytearray(100)]) == [Outcome.MISS]
    assert client.counters["checksum_errors"] == before + 1


def test_wrong_buffer_size_raises(client: MooncakeClient) -> None:
    assert client.put(b"sized", b"z" * 500)
    for n in (499, 501, 5000):
        with pytest.raises(ValueError, match="stored 500 bytes"):
            client.get(b"sized", bytearray(n))


def test_delete(client: MooncakeClient) -> None:
    assert client.put(b"gone", b"q" * 10)
    assert client.contains([b"gone"]) == [True]
    assert client.delete([b"gone", b"never"]) == 1
    assert client.contains([b"gone"]) == [False]


def test_failed_transfer_is_not_a_miss() -> None:
    """The master dies: a get is FAILED (counted as an error), never a miss or wrong bytes."""
    own = MasterProcess()
    try:
        c = connect(own)
        assert c.put(b"k", b"v" * 64)
        own.close()
        assert c.batch_get_outcomes([b"k"], [bytearray(64)]) == [Outcome.FAILED]
        assert c.put(b"k2", b"w" * 64) is False
        assert c.counters["get_errors"] == 1 and c.counters["put_errors"] == 1
        assert c.counters.get("misses", 0) == 0
        tier = MooncakeTier(c, 2 * 64, 64)  # the shared tier's view of a master that is gone:
        key = os.urandom(16)
        tier.bind(0, key)
        assert tier.find([key, os.urandom(16)]) == [False, False]  # absent, never raised
        with pytest.raises(TierIOError, match="mooncake answered failed"):
            tier.read(0, torch.empty(64, dtype=torch.uint8))
        c.close()
    finally:
        own.close()


def test_master_absent_fails_fast() -> None:
    with socket.socket() as held:  # bound, never listening: refuses connections, and no one else can take it
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(TransferError, match=f"mooncake master 127.0.0.1:{port}: not reachable"):
            MooncakeClient(f"127.0.0.1:{port}", f"http://127.0.0.1:{port}/metadata", setup_timeout_s=2)
    # The property is "no ~90 s hang in setup()"; the bound is loose so a loaded machine cannot fail it.
    assert time.monotonic() - started < 20


def test_silent_metadata_server_fails_within_timeout(master: MasterProcess) -> None:
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/metadata"
        started = time.monotonic()
        with pytest.raises(TransferError, match="no HTTP answer within 1"):
            MooncakeClient(master.address, url, setup_timeout_s=1)
        assert time.monotonic() - started < 20  # the probe's 1 s timeout, not setup()'s ~30-90 s wait


OTHER_PROCESS = r"""
import sys
from kvtier.pool.mooncake import MooncakeClient
master, meta, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
with MooncakeClient(master, meta, local_hostname="127.0.0.1") as c:  # its transfer engine binds a port itself
    into = bytearray(size)
    assert c.get(b"shared-by-a", into), c.counters
    assert c.put(b"shared-by-b", bytes(into[::-1]))
    assert c.contains([b"shared-by-b"]) == [True]
    sys.stdout.write(into.hex()[:32] + "\n")
"""


def test_two_processes_share_blocks(client: MooncakeClient, master: MasterProcess) -> None:
    data = os.urandom(256 << 10)
    assert client.put(b"shared-by-a", data)
    out = subprocess.run([sys.executable, "-c", OTHER_PROCESS, master.address, master.metadata_server,
                          str(len(data))], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == data.hex()[:32]
    # B's block may have lived in B's segment, which left with B: found means correct bytes
    into = bytearray(len(data))
    assert client.batch_get_outcomes([b"shared-by-b"], [into])[0] in (Outcome.HIT, Outcome.MISS)
    if client.contains([b"shared-by-b"]) == [True]:
        assert bytes(into) == data[::-1]


def test_tenants_are_apart(master: MasterProcess, client: MooncakeClient) -> None:
    assert client.put(b"tenant-key", b"t" * 32)
    with connect(master, tenant="other") as other:
        assert other.batch_get_outcomes([b"tenant-key"], [bytearray(32)]) == [Outcome.MISS]


# ---- the Tier contract, as tests/tiers/test_tier_contract.py states it, on MooncakeTier ------------

SLOT = 3 * 4096 + 1000


@pytest.fixture
def tier(client: MooncakeClient) -> Iterator[MooncakeTier]:
    t = MooncakeTier(client, 6 * SLOT, SLOT)
    yield t
    t.close()


def rand(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_tier_geometry(tier: MooncakeTier, client: MooncakeClient) -> None:
    assert (tier.num_slots, tier.slot_bytes, tier.capacity_bytes) == (6, SLOT, 6 * SLOT)
    assert MooncakeTier(client, 3 * SLOT + SLOT - 1, SLOT).num_slots == 3
    assert tier.describe()["backend"] == "mooncake" and tier.view(0, 0, 1) is None


def test_tier_whole_and_partial_round_trip(tier: MooncakeTier) -> None:
    blocks = [rand(SLOT, s) for s in range(6)]
    for s, b in enumerate(blocks):
        tier.write(s, b)
    patch = rand(777, 99)
    tier.write(2, patch, offset=5000)
    blocks[2][5000:5777] = patch
    for s, b in enumerate(blocks):
        out = torch.empty(SLOT, dtype=torch.uint8)
        tier.read(s, out)
        assert torch.equal(out, b)
    part = torch.empty(100, dtype=torch.uint8)
    tier.read(2, part, offset=4950)
    assert torch.equal(part, blocks[2][4950:5050])


def test_tier_layer_by_layer_write(tier: MooncakeTier) -> None:
    block, step = rand(SLOT, 7), 1000
    for at in range(0, SLOT, step):
        tier.write(4, block[at: at + step].clone(), offset=at)
    out = torch.empty(SLOT, dtype=torch.uint8)
    tier.read(4, out)
    assert torch.equal(out, block)


def test_tier_errors(tier: MooncakeTier) -> None:
    with pytest.raises(IndexError):
        tier.write(6, rand(10, 1))
    with pytest.raises(IndexError):
        tier.read(0, torch.empty(10, dtype=torch.uint8), offset=SLOT - 5)
    with pytest.raises(TypeError):
        tier.write(0, torch.zeros(4, dtype=torch.float32))
    with pytest.raises(TierIOError, match="holds no block"):
        tier.read(1, torch.empty(10, dtype=torch.uint8))
    tier.close()
    tier.close()
    with pytest.raises(TierIOError, match="closed"):
        tier.write(0, rand(10, 1))


class CountingStore:
    """The client's store with each call counted by name."""

    def __init__(self, store) -> None:
        self.store, self.calls = store, Counter()

    def __getattr__(self, name: str):
        inner = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return inner(*args, **kwargs)

        return counted


def test_tier_spans_cost_one_store_call_per_batch(client: MooncakeClient) -> None:
    """A batch of whole shared blocks is one batch_put_from and one batch_get_into; layer spans
    are gathered, then put in one call; parts read back take one get; a block the store dropped
    fails alone; private blocks batch too."""
    tier, slot = MooncakeTier(client, 8 * SLOT, SLOT), SLOT
    keys = [os.urandom(16) for _ in range(8)]
    data = torch.stack([rand(slot, 50 + i) for i in range(8)])
    out = torch.zeros_like(data)

    def io(t: torch.Tensor, keys, offset: int = 0, length: int = slot) -> SpanIO:
        return SpanIO(list(range(len(keys))), offset, length, [r.data_ptr() + offset for r in t], keys)

    counting = CountingStore(client._store)
    client._store = counting
    try:
        assert tier.write_spans(io(data, keys)) == {}
        assert counting.calls == {"batch_put_from": 1}
        assert tier.read_spans(io(out, keys)) == {} and torch.equal(out, data)
        assert counting.calls["batch_get_into"] == 1
        fresh, half = [os.urandom(16) for _ in range(8)], slot // 2
        counting.calls.clear()
        assert tier.write_spans(io(data, fresh, 0, half)) == {} and not counting.calls
        assert tier.write_spans(io(data, fresh, half, slot - half)) == {}
        assert counting.calls == {"batch_put_from": 1}
        out.zero_()
        assert tier.read_spans(io(out, fresh, 0, half)) == {}
        assert tier.read_spans(io(out, fresh, half, slot - half)) == {}
        assert torch.equal(out, data) and counting.calls["batch_get_into"] == 1
        assert client.delete([fresh[3]]) == 1
        out.zero_()
        failed = tier.read_spans(io(out, fresh))
        assert set(failed) == {3} and "mooncake answered miss" in str(failed[3]) and not out[3].any()
        private = [("private", i) for i in range(8)]
        counting.calls.clear()
        assert tier.write_spans(io(data, private)) == {}
        assert tier.read_spans(io(out, private)) == {} and torch.equal(out, data)
        assert counting.calls == {"batch_upsert_from": 1, "batch_get_into": 1}
    finally:
        client._store = counting.store
        tier.close()


def test_config_backend_builds_the_mooncake_tier(master: MasterProcess) -> None:
    from kvtier.config import PoolBackend, _tier
    from kvtier.errors import ConfigError
    from kvtier.pool.client.tier import build_pool_tier

    cfg = _tier("pool", {"capacity": "1MiB", "backend": "mooncake", "nodes": [master.address],
                         "metadata_server": master.metadata_server})
    assert cfg.backend is PoolBackend.MOONCAKE
    tier = build_pool_tier(cfg, 64 << 10)
    try:
        block = rand(64 << 10, 3)
        tier.write(0, block)
        out = torch.empty(64 << 10, dtype=torch.uint8)
        tier.read(0, out)
        assert torch.equal(out, block) and tier.num_slots == 16
    finally:
        tier.close()
    for raw, field in (({"backend": "memcached"}, "backend"), ({"backend": "mooncake"}, "metadata_server"),
                       ({"metadata_server": "http://x:1/metadata"}, "metadata_server")):
        with pytest.raises(ConfigError, match=f"tiers.pool.{field}"):
            _tier("pool", {"capacity": "1MiB", "nodes": [master.address], **raw})


# ---- MooncakeTier shared by key (two tiers on one client stand for two processes here; the
# ---- processes themselves are in test_pool_mooncake_shared.py) ---------------------------------


def shared_tier(client: MooncakeClient, **kw) -> MooncakeTier:
    return MooncakeTier(client, 4 * SLOT, SLOT, **kw)


def test_shared_block_is_gathered_then_put_once_and_found_by_another_tier(client: MooncakeClient) -> None:
    a, b = shared_tier(client), shared_tier(client)
    key, block = os.urandom(16), rand(SLOT, 11)
    puts = client.counters.get("puts", 0)
    a.bind(1, key)
    a.write(1, block[:5000].clone())
    a.write(1, block[5000:9000].clone(), offset=5000)
    assert client.counters.get("puts", 0) == puts and client.contains([key]) == [False]  # not whole yet
    a.write(1, block[9000:].clone(), offset=9000)
    assert client.counters["puts"] == puts + 1
    whole = bytearray(SLOT)  # one object under the key itself, the whole block, checked
    assert client.get(key, whole) and bytes(whole) == block.numpy().tobytes()
    assert b.find([key, os.urandom(16), "not-a-block-key", 7]) == [True, False, False, False]
    assert dict(b.stats.shared) == {"asked": 2, "found": 1}  # keys that cannot be shared are not asked
    hits = client.counters["hits"]
    b.bind(3, key)
    got = torch.empty(SLOT, dtype=torch.uint8)
    for at in range(0, SLOT, 4096):  # layer range by layer range: one get, the rest from its cache
        b.read(3, got[at: at + 4096], offset=at)
    assert torch.equal(got, block) and client.counters["hits"] == hits + 1
    a.close()
    b.close()


def test_a_block_known_held_is_not_sent_again(client: MooncakeClient) -> None:
    a, b = shared_tier(client), shared_tier(client)
    key, block = os.urandom(16), rand(SLOT, 12)
    a.bind(0, key)
    a.write(0, block)
    puts = client.counters["puts"]
    a.write(0, block)  # its own put: known held
    assert b.find([key]) == [True]
    b.bind(2, key)
    b.write(2, block)  # found by b: known held
    assert client.counters["puts"] == puts
    assert a.stats.shared["deduplicated"] == 1 and b.stats.shared["deduplicated"] == 1
    client.delete([key])  # the store dropped it: the next write asks, finds it gone, and puts again
    b.write(2, block)
    assert client.counters["puts"] == puts + 1 and b.stats.shared["deduplicated"] == 1
    a.close()
    b.close()


def test_a_shared_put_keeps_the_object_the_key_names(client: MooncakeClient) -> None:
    """`batch_put_from`, not an upsert: a reader elsewhere never sees a shared block replaced."""
    key, first, second = os.urandom(16), rand(SLOT, 13), rand(SLOT, 14)
    assert client.put(key, first)  # another process's block under the key
    tier = shared_tier(client)
    tier.bind(0, key)
    tier.write(0, second)  # not known held here: put, which keeps what is there
    got = torch.empty(SLOT, dtype=torch.uint8)
    tier.read(0, got)
    assert torch.equal(got, first)
    tier.close()


def test_misses_are_remembered_for_negative_cache_s(client: MooncakeClient) -> None:
    key = os.urandom(16)
    cached, uncached = shared_tier(client, negative_cache_s=60), shared_tier(client, negative_cache_s=0)
    for tier in (cached, uncached):
        assert tier.find([key]) == [False] and tier.find([key]) == [False]
    assert dict(cached.stats.shared) == {"asked": 1, "negative_cached": 1}
    assert dict(uncached.stats.shared) == {"asked": 2}
    assert client.put(key, rand(SLOT, 15))
    assert cached.find([key]) == [False] and uncached.find([key]) == [True]  # the cache answers till it expires
    cached.close()
    uncached.close()


def test_close_keeps_shared_blocks_and_drops_private_ones(client: MooncakeClient) -> None:
    tier = shared_tier(client)
    key = os.urandom(16)
    tier.bind(0, key)
    tier.write(0, rand(SLOT, 16))
    tier.bind(1, ("a", "tuple", "key"))  # not a BlockKey: private to this tier
    tier.write(1, rand(SLOT, 17))
    private = tier._private_key(1)
    assert client.contains([key, private]) == [True, True]
    tier.close()
    assert client.contains([key, private]) == [True, False]


def test_a_shared_block_not_in_the_store_is_a_miss(client: MooncakeClient) -> None:
    tier = shared_tier(client)
    tier.bind(0, os.urandom(16))
    with pytest.raises(TierIOError, match="mooncake answered miss"):
        tier.read(0, torch.empty(100, dtype=torch.uint8), offset=10)
    tier.close()


def test_sharing_off_keeps_block_keys_private(client: MooncakeClient) -> None:
    tier = shared_tier(client, shared=False)
    key, block = os.urandom(16), rand(SLOT, 18)
    tier.bind(0, key)
    tier.write(0, block)
    assert client.contains([key]) == [False] and tier.find([key]) == [False]
    got = torch.empty(SLOT, dtype=torch.uint8)
    tier.read(0, got)
    assert torch.equal(got, block) and not tier.stats.shared
    assert tier.describe()["sharing"] == "per process"
    tier.close()
