"""Manager bookkeeping cost: microseconds per decision with a million blocks indexed.

Not a test: it asserts nothing. One `TierManager` per policy (the same policy in every tier) over
virtual tiers — no bytes move — HBM, DRAM and SSD sized 10 %, 30 % and 150 % of `--blocks` (the
SSD's headroom takes the blocks the timed stores add), with the runtime's default watermarks
(0.95 / 0.85). It is filled bottom-up through the public verbs
(`prepare_store(..., target=tier)` + `complete_store`): the SSD first, then DRAM, then HBM, each
upper tier to the middle of its watermark band, the rest in the SSD. Keys are 16-byte xxh3-128
digests of integers, like real block keys. Then, `--repeat` times, round-robin, each of these is
timed over `--ops` calls with `time.perf_counter` around the whole batch (loop overhead included,
garbage collector off as in bench_policy.py unless `--gc`); the median of the repeats is reported:

  lookup+touch  `lookup([k])` then `touch([k])` of a random indexed key (any tier)   goal <= 5 µs
  store         `prepare_store([new])` + `complete_store(plan)`, then `complete_move` of every
                demotion that triggered, and of every demotion those completions trigger
  load hbm      `prepare_load([k])` + `complete_load(plan)` of a random key held in HBM
  load ssd      `prepare_load([k])` of a distinct key held in the SSD, `complete_move` of the
                promotion into DRAM (and of the demotions that made room), then `complete_load`

"moves/op" counts completed moves per call, "what the calls did" where stores landed and how many
SSD loads were promoted (both should be 100 % HBM / promoted; the JSON has every counter). A store
batch's cost depends on how many watermark bursts (a tier demoting down to its low watermark at
once) fall inside it, hence batches of 100k. "cpu µs" is process time: wall well above it means
the machine was busy, not the manager slow.

    python bench/bench_manager.py [--blocks 1000000] [--ops 100000] [--json out.json] [--profile]

`--memory 1000000 10000000` measures instead what the index costs to hold, at each count of blocks,
each in a fresh child process (its RSS is its own): a manager with a DRAM tier of 0.2 N and an SSD
tier of 1.2 N slots, one policy, N new 16-byte keys stored through `store_now` in requests of 64,
then `gc.collect()`. Reported: RSS per block (everything the index holds, keys included), the same
beyond the 16 bytes of a key (the issue's measure), what a 16-byte `bytes` object costs here (an
index that keeps key objects pays that per block), objects the garbage collector tracks, the pause of a full
collection (median of 5), `lookup([k])` + `touch([k])` of random stored keys, a store of one new key
with the demotions it triggers (`store_now`), the fill's speed, and a replay's (`replay_at_scale`:
20,000 requests of 16 blocks, 60 % of them back to blocks stored long ago), all with the collector
on, as in a server. `--pool 1000000 10000000` does the same for a pool node's `BlockStore` (sans-I/O: no arena behind
it): one tenant, N blocks of 64 KiB in 64 MiB regions, each put as the node takes an inline one
(`put_begin`, the write's access, `commit`), then RSS per block, tracked objects, the full-GC pause,
and a GET of one random key with its lease released. `--kvtier PATH` runs the children on another
checkout (e.g. the tree before a change, with its `kvtier._keytable` built: `python setup.py
build_ext --inplace` there), for a before/after in one run; `--memory-policies` picks the policies
(default lru).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import math
import os
import platform
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import xxhash
from rich.console import Console
from rich.table import Table

if "--kvtier" not in sys.argv and not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.deciding.manager import Move, TierManager, TierSlots  # noqa: E402
from kvtier.policy import PolicyKind, make_policy  # noqa: E402
from kvtier.kinds import TierKind  # noqa: E402  (kvtier.tiers imports torch: its objects would be in every GC pause)

LOOKUP_GOAL_US = 5.0
HBM, DRAM, SSD = TierKind.HBM, TierKind.DRAM, TierKind.SSD


@dataclass(frozen=True, slots=True)
class Batch:
    """One timed batch: wall and CPU µs per call, calls made, moves completed, counters changed."""

    us: float
    cpu_us: float
    num_ops: int
    num_moves: int
    counters: dict


@dataclass(slots=True)
class Result:
    """One operation of one policy: µs per call over each repeat, and what the calls did."""

    policy: str
    op: str
    num_ops: int  # per batch
    runs_us: list[float]
    runs_cpu_us: list[float]
    goal_us: float | None
    moves_per_op: float
    counters: dict[str, object] = field(default_factory=dict)  # summed over the batches

    @property
    def median_us(self) -> float:
        return statistics.median(self.runs_us)

    @property
    def median_cpu_us(self) -> float:
        return statistics.median(self.runs_cpu_us)

    @property
    def meets_goal(self) -> bool | None:
        return None if self.goal_us is None else self.median_us <= self.goal_us


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=1_000_000, help="blocks indexed after the fill (default 1e6)")
    p.add_argument("--ops", type=int, help="calls per timed batch (default min(100k, blocks/10))")
    p.add_argument("--repeat", type=int, default=3, help="timed batches per operation; the median counts")
    p.add_argument("--policies", nargs="+", default=[k.value for k in PolicyKind],
                   choices=[k.value for k in PolicyKind])
    p.add_argument("--hbm-slots", type=int, help="default blocks/10")
    p.add_argument("--dram-slots", type=int, help="default 3*blocks/10")
    p.add_argument("--ssd-slots", type=int, help="default 1.5*blocks: room below its high watermark for "
                   "every block the timed stores add, so that no key sampled for 'load ssd' is dropped")
    p.add_argument("--high-watermark", type=float, default=0.95, help="every tier (runtime default 0.95)")
    p.add_argument("--low-watermark", type=float, default=0.85, help="every tier (runtime default 0.85)")
    p.add_argument("--gc", action="store_true", help="leave the garbage collector on while timing")
    p.add_argument("--profile", action="store_true",
                   help="also run one untimed batch of each op under cProfile and print the top functions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the results as JSON to this path")
    p.add_argument("--memory", type=int, nargs="+", metavar="BLOCKS",
                   help="measure the index's memory and GC pause at these block counts instead (see above)")
    p.add_argument("--memory-policies", nargs="+", default=["lru"], choices=[k.value for k in PolicyKind])
    p.add_argument("--kvtier", type=Path, help="with --memory: the checkout whose kvtier the children import")
    p.add_argument("--pool", type=int, nargs="+", metavar="BLOCKS",
                   help="measure a pool node's block index at these block counts instead (see above)")
    p.add_argument("--memory-child", nargs=2, metavar=("BLOCKS", "POLICY"), help=argparse.SUPPRESS)
    p.add_argument("--pool-child", type=int, metavar="BLOCKS", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("blocks", "ops", "repeat", "hbm_slots", "dram_slots", "ssd_slots"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    args.ops = args.ops or max(1_000, min(100_000, args.blocks // 10))
    args.hbm_slots = args.hbm_slots or max(1, args.blocks // 10)
    args.dram_slots = args.dram_slots or max(1, 3 * args.blocks // 10)
    args.ssd_slots = args.ssd_slots or math.ceil(1.5 * args.blocks)
    return args


# ---- setup -------------------------------------------------------------------------------------


class KeyMaker:
    """Distinct 16-byte keys: xxh3-128 of a counter, deterministic for a seed."""

    def __init__(self, seed: int) -> None:
        self._seed = seed
        self._next = 0

    def take(self, count: int) -> list[bytes]:
        start, self._next = self._next, self._next + count
        digest, seed = xxhash.xxh3_128_digest, self._seed
        return [digest(i.to_bytes(8, "little"), seed) for i in range(start, start + count)]


@contextmanager
def gc_off(enabled: bool = False) -> Iterator[None]:
    """Turns the collector off (unless `enabled`) for the block: a full pass over 10^7 objects
    would otherwise land in whichever batch happened to trigger it."""
    was = gc.isenabled()
    if not enabled:
        gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def build_manager(kind: PolicyKind, args: argparse.Namespace) -> TierManager:
    sizes = {HBM: args.hbm_slots, DRAM: args.dram_slots, SSD: args.ssd_slots}
    tiers = [TierSlots(t, n, make_policy(kind, n), high_watermark=args.high_watermark,
                       low_watermark=args.low_watermark) for t, n in sizes.items()]
    return TierManager(tiers)


def fill_levels(manager: TierManager, num_blocks: int, high: float, low: float) -> dict[TierKind, int]:
    """How many blocks each tier gets: upper tiers the middle of their watermark band, the rest last.

    Raises:
        SystemExit: the last tier cannot take the rest without passing its high watermark.
    """
    levels: dict[TierKind, int] = {}
    left = num_blocks
    *upper, last = manager.order
    for tier in upper:
        levels[tier] = min(left, math.floor(manager.num_slots(tier) * (high + low) / 2))
        left -= levels[tier]
    if left > math.floor(manager.num_slots(last) * high):
        raise SystemExit(f"{num_blocks:,} blocks do not fit: {last.name} would need {left:,} of "
                         f"{manager.num_slots(last):,} slots, above its high watermark")
    levels[last] = left
    return levels


def fill(manager: TierManager, keys: list[bytes], levels: dict[TierKind, int]) -> None:
    """Stores `keys` bottom-up, so that the fastest tier holds the most recent ones."""
    start = 0
    for tier in reversed(manager.order):
        batch = keys[start:start + levels[tier]]
        start += len(batch)
        plan = manager.prepare_store(batch, target=tier)
        if plan.rejected or plan.moves or any(p.tier is not tier for p in plan.placements):
            raise SystemExit(f"fill: {tier.name} did not take its {len(batch):,} blocks")
        settle(manager, manager.complete_store(plan))


def settle(manager: TierManager, moves: Iterable[Move]) -> int:
    """Completes `moves` successfully, then every move their completion triggers; returns how many."""
    pending = list(moves)
    complete = manager.complete_move
    i = 0
    while i < len(pending):
        pending += complete(pending[i].id, True)
        i += 1
    return i


def keys_in(manager: TierManager, tier: TierKind) -> list[Hashable]:
    """Keys whose fastest READY copy is in `tier`."""
    owner, where = manager.owner, manager.where
    found = (owner(tier, slot) for slot in range(manager.num_slots(tier)))
    return [k for k in found if k is not None and where(k) is tier]


# ---- the timed operations ----------------------------------------------------------------------
# Each takes the manager and its inputs, runs one batch and returns the number of moves completed.


def run_lookup_touch(m: TierManager, keys: list[Hashable]) -> int:
    lookup, touch = m.lookup, m.touch
    for key in keys:
        lookup([key])
        touch([key])
    return 0


def run_store(m: TierManager, keys: list[Hashable]) -> int:
    prepare, complete = m.prepare_store, m.complete_store
    moved = 0
    for key in keys:
        plan = prepare([key])
        done = complete(plan)
        moved += settle(m, plan.moves + done)
    return moved


def run_load(m: TierManager, keys: list[Hashable]) -> int:
    """A load waits for its promotion (if any) to land, reads, then completes."""
    prepare, complete = m.prepare_load, m.complete_load
    moved = 0
    for key in keys:
        plan = prepare([key])
        moved += settle(m, plan.moves)
        moved += settle(m, complete(plan))
    return moved


def counters(m: TierManager) -> dict[str, object]:
    s = m.stats.snapshot()
    return {k: s[k] for k in ("hits", "misses", "stores", "evictions", "demotions", "promotions", "dropped")}


def diff(after: dict, before: dict) -> dict:
    """`after - before` for nested counter dicts, dropping zeros."""
    out: dict = {}
    for k, v in after.items():
        if isinstance(v, dict):
            d = diff(v, before.get(k, {}))
            if d:
                out[k] = d
        elif v - before.get(k, 0):
            out[k] = v - before.get(k, 0)
    return out


@dataclass(slots=True)
class Bench:
    """One policy's manager, its key source, and the inputs for each operation."""

    manager: TierManager
    keys: KeyMaker
    indexed: list[bytes]
    rng: random.Random
    num_ops: int

    def inputs(self, op: str) -> list[Hashable]:
        """Fresh inputs for one batch of `op`, chosen before the clock starts."""
        m, n = self.manager, self.num_ops
        if op == "store":
            new = self.keys.take(n)
            self.indexed += new
            return new
        if op == "lookup+touch":
            picks = (self.rng.choice(self.indexed) for _ in range(3 * n))
            return [k for k in picks if m.where(k) is not None][:n]
        tier = HBM if op == "load hbm" else SSD
        held = keys_in(m, tier)
        if not held:
            raise SystemExit(f"{op}: no block is held in {tier.name}; use more --blocks")
        if tier is HBM:
            return [self.rng.choice(held) for _ in range(n)]  # a load from HBM moves nothing
        return self.rng.sample(held, min(n, len(held)))  # distinct: each is promoted out of the SSD


