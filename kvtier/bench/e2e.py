"""End to end: spill from HBM to one lower tier and fill back, through a real `KVTier`.

The runtime holds two tiers: HBM, whose watermarks are set so low that every block stored there is
demoted at once, and the lower tier under test, which never demotes (watermarks at 1.0) and is
sized to hold the blocks a row cycles over. Loads do not promote, so a fill reads the lower tier
straight into the caller's device buffer.

One op is one call with `queue_depth` blocks (the engine's `io_workers` is set to the same number),
made as an engine that waits for each call makes it (`sync=True`: the copies run in the caller's
thread, no hand-off to a worker and back):
  spill: `store(keys, blocks_on_device, sync=True)` into HBM, then `quiesce()` until the demotions
         into the lower tier have landed (background moves: checksums computed on the way below DRAM);
  fill:  `load(keys, device_buffer, sync=True)` of blocks held by the lower tier (checksums
         verified on the way up from below DRAM).
Its limit moves the same `queue_depth` blocks with the lower medium's raw op, one thread per block:
pinned cudaMemcpy / memcpy for DRAM, a raw TCP socket for the pool, raw O_DIRECT for the SSD.
The engine's device<->host leg has no limit of its own here; the hbm-dram path measures it alone.
"""

from __future__ import annotations

import faulthandler
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvtier.bench.limits import CopyLimit, DirectIOLimit, SocketLimit, random_fill
from kvtier.bench.measure import Budget, Measured, measure, paired_times, summarize
from kvtier.bench.paths import BenchEnv, PathFn, record_facts, spill_and_fill
from kvtier.errors import TransferError
from kvtier.tiers.base import TierKind

NUM_LAYERS = 32  # a block is laid out as this many equal layers, as a 7-8B model's are
CHUNK_BYTES = 1 << 20  # the runtime's default: layers copied in runs of at least 1 MiB
DEMOTE_AT_ONCE = 1e-6  # an HBM watermark any one block passes
TIMEOUT_S = 120.0  # a safety net against a hung transfer, never a measurement
# A sync call has no timeout (the pool client's own bounds a remote call, nothing bounds a hung
# disk): past this, a path's run ends the process with every thread's traceback.
WATCHDOG_S = 900.0


def runtime_config(env: BenchEnv, lower: TierKind, block_bytes: int, depth: int, num_blocks: int):
    """The two-tier `KVTierConfig`: HBM of 2 x depth slots over `lower` of `num_blocks + depth`."""
    from kvtier.config import KVTierConfig, PrefetchConfig, TierConfig, TransferConfig

    hbm = TierConfig(TierKind.HBM, 2 * depth * block_bytes, high_watermark=DEMOTE_AT_ONCE,
                     low_watermark=DEMOTE_AT_ONCE, device=str(env.device))
    capacity = (num_blocks + depth) * block_bytes
    if lower is TierKind.SSD:
        low = TierConfig(TierKind.SSD, capacity, high_watermark=1.0, low_watermark=1.0,
                         path=Path(env.workdir) / "e2e-ssd", num_files=4)
    elif lower is TierKind.POOL:
        # No write-through (a shared pool's default for BlockKeys): a spill is the demotion path.
        low = TierConfig(TierKind.POOL, capacity, high_watermark=1.0, low_watermark=1.0, write_through=False,
                         nodes=(env.pool_address,), timeout_s=env.pool_timeout_s)
    else:
        low = TierConfig(lower, capacity, high_watermark=1.0, low_watermark=1.0)
    return KVTierConfig(model="kvtier-bench", tiers=(hbm, low), promote_to=None,
                        transfer=TransferConfig(io_workers=depth, chunk_bytes=CHUNK_BYTES),
                        prefetch=PrefetchConfig(target=TierKind.HBM))


