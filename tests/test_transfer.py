"""The transfer engine's route table: a copy takes the entry for its (source, destination) media,
a new medium is an entry away, and a pair without one is refused (cost: ~1 s).

The new medium is a tape: a real tier of host bytes without views, so that every copy to or from
it goes through its route, and counts its calls.
"""

from __future__ import annotations

import enum
import threading

import pytest
import torch

from kvtier.errors import TransferError
from kvtier.moving.handle import Stage
from kvtier.tiers.base import Medium, Tier, TierKind
from kvtier.moving.engine import CopyOp, Endpoint, Route, StageError, TransferEngine, layer_checksum, block_seed

from support.runtime import BLOCK, LAYOUT, WAIT_S, blocks


class Tape(enum.Enum):
    TAPE = "tape"


class TapeTier(Tier):
    """Slots of host bytes with no `view`: reads and writes only, each recorded (after its `bind`)."""

    kind = TierKind.SSD
    medium = Tape.TAPE

    def __init__(self, num_slots: int, shared: bool = False) -> None:
        self.slot_bytes, self.num_slots, self.shared = BLOCK, num_slots, shared
        self.data = torch.zeros(num_slots, BLOCK, dtype=torch.uint8)
        self.calls: list[tuple] = []
        self._lock = threading.Lock()

    def bind(self, slot, key):
        with self._lock:
            self.calls.append(("bind", slot, key))

    def read(self, slot, dst, offset=0):
        with self._lock:
            self.calls.append(("read", slot, offset))
        dst.copy_(self.data[slot, offset: offset + dst.numel()])

    def write(self, slot, src, offset=0):
        with self._lock:
            self.calls.append(("write", slot, offset))
        self.data[slot, offset: offset + src.numel()] = src


@pytest.fixture
def engine():
    engine = TransferEngine(LAYOUT, io_workers=2)
    yield engine
    engine.close()


def _sums(key, block):
    return [layer_checksum(block[LAYOUT.offsets[l]: LAYOUT.offsets[l + 1]], block_seed(key), l)
            for l in range(LAYOUT.num_layers)]


def test_a_new_medium_is_one_entry_per_direction_and_keeps_checksums_and_binds(engine):
    tape = TapeTier(2, shared=True)
    engine.add_route(Tape.TAPE, Medium.HOST, engine.routes[Medium.DISK, Medium.HOST])  # as a disk is read
    engine.add_route(Medium.HOST, Tape.TAPE, engine.routes[Medium.HOST, Medium.DISK])
    data = blocks([7])
    stored = engine.submit([CopyOp(7, Endpoint(buffer=data[0]), Endpoint(tape, 1), checksum=True)])
    assert stored.wait(WAIT_S) and stored.failed == {}
    assert torch.equal(tape.data[1], data[0]) and stored.checksums[7] == _sums(7, data[0])
    out = torch.zeros(BLOCK, dtype=torch.uint8)
    loaded = engine.submit([CopyOp(7, Endpoint(tape, 1), Endpoint(buffer=out), verify=tuple(stored.checksums[7]))])
    assert loaded.wait(WAIT_S) and loaded.failed == {} and torch.equal(out, data[0])
    per_layer = [(op, 1, LAYOUT.offsets[l]) for op in ("write", "read") for l in range(LAYOUT.num_layers)]
    assert tape.calls == [c for op, slot, off in per_layer for c in (("bind", slot, 7), (op, slot, off))], \
        "a shared tier is told the key before each read and write"
    assert engine.stats.bytes_moved[("buffer:cpu", "ssd")] == engine.stats.bytes_moved[("ssd", "buffer:cpu")] == BLOCK


def test_a_read_through_a_new_route_is_still_verified_before_delivery(engine):
    tape = TapeTier(1)
    engine.add_route(Tape.TAPE, Medium.HOST, engine.routes[Medium.DISK, Medium.HOST])
    data = blocks([3])
    tape.data[0] = data[0]
    tape.data[0, LAYOUT.offsets[2]] ^= 0xFF  # one bit of layer 2 flipped
    out = torch.zeros(BLOCK, dtype=torch.uint8)
    handle = engine.submit([CopyOp(3, Endpoint(tape, 0), Endpoint(buffer=out), verify=tuple(_sums(3, data[0])))])
    handle.wait(WAIT_S)
    assert handle.failed[3].stage == Stage.VERIFY and handle.failed[3].layer == 2


