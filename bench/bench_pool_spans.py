"""Pool tier batches: `PoolTier.write_spans`/`read_spans` of a batch of blocks against the same
blocks through one-by-one `write`/`read`, and against the raw TCP limit, all in one run.

A `kvtier pool serve` node (TCP, 127.0.0.1) in its own process; a `PoolTier` (shared, keyed blocks)
in this one. Per block size and repetition, in turn: the batch written with `write_spans` (fresh
keys, so nothing is deduplicated) and read back with `read_spans`, a block larger than `--span`
in spans of that size (offset 0 first, as the transfer engine moves it: one call per span for
the whole batch); the same number of fresh blocks written one by one (`bind` + `write`, span by
span) and read one by one. The raw limit: the batch's bytes sent as
one message to a raw socket server and received back as one (`kvtier.bench.rawsock`: no header,
no checksum, no index). Reported: the median time per batch, GB/s, and the ratios batched /
one-by-one and batched / raw. Two vCPUs shared with other work give noisy figures: compare the
ratios of one run, not absolute numbers across runs.

    python bench/bench_pool_spans.py [--blocks 16] [--sizes 64KiB,1MiB] [--span 1MiB] [--reps 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import secrets
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from kvtier.bench.rawsock import RawSocketServer  # noqa: E402
from kvtier.pool.buffers import byte_view  # noqa: E402
from kvtier.pool.client.api import PoolClient  # noqa: E402
from kvtier.pool.client.tier import PoolTier  # noqa: E402
from kvtier.pool.node.process import NodeProcess  # noqa: E402
from kvtier.tiers.base import SpanIO  # noqa: E402
from kvtier.units import parse_size  # noqa: E402


def spans_of(block_bytes: int, span_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each span of a block, offset 0 first, as the engine moves a block."""
    return [(at, min(span_bytes, block_bytes - at)) for at in range(0, block_bytes, span_bytes)]


def batch_io(data: torch.Tensor, keys: list[bytes], offset: int, length: int) -> SpanIO:
    return SpanIO(list(range(len(keys))), offset, length, [row.data_ptr() + offset for row in data], keys)


def one_rep(tier: PoolTier, raw, data: torch.Tensor, out: torch.Tensor, span_bytes: int) -> dict[str, float]:
    """Seconds for each way of moving the batch once (writes with fresh keys)."""
    n, t = data.shape[0], {}
    spans = spans_of(data.shape[1], span_bytes)
    keys = [secrets.token_bytes(16) for _ in range(n)]
    failed: dict[int, Exception] = {}
    start = time.perf_counter()
    for offset, length in spans:
        failed.update(tier.write_spans(batch_io(data, keys, offset, length)))
    t["write_spans"] = time.perf_counter() - start
    out.zero_()
    start = time.perf_counter()
    for offset, length in spans:
        failed.update(tier.read_spans(batch_io(out, keys, offset, length)))
    t["read_spans"] = time.perf_counter() - start
    if failed or not torch.equal(out, data):
        raise RuntimeError(f"batched round trip failed: {failed}")
    keys = [secrets.token_bytes(16) for _ in range(n)]
    start = time.perf_counter()
    for i, key in enumerate(keys):
        tier.bind(i, key)
        for offset, length in spans:
            tier.write(i, data[i, offset: offset + length], offset)
    t["write_one_by_one"] = time.perf_counter() - start
    out.zero_()
    start = time.perf_counter()
    for i in range(n):
        for offset, length in spans:
            tier.read(i, out[i, offset: offset + length], offset)
    t["read_one_by_one"] = time.perf_counter() - start
    if not torch.equal(out, data):
        raise RuntimeError("one-by-one round trip failed")
    whole_in = byte_view(data.view(-1), writable=False, what="raw")
    whole_out = byte_view(out.view(-1), writable=True, what="raw")
    start = time.perf_counter()
    raw.put(whole_in)
    t["raw_send"] = time.perf_counter() - start
    start = time.perf_counter()
    raw.get(whole_out)
    t["raw_recv"] = time.perf_counter() - start
    return t


def measure(node: NodeProcess, raw_server: RawSocketServer, num_blocks: int, block_bytes: int,
            reps: int, span_bytes: int) -> dict[str, object]:
    client = PoolClient([node.address], timeout_s=30)
    tier = PoolTier(client, 2 * num_blocks * block_bytes, block_bytes, owns_client=True)
    raw = raw_server.connect()
    data = torch.randint(0, 256, (num_blocks, block_bytes), dtype=torch.uint8)
    out = torch.empty_like(data)
    try:
        one_rep(tier, raw, data, out, span_bytes)  # warm: connections, allocations
        runs = [one_rep(tier, raw, data, out, span_bytes) for _ in range(reps)]
    finally:
        raw.close()
        tier.close()
    median = {name: statistics.median(r[name] for r in runs) for name in runs[0]}
    total = num_blocks * block_bytes
    return {"block_bytes": block_bytes, "span_bytes": min(span_bytes, block_bytes), "num_blocks": num_blocks, "reps": reps,
            "median_s": median, "gb_s": {k: total / v / 1e9 for k, v in median.items()},
            "ratio": {"write_spans/one_by_one": median["write_one_by_one"] / median["write_spans"],
                      "read_spans/one_by_one": median["read_one_by_one"] / median["read_spans"],
                      "write_spans/raw": median["raw_send"] / median["write_spans"],
                      "read_spans/raw": median["raw_recv"] / median["read_spans"]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--sizes", default="64KiB,1MiB")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--span", default="1MiB", help="layer span: a larger block moves in spans of this (chunk_bytes)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = [parse_size(s, "--sizes") for s in args.sizes.split(",")]
    span_bytes = parse_size(args.span, "--span")
    node = NodeProcess(capacity=f"{max(512 << 20, 8 * args.blocks * max(sizes))}",
                       region_size=f"{max(4 << 20, 2 * max(sizes))}")
    raw_server = RawSocketServer()
    try:
        rows = [measure(node, raw_server, args.blocks, size, args.reps, span_bytes) for size in sizes]
    finally:
        raw_server.close()
        node.close()
    table = Table(title=f"PoolTier batches of {args.blocks} blocks, TCP loopback, median of {args.reps}")
    for col in ("block", "way", "write GB/s", "read GB/s", "write x", "read x"):
        table.add_column(col, justify="right")
    for r in rows:
        g, q = r["gb_s"], r["ratio"]
        kib = f"{r['block_bytes'] >> 10} KiB" + (f" ({r['block_bytes'] // r['span_bytes']} spans)"
                                                 if r["span_bytes"] < r["block_bytes"] else "")
        table.add_row(kib, "spans", f"{g['write_spans']:.2f}", f"{g['read_spans']:.2f}", "1.00", "1.00")
        table.add_row(kib, "one by one", f"{g['write_one_by_one']:.2f}", f"{g['read_one_by_one']:.2f}",
                      f"{1 / q['write_spans/one_by_one']:.2f}", f"{1 / q['read_spans/one_by_one']:.2f}")
        table.add_row(kib, "raw TCP (one message)", f"{g['raw_send']:.2f}", f"{g['raw_recv']:.2f}",
                      f"{1 / q['write_spans/raw']:.2f}", f"{1 / q['read_spans/raw']:.2f}")
    Console().print(table)
    Console().print("x: that way's GB/s over the spans' GB/s (spans / raw = 1 / x of the raw row)")
    report = {"machine": {"python": platform.python_version(), "cpus": __import__("os").cpu_count()}, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
