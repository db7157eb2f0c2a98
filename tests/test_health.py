"""Tiers out of service: the backoff bookkeeping (fake clock), how tiers say they failed as a
whole, and the runtime taking a failed tier out of the cascade and back. Cost: about 2 s."""

from __future__ import annotations

import errno

import pytest
import torch

from kvtier.errors import TierIOError, TierUnavailable
from kvtier.tiers.health import TierHealth
from kvtier.runtime import KVTier
from kvtier.observing.stats import DropReason
from kvtier.tiers import ssd as ssd_module
from kvtier.tiers.base import TierKind
from kvtier.tiers.ssd import SSDTier
from support.metrics import scrape
from support.runtime import BLOCK, WAIT_S, GatedTier, blocks, config, load, store

H, D, S = TierKind.HBM, TierKind.DRAM, TierKind.SSD


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_up_to_the_ceiling_and_a_recovery_ends_it():
    clock = Clock()
    health = TierHealth(clock, first_backoff_s=1.0, max_backoff_s=4.0)
    assert health.seconds_to_next_probe() is None
    assert health.failed(S, "EIO") and not health.failed(S, "again"), "down once, not twice"
    assert health.down == {S} and health.due() == [] and health.seconds_to_next_probe() == 1.0
    for wait in (1.0, 2.0, 4.0, 4.0):
        clock.now += wait
        assert health.due() == [S]
        health.probe_failed(S, "still EIO")
    assert health.seconds_to_next_probe() == 4.0, "capped"
    assert health.facts()["ssd"]["error"] == "still EIO"
    clock.now += 4.0
    assert health.recovered(S) == pytest.approx(15.0) and health.down == frozenset()


def test_a_tier_that_fails_again_soon_after_coming_back_resumes_its_backoff():
    clock = Clock()
    health = TierHealth(clock, first_backoff_s=1.0, max_backoff_s=8.0)
    health.failed(S, "x")
    clock.now += 1.0
    health.probe_failed(S, "x")  # backoff 2
    clock.now += 2.0
    health.recovered(S)
    clock.now += 1.0  # fails again within the ceiling: resumes at 4, not 1
    health.failed(S, "x")
    assert health.seconds_to_next_probe() == 4.0
    clock.now += 4.0
    health.recovered(S)
    clock.now += 60.0  # long after: starts afresh
    health.failed(S, "x")
    assert health.seconds_to_next_probe() == 1.0


def test_bad_backoffs_are_refused():
    with pytest.raises(ValueError, match="first_backoff_s"):
        TierHealth(Clock(), first_backoff_s=5.0, max_backoff_s=1.0)


def test_the_ssd_tier_says_unavailable_for_a_dead_device_not_for_a_short_file(tmp_path):
    dead = ssd_module._io_error(OSError(errno.EIO, "Input/output error"), "write", "f", 3, 0, 10)
    assert isinstance(dead, TierUnavailable) and dead.errno == errno.EIO
    assert isinstance(ssd_module._io_error(OSError(errno.EROFS, "ro"), "write", "f", 3, 0, 10), TierUnavailable)
    short = ssd_module._io_error(ssd_module._ShortRead(errno.EIO, "short read"), "read", "f", 3, 0, 10)
    assert type(short) is TierIOError, "a truncated file is that slot's failure"
    assert type(ssd_module._io_error(OSError(errno.ENOSPC, "full"), "write", "f", 3, 0, 10)) is TierIOError
    tier = SSDTier(tmp_path, 4 * BLOCK, BLOCK, num_files=2)
    tier.probe()  # every file reads
    tier.close()
    with pytest.raises(TierUnavailable, match="closed"):
        tier.probe()


class FlakySSD(GatedTier):
    """A real SSD tier that can be made to fail as a whole (every read, write and probe)."""

    dead = False

    def _check(self):
        if self.dead:
            raise TierUnavailable(errno.EIO, "injected: the disk is gone")

    def read(self, slot, dst, offset=0):
        self._check()
        super().read(slot, dst, offset)

    def write(self, slot, src, offset=0):
        self._check()
        super().write(slot, src, offset)

    def probe(self):
        self._check()
        self.inner.probe()


def test_a_disk_that_fails_as_a_whole_leaves_the_cascade_and_comes_back(tmp_path):
    (tmp_path / "ssd-flaky").mkdir()
    flaky = FlakySSD(SSDTier(tmp_path / "ssd-flaky", 6 * BLOCK, BLOCK, num_files=2))
    (tmp_path / "ssd").mkdir()
    cfg = config(tmp_path, hbm=1, dram=2)
    with KVTier(cfg, layout=__import__("test_runtime").LAYOUT, tiers={S: flaky}) as kv:
        for k in range(1, 6):  # one at a time, each pushing the oldest down: 1 and 2 reach the SSD
            store(kv, [k])
        assert kv.where([1, 2]) == [S, S]
        flaky.dead = True
        _, handle = load(kv, [1])
        kv.quiesce(WAIT_S)  # the promotion that failed reports on its own handle
        assert 1 in handle.failed, "a miss (the promotion it joined could not read the disk)"
        assert kv.snapshot()["unavailable"]["ssd"]["error"].endswith("the disk is gone")
        assert kv.lookup([1]) == 0 and kv.lookup([2]) == 0, "not served while the disk is down"
        metrics = scrape(kv.serve_metrics(0))
        assert metrics[("kvtier_tier_up", (("tier", "ssd"),))] == 0
        assert metrics[("kvtier_tier_up", (("tier", "dram"),))] == 1
        assert metrics[("kvtier_tier_failures_total", (("tier", "ssd"),))] == 1
        for k in (6, 7, 8):  # HBM and DRAM full, nothing below in service: counted, never silent
            store(kv, [k])
        assert kv.stats.dropped[DropReason.LOWER_DOWN] >= 1
        assert S not in kv.where([6, 7, 8])
        assert kv.recheck() == []
        flaky.dead = False
        assert kv.recheck() == [S]
        out, handle = load(kv, [1, 2])
        assert handle.failed == {} and torch.equal(out, blocks([1, 2])), "its blocks were kept for its return"
        assert kv.stats.tier_failures[S] == 1 and kv.stats.tier_recoveries[S] == 1
        snap = kv.snapshot()
        assert snap["unavailable"] == {} and snap["tier_failures"] == {"ssd": 1}


def test_the_background_prober_puts_a_tier_back_on_its_own(tmp_path):
    (tmp_path / "ssd-flaky").mkdir()
    flaky = FlakySSD(SSDTier(tmp_path / "ssd-flaky", 6 * BLOCK, BLOCK, num_files=2))
    (tmp_path / "ssd").mkdir()
    cfg = config(tmp_path, hbm=1, dram=1)
    with KVTier(cfg, layout=__import__("test_runtime").LAYOUT, tiers={S: flaky}) as kv:
        for k in (1, 2, 3):
            store(kv, [k])
        on_ssd = [k for k, t in zip((1, 2, 3), kv.where([1, 2, 3])) if t is S]
        assert on_ssd
        flaky.dead = True
        load(kv, on_ssd)
        kv.quiesce(WAIT_S)
        assert "ssd" in kv.snapshot()["unavailable"]
        flaky.dead = False
        assert kv.wait_for_tiers(WAIT_S), "the prober (after tier_retry_s, 0.5 s) put it back"
        assert kv.snapshot()["unavailable"] == {} and kv.stats.tier_recoveries[S] == 1
