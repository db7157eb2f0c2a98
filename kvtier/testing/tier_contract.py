"""The `Tier` contract: what every tier must do, as a pytest class any tier's tests can reuse.

kvtier runs it against each of its tiers (tests/tiers/test_tier_contract.py); an out-of-tree tier runs it
the same way, by subclassing and giving the factory:

    from kvtier.testing.tier_contract import TierContract

    class TestMyTier(TierContract):
        @pytest.fixture
        def make_tier(self, tmp_path):
            made = []
            def make(capacity_bytes, slot_bytes):
                made.append(MyTier(tmp_path, capacity_bytes, slot_bytes))
                return made[-1]
            yield make
            for tier in made:
                tier.close()

`make_tier(capacity_bytes, slot_bytes) -> Tier` builds a fresh tier and closes what it made
afterwards. The tests use slots of `SLOT_BYTES` (not a multiple of 4 KiB, on purpose) and
`NUM_SLOTS` of them. What a tier may differ in (`view`: a zero-copy tensor or None) is not asserted
here; the implementation's own tests say which it offers.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.errors import CapacityError, TierIOError
from kvtier.model.layout import BlockLayout
from kvtier.tiers.base import SpanIO, Tier

SLOT_BYTES = 3 * 4096 + 1000  # deliberately not a multiple of 4 KiB
NUM_SLOTS = 6
MakeTier = Callable[[int, int], Tier]


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def read_back(tier: Tier, slot: int, offset: int = 0, length: int | None = None) -> torch.Tensor:
    out = torch.empty(tier.slot_bytes - offset if length is None else length, dtype=torch.uint8)
    tier.read(slot, out, offset)
    return out


def fill_all(tier: Tier) -> list[torch.Tensor]:
    """Writes distinct random bytes to every slot; returns what each slot holds."""
    blocks = [random_bytes(tier.slot_bytes, seed=100 + s) for s in range(tier.num_slots)]
    for slot, block in enumerate(blocks):
        tier.write(slot, block)
    return blocks


def fresh_keys(n: int) -> list[bytes]:
    """`n` block keys never used before (16 bytes, as a shared tier takes): a shared tier's node
    outlives one test, and keeps the first bytes stored under a key."""
    return [secrets.token_bytes(16) for _ in range(n)]


ranges = st.lists(
    st.tuples(
        st.booleans(),  # True: write, False: read
        st.integers(0, NUM_SLOTS - 1),
        st.integers(0, SLOT_BYTES - 1),
        st.integers(0, SLOT_BYTES),
        st.integers(0, 2**31 - 1),
    ),
    min_size=1,
    max_size=12,
)


class TierContract:
    """Every test a `Tier` must pass; a subclass provides the `make_tier` fixture."""

    @pytest.fixture
    def make_tier(self) -> MakeTier:
        raise NotImplementedError("a TierContract subclass provides the make_tier fixture")

    @pytest.fixture
    def tier(self, make_tier: MakeTier) -> Tier:
        return make_tier(NUM_SLOTS * SLOT_BYTES, SLOT_BYTES)

    def test_geometry(self, tier: Tier) -> None:
        assert tier.slot_bytes == SLOT_BYTES
        assert tier.num_slots == NUM_SLOTS
        assert tier.capacity_bytes == NUM_SLOTS * SLOT_BYTES
        facts = tier.describe()
        assert facts["tier"] == tier.kind.name.lower() and facts["num_slots"] == NUM_SLOTS

    def test_capacity_rounds_down_to_whole_slots(self, make_tier: MakeTier) -> None:
        assert make_tier(3 * SLOT_BYTES + SLOT_BYTES - 1, SLOT_BYTES).num_slots == 3

    def test_capacity_below_one_slot_raises(self, make_tier: MakeTier) -> None:
        with pytest.raises(CapacityError, match=str(SLOT_BYTES)):
            make_tier(SLOT_BYTES - 1, SLOT_BYTES)

    def test_round_trip_is_byte_identical(self, tier: Tier) -> None:
        blocks = fill_all(tier)
        for slot, block in enumerate(blocks):
            assert torch.equal(read_back(tier, slot), block)

    def test_slots_are_independent(self, tier: Tier) -> None:
        blocks = fill_all(tier)
        blocks[2] = random_bytes(SLOT_BYTES, seed=7)
        tier.write(2, blocks[2])
        tier.write(4, blocks[4][:10], 0)  # rewrite of identical bytes changes nothing
        for slot, block in enumerate(blocks):
            assert torch.equal(read_back(tier, slot), block), f"slot {slot}"

    @pytest.mark.parametrize(
        "offset,length", [(1, 1), (1234, 3000), (4095, 4098), (4096, 4096), (SLOT_BYTES - 5, 5)]
    )
    def test_sub_range_write_keeps_the_rest(self, tier: Tier, offset: int, length: int) -> None:
        blocks = fill_all(tier)
        patch = random_bytes(length, seed=offset)
        tier.write(3, patch, offset)
        blocks[3][offset : offset + length] = patch
        assert torch.equal(read_back(tier, 3, offset, length), patch)
        for slot, block in enumerate(blocks):
            assert torch.equal(read_back(tier, slot), block), f"slot {slot}"

    def test_layer_wise_reads(self, tier: Tier) -> None:
        layout = BlockLayout(16, (1000, 2500, 4096, 3000, SLOT_BYTES - 10596))
        assert layout.block_bytes == SLOT_BYTES
        block = fill_all(tier)[1]
        for layer in reversed(range(layout.num_layers)):
            offset, length = layout.layer_range(layer)
            assert torch.equal(read_back(tier, 1, offset, length), block[offset : offset + length])

    def test_zero_length_io_is_a_no_op(self, tier: Tier) -> None:
        blocks = fill_all(tier)
        tier.write(0, torch.empty(0, dtype=torch.uint8), SLOT_BYTES)
        tier.read(0, torch.empty(0, dtype=torch.uint8), 17)
        assert torch.equal(read_back(tier, 0), blocks[0])

    @pytest.mark.parametrize(
        "slot,offset,length",
        [(-1, 0, 1), (NUM_SLOTS, 0, 1), (0, SLOT_BYTES - 3, 4), (5, -1, 2), (1, SLOT_BYTES + 1, 0)],
    )
    def test_out_of_bounds_raises_index_error_naming_tier_and_slot(
        self, tier: Tier, slot: int, offset: int, length: int
    ) -> None:
        pattern = rf"{tier.kind.name}.*slot {slot}"
        with pytest.raises(IndexError, match=pattern):
            tier.write(slot, torch.zeros(length, dtype=torch.uint8), offset)
        with pytest.raises(IndexError, match=pattern):
            tier.read(slot, torch.zeros(length, dtype=torch.uint8), offset)

    @pytest.mark.parametrize(
        "bad",
        [
            torch.zeros(16, dtype=torch.float32),
            torch.zeros(16, dtype=torch.int8),
            torch.zeros((4, 4), dtype=torch.uint8),
            torch.zeros(32, dtype=torch.uint8)[::2],
        ],
        ids=["float32", "int8", "2-d", "strided"],
    )
    def test_wrong_buffer_type_raises_type_error(self, tier: Tier, bad: torch.Tensor) -> None:
        with pytest.raises(TypeError):
            tier.write(0, bad)
        with pytest.raises(TypeError):
            tier.read(0, bad)

    def test_write_spans_and_read_spans(self, tier: Tier) -> None:
        """Whole slots written in one batch (each under its key, as the engine writes a shared
        tier's blocks) read back whole and in part."""
        slots = list(range(NUM_SLOTS))
        keys = fresh_keys(len(slots))
        blocks = [random_bytes(SLOT_BYTES, seed=slot) for slot in slots]
        assert tier.write_spans(SpanIO(slots, 0, SLOT_BYTES, [b.data_ptr() for b in blocks], keys)) == {}
        outs = [torch.empty(SLOT_BYTES, dtype=torch.uint8) for _ in slots]
        assert tier.read_spans(SpanIO(slots, 0, SLOT_BYTES, [o.data_ptr() for o in outs], keys)) == {}
        assert all(torch.equal(out, block) for out, block in zip(outs, blocks))
        offset, length = 100, 500
        parts = [torch.empty(length, dtype=torch.uint8) for _ in slots]
        assert tier.read_spans(SpanIO(slots[::-1], offset, length, [p.data_ptr() for p in parts], keys[::-1])) == {}
        for part, block in zip(parts, blocks[::-1]):
            assert torch.equal(part, block[offset: offset + length])
        assert tier.read_spans(SpanIO([], 0, SLOT_BYTES, [], [])) == {}

    def test_spans_fail_per_slot(self, tier: Tier) -> None:
        """A slot out of range fails alone, by its index in the batch; the others are moved."""
        data = random_bytes(SLOT_BYTES, seed=99)
        slots, keys = [0, NUM_SLOTS, 1], fresh_keys(3)
        failed = tier.write_spans(SpanIO(slots, 0, SLOT_BYTES, [data.data_ptr()] * 3, keys))
        assert set(failed) == {1} and isinstance(failed[1], IndexError)
        outs = [torch.empty(SLOT_BYTES, dtype=torch.uint8) for _ in range(3)]
        failed = tier.read_spans(SpanIO(slots, 0, SLOT_BYTES, [o.data_ptr() for o in outs], keys))
        assert set(failed) == {1} and isinstance(failed[1], IndexError)
        assert torch.equal(outs[0], data) and torch.equal(outs[2], data)

    def test_concurrent_threads_on_distinct_slots(self, tier: Tier) -> None:
        start = threading.Barrier(NUM_SLOTS)

        def worker(slot: int) -> bool:
            model = random_bytes(SLOT_BYTES, seed=slot)
            start.wait()
            tier.write(slot, model)
            for i in range(20):
                offset, length = (i * 997) % (SLOT_BYTES - 3000), 1 + (i * 1531) % 3000
                patch = random_bytes(length, seed=1000 * slot + i)
                tier.write(slot, patch, offset)
                model[offset : offset + length] = patch
                if not torch.equal(read_back(tier, slot, offset, length), patch):
                    return False
            return torch.equal(read_back(tier, slot), model)

        with ThreadPoolExecutor(NUM_SLOTS) as pool:
            assert all(pool.map(worker, range(NUM_SLOTS)))

    def test_close_is_idempotent_and_later_io_raises(self, tier: Tier) -> None:
        tier.close()
        tier.close()
        with pytest.raises(TierIOError):
            tier.write(0, torch.zeros(8, dtype=torch.uint8))
        with pytest.raises(TierIOError):
            tier.read(0, torch.zeros(8, dtype=torch.uint8))

    @pytest.fixture
    def reference(self, tier: Tier) -> list[bytearray]:
        """A bytearray mirror of `tier`, made by writing known bytes to every slot."""
        return [bytearray(block.numpy().tobytes()) for block in fill_all(tier)]

    # differing_executors: each subclass runs this method on its own tier; no state is shared between them
    @settings(max_examples=40, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.differing_executors])
    @given(ops=ranges)
    def test_random_ranges_match_a_reference_model(
        self, tier: Tier, reference: list[bytearray], ops: list[tuple[bool, int, int, int, int]]
    ) -> None:
        """Random reads and writes of (slot, offset, length) against a bytearray per slot.

        The tier outlives hypothesis' examples, so the model (`reference`) lives as long as it does.
        """
        model = reference
        for is_write, slot, offset, length, seed in ops:
            length = min(length, SLOT_BYTES - offset)
            if is_write:
                data = random_bytes(length, seed)
                tier.write(slot, data, offset)
                model[slot][offset : offset + length] = data.numpy().tobytes()
            else:
                got = read_back(tier, slot, offset, length)
                assert got.numpy().tobytes() == bytes(model[slot][offset : offset + length])
