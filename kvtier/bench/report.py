"""What a bench run reports: a Markdown table, a JSON document, PNG plots.

Plots (`write_plots`): one latency CDF per tier path (spill and fill side by side, a curve per block
size and queue depth) and one chart of bandwidth against block size (a panel per path, kvtier solid,
its limit dashed). matplotlib is imported only here, with the Agg backend: no display needed.

Small samples are marked, not hidden: a row with too few ops for a percentile shows "-" for it (p99
needs 100 ops, p999 1,000), a ratio from fewer than 30 paired ops gets a "*", each with a footnote
in `notes`; the JSON keeps every number and says the same in `small_sample` and `too_few_ops_for`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from kvtier.bench.measure import Measured, Row
from kvtier.bench.runner import BenchResult

COLUMNS = ("path", "op", "block", "qd", "ops", "p50 µs", "p99 µs", "p999 µs", "GB/s", "limit", "limit GB/s",
           "ratio")

# A percentile needs enough ops to have a tail: with fewer than 100, "p99" is just the slowest op.
MIN_OPS_FOR_PERCENTILE = {"p99_us": 100, "p999_us": 1000}
# A median ratio of fewer paired ops than this swings run to run (ratios of 1.5 come and go): flagged.
MIN_OPS_FOR_RATIO = 30


def size_label(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def too_few_ops_for(r: Row) -> list[str]:
    """The percentile fields (`p99_us`, `p999_us`) that `r` has too few ops to measure."""
    return [field for field, need in MIN_OPS_FOR_PERCENTILE.items() if r.num_ops < need]


def small_sample(r: Row) -> bool:
    """Whether `r`'s ratio rests on fewer than `MIN_OPS_FOR_RATIO` paired ops."""
    return r.num_ops < MIN_OPS_FOR_RATIO


def _cells(r: Row) -> tuple[str, ...]:
    missing = too_few_ops_for(r)
    p99, p999 = ("-" if f in missing else f"{getattr(r, f):,.0f}" for f in ("p99_us", "p999_us"))
    ratio = f"{r.ratio:.2f}" + ("*" if small_sample(r) else "")
    return (r.path, r.op, size_label(r.block_bytes), str(r.queue_depth), str(r.num_ops), f"{r.p50_us:,.0f}",
            p99, p999, f"{r.gbps:.2f}", r.limit, f"{r.limit_gbps:.2f}", ratio)


def markdown_table(rows: list[Row]) -> str:
    """A GitHub Markdown table of every row, numbers right-aligned."""
    right = {"qd", "ops", "p50 µs", "p99 µs", "p999 µs", "GB/s", "limit GB/s", "ratio"}
    lines = ["| " + " | ".join(COLUMNS) + " |",
             "|" + "|".join("---:" if c in right else "---" for c in COLUMNS) + "|"]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def notes(result: BenchResult) -> list[str]:
    """One line per fact a reader needs to read the table right: HBM stand-in, transport, O_DIRECT."""
    f = result.facts
    out = []
    hbm = f.get("hbm", {})
    out.append(f"HBM: {'CPU stand-in — ' + hbm['reason'] if hbm.get('stand_in') else hbm.get('device')}")
    if "pool" in f:
        p = f["pool"]
        where = "started here" if p["started_here"] else "given with --pool"
        client = p.get("client_transport")
        client = f"; the client used {client}" if client and client != p["transport"] else ""
        out.append(f"pool: node {p['address']} ({where}), transport {p['transport']} ({p['transport_reason']}){client}")
        if not p["started_here"]:
            out.append("pool limit: the raw socket runs on loopback here, not to the --pool node's machine: "
                       "kvtier's ratio to it includes the network")
    if "ssd" in f:
        s = f["ssd"]
        direct = "O_DIRECT active" if s["o_direct"] else "O_DIRECT NOT active (buffered I/O)"
        out.append(f"SSD: {s['dir']} ({s['filesystem']}), {direct}: {s['reason']}")
    m = f["machine"]
    out.append(f"machine: {m['cpus']} CPUs, torch {m['torch']}{', ' + m['gpu'] if m.get('gpu') else ''}, "
               f"xxh3 checksums: {m.get('checksum_code', '?')} code; {result.elapsed_s:.1f} s")
    out.append("ratio = median over paired ops of limit time / kvtier time; GB/s = bytes per op x depth / p50; "
               "end-to-end ops are one call of qd blocks")
    out += sample_notes([m.row for m in result.measured])
    return out


