"""The runtime end to end on real tiers: CPU stand-in HBM, DRAM, SSD files on disk (cost: ~15 s).

Ordering is proved by gates, never by timing: a `GatedTier` wraps a real tier and holds reads or
writes of chosen layers until the test opens the gate, and counts every call.
"""

from __future__ import annotations

import errno
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.config import CacheMode, KVTierConfig, PrefetchConfig, TierConfig, TransferConfig
from kvtier.errors import TierIOError
from kvtier.moving.handle import Stage
from kvtier.model.layout import BlockLayout
from kvtier.runtime import KVTier
from kvtier.observing.stats import DropReason
from kvtier.tiers.base import Tier, TierKind
from kvtier.tiers.ssd import SSDTier

from support.runtime import BLOCK, D, GatedTier, H, LAYOUT, S, WAIT_S, blocks, load, runtime, store


















# ---- round trips ---------------------------------------------------------------------------


def test_blocks_spill_through_every_tier_and_come_back_identical(tmp_path):
    with runtime(tmp_path, marks=(0.95, 0.85)) as kv:
        keys = list(range(8))  # 2 + 3 + 6 slots, less the watermarks' headroom
        for k in keys:
            store(kv, [k])
        assert {kv.where([k])[0] for k in keys} == {H, D, S}, "every tier holds some"
        for used in kv.usage().values():
            assert used["used"] <= used["slots"]
        out, handle = load(kv, keys)
        assert handle.failed == {} and torch.equal(out, blocks(keys))
        snap = kv.snapshot()
        assert snap["hits"].keys() >= {"hbm", "dram", "ssd"} and snap["dropped"] == {}


def test_inclusive_mode_writes_through(tmp_path):
    with runtime(tmp_path, mode=CacheMode.INCLUSIVE) as kv:
        store(kv, [1])
        assert kv.usage() == {"hbm": {"used": 1, "slots": 2}, "dram": {"used": 1, "slots": 3},
                              "ssd": {"used": 1, "slots": 6}}
        store(kv, [2, 3])  # 1 leaves HBM: its lower copies stay, no demotion is needed
        assert kv.where([1]) == [D] and not any(kv.stats.demotions.values()), "a copy below exists: no demotion"
        out, handle = load(kv, [1, 2, 3])
        assert handle.failed == {} and torch.equal(out, blocks([1, 2, 3]))


def test_a_write_through_copy_that_fails_costs_that_copy_only(tmp_path, ssd):
    """Inclusive mode: the SSD's copy fails (a full disk); the block stands in HBM and DRAM, is
    not reported failed, and loads identical. (A transfer reports failures per block: before the
    write-through copies ran apart, the SSD's failure failed the block in every tier.)"""
    with runtime(tmp_path, ssd_tier=ssd, mode=CacheMode.INCLUSIVE) as kv:
        ssd.fail_writes = OSError(errno.ENOSPC, "No space left on device")
        handle = kv.store([1, 2], blocks([1, 2]))
        assert handle.wait(WAIT_S) and not handle.failed
        kv.quiesce(WAIT_S)
        assert kv.where([1, 2]) == [H, H] and kv.usage()["ssd"]["used"] == 0
        snap = kv.snapshot()
        assert snap["dropped"] == {} and snap["stores"] == {"hbm": 2, "dram": 2}
        out, handle = load(kv, [1, 2])
        assert handle.failed == {} and torch.equal(out, blocks([1, 2]))


def test_missing_blocks_are_reported_not_served(tmp_path):
    with runtime(tmp_path) as kv:
        store(kv, [1])
        out, handle = load(kv, [1, 99])
        assert set(handle.failed) == {99} and torch.equal(out[0], blocks([1])[0])
        assert kv.lookup([1, 99, 1]) == 1


# ---- layer-wise loading and in-flight sharing ------------------------------------------------


class ThreadRecordingTier(GatedTier):
    """A GatedTier that notes which thread ran each read and write."""

    def __init__(self, inner: Tier) -> None:
        super().__init__(inner)
        self.threads: set[str] = set()

    def read(self, slot, dst, offset=0):
        self.threads.add(threading.current_thread().name)
        super().read(slot, dst, offset)

    def write(self, slot, src, offset=0):
        self.threads.add(threading.current_thread().name)
        super().write(slot, src, offset)


