"""Load-or-recompute estimates (kvtier.deciding.cost) and how `KVTier.loadable` uses them (cost: ~3 s).

The estimates are fed numbers, not timed: a test never depends on how fast this machine is."""

from __future__ import annotations

import math

import pytest
import torch

from kvtier.config import KVTierConfig, TierConfig, TransferConfig
from kvtier.deciding.cost import LoadCost, OnlineFit
from kvtier.model.layout import BlockLayout
from kvtier.runtime import KVTier
from kvtier.tiers.base import TierKind

D, S = TierKind.DRAM, TierKind.SSD
LAYOUT = BlockLayout.uniform(block_tokens=16, num_layers=2, layer_bytes=4096)
WAIT_S = 30


def test_a_fit_recovers_a_line_and_fades_old_points():
    fit = OnlineFit(decay=0.9)
    assert fit.slope is None and fit.predict(3) is None
    for x in (1, 2, 4, 8) * 10:
        fit.add(x, 0.5 + 0.25 * x)
    assert math.isclose(fit.slope, 0.25, rel_tol=1e-6) and math.isclose(fit.fixed, 0.5, rel_tol=1e-6)
    for x in (1, 2, 4, 8) * 40:  # the machine got slower: the fit follows
        fit.add(x, 1.0 + 1.0 * x)
    assert math.isclose(fit.slope, 1.0, rel_tol=1e-3) and math.isclose(fit.predict(2), 3.0, rel_tol=1e-3)


def test_a_fit_of_one_size_is_proportional_and_never_negative():
    fit = OnlineFit()
    for _ in range(5):
        fit.add(4, 2.0)
    assert fit.slope == pytest.approx(0.5) and fit.fixed == 0.0
    falling = OnlineFit()
    for x, y in ((1, 5.0), (2, 1.0), (3, 0.0)):
        falling.add(x, y)
    assert falling.slope == 0.0 and falling.fixed >= 0.0
    with pytest.raises(ValueError, match="decay"):
        OnlineFit(decay=1.0)


def test_without_estimates_every_held_block_is_worth_loading():
    cost = LoadCost(block_tokens=16)
    assert cost.worth_loading([D, S, S]) == 3  # no recompute estimate
    cost.note_compute(1024, 1.0)
    assert cost.worth_loading([D, S, S]) == 3  # no load estimate for either tier: measure first
    assert cost.facts().skipped_blocks == {}


def test_the_prefix_stops_where_loading_gets_slower_than_recomputing():
    cost = LoadCost(block_tokens=16, explore_every=1000)
    for n in (256, 512, 1024):
        cost.note_compute(n, 0.01 + n * 1e-4)  # 1.6 ms per block of tokens
    for n in (1, 2, 4):
        cost.note_load(D, n, 50e-6 + n * 100e-6)  # 0.1 ms per block: worth it
        cost.note_load(S, n, 2e-3 + n * 5e-3)  # 5 ms per block: slower than recomputing
    assert cost.worth_loading([D] * 6) == 6
    assert cost.worth_loading([S] * 4) == 0
    assert cost.worth_loading([D, D, D, S, S]) == 3  # DRAM first, then the SSD blocks do not pay
    facts = cost.facts()
    assert facts.skipped_blocks == {S: 4 + 2}
    assert facts.recompute_per_token_s == pytest.approx(1e-4)
    assert facts.load_per_block_s[S] == pytest.approx(5e-3) and facts.load_fixed_s[S] == pytest.approx(2e-3)


def test_a_tier_judged_slow_is_still_measured_now_and_then():
    cost = LoadCost(block_tokens=16, explore_every=4)
    cost.note_compute(1024, 1024 * 1e-6)
    for n in (1, 2):
        cost.note_load(S, n, n * 1.0)
    decisions = [cost.worth_loading([S, S]) for _ in range(8)]
    assert decisions == [0, 0, 0, 2, 0, 0, 0, 2]
    assert cost.facts().skipped_blocks == {S: 12}


