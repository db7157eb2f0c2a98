"""`kvtier simulate`: replay a Mooncake trace through kvtier's manager to size the tiers before buying them.

This module only parses arguments, calls `kvtier.simulate.replay` / `kvtier.simulate.sweep` and prints; the
accounting and the TTFT model are documented in `kvtier/simulate/replay.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from kvtier.cli.bench import create_folder
from kvtier.model.catalog import match_note, resolve_model
from kvtier.cli.simulate_tables import print_report
from kvtier.config import CacheMode
from kvtier.errors import ConfigError
from kvtier.simulate.replay import (DEFAULT_BANDWIDTH_GBPS, DEFAULT_MODEL, DEFAULT_PREFILL_TOKENS_PER_S, SimConfig,
                                    SimPolicy, VirtualTier, native_declines, parse_capacity, simulate)
from kvtier.simulate.hints import compare_hints, derive_hints, parse_hints
from kvtier.simulate.report import admission_notes
from kvtier.simulate.servers import Route, check_num_servers, compare, planned_replays, plot_servers
from kvtier.simulate.sweep import (bracket, default_points, default_target, labels_to_search, planned_bisections,
                                  plot_runs, plot_sweep, recommend, search_smallest, sweep)
from kvtier.simulate.trace import MOONCAKE_BLOCK_TOKENS, OnError, Trace, load_trace, resolve_trace_path
from kvtier.kinds import TierKind
from kvtier.units import check_number

MAX_BLOCK_TOKENS = 2**31 - 1  # times at most 2**31 blocks, token counts stay within the replay's 64-bit counters

EXAMPLES = """examples:
  kvtier simulate --trace conversation --capacity hbm=18279
  kvtier simulate --trace conversation --capacity hbm=1000 --capacity dram=5000 --capacity ssd=20000 \\
      --policy all --admission both
  kvtier simulate --trace synthetic --model llama-3-8b --capacity dram=64GiB --capacity ssd=2TiB --json
  kvtier simulate --trace conversation --capacity hbm=2000 --sweep --sweep-tier dram --plot plots/
  kvtier simulate --trace conversation --servers 4 --capacity dram=2.5% --plot plots/
  kvtier simulate --trace conversation --capacity dram=5% --policy lru,chain-arc --hints session-end
