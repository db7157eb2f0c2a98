"""Replay speed of `kvtier simulate`: block accesses per second through the real manager.

Not a test: it asserts nothing, and prints each figure against the goal (>= 200,000 accesses/s).
For each case, the trace is loaded once and `simulate()` replays it `--repeat` times (a fresh manager
each time); the median replay is reported both in wall time and in this process's CPU time, since
on a shared 2-core machine wall time also measures the neighbours. Trace parsing and Belady's
future index are built outside the timed replay, as `simulate` itself reports it (`replay_s`).

Cases, on conversation_trace.jsonl (288,500 accesses) unless `--trace` says otherwise:
  1 tier  <policy>   one HBM tier of 18,279 blocks (the 27.8 % LRU reference), every policy
  3 tiers <policy>   HBM 1,000 + DRAM 5,000 + SSD 20,000 blocks, LRU (every stored block cascades
                     down through the tiers: per access ~1.7 moves, 2.1 evictions, 2.4 slots claimed)

The replay drives the manager's synchronous verbs (`load_now` / `store_now`), which run the same
decision code as the two-phase verbs and complete each move inside the call; see
tests/simulate/test_simulate_fastpath.py for the proof that both decide alike.

`--profile POLICY` runs one replay under cProfile instead (`--tiers 3` for the three-tier case);
cProfile's per-call overhead inflates small functions, so confirm a finding with the timed cases.

    python bench/bench_simulate.py [--trace NAME] [--repeat 3] [--policies lru,s3fifo,arc,belady]
                                   [--json out.json] [--profile POLICY [--tiers 1|3]]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import platform
import pstats
import statistics
import sys
import time

from kvtier.simulate.replay import SimConfig, SimPolicy, VirtualTier, simulate
from kvtier.simulate.trace import load_trace, resolve_trace_path
from kvtier.tiers.base import TierKind

GOAL_ACCESSES_PER_S = 200_000
BLOCK_BYTES = 160 * 2**20  # Llama-2-70B fp16, 512 tokens: only scales the byte counts


def one_tier(policy: SimPolicy, num_slots: int) -> SimConfig:
    return SimConfig((VirtualTier(TierKind.HBM, num_slots, 1000.0),), BLOCK_BYTES, policy=policy)


def three_tiers(policy: SimPolicy) -> SimConfig:
    tiers = (VirtualTier(TierKind.HBM, 1000, 1000.0), VirtualTier(TierKind.DRAM, 5000, 25.0),
             VirtualTier(TierKind.SSD, 20_000, 6.0))
    return SimConfig(tiers, BLOCK_BYTES, policy=policy)


def measure(trace, config: SimConfig, repeat: int) -> dict:
    """Median wall and CPU seconds of `repeat` replays, garbage collector on as in real use."""
    walls, cpus, report = [], [], None
    for _ in range(repeat):
        gc.collect()
        cpu0 = time.process_time()
        report = simulate(trace, config)
        cpus.append(time.process_time() - cpu0)
        walls.append(report["replay_s"])
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    accesses = report["num_accesses"]
    return {"label": config.label, "num_tiers": len(config.tiers), "num_accesses": accesses,
            "block_hit_rate": report["block_hit_rate"], "replay_wall_s": wall,
            "accesses_per_s_wall": accesses / wall, "accesses_per_s_cpu": accesses / cpu}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="conversation")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--policies", default=",".join(p.value for p in SimPolicy))
    parser.add_argument("--json", default=None, metavar="FILE")
    parser.add_argument("--profile", default=None, metavar="POLICY", help="cProfile one replay instead")
    parser.add_argument("--tiers", type=int, choices=(1, 3), default=1, help="the case --profile replays")
    args = parser.parse_args()
    trace = load_trace(resolve_trace_path(args.trace))
    num_slots = max(1, round(0.1 * trace.num_unique_blocks))
    if args.profile:
        profiler = cProfile.Profile()
        policy = SimPolicy(args.profile)
        config = one_tier(policy, num_slots) if args.tiers == 1 else three_tiers(policy)
        profiler.runcall(simulate, trace, config)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        return 0
    policies = [SimPolicy(p.strip()) for p in args.policies.split(",") if p.strip()]
    cases = [one_tier(p, num_slots) for p in policies] + [three_tiers(SimPolicy.LRU)]
    print(f"{trace.path}: {trace.num_accesses:,} accesses; python {platform.python_version()}, "
          f"{platform.machine()}; median of {args.repeat}")
    print(f"{'case':<22}{'hit rate':>9}{'wall s':>9}{'acc/s wall':>13}{'acc/s cpu':>12}  goal {GOAL_ACCESSES_PER_S:,}")
    rows = []
    for config in cases:
        row = measure(trace, config, args.repeat)
        rows.append(row)
        name = f"{row['num_tiers']} tier{'s' if row['num_tiers'] > 1 else ''} {row['label']}"
        verdict = "ok" if row["accesses_per_s_wall"] >= GOAL_ACCESSES_PER_S else "BELOW"
        print(f"{name:<22}{row['block_hit_rate']:>9.2%}{row['replay_wall_s']:>9.2f}"
              f"{row['accesses_per_s_wall']:>13,.0f}{row['accesses_per_s_cpu']:>12,.0f}  {verdict}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trace": trace.path, "goal_accesses_per_s": GOAL_ACCESSES_PER_S, "cases": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
