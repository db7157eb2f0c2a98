"""One bench run: options, the plan of rows, the shared resources, and the measurements.

Before anything is written the run checks where it will write (`limits.check_ssd_dir`, sized from
the plan). It then starts what the paths share — a pool node on 127.0.0.1 unless one is given, the
raw socket server, a scratch directory inside the SSD directory — runs every (path, block size,
queue depth) in order, and removes all of it, whatever happens.
"""

from __future__ import annotations

import math
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace

import torch

from kvtier.bench.e2e import E2E_PATHS
from kvtier.bench.limits import check_ssd_dir, filesystem_of
from kvtier.bench.measure import Budget, Measured
from kvtier.bench.paths import PATHS, BenchEnv, num_blocks_for
from kvtier.errors import ConfigError, TransferError
from kvtier.moving import _movers

KIB, MIB = 1 << 10, 1 << 20
ALL_PATHS = (*PATHS, *E2E_PATHS)
GROUPS = {"e2e": tuple(E2E_PATHS)}  # names --tiers takes besides each path's own
POOL_PATHS = ("dram-pool", "e2e-hbm-pool", "e2e-pool-shared")
SSD_PATHS = ("dram-ssd", "e2e-hbm-ssd")
SLACK_BYTES = 16 * MIB  # headroom on the SSD filesystem beyond the bench's own files


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """What to measure and for how long.

    Attributes:
        paths: tier paths, in the order run (see ALL_PATHS).
        sizes_bytes: block sizes; each a multiple of 4 KiB (O_DIRECT's alignment).
        depths: queue depths (threads on a tier path; blocks per call end to end).
        ssd_dir: directory on the disk to test; the bench writes only in a scratch directory inside.
        pool: HOST:PORT of a running pool node; None starts one on 127.0.0.1 for the run.
        row_seconds: time spent timing one row (kvtier and limit ops together), once `min_ops` are in.
        working_set_bytes: bytes one row cycles over (its blocks), at most `max_blocks` blocks.
    """

    paths: tuple[str, ...] = ALL_PATHS
    sizes_bytes: tuple[int, ...] = (64 * KIB, 256 * KIB, MIB, 4 * MIB)
    depths: tuple[int, ...] = (1, 4)
    ssd_dir: str = "/var/tmp"
    pool: str | None = None
    row_seconds: float = 0.35
    working_set_bytes: int = 64 * MIB
    max_blocks: int = 256
    min_ops: int = 16
    max_ops: int = 20_000

    def __post_init__(self) -> None:
        unknown = [p for p in self.paths if p not in ALL_PATHS]
        if unknown or not self.paths:
            raise ConfigError(f"--tiers: unknown path {unknown[0] if unknown else '(none)'}; expected some of "
                              f"{', '.join((*ALL_PATHS, *GROUPS))}")
        bad = [s for s in self.sizes_bytes if s <= 0 or s % (4 * KIB)]
        if bad or not self.sizes_bytes:
            raise ConfigError(f"--sizes: block sizes must be positive multiples of 4 KiB (O_DIRECT's alignment), "
                              f"got {bad[0] if bad else '(none)'} bytes")
        if not self.depths or min(self.depths) < 1 or max(self.depths) > 64:
            raise ConfigError(f"--depths: queue depths must be in [1, 64], got {list(self.depths)}")

    @property
    def budget(self) -> Budget:
        return Budget(self.row_seconds, self.min_ops, self.max_ops)

    def num_blocks(self, block_bytes: int, depth: int) -> int:
        return num_blocks_for(block_bytes, depth, self.working_set_bytes, self.max_blocks)


QUICK = {"sizes_bytes": (64 * KIB, MIB), "depths": (1, 4), "row_seconds": 0.04, "working_set_bytes": 8 * MIB,
         "max_blocks": 32, "min_ops": 4}


def quick(options: BenchOptions, **explicit) -> BenchOptions:
    """`options` cut to a ~20 s run, except for the fields the user gave (`explicit`)."""
    return replace(options, **{**QUICK, **explicit})


def expand_paths(names: list[str]) -> tuple[str, ...]:
    """--tiers names (paths and groups such as "e2e") to paths in run order, without repeats."""
    chosen = [p for n in names for p in GROUPS.get(n, (n,))]
    return tuple(dict.fromkeys(chosen))


@dataclass(frozen=True, slots=True)
class Step:
    path: str
    block_bytes: int
    depth: int


def plan(options: BenchOptions) -> list[Step]:
    return [Step(p, s, d) for p in options.paths for s in options.sizes_bytes for d in options.depths]


