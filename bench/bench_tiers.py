"""Tier benchmark: what the DRAM and SSD tiers cost over the machine's own limits, measured in one run.

(a) DRAM tier store/load of 1, 2, 4 MiB blocks, as a ratio to a plain `torch` copy of the same bytes
    between plain tensors (goal >= 0.9).
(b) SSD tier write/read, as a ratio to raw `os.pwrite`/`os.preadv` of the same block size, queue
    depth (threads), buffers and file striping, with O_DIRECT exactly when the tier has it
    (goal >= 0.85).

Each block's tier op and baseline op run back to back (order alternating) and are timed one by
one; the ratio is the median over all blocks and rounds of baseline time / tier time, so a noisy
neighbour or a slow moment of the disk cannot tip it. GB/s = block bytes x queue depth / median
op time. The default run takes about 20 s on a 2-core machine.

    python bench/bench_tiers.py [--ssd-dir /var/tmp] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.tiers.dram import DRAMTier  # noqa: E402
from kvtier.tiers.ssd import SSDTier  # noqa: E402

MIB = 1 << 20
DRAM_GOAL = 0.9
SSD_GOAL = 0.85


@dataclass(frozen=True, slots=True)
class Result:
    """One measured operation: the tier's bandwidth against its baseline's."""

    test: str
    op: str
    block_bytes: int
    queue_depth: int
    tier_gbps: float
    baseline_gbps: float
    goal: float
    ratio: float  # median over blocks of baseline op time / tier op time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ssd-dir", default="/var/tmp", help="directory on the disk to test (default: /var/tmp)")
    p.add_argument("--json", type=Path, help="also write the results as JSON to this path")
    p.add_argument("--block-mib", type=int, nargs="+", default=[1, 2, 4], help="block sizes in MiB")
    p.add_argument("--queue-depths", type=int, nargs="+", default=[1, 4], help="SSD threads in flight")
    p.add_argument("--dram-mib", type=int, default=128, help="DRAM working set per measurement, MiB")
    p.add_argument("--ssd-mib", type=int, default=128, help="SSD bytes per measurement, MiB")
    p.add_argument("--rounds", type=int, default=7, help="paired tier/baseline passes; the median counts")
    # torch's intra-op threads make one copy's time hinge on every core being free at that instant;
    # on a shared 2-core machine that swings it 50x. One thread measures the copy, not the scheduler.
    p.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads for the DRAM copies")
    return p.parse_args(argv)


Op = Callable[[int, int], None]  # (thread, block) -> None
Pair = tuple[float, float]  # seconds of one block's (tier op, baseline op)


def paired_times(num_blocks: int, queue_depth: int, tier_op: Op, base_op: Op) -> list[Pair]:
    """Runs both ops on every block from `queue_depth` threads; returns each block's op times.

    Thread `t` takes blocks t, t+qd, ...; for each it runs the tier op and the baseline op back to back,
    alternating which goes first, so a core taken by another process or a slow moment of the disk is
    as likely to land on either side.
    """
    pairs: list[list[Pair]] = [[] for _ in range(queue_depth)]
    start = threading.Barrier(queue_depth)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        start.wait()
        try:
            for i, block in enumerate(range(t, num_blocks, queue_depth)):
                seconds = [0.0, 0.0]
                for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                    began = time.perf_counter()
                    (tier_op, base_op)[side](t, block)
                    seconds[side] = time.perf_counter() - began
                pairs[t].append((seconds[0], seconds[1]))
        except BaseException as e:  # re-raised below, in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(queue_depth)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return [p for per_thread in pairs for p in per_thread]


def measure(test: str, op: str, block_bytes: int, num_blocks: int, queue_depth: int, goal: float,
            rounds: int, advance: Callable[[], None], tier_op: Op, base_op: Op) -> Result:
    """`rounds` paired passes over all blocks.

    The ratio is the median over blocks of (baseline time / tier time): robust to the preemptions
    that make sums of times swing 2x on a shared machine. GB/s is block bytes x queue depth over the
    median op time.
    """
    pairs: list[Pair] = []
    for _ in range(rounds):
        pairs += paired_times(num_blocks, queue_depth, tier_op, base_op)
        advance()
    ratio = statistics.median(b / t for t, b in pairs)
    tier_gbps = block_bytes * queue_depth / statistics.median(t for t, _ in pairs) / 1e9
    base_gbps = block_bytes * queue_depth / statistics.median(b for _, b in pairs) / 1e9
    return Result(test, op, block_bytes, queue_depth, tier_gbps, base_gbps, goal, ratio)


# -- (a) DRAM ---------------------------------------------------------------------------------------


def bench_dram(
    block_bytes: int, working_set_bytes: int, rounds: int, advance: Callable[[], None]
) -> list[Result]:
    """Store (tensor -> tier) and load (tier -> tensor) of every slot vs `copy_` between plain tensors.

    Each side has its own source and destination, so neither finds the other's bytes in cache.
    """
    n = max(1, working_set_bytes // block_bytes)
    tier = DRAMTier(n * block_bytes, block_bytes)
    src, src2 = (torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8) for _ in range(2))
    dst, dst2, plain = (torch.zeros_like(src) for _ in range(3))
    try:
        store = (lambda t, b: tier.write(b, src[b]), lambda t, b: plain[b].copy_(src2[b]))
        load = (lambda t, b: tier.read(b, dst[b]), lambda t, b: dst2[b].copy_(plain[b]))
        paired_times(n, 1, *store)  # first touch of every page is not what we measure
        paired_times(n, 1, *load)
        return [measure("dram", name, block_bytes, n, 1, DRAM_GOAL, rounds, advance, *ops)
                for name, ops in (("store", store), ("load", load))]
    finally:
        tier.close()


# -- (b) SSD ----------------------------------------------------------------------------------------


class RawFiles:
    """Preallocated files striped like the SSD tier's, for raw pwrite/preadv at the same offsets."""

    def __init__(
        self, directory: str, num_blocks: int, block_bytes: int, num_files: int, direct: bool
    ) -> None:
        self.block_bytes, self.num_files = block_bytes, num_files
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
        self.paths = [os.path.join(directory, f"raw-{i}.bin") for i in range(num_files)]
        self.fds = [os.open(p, flags, 0o600) for p in self.paths]
        per_file = -(-num_blocks // num_files) * block_bytes
        for fd in self.fds:
            os.posix_fallocate(fd, 0, per_file)

    def place(self, block: int) -> tuple[int, int]:
        return self.fds[block % self.num_files], (block // self.num_files) * self.block_bytes

    def write(self, block: int, buf: mmap.mmap) -> None:
        fd, offset = self.place(block)
        if os.pwrite(fd, buf, offset) != self.block_bytes:
            raise OSError("short raw write")

    def read(self, block: int, buf: mmap.mmap) -> None:
        fd, offset = self.place(block)
        if os.preadv(fd, [buf], offset) != self.block_bytes:
            raise OSError("short raw read")

    def close(self) -> None:
        for fd, path in zip(self.fds, self.paths):
            os.close(fd)
            os.unlink(path)


def bench_ssd(
    directory: str,
    block_bytes: int,
    queue_depth: int,
    total_bytes: int,
    rounds: int,
    advance: Callable[[], None],
) -> tuple[list[Result], dict[str, object]]:
    """Tier write/read of every slot vs raw I/O of the same blocks from the same aligned buffers.

    Raw I/O uses O_DIRECT exactly when the tier does, 4 files striped the same way, and page-aligned
    buffers (one per thread) that the tier also gets, as tensors, so it does I/O straight from them.
    """
    n = max(queue_depth, total_bytes // block_bytes)
    tier = SSDTier(directory, n * block_bytes, block_bytes, num_files=4)
    raw = RawFiles(directory, n, block_bytes, 4, tier.o_direct)
    buffers = [mmap.mmap(-1, block_bytes) for _ in range(queue_depth)]
    tensors = [torch.frombuffer(b, dtype=torch.uint8) for b in buffers]
    for t in tensors:
        t.copy_(torch.randint(0, 256, (block_bytes,), dtype=torch.uint8))
    try:
        write = (lambda t, b: tier.write(b, tensors[t]), lambda t, b: raw.write(b, buffers[t]))
        read = (lambda t, b: tier.read(b, tensors[t]), lambda t, b: raw.read(b, buffers[t]))
        paired_times(n, queue_depth, *write)  # the filesystem's first allocation is not what we measure
        results = [measure("ssd", name, block_bytes, n, queue_depth, SSD_GOAL, rounds, advance, *ops)
                   for name, ops in (("write", write), ("read", read))]
        return results, tier.describe()
    finally:
        tier.close()
        raw.close()
        del tensors
        for b in buffers:
            b.close()


# -- report -----------------------------------------------------------------------------------------


def filesystem_of(path: str) -> str:
    """The filesystem type of the mount holding `path`, from /proc/mounts ("unknown" elsewhere)."""
    real, best, fstype = os.path.realpath(path), "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mount_point, kind, *_ = line.split()
                inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) > len(best):
                    best, fstype = mount_point, kind
    except OSError:
        pass
    return fstype


def table(results: list[Result]) -> Table:
    t = Table(title="kvtier tiers vs the machine's own limits (same run)")
    for col in ("test", "op", "block", "qd", "tier GB/s", "baseline GB/s", "ratio", "goal"):
        t.add_column(col, justify="right" if col not in ("test", "op") else "left")
    for r in results:
        mark = "[green]ok[/]" if r.ratio >= r.goal else "[red]below[/]"
        t.add_row(r.test, r.op, f"{r.block_bytes // MIB} MiB", str(r.queue_depth), f"{r.tier_gbps:.2f}",
                  f"{r.baseline_gbps:.2f}", f"{r.ratio:.3f}", f">= {r.goal} {mark}")
    return t


def run_all(args: argparse.Namespace, console: Console) -> tuple[list[Result], dict[str, object]]:
    """Every DRAM then SSD measurement, with a progress bar; returns results and the SSD tier's facts."""
    blocks = [m * MIB for m in args.block_mib]
    workdir = tempfile.mkdtemp(prefix="kvtier-bench-", dir=args.ssd_dir)
    results: list[Result] = []
    ssd_facts: dict[str, object] = {}
    try:
        with Progress(console=console, transient=True) as progress:
            steps = args.rounds * 2 * len(blocks) * (1 + len(args.queue_depths))
            task = progress.add_task("benchmarking tiers", total=steps)
            advance = lambda: progress.advance(task)  # noqa: E731
            for block in blocks:
                progress.update(task, description=f"DRAM {block // MIB} MiB")
                results += bench_dram(block, args.dram_mib * MIB, args.rounds, advance)
            for block in blocks:
                for qd in args.queue_depths:
                    progress.update(task, description=f"SSD {block // MIB} MiB qd {qd}")
                    found, ssd_facts = bench_ssd(workdir, block, qd, args.ssd_mib * MIB, args.rounds, advance)
                    results += found
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return results, ssd_facts


def report(args: argparse.Namespace, results: list[Result], ssd_facts: dict[str, object], elapsed_s: float) -> dict:
    """The JSON report: machine, SSD directory and O_DIRECT decision, and every result."""
    return {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "dram_pinned": torch.cuda.is_available(),
        },
        "ssd": {
            "dir": args.ssd_dir,
            "filesystem": filesystem_of(args.ssd_dir),
            "o_direct": ssd_facts.get("o_direct"),
            "reason": ssd_facts.get("reason"),
        },
        "elapsed_s": elapsed_s,
        "results": [{**asdict(r), "meets_goal": r.ratio >= r.goal} for r in results],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    if not os.path.isdir(args.ssd_dir):
        console.print(f"[red]--ssd-dir {args.ssd_dir} is not a directory[/]")
        return 2
    torch.set_num_threads(args.torch_threads)
    started = time.perf_counter()
    results, ssd_facts = run_all(args, console)
    facts = report(args, results, ssd_facts, time.perf_counter() - started)
    console.print(table(results))
    ssd = facts["ssd"]
    console.print(f"SSD dir {ssd['dir']} ({ssd['filesystem']}): O_DIRECT "
                  f"{'active' if ssd['o_direct'] else 'NOT active'} ({ssd['reason']})")
    machine = facts["machine"]
    console.print(f"torch {machine['torch']}, {machine['cpus']} CPUs, {machine['torch_threads']} torch thread(s), "
                  f"DRAM pinned: {machine['dram_pinned']}; {facts['elapsed_s']:.1f} s")
    if args.json:
        args.json.write_text(json.dumps(facts, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
