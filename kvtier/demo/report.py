"""What the demo measures besides time, and how it shows results: memory probes, per-tier
figures from the runtime's counters, rich tables, the PNG plot.

Memory is measured the way an operator should under load, three ways at once, because each alone
misleads: the framework's allocator (`torch.cuda` allocated vs reserved: reserved is what the
process really took from the GPU), the process's resident set (RSS, and its peak), and the share
of each tier's blocks in use (a tier's memory is allocated up front, so RSS does not show how full
it is).
"""

from __future__ import annotations

import resource
import statistics
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from kvtier.demo.noise import Load, experiment_notes, spread_notes
from kvtier.demo.ttft import SUFFIX_TOKENS


def proc_memory(pid: int | str = "self") -> dict[str, int | None]:
    """`VmRSS` and `VmHWM` (peak RSS) of a process, in bytes, from /proc; None where unavailable."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        text = ""
    fields = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    peak = fields.get("VmHWM")
    if peak is None and pid == "self":
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"rss_bytes": fields.get("VmRSS"), "peak_rss_bytes": peak}


def memory_probe(phase: str, kv: Any, device: torch.device, pool_pid: int | None = None) -> dict[str, Any]:
    """One memory row: framework allocator, process RSS, pool node RSS, share of each tier in use."""
    if device.type == "cuda":
        framework = "torch.cuda"
        allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    else:
        framework = "cpu: torch keeps no allocator counters on CPU; RSS is the measure"
        allocated = reserved = None
    usage = kv.usage()
    return {"phase": phase, "framework": framework, "allocated_bytes": allocated, "reserved_bytes": reserved,
            **proc_memory(),
            "pool_node_rss_bytes": proc_memory(pool_pid)["rss_bytes"] if pool_pid else None,
            "tier_share": {t: u["used"] / u["slots"] if u["slots"] else 0.0 for t, u in usage.items()},
            "tier_blocks": usage}


def tier_figures(snapshot: dict[str, Any], block_bytes: int) -> dict[str, dict[str, Any]]:
    """Per tier: hits, bytes read out of it for loads, mean ms per block, slots in use.

    A hit below the promotion tier is read on its way up (the block is promoted, and the load
    reads the promoted copy once it lands), so a tier's bytes loaded are those copied out of it
    into a request buffer or into a faster tier: counting the buffer routes alone would show a
    tier that served hits as having given no bytes whenever the faster tier had room.
    """
    out = {}
    order = list(snapshot["usage"])  # fastest first
    for i, (tier, usage) in enumerate(snapshot["usage"].items()):
        faster = set(order[:i])
        routes = [r for r in snapshot["bytes_moved"] if _loaded_out_of(r, tier, faster)]
        timed = [r for r in routes if r in snapshot["transfer_latency"]]
        num_blocks = sum(sum(snapshot["transfer_latency"][r][0]) for r in timed)
        seconds = sum(snapshot["transfer_latency"][r][1] for r in timed)
        out[tier] = {"hits": snapshot["hits"].get(tier, 0),
                     "bytes_loaded": sum(snapshot["bytes_moved"][r] for r in routes),
                     "mean_load_ms_per_block": 1e3 * seconds / num_blocks if num_blocks else None,
                     "used_blocks": usage["used"], "slots": usage["slots"],
                     "bytes_held": usage["used"] * block_bytes}
    return out


def _loaded_out_of(route: str, tier: str, faster: set[str]) -> bool:
    """Whether `route` ("src->dst", dst a tier or "buffer:<device>") copies out of `tier` toward a load."""
    src, _, dst = route.partition("->")
    return src == tier and (dst.partition(":")[0] == "buffer" or dst in faster)


def tier_table(figures: dict[str, dict[str, Any]], title: str) -> Table:
    table = Table("tier", "hits", "MiB loaded", "ms/block", "blocks in use", title=title,
                  caption="ms/block: submission to landing, queueing included")
    for tier, f in figures.items():
        ms = f["mean_load_ms_per_block"]
        table.add_row(tier, str(f["hits"]), f"{f['bytes_loaded'] / 2**20:.1f}", "-" if ms is None else f"{ms:.2f}",
                      f"{f['used_blocks']}/{f['slots']} ({100 * f['used_blocks'] / max(f['slots'], 1):.0f}%)")
    return table


def ttft_table(rows: list[dict[str, Any]]) -> Table:
    table = Table("prefix tokens", "prefix in", "recompute ms", "kvtier ms", "ratio", "speedup", "blocks hit",
                  "same token", title="TTFT: stored prefix vs recomputing it (ratio = kvtier / recompute)")
    for r in rows:
        table.add_row(f"{r['prefix_tokens']:,}", r["tier"], f"{r['recompute_ms']:.1f}", f"{r['kvtier_ms']:.1f}",
                      f"{r['ratio']:.3f}", f"{r['speedup']:.1f}x", f"{r['hits_from_tier']}/{r['num_blocks']}",
                      "yes" if r["identical"] else "[red]NO[/]")
    return table


def workload_ttft_table(summary: dict[str, Any]) -> Table:
    table = Table("turns", "prompt tokens (mean)", "served by kvtier", "recompute TTFT ms", "kvtier TTFT ms",
                  "ratio", title="Workload TTFT (turns whose prefix kvtier held; medians)")
    table.add_row(str(summary["num_turns"]), f"{summary['mean_prompt_tokens']:.0f}",
                  f"{100 * summary['cached_share']:.0f}%", f"{summary['recompute_ms']:.1f}",
                  f"{summary['kvtier_ms']:.1f}", f"{summary['ratio']:.3f}")
    return table


def memory_table(rows: list[dict[str, Any]]) -> Table:
    def mib(n: int | None) -> str:
        return "n/a" if n is None else f"{n / 2**20:.0f}"

    table = Table("phase", "allocated MiB", "reserved MiB", "RSS MiB", "peak RSS MiB", "pool node RSS MiB",
                  "tier blocks in use", title="Memory under load")
    for r in rows:
        shares = " ".join(f"{t} {100 * s:.0f}%" for t, s in r["tier_share"].items())
        table.add_row(r["phase"], mib(r["allocated_bytes"]), mib(r["reserved_bytes"]), mib(r["rss_bytes"]),
                      mib(r["peak_rss_bytes"]), mib(r["pool_node_rss_bytes"]), shares)
    return table


def print_report(console: Console, result: dict[str, Any]) -> None:
    """The tables after the workload (whose per-tier table was printed with its rounds), each followed
    by a note on any figure the machine's noise made (see `kvtier.demo.noise`)."""
    load = Load(**result["load"])
    console.print(workload_ttft_table(result["workload"]["ttft"]))
    _print_notes(console, spread_notes(_by_length(result["workload"]["turns"], "prompt_tokens"),
                                       "recomputing {n:,}-token prompts", load))
    console.print(ttft_table(result["ttft"]))
    _print_notes(console, experiment_notes(result["ttft"], list(result["final"]["usage"]), load))
    console.print(memory_table(result["memory"]))
    if result["memory"] and result["memory"][0]["allocated_bytes"] is None:
        console.print(f"framework memory: {result['memory'][0]['framework']}")
    console.print(f"machine: {load.describe()} (1-minute, /proc/loadavg, at the start and the end)")


