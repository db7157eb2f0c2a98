"""Pool benchmark: put/get of one block through a `kvtier pool serve` node over TCP, against a raw
socket moving the same bytes to and from another process, measured in the same run.

For each block size (64 KiB to 4 MiB) every pool op is paired with a raw op of the same bytes, run
back to back with the order alternating, and each is timed alone. Reported: p50 and p99 latency of
the pool op, GB/s (block bytes / median op time) for both, and the ratio = median over pairs of
raw time / pool time (goal >= 0.8 at 1-4 MiB). Queue depth 1, one client thread. Rows "x8" move
8 blocks per call (`batch_put`/`batch_get`, one lookup for all), against one raw transfer of the
same bytes: what the runtime's multi-block loads see.

What a pool op includes that the raw one does not: put = one PUT frame (key and checksum in a msgpack
header, then the bytes, straight into the node's slot; a block the node holds already is sent anyway
and dropped) answered by a status, plus the block's xxh3-64; get = one GET answered with the bytes
inline, plus the xxh3-64 check; both sides validate every header. So both are one round trip, as the
raw op, and what remains is the fixed Python cost of an exchange on each side (about 20 µs of CPU
each, on a 2-core VM), which matters at 64-256 KiB and fades from 1 MiB on. The raw baseline is the
floor: one request, the bytes, one ack. Like the pool node, whose puts fill slot after slot and whose
gets cycle over a working set of up to 128 MiB, the raw server moves each op's bytes to or from the
next stretch of a 256 MiB buffer, so neither side's block is still in the CPU cache from the last op
(a raw server that reused one 1 MiB buffer measured its cache, not the socket: 6.8 GB/s at 1 MiB,
3.5 GB/s at 2 MiB). On the client both sides reuse one source and one destination buffer per size.
Side by side, the same ops on Mooncake Store (a `mooncake_master` subprocess, TCP, this process's own
segment; upsert from and get into a registered staging region, plus the xxh3 trailer) and on Redis
(Debian `redis-server`, no persistence; redis-py with hiredis, SET / MGET pipelined per batch).
Every server is a subprocess of this one on 127.0.0.1; the default run takes about a minute.

    python bench/bench_pool.py [--sizes-kib 64 256 1024 2048 4096] [--no-others] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console
from rich.table import Table

from kvtier.pool.client.api import PoolClient
from kvtier.pool.node.process import NodeProcess

KIB, MIB = 1 << 10, 1 << 20
GOAL = 0.8
GOAL_FROM_BYTES = MIB

# A raw socket server: "P" + u64 n + n bytes -> 1-byte ack; "G" + u64 n -> n bytes.
RAW_SERVER = r"""
import socket, struct, sys
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 0)); srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept(); conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = memoryview(bytearray(256 << 20))  # zero-filled, so every page is touched before the first op
head = memoryview(bytearray(9))
at = 0  # each op uses the next stretch of buf, as the pool's puts and gets use slot after slot
def fill(view):
    got = 0
    while got < len(view):
        k = conn.recv_into(view[got:])
        if k == 0: sys.exit(0)
        got += k
while True:
    fill(head)
    op, n = bytes(head[:1]), struct.unpack("!Q", head[1:])[0]
    at = 0 if at + n > len(buf) else at
    if op == b"P":
        fill(buf[at: at + n]); conn.sendall(b"k")
    else:
        conn.sendall(buf[at: at + n])
    at += n
