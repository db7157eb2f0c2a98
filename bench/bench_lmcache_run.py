"""The measuring half of bench/bench_lmcache.py: runs inside the LMCache venv, with kvtier from the checkout.

Both systems move the same rows of one caller tensor; each pass is timed with `perf_counter` and
`process_time` (the whole process's CPU, kvtier's worker threads included) and checked byte for
byte afterwards (untimed): a system that moved wrong bytes stops the run.
"""

from __future__ import annotations

import hashlib
import platform
import sys
import time
from dataclasses import dataclass, field

import torch

from bench_lmcache import BLOCK_TOKENS, NUM_LAYERS, Sample, blocks_per_pass, format_size

TIMEOUT_S = 120.0  # a safety net against a hung transfer, never a measurement


class KVTierSide:
    """A DRAM-only `KVTier` with room for `capacity_blocks` (never evicts during the bench)."""

    name = "kvtier"

    def __init__(self, block_bytes: int, capacity_blocks: int, sync: bool) -> None:
        from kvtier.config import KVTierConfig, TierConfig
        from kvtier.kinds import TierKind
        from kvtier.model.layout import BlockLayout
        from kvtier.runtime import KVTier

        layout = BlockLayout.uniform(BLOCK_TOKENS, NUM_LAYERS, block_bytes // NUM_LAYERS)
        tier = TierConfig(TierKind.DRAM, capacity_blocks * block_bytes, high_watermark=1.0, low_watermark=1.0)
        self.kv = KVTier(KVTierConfig(model="kvtier-bench", tiers=(tier,)), layout=layout)
        self.sync = sync

    def keys(self, tag: str, n: int) -> list[bytes]:
        return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(n)]

    def store(self, keys, rows: torch.Tensor) -> None:
        h = self.kv.store(keys, rows, sync=self.sync)
        _finished(h, "store")

    def load(self, keys, rows: torch.Tensor) -> None:
        h = self.kv.load(keys, rows, sync=self.sync)
        _finished(h, "load")

    def close(self) -> None:
        self.kv.close()


def _finished(handle, what: str) -> None:
    if not handle.wait(TIMEOUT_S) or handle.failed:
        first = next(iter(handle.failed.values()), None)
        raise RuntimeError(f"kvtier {what}: {len(handle.failed)} blocks failed ({first})")


class LMCacheSide:
    """LMCache's `LocalCPUBackend` with its own allocator, as its storage manager creates it."""

    name = "lmcache"

    def __init__(self, block_bytes: int, capacity_blocks: int) -> None:
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        head_size = block_bytes // (NUM_LAYERS * 2 * BLOCK_TOKENS * 2)  # bf16 K and V, one KV head
        if head_size * NUM_LAYERS * 2 * BLOCK_TOKENS * 2 != block_bytes:
            raise ValueError(f"block of {block_bytes} bytes is not {NUM_LAYERS} layers x 2 x {BLOCK_TOKENS} tokens of bf16")
        self.metadata = LMCacheMetadata(model_name="kvtier-bench", world_size=1, local_world_size=1, worker_id=0,
                                        local_worker_id=0, kv_dtype=torch.bfloat16,
                                        kv_shape=(NUM_LAYERS, 2, BLOCK_TOKENS, 1, head_size), chunk_size=BLOCK_TOKENS)
        slack = 2 * block_bytes + (1 << 20)  # the allocator's alignment and bookkeeping
        size_gb = (capacity_blocks * block_bytes + slack) / (1 << 30)
        config = LMCacheEngineConfig.from_defaults(chunk_size=BLOCK_TOKENS, local_cpu=True, max_local_cpu_size=size_gb)
        self.backend = LocalCPUBackend(config, self.metadata)
        self.shapes = self.metadata.get_shapes(BLOCK_TOKENS)
        self.dtypes = self.metadata.get_dtypes()
        buffer = getattr(self.backend.memory_allocator, "buffer", None)
        if isinstance(buffer, torch.Tensor):
            buffer.zero_()  # every page touched before timing, as kvtier's DRAM slab is at creation

    def keys(self, tag: str, n: int) -> list:
        from lmcache.utils import CacheEngineKey

        return [CacheEngineKey("kvtier-bench", 1, 0, int.from_bytes(hashlib.blake2b(f"{tag}/{i}".encode(),
                                                                                    digest_size=8).digest()),
                               torch.bfloat16) for i in range(n)]

    def store(self, keys, rows: torch.Tensor) -> None:
        objs = []
        for key, row in zip(keys, rows):  # the engine allocates one chunk at a time (cache_engine.store)
            obj = self.backend.allocate(self.shapes, self.dtypes, busy_loop=False)
            if obj is None:
                raise RuntimeError(f"LMCache allocate failed for {key}: the bench sized its memory too small")
            obj.tensor.copy_(row.view(obj.tensor.dtype).view(obj.tensor.shape))
            objs.append(obj)
        if len(objs) == 1:
            self.backend.submit_put_task(keys[0], objs[0])
        else:
            self.backend.batched_submit_put_task(keys, objs)
        for obj in objs:  # as StorageManager.batched_put does once the backends hold their references
            obj.ref_count_down()

    def load(self, keys, rows: torch.Tensor) -> None:
        objs = [self.backend.get_blocking(keys[0])] if len(keys) == 1 else self.backend.batched_get_blocking(keys)
        for key, obj, row in zip(keys, objs, rows):
            if obj is None:
                raise RuntimeError(f"LMCache get: {key} is missing")
            row.view(obj.tensor.dtype).view(obj.tensor.shape).copy_(obj.tensor)
            obj.ref_count_down()

    def close(self) -> None:
        self.backend.close()