OPS: dict[str, tuple[Callable[[TierManager, list[Hashable]], int], float | None]] = {
    "lookup+touch": (run_lookup_touch, LOOKUP_GOAL_US),
    "store": (run_store, None),
    "load hbm": (run_load, None),
    "load ssd": (run_load, None),
}


def time_batch(bench: Bench, op: str, keep_gc: bool) -> Batch:
    """Runs and times one batch of `op` on fresh inputs."""
    run, _ = OPS[op]
    keys = bench.inputs(op)
    before = counters(bench.manager)
    with gc_off(keep_gc):
        start, start_cpu = time.perf_counter(), time.process_time()
        moved = run(bench.manager, keys)
        elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
    n = len(keys)
    return Batch(elapsed / n * 1e6, elapsed_cpu / n * 1e6, n, moved, diff(counters(bench.manager), before))


def profile_batch(bench: Bench, op: str, top: int = 12) -> str:
    """One untimed batch of `op` under cProfile; the top functions by own time, as text."""
    run, _ = OPS[op]
    keys = bench.inputs(op)
    profiler = cProfile.Profile()
    with gc_off():
        profiler.runcall(run, bench.manager, keys)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def bench_policy(kind: PolicyKind, args: argparse.Namespace, console: Console) -> tuple[list[Result], dict]:
    """Fills one manager, times every op `args.repeat` times round-robin; returns results and facts."""
    manager = build_manager(kind, args)
    levels = fill_levels(manager, args.blocks, args.high_watermark, args.low_watermark)
    keys = KeyMaker(args.seed)
    started = time.perf_counter()
    indexed = keys.take(args.blocks)
    with gc_off():
        fill(manager, indexed, levels)
    fill_s = time.perf_counter() - started
    console.print(f"{kind.value}: filled {len(manager.index):,} blocks "
                  f"({', '.join(f'{t.name} {manager.num_used(t):,}' for t in manager.order)}) in {fill_s:.1f} s")
    bench = Bench(manager, keys, indexed, random.Random(args.seed), args.ops)
    runs: dict[str, list[Batch]] = {op: [] for op in OPS}
    for _ in range(args.repeat):
        for op in OPS:
            runs[op].append(time_batch(bench, op, args.gc))
    results = []
    for op, batches in runs.items():
        num_ops = sum(b.num_ops for b in batches)
        total: dict = {}
        for b in batches:
            total = _add(total, b.counters)
        results.append(Result(kind.value, op, num_ops // len(batches), [b.us for b in batches],
                              [b.cpu_us for b in batches], OPS[op][1],
                              sum(b.num_moves for b in batches) / num_ops, total))
    if args.profile:
        for op in OPS:
            console.rule(f"{kind.value} {op}: cProfile of one batch of {args.ops:,} (sorted by own time)")
            console.print(profile_batch(bench, op), markup=False, highlight=False)
    facts = {"fill_s": fill_s, "fill_levels": {t.name.lower(): n for t, n in levels.items()},
             "used_after": {t.name.lower(): manager.num_used(t) for t in manager.order},
             "blocks_indexed_after": len(manager.index)}
    del bench, manager, indexed
    gc.collect()
    return results, facts