def test_sync_store_and_load_run_in_the_callers_thread_and_are_done_on_return(tmp_path):
    (tmp_path / "ssd-rec").mkdir()
    disk = ThreadRecordingTier(SSDTier(tmp_path / "ssd-rec", 6 * BLOCK, BLOCK, num_files=2))
    with runtime(tmp_path, ssd_tier=disk, hbm=0, dram=0, promote_to=None) as kv:
        keys = [1, 2, 3]
        stored = kv.store(keys, blocks(keys), sync=True)
        assert stored.done() and stored.wait(0) and kv.where(keys) == [S] * 3
        out = torch.zeros(4, BLOCK, dtype=torch.uint8)
        loaded = kv.load(keys + [9], out, sync=True)
        assert loaded.done() and set(loaded.failed) == {9} and torch.equal(out[:3], blocks(keys))
        # every read but the batch's last ran on an I/O worker, in flight together; the last, and
        # at queue depth 1 each, in this thread: no job hand-off either way
        assert threading.current_thread().name in disk.threads
        assert not {t for t in disk.threads if t.startswith("kvtier-job") or t.startswith("kvtier-bg-job")}
        one = torch.zeros(1, BLOCK, dtype=torch.uint8)
        disk.threads.clear()
        assert kv.load([2], one, sync=True).wait(0) and torch.equal(one[0], blocks([2])[0])
        assert disk.threads == {threading.current_thread().name}
        with pytest.raises(ValueError, match="background and sync"):
            kv.store([4], blocks([4]), background=True, sync=True)


@pytest.mark.parametrize("sync", [True, False])
def test_a_route_that_raises_fails_its_blocks_and_never_hangs_a_waiter(tmp_path, sync):
    """A bug in a route (here a TypeError) fails every block of its transfer, with the error in
    each failure; the plan is still completed, so the caller's handle finishes and the slots the
    store claimed are free again."""
    from kvtier.moving.copies import Route
    from kvtier.tiers.base import Medium

    def broken(batch):
        raise TypeError("injected: a route bug")

    with runtime(tmp_path, hbm=0, ssd=0, promote_to=None) as kv:
        kv.engine.add_route(Medium.HOST, Medium.HOST, Route(broken))
        keys = [1, 2]
        stored = kv.store(keys, blocks(keys), sync=sync)
        assert not stored.wait(WAIT_S)  # finished (a TimeoutError otherwise), with failures
        assert set(stored.failed) == set(keys)
        assert all("injected: a route bug" in f.error for f in stored.failed.values())
        assert kv.where(keys) == [None, None] and kv.manager.stats.dropped[DropReason.STORE_FAILED] == 2
        out = torch.zeros(2, BLOCK, dtype=torch.uint8)
        loaded = kv.load(keys, out, sync=sync)
        assert not loaded.wait(WAIT_S) and set(loaded.failed) == set(keys)


def test_a_sync_load_still_verifies_every_checksum(tmp_path):
    with runtime(tmp_path, hbm=0, dram=0, promote_to=None) as kv:
        store(kv, [5])
        tier = kv.tiers[S]
        slot = kv.manager.index.get(5).copies[S].slot
        tier.write(slot, torch.full((16,), 7, dtype=torch.uint8), offset=0)  # 16 bytes of layer 0 flipped
        out = torch.zeros(1, BLOCK, dtype=torch.uint8)
        handle = kv.load([5], out, sync=True)
        assert handle.done() and handle.failed[5].stage == Stage.VERIFY and kv.where([5]) == [None]


@pytest.mark.parametrize("promote_to", [None, D], ids=["direct", "via-promotion"])
def test_layer_zero_is_usable_before_the_last_layer_lands(tmp_path, ssd, promote_to):
    with runtime(tmp_path, ssd_tier=ssd, promote_to=promote_to) as kv:
        store(kv, [7], target=S)
        ssd.read_gate.clear()  # reads of layers >= 1 wait for the test
        out = torch.zeros(1, BLOCK, dtype=torch.uint8)
        handle = kv.load([7], out)
        handle.wait_layer(0, WAIT_S)
        first = LAYOUT.layer_bytes[0]
        assert handle.layers_done == 1 and not handle.done(), "later layers are still held at the gate"
        assert torch.equal(out[0, :first], blocks([7])[0, :first]), "layer 0 is in place"
        assert not torch.equal(out[0, first:], blocks([7])[0, first:])
        ssd.read_gate.set()
        assert handle.wait(WAIT_S) and torch.equal(out, blocks([7]))


