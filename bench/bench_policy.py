"""Microseconds per insert, touch and evict(1) of each eviction policy with many keys resident.

Not a test: it asserts nothing. Keys are 16-byte digests, like real block keys. Each policy is first
brought to a steady state (filled to `--keys`, then a random mix of touches and evict+insert), so
that S3-FIFO's main queue and ARC's T2 and ghosts are populated; then each operation is timed in a
plain loop over pre-built inputs (loop overhead included), with the garbage collector off, keeping
the best of `--repeat` runs. With a million keys, random touches are bound by memory latency, not
by Python: the last line prints a bare OrderedDict.move_to_end on the same keys for comparison.

Usage: python bench/bench_policy.py [--keys 1000000] [--ops 200000] [--repeat 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

from kvtier.policy import EvictionPolicy, PolicyKind, make_policy


def never(key: Hashable) -> bool:
    """A `protected` callback that protects nothing."""
    return False


def make_keys(count: int, rng: random.Random) -> list[bytes]:
    """Returns `count` distinct random 16-byte keys."""
    return [rng.randbytes(16) for _ in range(count)]


def warm_up(policy: EvictionPolicy, keys: list[bytes], rng: random.Random) -> list[bytes]:
    """Fills `policy` with `keys`, then churns it; returns the keys resident afterwards."""
    for key in keys:
        policy.insert(key)
    resident = list(keys)
    for _ in range(len(keys) // 10):
        policy.touch(rng.choice(resident))
    fresh = make_keys(len(keys) // 20, rng)
    for key in fresh:
        policy.evict(1, never)
        policy.insert(key)
    return [k for k in keys + fresh if k in policy]


def time_per_call_us(call: Callable[[object], object], inputs: list) -> float:
    """Runs `call` on every input and returns the mean wall time per call in microseconds."""
    gc.disable()
    try:
        start = time.perf_counter_ns()
        for item in inputs:
            call(item)
        elapsed_ns = time.perf_counter_ns() - start
    finally:
        gc.enable()
    return elapsed_ns / len(inputs) / 1000


def time_evict_one_us(policy: EvictionPolicy, num_calls: int) -> float:
    """Calls `policy.evict(1, never)` `num_calls` times; returns the mean µs per call."""
    evict = policy.evict
    gc.disable()
    try:
        start = time.perf_counter_ns()
        for _ in range(num_calls):
            evict(1, never)
        elapsed_ns = time.perf_counter_ns() - start
    finally:
        gc.enable()
    return elapsed_ns / num_calls / 1000


def bench_one(
    kind: PolicyKind, num_keys: int, num_ops: int, repeat: int, seed: int
) -> dict[str, float]:
    """Measures one policy; returns the best of `repeat` runs of µs per insert, touch, evict(1)."""
    rng = random.Random(seed)
    policy = make_policy(kind, num_keys)
    resident = warm_up(policy, make_keys(num_keys, rng), rng)
    runs: dict[str, list[float]] = {"insert_us": [], "touch_us": [], "evict1_us": []}
    for _ in range(repeat):
        touches = [rng.choice(resident) for _ in range(num_ops)]
        runs["touch_us"].append(time_per_call_us(policy.touch, touches))
        runs["evict1_us"].append(time_evict_one_us(policy, num_ops))
        fresh = make_keys(num_ops, rng)  # refills what evict took, so residency stays put
        runs["insert_us"].append(time_per_call_us(policy.insert, fresh))
        resident = [k for k in resident if k in policy] + fresh
    return {name: min(values) for name, values in runs.items()}


def bench_floor(num_keys: int, num_ops: int, repeat: int, seed: int) -> float:
    """µs per bare `OrderedDict.move_to_end` on random resident keys: what a touch cannot beat."""
    rng = random.Random(seed)
    keys = make_keys(num_keys, rng)
    order = OrderedDict.fromkeys(keys)
    touches = [rng.choice(keys) for _ in range(num_ops)]
    return min(time_per_call_us(order.move_to_end, touches) for _ in range(repeat))


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark, prints a table and optionally writes JSON.

    Args:
        argv: command-line arguments (default: sys.argv[1:]).
    Returns:
        The process exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000, help="keys resident (default 1e6)")
    parser.add_argument("--ops", type=int, default=200_000, help="calls timed per operation")
    parser.add_argument("--repeat", type=int, default=3, help="runs per operation; best is kept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results as JSON to this path")
    args = parser.parse_args(argv)
    results = {
        kind.value: bench_one(kind, args.keys, args.ops, args.repeat, args.seed)
        for kind in PolicyKind
    }
    floor_us = bench_floor(args.keys, args.ops, args.repeat, args.seed)
    header = f"{'policy':<8} {'insert µs':>10} {'touch µs':>10} {'evict(1) µs':>12}"
    print(f"{header}   ({args.keys:,} keys resident)")
    for name, r in results.items():
        print(f"{name:<8} {r['insert_us']:>10.3f} {r['touch_us']:>10.3f} {r['evict1_us']:>12.3f}")
    print(f"floor: a bare OrderedDict.move_to_end on the same keys takes {floor_us:.3f} µs")
    if args.json:
        report = {
            "num_keys_resident": args.keys,
            "num_ops_timed": args.ops,
            "repeat": args.repeat,
            "python": sys.version.split()[0],
            "machine": platform.machine(),
            "results": results,
            "floor_ordereddict_move_to_end_us": floor_us,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