def test_an_entry_is_the_function_every_copy_between_its_media_runs(engine):
    tape = TapeTier(2)
    spans: list[tuple] = []

    def copy(op, first, last, ready):
        spans.append((op.key, first, last, ready))
        offset, length = LAYOUT.offsets[first], LAYOUT.offsets[last + 1] - LAYOUT.offsets[first]
        tape.read(op.src.slot, op.dst.view(offset, length), offset)
        return [first * 100 + op.key]

    engine.add_route(Tape.TAPE, Medium.HOST, Route.per_block(copy, io=True))
    tape.data[:] = blocks([0, 1])
    out = torch.zeros(2, BLOCK, dtype=torch.uint8)
    handle = engine.submit([CopyOp(k, Endpoint(tape, k), Endpoint(buffer=out[k])) for k in (0, 1)])
    assert handle.wait(WAIT_S) and torch.equal(out, blocks([0, 1]))
    assert sorted(spans) == sorted((k, l, l, None) for k in (0, 1) for l in range(LAYOUT.num_layers))
    assert handle.checksums == {k: [l * 100 + k for l in range(LAYOUT.num_layers)] for k in (0, 1)}


def test_a_route_gets_every_block_of_a_span_in_one_call(engine):
    """A batched route is called once per layer span with the whole batch; its per-block failures
    and checksums reach the handle by index, and the other blocks land."""
    tape = TapeTier(3)
    calls: list[tuple] = []

    def run(batch):
        calls.append(([op.key for op in batch.ops], batch.first, batch.last, batch.offset, batch.length))
        for i, op in enumerate(batch.ops):
            if op.key == 1:
                batch.fail(i, StageError(Stage.READ, OSError(5, "bad sector"), batch.first))
                continue
            tape.read(op.src.slot, op.dst.view(batch.offset, batch.length), batch.offset)
            batch.checksums[i] = [op.key] * (batch.last - batch.first + 1)

    engine.add_route(Tape.TAPE, Medium.HOST, Route(run, io=True))
    tape.data[:] = blocks([0, 1, 2])
    out = torch.zeros(3, BLOCK, dtype=torch.uint8)
    handle = engine.submit([CopyOp(k, Endpoint(tape, k), Endpoint(buffer=out[k])) for k in (0, 1, 2)])
    assert not handle.wait(WAIT_S)
    assert calls[0] == ([0, 1, 2], 0, 0, 0, LAYOUT.layer_bytes[0]), "the first span: every block, one call"
    assert [c[0] for c in calls[1:]] == [[0, 2]] * (LAYOUT.num_layers - 1), "a failed block is not copied again"
    assert set(handle.failed) == {1} and handle.failed[1].stage == Stage.READ and "bad sector" in handle.failed[1].error
    assert torch.equal(out[0], blocks([0])[0]) and torch.equal(out[2], blocks([2])[0])
    assert handle.checksums == {0: [0] * LAYOUT.num_layers, 2: [2] * LAYOUT.num_layers}


def test_a_copy_between_media_without_a_route_is_refused_naming_both(engine):
    tape = TapeTier(1)
    out = torch.zeros(BLOCK, dtype=torch.uint8)
    ok = CopyOp(1, Endpoint(buffer=blocks([1])[0]), Endpoint(buffer=out))
    with pytest.raises(TransferError, match=r"Tape\.TAPE.*Medium\.HOST"):
        engine.submit([ok, CopyOp(2, Endpoint(tape, 0), Endpoint(buffer=out))])
    with pytest.raises(TransferError, match=r"Medium\.HOST.*Tape\.TAPE"):
        engine.run_now([CopyOp(2, Endpoint(buffer=out), Endpoint(tape, 0))], handle=None)
    assert tape.calls == [] and not out.any(), "nothing of a refused batch runs"
    assert engine.submit([ok]).wait(WAIT_S) and torch.equal(out, blocks([1])[0])


