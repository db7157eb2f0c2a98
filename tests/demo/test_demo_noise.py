"""`kvtier.demo.noise`: which demo figures a busy machine made, decided from made-up measurements.

Cost: milliseconds (pure functions, no model).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.demo.noise import Load, experiment_notes, read_load_average, spread, spread_notes, turn_note

LOAD = Load(start=0.5, end=3.5, num_cores=2)
TIERS = ("hbm", "dram", "pool", "ssd")


def _turn(cached_tokens: int, kvtier_ms: float, recompute_ms: float, prepare_ms: float = 0.5) -> dict:
    return {"cached_tokens": cached_tokens, "prompt_tokens": 3072, "kvtier_ms": kvtier_ms,
            "recompute_ms": recompute_ms, "prepare_ms": prepare_ms}


def test_a_miss_as_slow_as_recompute_plus_its_lookup_gets_no_note():
    assert turn_note(_turn(0, kvtier_ms=126.0, recompute_ms=128.0), LOAD) is None
    assert turn_note(_turn(0, kvtier_ms=135.0, recompute_ms=128.0, prepare_ms=1.0), LOAD) is None  # within 10%


def test_a_miss_far_slower_than_recompute_is_called_noise_with_the_load():
    note = turn_note(_turn(0, kvtier_ms=1881.0, recompute_ms=1236.0, prepare_ms=2.0), LOAD)
    assert note is not None and "miss" in note and "2.0 ms lookup" in note and "643 ms" in note
    assert "load average 0.5 -> 3.5 on 2 cores" in note


def test_a_hit_slower_than_recompute_is_called_noise_and_a_fast_hit_is_not():
    note = turn_note(_turn(3072, kvtier_ms=483.0, recompute_ms=203.0, prepare_ms=10.0), LOAD)
    assert note is not None and "hit" in note and "loaded the prefix in 10.0 ms" in note
    assert turn_note(_turn(3072, kvtier_ms=25.0, recompute_ms=140.0, prepare_ms=10.0), LOAD) is None


def test_spread_notes_name_only_sizes_whose_repeats_spread_widely():
    notes = spread_notes({3072: [120.0, 122.0, 125.0], 3124: [124.0, 130.0, 1304.0]},
                         "recomputing {n:,}-token prompts", LOAD)
    assert len(notes) == 1
    assert "recomputing 3,124-token prompts took 124.0-1304.0 ms" in notes[0] and "3 runs" in notes[0]
    assert spread_notes({3072: [120.0]}, "x {n}", LOAD) == []  # one run has no spread
    assert spread([100.0, 150.0, 200.0]) == pytest.approx(100 / 150)


def _row(tokens: int, tier: str, kvtier_ms: float, recompute_ms: float = 65.0) -> dict:
    return {"prefix_tokens": tokens, "tier": tier, "kvtier_ms": kvtier_ms, "recompute_ms": recompute_ms}


def test_dram_reading_slower_than_a_lower_tier_gets_one_note_per_length():
    rows = [_row(1024, "dram", 6.4), _row(1024, "pool", 8.9), _row(1024, "ssd", 13.1),
            _row(2048, "dram", 116.0), _row(2048, "pool", 26.5), _row(2048, "ssd", 15.6)]
    notes = experiment_notes(rows, TIERS, LOAD)
    assert len(notes) == 1 and notes[0].startswith("note: at 2,048 tokens")
    assert "dram (116.0 ms) read slower than pool (26.5 ms) and ssd (15.6 ms)" in notes[0]
    assert "a dram hit is a memory copy" in notes[0]


def test_pool_against_ssd_is_the_machines_to_order_and_gets_no_note():
    rows = [_row(512, "dram", 7.7), _row(512, "pool", 10.1), _row(512, "ssd", 8.7)]  # loopback TCP vs page cache
    assert experiment_notes(rows, TIERS, LOAD) == []


def test_ordered_tiers_with_tight_recompute_get_no_note_and_wide_recompute_does():
    ordered = [_row(512, "dram", 6.1), _row(512, "pool", 10.1), _row(512, "ssd", 10.4)]
    assert experiment_notes(ordered, TIERS, LOAD) == []
    noisy = [{**r, "recompute_ms": ms} for r, ms in zip(ordered, (14.0, 1239.6, 226.4))]
    notes = experiment_notes(noisy, TIERS, LOAD)
    assert len(notes) == 1 and "rough" in notes[0] and "14.0-1239.6 ms" in notes[0]


def test_the_load_average_is_read_from_proc_and_none_where_it_cannot_be(tmp_path: Path):
    (tmp_path / "loadavg").write_text("1.25 0.80 0.60 2/113 24106\n")
    assert read_load_average(tmp_path / "loadavg") == 1.25
    assert read_load_average(tmp_path / "missing") is None
    assert "unknown" in Load(None, 1.0, 2).describe()
