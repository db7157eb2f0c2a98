"""`kvtier simulate`: replay a request trace through the runtime's own manager and policies, or an equal C engine.

The tiers are virtual: slot counts and bandwidths, no bytes. Everything else is the runtime's code:
one `TierManager` with one eviction policy per tier (made by `make_policy`, or `BeladyPolicy`),
the runtime's admission rules and watermarks, and the same verbs in the same order as `KVTier`:

    n = lookup(keys)          longest cached prefix, in any tier
    load_now(keys[:n])        the hit blocks are read (and promoted per the manager)
    store_now(keys[n:])       the missed blocks were just computed: store them
    order_chain(keys)         chain-aware policies (chain-arc) re-rank the request's blocks

`load_now` and `store_now` are the manager's `prepare_*` / `complete_*` pairs for transfers that
all succeed at once: every move the manager plans (promotions, demotions) completes at once, in
the order issued, and the moves that completions trigger follow (tests/simulate/test_simulate_fastpath.py
checks that this decides exactly as the two-phase verbs driven that way). Nothing is in flight
between requests, and requests are served one at a time in timestamp order (`load_trace` sorts a file that is not).

Engines (`simulate(..., engine=...)`, `SimEngine`; the report's `engine` says which ran). "manager"
replays through a `TierManager` as above. "native" (kvtier/_replay.c, driven by
kvtier/simulate/native_replay.py) is a port, function by function, of what `lookup`, `load_now`
and `store_now` do for the configurations it accepts: policy LRU, with anything else `SimConfig`
allows (one to four tiers, exclusive or inclusive mode, admission on or off, any `promote_to`, any
watermarks, `full_blocks_only` or not), on a trace whose hash ids are ints. It is ~20 to 45 times
faster (bench/bench_simulate.py). "auto", the default, runs the native engine where it accepts
the configuration and trace and the manager otherwise (any other policy, including ones added
later), saying why under `engine_fallback`; asking for "native" where it does not accept them is
a ConfigError. Proof of equality: tests/simulate/test_native_engine.py replays hypothesis-generated
traces (prefix-chained ids, and any ids with repeats inside a request) across hypothesis-generated
accepted configurations on tiers of a few blocks, slices of the Mooncake conversation trace across
modes, admission, promotion and watermarks, and the whole shared traces, and requires both engines'
counts to be equal field by field, every request's TTFT to be the same float, and every tier's
final LRU order to be the same keys. Timing: `replay_s` is the replay alone for both engines; the
preparation before it (the manager's key lists and Belady's future index; the native engine's
interning of hash ids into arrays) is outside it, inside the `simulate` call.

Retention hints. A trace whose requests carry hints (`session`, `closed`, `retain_s`: see
kvtier/simulate/trace.py, or derived by kvtier/simulate/hints.py) is replayed with one more verb per
request, after `order_chain`: `apply_hint(keys, now=timestamp, ...)` (kvtier/deciding/retention.py),
the trace's time being the manager's clock; a request without a hint in such a trace counts as
unhinted use. Both engines replay hints, with the manager's default bounds (`SIM_HINT_LIMITS`): the
native engine ports the victims `_bind_hinted_victims` chooses (doomed first, retained blocks set
aside in the last tier) and the book's deadlines, budgets and pruning; the sessions' bookkeeping,
which depends on the trace alone, is worked out before the replay (`native_replay.hint_arrays`).
tests/simulate/test_native_engine.py requires equal counts, hint counters included, on hinted traces.

Accounting (what `block_hit_rate` means). Every hash id of a request is one block access, the
partial tail block included: its id names the tail's tokens as exactly as a full block's id does, so
it is stored and hit like one (`full_blocks_only` drops it instead, as engines that never cache a
partial block do). A block counts as a hit only inside the matched prefix: an engine cannot use a
cached block that follows a miss. `block_hit_rate` = hits / accesses. This accounting reproduces
the independent reference figure for the Mooncake conversation trace: one LRU tier of 18,279
blocks (10 % of its 182,790 unique blocks) hits 80,323 of 288,500 accesses, 27.8 %. Dropping the
tails instead gives 81,754 of 276,491 (29.6 %), which is not the reference. For LRU, counting every
cached block rather than only the prefix changes nothing (also 80,323): block i is accessed just
before block i+1 every time, so when LRU evicts i but keeps i+1, i+1 is the least recent block and
leaves at the next insertion, at the latest i's own, before any request reaches i+1.

TTFT model (an estimate for comparing configurations, not a prediction of one server):

    ttft_s = max(uncached_tokens, 1) / prefill_tokens_per_s
             + sum over hit blocks of block_bytes / (bandwidth of the tier the block was found in)

Prefill cost is linear in the tokens computed (attention's quadratic term is ignored) and at least
one token is always computed; loads do not overlap compute (layer-wise loading could hide part of
them, so the load term is an upper bound); no queueing, no decode. A block found below
`promote_to` is charged once, at its own tier's bandwidth, though it also lands in `promote_to`.
"""