def test_add_route_takes_enum_media_and_a_route(engine):
    route = engine.routes[Medium.HOST, Medium.HOST]
    with pytest.raises(TypeError, match="enum"):
        engine.add_route("tape", Medium.HOST, route)
    with pytest.raises(TypeError, match="Route"):
        engine.add_route(Tape.TAPE, Medium.HOST, route.run)
    assert (Tape.TAPE, Medium.HOST) not in engine.routes


@pytest.mark.parametrize("chunk_bytes", [0, 2 * 4096], ids=["per-layer", "two-layer-spans"])
def test_a_copy_after_a_failed_move_gets_only_the_layers_that_move_put_in_place(chunk_bytes):
    # A load that reads a block through its promotion (`CopyOp.after`) may start after the move
    # already failed: it must still deliver the layers the move landed, and never one it did not.
    # With spans of two layers, a checksum failure in layer 3 fails the whole span 2-3: the
    # route checks a span before writing any of it.
    engine = TransferEngine(LAYOUT, io_workers=2, chunk_bytes=chunk_bytes)
    try:
        tape = TapeTier(1)
        engine.add_route(Tape.TAPE, Medium.HOST, engine.routes[Medium.DISK, Medium.HOST])
        data = blocks([3])
        tape.data[0] = data[0]
        tape.data[0, LAYOUT.offsets[3]] ^= 0xFF  # one bit of layer 3 flipped
        landed = torch.zeros(BLOCK, dtype=torch.uint8)
        move = engine.submit([CopyOp(3, Endpoint(tape, 0), Endpoint(buffer=landed), verify=tuple(_sums(3, data[0])))])
        move.wait(WAIT_S)
        first_bad = 3 if chunk_bytes == 0 else 2
        assert move.failed[3].stage == Stage.VERIFY and move.failed[3].layer == first_bad
        out = torch.zeros(BLOCK, dtype=torch.uint8)
        load = engine.submit([CopyOp(3, Endpoint(buffer=landed), Endpoint(buffer=out), after=move)])
        load.wait(WAIT_S)
        assert load.failed[3].stage == Stage.DEPENDENCY and load.failed[3].layer == first_bad
        good = LAYOUT.offsets[first_bad]
        assert torch.equal(out[:good], data[0, :good]) and not out[good:].any()
    finally:
        engine.close()


@pytest.mark.parametrize("fault", ["corrupt", "unreadable"])
def test_a_source_that_fails_mid_block_is_read_from_its_fallback_before_the_layer_is_reported(engine, fault):
    """Issue 29, finding 7: a copy may carry a fallback (the block's copy in another tier). Where
    its source fails a layer's check or read, that layer and the rest come from the fallback, still
    checked, and the block is delivered (`handle.fell_back`, not `handle.failed`)."""
    engine.add_route(Tape.TAPE, Medium.HOST, engine.routes[Medium.DISK, Medium.HOST])
    source, other = TapeTier(1), TapeTier(1)
    good = blocks([5])[0]
    source.data[0], other.data[0] = good, good
    at = LAYOUT.offsets[2]
    if fault == "corrupt":
        source.data[0, at] ^= 0xFF
    else:
        def read(slot, dst, offset=0, inner=source.read):
            if offset >= at:
                raise OSError(5, "injected: the node is gone")
            inner(slot, dst, offset)
        source.read = read
    out = torch.zeros(BLOCK, dtype=torch.uint8)
    sums = tuple(_sums(5, good))
    fallback = CopyOp(5, Endpoint(other, 0), Endpoint(buffer=out), verify=sums)
    handle = engine.submit([CopyOp(5, Endpoint(source, 0), Endpoint(buffer=out), verify=sums, fallback=fallback)])
    assert handle.wait(WAIT_S) and handle.failed == {} and torch.equal(out, good), "never wrong, never partial"
    assert handle.fell_back[5].stage == (Stage.VERIFY if fault == "corrupt" else Stage.READ)
    assert handle.fell_back[5].layer == 2
    assert [c[2] for c in other.calls if c[0] == "read"] == list(LAYOUT.offsets[2:-1]), "the rest from the fallback"


