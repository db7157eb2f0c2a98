"""The `Tier` contract, run unchanged against every tier implementation.

Implementations: HBMTier on its CPU stand-in, DRAMTier, SSDTier with O_DIRECT attempted (on pytest's
tmp_path and on a disk-backed /var/tmp, since /tmp may be tmpfs) and SSDTier with buffered I/O, each
on real files; PoolTier on a `kvtier pool serve` subprocess; MooncakeTier on a real `mooncake_master`
subprocess (skipped where the mooncake package or its master binary is missing). Cost: about ten
seconds in all; the hypothesis test and the Mooncake client's set-up are the bulk of it.
"""

from __future__ import annotations

import importlib
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.errors import CapacityError, TierIOError
from kvtier.layout import BlockLayout
from kvtier.pool.client.api import PoolClient
from kvtier.pool.client.tier import PoolTier
from kvtier.tiers.base import SlotIO, Tier
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.hbm import HBMTier
from kvtier.tiers.ssd import SSDTier

SLOT_BYTES = 3 * 4096 + 1000  # deliberately not a multiple of 4 KiB
NUM_SLOTS = 6
DISK_DIR = "/var/tmp"

MakeTier = Callable[[int, int], Tier]
MEMORY_TIERS = ["hbm-cpu", "dram"]  # offer `view`
SSD_TIERS = ["ssd-direct-tmp_path", "ssd-direct-var-tmp", "ssd-buffered"]  # `view` is None

def _mooncake_runs_here() -> bool:
    """The mooncake package imports (its extension can be present yet miss a shared library) and
    its `mooncake_master` is where `MasterProcess` looks."""
    try:
        importlib.import_module("mooncake.store")
    except ImportError:
        return False
    return (Path(sys.executable).parent / "mooncake_master").exists() or shutil.which("mooncake_master") is not None


MOONCAKE = pytest.param("mooncake", marks=[pytest.mark.slow, pytest.mark.skipif(
    not _mooncake_runs_here(), reason="mooncake-transfer-engine (and its mooncake_master) not installed")])
# PoolTier on a `kvtier pool serve` subprocess, MooncakeTier on a `mooncake_master` one; `view` is None
REMOTE_TIERS = ["pool", MOONCAKE]


@pytest.fixture
def disk_dir() -> Iterator[str]:
    """A fresh directory under /var/tmp (usually disk-backed, always writable on Linux), removed afterwards."""
    path = tempfile.mkdtemp(prefix="kvtier-contract-", dir=DISK_DIR)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def pool_node() -> Iterator[str]:
    """A pool node subprocess shared by the module's pool tiers (each tier keys its slots apart)."""
    from kvtier.pool.node.process import running_node

    with running_node(capacity="16MiB", region_size="1MiB") as node:
        yield node.address


@pytest.fixture(scope="module")
def mooncake_client() -> Iterator[object]:
    """A `mooncake_master` subprocess and one client of it, shared by the module's Mooncake tiers
    (each tier keys its slots apart; setting a client up costs more than the tests that use it)."""
    from kvtier.pool.mooncake import MooncakeClient
    from kvtier.testing.mooncake_master import MasterProcess

    master = MasterProcess()
    try:
        client = MooncakeClient(master.address, master.metadata_server, segment_bytes=64 << 20,
                                staging_bytes=16 << 20)
        yield client
        client.close()
    finally:
        master.close()


