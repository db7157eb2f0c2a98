"""`kvtier simulate`: replay a request trace through the runtime's own manager and policies.

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
between requests, and requests are served one at a time in trace order (timestamps only order them).

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

import numpy as np

from kvtier.config import CacheMode, parse_size
from kvtier.errors import CapacityError, ConfigError
from kvtier.manager import TierManager, TierSlots
from kvtier.policy import EvictionPolicy, PolicyKind, make_policy
from kvtier.policy.admission import AdmissionKind, AdmissionRule
from kvtier.simulate.belady import BeladyPolicy, FutureAccesses
from kvtier.simulate.trace import Trace
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
# With admission on, these tiers (slow, wear-limited or shared) admit only blocks hit at least
# ADMISSION_MIN_HITS times, whether stored directly or demoted: blocks used once never reach them.
ADMISSION_TIERS = frozenset({TierKind.POOL, TierKind.SSD})
ADMISSION_MIN_HITS = 1
PROGRESS_EVERY = 256  # requests between progress callbacks


class SimPolicy(enum.Enum):
    """The eviction policies a simulation can use: the runtime's, plus the offline optimum."""

    LRU = "lru"
    S3FIFO = "s3fifo"
    ARC = "arc"
    CHAIN_ARC = "chain-arc"
    BELADY = "belady"


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


def parse_capacity(text: str, *, block_bytes: int, num_unique_blocks: int, where: str) -> int:
    """Slots from a capacity: blocks (`18279`), bytes (`64GiB`, `500GB`) or a share of the trace (`10%`).

    Args:
        text: the value as written.
        block_bytes: bytes per block, for byte sizes.
        num_unique_blocks: the trace's distinct blocks, for percentages.
        where: what to name in errors, e.g. `capacity dram`.
    Returns:
        The number of slots (>= 1).
    Raises:
        ConfigError: the value is not a number, a size or a percentage.
        CapacityError: it comes to less than one block (zero, negative, or bytes under a block).
    """
    value = text.strip()
    if value.startswith("-"):
        raise CapacityError(f"{where}: must be a positive number of blocks (at least one), got {text!r}")
    try:
        if value.endswith("%"):
            share = float(value[:-1])
            if not math.isfinite(share):
                raise ValueError
            blocks = math.floor(share / 100 * num_unique_blocks)
        elif value.lstrip("+").isdigit():
            blocks = int(value)
        else:
            blocks = parse_size(value, where) // block_bytes
    except ValueError:
        raise ConfigError(f"{where}: expected blocks (18279), bytes (64GiB) or a share (10%), got {text!r}") from None
    if blocks < 1:
        raise CapacityError(f"{where}: {text!r} is less than one block of {block_bytes:,} bytes; need at least one")
    return blocks


def build_manager(config: SimConfig, future: FutureAccesses | None = None) -> TierManager:
    """The runtime's `TierManager` over `config`'s virtual tiers.

    Raises:
        ConfigError: Belady without `future`.
    """
    last = config.tiers[-1].kind
    slots = []
    for i, tier in enumerate(config.tiers):
        admits_all = i == 0 or not config.admission or tier.kind not in ADMISSION_TIERS
        admission = (AdmissionRule(AdmissionKind.ALL) if admits_all
                     else AdmissionRule(AdmissionKind.REUSED, min_hits=ADMISSION_MIN_HITS))
        marks = (1.0, 1.0) if tier.kind is last else (config.high_watermark, config.low_watermark)
        slots.append(TierSlots(tier.kind, tier.num_slots, _policy(config.policy, tier.num_slots, future),
                               admission, *marks))
    return TierManager(slots, mode=config.mode, promote_to=config.promote_to)


def _policy(policy: SimPolicy, num_slots: int, future: FutureAccesses | None) -> EvictionPolicy:
    if policy is SimPolicy.BELADY:
        if future is None:
            raise ConfigError("policy belady needs the future accesses of the trace")
        return BeladyPolicy(future)
    return make_policy(PolicyKind(policy.value), num_slots)