def test_a_block_whose_fallback_fails_too_is_failed(engine):
    engine.add_route(Tape.TAPE, Medium.HOST, engine.routes[Medium.DISK, Medium.HOST])
    source, other = TapeTier(1), TapeTier(1)  # both hold zeros, not the block
    out = torch.zeros(BLOCK, dtype=torch.uint8)
    sums = tuple(_sums(5, blocks([5])[0]))
    fallback = CopyOp(5, Endpoint(other, 0), Endpoint(buffer=out), verify=sums)
    handle = engine.submit([CopyOp(5, Endpoint(source, 0), Endpoint(buffer=out), verify=sums, fallback=fallback)])
    assert not handle.wait(WAIT_S) and handle.failed[5].stage == Stage.VERIFY and 5 in handle.fell_back


def test_a_relay_between_two_disks_is_checked_and_keeps_going_past_a_bad_block(engine, tmp_path):
    """Disk → disk (a demotion from the pool to the SSD takes the same route): every block read
    into staging in one batch, checked, and written to the other disk in one batch; a block whose
    bytes fail their check is failed (VERIFY, naming the layer) and not written, the others land
    with their checksums."""
    from kvtier.tiers.ssd import SSDTier

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    src = SSDTier(tmp_path / "a", 4 * BLOCK, BLOCK, num_files=2)
    dst = SSDTier(tmp_path / "b", 4 * BLOCK, BLOCK, num_files=2)
    try:
        data = blocks([0, 1, 2])
        for k in range(3):
            src.write(k, data[k])
        sums = {k: tuple(_sums(k, data[k])) for k in range(3)}
        bad = list(sums[1])
        bad[2] ^= 1
        ops = [CopyOp(k, Endpoint(src, k), Endpoint(dst, 3 - k), verify=sums[k] if k != 1 else tuple(bad),
                      checksum=True) for k in range(3)]
        handle = engine.submit(ops)
        assert not handle.wait(WAIT_S)
        assert set(handle.failed) == {1} and handle.failed[1].stage == Stage.VERIFY and "layer 2" in handle.failed[1].error
        out = torch.empty(BLOCK, dtype=torch.uint8)
        for k in (0, 2):
            dst.read(3 - k, out)
            assert torch.equal(out, data[k]) and tuple(handle.checksums[k]) == sums[k]
        dst.read(2, out)
        assert not out[LAYOUT.offsets[2]:].any(), "from the layer that failed its check on, nothing was written"
    finally:
        src.close()
        dst.close()


def test_a_mixed_batch_takes_each_ops_route_and_counts_bytes_per_pair_of_ends(engine):
    """One batch whose copies go to two tiers from two buffers (a store that spilled past a full
    tier): each copy takes its own pair's route, lands, and the bytes are counted under each pair
    of names (two CPU buffers are one `buffer:cpu`)."""
    from kvtier.tiers.dram import DRAMTier

    dram = DRAMTier(4 * BLOCK, BLOCK)
    tape = TapeTier(4)
    engine.add_route(Medium.HOST, Tape.TAPE, engine.routes[Medium.HOST, Medium.DISK])
    try:
        data = blocks([1, 2, 3, 4, 5])
        other = data[3:].clone()
        ops = [CopyOp(1, Endpoint(buffer=data, slot=0), Endpoint(dram, 0)),
               CopyOp(2, Endpoint(buffer=data, slot=1), Endpoint(tape, 0)),
               CopyOp(3, Endpoint(buffer=data, slot=2), Endpoint(dram, 1)),
               CopyOp(4, Endpoint(buffer=other[0]), Endpoint(tape, 1)),
               CopyOp(5, Endpoint(buffer=other[1]), Endpoint(dram, 2))]
        handle = engine.submit(ops)
        assert handle.wait(WAIT_S) and handle.failed == {}
        assert all(torch.equal(dram.memory_rows()[s], data[k - 1]) for k, s in ((1, 0), (3, 1), (5, 2)))
        assert torch.equal(tape.data[0], data[1]) and torch.equal(tape.data[1], data[3])
        assert engine.stats.bytes_moved[("buffer:cpu", "dram")] == 3 * BLOCK
        assert engine.stats.bytes_moved[("buffer:cpu", "ssd")] == 2 * BLOCK
    finally:
        dram.close()