"""


@dataclass(frozen=True, slots=True)
class Result:
    op: str
    block_bytes: int
    ops: int
    p50_us: float
    p99_us: float
    pool_gbps: float
    raw_gbps: float
    ratio: float
    goal: float | None
    mooncake_p50_us: float | None = None
    mooncake_p99_us: float | None = None
    mooncake_gbps: float | None = None
    redis_p50_us: float | None = None
    redis_p99_us: float | None = None
    redis_gbps: float | None = None


class RedisServer:
    """Debian's redis-server on a free loopback port, nothing persisted; a hiredis-parsed client."""

    def __init__(self) -> None:
        import redis

        from kvtier.testing.ports import start_on_picked_ports

        def start(ports):  # redis-server reads --port 0 as "no TCP": its port is picked, then checked
            return subprocess.Popen(["redis-server", "--port", str(ports[0]), "--bind", "127.0.0.1", "--save", "",
                                     "--appendonly", "no", "--protected-mode", "no"], stdout=subprocess.DEVNULL)

        try:
            self.proc, (port,) = start_on_picked_ports(start, 1, timeout_s=10)
        except RuntimeError as e:
            raise RuntimeError(f"redis-server did not come up: {e}") from None
        self.client = redis.Redis(host="127.0.0.1", port=port)
        self.client.ping()

    def batch_put(self, keys: list[bytes], blocks: list[memoryview]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for k, b in zip(keys, blocks):
            pipe.set(k, b)
        return [bool(r) for r in pipe.execute()]

    def batch_get(self, keys: list[bytes], intos: list[memoryview]) -> list[bool]:
        values = self.client.mget(keys)
        for v, into in zip(values, intos):
            if v is not None:
                into[:] = v
        return [v is not None for v in values]

    def delete(self, keys: list[bytes]) -> int:
        return self.client.delete(*keys)

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(10)


class RawClient:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", RAW_SERVER], stdout=subprocess.PIPE, text=True)
        port = int(self.proc.stdout.readline())
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def put(self, data: memoryview) -> None:
        sent = self.sock.sendmsg([b"P" + struct.pack("!Q", len(data)), data])  # blocking: all of it
        if sent < 9 + len(data):
            raise ConnectionError(f"raw put sent {sent} of {9 + len(data)} bytes")
        self._fill(memoryview(bytearray(1)))

    def get(self, into: memoryview) -> None:
        self.sock.sendall(b"G" + struct.pack("!Q", len(into)))
        self._fill(into)

    def _fill(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionError("raw server closed")
            got += k

    def close(self) -> None:
        self.sock.close()
        self.proc.wait(10)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def median(xs: list[float]) -> float:
    return percentile(xs, 0.5)


def timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def bench_size(pool: PoolClient, raw: RawClient, size: int, ops: int, batch: int, run_id: bytes) -> list[Result]:
    """`ops` pool calls of `batch` blocks of `size` bytes each, paired with raw transfers of the same bytes."""
    blocks = [memoryview(bytearray(os.urandom(size))) for _ in range(batch)]
    intos = [memoryview(bytearray(size)) for _ in range(batch)]
    raw_out, raw_in = memoryview(bytearray(size * batch)), memoryview(bytearray(size * batch))
    working = max(1, min(ops, (128 * MIB) // (size * batch)))  # the last batches put: resident for the gets
    keys = [[run_id + b"/%d/%d/%d" % (size, i, j) for j in range(batch)] for i in range(ops)]

    def put(i: int) -> None:
        if not all(pool.batch_put(keys[i], blocks)):
            raise RuntimeError(f"pool put of {batch} x {size} bytes failed: {pool.counters}")

    def get(i: int) -> None:
        if not all(pool.batch_get(keys[ops - working + i % working], intos)):
            raise RuntimeError(f"pool get of {batch} x {size} bytes missed: {pool.counters}")

    results = []
    name = "" if batch == 1 else f" x{batch}"
    for op, pool_op, raw_op, raw_buf in (("put", put, raw.put, raw_out), ("get", get, raw.get, raw_in)):
        pool_op(0), raw_op(raw_buf)  # warm connections and pages
        pool_t, raw_t, ratios = [], [], []
        for i in range(ops):
            if i % 2:
                r, p = timed(raw_op, raw_buf), timed(pool_op, i)
            else:
                p, r = timed(pool_op, i), timed(raw_op, raw_buf)
            pool_t.append(p)
            raw_t.append(r)
            ratios.append(r / p)
        nbytes = size * batch
        results.append(Result(op + name, size, ops, median(pool_t) * 1e6, percentile(pool_t, 0.99) * 1e6,
                              nbytes / median(pool_t) / 1e9, nbytes / median(raw_t) / 1e9, median(ratios),
                              GOAL if size >= GOAL_FROM_BYTES and batch == 1 else None))
    return results


def bench_side(store, size: int, ops: int, batch: int, run_id: bytes) -> dict[str, tuple[float, float, float]]:
    """(p50 µs, p99 µs, GB/s) of put and get on another store, same sizes and batches, queue depth 1."""
    blocks = [memoryview(bytearray(os.urandom(size))) for _ in range(batch)]
    intos = [memoryview(bytearray(size)) for _ in range(batch)]
    working = max(1, min(ops, (128 * MIB) // (size * batch)))
    keys = [[run_id + b"/%d/%d/%d" % (size, i, j) for j in range(batch)] for i in range(working)]
    # puts overwrite a working set of at most 128 MiB (both stores upsert), so no store fills up
    put = lambda i: all(store.batch_put(keys[i % working], blocks)) or sys.exit(f"put failed on {store}")
    get = lambda i: all(store.batch_get(keys[i % working], intos)) or sys.exit(f"get missed on {store}")
    out = {}
    for op, fn in (("put", put), ("get", get)):
        fn(0)
        ts = [timed(fn, i) for i in range(ops)]
        out[op] = (median(ts) * 1e6, percentile(ts, 0.99) * 1e6, size * batch / median(ts) / 1e9)
    for i in range(0, working, 64):  # leave the store empty for the next size
        store.delete([k for ks in keys[i: i + 64] for k in ks])
    return out


def with_sides(results: list[Result], sides: dict[str, dict]) -> list[Result]:
    """`results` with the other stores' figures of the same op filled in."""
    from dataclasses import replace

    out = []
    for r in results:
        extra = {f"{name}_{f}": v for name, figures in sides.items()
                 for f, v in zip(("p50_us", "p99_us", "gbps"), figures[r.op.split()[0]])}
        out.append(replace(r, **extra))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-kib", type=int, nargs="+", default=[64, 256, 1024, 2048, 4096])
    p.add_argument("--bytes-per-size-mib", type=int, default=256, help="bytes moved per size and op (default 256)")
    p.add_argument("--min-ops", type=int, default=60)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8],
                   help="blocks per call (default 1 and 8); the raw baseline moves the same bytes at once")
    p.add_argument("--no-others", action="store_true", help="skip the Mooncake Store and Redis columns")
    p.add_argument("--json", type=Path, help="also write the results as JSON to this path")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    started = time.perf_counter()
    biggest = max(args.sizes_kib) * KIB
    region = max(4 * MIB, -(-biggest // (4 * KIB)) * 4 * KIB)
    node = NodeProcess(capacity=str(max(512 * MIB, 8 * region * max(args.batches))), region_size=str(region))
    raw = RawClient()
    results: list[Result] = []
    others, closers = {}, []
    try:
        if not args.no_others:
            from kvtier.pool.mooncake import MooncakeClient
            from kvtier.testing.mooncake_master import MasterProcess

            master = MasterProcess()
            closers.append(master.close)
            mooncake = MooncakeClient(master.address, master.metadata_server, segment_bytes=1 << 30,
                                      staging_bytes=max(64 * MIB, 2 * biggest * max(args.batches)))
            closers.insert(0, mooncake.close)
            redis_server = RedisServer()
            closers.append(redis_server.close)
            others = {"mooncake": mooncake, "redis": redis_server}
        with PoolClient([node.address], timeout_s=30) as pool:
            for batch in args.batches:
                for kib in args.sizes_kib:
                    size = kib * KIB
                    ops = max(args.min_ops, (args.bytes_per_size_mib * MIB) // (size * batch))
                    rows = bench_size(pool, raw, size, ops, batch, os.urandom(8))
                    sides = {name: bench_side(store, size, ops, batch, os.urandom(8)) for name, store in others.items()}
                    results += with_sides(rows, sides) if sides else rows
            node_facts = pool.stats()[0]
    finally:
        for close in closers:
            close()
        raw.close()
        node.close()
    facts = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
             "transport": node_facts["transport"], "transport_reason": node_facts["transport_reason"],
             "elapsed_s": round(time.perf_counter() - started, 1), "results": [asdict(r) for r in results]}
    table = Table("op", "block", "calls", "p50 µs", "p99 µs", "pool GB/s", "raw GB/s", "ratio", "goal",
                  "mooncake p50/p99 µs", "mooncake GB/s", "redis p50/p99 µs", "redis GB/s",
                  title=f"kvtier pool over {facts['transport']} ({facts['transport_reason']}), queue depth 1")
    side = lambda p50, p99: "" if p50 is None else f"{p50:,.0f} / {p99:,.0f}"
    gbps = lambda g: "" if g is None else f"{g:.2f}"
    for r in results:
        verdict = "" if r.goal is None else ("≥ 0.8 ✓" if r.ratio >= r.goal else "≥ 0.8 ✗")
        table.add_row(r.op, f"{r.block_bytes // KIB} KiB", str(r.ops), f"{r.p50_us:,.0f}", f"{r.p99_us:,.0f}",
                      f"{r.pool_gbps:.2f}", f"{r.raw_gbps:.2f}", f"{r.ratio:.2f}", verdict,
                      side(r.mooncake_p50_us, r.mooncake_p99_us), gbps(r.mooncake_gbps),
                      side(r.redis_p50_us, r.redis_p99_us), gbps(r.redis_gbps))
    console.print(table)
    console.print(f"{facts['machine']['cpus']} CPUs, {facts['elapsed_s']} s")
    if args.json:
        args.json.write_text(json.dumps(facts, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
