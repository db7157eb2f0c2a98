"""Where a queue-depth-1 pool fill's time goes: the same block read four ways, op by op, in turn.

`kvtier bench`'s e2e-hbm-pool fill row compares `KVTier.load(sync=True)` of one block with a raw
socket read of the same bytes. This splits that gap by layer, each way timed against the raw read
in the same pass (the ratio is the median over pairs of raw time / this way's time):

  raw             `kvtier.bench.rawsock`: a Python server that sends n bytes on request (the limit)
  bare client     one pre-encoded GET to a real `kvtier pool serve` node, the reply read into a buffer
                  with three `recv_into` calls, nothing checked: what the node's own handling costs
  PoolClient.get  the pool client's GET: the protocol, a connection from its pool, the checksum
  KVTier.load     the runtime: plan, transfer engine, route, pool tier, client (checked as it lands)

Then each way again alone, for its CPU per op in this process and in the server's.

    python bench/bench_pool_qd1.py [--block 1MiB] [--ops 1500] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

from kvtier.bench.e2e import NUM_LAYERS, runtime_config
from kvtier.bench.measure import cpu_spent
from kvtier.bench.rawsock import RawSocketServer, recv_exactly
from kvtier.kinds import TierKind
from kvtier.model.layout import BlockLayout
from kvtier.pool.client.api import PoolClient
from kvtier.pool.node.process import NodeProcess
from kvtier.pool.protocol import PREFIX, MsgType, encode
from kvtier.runtime import KVTier
from kvtier.units import format_bytes, parse_size

NUM_BLOCKS = 16
WARM_OPS = 100
CPU_OPS = 400


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--block", default="1MiB", help="block size (default 1MiB)")
    p.add_argument("--ops", type=int, default=1500, help="timed ops per way (default 1500)")
    p.add_argument("--json", type=Path, help="write the rows as JSON here")
    args = p.parse_args(argv)
    args.block_bytes = parse_size(args.block, "--block")
    if args.block_bytes <= 0 or args.block_bytes % (NUM_LAYERS * 4096):
        p.error(f"--block: {args.block} is not {NUM_LAYERS} layers of whole 4KiB pages")
    if args.ops <= 0:
        p.error("--ops must be positive")
    return args


def measure(args: argparse.Namespace) -> dict:
    size = args.block_bytes
    node = NodeProcess(capacity=str(max(64 << 20, 4 * NUM_BLOCKS * size)), region_size=str(max(8 << 20, size)))
    raw = RawSocketServer()
    closers: list[Callable[[], None]] = []
    try:
        src = torch.randint(0, 256, (NUM_BLOCKS, size), dtype=torch.uint8)
        env = types.SimpleNamespace(pool_address=node.address, pool_timeout_s=10.0, device=torch.device("cpu"),
                                    workdir="/tmp")
        kv = KVTier(runtime_config(env, TierKind.POOL, size, 1, 4 * NUM_BLOCKS),
                    layout=BlockLayout.uniform(16, NUM_LAYERS, size // NUM_LAYERS))
        closers.append(kv.close)
        salt = os.urandom(8)
        kv_keys = [[salt + i.to_bytes(8, "little")] for i in range(NUM_BLOCKS)]
        for i, key in enumerate(kv_keys):  # stored into HBM, then demoted: held by the pool alone
            kv.store(key, src[i: i + 1], target=TierKind.HBM, sync=True)
            kv.quiesce(30)
        where = kv.where([k[0] for k in kv_keys])
        if any(w is not TierKind.POOL for w in where):
            raise RuntimeError(f"blocks not on the pool after demotion: {where}")

        tenant, secret = node.credentials
        client = PoolClient([node.address], tenant=tenant, secret=secret)
        closers.append(client.close)
        keys = [os.urandom(16) for _ in range(NUM_BLOCKS)]
        if not all(client.batch_put(keys, [src[i].numpy() for i in range(NUM_BLOCKS)])):
            raise RuntimeError("the pool node did not take the blocks")
        loan = client.links[0].connection()
        sock = loan.__enter__().frames.sock
        closers.append(lambda: loan.__exit__(None, None, None))
        requests = [encode(MsgType.GET, 1 << 40 | i, {"keys": [k], "lease_s": 5.0, "release": [], "inline": True})
                    for i, k in enumerate(keys)]
        head, header = bytearray(PREFIX.size), bytearray(64 << 10)

        rc = raw.connect()
        closers.append(rc.close)
        rc.put(memoryview(src[0].numpy()))
        out = bytearray(size)
        view = memoryview(out)
        dst = torch.empty((1, size), dtype=torch.uint8)

        def bare(i: int) -> None:
            sock.sendall(requests[i % NUM_BLOCKS])
            recv_exactly(sock, memoryview(head))
            *_, header_len, payload_len = PREFIX.unpack(head)
            recv_exactly(sock, memoryview(header)[:header_len])
            if payload_len != size:
                raise RuntimeError(f"bare GET: a reply of {payload_len} bytes, not {size}")
            recv_exactly(sock, view)

        def load(i: int) -> None:
            if kv.load(kv_keys[i % NUM_BLOCKS], dst, sync=True).failed:
                raise RuntimeError("KVTier.load failed a block held by the pool")

        def get(i: int) -> None:
            if not client.get(keys[i % NUM_BLOCKS], out):
                raise RuntimeError("PoolClient.get missed a block it stored")

        ways = {"raw": (lambda i: rc.get(view), raw.proc.pid), "bare client": (bare, node.proc.pid),
                "PoolClient.get": (get, node.proc.pid), "KVTier.load": (load, node.proc.pid)}
        times: dict[str, list[float]] = {name: [] for name in ways}
        for i in range(WARM_OPS + args.ops):
            for name, (op, _) in ways.items():
                t = time.perf_counter()
                op(i)
                if i >= WARM_OPS:
                    times[name].append(time.perf_counter() - t)
        if not torch.equal(dst[0], src[(WARM_OPS + args.ops - 1) % NUM_BLOCKS]):
            raise RuntimeError("KVTier.load delivered other bytes than were stored")
        cpu = {}
        for name, (op, pid) in ways.items():
            with cpu_spent(pid) as spent:
                for i in range(CPU_OPS):
                    op(i)
            cpu[name] = spent
        rows = []
        for name, ts in times.items():
            ratios = [r / t for r, t in zip(times["raw"], ts)]
            rows.append({"way": name, "p50_us": statistics.median(ts) * 1e6,
                         "ratio_to_raw": statistics.median(ratios),
                         "cpu_us_per_op": (cpu[name].user + cpu[name].system) / CPU_OPS * 1e6,
                         "server_cpu_us_per_op": cpu[name].other / CPU_OPS * 1e6})
        return {"block_bytes": size, "ops": args.ops, "transport": "tcp (127.0.0.1)", "rows": rows}
    finally:
        for close in reversed(closers):
            close()
        raw.close()
        node.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"{args.ops} ops of {format_bytes(args.block_bytes)} per way, in turn ...", file=sys.stderr, flush=True)
    result = measure(args)
    print(f"{'way':>15} {'p50 µs':>8} {'raw / way':>10} {'cpu µs/op':>10} {'server cpu µs/op':>17}")
    for r in result["rows"]:
        print(f"{r['way']:>15} {r['p50_us']:>8.0f} {r['ratio_to_raw']:>10.2f} {r['cpu_us_per_op']:>10.0f} "
              f"{r['server_cpu_us_per_op']:>17.0f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
