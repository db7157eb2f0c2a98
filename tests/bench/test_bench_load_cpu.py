"""bench/bench_load_cpu.py end to end, tiny: every tier's row is made from real loads (blocks
placed in DRAM, in a real SSD tier on disk, on a real pool node process, each load checked), and
bad arguments are refused by name. Counters only, never time (cost: ~6 s, most of it node starts)."""

from __future__ import annotations

import json

import pytest

from support.bench import load_script


@pytest.fixture(scope="module")
def bench():
    yield from load_script("bench_load_cpu")


def test_every_tier_and_batch_gives_a_row_of_real_loads(bench, tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert bench.main(["--block", "128KiB", "--batches", "1,3", "--calls", "6", "--seconds", "0",
                       "--ssd-dir", str(tmp_path), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tier"], r["batch"]) for r in rows] == [(t, b) for t in bench.TIERS for b in (1, 3)]
    assert all(r["calls"] == 6 and r["block_bytes"] == 128 << 10 and r["cpu_us_per_call"] > 0
               and r["wall_us_min"] <= r["wall_us_p50"] for r in rows)
    assert all(r["user_us_per_call"] + r["system_us_per_call"] == pytest.approx(r["cpu_us_per_call"]) for r in rows)
    assert [r["node_cpu_us_per_call"] is not None for r in rows] == [r["tier"] == "pool" for r in rows]
    table = capsys.readouterr().out
    assert all(t in table for t in bench.TIERS) and "cpu µs/block" in table
    assert not list(tmp_path.glob("kvtier-bench-load-cpu-*"))  # the SSD files went with the run


def test_a_tier_whose_blocks_land_elsewhere_is_an_error_not_a_row(bench, tmp_path, monkeypatch):
    """The bench measures loads from the tier it names: blocks that did not get there (here HBM
    keeps them: no watermark, room for all) fail the run instead of timing another tier."""
    import dataclasses

    inner = bench.runtime_config

    def hbm_keeps_all(env, lower, block_bytes, depth, num_blocks):
        config = inner(env, lower, block_bytes, depth, num_blocks)
        hbm = dataclasses.replace(config.tiers[0], capacity_bytes=num_blocks * block_bytes,
                                  high_watermark=1.0, low_watermark=1.0)
        return dataclasses.replace(config, tiers=(hbm, *config.tiers[1:]))

    monkeypatch.setattr(bench, "runtime_config", hbm_keeps_all)
    args = bench.parse_args(["--block", "128KiB", "--batches", "1", "--calls", "2", "--tiers", "ssd",
                             "--ssd-dir", str(tmp_path)])
    with pytest.raises(RuntimeError, match=r"ssd: blocks placed in \['HBM'\], not SSD"):
        bench.measure("ssd", 1, args, str(tmp_path))


@pytest.mark.parametrize("argv, what", [(["--tiers", "dram,nvme"], "--tiers"), (["--block", "10"], "--block"),
                                        (["--calls", "0"], "--calls"), (["--batches", "0"], "--batches"),
                                        (["--batches", "a"], "--batches"),
                                        (["--seconds", "-1"], "--seconds")])
def test_bad_arguments_are_refused_by_name(bench, argv, what, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and what in capsys.readouterr().err
