"""The tier paths: one tier's own read/write between it and the tier above, against the limit.

| path      | spill (timed kvtier op)                  | fill                         | limit            |
|-----------|------------------------------------------|------------------------------|------------------|
| hbm-dram  | `HBMTier.read` of a slot into a DRAM slot | `HBMTier.write` from it      | `CopyLimit`      |
| dram-pool | `PoolTier.write` from a DRAM slot         | `PoolTier.read` into it      | `SocketLimit`    |
| dram-ssd  | `SSDTier.write` from a DRAM slot          | `SSDTier.read` into it       | `DirectIOLimit`  |

Every block has its own slot on both tiers and its own limit-side buffer. Before a row is timed,
one untimed spill pass writes every block (first touch of memory, the pool's slot allocation, the
filesystem's first allocation), and the fill row reads what the spill rows wrote.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvtier.bench.limits import CopyLimit, DirectIOLimit, SocketLimit, random_fill
from kvtier.bench.measure import Budget, Measured, Op, measure, paired_times, summarize
from kvtier.tiers.dram import DRAMTier

PathFn = Callable[["BenchEnv", int, int, int, Budget], list[Measured]]


@dataclass
class BenchEnv:
    """What the paths share within one run.

    Attributes:
        device: where the HBM tier (and the device side of its limit) lives.
        workdir: the bench's own directory inside --ssd-dir; removed after the run.
        pool_address: HOST:PORT of the pool node (None: no pool path is run).
        rawsock: the raw socket server (`rawsock.RawSocketServer`) the pool limits talk to.
        pool_timeout_s: the pool client's per-call timeout.
        facts: what the paths learn on the way (O_DIRECT active, pool transport), for the report.
    """

    device: torch.device
    workdir: str
    pool_address: str | None = None
    rawsock: object | None = None
    pool_timeout_s: float = 10.0
    facts: dict[str, dict] = field(default_factory=dict)


def spill_and_fill(path: str, block_bytes: int, depth: int, num_blocks: int, budget: Budget,
                   tier_ops: tuple[Op, Op], limit, bytes_per_op: int | None = None,
                   concurrency: int | None = None, after_warm: Callable[[], None] | None = None) -> list[Measured]:
    """One untimed spill pass over all blocks (then `after_warm()`), then the spill row and the fill row.

    `tier_ops` and the limit's `spill`/`fill` take (thread, block). `bytes_per_op` and `concurrency`
    default to one block from `depth` threads (an end-to-end call moves `depth` blocks from one).
    """
    threads = depth if concurrency is None else concurrency
    per_op = block_bytes if bytes_per_op is None else bytes_per_op
    spill, fill = tier_ops
    paired_times(num_blocks, threads, spill, limit.spill)
    if after_warm is not None:
        after_warm()
    rows = [summarize(path, "spill", block_bytes, depth, per_op, threads, limit.spill_name,
                      measure(num_blocks, threads, spill, limit.spill, budget))]
    paired_times(num_blocks, threads, fill, limit.fill, time.perf_counter() + budget.seconds / 8)
    rows.append(summarize(path, "fill", block_bytes, depth, per_op, threads, limit.fill_name,
                          measure(num_blocks, threads, fill, limit.fill, budget)))
    return rows


def dram_slab(num_blocks: int, block_bytes: int) -> tuple[DRAMTier, list[torch.Tensor]]:
    """A DRAM tier of `num_blocks` slots filled with random bytes, and a view of each slot."""
    dram = DRAMTier(num_blocks * block_bytes, block_bytes)
    views = [dram.view(b, 0, block_bytes) for b in range(num_blocks)]
    for v in views:
        random_fill(v)
    return dram, views


def hbm_dram(env: BenchEnv, block_bytes: int, depth: int, num_blocks: int, budget: Budget) -> list[Measured]:
    from kvtier.tiers.hbm import HBMTier

    hbm = HBMTier(num_blocks * block_bytes, block_bytes, device=env.device)
    dram, views = dram_slab(num_blocks, block_bytes)
    limit = CopyLimit(num_blocks, block_bytes, hbm.device)
    try:
        ops = (lambda t, b: hbm.read(b, views[b]), lambda t, b: hbm.write(b, views[b]))
        for b in range(num_blocks):  # HBM holds real data from the start
            hbm.write(b, views[b])
        return spill_and_fill("hbm-dram", block_bytes, depth, num_blocks, budget, ops, limit)
    finally:
        limit.close()
        hbm.close()
        dram.close()


def dram_pool(env: BenchEnv, block_bytes: int, depth: int, num_blocks: int, budget: Budget) -> list[Measured]:
    from kvtier.pool.client.api import PoolClient
    from kvtier.pool.client.tier import PoolTier

    dram, views = dram_slab(num_blocks, block_bytes)
    client = PoolClient([env.pool_address], timeout_s=env.pool_timeout_s)
    pool = PoolTier(client, num_blocks * block_bytes, block_bytes, owns_client=True)
    limit = SocketLimit(env.rawsock, num_blocks, block_bytes, depth)
    try:
        ops = (lambda t, b: pool.write(b, views[b]), lambda t, b: pool.read(b, views[b]))
        record_facts(env, pool)
        return spill_and_fill("dram-pool", block_bytes, depth, num_blocks, budget, ops, limit)
    finally:
        limit.close()
        pool.close()
        dram.close()


def dram_ssd(env: BenchEnv, block_bytes: int, depth: int, num_blocks: int, budget: Budget) -> list[Measured]:
    from kvtier.tiers.ssd import SSDTier

    dram, views = dram_slab(num_blocks, block_bytes)
    ssd = SSDTier(env.workdir, num_blocks * block_bytes, block_bytes, num_files=4)
    try:
        limit = DirectIOLimit(env.workdir, num_blocks, block_bytes, ssd.o_direct)
    except BaseException:
        ssd.close()
        raise
    record_facts(env, ssd)
    try:
        ops = (lambda t, b: ssd.write(b, views[b]), lambda t, b: ssd.read(b, views[b]))
        return spill_and_fill("dram-ssd", block_bytes, depth, num_blocks, budget, ops, limit)
    finally:
        limit.close()
        ssd.close()
        dram.close()


def record_facts(env: BenchEnv, tier) -> None:
    """Keeps what the report must say about a tier: O_DIRECT on the SSD, the pool client's transport."""
    facts = tier.describe()
    if facts["tier"] == "ssd":
        env.facts["ssd"] = {"o_direct": facts["o_direct"], "reason": facts["reason"]}
    elif facts["tier"] == "pool":
        env.facts["pool"] = {"client_transport": facts["transport"]}


def num_blocks_for(block_bytes: int, depth: int, working_set_bytes: int, max_blocks: int) -> int:
    """Blocks one row cycles over: the working set's worth (at most `max_blocks`), at least two per thread."""
    return max(2 * depth, min(max_blocks, math.ceil(working_set_bytes / block_bytes)))


PATHS: dict[str, PathFn] = {"hbm-dram": hbm_dram, "dram-pool": dram_pool, "dram-ssd": dram_ssd}