def step_bytes(options: BenchOptions, step: Step) -> int:
    """Bytes one step holds on the SSD or the pool at once (kvtier's slots plus the limit's)."""
    n = options.num_blocks(step.block_bytes, step.depth)
    if step.path.startswith("e2e"):
        n = max(2, n // step.depth) * step.depth + step.depth
    return 2 * n * step.block_bytes


@dataclass
class BenchResult:
    options: BenchOptions
    measured: list[Measured] = field(default_factory=list)
    facts: dict = field(default_factory=dict)
    elapsed_s: float = 0.0


def run_bench(options: BenchOptions, on_row: Callable[[Measured], None] = lambda m: None,
              on_step: Callable[[Step], None] = lambda s: None) -> BenchResult:
    """Runs every step of `plan(options)`; `on_step` sees each step as it starts, `on_row` each row
    (two per step: spill, fill) as it is measured.

    Raises:
        TierIOError: the SSD directory is missing, read-only, refuses files or lacks the space.
        TransferError: the pool node given cannot be reached, or one could not be started here.
        KVTierError: a transfer failed or came back wrong while measuring.
    """
    steps = plan(options)
    ssd_need = max((step_bytes(options, s) for s in steps if s.path in SSD_PATHS), default=0)
    if ssd_need:
        check_ssd_dir(options.ssd_dir, ssd_need + SLACK_BYTES)
    pool_need = max((step_bytes(options, s) for s in steps if s.path in POOL_PATHS), default=0)
    result = BenchResult(options, facts={"machine": machine_facts(), "hbm": hbm_facts()})
    started = time.perf_counter()
    threads = torch.get_num_threads()
    # torch's intra-op threads make one copy's time hinge on every core being free at that instant;
    # on a shared 2-core machine that swings it 50x. One thread measures the copy, not the scheduler.
    torch.set_num_threads(1)
    try:
        with ExitStack() as stack:
            env = BenchEnv(device=_device(), workdir=_workdir(stack, options, bool(ssd_need)))
            if pool_need:
                _start_pool(stack, env, options, pool_need, result.facts)
            for step in steps:
                on_step(step)
                fn = PATHS.get(step.path) or E2E_PATHS[step.path]
                for m in fn(env, step.block_bytes, step.depth, options.num_blocks(step.block_bytes, step.depth),
                            options.budget):
                    result.measured.append(m)
                    on_row(m)
            if ssd_need:
                result.facts["ssd"] = {"dir": options.ssd_dir, "filesystem": filesystem_of(options.ssd_dir),
                                       **env.facts.get("ssd", {})}
            if pool_need:
                result.facts["pool"].update(env.facts.get("pool", {}))
    finally:
        torch.set_num_threads(threads)
    result.elapsed_s = time.perf_counter() - started
    return result


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _workdir(stack: ExitStack, options: BenchOptions, on_ssd: bool) -> str:
    """A scratch directory inside --ssd-dir (elsewhere only when no SSD path runs), removed at exit."""
    path = tempfile.mkdtemp(prefix="kvtier-bench-", dir=options.ssd_dir if on_ssd else None)
    stack.callback(shutil.rmtree, path, ignore_errors=True)
    return path


def _start_pool(stack: ExitStack, env: BenchEnv, options: BenchOptions, need_bytes: int, facts: dict) -> None:
    """Starts (or reaches) the pool node and the raw socket server; records the transport in use."""
    from kvtier.bench.rawsock import RawSocketServer
    from kvtier.pool.client.api import PoolClient

    address = options.pool
    if address is None:
        from kvtier.pool.node.process import NodeProcess

        from kvtier.pool.client.streamed import BlockFrame

        largest = max(BlockFrame(size).stored_bytes for size in options.sizes_bytes)  # a shared block's header too
        region = max(4 * MIB, -(-largest // (4 * KIB)) * 4 * KIB)
        capacity = math.ceil((2 * need_bytes + 64 * MIB) / region) * region
        try:
            node = NodeProcess(capacity=str(capacity), region_size=str(region))
        except RuntimeError as e:
            raise TransferError(f"could not start a pool node on 127.0.0.1: {e}") from None
        stack.callback(node.close)
        address = node.address
    with PoolClient([address], timeout_s=env.pool_timeout_s, reconnect_s=0) as client:
        stats = client.stats()[0]
    if "error" in stats:
        raise TransferError(f"--pool {address}: {stats['error']}")
    facts["pool"] = {"address": address, "started_here": options.pool is None,
                     "transport": stats.get("transport"), "transport_reason": stats.get("transport_reason")}
    server = RawSocketServer()
    stack.callback(server.close)
    env.pool_address, env.rawsock = address, server


def machine_facts() -> dict:
    facts = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
             "torch": torch.__version__, "cuda": torch.cuda.is_available(), "checksum_code": _movers.XXH3_VECTOR}
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name()
    return facts


def hbm_facts() -> dict:
    """Where the HBM tier lives in this run; without CUDA a CPU tensor stands in, and the report says so."""
    if torch.cuda.is_available():
        return {"device": str(_device()), "stand_in": False, "reason": ""}
    return {"device": "cpu", "stand_in": True,
            "reason": "CUDA is not available: a CPU tensor stands in for HBM, so hbm-dram is a host memcpy"}