def test_chunked_copies_report_each_layer_as_its_run_lands(tmp_path, ssd):
    two_layers = LAYOUT.offsets[2]
    ssd.gate_from = two_layers  # reads of layers 2-3 wait; layers 0-1 travel as one run
    with runtime(tmp_path, ssd_tier=ssd, promote_to=None, chunk_bytes=two_layers) as kv:
        store(kv, [7], target=S)
        ssd.reads.clear()
        ssd.read_gate.clear()
        out = torch.zeros(1, BLOCK, dtype=torch.uint8)
        handle = kv.load([7], out)
        handle.wait_layer(1, WAIT_S)
        assert handle.layers_done == 2 and not handle.done()
        assert torch.equal(out[0, :two_layers], blocks([7])[0, :two_layers])
        ssd.read_gate.set()
        assert handle.wait(WAIT_S) and torch.equal(out, blocks([7]))
        assert ssd.reads == [(ssd.reads[0][0], 0), (ssd.reads[0][0], two_layers)], "two reads of two layers"


def test_concurrent_loads_of_a_block_share_one_read(tmp_path, ssd):
    with runtime(tmp_path, ssd_tier=ssd) as kv:
        store(kv, [5], target=S)
        ssd.reads.clear()
        ssd.read_gate.clear()
        outs = [torch.zeros(1, BLOCK, dtype=torch.uint8) for _ in range(3)]
        handles = [kv.load([5], o) for o in outs]
        ssd.read_gate.set()
        assert all(h.wait(WAIT_S) for h in handles)
        assert all(torch.equal(o, blocks([5])) for o in outs)
        assert len(ssd.reads) == LAYOUT.num_layers, "one read per layer, not one per load"
        assert kv.stats.promotions[(S, D)] == 1


def test_load_waits_for_prefetch_in_flight_instead_of_reading_again(tmp_path, ssd):
    with runtime(tmp_path, ssd_tier=ssd) as kv:
        store(kv, [1, 2], target=S)
        ssd.reads.clear()
        ssd.read_gate.clear()
        prefetch = kv.prefetch([1, 2], budget_bytes=BLOCK)  # budget: one block
        assert [m.key for m in prefetch.moves] == [1]
        out, _ = torch.zeros(1, BLOCK, dtype=torch.uint8), None
        handle = kv.load([1], out)
        ssd.read_gate.set()
        assert handle.wait(WAIT_S) and torch.equal(out, blocks([1]))
        assert len(ssd.reads) == LAYOUT.num_layers and kv.stats.prefetch_used == 1
        assert kv.where([1, 2]) == [D, S]


def test_cancelled_prefetch_leaves_blocks_where_they_were(tmp_path, ssd):
    with runtime(tmp_path, ssd_tier=ssd) as kv:
        store(kv, [1, 2], target=S)
        ssd.read_gate.clear()
        prefetch = kv.prefetch([1, 2])
        prefetch.cancel()
        ssd.read_gate.set()
        assert prefetch.wait(WAIT_S) is False
        kv.quiesce(WAIT_S)
        assert kv.where([1, 2]) == [S, S] and kv.usage()["dram"]["used"] == 0
        assert kv.stats.prefetch_cancelled == 2
        out, handle = load(kv, [1, 2])
        assert handle.failed == {} and torch.equal(out, blocks([1, 2]))


def test_prefetch_never_evicts_pinned_blocks(tmp_path):
    with runtime(tmp_path, dram=2) as kv:
        store(kv, [1, 2], target=D)
        store(kv, [3, 4], target=S)
        assert kv.pin([1, 2]) == [1, 2]
        prefetch = kv.prefetch([3, 4])
        prefetch.wait(WAIT_S)
        assert kv.where([1, 2, 3, 4]) == [D, D, S, S]
        kv.unpin([1, 2])
        first = kv.prefetch([3, 4])  # DRAM is full: both LRU blocks are demoted to make room
        assert first.moves and all(m.reason.value == "demote" for m in first.moves)
        kv.quiesce(WAIT_S)
        kv.prefetch([3, 4]).wait(WAIT_S)  # the room is there now
        kv.quiesce(WAIT_S)
        assert kv.where([1, 2, 3, 4]) == [S, S, D, D]