class MemcpySide:
    """The reference: a store is `copy_` of the caller's rows into a slab, a load `copy_` back out."""

    name = "memcpy"

    def __init__(self, block_bytes: int, num_blocks: int) -> None:
        self.slab = torch.zeros((num_blocks, block_bytes), dtype=torch.uint8)

    def keys(self, tag: str, n: int) -> list[int]:
        return list(range(n))

    def store(self, keys, rows: torch.Tensor) -> None:
        self.slab[keys[0]:keys[0] + len(keys)].copy_(rows)

    def load(self, keys, rows: torch.Tensor) -> None:
        rows.copy_(self.slab[keys[0]:keys[0] + len(keys)])

    def close(self) -> None:
        self.slab = None


@dataclass
class Lane:
    """One system's part of a round: its own caller rows (so no side reads rows another just warmed
    in the CPU caches), its keys, and the time and CPU its calls took."""

    side: object
    src: torch.Tensor
    dst: torch.Tensor
    keys: list = field(default_factory=list)
    seconds: float = 0.0
    cpu_seconds: float = 0.0

    def run(self, op: str, first: int, last: int, batch: int) -> None:
        move = self.side.store if op == "store" else self.side.load
        rows = self.src if op == "store" else self.dst
        cpu0, t0 = time.process_time(), time.perf_counter()
        for i in range(first, last, batch):
            move(self.keys[i:i + batch], rows[i:i + batch])
        self.seconds += time.perf_counter() - t0
        self.cpu_seconds += time.process_time() - cpu0


