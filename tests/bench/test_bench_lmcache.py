"""bench/bench_lmcache.py's pure parts: its command line, the summary of timed passes, the table, the
JSON document and the plots, from made-up samples. Nothing here installs or imports lmcache, torch
or kvtier's runtime (the measuring half is bench/bench_lmcache_run.py, run only by the script).
Cost: under a second, plus matplotlib's import for the plot test."""

from __future__ import annotations

import json

import pytest

from support.bench import BENCH_DIR, load_script

SCRIPT = BENCH_DIR / "bench_lmcache.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def bl():
    yield from load_script("bench_lmcache")


def test_the_script_imports_neither_lmcache_nor_torch_at_module_level(bl):
    source = SCRIPT.read_text()
    top_level = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert not [line for line in top_level if "torch" in line or "lmcache" in line or "kvtier" in line]


def test_defaults_cover_the_issue_sizes_in_rounds_of_three(bl):
    args = bl.parse_args([])
    assert args.sizes == (64 << 10, 256 << 10, 1 << 20, 4 << 20)
    assert args.rounds == 3 and args.batches == (1, 16) and args.round_mib == 64
    assert args.torch_threads == 1 and not args.sync and args.json is None and args.plot is None
    assert args.kvtier_root == SCRIPT.parents[1]


def test_quick_and_explicit_options(bl, tmp_path):
    args = bl.parse_args(["--quick", "--sizes", "64KiB,4m", "--batches", "4", "--rounds", "5", "--sync",
                          "--json", str(tmp_path / "o.json"), "--plot", str(tmp_path)])
    assert args.round_mib == 16 and args.sizes == (64 << 10, 4 << 20) and args.batches == (4,)
    assert args.rounds == 5 and args.sync and args.json == tmp_path / "o.json"
    assert bl.parse_args(["--quick", "--round-mib", "32"]).round_mib == 32


@pytest.mark.parametrize("argv, named", [
    (["--rounds", "2"], "--rounds"),
    (["--sizes", "12 parsecs"], "--sizes"),
    (["--sizes", "0KiB"], "--sizes"),
    (["--batches", "1,x"], "--batches"),
    (["--batches", "0"], "--batches"),
    (["--round-mib", "0"], "--round-mib"),
    (["--torch-threads", "0"], "--torch-threads"),
])
def test_bad_arguments_exit_2_naming_the_option(bl, capsys, argv, named):
    with pytest.raises(SystemExit) as e:
        bl.parse_args(argv)
    assert e.value.code == 2
    assert named in capsys.readouterr().err


def test_a_pass_is_whole_batches_of_about_round_mib(bl):
    assert bl.blocks_per_pass(64 << 10, 16, 64) == 1024
    assert bl.blocks_per_pass(64 << 10, 1, 16) == 256
    assert bl.blocks_per_pass(4 << 20, 16, 64) == 32  # never fewer than two calls
    assert bl.blocks_per_pass(1 << 20, 16, 20) == 16 * 2
    assert bl.blocks_per_pass(1 << 20, 3, 64) % 3 == 0


def fake_samples(bl, kv_gbps=(2.0, 2.4, 2.2), lmc_gbps=(1.0, 2.0, 1.1), size=1 << 20, batch=16):
    """Made-up passes of 64 blocks: seconds chosen so that each pass has the GB/s asked for."""
    out = []
    moved = 64 * size
    for op in ("store", "load"):
        for rnd, (k, l) in enumerate(zip(kv_gbps, lmc_gbps)):
            out.append(bl.Sample("kvtier", op, size, batch, rnd, 64, moved / (k * 1e9), 64e-6 * 10))
            out.append(bl.Sample("lmcache", op, size, batch, rnd, 64, moved / (l * 1e9), 64e-6 * 30))
            out.append(bl.Sample("memcpy", op, size, batch, rnd, 64, moved / 10e9, 64e-6 * 5))
    return out


