"""`kvtier bench`'s report on rows built by hand: small samples are flagged in the table, the notes,
the JSON and the plots, and the latency axis is labelled compactly.

Cost: well under a second for the table and JSON tests; the plot test imports matplotlib and writes
two small PNGs under tmp_path.
"""

from __future__ import annotations

import random

import pytest

from kvtier.bench import report
from kvtier.bench.measure import Measured, Row
from kvtier.bench.runner import BenchOptions, BenchResult

FACTS = {"hbm": {"stand_in": True, "reason": "no CUDA"},
         "machine": {"cpus": 2, "torch": "test", "checksum_code": "scalar"}}  # fmt: skip


def row(num_ops: int, ratio: float = 1.47, op: str = "spill", block_bytes: int = 1 << 20) -> Row:
    return Row("e2e-hbm-pool", op, block_bytes, 4, num_ops, p50_us=100.0, p99_us=900.0, p999_us=950.0, gbps=1.5,
               limit="raw TCP", limit_p50_us=80.0, limit_gbps=2.0, ratio=ratio)


def measured(r: Row, seed: int = 0) -> Measured:
    rng = random.Random(seed)
    return Measured(r, tuple(sorted(rng.uniform(300e-6, 4e-3) for _ in range(r.num_ops))))


def result(*rows: Row) -> BenchResult:
    return BenchResult(BenchOptions(), [measured(r, i) for i, r in enumerate(rows)], dict(FACTS), 1.0)


def cells(table: str, line: int) -> list[str]:
    return [c.strip() for c in table.splitlines()[line].strip("|").split("|")]


@pytest.mark.parametrize(
    ("num_ops", "p99", "p999", "ratio"),
    [(4, "-", "-", "1.47*"), (29, "-", "-", "1.47*"), (30, "-", "-", "1.47"), (100, "900", "-", "1.47"),
     (1000, "900", "950", "1.47")],
)  # fmt: skip
def test_table_shows_dash_for_percentiles_and_star_for_ratios_a_row_cannot_support(num_ops, p99, p999, ratio):
    line = cells(report.markdown_table([row(num_ops)]), 2)
    named = dict(zip(report.COLUMNS, line))
    assert (named["ops"], named["p99 µs"], named["p999 µs"], named["ratio"]) == (str(num_ops), p99, p999, ratio)
    assert named["p50 µs"] == "100"  # the median needs no more than one op


def test_notes_explain_the_marks_only_when_a_row_has_them():
    flagged = report.notes(result(row(4), row(2000)))
    assert any(n.startswith("-: too few ops") and "p99 needs 100" in n and "p999 needs 1,000" in n for n in flagged)
    assert any(n.startswith("*: ratio from fewer than 30 paired ops") for n in flagged)
    clean = report.notes(result(row(2000)))
    assert not any(n.startswith(("-:", "*:")) for n in clean)


def test_json_rows_carry_the_same_flags_and_keep_the_numbers():
    rows = report.to_json(result(row(4), row(150), row(2000)))["rows"]
    assert [(r["small_sample"], r["too_few_ops_for"]) for r in rows] == [
        (True, ["p99_us", "p999_us"]), (False, ["p999_us"]), (False, [])]
    assert all(r["p999_us"] == 950.0 and r["ratio"] == 1.47 for r in rows)  # flagged, not dropped


def test_compact_tick_labels():
    assert [report._compact(x) for x in (5, 50, 500, 1000, 2000, 20000, 1.5e6)] == [
        "5", "50", "500", "1k", "2k", "20k", "1.5M"]


def test_latency_cdf_labels_a_short_log_range_with_few_compact_ticks(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bench = result(row(8, op="spill"), row(40, op="spill", block_bytes=64 << 10), row(8, op="fill"))
    written = report.write_plots(bench, tmp_path)
    assert {p.name for p in written} == {"latency-cdf-e2e-hbm-pool.png", "bandwidth.png"}
    fig, ax = plt.subplots()
    try:
        ax.plot([300, 4000], [0, 1])  # 300 µs to 4 ms: the range whose minor labels used to collide
        report._log_ticks(ax)
        fig.canvas.draw()
        low, high = ax.get_xlim()
        shown = [t.get_text() for t, x in zip(ax.get_xticklabels(), ax.get_xticks()) if low <= x <= high]
        assert shown == ["500", "1k", "2k"]
        assert not any(t.get_text() for t in ax.xaxis.get_minorticklabels())
    finally:
        plt.close(fig)