def _add(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _add(out.get(k, {}), v) if isinstance(v, dict) else out.get(k, 0) + v
    return out


# ---- report ------------------------------------------------------------------------------------


def table(results: list[Result], args: argparse.Namespace) -> Table:
    t = Table(title=f"kvtier manager bookkeeping, {args.blocks:,} blocks indexed "
                    f"(HBM {args.hbm_slots:,} / DRAM {args.dram_slots:,} / SSD {args.ssd_slots:,} slots)")
    for col in ("policy", "op", "µs/op (median)", "min", "max", "cpu µs", "moves/op", "what the calls did",
                "goal", "result"):
        t.add_column(col, justify="left" if col in ("policy", "op", "what the calls did") else "right")
    for r in results:
        if r.goal_us is None:
            goal, mark = "-", "-"
        else:
            goal, mark = f"<= {r.goal_us:g} µs", "[green]pass[/]" if r.meets_goal else "[red]miss[/]"
        t.add_row(r.policy, r.op, f"{r.median_us:.2f}", f"{min(r.runs_us):.2f}", f"{max(r.runs_us):.2f}",
                  f"{r.median_cpu_us:.2f}", f"{r.moves_per_op:.2f}", outcome(r), goal, mark)
    return t


def outcome(r: Result) -> str:
    """Where stores landed, or how many SSD loads were promoted: the share that should be 100 %."""
    c = r.counters
    if r.op == "store":
        stores = c.get("stores", {})
        total = sum(stores.values()) or 1
        return " ".join(f"{t} {n / total:.0%}" for t, n in stores.items())
    if r.op == "load ssd":
        hits = sum(c.get("hits", {}).values())
        promoted = sum(c.get("promotions", {}).values())
        missed = c.get("misses", 0)
        return f"promoted {promoted / (hits or 1):.0%}" + (f", {missed:,} missed" if missed else "")
    return ""


def report(args: argparse.Namespace, results: list[Result], facts: dict, elapsed_s: float) -> dict:
    return {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": sys.version.split()[0], "machine": platform.machine()},
        "config": {"blocks": args.blocks, "ops_per_batch": args.ops, "repeat": args.repeat,
                   "slots": {"hbm": args.hbm_slots, "dram": args.dram_slots, "ssd": args.ssd_slots},
                   "high_watermark": args.high_watermark, "low_watermark": args.low_watermark,
                   "gc_during_timing": args.gc, "seed": args.seed},
        "policies": facts,
        "elapsed_s": elapsed_s,
        "results": [{**asdict(r), "median_us": r.median_us, "median_cpu_us": r.median_cpu_us,
                     "meets_goal": r.meets_goal} for r in results],
    }


# ---- memory: what holding N blocks costs -------------------------------------------------------


KEY_BYTES = 16  # a block key: an xxh3-128 digest


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def digest_keys(start: int, count: int) -> list[bytes]:
    return [xxhash.xxh3_128_digest(i.to_bytes(8, "little")) for i in range(start, start + count)]


def before_index() -> tuple[float, int, int, float]:
    """What a 16-byte key object costs here (to tell the index's own bytes from its keys'), then the
    tracked objects, RSS and full-GC pause of the process before the index (imports, interpreter)."""
    gc.collect()
    base = rss_bytes()
    probe = digest_keys(10**12, 200_000)
    key_bytes = (rss_bytes() - base - 8 * len(probe)) / len(probe)
    del probe
    gc.collect()
    objects, rss = len(gc.get_objects()), rss_bytes()
    t = time.perf_counter()
    gc.collect()
    return key_bytes, objects, rss, time.perf_counter() - t


def after_index() -> tuple[int, int, list[float]]:
    """RSS and tracked objects once the index is built, and five full-GC pauses (seconds)."""
    gc.collect()
    rss, objects = rss_bytes(), len(gc.get_objects())
    pauses = []
    for _ in range(5):
        t = time.perf_counter()
        gc.collect()
        pauses.append(time.perf_counter() - t)
    return rss, objects, pauses


def memory_child(num_blocks: int, policy: str) -> dict:
    """One measurement (run in a fresh process): see the module's docstring."""
    key_bytes, objects_before, rss_before, empty_pause = before_index()
    dram, ssd = max(1, num_blocks // 5), max(1, num_blocks * 6 // 5)
    manager = TierManager([TierSlots(DRAM, dram, make_policy(policy, dram)), TierSlots(SSD, ssd, make_policy(policy, ssd))])
    started = time.perf_counter()
    step = 64
    for start in range(0, num_blocks, step):
        manager.store_now(digest_keys(start, min(step, num_blocks - start)))
    fill_s = time.perf_counter() - started
    indexed = len(manager.index)
    rss_after, objects_after, pauses = after_index()
    rng = random.Random(0)
    picks = [digest_keys(rng.randrange(num_blocks), 1)[0] for _ in range(50_000)]
    lookup, touch = manager.lookup, manager.touch
    t = time.perf_counter()
    for key in picks:
        lookup([key])
        touch([key])
    lookup_us = (time.perf_counter() - t) / len(picks) * 1e6
    found = sum(manager.lookup([k]) for k in picks[:1000])
    new = [[k] for k in digest_keys(num_blocks, 20_000)]
    store_now = manager.store_now
    t = time.perf_counter()
    for request in new:
        store_now(request)
    store_us = (time.perf_counter() - t) / len(new) * 1e6
    replay_per_s, replay = replay_at_scale(manager, num_blocks)
    grown = rss_bytes() - rss_before
    return {"blocks": num_blocks, "policy": policy, "dram_slots": dram, "ssd_slots": ssd, "indexed": indexed,
            "rss_per_block": (rss_after - rss_before) / num_blocks, "key_object_bytes": key_bytes,
            "rss_per_block_beyond_key": (rss_after - rss_before) / num_blocks - KEY_BYTES,
            "rss_mib": (rss_after - rss_before) / 2**20, "rss_mib_at_end": grown / 2**20,
            "tracked_objects": objects_after - objects_before,
            "gc_pause_ms": statistics.median(pauses) * 1e3, "gc_pauses_ms": [p * 1e3 for p in pauses],
            "gc_pause_ms_before_index": empty_pause * 1e3, "torch_imported": "torch" in sys.modules,
            "lookup_touch_us": lookup_us, "lookups_found": found, "store_us": store_us,
            "fill_blocks_per_s": num_blocks / fill_s, "replay_accesses_per_s": replay_per_s, "replay": replay,
            "kvtier": str(Path(sys.modules["kvtier"].__file__).parent)}


REPLAY_REQUESTS, REPLAY_BLOCKS, REPLAY_REUSE = 20_000, 16, 0.6


def replay_at_scale(manager: TierManager, num_blocks: int) -> tuple[float, dict]:
    """Replays requests against the filled index as `kvtier simulate` does (`lookup`, `load_now` of
    the prefix found, `store_now` of the rest), with the collector on as in a server: 60 % of
    the requests come back to the first 16 blocks of one of the fill's requests (uniformly: most
    are in the SSD, and a load promotes them into DRAM, demoting others), the rest are 16 new
    blocks. Returns block accesses per second, and what the replay did."""
    rng = random.Random(1)
    chunks = max(1, num_blocks // 64)
    fresh = num_blocks + 20_000  # past the keys the store timing used
    requests = []
    for _ in range(REPLAY_REQUESTS):
        if rng.random() < REPLAY_REUSE:
            start = rng.randrange(chunks) * 64
            requests.append(digest_keys(start, min(REPLAY_BLOCKS, num_blocks - start)))
        else:
            requests.append(digest_keys(fresh, REPLAY_BLOCKS))
            fresh += REPLAY_BLOCKS
    lookup, load_now, store_now = manager.lookup, manager.load_now, manager.store_now
    stats = manager.stats
    hits_before = sum(stats.hits.values())
    accesses = 0
    t = time.perf_counter()
    for keys in requests:
        n = lookup(keys)
        if n:
            load_now(keys[:n])
        if n < len(keys):
            store_now(keys[n:])
        accesses += len(keys)
    elapsed = time.perf_counter() - t
    hits = sum(stats.hits.values()) - hits_before
    return accesses / elapsed, {"requests": len(requests), "accesses": accesses, "hit_rate": hits / accesses}


def pool_child(num_blocks: int) -> dict:
    """A pool node's `BlockStore` holding `num_blocks` committed blocks (run in a fresh process)."""
    from kvtier.pool.node.store import BlockStore

    block_bytes, region_bytes = 64 << 10, 64 << 20
    key_bytes, objects_before, rss_before, empty_pause = before_index()
    regions = -(-num_blocks * block_bytes // region_bytes) + 1
    now = [0.0]
    store = BlockStore(regions * region_bytes, region_bytes, {"t": regions * region_bytes}, lambda: now[0])
    put_begin, pin, end_access, commit = store.put_begin, store.pin, store.end_access, store.commit
    started = time.perf_counter()
    step = 64
    for start in range(0, num_blocks, step):
        for key in digest_keys(start, min(step, num_blocks - start)):
            grant = put_begin("t", key, block_bytes, 30.0)
            end_access(pin(grant.block, write=True), True)
            if not commit("t", key, grant.block.gen, 1):
                raise SystemExit(f"pool bench: the commit of block {start} failed")
    fill_s = time.perf_counter() - started
    held = store.stats()["num_blocks"]
    rss_after, objects_after, pauses = after_index()
    rng = random.Random(0)
    picks = [digest_keys(rng.randrange(num_blocks), 1)[0] for _ in range(50_000)]
    get, release = store.get, store.release
    t = time.perf_counter()
    found = 0
    for key in picks:
        (grant,) = get("t", [key], 30.0)
        found += grant is not None
        release("t", [grant.lease])
    get_us = (time.perf_counter() - t) / len(picks) * 1e6
    return {"blocks": num_blocks, "indexed": held, "block_bytes": block_bytes, "regions": regions,
            "rss_per_block": (rss_after - rss_before) / num_blocks, "key_object_bytes": key_bytes,
            "rss_per_block_beyond_key": (rss_after - rss_before) / num_blocks - KEY_BYTES,
            "tracked_objects": objects_after - objects_before, "gc_pause_ms": statistics.median(pauses) * 1e3,
            "gc_pauses_ms": [p * 1e3 for p in pauses], "gc_pause_ms_before_index": empty_pause * 1e3,
            "get_release_us": get_us, "gets_found": found, "fill_blocks_per_s": num_blocks / fill_s,
            "torch_imported": "torch" in sys.modules, "kvtier": str(Path(sys.modules["kvtier"].__file__).parent)}


def run_pool(args: argparse.Namespace, console: Console) -> list[dict]:
    """One child per block count; prints each result as it comes, then a table."""
    rows = [_child(args, console, ["--pool-child", str(n)], f"pool node, {n:,} blocks") for n in args.pool]
    t = Table(title="kvtier pool node index: what N blocks of 64 KiB cost (put, commit)"
                    + (f" — kvtier from {args.kvtier}" if args.kvtier else ""))
    for col in ("blocks", "RSS B/block", "beyond 16-B key", "key object B", "tracked objects", "full GC ms", "goal <= 20 ms",
                "GC ms, no index", "get+release µs", "puts/s"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(f"{r['blocks']:,}", f"{r['rss_per_block']:.0f}", f"{r['rss_per_block_beyond_key']:.0f}", f"{r['key_object_bytes']:.0f}",
                  f"{r['tracked_objects']:,}", f"{r['gc_pause_ms']:.1f}",
                  "[green]pass[/]" if r["gc_pause_ms"] <= 20 else "[red]miss[/]", f"{r['gc_pause_ms_before_index']:.1f}",
                  f"{r['get_release_us']:.2f}", f"{r['fill_blocks_per_s']:,.0f}")
    console.print(t)
    return rows


def _child(args: argparse.Namespace, console: Console, child_args: list[str], what: str) -> dict:
    """Runs this script with `child_args` in a fresh process (on `--kvtier`'s checkout if given)."""
    import subprocess

    env = dict(os.environ)
    if args.kvtier:
        env["PYTHONPATH"] = str(args.kvtier.resolve())
    console.print(f"{what} (a child process; 10M blocks take a few minutes) ...")
    out = subprocess.run([sys.executable, __file__, *child_args], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{what}: the child failed:\n{out.stderr[-3000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    console.print(f"  RSS {row['rss_per_block']:.0f} B/block, full GC {row['gc_pause_ms']:.1f} ms, "
                  f"{row['tracked_objects']:,} tracked objects")
    return row


def run_memory(args: argparse.Namespace, console: Console) -> list[dict]:
    """One child per (policy, block count); prints each result as it comes, then a table."""
    rows = [_child(args, console, ["--memory-child", str(n), policy], f"memory: {policy}, {n:,} blocks")
            for policy in args.memory_policies for n in args.memory]
    t = Table(title="kvtier block index: what N blocks cost (DRAM 0.2 N + SSD 1.2 N slots, store_now)"
                    + (f" — kvtier from {args.kvtier}" if args.kvtier else ""))
    for col in ("policy", "blocks", "RSS B/block", "beyond 16-B key", "key object B", "tracked objects", "full GC ms",
                "goal <= 20 ms", "GC ms, no index", "lookup+touch µs", "store µs", "fill blocks/s",
                "replay acc/s"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for r in rows:
        t.add_row(r["policy"], f"{r['blocks']:,}", f"{r['rss_per_block']:.0f}", f"{r['rss_per_block_beyond_key']:.0f}", f"{r['key_object_bytes']:.0f}",
                  f"{r['tracked_objects']:,}", f"{r['gc_pause_ms']:.1f}",
                  "[green]pass[/]" if r["gc_pause_ms"] <= 20 else "[red]miss[/]", f"{r['gc_pause_ms_before_index']:.1f}",
                  f"{r['lookup_touch_us']:.2f}", f"{r['store_us']:.2f}", f"{r['fill_blocks_per_s']:,.0f}",
                  f"{r['replay_accesses_per_s']:,.0f}" if "replay_accesses_per_s" in r else "-")
    console.print(t)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.memory_child:
        print(json.dumps(memory_child(int(args.memory_child[0]), args.memory_child[1])))
        return 0
    if args.pool_child:
        print(json.dumps(pool_child(args.pool_child)))
        return 0
    console = Console(width=None if sys.stdout.isatty() else 130)
    if args.memory or args.pool:
        out = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0]},
               "memory": run_memory(args, console) if args.memory else [],
               "pool": run_pool(args, console) if args.pool else []}
        if args.json:
            args.json.write_text(json.dumps(out, indent=2))
        return 0
    started = time.perf_counter()
    results: list[Result] = []
    facts: dict[str, dict] = {}
    for name in args.policies:
        found, facts[name] = bench_policy(PolicyKind(name), args, console)
        results += found
    elapsed_s = time.perf_counter() - started
    console.print(table(results, args))
    for r in results:
        if r.counters.get("misses"):
            console.print(f"[yellow]{r.policy} {r.op}: {r.counters['misses']:,} of {r.num_ops * args.repeat:,} "
                          f"loads missed (their key was dropped mid-batch): raise --ssd-slots[/]")
    console.print(f"{args.ops:,} calls per batch, median of {args.repeat}; garbage collector "
                  f"{'on' if args.gc else 'off'} while timing; {elapsed_s:.1f} s")
    if args.json:
        args.json.write_text(json.dumps(report(args, results, facts, elapsed_s), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