from __future__ import annotations

import enum
import gc
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.config import CacheMode, parse_size
from kvtier.errors import CapacityError, ConfigError
from kvtier.deciding.manager import TierManager, TierSlots
from kvtier.deciding.retention import HintLimits
from kvtier.policy import EvictionPolicy, PolicyKind, make_policy
from kvtier.policy.admission import AdmissionKind, AdmissionRule
from kvtier.simulate.belady import BeladyPolicy, FutureAccesses
from kvtier.simulate.native_replay import (MAX_BLOCKS, HintArrays, NativeTier, NotNative, hint_arrays,
                                           intern_requests, run_native)
from kvtier.simulate.report import ADMISSION_MIN_HITS, ADMISSION_TIERS, ReplayCounts, make_report
from kvtier.simulate.trace import Trace
from kvtier.observing.stats import DropReason
from kvtier.kinds import TierKind
from kvtier.units import check_number

# The model the Mooncake paper's own simulations use (LLaMA2-70B geometry): 160 MiB per 512-token block.
DEFAULT_MODEL = "Llama-2-70B"
# Roughly a 70B model prefilling on one 8-GPU node; measure your own and pass it.
DEFAULT_PREFILL_TOKENS_PER_S = 20_000.0
DEFAULT_BANDWIDTH_GBPS: dict[TierKind, float] = {
    TierKind.HBM: 1000.0,  # device-to-device copy into the engine's KV pages
    TierKind.DRAM: 25.0,  # PCIe Gen5 x16, achieved
    TierKind.POOL: 12.5,  # 100 GbE RDMA
    TierKind.SSD: 6.0,  # one NVMe Gen4 drive
}
# With admission on, ADMISSION_TIERS (defined in report.py, whose notes describe them) admit only
# blocks hit at least ADMISSION_MIN_HITS times, stored directly or demoted: blocks used once never reach them.
PROGRESS_EVERY = 256  # requests between progress callbacks
# The hints' bounds and budgets of a replay with hints, in either engine: the runtime's defaults.
SIM_HINT_LIMITS = HintLimits()
# `TierManager.apply_hint` prunes the book's marks past this many times the index's capacity (a
# literal there; the hinted equality tests fail if the two differ: pruning changes which blocks are doomed).
HINT_PRUNE_CAPACITIES = 4


class SimPolicy(enum.Enum):
    """The eviction policies a simulation can use: the runtime's, plus the offline optimum."""

    LRU = "lru"
    S3FIFO = "s3fifo"
    ARC = "arc"
    CHAIN_ARC = "chain-arc"
    BELADY = "belady"


class SimEngine(enum.Enum):
    """Which engine replays a trace (see the module docstring)."""

    AUTO = "auto"  # the native engine where it accepts the configuration and trace, else the manager
    NATIVE = "native"  # the native engine, or ConfigError where it does not accept them
    MANAGER = "manager"  # the runtime's TierManager