capacities: blocks (18279), bytes (64GiB, 500GB: needs the model's block size) or a share of the
trace's distinct blocks (10%). Tiers: hbm, dram, pool, ssd."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers `simulate` on the `kvtier` command's subparsers."""
    p = subparsers.add_parser(
        "simulate", help="replay a Mooncake trace through the manager: hit rate per tier, bytes moved, TTFT",
        description="Replay a request trace through kvtier's manager and policies with virtual tiers.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, metavar="FILE",
                   help="JSONL trace (.jsonl, .gz, .zst), or the name of a trace shipped with kvtier: conversation, synthetic (Mooncake)")
    p.add_argument("--capacity", action="append", default=[], metavar="TIER=N", help="a tier and its capacity (repeat)")
    p.add_argument("--bandwidth", action="append", default=[], metavar="TIER=GB/s",
                   help="load bandwidth of a tier (defaults: " + ", ".join(
                       f"{k.name.lower()} {v:g}" for k, v in DEFAULT_BANDWIDTH_GBPS.items()) + ")")
    p.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME|config.json",
                   help=f"sizes a block: 512 tokens x KV bytes/token (default {DEFAULT_MODEL})")
    p.add_argument("--kv-dtype", default=None, metavar="DTYPE", help="fp16, bf16, fp8, ... (default: the model's)")
    p.add_argument("--policy", action="append", default=None, metavar="NAME",
                   help="lru, s3fifo, arc, chain-arc, belady or all; repeat or comma-separate to compare (default lru)")
    p.add_argument("--admission", choices=("off", "on", "both"), default="off",
                   help="on: pool and SSD admit only blocks already hit once (default off)")
    p.add_argument("--mode", choices=[m.value for m in CacheMode], default=CacheMode.EXCLUSIVE.value)
    p.add_argument("--promote-to", default="dram", metavar="TIER|none", help="hits below this tier move into it")
    p.add_argument("--high-watermark", type=float, default=0.95, metavar="F",
                   help="of every tier but the last (default 0.95)")
    p.add_argument("--low-watermark", type=float, default=0.85, metavar="F",
                   help="of every tier but the last (default 0.85)")
    p.add_argument("--prefill-tokens-per-s", type=float, default=DEFAULT_PREFILL_TOKENS_PER_S, metavar="N",
                   help=f"prefill throughput of the TTFT model (default {DEFAULT_PREFILL_TOKENS_PER_S:,.0f})")
    p.add_argument("--block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS, metavar="N",
                   help="tokens per hash id (default 512)")
    p.add_argument("--full-blocks-only", action="store_true", help="ignore each request's partial tail block")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="replay only the first N requests")
    p.add_argument("--on-error", choices=[e.value for e in OnError], default=OnError.STOP.value,
                   help="malformed trace lines: stop with an error naming the line (default) or skip them")
    p.add_argument("--sweep", action="store_true", help="sweep one tier's capacity, then bisect to the smallest reaching the target, and recommend it")
    p.add_argument("--sweep-tier", default=None, metavar="TIER", help="tier to sweep (default: the last --capacity)")
    p.add_argument("--sweep-points", default=None, metavar="N,N,...",
                   help="capacities to try (default 1%%,2%%,5%%,10%%,20%%,30%%,50%%,75%%,100%% of distinct blocks)")
    p.add_argument("--target-hit-rate", default=None, metavar="R",
                   help="block hit rate to reach, 0.3 or 30%% (default: 90%% of the trace's maximum)")
    p.add_argument("--servers", default=None, metavar="N",
                   help="spread the trace over N servers: N private DRAM tiers (--capacity dram=D each) against "
                        "one pool of N x D shared by all, and the smallest pool matching the private hit rate")
    p.add_argument("--route", choices=[r.value for r in Route], default=None,
                   help="with --servers: by conversation (session affinity, default) or round-robin by request")
    p.add_argument("--hints", default=None, metavar="SPEC",
                   help="derive retention hints (session-end, ttl=300s, wrong=0.1; comma-separated) and report "
                        "each run with and without them, as shares of the LRU -> Belady gap (kvtier/simulate/hints.py)")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of tables")
    p.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots into DIR")
    p.add_argument("--no-progress", action="store_true", help="no progress bars or loading status")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Runs the simulation(s) described by `args` and prints the report.

    Raises:
        TraceError: unreadable trace, or a malformed line with --on-error stop.
        GeometryError: unknown model or KV dtype.
        ConfigError, CapacityError: bad tiers, capacities, bandwidths or options.
    """
    num_servers = _check_servers_options(args)
    if args.plot:
        create_folder(Path(args.plot), "--plot")  # now, not after a replay of minutes
    block_tokens = _positive_int(args.block_tokens, "block-tokens", maximum=MAX_BLOCK_TOKENS)
    limit = None if args.limit is None else _positive_int(args.limit, "limit")
    path = resolve_trace_path(args.trace)
    with _loading(path, not args.no_progress):
        trace = load_trace(path, block_tokens=block_tokens, on_error=OnError(args.on_error), limit=limit)
    if trace.skipped_lines:
        _warn_skipped(trace)
    geometry = resolve_model(args.model, kv_dtype=args.kv_dtype)
    note = match_note(args.model)
    if note:
        print(note, file=sys.stderr)
    block_bytes = geometry.block_bytes(trace.block_tokens)
    bandwidths = DEFAULT_BANDWIDTH_GBPS | _pairs(args.bandwidth, "bandwidth", _bandwidth)
    capacities = _pairs(args.capacity, "capacity", lambda v, where: parse_capacity(
        v, block_bytes=block_bytes, num_unique_blocks=trace.num_unique_blocks, where=where))
    if num_servers is not None:
        return _run_servers(args, trace, geometry, block_bytes, capacities, bandwidths, num_servers)
    if not capacities and not args.sweep:
        raise ConfigError("capacity: give at least one --capacity TIER=N (e.g. --capacity dram=10%), or --sweep")
    sweep_tier = _tier(args.sweep_tier, "sweep-tier") if args.sweep_tier else (max(capacities) if capacities
                                                                                 else TierKind.DRAM)
    tiers = capacities or {sweep_tier: 1}  # a sweep-only run: the swept tier's size is replaced anyway
    configs = _configs(args, tiers, bandwidths, block_bytes)
    if args.hints is not None:
        return _run_hints(args, trace, geometry, block_bytes, configs, sweep_tier)
    points = _sweep_points(args, trace, block_bytes) if args.sweep else []
    target = _target(args, trace) if points else None
    with _progress(not args.no_progress) as bars:
        runs, rows = _replay(trace, configs, bool(capacities), (sweep_tier, points, bandwidths[sweep_tier]), bars)
        searches = _search(trace, configs, rows, target, (sweep_tier, points, bandwidths[sweep_tier]), bars)
    report = _report(args, trace, geometry, block_bytes, runs, rows, sweep_tier, searches, target)
    if args.plot:
        report["plots"] = _plots(Path(args.plot), runs, rows, report, trace)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report, Console() if sys.stdout.isatty() else Console(width=160))
    return 0


