"""DRAM <-> a caller's host buffer through `KVTier.store`/`load`, against memcpy of the same bytes.

Not a test: it asserts nothing but that every block landed. Issue 30's goal for the host data path:
in batches of 16 blocks, `KVTier.store(keys, blocks, sync=True)` and `KVTier.load(keys, into,
sync=True)` to completion (the engine's view: the call returns with the blocks in place) move
>= 0.85 of memcpy's GB/s at 1 MiB blocks and >= 0.7 at 64 KiB, spending <= 3 µs of process CPU per
block beyond the copy itself.

Per block size, a KVTier with one DRAM tier of `--slots` slots (the blocks cycle through them, so
the tier is full and every store evicts, as in a server's steady state) and a caller buffer of
`--batch` blocks. Its limit copies the same bytes the same way with nothing else: one memcpy
(`np.copyto`, one thread) per block between the same kind of buffer and the rows of a slab of the
same size, in the same slot order (into the slab for a store, out of it for a load). The two are
timed in alternating rounds of `--calls` calls; per round, GB/s and process CPU time
(`time.process_time`: what the calls cost the host's cores, waiting excluded). Reported: the ratio
of kvtier's GB/s to the limit's (median and min-max over `--rounds` rounds), and the process CPU per
block beyond the limit's.

    python bench/bench_host_path.py [--quick] [--sizes 64KiB,256KiB,1MiB,4MiB] [--json out.json] [--plot DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from kvtier.config import KVTierConfig, TierConfig, TransferConfig
from kvtier.model.layout import BlockLayout
from kvtier.runtime import KVTier
from kvtier.tiers.base import TierKind
from kvtier.tiers.dram import aligned_host_memory
from kvtier.units import parse_size

NUM_LAYERS = 32  # a 7-8B model's block: 32 equal layers
GOALS = {"ratio_64KiB": 0.7, "ratio_1MiB": 0.85, "cpu_us_per_block": 3.0}


@dataclass
class Row:
    """One block size and direction: the ratios and CPU per block of every round."""

    block_bytes: int
    direction: str  # "store" (buffer -> DRAM) or "load" (DRAM -> buffer)
    kvtier_gbps: list[float]
    limit_gbps: list[float]
    ratios: list[float]
    cpu_us_per_block: list[float]  # kvtier's process CPU per block minus the limit's

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def cpu_us(self) -> float:
        return statistics.median(self.cpu_us_per_block)


class Kvtier:
    """The measured side: store then load batches of fresh keys through one KVTier."""

    def __init__(self, block_bytes: int, batch: int, slots: int) -> None:
        layout = BlockLayout.uniform(16, NUM_LAYERS, block_bytes // NUM_LAYERS)
        config = KVTierConfig(model="bench", tiers=(TierConfig(TierKind.DRAM, slots * block_bytes),),
                              transfer=TransferConfig())
        self.kv = KVTier(config, layout=layout)
        self.batch = batch
        self.src = aligned_host_memory(batch * block_bytes, pinned=False).view(batch, block_bytes)
        self.src.copy_(torch.randint(0, 256, (batch, block_bytes), dtype=torch.uint8))
        self.dst = aligned_host_memory(batch * block_bytes, pinned=False).view(batch, block_bytes)
        self._next = 0
        self._keys: list[bytes] = []

    def store(self) -> None:
        self._keys = [(self._next + j).to_bytes(16, "little") for j in range(self.batch)]
        self._next += self.batch
        handle = self.kv.store(self._keys, self.src, sync=True)
        if handle.failed:
            sys.exit(f"store failed: {dict(list(handle.failed.items())[:2])}")

    def load(self) -> None:
        handle = self.kv.load(self._keys, self.dst, sync=True)
        if handle.failed:
            sys.exit(f"load failed: {dict(list(handle.failed.items())[:2])}")

    def check(self) -> None:
        if not torch.equal(self.src, self.dst):
            sys.exit("the blocks loaded differ from those stored")

    def close(self) -> None:
        self.kv.close()


class Memcpy:
    """The limit: the same bytes between the same kind of buffer and a slab's rows, one memcpy a block."""

    def __init__(self, block_bytes: int, batch: int, slots: int) -> None:
        self.slab = aligned_host_memory(slots * block_bytes, pinned=False).view(slots, block_bytes).numpy()
        self.src = aligned_host_memory(batch * block_bytes, pinned=False).view(batch, block_bytes).numpy()
        self.dst = aligned_host_memory(batch * block_bytes, pinned=False).view(batch, block_bytes).numpy()
        self.batch, self.slots = batch, slots
        self._rows: list[int] = []
        self._next = 0

    def store(self) -> None:
        self._rows = [(self._next + j) % self.slots for j in range(self.batch)]
        self._next += self.batch
        for j, row in enumerate(self._rows):
            np.copyto(self.slab[row], self.src[j])

    def load(self) -> None:
        for j, row in enumerate(self._rows):
            np.copyto(self.dst[j], self.slab[row])