class _Calls:
    """The kvtier side: `spill(0, i)` stores a fresh batch as call `i`, `fill(0, i)` loads it back."""

    def __init__(self, kv, lower: TierKind, depth: int, num_calls: int, device: torch.device) -> None:
        self.kv, self.lower, self.depth = kv, lower, depth
        self.src = random_fill(torch.empty((depth, kv.layout.block_bytes), dtype=torch.uint8, device=device))
        self.dst = torch.empty_like(self.src)
        self.batches: list[list[bytes]] = [[] for _ in range(num_calls)]  # the latest keys stored as call i
        # 16-byte keys are `BlockKey`s, shared on the pool: a salt per run keeps them this run's own
        self._salt, self._next_key = os.urandom(8), 0

    def spill(self, t: int, call: int) -> None:
        keys = [self._salt + (self._next_key + j).to_bytes(8, "little") for j in range(self.depth)]
        self._next_key += self.depth
        handle = self.kv.store(keys, self.src, target=TierKind.HBM, sync=True)
        self.kv.quiesce(TIMEOUT_S)
        if handle.failed:
            raise TransferError(f"e2e spill to {self.lower.name}: {len(handle.failed)} blocks failed: "
                                f"{next(iter(handle.failed.values())).error}")
        self.batches[call] = keys

    def fill(self, t: int, call: int) -> None:
        handle = self.kv.load(self.batches[call], self.dst, sync=True)
        if handle.failed:
            raise TransferError(f"e2e fill from {self.lower.name}: {len(handle.failed)} blocks failed: "
                                f"{next(iter(handle.failed.values())).error}")

    def check(self) -> None:
        """After one spill pass: every block went down to the lower tier, and comes back intact."""
        where = set(self.kv.where(self.batches[0]))
        if where != {self.lower}:
            raise TransferError(f"e2e: blocks stored into HBM ended in {sorted(w.name for w in where if w)}, "
                                f"not demoted to {self.lower.name}")
        self.fill(0, 0)
        if not torch.equal(self.dst, self.src):
            raise TransferError(f"e2e: blocks filled back from {self.lower.name} differ from those spilled")


class _Parallel:
    """A limit's op on the `depth` blocks of one call, one thread per block."""

    def __init__(self, limit, depth: int) -> None:
        self.limit, self.depth = limit, depth
        self.pool = ThreadPoolExecutor(depth, thread_name_prefix="kvtier-bench") if depth > 1 else None
        suffix = f" x{depth} threads" if depth > 1 else ""
        self.spill_name, self.fill_name = limit.spill_name + suffix, limit.fill_name + suffix

    def spill(self, t: int, call: int) -> None:
        self._run(self.limit.spill, call)

    def fill(self, t: int, call: int) -> None:
        self._run(self.limit.fill, call)

    def _run(self, op, call: int) -> None:
        first = call * self.depth
        if self.pool is None:
            op(0, first)
            return
        for f in [self.pool.submit(op, j, first + j) for j in range(self.depth)]:
            f.result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        self.limit.close()


def _limit(env: BenchEnv, kv, lower: TierKind, num_blocks: int, block_bytes: int, depth: int):
    if lower is TierKind.SSD:
        return DirectIOLimit(env.workdir, num_blocks, block_bytes, kv.tiers[TierKind.SSD].o_direct)
    if lower is TierKind.POOL:
        return SocketLimit(env.rawsock, num_blocks, block_bytes, depth)
    return CopyLimit(num_blocks, block_bytes, env.device)