def runtime(tmp_path, skip=True) -> KVTier:
    (tmp_path / "ssd").mkdir(parents=True, exist_ok=True)
    tiers = (TierConfig(D, 2 * LAYOUT.block_bytes, high_watermark=1.0, low_watermark=1.0),
             TierConfig(S, 8 * LAYOUT.block_bytes, path=tmp_path / "ssd"))
    cfg = KVTierConfig(model="kvtier-tiny", tiers=tiers, promote_to=None,
                       transfer=TransferConfig(io_workers=2, skip_slow_loads=skip))
    return KVTier(cfg, layout=LAYOUT)


def _store(kv, keys):
    data = torch.stack([torch.full((LAYOUT.block_bytes,), k, dtype=torch.uint8) for k in keys])
    assert kv.store(keys, data).wait(WAIT_S)
    kv.quiesce(WAIT_S)


def test_loads_feed_the_estimate_of_the_tier_they_came_from(tmp_path):
    with runtime(tmp_path) as kv:
        _store(kv, [1, 2, 3, 4])  # DRAM holds 2, SSD the others
        where = dict(zip([1, 2, 3, 4], kv.where([1, 2, 3, 4])))
        on_ssd, in_dram = ([k for k, t in where.items() if t is tier] for tier in (S, D))
        assert len(on_ssd) == len(in_dram) == 2
        for keys in (on_ssd[:1], on_ssd, in_dram[:1], in_dram):
            out = torch.empty(len(keys), LAYOUT.block_bytes, dtype=torch.uint8)
            h = kv.load(keys, out)
            assert h.wait(WAIT_S) and not h.failed
        cost = kv.snapshot()["cost"]
        assert set(cost["load_per_block_s"]) == {"dram", "ssd"}
        assert kv.loadable([*in_dram, 9]) == 2  # no recompute estimate yet: all that is held


def test_loadable_reports_held_blocks_slower_than_recompute_as_misses(tmp_path):
    with runtime(tmp_path) as kv:
        _store(kv, [1, 2, 3, 4])
        on_ssd = [k for k, t in zip([1, 2, 3, 4], kv.where([1, 2, 3, 4])) if t is S]
        in_dram = [k for k in [1, 2, 3, 4] if k not in on_ssd]
        kv.cost.note_load(S, 1, 1.0)
        kv.cost.note_load(S, 2, 2.0)  # a second a block from SSD
        kv.note_compute(4, 1e-9)  # fewer tokens than a block: a decode step, left out
        assert kv.snapshot()["cost"]["recompute_per_token_s"] is None
        kv.note_compute(1024, 1e-3)  # a microsecond a token
        assert kv.lookup(on_ssd) == 2 and kv.loadable(on_ssd) == 0
        assert kv.loadable(in_dram) == 2  # DRAM: unmeasured, so worth it
        assert kv.snapshot()["cost"]["skipped_blocks"] == {"ssd": 2}
    with runtime(tmp_path / "off", skip=False) as kv:
        _store(kv, [1, 2, 3, 4])
        kv.cost.note_load(S, 1, 1.0)
        kv.cost.note_load(S, 2, 2.0)
        kv.note_compute(1024, 1e-3)
        assert kv.loadable([1, 2, 3, 4]) == 4  # transfer.skip_slow_loads: false


def test_a_background_store_never_runs_in_the_callers_thread(tmp_path):
    import threading

    with runtime(tmp_path) as kv:
        ran_in: list[int] = []  # the thread of each batch's copies, whichever way they go
        for name in ("_run", "copy_rows"):
            def record(*args, inner=getattr(kv.engine, name), **kwargs):
                ran_in.append(threading.get_ident())
                return inner(*args, **kwargs)
            setattr(kv.engine, name, record)
        data = torch.stack([torch.full((LAYOUT.block_bytes,), k, dtype=torch.uint8) for k in (7, 8)])
        h = kv.store([7], data[:1], background=True)  # one small host block: inline unless background
        assert h.wait(WAIT_S) and not h.failed
        assert len(ran_in) == 1 and ran_in[0] != threading.get_ident()
        assert kv.store([8], data[1:]).done()  # the engine's default: inline, done on return
        assert ran_in[-1] == threading.get_ident()
        out = torch.empty(2, LAYOUT.block_bytes, dtype=torch.uint8)
        assert kv.load([7, 8], out).wait(WAIT_S) and torch.equal(out, data)