def time_calls(fns, calls: int) -> tuple[list[float], list[float]]:
    """Runs each of `fns` (in order, once per call) `calls` times; wall and CPU seconds of each."""
    wall, cpu = [0.0] * len(fns), [0.0] * len(fns)
    for _ in range(calls):
        for k, fn in enumerate(fns):
            w, c = time.perf_counter(), time.process_time()
            fn()
            wall[k] += time.perf_counter() - w
            cpu[k] += time.process_time() - c
    return wall, cpu


def measure(block_bytes: int, batch: int, slots: int, calls: int, rounds: int) -> list[Row]:
    """Alternating rounds of kvtier and its limit; one `Row` per direction."""
    kv, limit = Kvtier(block_bytes, batch, slots), Memcpy(block_bytes, batch, slots)
    rows = {d: Row(block_bytes, d, [], [], [], []) for d in ("store", "load")}
    try:
        time_calls([kv.store, kv.load, limit.store, limit.load], max(2, slots // batch))  # warm: every slot once
        kv.check()
        moved = calls * batch * block_bytes
        for _ in range(rounds):
            kv_wall, kv_cpu = time_calls([kv.store, kv.load], calls)
            lim_wall, lim_cpu = time_calls([limit.store, limit.load], calls)
            for k, direction in enumerate(("store", "load")):
                row = rows[direction]
                row.kvtier_gbps.append(moved / kv_wall[k] / 1e9)
                row.limit_gbps.append(moved / lim_wall[k] / 1e9)
                row.ratios.append(lim_wall[k] / kv_wall[k])
                row.cpu_us_per_block.append((kv_cpu[k] - lim_cpu[k]) / (calls * batch) * 1e6)
        kv.check()
    finally:
        kv.close()
    return list(rows.values())


def table(rows: list[Row]) -> str:
    lines = [f"{'block':>8} {'dir':>5} {'kvtier GB/s':>11} {'memcpy GB/s':>11} {'ratio':>6} {'(min-max)':>11} "
             f"{'cpu µs/block beyond copy':>25}"]
    for r in rows:
        lines.append(f"{_size(r.block_bytes):>8} {r.direction:>5} {statistics.median(r.kvtier_gbps):>11.2f} "
                     f"{statistics.median(r.limit_gbps):>11.2f} {r.ratio:>6.2f} "
                     f"{min(r.ratios):>5.2f}-{max(r.ratios):<5.2f} {r.cpu_us:>25.1f}")
    return "\n".join(lines)


def plot(rows: list[Row], out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for direction in ("store", "load"):
        mine = [r for r in rows if r.direction == direction]
        ax.errorbar([_size(r.block_bytes) for r in mine], [r.ratio for r in mine],
                    yerr=[[r.ratio - min(r.ratios) for r in mine], [max(r.ratios) - r.ratio for r in mine]],
                    marker="o", capsize=3, label=f"KVTier.{direction} / memcpy")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_ylim(0, 1.2)
    ax.set_xlabel("block size (batches of 16)")
    ax.set_ylabel("GB/s ratio to memcpy (same run)")
    ax.legend()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "host_path.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def _size(n: int) -> str:
    return f"{n >> 20}MiB" if n >= 1 << 20 else f"{n >> 10}KiB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="64KiB,256KiB,1MiB,4MiB", help="block sizes (default %(default)s)")
    p.add_argument("--batch", type=int, default=16, help="blocks per call (default %(default)s)")
    p.add_argument("--dram", default="128MiB", help="the DRAM tier's capacity (default %(default)s)")
    p.add_argument("--calls", type=int, default=0, help="calls per round (default: ~32 MiB of blocks a round)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per size (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="3 short rounds of 64KiB and 1MiB blocks")
    p.add_argument("--json", type=Path, help="write the rows as JSON")
    p.add_argument("--plot", type=Path, help="write host_path.png into this folder")
    args = p.parse_args(argv)
    sizes = [parse_size(s, "--sizes") for s in ("64KiB,1MiB" if args.quick and args.sizes == p.get_default("sizes")
                                     else args.sizes).split(",")]
    rounds = 3 if args.quick else args.rounds
    rows: list[Row] = []
    for size in sizes:
        slots = max(parse_size(args.dram, "--dram") // size, 2 * args.batch)
        calls = args.calls or max(8, (8 if args.quick else 64) * (1 << 20) // (args.batch * size))
        print(f"{_size(size)}: {rounds} rounds of {calls} store+load calls of {args.batch} blocks ...", flush=True)
        rows += measure(size, args.batch, slots, calls, rounds)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"goals": GOALS, "rows": [asdict(r) | {"ratio": r.ratio, "cpu_us": r.cpu_us}
                                                                   for r in rows]}, indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {plot(rows, args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