def test_block_being_written_is_not_served(tmp_path, ssd):
    with runtime(tmp_path, ssd_tier=ssd) as kv:
        ssd.write_gate.clear()
        handle = kv.store([9], blocks([9]), target=S)
        assert kv.lookup([9]) == 0
        _, miss = load(kv, [9])
        assert 9 in miss.failed
        ssd.write_gate.set()
        assert handle.wait(WAIT_S) and kv.lookup([9]) == 1


# ---- integrity and failures --------------------------------------------------------------------


def test_corrupted_block_is_a_counted_miss_never_data(tmp_path, ssd):
    with runtime(tmp_path, ssd_tier=ssd, promote_to=None) as kv:
        store(kv, [3], target=S)
        slot = kv.manager.index.get(3).copies[S].slot
        ssd.inner.write(slot, torch.full((16,), 0xAB, dtype=torch.uint8), offset=LAYOUT.offsets[2] + 100)
        _, handle = load(kv, [3])
        assert handle.failed[3].stage == Stage.VERIFY and handle.failed[3].layer == 2
        assert kv.stats.checksum_errors == 1 and kv.stats.dropped[DropReason.CHECKSUM] == 1
        assert kv.lookup([3]) == 0 and kv.usage()["ssd"]["used"] == 0


def test_truncated_ssd_file_is_a_counted_miss(tmp_path):
    with runtime(tmp_path, promote_to=None) as kv:
        store(kv, [3], target=S)
        for path in kv.tiers[S].paths:
            with open(path, "r+b") as f:
                f.truncate(0)
        _, handle = load(kv, [3])
        assert handle.failed[3].stage == Stage.READ
        assert kv.stats.io_errors == 1 and kv.stats.dropped[DropReason.READ_FAILED] == 1


def test_full_disk_during_demotion_drops_with_reason_and_keeps_serving(tmp_path, ssd):
    with runtime(tmp_path, ssd_tier=ssd, hbm=1, dram=1) as kv:
        ssd.fail_writes = OSError(errno.ENOSPC, "No space left on device")
        for k in range(5):
            kv.store([k], blocks([k])).wait(WAIT_S)
            kv.quiesce(WAIT_S)
        assert kv.stats.dropped[DropReason.DEMOTION_FAILED] >= 1
        failed_writes = kv.stats.dropped[DropReason.DEMOTION_FAILED] + kv.stats.dropped[DropReason.STORE_FAILED]
        assert kv.stats.io_errors == failed_writes, "every failed write is counted, and costs only its block"
        alive = [k for k in range(5) if kv.where([k])[0] is not None]
        assert alive, "the runtime keeps serving from the tiers that work"
        out, handle = load(kv, alive)
        assert handle.failed == {} and torch.equal(out, blocks(alive))
        ssd.fail_writes = None
        store(kv, [10, 11, 12])
        assert kv.lookup([10, 11, 12]) == 3


def test_a_sync_store_into_a_full_disk_returns_its_failure_counted(tmp_path, ssd):
    # A sync store runs in the caller's thread: a full disk must come back as failed blocks in the
    # returned handle, each counted, never as an exception or a hang, and the runtime serves on.
    with runtime(tmp_path, ssd_tier=ssd, hbm=0, dram=2, promote_to=None) as kv:
        ssd.fail_writes = OSError(errno.ENOSPC, "No space left on device")
        handle = kv.store([1, 2], blocks([1, 2]), target=S, sync=True)
        assert handle.done() and set(handle.failed) == {1, 2} and handle.failed[1].stage == Stage.WRITE
        assert kv.stats.io_errors == 2 and kv.where([1, 2]) == [None, None]
        assert kv.store([3], blocks([3]), target=D, sync=True).wait(0) and kv.where([3]) == [D]
        ssd.fail_writes = None
        assert kv.store([4], blocks([4]), target=S, sync=True).wait(0) and kv.where([4]) == [S]


def test_store_with_no_room_anywhere_is_counted(tmp_path):
    with runtime(tmp_path, hbm=1, dram=1, ssd=1) as kv:
        assert kv.pin([]) == []
        store(kv, [1, 2, 3])
        kv.pin([1, 2, 3])
        handle = kv.store([4], blocks([4]))
        assert handle.wait(WAIT_S) is False and handle.failed[4].stage == Stage.WRITE
        assert kv.stats.dropped[DropReason.NO_SPACE] == 1


