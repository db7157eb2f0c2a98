"""The `Tier` contract (`kvtier.testing.tier_contract`), run unchanged against every tier implementation.

Implementations: HBMTier on its CPU stand-in, DRAMTier, SSDTier with O_DIRECT attempted (on pytest's
tmp_path and on a disk-backed /var/tmp, since /tmp may be tmpfs) and SSDTier with buffered I/O, each
on real files; PoolTier on a `kvtier pool serve` subprocess; MooncakeTier on a real `mooncake_master`
subprocess (skipped where the mooncake package or its master binary is missing). Cost: about ten
seconds in all; the hypothesis test and the Mooncake client's set-up are the bulk of it.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.pool.client.api import PoolClient
from kvtier.pool.client.tier import PoolTier
from kvtier.tiers.base import Tier
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.hbm import HBMTier
from kvtier.tiers.ssd import SSDTier
from kvtier.testing.tier_contract import NUM_SLOTS, SLOT_BYTES, MakeTier, TierContract, fill_all, random_bytes, read_back

DISK_DIR = "/var/tmp"

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
def tier_factory(request: pytest.FixtureRequest, tmp_path) -> Iterator[MakeTier]:
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


@pytest.mark.parametrize("tier_factory", MEMORY_TIERS, indirect=True)
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


@pytest.mark.parametrize("tier_factory", SSD_TIERS, indirect=True)
def test_ssd_offers_no_view(tier: Tier) -> None:
    """A disk has no zero-copy view: `view` says so with None, and the transfer engine stages."""
    blocks = fill_all(tier)
    assert tier.view(2, 10, 100) is None
    assert tier.view(0, 0, SLOT_BYTES) is None
    assert torch.equal(read_back(tier, 2), blocks[2])


@pytest.fixture
def tier(tier_factory: MakeTier) -> Tier:
    return tier_factory(NUM_SLOTS * SLOT_BYTES, SLOT_BYTES)


class TestEveryTier(TierContract):
    """The whole contract (`kvtier.testing.tier_contract`) against each implementation above."""

    @pytest.fixture
    def make_tier(self, tier_factory: MakeTier) -> MakeTier:
        return tier_factory


OUT_OF_TREE = '''
import pytest, torch
from kvtier.testing.tier_contract import TierContract
from kvtier.tiers.dram import DRAMTier

class ForgetfulTier(DRAMTier):
    """Reads give zeros past the first 4 KiB: a tier that loses bytes."""
    def read(self, slot, dst, offset=0):
        super().read(slot, dst, offset)
        if offset + dst.numel() > 4096:
            dst[max(0, 4096 - offset):] = 0

class TestForgetful(TierContract):
    @pytest.fixture
    def make_tier(self):
        made = []
        def make(capacity_bytes, slot_bytes):
            made.append(ForgetfulTier(capacity_bytes, slot_bytes))
            return made[-1]
        yield make
        for t in made:
            t.close()

class TestPlainDRAM(TierContract):
    @pytest.fixture
    def make_tier(self):
        return lambda capacity_bytes, slot_bytes: DRAMTier(capacity_bytes, slot_bytes)
'''


@pytest.mark.slow
def test_an_out_of_tree_tier_runs_the_contract_and_a_broken_one_fails_it(tmp_path) -> None:
    """The contract as an outside project uses it: a subclass in its own test file, run by pytest."""
    (tmp_path / "test_my_tier.py").write_text(OUT_OF_TREE)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 1, run.stdout[-3000:]
    failed = {line.split("::")[-1].split(" ")[0] for line in run.stdout.splitlines() if line.startswith("FAILED")}
    assert all("TestForgetful" in line for line in run.stdout.splitlines() if line.startswith("FAILED")), run.stdout
    assert {"test_round_trip_is_byte_identical", "test_random_ranges_match_a_reference_model"} <= failed, failed
    assert "passed" in run.stdout.splitlines()[-1]  # TestPlainDRAM's tests
