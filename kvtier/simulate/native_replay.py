"""The native replay engine: `kvtier simulate`'s replay of LRU tiers, in C (kvtier/_replay.c).

`kvtier.simulate.replay.simulate` runs it for the configurations it accepts (see that module's
docstring for which, and for how its equality with the manager is checked). This module only
turns a trace into the arrays the C entry point takes and calls it:

  * `intern_requests`: every request's hash ids, interned to dense block ids 0 .. num_blocks - 1
    (equal ids, equal block), back to back in one int32 array, with per-request offsets, lengths
    (the partial tail left out under `full_blocks_only`) and input tokens;
  * `hint_arrays`: for a trace with retention hints, what `TierManager.apply_hint` would do with each
    request's hint that depends on the trace alone (the sessions' bookkeeping), as flat arrays;
  * `run_native`: one replay over `NativeTier`s, returning the C engine's counters per tier index.

Nothing here decides anything: the decisions are the C port's, of `TierManager.store_now` and
`load_now`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier._replay import replay_lru
from kvtier.deciding.retention import HintError, HintLimits, check_hint
from kvtier.errors import KVTierError
from kvtier.policy.admission import AdmissionKind, AdmissionRule

# The C engine's ids are int32 (2**31 - 1 is kept free, as `SlotList` keeps it).
MAX_BLOCKS = 2**31 - 2
# `AdmissionKind` -> the C engine's code for it.
_ADMISSION_CODES = {AdmissionKind.ALL: 0, AdmissionKind.EVICTED: 1, AdmissionKind.REUSED: 2}


@dataclass(frozen=True, slots=True)
class TraceArrays:
    """A trace's requests as the C engine takes them.

    Attributes:
        ids: int32, every request's block ids back to back (dense: 0 .. num_blocks - 1).
        starts: int64, per request, where its ids start in `ids`.
        lengths: int64, per request, how many of its ids are accessed.
        input_tokens: int64, per request.
        keys: per dense id, the hash id it stands for.
    """

    ids: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    input_tokens: np.ndarray
    keys: Sequence[Hashable]

    @property
    def num_blocks(self) -> int:
        return len(self.keys)


@dataclass(frozen=True, slots=True)
class NativeTier:
    """One tier's rules, as `kvtier.simulate.replay.build_manager` gives them to the manager.

    Attributes:
        num_slots: blocks the tier holds.
        admission: which blocks it admits.
        high_watermark, low_watermark: ignored for the last tier (it evicts on demand).
        seconds_per_block: what reading one block out of it costs in the TTFT model.
    """

    num_slots: int
    admission: AdmissionRule
    high_watermark: float
    low_watermark: float
    seconds_per_block: float

    def as_tuple(self) -> tuple:
        """The tuple `replay_lru` takes; the watermarks in slots, as `TierManager._rebalance` compares them.

        The manager compares a tier's slots in use (an integer) with `high_watermark * num_slots`
        and demotes down to `floor(low_watermark * num_slots)`; for an integer, being at most a
        number is being at most its floor, so both marks travel as floors.
        """
        rule = self.admission
        return (self.num_slots, _ADMISSION_CODES[rule.kind], rule.min_hits, rule.allow_demoted,
                math.floor(self.high_watermark * self.num_slots), math.floor(self.low_watermark * self.num_slots),
                self.seconds_per_block)


class NotNative(KVTierError, ValueError):
    """A trace the native engine does not take; the message says why (the manager replays it instead)."""


def intern_requests(requests: Sequence, full_blocks_only: bool) -> TraceArrays:
    """The C engine's arrays for `requests` (each with `hash_ids`, `input_tokens`, `partial_tail`).

    Hash ids must be Python ints, as a trace file's are: the engine interns numbers, and the
    manager, whose index matches keys of any type as a dict does, replays every other trace. Ids
    that fit in 64 bits are interned by sorting (`np.unique`), others through a dict; either way
    equal ids get one block id, as they get one entry in the index.

    Args:
        requests: the trace's requests, in order.
        full_blocks_only: leave each request's partial tail block out, as `simulate` does.
    Returns:
        The arrays.
    Raises:
        NotNative: an id is not an int, or more than `MAX_BLOCKS` distinct ids.
    """
    num_requests = len(requests)
    lengths = np.fromiter((len(r.hash_ids) for r in requests), dtype=np.int64, count=num_requests)
    starts = np.zeros(num_requests, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    num_ids = int(lengths.sum())
    types = set(map(type, _flat(requests)))
    if not types <= {int}:
        names = sorted(t.__name__ for t in types - {int})
        raise NotNative(f"hash ids of type {', '.join(names)}: the native engine takes int ids only")
    try:
        hash_ids = np.fromiter(_flat(requests), dtype=np.int64, count=num_ids)
    except OverflowError:  # an id beyond int64
        dense: dict[int, int] = {}
        ids = np.fromiter((dense.setdefault(h, len(dense)) for h in _flat(requests)), dtype=np.int64, count=num_ids)
        return _arrays(ids, starts, lengths, requests, list(dense), full_blocks_only)
    keys, ids = np.unique(hash_ids, return_inverse=True)
    return _arrays(ids, starts, lengths, requests, keys, full_blocks_only)


def _flat(requests: Sequence) -> Iterator[Hashable]:
    return itertools.chain.from_iterable(r.hash_ids for r in requests)


def _arrays(ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray, requests: Sequence,
            keys: Sequence[Hashable], full_blocks_only: bool) -> TraceArrays:
    if len(keys) > MAX_BLOCKS:
        raise NotNative(f"the native engine takes at most {MAX_BLOCKS:,} distinct blocks, got {len(keys):,}")
    if full_blocks_only:
        lengths = lengths - np.fromiter((r.partial_tail for r in requests), dtype=np.int64, count=len(requests))
    input_tokens = np.fromiter((r.input_tokens for r in requests), dtype=np.int64, count=len(requests))
    return TraceArrays(ids.astype(np.int32), starts, lengths, input_tokens, keys)


@dataclass(frozen=True, slots=True)
class HintArrays:
    """A trace's retention hints as the C engine applies them (`replay_lru`'s `hints`).

    `HintBook.use` and `HintBook.close` (kvtier/deciding/retention.py) depend on the requests alone
    (which sessions list which keys, which close, and the session bounds), not on what the tiers
    hold, so they are worked out here, once, in the book's own order; the engine applies the rest
    (unhinted marks, refs, doomed blocks, deadlines, budgets, pruning), which does depend on them.

    Attributes:
        now_s: float64, per request: the manager's clock for its hint (`timestamp_ms / 1000`).
        retain_s: float64, per request: its `retain_s`, 0 for none.
        ids: int32 block ids, per request three runs back to back: the blocks it used without a
            session (`use` with none, past `max_session_blocks`, or of a session forgotten), the blocks
            its session lists for the first time, and the blocks no session lists any more: those
            of a session forgotten to make room for its own, then, where it closes an open
            session, every block that session listed, in the order `HintBook.close` visits them.
        offsets: int64, 3 per request + 1: where those runs start in `ids`.
        counts: the hint counters settled here ("applied", "closed", "sessions_forgotten",
            "session_blocks_over"), nonzero ones only.
    """

    now_s: np.ndarray
    retain_s: np.ndarray
    ids: np.ndarray
    offsets: np.ndarray
    counts: dict[str, int]


def hint_arrays(requests: Sequence, arrays: TraceArrays, limits: HintLimits) -> HintArrays:
    """The hints of `requests` (interned as `arrays`), as the C engine takes them.

    Mirrors `HintBook.use` and `HintBook.close` step by step over the requests' own keys, so that
    a closed session's keys come out in the order of the book's set of them (a set's order
    follows its keys' hashes and insertion order, both the same here).

    Raises:
        NotNative: a request's hint is one `TierManager.apply_hint` refuses (the manager replays
            the trace, and refuses it as the runtime does).
    """
    sessions: dict[str, set] = {}
    dense: dict = {}  # key -> its block id
    counts: dict[str, int] = {"applied": len(requests)}
    out: list[int] = []
    offsets = [0]
    ids, starts, lengths = arrays.ids, arrays.starts, arrays.lengths
    for i, r in enumerate(requests):
        try:
            check_hint(r.session, r.retain_s, r.closed, limits)
        except HintError as e:
            raise NotNative(f"request {i}: {e}") from None
        length = int(lengths[i])
        keys, blocks = r.hash_ids[:length], ids[starts[i]:starts[i] + length].tolist()
        dense.update(zip(keys, blocks))
        unhinted, listed, forgotten = _use(sessions, r.session, keys, limits, counts)
        out.extend(dense[k] for k in forgotten)  # a forgotten session's keys: unhinted from now on
        out.extend(dense[k] for k in unhinted)
        offsets.append(len(out))
        out.extend(dense[k] for k in listed)
        offsets.append(len(out))
        out.extend(dense[k] for k in forgotten)  # ... and no longer listed (never doomed: unhinted)
        ended = sessions.pop(r.session, None) if r.closed else None
        if ended is not None:
            counts["closed"] = counts.get("closed", 0) + 1
            out.extend(dense[k] for k in ended)
        offsets.append(len(out))
    now_s = np.fromiter((r.timestamp_ms / 1000 for r in requests), dtype=np.float64, count=len(requests))
    if not np.isfinite(now_s).all():
        raise NotNative("a request's timestamp is not a finite number of seconds")
    retain_s = np.fromiter((r.retain_s or 0.0 for r in requests), dtype=np.float64, count=len(requests))
    return HintArrays(now_s, retain_s, np.array(out, dtype=np.int32), np.array(offsets, dtype=np.int64),
                      {name: n for name, n in counts.items() if n})


def _use(sessions: dict[str, set], session: str | None, keys: Sequence, limits: HintLimits,
         counts: dict[str, int]) -> tuple[Sequence, list, Sequence]:
    """`HintBook.use` of `keys` in `session`: returns the keys used without a session, those the
    session lists for the first time, and those of a session forgotten to make room for it (in
    the order the book's set of them gives), counting what the book counts."""
    if session is None:
        return keys, [], ()
    forgotten: Sequence = ()
    listed = sessions.pop(session, None)  # back in last: sessions in order of last use
    if listed is None:
        listed = set()
        if len(sessions) >= limits.max_sessions:
            forgotten = sessions.pop(next(iter(sessions)))
            counts["sessions_forgotten"] = counts.get("sessions_forgotten", 0) + 1
    sessions[session] = listed
    unhinted, fresh = [], []
    for key in keys:
        if key in listed:
            continue
        if len(listed) >= limits.max_session_blocks:
            counts["session_blocks_over"] = counts.get("session_blocks_over", 0) + 1
            unhinted.append(key)
            continue
        listed.add(key)
        fresh.append(key)
    return unhinted, fresh, forgotten


@dataclass(frozen=True, slots=True)
class NativeResult:
    """One native replay's counters, by tier index (fastest first), as `replay_lru` returns them.

    Attributes:
        counts: `replay_lru`'s dict (hits, stores, evictions, engine_reads, used_slots per tier;
            demotions, promotions per [src][dst]; dropped; num_accesses, cached_tokens, input_tokens;
            with hints, hints: over_budget, doomed_evicted, num_retained).
        ttft_s, ttft_no_cache_s: per request, the TTFT model's estimate with and without the cache.
        lru_orders: per tier, the hash ids of its LRU order, oldest first (only when asked for).
    """

    counts: dict
    ttft_s: np.ndarray
    ttft_no_cache_s: np.ndarray
    lru_orders: list[list[Hashable]] | None


def run_native(arrays: TraceArrays, tiers: Sequence[NativeTier], *, inclusive: bool, promote_to: int | None,
               block_tokens: int, seconds_per_token: float, on_progress: Callable[[int], None] | None,
               progress_every: int, lru_orders: bool = False, hints: HintArrays | None = None,
               hint_budgets: tuple[int, int, int] | None = None) -> NativeResult:
    """Replays `arrays` through LRU `tiers` (fastest first) in C.

    Args:
        arrays: the trace, from `intern_requests`.
        tiers: 1 to 4 tiers, fastest first.
        inclusive: stores write through to every lower tier; False: exclusive.
        promote_to: the index in `tiers` a hit below it is promoted into, or None.
        block_tokens: tokens per block.
        seconds_per_token: the TTFT model's prefill cost per token computed.
        on_progress: called with `progress_every` after every `progress_every` requests.
        progress_every: see `on_progress`.
        lru_orders: also return each tier's final LRU order (for tests).
        hints: the trace's hints (`hint_arrays`), applied after every request; None: no hints.
        hint_budgets: with `hints`, (tenant_cap, total_cap, prune_keep) in blocks: the last tier's
            retention budgets and `HintBook.prune`'s keep, as the manager derives them.
    Returns:
        The counters and per-request TTFTs.
    Raises:
        TypeError, ValueError: malformed arrays or tiers (the message names the argument), or
            `hints` without `hint_budgets`.
        RuntimeError: the engine found one of its invariants broken (a bug).
        Exception: whatever `on_progress` raises.
    """
    if hints is not None and hint_budgets is None:
        raise ValueError("run_native: hints need hint_budgets (tenant_cap, total_cap, prune_keep)")
    num_requests = len(arrays.starts)
    ttft_s, ttft_no_cache_s = np.empty(num_requests), np.empty(num_requests)
    counts = replay_lru(arrays.ids, arrays.starts, arrays.lengths, arrays.input_tokens, arrays.num_blocks,
                        tuple(t.as_tuple() for t in tiers), inclusive, -1 if promote_to is None else promote_to,
                        block_tokens, seconds_per_token, ttft_s, ttft_no_cache_s, on_progress=on_progress,
                        progress_every=progress_every, lru_orders=lru_orders,
                        hints=None if hints is None else (hints.now_s, hints.retain_s, hints.ids, hints.offsets,
                                                          *hint_budgets))
    orders = counts.pop("lru_orders", None)
    if orders is not None:
        keys = arrays.keys
        orders = [[_plain(keys[b]) for b in order] for order in orders]
    return NativeResult(counts, ttft_s, ttft_no_cache_s, orders)


def _plain(key: object) -> Hashable:
    """A numpy integer as a Python int; any other key as it is."""
    return int(key) if isinstance(key, np.integer) else key