def _run_hints(args: argparse.Namespace, trace: Trace, geometry: Any, block_bytes: int, configs: list[SimConfig],
               sweep_tier: TierKind) -> int:
    """`--hints SPEC`: every configuration with and without derived hints (kvtier/simulate/hints.py)."""
    if args.sweep or not args.capacity:
        raise ConfigError("hints: --hints needs --capacity and cannot be combined with --sweep")
    spec = parse_hints(args.hints)
    hinted = derive_hints(trace, spec)
    for config in configs:
        declined = native_declines(config)
        if declined is not None:
            print(f"kvtier simulate: --hints: {declined}; the {config.label} runs use the manager", file=sys.stderr)
    with _progress(not args.no_progress) as bars:
        for config in configs:
            bars.add(config.label, 2 * len(trace.requests))
        rows = compare_hints(trace, hinted, configs, lambda config, _: bars.advance(config.label))
    report = _report(args, trace, geometry, block_bytes, [], [], sweep_tier)
    report["hints"] = {"spec": spec.label, "rows": rows}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report, Console() if sys.stdout.isatty() else Console(width=160))
    return 0


def _check_servers_options(args: argparse.Namespace) -> int | None:
    """The server count of --servers (None without it), after rejecting options it cannot combine with.

    Raises:
        ConfigError: a bad count, --route without --servers, or --servers with --sweep, several
            policies or admission on; the message names the options.
    """
    if args.servers is None:
        if args.route is not None:
            raise ConfigError("route: --route applies only with --servers N")
        return None
    num_servers = check_num_servers(args.servers)
    if args.hints is not None:
        raise ConfigError("servers: --servers cannot be combined with --hints; drop one")
    if args.sweep:
        raise ConfigError("servers: --servers cannot be combined with --sweep (it searches the shared pool's size "
                          "itself); drop --sweep")
    policies = _policies(args.policy)
    if len(policies) != 1:
        raise ConfigError("servers: --servers takes one policy, got " + ", ".join(p.value for p in policies))
    if args.admission != "off":
        raise ConfigError("servers: --admission does not apply with --servers (the DRAM tier and the pool are each "
                          "the only tier, and a top tier admits every block)")
    return num_servers


def _run_servers(args: argparse.Namespace, trace: Trace, geometry: Any, block_bytes: int,
                 capacities: dict[TierKind, int], bandwidths: dict[TierKind, float], num_servers: int) -> int:
    """`--servers N`: private DRAM per server against one shared pool (kvtier/simulate/servers.py)."""
    if list(capacities) != [TierKind.DRAM]:
        given = ", ".join(k.name.lower() for k in capacities) or "none"
        raise ConfigError(f"servers: --servers needs exactly one --capacity, dram=D (each server's DRAM), got {given}; "
                          "per-server HBM or SSD around a shared pool is not modelled")
    config = _configs(args, capacities, bandwidths, block_bytes)[0]
    route = Route(args.route or Route.CONVERSATION.value)
    name = f"{config.label}, {num_servers} servers"
    with _progress(not args.no_progress) as bars:
        bars.add(name, len(trace.requests) * planned_replays(num_servers * capacities[TierKind.DRAM]))
        result = compare(trace, config, num_servers, route, bandwidths[TierKind.POOL], on_progress=bars.advance(name))
    report = _report(args, trace, geometry, block_bytes, [], [], TierKind.DRAM)
    report["servers"] = result
    report["notes"] += ["--servers models the DRAM level only (no HBM in front, no SSD behind); the pool's "
                        "ttft_mean_s uses the pool bandwidth (--bandwidth pool), which no hit count depends on"]
    if args.plot:
        report["plots"] = [str(plot_servers(result, Path(args.plot) / "simulate_servers_hit_rate_vs_pool.png"))]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report, Console() if sys.stdout.isatty() else Console(width=160))
    return 0


def _configs(args: argparse.Namespace, tiers: dict[TierKind, int], bandwidths: dict[TierKind, float],
             block_bytes: int) -> list[SimConfig]:
    promote_to = None if args.promote_to.lower() == "none" else _tier(args.promote_to, "promote-to")
    admissions = {"off": (False,), "on": (True,), "both": (False, True)}[args.admission]
    virtual = tuple(VirtualTier(k, n, bandwidths[k]) for k, n in tiers.items())
    return [SimConfig(virtual, block_bytes, policy=policy, admission=admission, mode=CacheMode(args.mode),
                      promote_to=promote_to, high_watermark=args.high_watermark, low_watermark=args.low_watermark,
                      prefill_tokens_per_s=args.prefill_tokens_per_s, full_blocks_only=args.full_blocks_only)
            for policy in _policies(args.policy) for admission in admissions]


