"""What a bench run reports: a Markdown table, a JSON document, PNG plots.

Plots (`write_plots`): one latency CDF per tier path (spill and fill side by side, a curve per block
size and queue depth) and one chart of bandwidth against block size (a panel per path, kvtier solid,
its limit dashed). matplotlib is imported only here, with the Agg backend: no display needed.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from kvtier.bench.measure import Measured, Row
from kvtier.bench.runner import BenchResult

COLUMNS = ("path", "op", "block", "qd", "ops", "p50 µs", "p99 µs", "p999 µs", "GB/s", "limit", "limit GB/s",
           "ratio")


def size_label(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _cells(r: Row) -> tuple[str, ...]:
    return (r.path, r.op, size_label(r.block_bytes), str(r.queue_depth), str(r.num_ops), f"{r.p50_us:,.0f}",
            f"{r.p99_us:,.0f}", f"{r.p999_us:,.0f}", f"{r.gbps:.2f}", r.limit, f"{r.limit_gbps:.2f}",
            f"{r.ratio:.2f}")


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
    return out


def to_json(result: BenchResult) -> dict:
    rows = [m.row for m in result.measured]
    return {"kvtier_bench": 1, **result.facts, "options": asdict(result.options),
            "elapsed_s": round(result.elapsed_s, 2), "notes": notes(result),
            "rows": [asdict(r) for r in rows], "table_markdown": markdown_table(rows)}


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
            ax.step(xs, ys, where="post", label=f"{size_label(m.row.block_bytes)} qd {m.row.queue_depth}")
        ax.set_xscale("log")
        ax.set_xlabel("latency per op (µs, log)")
        ax.set_title(f"{path} {op}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[0].set_ylabel("fraction of ops")
    out = directory / f"latency-cdf-{path}.png"
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def _bandwidth(plt, by_path: dict[str, list[Measured]], directory: Path) -> Path:
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
        ax.set_xlabel("block size (KiB)")
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
