"""Paired timing: every kvtier op runs back to back with its limit op on the same bytes.

Each block's kvtier op and limit op run back to back (the order alternating) and are timed one by
one, from `queue_depth` threads at once. So a core taken by another process, or a slow moment of the
disk, is as likely to land on either side, and the ratio — the median over pairs of
limit time / kvtier time — is robust to the preemptions that make sums of times swing 2x on a shared
machine. GB/s = bytes per op x queue depth / p50 op time (a closed loop of `queue_depth` callers).
"""

from __future__ import annotations

import math
import os
import resource
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (another process's: a pool node's)."""
    return stat_cpu_s(proc_stat(Path(f"/proc/{pid}/stat"))[1])


def proc_stat(path: Path) -> tuple[str, list[str]]:
    """A /proc `stat` file (a process's or a thread's): its command name and the fields after it
    (the name may hold spaces and parentheses: it ends at the last ')')."""
    text = path.read_text()
    return text[text.index("(") + 1: text.rindex(")")], text[text.rindex(")") + 2:].split()


def stat_cpu_s(fields: list[str]) -> float:
    """User + system CPU seconds of the fields after a /proc stat file's name (`proc_stat`)."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(slots=True)
class CpuSpent:
    """CPU seconds spent inside a `cpu_spent` block: this process's user and system time (every
    thread), and another process's (a pool node's; None where none was named). Set on exit."""

    user: float = 0.0
    system: float = 0.0
    other: float | None = None

    def per(self, count: int, unit: str) -> dict[str, float | None]:
        """µs per `unit` over `count` of them, under the names the CPU benches' rows use
        (`cpu_us_per_<unit>`, `user_…`, `system_…`, `node_cpu_…`: the other process is a pool node)."""
        us = 1e6 / count
        return {f"cpu_us_per_{unit}": (self.user + self.system) * us, f"user_us_per_{unit}": self.user * us,
                f"system_us_per_{unit}": self.system * us,
                f"node_cpu_us_per_{unit}": None if self.other is None else self.other * us}


@contextmanager
def cpu_spent(other_pid: int | None = None) -> Iterator[CpuSpent]:
    """Measures the CPU this process (and process `other_pid`, where given) spends in the block."""
    spent = CpuSpent()
    other0 = process_cpu_s(other_pid) if other_pid is not None else 0.0
    times0 = resource.getrusage(resource.RUSAGE_SELF)
    yield spent
    times = resource.getrusage(resource.RUSAGE_SELF)
    spent.user, spent.system = times.ru_utime - times0.ru_utime, times.ru_stime - times0.ru_stime
    if other_pid is not None:
        spent.other = process_cpu_s(other_pid) - other0


Op = Callable[[int, int], None]  # (thread, block) -> None
Pair = tuple[float, float]  # seconds of one block's (kvtier op, limit op)


@dataclass(frozen=True, slots=True)
class Budget:
    """How long one row is measured: passes over the blocks until `seconds` have passed and at least
    `min_ops` pairs were timed, never more than `max_ops` pairs."""

    seconds: float
    min_ops: int
    max_ops: int


@dataclass(frozen=True, slots=True)
class Row:
    """One measured (path, op, block size, queue depth): kvtier's latency and bandwidth, and its limit's.

    `op` is "spill" (toward the slower tier) or "fill" (back up). Latencies are of one op: one block
    on a tier path, one call of `queue_depth` blocks end to end. `ratio` is the median over pairs of
    limit time / kvtier time (1.0: kvtier is as fast as the machine allows).
    """

    path: str
    op: str
    block_bytes: int
    queue_depth: int
    num_ops: int
    p50_us: float
    p99_us: float
    p999_us: float
    gbps: float
    limit: str
    limit_p50_us: float
    limit_gbps: float
    ratio: float


@dataclass(frozen=True, slots=True)
class Measured:
    """A row and the raw kvtier op latencies behind it (for the CDF plots; not in the JSON)."""

    row: Row
    latencies_s: tuple[float, ...]


def percentile(sorted_xs: list[float] | tuple[float, ...], q: float) -> float:
    """Nearest-rank percentile of an ascending list: monotone in `q`, and the max once q > 1 - 1/n."""
    return sorted_xs[max(0, min(len(sorted_xs) - 1, math.ceil(q * len(sorted_xs)) - 1))]


def paired_times(num_blocks: int, queue_depth: int, tier_op: Op, limit_op: Op,
                 deadline: float = math.inf) -> list[Pair]:
    """Runs both ops on the blocks from `queue_depth` threads; returns each block's op times.

    Thread `t` takes blocks t, t+qd, ...; it stops early once `deadline` (a `perf_counter` time)
    has passed, after at least one block.

    Raises:
        whatever an op raised (the first, re-raised in the caller's thread once all threads stopped).
    """
    pairs: list[list[Pair]] = [[] for _ in range(queue_depth)]
    start = threading.Barrier(queue_depth)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        start.wait()
        try:
            for i, block in enumerate(range(t, num_blocks, queue_depth)):
                if i and time.perf_counter() > deadline:
                    return
                seconds = [0.0, 0.0]
                for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                    began = time.perf_counter()
                    (tier_op, limit_op)[side](t, block)
                    seconds[side] = time.perf_counter() - began
                pairs[t].append((seconds[0], seconds[1]))
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(e)

    if queue_depth == 1:
        worker(0)
    else:
        threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(queue_depth)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    if errors:
        raise errors[0]
    return [p for per_thread in pairs for p in per_thread]


def measure(num_blocks: int, queue_depth: int, tier_op: Op, limit_op: Op, budget: Budget) -> list[Pair]:
    """Passes of `paired_times` over all blocks until the budget is spent."""
    pairs: list[Pair] = []
    started = time.perf_counter()
    while len(pairs) < budget.max_ops:
        deadline = started + budget.seconds if len(pairs) >= budget.min_ops else math.inf
        pairs += paired_times(num_blocks, queue_depth, tier_op, limit_op, deadline)
        if time.perf_counter() - started >= budget.seconds and len(pairs) >= budget.min_ops:
            break
    return pairs


def summarize(path: str, op: str, block_bytes: int, queue_depth: int, bytes_per_op: int, concurrency: int,
              limit: str, pairs: list[Pair]) -> Measured:
    """The row for `pairs`: percentiles of the kvtier side, GB/s of both sides, and the ratio.

    Args:
        bytes_per_op: bytes one op moves (a block, or a call's `queue_depth` blocks end to end).
        concurrency: ops in flight at once (the threads of `paired_times`).
    """
    tier = sorted(t for t, _ in pairs)
    tier_s, limit_s = percentile(tier, 0.5), percentile(sorted(b for _, b in pairs), 0.5)
    ratio = statistics.median(b / t for t, b in pairs)
    row = Row(path, op, block_bytes, queue_depth, len(pairs),
              p50_us=tier_s * 1e6, p99_us=percentile(tier, 0.99) * 1e6, p999_us=percentile(tier, 0.999) * 1e6,
              gbps=bytes_per_op * concurrency / tier_s / 1e9,
              limit=limit, limit_p50_us=limit_s * 1e6, limit_gbps=bytes_per_op * concurrency / limit_s / 1e9,
              ratio=ratio)
    return Measured(row, tuple(tier))