def _policies(values: list[str] | None) -> list[SimPolicy]:
    names = [n.strip().lower() for v in (values or ["lru"]) for n in v.split(",") if n.strip()]
    chosen: list[SimPolicy] = []
    for name in names:
        if name == "all":
            chosen += list(SimPolicy)
            continue
        try:
            chosen.append(SimPolicy(name))
        except ValueError:
            valid = ", ".join([p.value for p in SimPolicy] + ["all"])
            raise ConfigError(f"policy: unknown policy {name!r}; expected one of {valid}") from None
    return list(dict.fromkeys(chosen))


def _sweep_points(args: argparse.Namespace, trace: Trace, block_bytes: int) -> list[int]:
    if args.sweep_points is None:
        return default_points(trace)
    return sorted({parse_capacity(v, block_bytes=block_bytes, num_unique_blocks=trace.num_unique_blocks,
                                  where="sweep-points") for v in args.sweep_points.split(",") if v.strip()})


def _target(args: argparse.Namespace, trace: Trace) -> float:
    if args.target_hit_rate is None:
        return default_target(trace)
    text = args.target_hit_rate.strip()
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise ConfigError(f"target-hit-rate: expected 0.3 or 30%, got {text!r}") from None
    if not 0 < value <= 1:
        raise ConfigError(f"target-hit-rate must be in (0, 1] (or 0-100%), got {text!r}")
    return value