@dataclass(frozen=True, slots=True)
class VirtualTier:
    """A tier with slots and a bandwidth but no bytes."""

    kind: TierKind
    num_slots: int
    bandwidth_gbps: float

    def __post_init__(self) -> None:
        """Raises CapacityError (slots) or ConfigError (bandwidth) naming the tier."""
        name = self.kind.name.lower()
        if isinstance(self.num_slots, bool) or not isinstance(self.num_slots, int) or self.num_slots < 1:
            raise CapacityError(f"capacity of tier {name} must be at least one block, got {self.num_slots!r}")
        bandwidth = self.bandwidth_gbps
        if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or not 0 < bandwidth < math.inf:
            raise ConfigError(f"bandwidth of tier {name} must be a positive number of GB/s, got {bandwidth!r}")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated configuration.

    Attributes:
        tiers: the virtual tiers, fastest first after validation; at most one per kind.
        block_bytes: bytes of one block (the model's KV bytes per token x the trace's block tokens).
        policy: the eviction policy of every tier.
        admission: False: every tier admits every block. True: the pool and SSD tiers (unless
            one is the top tier) admit only blocks already hit `ADMISSION_MIN_HITS` times, so blocks
            used once are dropped instead of written there; HBM and DRAM always admit all.
        mode: exclusive (one copy) or inclusive (stores write through).
        promote_to: a hit below this tier is promoted into it; None never promotes.
        high_watermark, low_watermark: of every tier but the last; the last tier evicts on demand,
            since its evictions are drops that free the slot at once.
        prefill_tokens_per_s: compute throughput of the TTFT model.
        full_blocks_only: ignore each request's partial tail block.
    """

    tiers: tuple[VirtualTier, ...]
    block_bytes: int
    policy: SimPolicy = SimPolicy.LRU
    admission: bool = False
    mode: CacheMode = CacheMode.EXCLUSIVE
    promote_to: TierKind | None = TierKind.DRAM
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    full_blocks_only: bool = False

    def __post_init__(self) -> None:
        """Sorts the tiers and validates every field.

        Raises:
            ConfigError: no tiers, a tier twice, or a field out of range; the message names it.
        """
        kinds = [t.kind for t in self.tiers]
        if not kinds:
            raise ConfigError("capacity: give at least one tier, e.g. --capacity dram=10000")
        if len(set(kinds)) != len(kinds):
            raise ConfigError(f"capacity: each tier at most once, got {[k.name.lower() for k in kinds]}")
        object.__setattr__(self, "tiers", tuple(sorted(self.tiers, key=lambda t: t.kind)))
        _check_positive("block_bytes", self.block_bytes, integral=True)
        _check_positive("prefill_tokens_per_s", self.prefill_tokens_per_s, integral=False)
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ConfigError("watermarks: need 0 < low_watermark <= high_watermark <= 1, got "
                              f"{self.low_watermark} and {self.high_watermark}")

    @property
    def label(self) -> str:
        """A short name for reports: the policy, with `+admission` when admission is on."""
        return self.policy.value + ("+admission" if self.admission else "")


def blocks_of_share(share: float, num_unique_blocks: int) -> int:
    """Slots that hold `share` (a fraction, 0.05 for 5 %) of a trace's distinct blocks: the nearest whole count.

    The one rounding rule for a capacity given as a share, used by `--capacity dram=5%` and by the
    sweep's default points alike, so the same share names the same size everywhere (Python's
    `round`: a tie goes to the even count). The result may be 0; callers decide what that means.
    """
    return round(share * num_unique_blocks)


def parse_capacity(text: str, *, block_bytes: int, num_unique_blocks: int, where: str) -> int:
    """Slots from a capacity: blocks (`18279`), bytes (`64GiB`, `500GB`) or a share of the trace (`10%`).

    Args:
        text: the value as written.
        block_bytes: bytes per block, for byte sizes.
        num_unique_blocks: the trace's distinct blocks, for percentages.
        where: what to name in errors, e.g. `capacity dram`.
    Returns:
        The number of slots (>= 1, <= `MAX_BLOCKS`).
    Raises:
        ConfigError: the value is not a number, a size or a percentage.
        CapacityError: it comes to less than one block (zero, negative, or bytes under a block), or
            to more than `MAX_BLOCKS` (what the replay engines can index; e.g. `1e30`).
    """
    value = text.strip()
    if value.startswith("-"):
        raise CapacityError(f"{where}: must be a positive number of blocks (at least one), got {text!r}")
    try:
        if value.endswith("%"):
            share = float(value[:-1])
            if not math.isfinite(share):
                raise ValueError
            blocks = blocks_of_share(share / 100, num_unique_blocks)
        elif value.lstrip("+").isdigit():
            blocks = int(value)
        else:
            blocks = parse_size(value, where) // block_bytes
    except ConfigError as e:  # parse_size's reason (unreadable, too large), with what a capacity may be
        raise ConfigError(f"{e}; a capacity is blocks (18279), bytes (64GiB) or a share (10%)") from None
    except ValueError:
        raise ConfigError(f"{where}: expected blocks (18279), bytes (64GiB) or a share (10%), got {text!r}") from None
    if blocks < 1:
        raise CapacityError(f"{where}: {text!r} is less than one block of {block_bytes:,} bytes; need at least one")
    if blocks > MAX_BLOCKS:
        raise CapacityError(f"{where}: {text!r} comes to {blocks:,} blocks; at most {MAX_BLOCKS:,} can be replayed "
                            f"(this trace has {num_unique_blocks:,} distinct blocks: a tier that holds them all, "
                            f"100%, never evicts)")
    return blocks


def build_manager(config: SimConfig, future: FutureAccesses | None = None) -> TierManager:
    """The runtime's `TierManager` over `config`'s virtual tiers.

    Raises:
        ConfigError: Belady without `future`.
    """
    slots = [TierSlots(tier.kind, tier.num_slots, _policy(config.policy, tier.num_slots, future), admission, *marks)
             for tier, admission, marks in _tier_rules(config)]
    manager = TierManager(slots, mode=config.mode, promote_to=config.promote_to)
    manager.configure_hints(SIM_HINT_LIMITS)
    return manager


def _tier_rules(config: SimConfig) -> list[tuple[VirtualTier, AdmissionRule, tuple[float, float]]]:
    """Per tier, fastest first: its admission rule and its (high, low) watermarks, for either engine."""
    last = config.tiers[-1].kind
    rules = []
    for i, tier in enumerate(config.tiers):
        admits_all = i == 0 or not config.admission or tier.kind not in ADMISSION_TIERS
        admission = (AdmissionRule(AdmissionKind.ALL) if admits_all
                     else AdmissionRule(AdmissionKind.REUSED, min_hits=ADMISSION_MIN_HITS))
        marks = (1.0, 1.0) if tier.kind is last else (config.high_watermark, config.low_watermark)
        rules.append((tier, admission, marks))
    return rules


def _policy(policy: SimPolicy, num_slots: int, future: FutureAccesses | None) -> EvictionPolicy:
    if policy is SimPolicy.BELADY:
        if future is None:
            raise ConfigError("policy belady needs the future accesses of the trace")
        return BeladyPolicy(future)
    return make_policy(PolicyKind(policy.value), num_slots)


def native_declines(config: SimConfig) -> str | None:
    """Why the native engine does not replay `config`, or None where it does (see the module docstring)."""
    if config.policy is not SimPolicy.LRU:
        return f"policy {config.policy.value}: the native engine replays LRU only"
    return None


def has_hints(trace: Trace) -> bool:
    """Whether any request of `trace` carries a retention hint (the replay then applies them)."""
    return any(r.hinted for r in trace.requests)


def simulate(trace: Trace, config: SimConfig, *, on_progress: Callable[[int], None] | None = None,
             engine: SimEngine | str = SimEngine.AUTO) -> dict:
    """Replays `trace` through `config`'s tiers: a fresh manager, or the native engine (see the module docstring).

    Args:
        trace: the requests.
        config: tiers, policy and models.
        on_progress: called with a number of requests done since the last call, now and then.
        engine: which engine replays: `SimEngine` or its value ("auto", "native", "manager").
    Returns:
        A JSON-ready report: `block_hit_rate`, hits and accesses, prefill tokens saved, TTFT
        percentiles (with and without the cache), under `tiers` a per-tier breakdown (slots,
        hits, hit rate, stores, evictions, blocks and bytes read and written), and `engine`
        ("native" or "manager"), with `engine_fallback` saying why where "auto" fell back.
    Raises:
        ConfigError: `engine` is not one of the three, or "native" for what it does not accept.
    """
    return make_report(trace, config, replay_counts(trace, config, engine=engine, on_progress=on_progress))


def replay_counts(trace: Trace, config: SimConfig, *, engine: SimEngine | str = SimEngine.AUTO,
                  on_progress: Callable[[int], None] | None = None, lru_orders: bool = False) -> ReplayCounts:
    """One replay's counts, from which `simulate` makes its report.

    Args:
        trace, config, on_progress, engine: as for `simulate`.
        lru_orders: also record each tier's final LRU order (the equality tests compare them).
    Returns:
        The counts.
    Raises:
        ConfigError: as `simulate`.
    """
    try:
        engine = SimEngine(engine)
    except ValueError:
        raise ConfigError(f"engine: expected one of {[e.value for e in SimEngine]}, got {engine!r}") from None
    declined = native_declines(config) if engine is not SimEngine.MANAGER else None
    arrays = hints = None
    if engine is not SimEngine.MANAGER and declined is None:
        try:
            arrays = intern_requests(trace.requests, config.full_blocks_only)
            hints = hint_arrays(trace.requests, arrays, SIM_HINT_LIMITS) if has_hints(trace) else None
        except NotNative as e:
            declined, arrays = str(e), None
    if engine is SimEngine.NATIVE and declined is not None:
        raise ConfigError(f"engine native: {declined}")
    collecting = gc.isenabled()
    gc.disable()  # see _Replay.run
    try:
        if arrays is not None:
            return _replay_native(arrays, hints, config, trace.block_tokens, on_progress, lru_orders)
        return _replay_manager(trace, config, on_progress, lru_orders, declined)
    finally:
        if collecting:
            gc.enable()


def _replay_native(arrays, hints: HintArrays | None, config: SimConfig, block_tokens: int,
                   on_progress: Callable[[int], None] | None, lru_orders: bool) -> ReplayCounts:
    """`replay_counts` by the native engine, over the interned trace (and its hints, if any)."""
    rules = _tier_rules(config)
    kinds = [tier.kind for tier, _, _ in rules]
    tiers = [NativeTier(tier.num_slots, admission, *marks, _seconds_per_block(config, tier))
             for tier, admission, marks in rules]
    promote_to = kinds.index(config.promote_to) if config.promote_to in kinds else None
    started = time.perf_counter()
    result = run_native(arrays, tiers, inclusive=config.mode is CacheMode.INCLUSIVE, promote_to=promote_to,
                        block_tokens=block_tokens, seconds_per_token=1 / config.prefill_tokens_per_s,
                        on_progress=on_progress, progress_every=PROGRESS_EVERY, lru_orders=lru_orders,
                        hints=hints, hint_budgets=_hint_budgets(config))
    replay_s = time.perf_counter() - started
    if on_progress is not None:
        on_progress(len(arrays.starts) % PROGRESS_EVERY)
    c = result.counts

    def per_tier(name: str) -> dict[TierKind, int]:
        return dict(zip(kinds, c[name]))

    def per_route(name: str) -> dict[tuple[TierKind, TierKind], int]:
        return {(a, b): c[name][i][j] for i, a in enumerate(kinds) for j, b in enumerate(kinds) if i != j}

    reasons = (DropReason.EVICTED, DropReason.ADMISSION, DropReason.LOWER_FULL, DropReason.NO_SPACE)
    return ReplayCounts(
        "native", None, replay_s, per_tier("hits"), per_tier("stores"), per_tier("evictions"),
        per_tier("engine_reads"), per_tier("used_slots"), per_route("demotions"), per_route("promotions"),
        {reason: n for reason, n in zip(reasons, c["dropped"]) if n}, c["num_accesses"], c["cached_tokens"],
        c["input_tokens"], result.ttft_s, result.ttft_no_cache_s,
        dict(zip(kinds, result.lru_orders)) if result.lru_orders is not None else None,
        _hint_counts(hints, c.get("hints")))


def _hint_budgets(config: SimConfig) -> tuple[int, int, int]:
    """(tenant_cap, total_cap, prune_keep) in blocks, as `HintBook` and `apply_hint` derive them."""
    last_slots = config.tiers[-1].num_slots
    limits = SIM_HINT_LIMITS
    return (math.floor(limits.retain_fraction_per_tenant * last_slots), math.floor(limits.retain_fraction * last_slots),
            HINT_PRUNE_CAPACITIES * sum(t.num_slots for t in config.tiers))


def _hint_counts(hints: HintArrays | None, decided: dict | None) -> dict[str, int] | None:
    """The manager's `Stats.hints` for a native replay: those settled before it and those it decided."""
    if hints is None or decided is None:
        return None
    counts = dict(hints.counts)
    counts.update((name, decided[name]) for name in ("over_budget", "doomed_evicted") if decided[name])
    return counts if counts or decided["num_retained"] else None