@pytest.fixture(params=MEMORY_TIERS + SSD_TIERS + REMOTE_TIERS)
def make_tier(request: pytest.FixtureRequest, tmp_path) -> Iterator[MakeTier]:
    """A factory `(capacity_bytes, slot_bytes) -> Tier` for one implementation; closes what it made."""
    kind = request.param
    directory = request.getfixturevalue("disk_dir") if kind == "ssd-direct-var-tmp" else str(tmp_path)
    pool = request.getfixturevalue("pool_node") if kind == "pool" else None
    mooncake = request.getfixturevalue("mooncake_client") if kind == "mooncake" else None
    factories: dict[str, MakeTier] = {
        "hbm-cpu": lambda cap, slot: HBMTier(cap, slot, device="cpu"),
        "dram": lambda cap, slot: DRAMTier(cap, slot),
        "ssd-direct-tmp_path": lambda cap, slot: SSDTier(directory, cap, slot, num_files=4),
        "ssd-direct-var-tmp": lambda cap, slot: SSDTier(directory, cap, slot, num_files=4),
        "ssd-buffered": lambda cap, slot: SSDTier(directory, cap, slot, num_files=3, direct=False),
        "pool": lambda cap, slot: PoolTier(PoolClient([pool], timeout_s=30), cap, slot, owns_client=True),
        "mooncake": lambda cap, slot: _mooncake_tier(mooncake, cap, slot),
    }
    made: list[Tier] = []

    def make(capacity_bytes: int, slot_bytes: int) -> Tier:
        tier = factories[kind](capacity_bytes, slot_bytes)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def _mooncake_tier(client, capacity_bytes: int, slot_bytes: int) -> Tier:
    from kvtier.pool.mooncake import MooncakeTier

    return MooncakeTier(client, capacity_bytes, slot_bytes)


@pytest.fixture
def tier(make_tier: MakeTier) -> Tier:
    return make_tier(NUM_SLOTS * SLOT_BYTES, SLOT_BYTES)


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


def test_geometry(tier: Tier) -> None:
    assert tier.slot_bytes == SLOT_BYTES
    assert tier.num_slots == NUM_SLOTS
    assert tier.capacity_bytes == NUM_SLOTS * SLOT_BYTES
    facts = tier.describe()
    assert facts["tier"] == tier.kind.name.lower() and facts["num_slots"] == NUM_SLOTS


def test_capacity_rounds_down_to_whole_slots(make_tier: MakeTier) -> None:
    assert make_tier(3 * SLOT_BYTES + SLOT_BYTES - 1, SLOT_BYTES).num_slots == 3


def test_capacity_below_one_slot_raises(make_tier: MakeTier) -> None:
    with pytest.raises(CapacityError, match=str(SLOT_BYTES)):
        make_tier(SLOT_BYTES - 1, SLOT_BYTES)


def test_round_trip_is_byte_identical(tier: Tier) -> None:
    blocks = fill_all(tier)
    for slot, block in enumerate(blocks):
        assert torch.equal(read_back(tier, slot), block)


def test_slots_are_independent(tier: Tier) -> None:
    blocks = fill_all(tier)
    blocks[2] = random_bytes(SLOT_BYTES, seed=7)
    tier.write(2, blocks[2])
    tier.write(4, blocks[4][:10], 0)  # rewrite of identical bytes changes nothing
    for slot, block in enumerate(blocks):
        assert torch.equal(read_back(tier, slot), block), f"slot {slot}"


@pytest.mark.parametrize(
    "offset,length", [(1, 1), (1234, 3000), (4095, 4098), (4096, 4096), (SLOT_BYTES - 5, 5)]
)
def test_sub_range_write_keeps_the_rest(tier: Tier, offset: int, length: int) -> None:
    blocks = fill_all(tier)
    patch = random_bytes(length, seed=offset)
    tier.write(3, patch, offset)
    blocks[3][offset : offset + length] = patch
    assert torch.equal(read_back(tier, 3, offset, length), patch)
    for slot, block in enumerate(blocks):
        assert torch.equal(read_back(tier, slot), block), f"slot {slot}"


def test_layer_wise_reads(tier: Tier) -> None:
    layout = BlockLayout(16, (1000, 2500, 4096, 3000, SLOT_BYTES - 10596))
    assert layout.block_bytes == SLOT_BYTES
    block = fill_all(tier)[1]
    for layer in reversed(range(layout.num_layers)):
        offset, length = layout.layer_range(layer)
        assert torch.equal(read_back(tier, 1, offset, length), block[offset : offset + length])


