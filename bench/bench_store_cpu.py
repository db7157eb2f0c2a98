"""What an engine's background stores cost in CPU per block, by tier configuration.

An engine stores every block it computes (`KVTier.store(..., background=True)`), whether or not
anything will hit it; on a CPU engine that work shares the cores the forward pass runs on (issue
30: `bench_serve.py`'s random workload, where nothing can hit). This measures it where it is made:
batches of `--batch` fresh blocks stored into a full DRAM tier, with each configuration's lower
tiers below it (an SSD on `--ssd-dir`, a real `kvtier pool serve` node on 127.0.0.1), each batch
waited for, then every demotion; reported per block stored: this process's CPU (every thread),
the pool node's CPU, and the wall time. DRAM alone is the baseline: a store that evicts into
nothing. This process's CPU is also split into user and system time: what kvtier's own code costs
(Python, copies, checksums) and what the kernel does for it (the disk's and the socket's I/O).

    python bench/bench_store_cpu.py [--block 64KiB] [--calls 300] [--configs dram,dram+ssd,...] [--json FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvtier.bench.measure import cpu_spent
from kvtier.config import KVTierConfig, TierConfig
from kvtier.kinds import TierKind
from kvtier.model.layout import BlockLayout
from kvtier.runtime import KVTier
from kvtier.units import parse_size

CONFIGS = ("dram", "dram+ssd", "dram+pool", "dram+pool+ssd")
NUM_LAYERS = 4
DRAM_BLOCKS = 64  # small, so that every store evicts
WARM_CALLS = 30
TIMEOUT_S = 120.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--block", default="64KiB", help="block size (default 64KiB)")
    p.add_argument("--batch", type=int, default=16, help="blocks per store call (default 16)")
    p.add_argument("--calls", type=int, default=300, help="timed store calls per configuration (default 300)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)}")
    p.add_argument("--ssd-dir", default="/var/tmp", help="where the SSD tier's files go (default /var/tmp)")
    p.add_argument("--json", type=Path, help="write the rows as JSON here")
    args = p.parse_args(argv)
    args.block_bytes = parse_size(args.block, "--block")
    args.configs = tuple(c for c in args.configs.split(",") if c)
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown or not args.configs:
        p.error(f"--configs: unknown {unknown or 'none given'}; choose from {', '.join(CONFIGS)}")
    if args.block_bytes % NUM_LAYERS or args.block_bytes <= 0:
        p.error(f"--block: {args.block_bytes} bytes is not {NUM_LAYERS} equal layers")
    if args.batch <= 0 or args.calls <= 0:
        p.error("--batch and --calls must be positive")
    return args


def measure(config: str, args: argparse.Namespace, workdir: str) -> dict:
    from kvtier.pool.node.process import NodeProcess

    block = args.block_bytes
    node = NodeProcess(capacity=str(max(64 << 20, 4 * (WARM_CALLS + args.calls) * args.batch * block)),
                       region_size=str(max(8 << 20, block))) if "pool" in config else None
    try:
        tiers = [TierConfig(TierKind.DRAM, DRAM_BLOCKS * block)]
        if node is not None:
            tiers.append(TierConfig(TierKind.POOL, 4 * (WARM_CALLS + args.calls) * args.batch * block,
                                    nodes=(node.address,)))
        if "ssd" in config:
            tiers.append(TierConfig(TierKind.SSD, 2 * (WARM_CALLS + args.calls) * args.batch * block,
                                    path=Path(tempfile.mkdtemp(prefix=f"{config}-", dir=workdir))))
        layout = BlockLayout.uniform(16, NUM_LAYERS, block // NUM_LAYERS)
        with KVTier(KVTierConfig(model="bench-store-cpu", tiers=tuple(tiers)), layout=layout) as kv:
            rows = torch.randint(0, 256, (args.batch, block), dtype=torch.uint8)
            salt, counter = os.urandom(8), itertools.count()

            def store() -> None:
                keys = [salt + next(counter).to_bytes(8, "little") for _ in range(args.batch)]
                handle = kv.store(keys, rows, background=True)
                handle.wait(TIMEOUT_S)

            for _ in range(WARM_CALLS):
                store()
            kv.quiesce(TIMEOUT_S)
            with cpu_spent(node.proc.pid if node else None) as cpu:
                wall0 = time.perf_counter()
                for _ in range(args.calls):
                    store()
                kv.quiesce(TIMEOUT_S)
                wall = time.perf_counter() - wall0
            dropped = sum(kv.snapshot().get("dropped", {}).values())
        blocks = args.calls * args.batch
        return {"config": config, "block_bytes": block, "blocks": blocks, **cpu.per(blocks, "block"),
                "wall_us_per_block": wall / blocks * 1e6, "dropped": dropped}
    finally:
        if node is not None:
            node.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-store-cpu-", dir=args.ssd_dir) as workdir:
        for config in args.configs:
            print(f"{config}: {args.calls} calls of {args.batch} x {args.block} blocks ...", file=sys.stderr, flush=True)
            results.append(measure(config, args, workdir))
    base = next((r["cpu_us_per_block"] for r in results if r["config"] == "dram"), None)
    print(f"{'configuration':>15} {'cpu µs/block':>13} {'user':>7} {'system':>7} {'x dram':>7} "
          f"{'node cpu µs/block':>18} {'wall µs/block':>14}")
    for r in results:
        ratio = f"{r['cpu_us_per_block'] / base:.1f}" if base else "-"
        node = f"{r['node_cpu_us_per_block']:.1f}" if r["node_cpu_us_per_block"] is not None else "-"
        print(f"{r['config']:>15} {r['cpu_us_per_block']:>13.1f} {r['user_us_per_block']:>7.1f} "
              f"{r['system_us_per_block']:>7.1f} {ratio:>7} {node:>18} {r['wall_us_per_block']:>14.1f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {"block_bytes": args.block_bytes, "batch": args.batch,
                                                  "calls": args.calls}, "rows": results}, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