def test_summary_pairs_rounds_and_spans_min_max(bl):
    rows = bl.summarize(fake_samples(bl))
    assert [(r["op"], r["block_bytes"], r["batch"]) for r in rows] == [("store", 1 << 20, 16), ("load", 1 << 20, 16)]
    row = rows[0]
    assert row["num_rounds"] == 3
    assert row["kvtier_gbps"] == pytest.approx((2.0, 2.4)) and row["lmcache_gbps"] == pytest.approx((1.0, 2.0))
    # per-round ratios 2.0, 1.2, 2.0: the span of ratios, not max(kv)/min(lmc)
    assert row["ratio"] == pytest.approx((1.2, 2.0))
    assert row["kvtier_cpu_us_per_block"] == pytest.approx((10.0, 10.0))
    assert row["lmcache_cpu_us_per_block"] == pytest.approx((30.0, 30.0))
    assert row["memcpy_gbps"] == pytest.approx((10.0, 10.0))
    assert row["goal_met"]  # the worst round is exactly 1.2


def test_one_round_below_the_goal_fails_the_row(bl):
    rows = bl.summarize(fake_samples(bl, kv_gbps=(2.0, 2.0, 2.0), lmc_gbps=(1.0, 1.0, 1.7)))
    assert rows[0]["ratio"] == pytest.approx((2.0 / 1.7, 2.0)) and not rows[0]["goal_met"]


def test_rows_are_ordered_store_first_then_by_size_and_batch(bl):
    samples = (fake_samples(bl, size=4 << 20, batch=1) + fake_samples(bl, size=64 << 10, batch=16)
               + fake_samples(bl, size=64 << 10, batch=1))
    rows = bl.summarize(samples)
    assert [(r["op"], r["block_bytes"], r["batch"]) for r in rows] == [
        ("store", 64 << 10, 1), ("store", 64 << 10, 16), ("store", 4 << 20, 1),
        ("load", 64 << 10, 1), ("load", 64 << 10, 16), ("load", 4 << 20, 1)]


def test_table_and_json_document(bl):
    doc = bl.report(fake_samples(bl), {"lmcache_version": "0.5.6"})
    text = json.dumps(doc)  # every value serialises
    back = json.loads(text)
    assert back["goal_ratio"] == 1.2 and back["facts"] == {"lmcache_version": "0.5.6"}
    assert len(back["samples"]) == 18 and {"gbps", "cpu_us_per_block", "system", "round"} <= set(back["samples"][0])
    lines = doc["table_markdown"].splitlines()
    assert lines[0].startswith("| op | block | batch | kvtier GB/s | LMCache GB/s | ratio |")
    assert len(lines) == 2 + len(doc["rows"])
    assert "| store / put | 1 MiB | 16 | 2.00-2.40 | 1.00-2.00 | 1.20-2.00 | met | 10-10 | 30-30 | 10.00-10.00 |" in lines


def test_rich_table_is_printed(bl, capsys):
    bl.print_table(bl.summarize(fake_samples(bl)), "kvtier vs LMCache")
    out = capsys.readouterr().out
    assert "kvtier vs LMCache" in out and "store / put" in out and "1.20-2.00" in out


def test_plots_are_pngs_one_per_op_and_batch(bl, tmp_path):
    rows = bl.summarize(fake_samples(bl, batch=1) + fake_samples(bl, batch=16) + fake_samples(bl, size=64 << 10))
    written = bl.write_plots(rows, tmp_path / "plots")
    assert sorted(p.name for p in written) == ["lmcache_load_batch1.png", "lmcache_load_batch16.png",
                                               "lmcache_store_batch1.png", "lmcache_store_batch16.png"]
    assert all(p.read_bytes().startswith(PNG_SIGNATURE) for p in written)


def test_the_venv_pins_torch_and_takes_kvtier_deps_from_pyproject(bl):
    assert bl.TORCH == "torch==2.13.0" and bl.TORCH in bl.CONSTRAINTS
    assert bl.LMCACHE == "lmcache==0.5.6"
    deps = bl.kvtier_requirements(SCRIPT.parents[1])
    assert deps and not [d for d in deps if d.lower().startswith("torch")]
    assert any(d.lower().startswith("xxhash") for d in deps)
    assert not [d for d in bl.LMCACHE_DEPS if "cuda" in d or "cupy" in d or d.startswith("torch")]
