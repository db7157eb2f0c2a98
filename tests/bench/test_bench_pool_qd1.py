"""bench/bench_pool_qd1.py end to end, tiny: every way reads real bytes from a real pool node process
(the runtime's load is checked against what was stored), and bad arguments are refused by name.
Counters only, never time (cost: ~5 s, most of it the node's and the raw server's start)."""

from __future__ import annotations

import json

import pytest

from support.bench import load_script

WAYS = ["raw", "bare client", "PoolClient.get", "KVTier.load"]


@pytest.fixture(scope="module")
def bench():
    yield from load_script("bench_pool_qd1")


def test_every_way_gives_a_row(bench, tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert bench.main(["--block", "128KiB", "--ops", "20", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["block_bytes"] == 128 << 10 and result["ops"] == 20
    rows = result["rows"]
    assert [r["way"] for r in rows] == WAYS
    assert all(r["p50_us"] > 0 and r["ratio_to_raw"] > 0 and r["cpu_us_per_op"] > 0 for r in rows)
    assert rows[0]["ratio_to_raw"] == 1.0  # raw against itself, pair by pair
    table = capsys.readouterr().out
    assert all(w in table for w in WAYS) and "raw / way" in table


@pytest.mark.parametrize("argv, what", [(["--block", "10"], "--block"), (["--block", "12KiB"], "--block"),
                                        (["--ops", "0"], "--ops")])
def test_bad_arguments_are_refused_by_name(bench, argv, what, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and what in capsys.readouterr().err