def e2e_path(lower: TierKind) -> PathFn:
    """The end-to-end path from HBM to `lower`, as a `paths.PathFn`."""
    name = f"e2e-hbm-{lower.name.lower()}"

    def run(env: BenchEnv, block_bytes: int, depth: int, num_blocks: int, budget: Budget) -> list[Measured]:
        from kvtier.model.layout import BlockLayout
        from kvtier.runtime import KVTier

        num_calls = max(2, num_blocks // depth)
        layout = BlockLayout.uniform(16, NUM_LAYERS, block_bytes // NUM_LAYERS)
        kv = KVTier(runtime_config(env, lower, block_bytes, depth, num_calls * depth), layout=layout)
        record_facts(env, kv.tiers[lower])
        try:
            calls = _Calls(kv, lower, depth, num_calls, env.device)
            limit = _Parallel(_limit(env, kv, lower, num_calls * depth, block_bytes, depth), depth)
        except BaseException:
            kv.close()
            raise
        faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
        try:
            return spill_and_fill(name, block_bytes, depth, num_calls, budget, (calls.spill, calls.fill), limit,
                                  bytes_per_op=depth * block_bytes, concurrency=1, after_warm=calls.check)
        finally:
            faulthandler.cancel_dump_traceback_later()
            limit.close()
            kv.close()

    return run


# The writer of the shared-pool row: its own process and KVTier (HBM over the pool, as the e2e
# pool row's), storing `num_calls` batches of `depth` blocks whose bytes follow from their index.
# argv: pool node, its timeout, device, block bytes, depth, num_calls, salt hex.
_WRITER = r"""
import sys, types, torch
from kvtier.bench.e2e import NUM_LAYERS, TIMEOUT_S, runtime_config, shared_block, shared_keys
from kvtier.model.layout import BlockLayout
from kvtier.runtime import KVTier
from kvtier.tiers.base import TierKind
env = types.SimpleNamespace(pool_address=sys.argv[1], pool_timeout_s=float(sys.argv[2]), device=sys.argv[3])
block_bytes, depth, num_calls, salt = *map(int, sys.argv[4:7]), bytes.fromhex(sys.argv[7])
layout = BlockLayout.uniform(16, NUM_LAYERS, block_bytes // NUM_LAYERS)
config = runtime_config(env, TierKind.POOL, block_bytes, depth, num_calls * depth)
with KVTier(config, layout=layout) as kv:
    for call in range(num_calls):
        keys = shared_keys(salt, call, depth)
        handle = kv.store(keys, torch.stack([shared_block(k, block_bytes) for k in keys]), target=TierKind.HBM, sync=True)
        kv.quiesce(TIMEOUT_S)
        if handle.failed or set(kv.where(keys)) != {TierKind.POOL}:
            snap = kv.snapshot()
            sys.exit(f"batch {call}: failed {len(handle.failed)}, in {kv.where(keys)}; dropped {snap['dropped']}, "
                     f"pool client {snap.get('pool_client')}")
"""


def shared_keys(salt: bytes, call: int, depth: int) -> list[bytes]:
    return [salt + (call * depth + j).to_bytes(8, "little") for j in range(depth)]


def shared_block(key: bytes, block_bytes: int) -> torch.Tensor:
    """A block's bytes, derived from its key: the reading process checks them without being told."""
    g = torch.Generator().manual_seed(int.from_bytes(key[8:], "little") ^ int.from_bytes(key[:8], "little"))
    return torch.randint(0, 256, (block_bytes,), dtype=torch.uint8, generator=g)


def shared_pool_path(env: BenchEnv, block_bytes: int, depth: int, num_blocks: int, budget: Budget) -> list[Measured]:
    """Blocks another process stored, loaded through the pool (`e2e-pool-shared`).

    A writer subprocess stores every batch through its own `KVTier` (HBM, demoted to the pool);
    this process's `KVTier` over the same node, which never saw them, then
      fill-first: `lookup(keys)` (one CONTAINS, the blocks adopted into its index) and
                  `load(keys, device_buffer, sync=True)`, once per batch;
      fill:       `load` again, as a later request reusing the prefix does.
    Both against the raw socket's recv of the same bytes (`SocketLimit`), as the e2e pool row.
    """
    from kvtier.model.layout import BlockLayout
    from kvtier.runtime import KVTier

    num_calls = max(4, num_blocks // depth)  # fill-first takes one sample per batch
    config = runtime_config(env, TierKind.POOL, block_bytes, depth, num_calls * depth)
    salt = os.urandom(8)
    writer = subprocess.run([sys.executable, "-c", _WRITER, env.pool_address, str(env.pool_timeout_s),
                             str(env.device), *map(str, (block_bytes, depth, num_calls)), salt.hex()],
                            capture_output=True, text=True, timeout=WATCHDOG_S)
    if writer.returncode != 0:
        raise TransferError(f"e2e-pool-shared: the writer process failed: {writer.stderr.strip()[-2000:]}")
    layout = BlockLayout.uniform(16, NUM_LAYERS, block_bytes // NUM_LAYERS)
    kv = KVTier(config, layout=layout)
    record_facts(env, kv.tiers[TierKind.POOL])
    dst = torch.empty((depth, block_bytes), dtype=torch.uint8, device=env.device)
    batches = [shared_keys(salt, call, depth) for call in range(num_calls)]

    def fill(t: int, call: int) -> None:
        keys = batches[call]
        if kv.lookup(keys) != depth:
            raise TransferError(f"e2e-pool-shared: batch {call} not found on the pool")
        handle = kv.load(keys, dst, sync=True)
        if handle.failed:
            raise TransferError(f"e2e-pool-shared: {len(handle.failed)} blocks failed: "
                                f"{next(iter(handle.failed.values())).error}")

    limit = _Parallel(SocketLimit(env.rawsock, num_calls * depth, block_bytes, depth), depth)
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    try:
        per_op = depth * block_bytes
        rows = [summarize("e2e-pool-shared", "fill-first", block_bytes, depth, per_op, 1, limit.fill_name,
                          paired_times(num_calls, 1, fill, limit.fill))]
        if kv.snapshot()["shared"].get("adopted", 0) != num_calls * depth:
            raise TransferError("e2e-pool-shared: the reader did not adopt every block from the pool")
        fill(0, 0)
        if not all(torch.equal(dst[j].cpu(), shared_block(k, block_bytes)) for j, k in enumerate(batches[0])):
            raise TransferError("e2e-pool-shared: blocks loaded differ from those the other process stored")
        rows.append(summarize("e2e-pool-shared", "fill", block_bytes, depth, per_op, 1, limit.fill_name,
                              measure(num_calls, 1, fill, limit.fill, budget)))
        return rows
    finally:
        faulthandler.cancel_dump_traceback_later()
        limit.close()
        kv.close()


E2E_PATHS: dict[str, PathFn] = {**{f"e2e-hbm-{k.name.lower()}": e2e_path(k)
                                   for k in (TierKind.DRAM, TierKind.POOL, TierKind.SSD)},
                                "e2e-pool-shared": shared_pool_path}