def _replay_manager(trace: Trace, config: SimConfig, on_progress: Callable[[int], None] | None, lru_orders: bool,
                    fallback: str | None) -> ReplayCounts:
    """`replay_counts` by a fresh manager."""
    keys = [r.hash_ids[:-1] if r.partial_tail and config.full_blocks_only else r.hash_ids for r in trace.requests]
    future = FutureAccesses(keys) if config.policy is SimPolicy.BELADY else None
    replay = _Replay(build_manager(config, future), config, trace.block_tokens)
    started = time.perf_counter()
    replay.run(trace, keys, future, on_progress)
    replay_s = time.perf_counter() - started
    return replay.counts(replay_s, fallback, lru_orders)


def _seconds_per_block(config: SimConfig, tier: VirtualTier) -> float:
    """Seconds to read one block out of `tier`, in the TTFT model."""
    return config.block_bytes / (tier.bandwidth_gbps * 1e9)


class _Replay:
    """One replay: drives the manager and counts what the manager's own stats do not."""

    def __init__(self, manager: TierManager, config: SimConfig, block_tokens: int) -> None:
        self.manager = manager
        self.config = config
        self.block_tokens = block_tokens
        self.engine_reads: Counter = Counter()  # tier -> blocks read out to the engine
        self.num_accesses = 0
        self.cached_tokens = 0
        self.input_tokens = 0
        self.ttft_s: list[float] = []
        self.ttft_no_cache_s: list[float] = []

    def run(self, trace: Trace, keys: Sequence[tuple], future: FutureAccesses | None,
            on_progress: Callable[[int], None] | None) -> None:
        """Serves every request in order; see the module docstring for the verbs and the TTFT model.

        `simulate` turns the cyclic garbage collector off for the replay: the manager allocates
        a few objects per block moved (copies, queued moves) and frees them by reference count,
        but every few thousand allocations the collector would walk every live object, the trace
        and the whole index included, which cost a three-tier replay about 30 % of its time.
        """
        m, cfg = self.manager, self.config
        lookup, hits = m.lookup, m.stats.hits
        seconds_per_block = [_seconds_per_block(cfg, t) for t in cfg.tiers]
        seconds_per_token = 1 / cfg.prefill_tokens_per_s
        order, single = m.order, len(m.order) == 1
        order_chain, partial_tails = m.order_chain, not cfg.full_blocks_only
        apply_hint = m.apply_hint if has_hints(trace) else None
        block_tokens, ttft, ttft_no_cache = self.block_tokens, self.ttft_s, self.ttft_no_cache_s
        for i, request in enumerate(trace.requests):
            blocks = keys[i]
            if future is not None:
                future.begin_request(i)
            n = lookup(blocks)
            load_s = 0.0
            if n:
                before = None if single else [hits[t] for t in order]
                self._load(blocks[:n])
                if single:
                    load_s = n * seconds_per_block[0]
                else:  # left to right, one rounding per step, as the native engine sums (not `sum`,
                    # whose float sums are compensated from Python 3.12 on)
                    for t, b, s in zip(order, before, seconds_per_block):
                        load_s += (hits[t] - b) * s
            if n < len(blocks):
                self._store(blocks[n:])
            order_chain(blocks, partial_tail=request.partial_tail and partial_tails)  # a no-op but for chain-arc
            if apply_hint is not None:  # trace time is the manager's clock; a request without one is unhinted use
                apply_hint(blocks, now=request.timestamp_ms / 1000, session=request.session,
                           retain_s=request.retain_s, closed=request.closed)
            self.num_accesses += len(blocks)
            cached = min(n * block_tokens, request.input_tokens)
            self.cached_tokens += cached
            self.input_tokens += request.input_tokens
            ttft.append(max(request.input_tokens - cached, 1) * seconds_per_token + load_s)
            ttft_no_cache.append(request.input_tokens * seconds_per_token)
            if on_progress is not None and i % PROGRESS_EVERY == PROGRESS_EVERY - 1:
                on_progress(PROGRESS_EVERY)
        if on_progress is not None:
            on_progress(len(trace.requests) % PROGRESS_EVERY)

    def _load(self, blocks: tuple) -> None:
        reads = self.engine_reads
        for src in self.manager.load_now(blocks):
            reads[src.tier] += 1  # not Counter.update: its isinstance(Mapping) check costs ~1 µs

    def _store(self, blocks: tuple) -> None:
        self.manager.store_now(blocks)

    def counts(self, replay_s: float, fallback: str | None, lru_orders: bool) -> ReplayCounts:
        """The counts of a finished replay (`fallback`: why the native engine did not run, if it was asked to)."""
        m, stats = self.manager, self.manager.stats
        kinds = [t.kind for t in self.config.tiers]
        routes = [(a, b) for a in kinds for b in kinds if a is not b]
        orders = None
        if lru_orders:
            orders = {}
            for kind in kinds:  # a policy iterates its slots oldest first
                owners = m.index.owner[kind]
                orders[kind] = [m.index.key_of(owners[slot]) for slot in m._tiers[kind].policy]
        return ReplayCounts(
            "manager", fallback, replay_s, {k: stats.hits[k] for k in kinds}, {k: stats.stores[k] for k in kinds},
            {k: stats.evictions[k] for k in kinds}, {k: self.engine_reads[k] for k in kinds},
            {k: m.num_used(k) for k in kinds}, {r: stats.demotions[r] for r in routes},
            {r: stats.promotions[r] for r in routes}, {reason: n for reason, n in stats.dropped.items() if n},
            self.num_accesses, self.cached_tokens, self.input_tokens, self.ttft_s, self.ttft_no_cache_s, orders,
            dict(stats.hints) if m.num_retained() or stats.hints else None)


def _check_positive(field: str, value: object, *, integral: bool) -> None:
    check_number(value, field, integral=integral, positive=True)
