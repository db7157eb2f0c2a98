"""What each eviction policy costs where an engine meets it: `KVTier.store` + `KVTier.load` to completion.

Not a test: it asserts nothing. One `KVTier` per policy, built from the same YAML but for `policy`:
one DRAM tier of `--capacity` blocks (small blocks, 2 layers x 4 KiB, so that bookkeeping and not
copying is what differs). First each is filled past its capacity (every store then evicts); then,
`--repeat` times, round-robin over the policies, `--requests` requests are timed, each a
`store(keys, blocks, sync=True)` of `--blocks-per-request` new keys followed by a
`load(keys, into, sync=True)` of the same keys, as an engine that waits for each call makes them.
chain-arc is told each request's chain by the runtime after each store and load (`order_chain`),
which is the cost it adds to ARC's. Process CPU time, median of the repeats; the ratio is to LRU in
the same run.

    python bench/bench_policy_e2e.py [--policies lru,arc,chain-arc,s3fifo] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from kvtier.config import load_config
from kvtier.model.layout import BlockLayout
from kvtier.policy import PolicyKind
from kvtier.runtime import KVTier

LAYOUT = BlockLayout.uniform(block_tokens=16, num_layers=2, layer_bytes=4096)


def make_runtime(policy: str, capacity_blocks: int, directory: Path) -> KVTier:
    raw = {"model": "kvtier-tiny", "block_tokens": LAYOUT.block_tokens, "promote_to": "none",
           "tiers": {"dram": {"capacity": capacity_blocks * LAYOUT.block_bytes, "policy": policy}}}
    path = directory / f"{policy}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return KVTier(load_config(path), layout=LAYOUT)


def serve(kv: KVTier, first: int, num_requests: int, blocks: torch.Tensor, into: torch.Tensor) -> float:
    """Process CPU seconds for `num_requests` store+load pairs of new keys, numbered from `first`."""
    per_request = len(blocks)
    start = time.process_time()
    for i in range(first, first + num_requests):
        keys = list(range(i * per_request, (i + 1) * per_request))
        if not kv.store(keys, blocks, sync=True).wait(0) or not kv.load(keys, into, sync=True).wait(0):
            raise RuntimeError(f"request {i}: a sync store or load did not complete")
    return time.process_time() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="lru,arc,chain-arc,s3fifo")
    parser.add_argument("--capacity", type=int, default=4096, help="DRAM tier, in blocks")
    parser.add_argument("--blocks-per-request", type=int, default=16)
    parser.add_argument("--requests", type=int, default=500, help="requests per timed run")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args()
    known = [k.value for k in PolicyKind]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in known]
    if unknown or not policies:
        parser.error(f"--policies: unknown policy {unknown[0]!r}; choose from {', '.join(known)}" if unknown
                     else "--policies: give at least one")
    blocks = torch.randint(0, 256, (args.blocks_per_request, LAYOUT.block_bytes), dtype=torch.uint8)
    into = torch.empty_like(blocks)
    times: dict[str, list[float]] = {p: [] for p in policies}
    warm = 2 * args.capacity // args.blocks_per_request + 1
    with tempfile.TemporaryDirectory() as d:
        runtimes = {p: make_runtime(p, args.capacity, Path(d)) for p in policies}
        try:
            for kv in runtimes.values():
                serve(kv, 0, warm, blocks, into)
            for r in range(args.repeat):
                print(f"run {r + 1}/{args.repeat}", file=sys.stderr)
                for p, kv in runtimes.items():
                    times[p].append(serve(kv, warm + r * args.requests, args.requests, blocks, into))
        finally:
            for kv in runtimes.values():
                kv.close()
    moved = 2 * args.blocks_per_request * args.requests  # each block stored once and loaded once
    rows = [{"policy": p, "cpu_s": statistics.median(t), "blocks_per_s": moved / statistics.median(t)} for p, t in times.items()]
    base = next((r["blocks_per_s"] for r in rows if r["policy"] == "lru"), None)
    print(f"{'policy':<10}{'blocks/s':>12}{'vs lru':>8}   ({args.requests} requests of {args.blocks_per_request} "
          f"blocks of {LAYOUT.block_bytes:,} B, store+load, DRAM of {args.capacity:,} blocks, median of {args.repeat})")
    for r in rows:
        r["ratio_to_lru"] = r["blocks_per_s"] / base if base else None
        ratio = f"{r['ratio_to_lru']:.2f}" if base else "-"
        print(f"{r['policy']:<10}{r['blocks_per_s']:>12,.0f}{ratio:>8}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "block_bytes": LAYOUT.block_bytes, "rows": rows},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