# ---- bad input --------------------------------------------------------------------------------


def test_bad_buffers_raise_clear_errors(tmp_path):
    with runtime(tmp_path) as kv:
        with pytest.raises(ValueError, match="2 blocks for 1 keys"):
            kv.store([1], blocks([1, 2]))
        with pytest.raises(ValueError, match=f"{BLOCK} bytes"):
            kv.store([1], torch.zeros(1, BLOCK - 1, dtype=torch.uint8))
        with pytest.raises(ValueError, match="uint8"):
            kv.load([1], torch.zeros(1, BLOCK // 2, dtype=torch.float16))
        with pytest.raises(ValueError, match="duplicate"):
            kv.store([1, 1], blocks([1, 2]))


# ---- random operation sequences on real tiers ------------------------------------------------

OPS = st.lists(st.tuples(st.sampled_from(["store", "load", "prefetch", "pin", "unpin"]),
                         st.lists(st.integers(0, 9), min_size=1, max_size=4, unique=True)),
               min_size=1, max_size=25)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, mode=st.sampled_from(list(CacheMode)), inline=st.booleans())
def test_random_operations_never_serve_wrong_bytes_or_exceed_capacity(tmp_path, ops, mode, inline):
    pins: dict[int, int] = {}
    with runtime(tmp_path, mode=mode, inline_bytes=4 * BLOCK if inline else 0) as kv:
        for op, keys in ops:
            if op == "store":
                kv.store(keys, blocks(keys)).wait(WAIT_S)
            elif op == "load":
                out, handle = load(kv, keys)
                for i, k in enumerate(keys):
                    if k not in handle.failed:
                        assert torch.equal(out[i], blocks([k])[0]), f"block {k} came back different"
            elif op == "prefetch":
                kv.prefetch(keys).wait(WAIT_S)
            elif op == "pin":
                for k in keys:
                    if kv.pin([k]):
                        pins[k] = pins.get(k, 0) + 1
            elif pins:
                k = next(iter(pins))
                kv.unpin([k])
                pins[k] -= 1
                pins = {a: b for a, b in pins.items() if b}
            for used in kv.usage().values():
                assert used["used"] <= used["slots"]
        kv.quiesce(WAIT_S)
        for k in pins:
            assert kv.where([k])[0] is not None, "a pinned block was evicted"
        assert kv.stats.checksum_errors == 0 and kv.stats.io_errors == 0


# ---- the transfer engine: small host-memory batches in the caller's thread ----------------------


def test_small_host_memory_batches_run_inline_the_rest_on_workers(tmp_path):
    from kvtier.tiers.dram import DRAMTier
    from kvtier.moving.engine import CopyOp, Endpoint, TransferEngine

    engine = TransferEngine(LAYOUT, inline_bytes=2 * BLOCK)
    dram = DRAMTier(4 * BLOCK, BLOCK)
    (tmp_path / "ssd").mkdir()
    gated = GatedTier(SSDTier(tmp_path / "ssd", 4 * BLOCK, BLOCK, num_files=1), gate_layer=0)
    data = blocks([1, 2, 3])
    ran_in: list[int] = []

    def copies(tier, n):
        return [CopyOp(k, Endpoint(buffer=data[i]), Endpoint(tier, i)) for i, k in enumerate([1, 2, 3][:n])]

    def submit(ops):
        return engine.submit(ops, lambda h: ran_in.append(threading.get_ident()))

    try:
        handle = submit(copies(dram, 2))  # within inline_bytes, memory to memory: done on return
        assert handle.done() and handle.failed == {} and ran_in == [threading.get_ident()]
        assert torch.equal(dram.view(1, 0, BLOCK), data[1])
        handle = submit(copies(dram, 3))  # over inline_bytes: a worker
        assert handle.wait(WAIT_S) and ran_in[-1] != threading.get_ident()
        gated.write_gate.clear()  # a disk end goes to a worker however small: this call must not block
        handle = submit(copies(gated, 1))
        assert not handle.done()
        gated.write_gate.set()
        assert handle.wait(WAIT_S) and ran_in[-1] != threading.get_ident()
    finally:
        gated.close()
        engine.close()
        dram.close()
