"""`kvtier simulate`'s output: the sweep's bisection, one rounding rule for shares, tables at 80 columns,
progress per configuration, the top-level figures with several runs, and the admission note.

Cost: ~5 s on two CPU cores (hand-made traces, and replays of 600 to 1,000 requests of the Mooncake
traces where a sweep needs a curve). Counts are asserted, never wall-clock time.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from rich.console import Console
from rich.progress import Progress

from kvtier.cli import main
from kvtier.cli import simulate as simulate_cli
from kvtier.cli.simulate_tables import print_report
from kvtier.simulate.replay import SimConfig, VirtualTier, blocks_of_share, parse_capacity, simulate
from kvtier.simulate.sweep import (DEFAULT_SWEEP_SHARES, bisect_capacity, default_points, recommend, search_smallest,
                                   sweep)
from kvtier.simulate.trace import load_trace
from kvtier.kinds import TierKind
from support.traces import TINY_TRACE as TINY, TRACE_DIR, needs_traces

DRAM = TierKind.DRAM


def write_trace(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def run_cli(capsys, *args: str) -> dict:
    code = main(["simulate", "--no-progress", "--json", *args])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


# ---- percent -> blocks: one rule ------------------------------------------------------------


@pytest.mark.parametrize("num_unique_blocks", [474_091, 182_790, 13_712, 199, 7])
def test_a_share_names_the_same_size_in_capacity_and_sweep(num_unique_blocks):
    class Trace:  # default_points reads only this
        pass

    trace = Trace()
    trace.num_unique_blocks = num_unique_blocks
    points = default_points(trace)
    for share in DEFAULT_SWEEP_SHARES:
        blocks = blocks_of_share(share, num_unique_blocks)
        if blocks >= 1:
            parsed = parse_capacity(f"{share * 100:g}%", block_bytes=1, num_unique_blocks=num_unique_blocks, where="c")
            assert parsed == blocks and blocks in points


def test_five_percent_of_the_agentic_trace_size_is_one_count():
    # The numbers: 5 % of 474,091 distinct blocks is 23,704.55; both paths now say 23,705.
    assert parse_capacity("5%", block_bytes=1, num_unique_blocks=474_091, where="c") == 23_705
    assert blocks_of_share(0.05, 474_091) == 23_705


def test_cli_capacity_share_equals_the_sweeps_point(capsys, tmp_path):
    lines = [{"timestamp": i, "input_length": 512 * 3, "output_length": 1, "hash_ids": [3 * i, 3 * i + 1, 3 * i + 2]}
             for i in range(15)]  # 45 distinct blocks: 5 % is 2.25, 75 % is 33.75
    trace = write_trace(tmp_path / "t.jsonl", lines)
    for share in ("5%", "75%"):
        report = run_cli(capsys, "--trace", str(trace), "--capacity", f"dram={share}", "--sweep")
        assert report["tiers"]["dram"]["num_slots"] in report["sweep"]["points"]


# ---- the sweep searches down to the exact size ----------------------------------------------


def test_bisect_capacity_returns_a_boundary_and_asks_only_inside_the_bracket():
    asked = []

    def reaches(size):
        asked.append(size)
        return size >= 57

    assert bisect_capacity(reaches, 47, 95) == 57
    assert all(47 < size < 95 for size in asked) and 56 in asked


@needs_traces
def test_the_sweep_recommends_the_smallest_size_reaching_the_target_not_the_grid_point():
    trace = load_trace(TRACE_DIR / "synthetic_trace.jsonl", limit=1000)
    config = SimConfig((VirtualTier(DRAM, 1, 25.0),), block_bytes=1 << 20)
    points = [100, 1000, 10_000]
    rows = sweep(trace, [config], DRAM, points, 25.0)
    rates = [r["block_hit_rate"] for r in rows]
    target = (rates[1] + rates[2]) / 2  # first reached at the grid's 10,000
    search = search_smallest(trace, config, DRAM, rows, target, 25.0)
    assert (search["below_blocks"], search["above_blocks"]) == (1000, 10_000)
    choice = recommend(rows, target, trace.max_block_hit_rate, [search])
    size = choice["recommended"]["capacity_blocks"]
    assert 1000 < size < 10_000 and size == search["capacity_blocks"]

    def rate(num_slots: int) -> float:
        return simulate(trace, SimConfig((VirtualTier(DRAM, num_slots, 25.0),), block_bytes=1 << 20))["block_hit_rate"]

    assert rate(size) >= target > rate(size - 1)
    assert choice["search"]["method"] == "bisection" and choice["search"]["num_replays"] == len(search["rows"])
    assert f"{size:,} blocks" in choice["message"] and "bisection" in choice["message"]
    assert f"{size - 1:,} blocks fall short" in choice["message"]


@needs_traces
def test_cli_sweep_bisects_only_the_configurations_that_can_be_recommended(capsys):
    report = run_cli(capsys, "--trace", str(TRACE_DIR / "synthetic_trace.jsonl"), "--limit", "600",
                     "--capacity", "dram=1%", "--policy", "lru,belady", "--sweep", "--sweep-points", "100,1000,10000",
                     "--target-hit-rate", "5%")
    sweep_report = report["sweep"]
    assert sweep_report["points"] == [100, 1000, 10_000]  # the table's grid stays the grid
    assert [s["label"] for s in sweep_report["searches"]] == ["lru"]  # Belady is never recommended nor bisected
    recommendation = sweep_report["recommendation"]
    assert recommendation["recommended"]["capacity_blocks"] == sweep_report["searches"][0]["capacity_blocks"]
    assert recommendation["search"]["below_blocks"] < recommendation["recommended"]["capacity_blocks"]


# ---- tables fit 80 columns ------------------------------------------------------------------


def big_report() -> dict:
    """A report with the widest figures a long agentic trace gives, three tiers and many runs."""
    def tier(n: int) -> dict:
        return {"num_slots": 94_820 + n, "capacity_bytes": 94_820 * (160 << 20), "hit_rate": 0.276,
                "hits": 7_591_123 + n, "stores": 12_345_678, "evictions": 11_234_567,
                "bytes_read": 7_591_123 * (160 << 20), "bytes_written": 12_345_678 * (160 << 20)}

    runs = [{"label": label, "block_hit_rate": 0.844, "tiers": {"hbm": tier(1), "dram": tier(2), "ssd": tier(3)},
             "prefill": {"token_hit_rate": 0.8}, "ttft_s": {"p50": 12.345, "p90": 123.456, "p99": 1234.567},
             "ttft_no_cache_s": {"p50": 23.456}}
            for label in ("lru", "lru+admission", "chain-arc+admission", "belady+admission")]
    rows = [{"label": r["label"], "capacity_blocks": p, "capacity_bytes": p * (160 << 20), "block_hit_rate": 0.5}
            for r in runs for p in (4_741, 23_705, 94_820, 474_091)]
    return {
        "trace": {"path": "agentic.jsonl", "num_requests": 10, "num_accesses": 7_591_123, "num_unique_blocks": 474_091,
                  "max_block_hit_rate": 0.9, "hash_ids_per_request": {}},
        "model": {"name": "m", "kv_dtype": "fp16", "block_tokens": 512, "kv_bytes_per_token": 327_680,
                  "block_bytes": 160 << 20},
        "runs": runs, "notes": [],
        "sweep": {"tier": "ssd", "points": [4_741, 23_705, 94_820, 474_091], "rows": rows,
                  "recommendation": {"message": "m"}},
    }


def test_tables_fit_80_columns_and_show_every_number_whole():
    console = Console(width=80, record=True, file=io.StringIO(), color_system=None)
    print_report(big_report(), console)
    text = console.export_text()
    table_lines = [line for line in text.splitlines() if line[:1] in "┏┃┡│├└"]
    assert table_lines and all(len(line) <= 80 for line in table_lines)
    assert "…" not in text
    for number in ("7,591,124", "7,591,126", "12,345,678", "11,234,567", "94,823", "474,091", "1234.567 s", "84.4%"):
        assert number in text, number
    assert "chain-arc+admission" in text
    assert "not shown, too wide for 80 columns" in text  # what was dropped is said


def test_a_wide_console_shows_every_column_in_one_table():
    console = Console(width=200, record=True, file=io.StringIO(), color_system=None)
    print_report(big_report(), console)
    text = console.export_text()
    assert "not shown" not in text and "(1/2)" not in text and "no cache" in text and "capacity" in text


# ---- progress per configuration, and while the trace loads ----------------------------------


def test_one_progress_task_per_configuration_named_by_its_label(tmp_path):
    trace = load_trace(write_trace(tmp_path / "tiny.jsonl", TINY))
    configs = [SimConfig((VirtualTier(DRAM, 3, 25.0),), block_bytes=1, policy=p) for p in simulate_cli._policies(
        ["lru,arc,belady"])]
    progress = Progress(console=Console(file=io.StringIO()), auto_refresh=False)
    bars = simulate_cli._Bars(progress)
    runs, rows = simulate_cli._replay(trace, configs, True, (DRAM, [2, 6], 25.0), bars)
    assert [t.description for t in progress.tasks] == ["lru", "arc", "belady"]
    for task in progress.tasks:  # each its own count: one run and two sweep points of 5 requests
        assert task.total == 15 and task.completed == 15
    assert len(runs) == 3 and len(rows) == 6


def test_progress_and_the_loading_status_show_on_a_terminal_and_not_with_no_progress(monkeypatch, tmp_path, capsys):
    trace = write_trace(tmp_path / "tiny.jsonl", TINY)
    shown = io.StringIO()
    monkeypatch.setattr(simulate_cli, "Console", lambda **kw: Console(
        file=shown if kw.get("stderr") else io.StringIO(), force_terminal=True, width=100))
    assert main(["simulate", "--trace", str(trace), "--capacity", "dram=3", "--policy", "lru,arc", "--json"]) == 0
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown.getvalue())
    assert "loading" in text and "lru" in text and "arc" in text
    shown.seek(0)
    shown.truncate()
    assert main(["simulate", "--no-progress", "--trace", str(trace), "--capacity", "dram=3", "--json"]) == 0
    assert shown.getvalue() == ""
    capsys.readouterr()


# ---- several runs: no top-level figure that belongs to one of them --------------------------


def test_with_several_policies_the_top_level_hit_rate_is_each_runs_by_label(capsys, tmp_path):
    trace = write_trace(tmp_path / "tiny.jsonl", TINY)
    report = run_cli(capsys, "--trace", str(trace), "--capacity", "hbm=3", "--policy", "lru,belady")
    assert "block_hit_rate" not in report and "tiers" not in report
    assert report["block_hit_rate_by_run"] == {r["label"]: r["block_hit_rate"] for r in report["runs"]}
    assert report["block_hit_rate_by_run"]["lru"] != report["block_hit_rate_by_run"]["belady"]
    one = run_cli(capsys, "--trace", str(trace), "--capacity", "hbm=3")
    assert one["block_hit_rate"] == one["runs"][0]["block_hit_rate"] and "block_hit_rate_by_run" not in one


# ---- admission says why an SSD tier hits less ---------------------------------------------


def test_admission_on_an_ssd_tier_is_explained_in_one_note(capsys, tmp_path):
    trace = write_trace(tmp_path / "tiny.jsonl", TINY)
    report = run_cli(capsys, "--trace", str(trace), "--capacity", "dram=1", "--capacity", "ssd=6",
                     "--admission", "both")
    plain, filtered = report["runs"]
    (note,) = [n for n in report["notes"] if "admission lets" in n]
    refused = filtered["dropped"]["admission_rejected"]
    assert refused > 0 and note.startswith("lru+admission: admission lets ssd take only blocks already hit at least 1")
    assert f"{refused:,} blocks not reused yet" in note
    assert (f"ssd {plain['tiers']['ssd']['hit_rate']:.1%} -> {filtered['tiers']['ssd']['hit_rate']:.1%}" in note)
    assert filtered["tiers"]["ssd"]["hit_rate"] < plain["tiers"]["ssd"]["hit_rate"]
