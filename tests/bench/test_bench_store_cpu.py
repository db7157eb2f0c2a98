"""bench/bench_store_cpu.py end to end, tiny: every configuration's row is made from real stores
(a real SSD tier on disk, a real pool node process), and bad arguments are refused by name.
Counters only, never time (cost: ~5 s, most of it the pool node's start)."""

from __future__ import annotations

import json

import pytest

from support.bench import load_script


@pytest.fixture(scope="module")
def bench():
    yield from load_script("bench_store_cpu")


def test_every_configuration_gives_a_row_of_real_stores(bench, tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert bench.main(["--block", "16KiB", "--batch", "4", "--calls", "5", "--ssd-dir", str(tmp_path),
                       "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["config"] for r in rows] == list(bench.CONFIGS)
    assert all(r["blocks"] == 20 and r["block_bytes"] == 16 << 10 and r["cpu_us_per_block"] > 0 for r in rows)
    assert all(r["user_us_per_block"] + r["system_us_per_block"] == pytest.approx(r["cpu_us_per_block"])
               for r in rows)
    assert [r["node_cpu_us_per_block"] is not None for r in rows] == ["pool" in r["config"] for r in rows]
    table = capsys.readouterr().out
    assert all(c in table for c in bench.CONFIGS) and "x dram" in table and "system" in table
    assert not list(tmp_path.glob("kvtier-bench-store-cpu-*"))  # the SSD files went with the run


@pytest.mark.parametrize("argv, what", [(["--configs", "dram,nvme"], "--configs"), (["--block", "10"], "--block"),
                                        (["--calls", "0"], "--calls")])
def test_bad_arguments_are_refused_by_name(bench, argv, what, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and what in capsys.readouterr().err