def simulate(trace: Trace, config: SimConfig, *, on_progress: Callable[[int], None] | None = None) -> dict:
    """Replays `trace` through a fresh manager built from `config`.

    Args:
        trace: the requests.
        config: tiers, policy and models.
        on_progress: called with a number of requests done since the last call, now and then.
    Returns:
        A JSON-ready report: `block_hit_rate`, hits and accesses, prefill tokens saved, TTFT
        percentiles (with and without the cache), and under `tiers` a per-tier breakdown (slots,
        hits, hit rate, stores, evictions, blocks and bytes read and written).
    """
    keys = [r.hash_ids[:-1] if r.partial_tail and config.full_blocks_only else r.hash_ids for r in trace.requests]
    future = FutureAccesses(keys) if config.policy is SimPolicy.BELADY else None
    replay = _Replay(build_manager(config, future), config, trace.block_tokens)
    collecting = gc.isenabled()
    gc.disable()  # see _Replay.run
    try:
        started = time.perf_counter()
        replay.run(trace, keys, future, on_progress)
        replay_s = time.perf_counter() - started
    finally:
        if collecting:
            gc.enable()
    return replay.report(trace, replay_s)


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
        seconds_per_block = [cfg.block_bytes / (t.bandwidth_gbps * 1e9) for t in cfg.tiers]
        seconds_per_token = 1 / cfg.prefill_tokens_per_s
        order, single = m.order, len(m.order) == 1
        order_chain, chain_aware = m.order_chain, cfg.policy is SimPolicy.CHAIN_ARC
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
                else:
                    load_s = sum((hits[t] - b) * s for t, b, s in zip(order, before, seconds_per_block))
            if n < len(blocks):
                self._store(blocks[n:])
            if chain_aware:
                order_chain(blocks, partial_tail=request.partial_tail and not cfg.full_blocks_only)
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

    def report(self, trace: Trace, replay_s: float) -> dict:
        """The JSON-ready report of a finished replay."""
        cfg, stats = self.config, self.manager.stats
        num_hits = sum(stats.hits.values())
        return {
            "label": cfg.label, "policy": cfg.policy.value, "admission": "on" if cfg.admission else "off",
            "mode": cfg.mode.value, "promote_to": cfg.promote_to.name.lower() if cfg.promote_to else None,
            "partial_blocks": "excluded" if cfg.full_blocks_only else "counted",
            "block_bytes": cfg.block_bytes, "num_requests": len(trace.requests),
            "num_accesses": self.num_accesses, "num_hits": num_hits,
            "block_hit_rate": num_hits / self.num_accesses if self.num_accesses else 0.0,
            "prefill": {
                "input_tokens": self.input_tokens, "tokens_saved": self.cached_tokens,
                "token_hit_rate": self.cached_tokens / self.input_tokens if self.input_tokens else 0.0,
                "prefill_tokens_per_s": cfg.prefill_tokens_per_s,
            },
            "ttft_s": _percentiles(self.ttft_s), "ttft_no_cache_s": _percentiles(self.ttft_no_cache_s),
            "tiers": {t.kind.name.lower(): self._tier_report(t) for t in cfg.tiers},
            "dropped": {reason: n for reason, n in stats.dropped.items() if n},
            "replay_s": replay_s, "accesses_per_s": self.num_accesses / replay_s if replay_s > 0 else None,
        }  # fmt: skip

    def _tier_report(self, tier: VirtualTier) -> dict:
        stats, kind, block_bytes = self.manager.stats, tier.kind, self.config.block_bytes
        moves = {route: n + stats.promotions[route] for route, n in stats.demotions.items()}
        moved_in = sum(n for (_, dst), n in moves.items() if dst == kind)
        moved_out = sum(n for (src, _), n in moves.items() if src == kind)
        num_hits = stats.hits[kind]
        blocks_written = stats.stores[kind] + moved_in
        blocks_read = self.engine_reads[kind] + moved_out
        return {
            "num_slots": tier.num_slots, "capacity_bytes": tier.num_slots * block_bytes,
            "bandwidth_gbps": tier.bandwidth_gbps, "used_slots": self.manager.num_used(kind),
            "hits": num_hits, "hit_rate": num_hits / self.num_accesses if self.num_accesses else 0.0,
            "share_of_hits": num_hits / max(1, sum(stats.hits.values())),
            "stores": stats.stores[kind], "evictions": stats.evictions[kind],
            "blocks_moved_in": moved_in, "blocks_moved_out": moved_out,
            "blocks_read": blocks_read, "blocks_written": blocks_written,
            "bytes_read": blocks_read * block_bytes, "bytes_written": blocks_written * block_bytes,
            "bytes_moved": (blocks_read + blocks_written) * block_bytes,
        }  # fmt: skip


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
    p50, p90, p99 = np.percentile(np.asarray(values), [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(np.mean(values))}


def _check_positive(field: str, value: object, *, integral: bool) -> None:
    check_number(value, field, integral=integral, positive=True)