def _pairs(items: list[str], option: str, parse: Callable[[str, str], Any]) -> dict[TierKind, Any]:
    """`["dram=64GiB", ...]` -> {TierKind.DRAM: parse("64GiB", "capacity dram")}; each tier once."""
    out: dict[TierKind, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not value.strip():
            raise ConfigError(f"{option}: expected TIER=VALUE, got {item!r}")
        kind = _tier(name, option)
        if kind in out:
            raise ConfigError(f"{option}: tier {kind.name.lower()} given twice")
        out[kind] = parse(value, f"{option} {kind.name.lower()}")
    return out


def _tier(name: str, option: str) -> TierKind:
    try:
        return TierKind[name.strip().upper()]
    except KeyError:
        valid = ", ".join(k.name.lower() for k in TierKind)
        raise ConfigError(f"{option}: unknown tier {name!r}; expected one of {valid}") from None


def _bandwidth(value: str, where: str) -> float:
    text = value.strip().lower().removesuffix("gb/s").removesuffix("gbps").strip()
    try:
        return float(text)  # VirtualTier checks it is positive and finite
    except ValueError:
        raise ConfigError(f"{where}: expected GB/s such as 25 or 12.5, got {value!r}") from None


def _positive_int(value: int, option: str, maximum: int | None = None) -> int:
    return check_number(value, option, integral=True, positive=True, maximum=maximum)


def _warn_skipped(trace: Trace) -> None:
    shown = "; ".join(f"line {n}: {why}" for n, why in trace.skipped_lines[:5])
    more = f" (and {len(trace.skipped_lines) - 5} more)" if len(trace.skipped_lines) > 5 else ""
    print(f"kvtier simulate: skipped {len(trace.skipped_lines)} malformed line(s) of {trace.path}: {shown}{more}",
          file=sys.stderr)


def _replay(trace: Trace, configs: list[SimConfig], with_runs: bool, swept: tuple[TierKind, list[int], float],
            bars: _Bars) -> tuple[list[dict], list[dict]]:
    """Each configuration's run (if capacities were given) and sweep, one progress bar per configuration."""
    tier, points, bandwidth = swept
    for config in configs:
        bars.add(config.label, len(trace.requests) * (int(with_runs) + len(points)))
    runs, rows = [], []
    for config in configs:
        advance = bars.advance(config.label)
        if with_runs:
            runs.append(simulate(trace, config, on_progress=advance))
        if points:
            rows += sweep(trace, [config], tier, points, bandwidth, on_progress=advance)
    return runs, rows


def _search(trace: Trace, configs: list[SimConfig], rows: list[dict], target: float | None,
            swept: tuple[TierKind, list[int], float], bars: _Bars) -> list[dict]:
    """Bisects the grid bracket of the configurations that may be recommended (kvtier/simulate/sweep.py)."""
    if not rows or target is None or trace.max_block_hit_rate <= 0:
        return []  # nothing to size: `recommend` says so
    tier, _, bandwidth = swept
    labels = labels_to_search(rows, target)
    chosen = [config for config in configs if config.label in labels]
    for config in chosen:  # a bar each, added up front so every estimate shows from the start
        below, above = bracket(rows, config.label, target)
        bars.add(f"{config.label}: bisecting", len(trace.requests) * planned_bisections(below, above))
    return [search_smallest(trace, config, tier, rows, target, bandwidth,
                            on_progress=bars.advance(f"{config.label}: bisecting")) for config in chosen]


class _Bars:
    """One rich progress task per configuration, named by its label, each with its own count and time estimate."""

    def __init__(self, progress: Progress | None) -> None:
        self.progress = progress
        self.tasks: dict[str, Any] = {}

    def add(self, name: str, total: int) -> None:
        if self.progress is not None and total:
            self.tasks[name] = self.progress.add_task(name, total=total)

    def advance(self, name: str) -> Callable[[int], None] | None:
        """A callback for `simulate`'s `on_progress` that advances `name`'s task (None when no bars are shown)."""
        if self.progress is None or name not in self.tasks:
            return None
        progress, task = self.progress, self.tasks[name]
        return lambda n: progress.advance(task, n)


@contextmanager
def _progress(wanted: bool) -> Iterator[_Bars]:
    """Progress bars on stderr, shown only on a terminal and without --no-progress."""
    console = Console(stderr=True)
    if not wanted or not console.is_terminal:
        yield _Bars(None)
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("requests"),
               TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        yield _Bars(progress)


@contextmanager
def _loading(path: Path, wanted: bool) -> Iterator[None]:
    """A spinner on stderr while the trace loads (a large one takes seconds), shown only on a terminal."""
    console = Console(stderr=True)
    if not wanted or not console.is_terminal:
        yield
        return
    with console.status(f"loading {path} ..."):
        yield


def _report(args: argparse.Namespace, trace: Trace, geometry: Any, block_bytes: int, runs: list[dict],
            rows: list[dict], sweep_tier: TierKind, searches: Sequence[dict] = (), target: float | None = None) -> dict:
    report: dict[str, Any] = {
        "trace": trace.describe(),
        "model": {"name": geometry.name, "kv_dtype": geometry.kv_dtype.value,
                  "kv_bytes_per_token": geometry.kv_bytes_per_token(), "block_tokens": trace.block_tokens,
                  "block_bytes": block_bytes},
        "ttft_model": "max(uncached_tokens, 1) / prefill_tokens_per_s + sum(block_bytes / bandwidth of the "
                      "tier each hit came from); no overlap, no queueing",
        "runs": runs,
    }
    if len(runs) == 1:  # the run's headline figures, also at the top level
        report["block_hit_rate"] = runs[0]["block_hit_rate"]
        report["tiers"] = runs[0]["tiers"]
    elif runs:  # no top-level figure a reader could take for every run's: each run's, by its label
        report["block_hit_rate_by_run"] = {r["label"]: r["block_hit_rate"] for r in runs}
    report["notes"] = _notes(runs or rows) + admission_notes(runs)
    if rows:
        report["sweep"] = {"tier": sweep_tier.name.lower(), "points": sorted({r["capacity_blocks"] for r in rows}),
                           "rows": rows, "searches": searches,
                           "recommendation": recommend(rows, target, trace.max_block_hit_rate, searches)}
    return report


def _notes(results: list[dict]) -> list[str]:
    """Caveats that apply to these results."""
    notes = []
    num_tiers = max((len(r.get("tiers") or r.get("tier_hit_rates", {})) for r in results), default=0)
    if num_tiers > 1 and any(r["policy"] == SimPolicy.BELADY.value for r in results):
        notes.append("with several tiers Belady runs MIN in each tier: a heuristic, not an upper bound")
    tier_names = {name for r in results for name in (r.get("tiers") or r.get("tier_hit_rates", {}))}
    if any(r["admission"] == "on" for r in results) and not tier_names & {"pool", "ssd"}:
        notes.append("admission applies to pool and SSD tiers only: here it changes nothing")
    return notes


def _plots(directory: Path, runs: list[dict], rows: list[dict], report: dict, trace: Trace) -> list[str]:
    paths = []
    if rows:
        target = report["sweep"]["recommendation"]["target_hit_rate"]
        paths.append(plot_sweep(rows, directory / "simulate_hit_rate_vs_capacity.png",
                                target_hit_rate=target, max_hit_rate=trace.max_block_hit_rate))
    if runs:
        paths.append(plot_runs(runs, directory / "simulate_hit_rate_by_tier.png"))
    return [str(p) for p in paths]


# ---------------------------------------------------------------------------------------------
# rendering