def slice_blocks(block_bytes: int, batch: int) -> int:
    """Blocks per slice: whole calls, about 8 MiB, so that the systems take turns many times per pass."""
    return max(1, (8 << 20) // (block_bytes * batch)) * batch


def one_round(lanes: list[Lane], rnd: int, batch: int) -> list[Sample]:
    """Every lane stores fresh keys, then loads them back; the lanes take turns slice by slice (who
    goes first flips every slice and every round), so load from other processes hits them alike."""
    n, size = lanes[0].src.shape
    step = slice_blocks(size, batch)
    out = []
    for lane in lanes:
        lane.keys = lane.side.keys(f"{size}/{batch}/{rnd}", n)
        lane.dst.zero_()
    for op in ("store", "load"):
        for lane in lanes:
            lane.seconds = lane.cpu_seconds = 0.0
        for j, first in enumerate(range(0, n, step)):
            order = lanes if (j + rnd) % 2 == 0 else lanes[::-1]
            for lane in order:
                lane.run(op, first, min(n, first + step), batch)
        out += [Sample(lane.side.name, op, size, batch, rnd, n, lane.seconds, lane.cpu_seconds) for lane in lanes]
    for lane in lanes:  # untimed: a system that moved wrong bytes stops the run
        if not torch.equal(lane.src, lane.dst):
            raise RuntimeError(f"{lane.side.name}: round {rnd} loaded bytes that differ from what was stored")
    return out


def measure(block_bytes: int, batch: int, args) -> list[Sample]:
    """Fresh instances of each, an untimed warm-up round, then `args.rounds` timed rounds."""
    n = blocks_per_pass(block_bytes, batch, args.round_mib)
    capacity = (args.rounds + 1) * n
    src = torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8)
    lanes = []
    try:
        for make in (lambda: KVTierSide(block_bytes, capacity, args.sync), lambda: LMCacheSide(block_bytes, capacity),
                     lambda: MemcpySide(block_bytes, n)):
            lanes.append(Lane(make(), src.clone(), torch.zeros_like(src)))
        one_round(lanes, -1, batch)
        samples = []
        for rnd in range(args.rounds):
            got = one_round(lanes, rnd, batch)
            samples += got
            print(_progress(got, block_bytes, batch, rnd), flush=True)
    finally:
        for lane in lanes:
            lane.side.close()
    return samples


def _progress(got: list[Sample], block_bytes: int, batch: int, rnd: int) -> str:
    by = {(s.system, s.op): s.gbps for s in got}
    parts = [f"{op} kvtier {by['kvtier', op]:.2f} lmcache {by['lmcache', op]:.2f} "
             f"({by['kvtier', op] / by['lmcache', op]:.2f}x)" for op in ("store", "load")]
    return (f"  {format_size(block_bytes):>7} x{batch:<2} round {rnd}: " + "; ".join(parts)
            + f"; memcpy {by['memcpy', 'store']:.2f}/{by['memcpy', 'load']:.2f} GB/s")


def run_all(args) -> tuple[list[Sample], dict]:
    """Every (block size, batch) in turn; returns the samples and what ran."""
    import lmcache
    import kvtier

    torch.set_num_threads(args.torch_threads)  # both systems' copy_ and the reference run alike
    facts = {"lmcache_version": getattr(lmcache, "__version__", "unknown"), "kvtier_path": str(kvtier.__file__),
             "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "python": sys.version.split()[0], "machine": platform.machine(),
             "cpus": _cpus(), "rounds": args.rounds, "round_mib": args.round_mib, "kvtier_sync": args.sync,
             "batches": list(args.batches), "sizes": list(args.sizes), **_checkout(args.kvtier_root)}
    dirty = f", {len(facts['kvtier_modified'])} files modified" if facts["kvtier_modified"] else ""
    print(f"bench_lmcache: kvtier from {facts['kvtier_path']} at {(facts['kvtier_commit'] or '?')[:10]}{dirty}, "
          f"lmcache {facts['lmcache_version']}, torch {facts['torch']} ({args.torch_threads} threads), "
          f"{facts['cpus']} CPUs", flush=True)
    samples = []
    for size in args.sizes:
        for batch in args.batches:
            samples += measure(size, batch, args)
    return samples, facts


def _checkout(root) -> dict:
    """The commit kvtier was imported at, and whether its files differed from it (work in progress)."""
    import subprocess

    def git(*cmd: str) -> str:
        done = subprocess.run(["git", "-C", str(root), *cmd], capture_output=True, text=True, check=False)
        return done.stdout.rstrip() if done.returncode == 0 else ""

    return {"kvtier_commit": git("rev-parse", "HEAD") or None,
            "kvtier_modified": sorted(line[3:] for line in git("status", "--porcelain", "--", "kvtier", "setup.py")
                                      .splitlines())}


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)