def test_zero_length_io_is_a_no_op(tier: Tier) -> None:
    blocks = fill_all(tier)
    tier.write(0, torch.empty(0, dtype=torch.uint8), SLOT_BYTES)
    tier.read(0, torch.empty(0, dtype=torch.uint8), 17)
    assert torch.equal(read_back(tier, 0), blocks[0])


@pytest.mark.parametrize(
    "slot,offset,length",
    [(-1, 0, 1), (NUM_SLOTS, 0, 1), (0, SLOT_BYTES - 3, 4), (5, -1, 2), (1, SLOT_BYTES + 1, 0)],
)
def test_out_of_bounds_raises_index_error_naming_tier_and_slot(
    tier: Tier, slot: int, offset: int, length: int
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
def test_wrong_buffer_type_raises_type_error(tier: Tier, bad: torch.Tensor) -> None:
    with pytest.raises(TypeError):
        tier.write(0, bad)
    with pytest.raises(TypeError):
        tier.read(0, bad)


def test_write_many_and_read_many(tier: Tier) -> None:
    blocks = fill_all(tier)
    patches = [(slot, 100 * slot + 1, random_bytes(500 + slot, seed=slot)) for slot in range(NUM_SLOTS)]
    tier.write_many([SlotIO(slot, buf, offset) for slot, offset, buf in patches])
    outs = [torch.empty(len(buf), dtype=torch.uint8) for _, _, buf in patches]
    tier.read_many([SlotIO(slot, out, offset) for (slot, offset, _), out in zip(patches, outs)])
    for (slot, offset, buf), out in zip(patches, outs):
        assert torch.equal(out, buf)
        blocks[slot][offset : offset + len(buf)] = buf
    outs = [torch.empty(SLOT_BYTES, dtype=torch.uint8) for _ in range(NUM_SLOTS)]
    tier.read_many([SlotIO(slot, out) for slot, out in enumerate(outs)])
    assert all(torch.equal(out, block) for out, block in zip(outs, blocks))


def test_concurrent_threads_on_distinct_slots(tier: Tier) -> None:
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


@pytest.mark.parametrize("make_tier", MEMORY_TIERS, indirect=True)
def test_memory_tier_view_is_zero_copy(tier: Tier) -> None:
    view = tier.view(2, 10, 100)
    assert view is not None, f"{tier.kind.name} must offer a view"
    assert view.dtype == torch.uint8 and view.shape == (100,)
    patch = random_bytes(100, seed=3)
    tier.write(2, patch, 10)
    assert torch.equal(view, patch)
    view.fill_(7)
    assert torch.equal(read_back(tier, 2, 10, 100), torch.full((100,), 7, dtype=torch.uint8))
    with pytest.raises(IndexError):
        tier.view(NUM_SLOTS, 0, 1)


@pytest.mark.parametrize("make_tier", SSD_TIERS, indirect=True)
def test_ssd_offers_no_view(tier: Tier) -> None:
    """A disk has no zero-copy view: `view` says so with None, and the transfer engine stages."""
    blocks = fill_all(tier)
    assert tier.view(2, 10, 100) is None
    assert tier.view(0, 0, SLOT_BYTES) is None
    assert torch.equal(read_back(tier, 2), blocks[2])


def test_close_is_idempotent_and_later_io_raises(tier: Tier) -> None:
    tier.close()
    tier.close()
    with pytest.raises(TierIOError):
        tier.write(0, torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(TierIOError):
        tier.read(0, torch.zeros(8, dtype=torch.uint8))


@pytest.fixture
def reference(tier: Tier) -> list[bytearray]:
    """A bytearray mirror of `tier`, made by writing known bytes to every slot."""
    return [bytearray(block.numpy().tobytes()) for block in fill_all(tier)]


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


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ranges)
def test_random_ranges_match_a_reference_model(
    tier: Tier, reference: list[bytearray], ops: list[tuple[bool, int, int, int, int]]
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
