"""What a load costs per call, from each tier: wall time and CPU, one block or a batch.

An engine that finds its prefix below DRAM waits for `KVTier.load`; at small batches the call's
fixed cost (kvtier's Python across the runtime, the route, the tier and the pool client) is most
of it. This measures it where the engine meets it: blocks placed in one tier (DRAM, an SSD on
`--ssd-dir`, a real `kvtier pool serve` node on 127.0.0.1), then loaded back into a host buffer
with `load(keys, into, sync=True)` in calls of `--batch` blocks, each call checked. Reported per
call: wall time (median and best), this process's CPU (every thread; user and system), and for
the pool the node's CPU. CPU moves far less than wall time on a shared machine, so an A/B of two
commits (`PYTHONPATH` set to each checkout in turn) can compare it where wall time is noise.

    python bench/bench_load_cpu.py [--block 1MiB] [--batches 1,16] [--calls 200] [--seconds 1] [--tiers dram,ssd,pool]
                                   [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

from kvtier.bench.e2e import NUM_LAYERS, runtime_config
from kvtier.bench.measure import cpu_spent
from kvtier.kinds import TierKind
from kvtier.model.layout import BlockLayout
from kvtier.runtime import KVTier
from kvtier.units import parse_size

TIERS = {"dram": TierKind.DRAM, "ssd": TierKind.SSD, "pool": TierKind.POOL}
DISTINCT_CALLS = 8  # batches held and loaded in turn (more blocks than one batch's, fewer than a cache's)
WARM_CALLS = 5
TIMEOUT_S = 120.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--block", default="1MiB", help="block size (default 1MiB)")
    p.add_argument("--batches", default="1,16", help="blocks per load call, comma-separated (default 1,16)")
    p.add_argument("--calls", type=int, default=200, help="timed load calls per tier and batch, at least (default 200)")
    p.add_argument("--seconds", type=float, default=1.0,
                   help="and at least this long per row (default 1.0): a short run's CPU total is mostly noise")
    p.add_argument("--tiers", default=",".join(TIERS), help=f"comma-separated subset of {', '.join(TIERS)}")
    p.add_argument("--ssd-dir", default="/var/tmp", help="where the SSD tier's files go (default /var/tmp)")
    p.add_argument("--json", type=Path, help="write the rows as JSON here")
    args = p.parse_args(argv)
    args.block_bytes = parse_size(args.block, "--block")
    if args.block_bytes <= 0 or args.block_bytes % (NUM_LAYERS * 4096):
        p.error(f"--block: {args.block_bytes} bytes is not {NUM_LAYERS} layers of whole 4 KiB pages")
    try:
        args.batches = tuple(int(b) for b in args.batches.split(",") if b)
    except ValueError:
        p.error(f"--batches: expected comma-separated block counts, got {args.batches!r}")
    if not args.batches or min(args.batches) <= 0:
        p.error("--batches: every batch needs at least one block")
    args.tiers = tuple(t for t in args.tiers.split(",") if t)
    unknown = [t for t in args.tiers if t not in TIERS]
    if unknown or not args.tiers:
        p.error(f"--tiers: unknown {unknown or 'none given'}; choose from {', '.join(TIERS)}")
    if args.calls <= 0:
        p.error("--calls must be positive")
    if args.seconds < 0:
        p.error("--seconds must not be negative")
    return args


def measure(tier: str, batch: int, args: argparse.Namespace, workdir: str) -> dict:
    from kvtier.pool.node.process import NodeProcess

    lower, block = TIERS[tier], args.block_bytes
    held = DISTINCT_CALLS * batch
    node = NodeProcess(capacity=str(max(64 << 20, 4 * held * block)), region_size=str(max(8 << 20, 2 * block))) \
        if lower is TierKind.POOL else None
    try:
        env = types.SimpleNamespace(pool_address=node.address if node else None, pool_timeout_s=30.0,
                                    device=torch.device("cpu"), workdir=tempfile.mkdtemp(prefix=f"{tier}-", dir=workdir))
        layout = BlockLayout.uniform(16, NUM_LAYERS, block // NUM_LAYERS)
        with KVTier(runtime_config(env, lower, block, batch, held), layout=layout) as kv:
            rows = torch.randint(0, 256, (batch, block), dtype=torch.uint8)
            into = torch.empty_like(rows)
            salt = os.urandom(8)
            calls = [[salt + (c * batch + j).to_bytes(8, "little") for j in range(batch)] for c in range(DISTINCT_CALLS)]
            for keys in calls:  # stored into HBM, demoted at once to the tier under test
                if kv.store(keys, rows, target=TierKind.HBM, sync=True).failed:
                    raise RuntimeError(f"{tier}: a store failed while placing the blocks")
                kv.quiesce(TIMEOUT_S)
            placed = {"nowhere" if w is None else w.name for keys in calls for w in kv.where(keys)}
            if placed != {lower.name}:
                raise RuntimeError(f"{tier}: blocks placed in {sorted(placed)}, not {lower.name}")

            def load(keys) -> None:
                handle = kv.load(keys, into, sync=True)
                if handle.failed:
                    raise RuntimeError(f"{tier}: {len(handle.failed)} blocks failed to load: "
                                       f"{next(iter(handle.failed.values())).error}")

            for c in range(WARM_CALLS):
                load(calls[c % DISTINCT_CALLS])
            if not torch.equal(into, rows):
                raise RuntimeError(f"{tier}: blocks loaded back differ from those stored")
            walls: list[float] = []
            with cpu_spent(node.proc.pid if node else None) as cpu:
                until = time.perf_counter() + args.seconds
                while len(walls) < args.calls or time.perf_counter() < until:
                    started = time.perf_counter()
                    load(calls[len(walls) % DISTINCT_CALLS])
                    walls.append(time.perf_counter() - started)
        return {"tier": tier, "batch": batch, "block_bytes": block, "calls": len(walls),
                "wall_us_p50": statistics.median(walls) * 1e6, "wall_us_min": min(walls) * 1e6,
                "gb_per_s_p50": batch * block / statistics.median(walls) / 1e9, **cpu.per(len(walls), "call")}
    finally:
        if node is not None:
            node.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-load-cpu-", dir=args.ssd_dir) as workdir:
        for tier in args.tiers:
            for batch in args.batches:
                print(f"{tier}: loads of {batch} x {args.block}, {args.calls} or {args.seconds:g} s ...", file=sys.stderr,
                      flush=True)
                results.append(measure(tier, batch, args, workdir))
    print(f"{'tier':>5} {'batch':>6} {'wall p50 µs':>12} {'wall min µs':>12} {'GB/s':>6} {'cpu µs':>8} "
          f"{'user':>7} {'system':>7} {'cpu µs/block':>13} {'node cpu µs':>12}")
    for r in results:
        node = f"{r['node_cpu_us_per_call']:.0f}" if r["node_cpu_us_per_call"] is not None else "-"
        print(f"{r['tier']:>5} {r['batch']:>6} {r['wall_us_p50']:>12.0f} {r['wall_us_min']:>12.0f} "
              f"{r['gb_per_s_p50']:>6.2f} {r['cpu_us_per_call']:>8.0f} {r['user_us_per_call']:>7.0f} "
              f"{r['system_us_per_call']:>7.0f} {r['cpu_us_per_call'] / r['batch']:>13.1f} {node:>12}")
    if args.json:
        args.json.write_text(json.dumps({"args": {"block_bytes": args.block_bytes, "batches": args.batches,
                                                  "calls": args.calls}, "rows": results}, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