def sample_notes(rows: list[Row]) -> list[str]:
    """Footnotes for the table's "-" percentiles and "*" ratios, only where some row has them."""
    out = []
    if any(too_few_ops_for(r) for r in rows):
        needs = ", ".join(f"{f.removesuffix('_us')} needs {n:,}" for f, n in MIN_OPS_FOR_PERCENTILE.items())
        out.append(f"-: too few ops in the row for that percentile ({needs}); the JSON keeps the value, "
                   "with the field named in too_few_ops_for")
    if any(small_sample(r) for r in rows):
        out.append(f"*: ratio from fewer than {MIN_OPS_FOR_RATIO} paired ops, a small sample: it can land well "
                   "above or below what a longer run gives; small_sample in the JSON; run longer with --row-seconds")
    return out


def to_json(result: BenchResult) -> dict:
    rows = [m.row for m in result.measured]
    return {"kvtier_bench": 1, **result.facts, "options": asdict(result.options),
            "elapsed_s": round(result.elapsed_s, 2), "notes": notes(result),
            "rows": [row_json(r) for r in rows], "table_markdown": markdown_table(rows)}


def row_json(r: Row) -> dict:
    """A row's fields, and how far to trust them: `small_sample` (the ratio) and `too_few_ops_for`."""
    return asdict(r) | {"small_sample": small_sample(r), "too_few_ops_for": too_few_ops_for(r)}


def write_json(result: BenchResult, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(result), indent=2))


def write_plots(result: BenchResult, directory: Path) -> list[Path]:
    """Writes `latency-cdf-<path>.png` for each path and `bandwidth.png`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    by_path: dict[str, list[Measured]] = {}
    for m in result.measured:
        by_path.setdefault(m.row.path, []).append(m)
    written = [_latency_cdf(plt, path, ms, directory) for path, ms in by_path.items()]
    written.append(_bandwidth(plt, by_path, directory))
    return written


def _latency_cdf(plt, path: str, measured: list[Measured], directory: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    ops = list(dict.fromkeys(m.row.op for m in measured))  # spill, fill; fill-first, fill for a shared row
    for ax, op in zip(axes, ops):
        for m in (m for m in measured if m.row.op == op):
            xs = [s * 1e6 for s in m.latencies_s]
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            label = f"{size_label(m.row.block_bytes)} qd {m.row.queue_depth}, {m.row.num_ops} ops"
            ax.step(xs, ys, where="post", label=label + ("*" if small_sample(m.row) else ""))
        _log_ticks(ax)
        ax.set_xlabel("latency per op (µs, log scale)")
        ax.set_title(f"{path} {op}")
        ax.grid(True, which="both", alpha=0.3)
        small = any(small_sample(m.row) for m in measured if m.row.op == op)
        ax.legend(fontsize=7, loc="lower right", title=f"* under {MIN_OPS_FOR_RATIO} ops" if small else None,
                  title_fontsize=7)
    axes[0].set_ylabel("fraction of ops")
    out = directory / f"latency-cdf-{path}.png"
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def _log_ticks(ax) -> None:
    """Labels a log x axis at 1-2-5 steps (fewer over wide ranges) as `50`, `200`, `1k`, `20k`: matplotlib's
    own labels for a range under a decade are `3×10²`-style minor labels that run into each other."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    low, high = ax.get_xlim()
    decades = math.log10(high / low) if low > 0 else 6
    subs = (1.0, 2.0, 5.0) if decades <= 3 else (1.0, 3.0) if decades <= 5 else (1.0,)
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.xaxis.set_major_formatter(FuncFormatter(_compact))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _compact(x: float, _pos: object = None) -> str:
    """`500` -> "500", `2000` -> "2k", `1.5e6` -> "1.5M"."""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:g}{suffix}"
    return f"{x:g}"


def _bandwidth(plt, by_path: dict[str, list[Measured]], directory: Path) -> Path:
    from matplotlib.ticker import NullLocator

    cols = min(3, len(by_path))
    rows = -(-len(by_path) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False)
    for ax, (path, measured) in zip(axes.flat, by_path.items()):
        series: dict[tuple[str, int], list[Row]] = {}
        for m in measured:
            series.setdefault((m.row.op, m.row.queue_depth), []).append(m.row)
        for (op, qd), rows_ in series.items():
            rows_.sort(key=lambda r: r.block_bytes)
            xs = [r.block_bytes / 1024 for r in rows_]
            line, = ax.plot(xs, [r.gbps for r in rows_], marker="o", label=f"{op} qd {qd}")
            ax.plot(xs, [r.limit_gbps for r in rows_], linestyle="--", color=line.get_color(), alpha=0.6)
        ax.set_xscale("log", base=2)
        sizes = sorted({m.row.block_bytes for m in measured})
        ax.set_xticks([n / 1024 for n in sizes], [size_label(n) for n in sizes])  # the sizes measured, not 2^k
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("block size")
        ax.set_ylabel("GB/s (dashed: limit)")
        ax.set_title(path)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(by_path):]:
        ax.set_visible(False)
    out = directory / "bandwidth.png"
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