def _by_length(rows: list[dict[str, Any]], length_field: str) -> dict[int, list[float]]:
    """Recompute timings (ms) grouped by size: repeated measurements of the same work."""
    out: dict[int, list[float]] = {}
    for r in rows:
        out.setdefault(r[length_field], []).append(r["recompute_ms"])
    return out


def _print_notes(console: Console, notes: list[str]) -> None:
    for note in notes:
        console.print(note, soft_wrap=True)


def plot(result: dict[str, Any], directory: Path) -> Path:
    """`kvtier-demo-ttft.png`: two panels, kvtier's TTFT (ms) against recomputing.

    Left: the workload's turns whose prefix kvtier held, grouped by prompt length (bars: medians;
    dots: each turn). Right (log scale): the prefix experiment, one group per prefix length, one
    bar per tier.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    _plot_workload(left, [t for t in result["workload"]["turns"] if t["cached_tokens"]])
    _plot_experiment(right, result["ttft"])
    fig.tight_layout()
    path = directory / "kvtier-demo-ttft.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot_workload(ax: Any, turns: list[dict[str, Any]]) -> None:
    lengths = sorted({t["prompt_tokens"] for t in turns})
    width = 0.4
    for i, (name, field) in enumerate([("recompute", "recompute_ms"), ("kvtier", "kvtier_ms")]):
        xs = [j + (i - 0.5) * width for j in range(len(lengths))]
        same = [[t[field] for t in turns if t["prompt_tokens"] == n] for n in lengths]
        bars = ax.bar(xs, [statistics.median(ms) for ms in same], width, label=f"{name} (median)", alpha=0.6)
        for x, ms in zip(xs, same):
            ax.scatter([x] * len(ms), ms, color=bars.patches[0].get_facecolor(), edgecolor="black", s=14,
                       zorder=3, alpha=1.0)
    counts = [sum(t["prompt_tokens"] == n for t in turns) for n in lengths]
    ax.set_xticks(range(len(lengths)), [f"{n:,}\n({c} turn{'s' * (c != 1)})" for n, c in zip(lengths, counts)])
    top = max((max(t["recompute_ms"], t["kvtier_ms"]) for t in turns), default=1.0)
    ax.set(xlabel="prompt length (tokens)", ylabel="time to first token (ms)", ylim=(0, 1.3 * top),
           title="Multi-turn workload: turns whose prefix kvtier held\n(bars: median; dots: each turn)")
    ax.legend(loc="upper center", ncol=2)


def _plot_experiment(ax: Any, rows: list[dict[str, Any]]) -> None:
    lengths = sorted({r["prefix_tokens"] for r in rows})
    tiers = list(dict.fromkeys(r["tier"] for r in rows))
    width = 0.8 / (len(tiers) + 1)
    for i, name in enumerate(["recompute", *tiers]):
        ms = [_experiment_ms(rows, n, name) for n in lengths]
        label = "recompute (median)" if name == "recompute" else f"kvtier, prefix in {name}"
        ax.bar([j + i * width for j in range(len(lengths))], ms, width, label=label)
    ax.set_xticks([j + width * len(tiers) / 2 for j in range(len(lengths))], [f"{n:,}" for n in lengths])
    ax.set(xlabel=f"stored prefix length (tokens; +{SUFFIX_TOKENS} new tokens computed)",
           ylabel="time to first token (ms, log scale)", yscale="log",
           title="Prefix placed in one tier vs recomputing it")
    _plain_log_ticks(ax.yaxis)
    ax.legend()


def _plain_log_ticks(axis: Any) -> None:
    """Ticks at 1, 2, 5 x 10^k labelled as plain numbers ("20", not "2 x 10^1")."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(subs=(1, 2, 5)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def _experiment_ms(rows: list[dict[str, Any]], length: int, name: str) -> float:
    same = [r for r in rows if r["prefix_tokens"] == length]
    if name == "recompute":
        return sorted(r["recompute_ms"] for r in same)[len(same) // 2]
    return next(r["kvtier_ms"] for r in same if r["tier"] == name)
