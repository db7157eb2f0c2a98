"""The manager decides; it never moves a byte.

It owns the block index, one free list, eviction policy and admission rule per tier, and the
watermarks. Every public verb returns a plan (plain data: which slot of which tier to write, read
or move); the transfer engine executes plans and the runtime reports back through the matching
`complete_*` verb. Blocks in flight are explicit in the index (`WRITING`, `readers`), so what is
being written is never served and what is being read is never evicted.

`store_now` and `load_now` are the same verbs for a caller whose transfers all succeed at once
(the trace simulator): the same decision code runs, and the moves it starts are completed inside
the call, in the order a transfer engine completing each batch at once would complete them.

Blocks are integer ids into the index's columns (`kvtier.deciding.index`), and policies track slots: with
millions of blocks indexed nothing per block is an object the garbage collector walks
(bench/bench_manager.py measures the pause). A policy that must know block keys (ghost lists,
Belady's future) is handed them through `_KeyedPolicy`.

Not thread-safe: the runtime serialises calls under one lock.

Size (over STYLE's ~400 lines, on purpose): the manager is one state machine over one index, and
its per-block paths (evict, demote, release) are inlined into each other because a replay runs
them a few million times (bench/bench_simulate.py). Spreading the class over modules would
scatter the invariants those paths keep in step (`_outgoing`, free lists, owners, `ready`)
without making any of them smaller; the hypothesis state machine (tests/test_manager.py) and the
two-path equivalence test (tests/simulate/test_simulate_fastpath.py) guard them instead.
"""

from __future__ import annotations

import functools
import itertools
import math
from array import array
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence

from kvtier._keytable import ResidentPath
from kvtier.errors import ConfigError, KVTierError
from kvtier.deciding.index import FREE, FREEING, NO_TIER, READY, WRITING, BlockIndex, SlotAllocator
from kvtier.deciding.plans import (Fallback, LoadPlan, LoadSource, Move, MoveReason, Placement, StoreOutcome, StorePlan,
                          TierSlots)
from kvtier.deciding.residency import REMOVED as _REMOVED, STORED as _STORED, ResidencyLog
from kvtier.policy.admission import AdmissionKind
from kvtier.deciding.retention import DoomedQueues, HintBook, HintError, HintLimits, check_hint
from kvtier.policy.base import EvictionPolicy, HintKind
from kvtier.policy.lru import SlotLRUPolicy
from kvtier.observing.stats import DropReason, Stats
from kvtier.kinds import CacheMode, TierKind

# Module constants for the per-block hot paths: a class attribute lookup on an Enum costs ~50 ns,
# a global ~5 ns, and a store or load runs several per block (bench/bench_simulate.py).
_ADMIT_ALL = AdmissionKind.ALL
_EXCLUSIVE = CacheMode.EXCLUSIVE
_DEMOTE, _PREFETCH = MoveReason.DEMOTE, MoveReason.PREFETCH
_EVICTED = DropReason.EVICTED
_KINDS = tuple(TierKind)  # a tier's number -> its TierKind


def _always(key: Hashable) -> bool:
    return True


class _KeyedPolicy:
    """Hands a policy that tracks block keys the manager's slot numbers, translated both ways.

    kvtier's LRU tracks slots (`tracks_slots`); ARC and S3-FIFO keep ghost lists of keys no longer
    resident, and Belady's MIN looks keys up in the future, so they see keys exactly as before.
    `protected` (the manager's rule, asked of keys: see `TierManager._protected_in`) is given once
    here, so that its check per candidate is one call, as it is for a policy of slots.
    """

    __slots__ = ("policy", "_key_of", "_ids", "_slot", "_owner", "_by_key", "_insert", "_touch", "_remove",
                 "_evict_one")

    def __init__(self, policy: EvictionPolicy, index: BlockIndex, tier: TierKind,
                 protected: Callable[[Hashable], bool]) -> None:
        self.policy = policy
        self._key_of, self._ids = index.key_of, index.ids
        self._slot, self._owner = index.slot[tier], index.owner[tier]
        self._by_key = protected
        self._insert, self._touch, self._remove = policy.insert, policy.touch, policy.remove
        self._evict_one = functools.partial(policy.evict_one, protected)

    def insert(self, slot: int) -> None:
        self._insert(self._key_of(self._owner[slot]))

    def touch(self, slot: int) -> None:
        self._touch(self._key_of(self._owner[slot]))

    def remove(self, slot: int) -> None:
        self._remove(self._key_of(self._owner[slot]))

    def evict(self, n: int) -> list[int] | None:
        """The slots of `n` victims (see `EvictionPolicy.evict`), or None."""
        victims = self.policy.evict(n, self._by_key)
        if victims is None:
            return None
        ids, slots = self._ids, self._slot
        return [slots[ids[key]] for key in victims]

    def evict_one(self) -> int | None:
        """The slot of one victim, or None."""
        key = self._evict_one()
        return None if key is None else self._slot[self._ids[key]]

    def __len__(self) -> int:
        return len(self.policy)


class TierManager:
    """Block index, placement, eviction and movement decisions for up to four tiers.

    Args:
        tiers: the tiers present, any order; at most one per kind.
        mode: exclusive (one copy per block) or inclusive (stores write through to lower tiers).
        promote_to: a load served from below this tier also promotes the block into it.
        stats: counters to update.
    Raises:
        ConfigError: duplicate tiers, no tiers, or a bad watermark pair.
    """

    # Retention hints (`apply_hint`), off until the first hint: then `_start_hints` sets these.
    _hint_limits = HintLimits()
    _hints: HintBook | None = None

    def __init__(self, tiers: Sequence[TierSlots], *, mode: CacheMode = CacheMode.EXCLUSIVE,
                 promote_to: TierKind | None = TierKind.DRAM, stats: Stats | None = None) -> None:
        kinds = [t.kind for t in tiers]
        if not tiers or len(set(kinds)) != len(kinds):
            raise ConfigError(f"tiers: need one or more distinct tiers, got {[k.name for k in kinds]}")
        self._tiers = {t.kind: t for t in sorted(tiers, key=lambda t: t.kind)}
        for t in tiers:
            if not 0 < t.low_watermark <= t.high_watermark <= 1:
                raise ConfigError(f"tiers.{t.kind.name.lower()}: need 0 < low_watermark <= high_watermark <= 1")
        self.order = tuple(self._tiers)
        self._last = self.order[-1]
        self.mode = mode
        self.promote_to = promote_to if promote_to in self._tiers else None
        self.stats = stats or Stats()
        self._slots = {k: SlotAllocator(k, t.num_slots) for k, t in self._tiers.items()}
        index = self.index = BlockIndex({k: t.num_slots for k, t in self._tiers.items()})
        # The index's columns, bound once (see kvtier.deciding.index): lists indexed by tier, arrays by block
        # id or slot. Blocks are ids everywhere below; a key is looked up once per call.
        self._ids, self._key_of, self._checksums = index.ids, index.key_of, index.checksums
        self._slot, self._owner, self._state, self._readers = index.slot, index.owner, index.state, index.readers
        self._pins, self._hits, self._ready, self._prefetched = index.pins, index.hits, index.ready, index.prefetched
        self._num_copies = index.num_copies
        self._moves: dict[int, Move] = {}
        self._inbound: dict[Hashable, Move] = {}  # key -> promotion/prefetch in flight
        self._outgoing = dict.fromkeys(self._tiers, 0)  # demotions in flight, per source tier
        self._new_moves: list[Move] = []
        # Moves started under `store_now` / `load_now`, to complete there: (block, src, dst, the
        # Move, or None for a demotion: see `_evict`); None outside those verbs.
        self._queue: list[tuple[int, TierKind, TierKind, Move | None]] | None = None
        self._over_high = True  # see `_rebalance` and `_complete_queued`
        self._ids_made = itertools.count(1)
        self._joined: set[int] = set()  # prefetch moves a load has joined while in flight
        self._down: frozenset[TierKind] = frozenset()  # tiers out of the cascade (see `set_available`)
        self._derive_cascade()
        self._admits_all = {k: t.admission.kind is _ADMIT_ALL for k, t in self._tiers.items()}
        # Per tier, the stores that place a copy there too (`TierSlots.write_through`); inclusive: all.
        self._write_through = {k: t.write_through if mode is _EXCLUSIVE else _always
                               for k, t in self._tiers.items() if t.write_through or mode is not _EXCLUSIVE}
        self._free_lists = {k: s.free for k, s in self._slots.items()}  # see SlotAllocator
        self._may_drop = frozenset(k for k, t in self._tiers.items() if t.may_drop)
        # Per tier, the policy as the manager calls it, with slot numbers (see `_KeyedPolicy`), and
        # its victims as the manager asks for them: `_victim[tier]()`, one victim's slot or None
        # (once per block stored into a full tier), `_victims[tier](n)`, n slots or None. Each with
        # the tier's `protected` rule, built once.
        self._policies, self._victim, self._victims = {}, {}, {}
        for k, t in self._tiers.items():
            if getattr(t.policy, "tracks_slots", False):
                policy, protected = t.policy, self._protected_in(k)
                self._victim[k] = functools.partial(policy.evict_one, protected)
                self._victims[k] = functools.partial(policy.evict, protected=protected)
            else:
                policy = _KeyedPolicy(t.policy, index, k, self._protected_in(k, by_key=True))
                self._victim[k], self._victims[k] = policy.evict_one, policy.evict
            self._policies[k] = policy
        # The chain-aware policies' `order_chain` (see `order_chain`); they are told keys, not slots.
        self._order_chain = tuple(t.policy.order_chain for t in self._tiers.values()
                                  if getattr(t.policy, "chain_aware", False))
        # Per tier number, its policy's `touch` (`touch` reads tier numbers out of the index's columns).
        self._touch_at = [self._policies[k].touch if k in self._policies else None for k in _KINDS]
        # Batches that stay in one memory tier, one C call per verb (see `lease_resident`): the
        # tiers whose slots are memory the caller's buffers are copied to and from directly (the
        # runtime says which: `serve_resident`), and of those, the ones a load may be served from
        # and a store written into that way (`_derive_resident`).
        self._resident = ResidentPath(index.ids, index.ready, index.hits, index.prefetched, index.pins,
                                      index.num_copies, index.slot, index.owner, index.state, index.readers,
                                      [self._policies.get(k) for k in _KINDS])
        self._memory_tiers: frozenset[TierKind] = frozenset()
        self._derive_resident()
        self._residency: ResidencyLog | None = None  # see `log_residency`

    def log_residency(self, log: ResidencyLog | None) -> None:
        """Logs every copy that becomes READY or leaves READY, below HBM, into `log` (None: stop).

        The points are `_make_ready`, `_finish_demotion`'s inlined path, `_retire_unlisted` (a READY
        copy only: a failed write was never servable), `adopt*` and the resident verbs' C paths
        (logged here from their results). Off, each costs one `is not None` test."""
        self._residency = log

    def _derive_cascade(self) -> None:
        """The per-tier tables that follow from the order and the tiers out of service."""
        down = self._down
        self._up = tuple(k for k in self.order if k not in down)
        # Per tier, the tiers a victim of it may go to: those below it that are in service.
        self._below = {k: tuple(t for t in self.order[i + 1:] if t not in down) for i, k in enumerate(self.order)}
        self._promote_now = self.promote_to if self.promote_to not in down else None
        # Tiers that can pass their high watermark; one at 1.0 never does (used <= num_slots), and
        # `_rebalance` runs after every completion; a tier out of service is left as it is, and so
        # is the last tier in service: with nowhere to demote to, draining it to its low watermark
        # would only drop blocks it has room for (it evicts on demand, as the simulator models it).
        # Each with its free list and its high mark in slots, so that the check is a few reads.
        self._watermarked = tuple((k, t, self._slots[k].free, t.high_watermark * t.num_slots)
                                  for k, t in self._tiers.items()
                                  if t.high_watermark < 1 and k not in down and self._below[k])

    def _derive_resident(self) -> None:
        """Which memory tiers a load may be served from in one call (`lease_resident`: the tier's
        policy is kvtier's slot LRU, which the C verbs update, and no promotion out of it is due),
        and which a store may be written into that way (`place_resident`: also, the tier takes
        every block and keeps it, and no store writes a second copy anywhere)."""
        lru = {k for k in self._memory_tiers if type(self._policies[k]) is SlotLRUPolicy}
        up = self._promote_now
        loads = bytearray(len(_KINDS))
        for k in lru:
            loads[k] = up is None or k <= up
        self._resident_loads = bytes(loads)
        single = self.mode is _EXCLUSIVE and not self._write_through
        self._resident_stores = frozenset(k for k in lru if single and self._admits_all[k] and k not in self._may_drop)

    def serve_resident(self, tiers: Collection[TierKind]) -> None:
        """Names the tiers whose slots are memory that batches are copied to and from in one
        native call (`lease_resident`, `place_resident`); the runtime's to say, once."""
        self._memory_tiers = frozenset(t for t in tiers if t in self._tiers)
        self._derive_resident()

    # ---- tiers in and out of service -----------------------------------------------------

    def set_available(self, tier: TierKind, available: bool) -> tuple[Move, ...]:
        """Takes `tier` out of the cascade (False) or puts it back (True).

        A tier out of service (a pool node that does not answer, a disk that failed) gets no new
        block: stores, demotions, promotions and prefetches go to the other tiers, in order. Its
        blocks stay indexed, since the tier may come back with them, but are not served: `lookup`
        and `prepare_load` see only copies in tiers in service. Returns the demotions that putting
        a tier back made possible.

        Raises:
            KVTierError: `tier` is not configured.
        """
        if tier not in self._tiers:
            raise KVTierError(f"tier {tier.name} is not configured")
        self._down = self._down - {tier} if available else self._down | {tier}
        self._derive_cascade()
        self._derive_resident()
        self._rebalance()
        return self._drain()

    @property
    def unavailable(self) -> frozenset[TierKind]:
        """The tiers out of the cascade now."""
        return self._down

    def held_elsewhere(self, key: Hashable, tiers: Collection[TierKind]) -> bool:
        """Whether `key` has a live copy (READY or WRITING) outside `tiers`."""
        block = self._ids.get(key)
        if block is None:
            return False
        for t in self.order:
            slot = self._slot[t][block]
            if slot >= 0 and t not in tiers and self._state[t][slot] != FREEING:
                return True
        return False

    def below(self, tier: TierKind) -> tuple[TierKind, ...]:
        """The tiers in service below `tier`, in order: where its victims and failed writes go."""
        return self._below[tier]

    # ---- queries -------------------------------------------------------------------------

    def lookup(self, keys: Iterable[Hashable]) -> int:
        """Length of the longest prefix of `keys` whose blocks are READY in some tier."""
        n = 0
        get, ready, down = self._ids.get, self._ready, self._down
        for key in keys:
            block = get(key)
            if block is None:
                break
            tier = ready[block]
            if tier == NO_TIER or (down and tier in down and self._serving(block) is None):
                break
            n += 1
        return n

    def serving_tiers(self, keys: Iterable[Hashable]) -> list[TierKind]:
        """The tier that would serve each block of the longest READY prefix of `keys` (as `lookup`)."""
        tiers = []
        get = self._ids.get
        for key in keys:
            block = get(key)
            tier = self._serving(block) if block is not None else None
            if tier is None:
                break
            tiers.append(tier)
        return tiers

    def held_here(self, keys: Iterable[Hashable]) -> list[TierKind | bool | None]:
        """Per key, up to the first that is indexed but cannot be served now (being stored, or
        only in a tier that is down), which is None and ends the list: the tier that serves it
        now (as `lookup`), or False where it is not indexed at all (what a shared tier may hold
        from another process). Compare with `is`: `TierKind.HBM` is 0."""
        out: list[TierKind | bool | None] = []
        get = self._ids.get
        for key in keys:
            block = get(key)
            if block is None:
                out.append(False)
                continue
            tier = self._serving(block)
            out.append(tier)
            if tier is None:
                break
        return out

    def forget_shared(self, tier: TierKind, keys: Iterable[Hashable]) -> int:
        """Drops the copies of `keys` in shared tier `tier` that the tier said it no longer holds
        (its node evicted them under other clients' pressure, restarted, or does not answer):
        a block found again later is adopted afresh. Returns how many copies were dropped; a
        block left with no copy is counted under `DropReason.SHARED_GONE`."""
        if tier not in self._tiers:
            return 0
        dropped = 0
        get, slots, state = self._ids.get, self._slot[tier], self._state[tier]
        for key in keys:
            block = get(key)
            if block is not None and slots[block] >= 0 and state[slots[block]] == READY:
                self._retire(block, tier, DropReason.SHARED_GONE)
                dropped += 1
        return dropped

    def _serving(self, block: int) -> TierKind | None:
        """The fastest READY copy of `block` in a tier in service (its `ready` tier when none is down)."""
        tier = self._ready[block]
        if tier == NO_TIER:
            return None
        down = self._down
        if not down or tier not in down:
            return _KINDS[tier]
        for t in self.order:  # fastest first
            slot = self._slot[t][block]
            if slot >= 0 and t not in down and self._state[t][slot] == READY:
                return t
        return None

    def where(self, key: Hashable) -> TierKind | None:
        """The fastest tier holding a READY copy of `key`, or None."""
        block = self._ids.get(key)
        tier = self._ready[block] if block is not None else NO_TIER
        return None if tier == NO_TIER else _KINDS[tier]

    def touch(self, keys: Iterable[Hashable]) -> None:
        """Marks `keys` as just used in the tier that would serve them."""
        get, ready, slots, touch_at, down = self._ids.get, self._ready, self._slot, self._touch_at, self._down
        for key in keys:
            block = get(key)
            if block is None:
                continue
            tier = ready[block]  # `_serving(block)`, inlined where no tier is down
            if tier == NO_TIER:
                continue
            if down and tier in down:
                tier = self._serving(block)
                if tier is None:
                    continue
            touch_at[tier](slots[tier][block])

    def order_chain(self, keys: Sequence[Hashable], *, partial_tail: bool = False) -> None:
        """Tells the chain-aware policies (`chain_aware`) one request's blocks in prefix order.

        Call it once a request's load and store are done, with all its keys, head first; each such
        tier's policy re-ranks the keys it holds (see `kvtier.policy.chain`). Other policies are not
        called: for them this is a no-op. It decides nothing by itself and moves nothing.

        Args:
            keys: the request's block keys, head first.
            partial_tail: the last key names a block only partly filled with tokens.
        """
        for order_chain in self._order_chain:
            order_chain(keys, partial_tail)

    # ---- retention hints (see kvtier.deciding.retention) ----------------------------------

    def configure_hints(self, limits: HintLimits) -> None:
        """Sets the hints' bounds and budgets; before the first `apply_hint` (KVTierError after)."""
        if self._hints is not None:
            raise KVTierError("configure_hints: hints were already applied with the limits in force")
        self._hint_limits = limits

    def apply_hint(self, keys: Iterable[Hashable], *, now: float, session: str | None = None,
                   retain_s: float | None = None, closed: bool = False, tenant: str = "") -> None:
        """Applies one request's hint to its block keys (all of them, head first), after its store.

        A hint with no session marks the keys as used by unhinted traffic (never doomed by a
        close). Until the first call the manager behaves exactly as without hints; from then on
        its victims are chosen as `kvtier.deciding.retention` describes, and `place_resident`
        declines (its C eviction does not see hints). Counts go to `stats.hints`.

        Args:
            keys: the request's block keys.
            now: the caller's clock, seconds (trace time in the simulator); it never goes back.
            session: the request's conversation.
            retain_s: keep the blocks for this long, in the last tier, within the tenant's budget.
            closed: the session ended with this request.
            tenant: whose retention budget `retain_s` is charged to.
        Raises:
            HintError: a field is out of range (`reason` says which); counted, nothing changed.
        """
        try:
            check_hint(session, retain_s, closed, self._hint_limits)
            if isinstance(now, bool) or not isinstance(now, (int, float)) or not math.isfinite(now):
                raise HintError("bad_now", f"now must be a finite number of seconds, got {now!r}")
        except HintError as e:
            self.stats.hints[f"refused:{e.reason}"] += 1
            raise
        book = self._hints if self._hints is not None else self._start_hints()
        keys = list(keys)
        for key in book.advance(now):
            if key in self._held:
                self._release_held(key, self._held.pop(key))
        book.use(keys, session)
        if retain_s is not None:  # blocks stored (or being stored) only: a budget is not spent on misses
            book.retain([key for key in keys if key in self._ids], retain_s, tenant)
        if closed:
            for key in book.close(session):
                book.release(key)  # its retention ends with the sessions that asked for it
                if key in self._held:
                    self._release_held(key, self._held.pop(key))
                self._doom(key)
        self.stats.hints["applied"] += 1
        book.prune(self._ids.__contains__, 4 * self.index.capacity)

    def hinted_copies(self, tier: TierKind, keys: Iterable[Hashable]) -> tuple[list[Hashable], list[Hashable]]:
        """Of `keys`, those with a copy in `tier` that are retained now, and those doomed now (what
        a shared tier passes on to its store); ([], []) before the first hint."""
        if self._hints is None:
            return [], []
        book, slots, get = self._hints, self._slot[tier], self._ids.get
        retained, doomed = [], []
        for key in keys:
            block = get(key)
            if block is None or slots[block] < 0:
                continue
            if book.retained(key):
                retained.append(key)
            elif book.doomed(key):
                doomed.append(key)
        return retained, doomed

    def num_retained(self, tenant: str | None = None) -> int:
        """Keys under a retention hint now, `tenant`'s or everyone's."""
        return self._hints.num_retained(tenant) if self._hints is not None else 0

    def _start_hints(self) -> HintBook:
        """Turns hints on: the book, the doomed queues, and every tier's victims rebound to use them."""
        book = self._hints = HintBook(self._hint_limits, self._slots[self._last].num_slots, self.stats.hints)
        self._held: dict[Hashable, TierKind] = {}  # retained keys set aside out of their tier's policy
        self._doomed = DoomedQueues(book, self.order)
        self._notes = {k: t.policy.note_hint for k, t in self._tiers.items() if getattr(t.policy, "notes_hints", False)}
        for tier in self.order:
            self._bind_hinted_victims(tier)
        return book

    def _release_held(self, key: Hashable, tier: TierKind) -> None:
        """A retained block set aside in `tier` whose deadline lapsed goes back into the policy,
        as a newcomer, where its copy is still READY there (it may have been promoted or dropped)."""
        block = self._ids.get(key)
        slot = self._slot[tier][block] if block is not None else -1
        if slot < 0 or self._state[tier][slot] != READY:
            return
        policy = self._tiers[tier].policy
        if (slot if getattr(policy, "tracks_slots", False) else key) not in policy:
            self._policies[tier].insert(slot)

    def _doom(self, key: Hashable) -> None:
        """Queues doomed `key` in each tier holding a copy, and tells the policies that note hints."""
        block = self._ids.get(key)
        if block is None:
            return
        for tier in self.order:
            if self._slot[tier][block] >= 0:
                self._doomed.push(tier, key)
                note = self._notes.get(tier)
                if note is not None:
                    note(key, HintKind.CLOSED)

    def _bind_hinted_victims(self, tier: TierKind) -> None:
        """`_victim[tier]` and `_victims[tier]` with hints: a doomed block first; and while `tier`
        is the last in service, a retained block the policy meets as a candidate is protected,
        then, once the policy's call returns, set aside (`_set_aside`). `_victims` declines (None)
        while doomed keys are queued, so that `_rebalance` takes them one at a time."""
        policy, retained = self._tiers[tier].policy, self._hints.retained
        key_of, owners, base, aside = self._key_of, self._owner[tier], self._protected_in(tier), []

        def guard(slot: int) -> bool:
            return base(slot) or (not self._below[tier] and retained(key_of(owners[slot])))

        def guard_aside(slot: int) -> bool:  # `guard`, noting the retained slots it protects
            if base(slot):
                return True
            if self._below[tier] or not retained(key_of(owners[slot])):
                return False
            aside.append(slot)
            return True

        if getattr(policy, "tracks_slots", False):
            first, several = functools.partial(policy.evict_one, guard_aside), functools.partial(policy.evict,
                                                                                                protected=guard_aside)
        else:
            ids, slots = self._ids, self._slot[tier]
            keyed = _KeyedPolicy(policy, self.index, tier, lambda key: guard_aside(slots[ids[key]])
                                 if key in ids and slots[ids[key]] >= 0 else True)
            first, several = keyed.evict_one, keyed.evict
        doomed, queue = self._doomed_victim(tier, guard), self._doomed.queues[tier]

        def victim() -> int | None:
            if queue:
                slot = doomed()
                if slot is not None:
                    return slot
            slot = first()
            if aside:
                self._set_aside(tier, aside)
            return slot

        def victims(n: int) -> list[int] | None:
            if queue:
                return None
            chosen = several(n)
            if aside:
                self._set_aside(tier, aside)
            return chosen

        self._victim[tier], self._victims[tier] = victim, victims

    def _set_aside(self, tier: TierKind, slots: list[int]) -> None:
        """Takes the retained blocks in `slots` of `tier` out of its policy (READY, kept, as a
        pinned block is) until their deadlines lapse (`_release_held`); empties `slots`.

        Protecting them where they stand instead would leave them at the policy's old end, each
        stepped over by every later eviction: a replay with a 300 s ttl ran ~30 times slower so.
        They leave with `remove`, not as victims: a policy with ghost lists does not remember them."""
        remove, owners = self._policies[tier].remove, self._owner[tier]
        for slot in dict.fromkeys(slots):  # a policy may ask of one candidate twice
            self._held[self._key_of(owners[slot])] = tier
            remove(slot)
        slots.clear()

    def _doomed_victim(self, tier: TierKind, guard: Callable[[int], bool]) -> Callable[[], int | None]:
        """The slot of `tier`'s first queued doomed block that `guard` does not protect (taken
        out of the policy and queued in the tiers below, where it is demoted next), or None. A
        doomed block still being written into `tier` keeps its place in the queue."""
        ids, slots, state, owners = self._ids, self._slot[tier], self._state[tier], self._owner[tier]

        def usable(key: Hashable) -> int | None:
            block = ids.get(key)
            slot = slots[block] if block is not None else -1
            return slot if slot >= 0 and not guard(slot) else None

        def pending(key: Hashable) -> bool:
            block = ids.get(key)
            slot = slots[block] if block is not None else -1
            return slot >= 0 and state[slot] == WRITING

        def victim() -> int | None:
            slot = self._doomed.pop(tier, usable, pending)
            if slot is not None:
                self._policies[tier].remove(slot)
                for lower in self._below[tier]:
                    self._doomed.push(lower, self._key_of(owners[slot]))
                self.stats.hints["doomed_evicted"] += 1
            return slot
        return victim

    def num_used(self, tier: TierKind) -> int:
        return self._slots[tier].num_used

    def num_slots(self, tier: TierKind) -> int:
        return self._slots[tier].num_slots

    def owner(self, tier: TierKind, slot: int) -> Hashable | None:
        """The key whose copy occupies `slot` of `tier`, or None if the slot is free."""
        owners = self._owner[tier]
        block = owners[slot] if 0 <= slot < len(owners) else -1
        return self._key_of(block) if block >= 0 else None

    def moves_in_flight(self) -> list[Move]:
        return list(self._moves.values())

    def cancellable(self, moves: Iterable[Move]) -> list[Hashable]:
        """The keys of the prefetches among `moves` that a cancel may still stop: in flight, and
        joined by no load (a load reading the copy on its way up holds its destination)."""
        keys = []
        for m in moves:
            if m.reason is _PREFETCH and m.id in self._moves and self._readers[m.dst][m.dst_slot] == 0:
                keys.append(m.key)
        return keys

    def adopt(self, tier: TierKind, blocks: Iterable[tuple[Hashable, int, tuple[int, ...]]]) -> int:
        """Registers blocks already stored in `tier` (found on disk at start-up) as READY.

        Args:
            blocks: (key, slot, per-layer checksums); a key seen twice keeps its first slot.
        Returns:
            How many were adopted. Call before any store.
        """
        taken: set[int] = set()
        num_slots, owners = self._slots[tier].num_slots, self._owner[tier]
        for key, slot, checksums in blocks:
            if key in self._ids or slot in taken or not 0 <= slot < num_slots or owners[slot] >= 0:
                continue
            block = self.index.add(key)
            self._claim(block, tier, slot)
            self._state[tier][slot] = READY
            self._refresh(block)
            self._checksums[block] = tuple(checksums)
            self._policies[tier].insert(slot)
            if self._residency is not None:
                self._residency.append(_STORED, tier, key)
            taken.add(slot)
        self._slots[tier].take(taken)
        return len(taken)

    def adopt_shared(self, tier: TierKind, keys: Iterable[Hashable]) -> tuple[list[tuple[Hashable, int]], tuple[Move, ...]]:
        """Registers blocks that another process stored in a shared tier (the pool) as READY here.

        Takes `keys` in order (the leading run of a lookup's misses that the tier reported holding)
        and stops at the first that cannot be adopted: one already indexed but not ready, or no
        slot to be had in `tier` (a slot here is this process's share of the tier, so a full tier
        evicts its least recent block as a store would). The blocks carry no checksums: the tier
        checks what it reads itself (`Tier.checks_reads`). Returns the (key, slot) pairs adopted and
        the demotions that making room started.

        Raises:
            KVTierError: `tier` is not configured.
        """
        if tier not in self._tiers:
            raise KVTierError(f"tier {tier.name} is not configured")
        adopted: list[tuple[Hashable, int]] = []
        if tier in self._down:
            return adopted, ()
        for key in keys:
            if key in self._ids:
                break
            slot = self._take_slot(tier, False, 0)
            if slot is None:
                break
            block = self.index.add(key)
            self._claim(block, tier, slot)
            self._state[tier][slot] = READY
            self._refresh(block)
            self._policies[tier].insert(slot)
            if self._residency is not None:
                self._residency.append(_STORED, tier, key)
            adopted.append((key, slot))
        self.stats.count_shared({"adopted": len(adopted)})
        return adopted, self._drain()

    # ---- pins ----------------------------------------------------------------------------

    def pin(self, keys: Iterable[Hashable]) -> list[Hashable]:
        """Protects stored `keys` from eviction in every tier, one pin each.

        Returns the keys pinned, in order; a key that is not stored is skipped. Pins count:
        each needs its own `unpin`, and a block dropped anyway (a failed read of its last copy)
        loses its pins with it.
        """
        pinned = []
        get, pins = self._ids.get, self._pins
        for key in keys:
            block = get(key)
            if block is not None and self._live(block):
                pins[block] += 1
                pinned.append(key)
        return pinned

    def unpin(self, keys: Iterable[Hashable]) -> tuple[list[Hashable], tuple[Move, ...]]:
        """Undoes one `pin` of each key, the mirror of `pin`: a key holding no pin (never pinned,
        already unpinned, or dropped with its pins) is skipped.

        Returns:
            The keys unpinned, in order, and the demotions that are now possible.
        """
        unpinned = []
        get, pins = self._ids.get, self._pins
        for key in keys:
            block = get(key)
            if block is not None and pins[block]:
                pins[block] -= 1
                unpinned.append(key)
        self._rebalance()
        return unpinned, self._drain()

    # ---- store ---------------------------------------------------------------------------

    def prepare_store(self, keys: Iterable[Hashable], target: TierKind | None = None) -> StorePlan:
        """Chooses where new blocks go: `target` (default the top tier) or, if full, the next below.

        Inclusive mode (and a tier's `write_through`) adds a further copy in every lower tier that
        admits the block: the plan's `through`, one plan per tier, each finished apart.
        """
        placed, present, rejected = self._place(keys, target)
        chosen = tuple([Placement(key, tier, slot) for _, tier, slot, key in placed])
        first: list[Placement] = []
        more: dict[TierKind, list[Placement]] = {}
        seen: set[Hashable] = set()
        for p in chosen:
            if p.key in seen:
                more.setdefault(p.tier, []).append(p)
            else:
                first.append(p)
                seen.add(p.key)
        if not more:
            return StorePlan(chosen, tuple(present), tuple(rejected), self._drain())
        through = tuple(StorePlan(tuple(ps), (), (), ()) for _, ps in sorted(more.items()))
        return StorePlan(tuple(first), tuple(present), tuple(rejected), self._drain(), through, chosen)

    def _place(self, keys: Iterable[Hashable], target: TierKind | None) -> tuple[list, list, list]:
        """`prepare_store`'s decisions: the (block, tier, slot, key) claimed, the keys present, those rejected."""
        start = self.order.index(target) if target is not None else 0
        placed: list[tuple[int, TierKind, int, Hashable]] = []
        present: list[Hashable] = []
        rejected: list[Hashable] = []
        get = self._ids.get
        tiers = self.order[start:] if not self._down else [t for t in self.order[start:] if t not in self._down]
        for key in keys:
            block = get(key)
            if block is not None and self._live(block):
                present.append(key)
                continue
            if not self._place_new(key, tiers, block, placed):
                rejected.append(key)
                self.stats.dropped[DropReason.NO_SPACE] += 1
        return placed, present, rejected

    def complete_store(self, plan: StorePlan, failed: Iterable[tuple[Hashable, TierKind]] = (),
                       checksums: dict[Hashable, tuple[int, ...]] | None = None,
                       retrying: Collection[Hashable] = ()) -> tuple[Move, ...]:
        """Applies a finished store: written copies become READY, failed ones are freed. Every
        copy of the plan, its write-through ones included (a caller that writes them apart
        completes each group apart: `StorePlan.first_copies`, `StorePlan.through`).

        Args:
            failed: the (key, tier) placements whose write failed.
            checksums: per-layer checksums of the blocks written.
            retrying: keys of failed placements the caller stores again further down
                (`prepare_store` with a lower target): a failed copy of theirs that was their
                last is not counted as dropped, since the retry counts its own outcome.
        Returns the demotions this triggered.
        """
        failed = set(failed)
        ids, stores, known = self._ids, self.stats.stores, self._checksums
        for p in plan.all_placements:
            block = ids[p.key]
            if failed and (p.key, p.tier) in failed:
                self.stats.io_errors += 1
                self._retire_unlisted(block, p.tier, None if p.key in retrying else DropReason.STORE_FAILED)
                continue
            self._make_ready(block, p.tier)
            stores[p.tier] += 1
            if checksums and p.key in checksums and block not in known:
                known[block] = checksums[p.key]
        self._rebalance()
        return self._drain()

    def finish_store(self, plan: StorePlan, failed: Iterable[tuple[Hashable, TierKind]] = (),
                     checksums: dict[Hashable, tuple[int, ...]] | None = None) -> StoreOutcome:
        """`complete_store`, and the retry of what failed: a block whose write failed in a tier,
        with no other copy, is planned again in the next tier in service below that one (a tier
        that failed as a whole has left the cascade by then), so that a drop is counted only when
        no tier below could take it. `plan` is one group of copies (the plan's first copies, or
        one of its `through` plans, or a retry), whose copies were all written: its `through`
        plans, if any, are finished apart (pass `plan.first_copies()` then each of them)."""
        failed = list(failed)
        failed_in: dict[Hashable, list[TierKind]] = {}
        for key, tier in failed:
            failed_in.setdefault(key, []).append(tier)
        again = {key: tiers[0] for key, tiers in failed_in.items()
                 if self.below(tiers[0]) and not self.held_elsewhere(key, tiers)}
        moves = self.complete_store(plan, failed, checksums, retrying=again)
        if not again:
            return StoreOutcome(moves)
        by_target: dict[TierKind, list[Hashable]] = {}
        for key, tier in again.items():
            by_target.setdefault(self.below(tier)[0], []).append(key)
        placements: list[Placement] = []
        present: list[Hashable] = []
        rejected: list[Hashable] = []
        for target, keys in by_target.items():
            retry = self.prepare_store(keys, target)
            placements += retry.all_placements
            present += retry.present
            rejected += retry.rejected
            moves += retry.moves
        self.stats.store_retries += len(placements)
        retry = StorePlan(tuple(placements), (), tuple(rejected), ()) if placements or rejected else None
        return StoreOutcome(moves, retry, tuple(present))

    # ---- load ----------------------------------------------------------------------------

    def prepare_load(self, keys: Iterable[Hashable]) -> LoadPlan:
        """Where to read each block from. Leases the source copies until `complete_load`.

        A block below `promote_to` is promoted there, and read from the promoted copy once the
        move lands; a block already on its way up (promotion or prefetch) joins that move instead
        of issuing a second read.
        """
        leased: list[tuple[int, TierKind, Hashable]] = []
        missing: list[Hashable] = []
        get, ready, slots, readers = self._ids.get, self._ready, self._slot, self._readers
        for key in keys:  # lease every source first: promoting one block must not evict another
            block = get(key)
            tier = ready[block] if block is not None else NO_TIER
            if tier != NO_TIER:
                tier = _KINDS[tier] if not self._down else self._serving(block)
            else:
                tier = None
            if tier is None:
                missing.append(key)
                self.stats.misses += 1
                continue
            readers[tier][slots[tier][block]] += 1
            leased.append((block, tier, key))
        sources = tuple([self._load_source(block, tier, key) for block, tier, key in leased])
        return LoadPlan(sources, tuple(missing), self._drain())

    def complete_load(self, plan: LoadPlan, failed: dict[Hashable, str] | None = None) -> tuple[Move, ...]:
        """Releases a load's leases. `failed` maps keys whose read from their source failed to a
        `DropReason` (whether or not their fallback then delivered them).

        A copy that failed its checksum or could not be read is discarded (a counted drop if it
        was the last copy); the caller treats the blocks that no copy delivered as misses.
        """
        failed = failed or {}
        get, slots, readers = self._ids.get, self._slot, self._readers
        for src in plan.sources:
            block = get(src.key)
            tier = src.tier
            if src.fallback is not None and block is not None:
                self._end_fallback(block, src.fallback)
            if block is None or slots[tier][block] != src.slot:
                continue  # the copy was already discarded by a failed move it had joined
            readers[tier][src.slot] -= 1
            reason = failed.get(src.key) if failed else None
            if reason in (DropReason.CHECKSUM, DropReason.READ_FAILED):
                self._count_bad_read(reason)
                self._retire(block, tier, reason)
            else:
                self._free_if_unread(block, tier)
        self._rebalance()
        return self._drain()

    # ---- batches that stay in one memory tier ----------------------------------------------

    def lease_resident(self, keys: Sequence[Hashable], slots: array) -> TierKind | None:
        """`prepare_load` for the commonest load, in one C call: every block READY in one memory
        tier that `_derive_resident` allows, no tier out of service, no promotion or prefetch in
        flight (a load would join it), none of the blocks prefetched and not loaded since. Then
        the plan would be one read per block from its slot, leased until `end_resident`: this
        leases the same slots (into `slots`, one per key), counts the hits and touches the LRU.
        None: nothing changed, take `prepare_load`."""
        if self._down or self._inbound or self._queue is not None:
            return None
        tier = self._resident.lease(keys, self._resident_loads, slots)
        if tier < 0:
            return None
        kind = _KINDS[tier]
        self.stats.hits[kind] += len(keys)
        return kind

    def end_resident(self, tier: TierKind, slots: array) -> tuple[Move, ...]:
        """`complete_load` for `lease_resident`'s leases (reads from memory do not fail)."""
        for slot in self._resident.release(tier, slots):  # evicted while read: freed now
            self._free(self._owner[tier][slot], tier, slot)
        self._rebalance()
        return self._drain()

    def place_resident(self, keys: Sequence[Hashable], target: TierKind | None = None
                       ) -> tuple[TierKind, array, array] | None:
        """`prepare_store` for the commonest store, in a few C calls: every key new, into one
        memory tier that `_derive_resident` allows (`target`, default the top tier) with no tier
        out of service, which has a free slot for each or else nothing below it (its oldest
        unprotected blocks are then dropped, as `_evict` drops a victim of the last tier, each its
        block's only copy). Returns (tier, block ids, slots), their copies WRITING until
        `finish_resident`; None: nothing changed, take `prepare_store` (always, once hints are on)."""
        tier = self.order[0] if target is None else target
        if self._down or self._queue is not None or tier not in self._resident_stores or self._hints is not None:
            return None
        if not self._resident.absent(keys):
            return None
        n, free = len(keys), self._free_lists[tier]
        short = n - len(free)
        if short > 0:
            if self._below[tier] or self._residency is not None:
                # Its victims would be demoted: moves, the general path's. Or logged: the C
                # eviction clears their keys, so the general path evicts them (and logs each).
                return None
            victims, victim_slots = array("i", bytes(4 * short)), array("i", bytes(4 * short))
            wasted = self._resident.evict(tier, short, victims, victim_slots)
            if wasted < 0:
                return None
            self.index.forget(victims)
            self.stats.evictions[tier] += short
            self.stats.dropped[_EVICTED] += short
            self.stats.prefetch_wasted += wasted
        taken = min(n, len(free))  # popped from the end, as `_take_slot` does, then the victims'
        slots = free[len(free) - taken:]
        slots.reverse()
        del free[len(free) - taken:]
        if short > 0:
            slots.extend(victim_slots)
        ids = self.index.add_many(keys)
        self._resident.claim(tier, ids, slots)
        return tier, ids, slots

    def finish_resident(self, placed: tuple[TierKind, array, array], ok: bool = True) -> tuple[Move, ...]:
        """`complete_store` for `place_resident`'s copies: all READY, or all failed (`ok` False:
        a bug in the copy, since memory copies do not fail otherwise). Returns the demotions due."""
        tier, ids, slots = placed
        if ok:
            self._resident.ready(tier, ids, slots)
            self.stats.stores[tier] += len(ids)
            if self._residency is not None:
                append, key_of = self._residency.append, self._key_of
                for block in ids:
                    append(_STORED, tier, key_of(block))
        else:
            for block in ids:
                self.stats.io_errors += 1
                self._retire_unlisted(block, tier, DropReason.STORE_FAILED)
        self._rebalance()
        return self._drain()

    def withdraw_resident(self, placed: tuple[TierKind, array, array]) -> tuple[Move, ...]:
        """Gives back `place_resident`'s copies that the caller never filled (a reservation it
        does not commit): each freed as if never placed, nothing counted, its slot back where
        `place_resident` took it from (the last first). Returns the demotions due."""
        tier, ids, _ = placed
        for block in reversed(ids):
            self._retire_unlisted(block, tier, None)
        self._rebalance()
        return self._drain()

    # ---- prefetch ------------------------------------------------------------------------

    def prepare_prefetch(self, keys: Iterable[Hashable], target: TierKind, budget_blocks: int) -> tuple[Move, ...]:
        """Moves up to `budget_blocks` of `keys`, in order, into `target`. Never evicts pinned blocks.

        Blocks already at or above `target`, missing, or already moving up are skipped. Where
        `target` is full, its coldest unpinned blocks are demoted to make room; a block whose room
        is still being made is not moved now (a later prefetch finds the room), but counts against
        the budget. Returns the prefetch moves (reason PREFETCH) and the demotions they caused.
        """
        if target not in self._tiers:
            raise KVTierError(f"prefetch target tier {target.name} is not configured")
        if target in self._down:
            return ()
        moves: list[Move] = []
        spent = 0
        get, slots = self._ids.get, self._slot
        for key in keys:
            if spent >= budget_blocks:
                break
            block = get(key)
            tier = self._serving(block) if block is not None else None
            if tier is None or tier <= target or key in self._inbound or slots[target][block] >= 0:
                continue
            source, readers = slots[tier][block], self._readers[tier]
            readers[source] += 1  # so that making room in `target` cannot evict the source itself
            evicted = self.stats.evictions[target]
            slot = self._take_slot(target, False, self._hits[block])
            if slot is not None:
                moves.append(self._start_move(block, tier, target, slot, MoveReason.PREFETCH))
            readers[source] -= 1
            if slot is None and self.stats.evictions[target] == evicted:
                break  # full of pinned or busy blocks: nothing more can be made room for
            spent += 1
        self.stats.prefetch_issued += len(moves)
        return self._drain()  # the prefetches, then any demotions that made room for them

    # ---- moves ---------------------------------------------------------------------------

    def complete_move(self, move_id: int, ok: bool, checksums: tuple[int, ...] | None = None,
                      failure: str | None = None) -> tuple[Move, ...]:
        """Applies a finished, failed or cancelled move; returns the demotions it triggered.

        On success the destination copy becomes READY; a demotion's source is freed, and so is a
        promotion's source in exclusive mode. On failure the destination is freed, and `failure`
        says why: a bad source (`DropReason.CHECKSUM`, `READ_FAILED`) is discarded; a demotion
        that could not be written drops its block (it was already evicted from above); None
        (cancelled) leaves the source as it was. A move that succeeded from its fallback copy
        after its source failed passes `ok` and the source's `failure` (a bad source goes).
        """
        move = self._moves.pop(move_id)
        block = self._land(move)
        if ok:
            self._finish_move(block, move, checksums)
            if failure is not None:
                self._drop_bad_copy(block, move.src, failure)
        else:
            self._fail_move(block, move, failure)
        if self._joined:
            self._joined.discard(move_id)
        self._rebalance()
        return self._drain()

    def complete_moves(self, move_ids: Iterable[int]) -> tuple[Move, ...]:
        """Applies many successful moves (no checksums), in order; returns the moves they triggered.

        The same as `complete_move(id, True)` for each id in turn, concatenating what each returns
        (a watermark check still follows every completion, so the decisions are identical), without
        a plan tuple per move. Raises as `complete_move` does; the moves before the bad id are applied.
        """
        moves, complete = self._moves, self._complete
        for move_id in move_ids:
            complete(moves[move_id])
        return self._drain()

    def _complete(self, move: Move) -> None:
        """`complete_move(move.id, True)` without the drain: `move` is in flight."""
        del self._moves[move.id]
        self._finish_move(self._land(move), move, None)
        if self._joined:
            self._joined.discard(move.id)
        self._rebalance()

    # ---- synchronous use: every transfer completes at once --------------------------------

    def store_now(self, keys: Iterable[Hashable]) -> None:
        """Stores `keys` into the top tier as if every write and move succeeded at once.

        Exactly `plan = prepare_store(keys)`, then `complete_moves` on `plan.moves`, then on what
        that returns, and so on until nothing is left, then the same from `complete_store(plan)`:
        the decisions are those verbs' own code; only the moves they start are not handed out but
        queued here and completed first in first out, which is the order that loop completes them
        in. What nobody sees is not made: no plan, no `Placement`, and demotions skip their `Move`
        and id, which were most of what a trace replay allocated (see bench/bench_simulate.py).
        """
        self._begin_synchronous()
        try:
            placed = self._place(keys, None)[0]
            self._complete_queued()
            stores = self.stats.stores
            for block, tier, _, _ in placed:  # `complete_store` with every write done
                self._make_ready(block, tier)
                stores[tier] += 1
            self._rebalance()
            self._complete_queued()
        finally:
            self._queue = None

    def load_now(self, keys: Iterable[Hashable]) -> tuple[LoadSource, ...]:
        """Loads `keys` as if every read and move succeeded at once; returns where each was read.

        `prepare_load`, its moves completed as in `store_now`, then `complete_load` and its moves.
        """
        self._begin_synchronous()
        try:
            plan = self.prepare_load(keys)
            self._complete_queued()
            self.complete_load(plan)
            self._complete_queued()
        finally:
            self._queue = None
        return plan.sources

    def _begin_synchronous(self) -> None:
        # Not a context manager: a generator-based one costs ~1 µs, a request's worth of bookkeeping.
        if self._queue is not None:
            raise KVTierError("store_now and load_now do not nest")
        self._queue = []

    def _complete_queued(self) -> None:
        """Completes the queued moves, and those their completions queue, first in first out.

        A watermark check follows every completion, as in `complete_moves`, but is skipped where
        it provably does nothing (it used to be a quarter of a three-tier replay's calls): after a
        demotion whose source was freed at once. That leaves every tier's slots in use, net of
        demotions leaving it, as they were, so the check can only act if the last one that ran
        left a tier above its high watermark (`_over_high`), for want of victims the new copy
        may now provide. The first completion is always checked: the verb before it claimed slots.
        """
        queue, outgoing, rebalance = self._queue, self._outgoing, self._rebalance
        slots, readers = self._slot, self._readers
        self._over_high = True
        for block, src, dst, move in queue:  # completions append to `queue`: the loop reaches those
            if move is None:  # a demotion queued by `_evict`; `_land` and `_finish_move` for it
                outgoing[src] -= 1
                readers[src][slots[src][block]] -= 1
                if not self._finish_demotion(block, src, dst) or self._over_high:
                    rebalance()
            else:
                self._complete(move)
        queue.clear()

    def _land(self, move: Move) -> int:
        """Ends `move`'s time in flight (its source lease, its place in the in-flight maps)."""
        block = self._ids[move.key]
        if move.reason is _DEMOTE:
            self._outgoing[move.src] -= 1
        else:
            self._inbound.pop(move.key, None)
        self._readers[move.src][move.src_slot] -= 1
        if move.fallback is not None:
            self._end_fallback(block, move.fallback)
        return block

    def _fallback(self, block: int, tier: TierKind) -> Fallback | None:
        """Leases the fastest other READY copy of `block` in a tier in service, for a read from
        `tier` to fall back on (see `Fallback`). None where the read cannot fail (memory), where
        no other copy is READY, or where nothing is read (a synchronous replay)."""
        if tier <= TierKind.DRAM or self._num_copies[block] < 2 or self._queue is not None:
            return None
        for t in self.order:
            slot = self._slot[t][block]
            if t is not tier and slot >= 0 and t not in self._down and self._state[t][slot] == READY:
                self._readers[t][slot] += 1
                return Fallback(t, slot, self._checksums.get(block))
        return None

    def _end_fallback(self, block: int, fallback: Fallback) -> None:
        """Gives back the lease `_fallback` took (the copy stays, whether or not it was read:
        a fallback that failed too is only found bad when it is a source itself)."""
        if self._slot[fallback.tier][block] == fallback.slot:
            self._readers[fallback.tier][fallback.slot] -= 1
            self._free_if_unread(block, fallback.tier)

    def _drop_bad_copy(self, block: int, tier: TierKind, failure: str) -> None:
        """A copy that could not be read (`failure`) although its block was delivered: discarded
        and counted where its bytes are bad or unreadable; kept where its tier is down (TIER_DOWN)."""
        if failure not in (DropReason.CHECKSUM, DropReason.READ_FAILED):
            return
        self._count_bad_read(failure)
        slot = self._slot[tier][block]
        if slot >= 0 and self._state[tier][slot] != FREEING:
            self._retire(block, tier, failure)

    def _finish_move(self, block: int, move: Move, checksums: tuple[int, ...] | None) -> None:
        if checksums is not None and block not in self._checksums:
            self._checksums[block] = checksums
        src, dst = move.src, move.dst
        if move.reason is _DEMOTE:
            self._finish_demotion(block, src, dst)
            return
        self._make_ready(block, dst)
        self.stats.promotions[src, dst] += 1
        if move.reason is _PREFETCH and move.id not in self._joined:
            self._prefetched[block] = 1  # no load joined it on the way: used only if a load comes later
        if self.mode is _EXCLUSIVE:
            self._retire(block, src, _EVICTED)  # never the last copy: dst is READY
        else:
            self._free_if_unread(block, src)

    def _finish_demotion(self, block: int, src: TierKind, dst: TierKind) -> bool:
        """The destination copy becomes READY and the source (already out of its policy) leaves.

        The source left its policy when `_evict` chose it, and nothing re-inserts a READY copy,
        so `_retire` would only add a no-op `remove`. Returns whether the source was freed at once
        and was the only other copy.
        """
        source = self._slot[src][block]
        if self._readers[src][source] or self._num_copies[block] != 2:
            self._make_ready(block, dst)
            self.stats.demotions[src, dst] += 1
            self._retire_unlisted(block, src, _EVICTED)  # never the last copy: dst is READY
            return False
        # The same where it is simplest, inlined (once per block demoted): the source is unread,
        # so it frees now, and `dst` is the only copy left, hence the fastest READY one.
        slot, state = self._slot[dst][block], self._state[dst]
        if state[slot] != WRITING:  # `_make_ready`, from here to the policy's insert
            raise KVTierError(f"block {_short(self._key_of(block))} in {dst.name} completed twice")
        state[slot] = READY
        self._policies[dst].insert(slot)
        self.stats.demotions[src, dst] += 1
        log = self._residency  # what `_make_ready` and `_retire_unlisted` log (a retired source: logged then)
        if log is not None:
            key = self._key_of(block)
            log.append(_STORED, dst, key)
            if self._state[src][source] == READY:
                log.append(_REMOVED, src, key)
        self._slot[src][block] = -1  # `_retire_unlisted(block, src, EVICTED)`, from here on
        self._state[src][source] = FREE
        self._owner[src][source] = -1
        self._free_lists[src].append(source)  # `SlotAllocator.release`, without its range check
        self._num_copies[block] = 1
        self._ready[block] = dst
        return True

    def _fail_move(self, block: int, move: Move, failure: str | None) -> None:
        # The source may already be leaving (discarded by a failed read): then this was the last copy.
        self._retire_unlisted(block, move.dst, failure or DropReason.MOVE_ABORTED)
        if failure in (DropReason.CHECKSUM, DropReason.READ_FAILED):
            self._count_bad_read(failure)
            self._retire(block, move.src, failure)
        elif failure == DropReason.DEMOTION_FAILED and move.reason is _DEMOTE:  # the destination failed
            self.stats.io_errors += 1
            self._demote_past(block, move.src, move.dst)
        elif failure == DropReason.TIER_DOWN and move.reason is _DEMOTE:
            self._keep_evicted(block, move.src)
        elif failure is not None and move.reason is MoveReason.DEMOTE:
            self.stats.io_errors += 1
            self._retire(block, move.src, failure)  # it was already evicted from above
        else:
            self.stats.io_errors += failure is not None
            self._free_if_unread(block, move.src)

    def _demote_past(self, block: int, src: TierKind, failed: TierKind) -> None:
        """A demotion from `src` that `failed` could not take goes on to the next tier in service
        below it that admits it and has (or can make) room; only when none does is it dropped."""
        if self._state[src][self._slot[src][block]] == FREEING:  # discarded meanwhile (a load found it corrupt)
            self._free_if_unread(block, src)
            return
        for lower in self._below[failed]:
            if self._slot[lower][block] >= 0:
                continue
            slot = self._take_slot(lower, True, self._hits[block])
            if slot is not None:
                self._start_move(block, src, lower, slot, _DEMOTE)
                return
        self._retire_unlisted(block, src, DropReason.DEMOTION_FAILED)  # already out of its policy

    def _keep_evicted(self, block: int, tier: TierKind) -> None:
        """A victim that could not be read out of `tier`, because the tier is down, stays there:
        back in its policy, served again if the tier comes back (a hung node), dropped by a failed
        read if it comes back without it (a restarted one). Unless another demotion of it out of
        `tier` is still in flight (a victim may leave to two tiers: one that may drop it, and one
        that keeps it): it leaves with that one, so its policy must not take it back."""
        slot = self._slot[tier][block]
        if self._state[tier][slot] != READY:
            self._free_if_unread(block, tier)
        elif not self._leaving(block, tier):
            self._policies[tier].insert(slot)

    def _leaving(self, block: int, tier: TierKind) -> bool:
        """Whether a demotion of `block` out of `tier` is in flight (a scan of the moves: failures only)."""
        key = self._key_of(block)
        return any(m.reason is _DEMOTE and m.src is tier and m.key == key for m in self._moves.values())

    def _count_bad_read(self, reason: str) -> None:
        if reason == DropReason.CHECKSUM:
            self.stats.checksum_errors += 1
        else:
            self.stats.io_errors += 1

    # ---- internals: placement and eviction ----------------------------------------------

    def _place_new(self, key: Hashable, tiers: Sequence[TierKind], block: int | None,
                   placed: list[tuple[int, TierKind, int, Hashable]]) -> bool:
        """Claims slots for `key` (whose block id, if indexed, is `block`) in the first of `tiers` with room.

        Appends each claim to `placed` as (block, tier, slot, key); returns whether there was any.
        """
        claimed = keeper = False  # keeper: the copies so far are all in tiers that may drop them
        for tier in tiers:
            if claimed and not (keeper and tier not in self._may_drop):
                # Exclusive mode: one copy, plus those the write-through tiers take, plus one in a
                # tier that keeps it where every copy so far may be dropped (see `_evict`).
                through = self._write_through.get(tier)
                if through is None or not through(key):
                    continue
            slots = self._slot[tier]
            if block is not None and slots[block] >= 0:
                continue  # a copy of an earlier life is still leaving this tier
            slot = self._take_slot(tier, False, 0)
            if slot is None:
                continue
            if block is None:
                block = self.index.add(key)
            slots[block] = slot  # `_claim(block, tier, slot)`, inlined (once per block stored): checked above
            self._state[tier][slot] = WRITING
            self._owner[tier][slot] = block
            self._num_copies[block] += 1
            placed.append((block, tier, slot, key))
            keeper = tier in self._may_drop if not claimed else keeper and tier in self._may_drop
            claimed = True
            if self.mode is _EXCLUSIVE and not self._write_through and not keeper:
                break
        return claimed

    def _take_slot(self, tier: TierKind, demoted: bool, hits: int) -> int | None:
        """A free slot of `tier` for a block it admits, evicting one victim if that frees one now."""
        if not self._admits_all[tier] and not self._tiers[tier].admission.admits(demoted=demoted, hits=hits):
            return None
        free = self._free_lists[tier]
        if free:
            return free.pop()
        victim = self._victim[tier]()
        if victim is not None:
            self._evict(self._owner[tier][victim], tier)
        return free.pop() if free else None

    def _protected_in(self, tier: TierKind, by_key: bool = False) -> Callable[[int], bool]:
        """Whether the copy in `slot` of `tier` must stay (pinned, not READY, or being read),
        inlined: policies call it per candidate. `by_key`: asked of the block's key instead."""
        owners, state, readers, pins = self._owner[tier], self._state[tier], self._readers[tier], self._pins
        ids, slots = self._ids, self._slot[tier]

        def protected(slot: int) -> bool:
            block = owners[slot]
            return block < 0 or pins[block] != 0 or state[slot] != READY or readers[slot] != 0

        def protected_key(key: Hashable) -> bool:
            block = ids.get(key)
            if block is None:
                return True
            slot = slots[block]
            return slot < 0 or pins[block] != 0 or state[slot] != READY or readers[slot] != 0

        return protected_key if by_key else protected

    def _evict(self, block: int, tier: TierKind) -> None:
        """Evicts `block`'s copy from `tier` (already gone from its policy): release, demote or drop."""
        self.stats.evictions[tier] += 1
        if self._prefetched[block]:
            self.stats.prefetch_wasted += 1  # evicted before any load used it
            self._prefetched[block] = 0
        slots, may_drop = self._slot, self._may_drop
        kept = False  # another live copy exists, in a tier that may lose it on its own
        if self._num_copies[block] > 1:
            state = self._state
            for t in self.order:
                slot = slots[t][block]
                if slot >= 0 and t != tier and state[t][slot] != FREEING:
                    if t not in may_drop:
                        self._retire_unlisted(block, tier, _EVICTED)  # never the last copy
                        return
                    kept = True
        # A copy only in a tier that may drop it on its own (a shared pool node, evicting by its own
        # recency) does not keep the block: the victim is demoted past it, to a tier that keeps it.
        below = self._below[tier]
        if not below:  # the last tier in service: a drop
            self._retire_unlisted(block, tier, _EVICTED if tier is self._last or kept else DropReason.LOWER_DOWN)
            return
        refused = started = False
        admits_all, free_lists = self._admits_all, self._free_lists
        for lower in below:
            lower_slots = slots[lower]
            if lower_slots[block] >= 0:
                continue
            if not admits_all[lower] and not self._tiers[lower].admission.admits(demoted=True, hits=self._hits[block]):
                refused = True
                continue
            # The rest of `_take_slot(lower, True, hits)`, inlined: a call per block demoted
            # cost ~5 % of a three-tier replay, and another one per block dropped from the last.
            free = free_lists[lower]
            if not free:
                victim = self._victim[lower]()
                if victim is not None:
                    self._evict(self._owner[lower][victim], lower)
            slot = free.pop() if free else None
            if slot is None:
                continue
            queue = self._queue
            if queue is None:
                self._start_move(block, tier, lower, slot, _DEMOTE)
            else:
                # `_start_move(block, tier, lower, slot, DEMOTE)` under `store_now` / `load_now`, inlined
                # (once per block demoted) and without the `Move` and its id, which nothing there looks
                # up and which were what a replay allocated most. `lower` holds no copy of the block:
                # checked above, and making room there only moved other blocks.
                self._readers[tier][slots[tier][block]] += 1
                lower_slots[block] = slot
                self._state[lower][slot] = WRITING
                self._owner[lower][slot] = block
                self._num_copies[block] += 1
                self._outgoing[tier] += 1
                queue.append((block, tier, lower, None))
            if lower not in may_drop:
                return
            # Into a tier that may drop it: a second copy goes on down to one that keeps it, where
            # one has room (the source is let go once both moves have read it).
            started = kept = True
        if not started:
            self._retire_unlisted(block, tier, _EVICTED if kept else DropReason.ADMISSION if refused else DropReason.LOWER_FULL)

    def _rebalance(self) -> None:
        """Demotes from every tier above its high watermark down to its low watermark.

        Sets `_over_high`: whether a tier is still above its high watermark, for want of victims.
        (Evictions only claim slots further down, and the tiers are visited top down, so a tier
        checked here stays as it was left.)
        """
        outgoing = self._outgoing
        over_high = False
        for tier, spec, free, high in self._watermarked:
            num_slots = spec.num_slots
            used = num_slots - len(free) - outgoing[tier]
            if used <= high:
                continue
            target = math.floor(spec.low_watermark * num_slots)
            victims_of, one_victim, owners = self._victims[tier], self._victim[tier], self._owner[tier]
            while used > target:
                # All `used - target` victims in one call where there are that many: the same blocks
                # as one call per victim (an eviction changes only lower tiers, never this tier's
                # order or which of its blocks are protected), for one call's overhead.
                victims = victims_of(used - target) if used - target > 1 else None
                if victims is None:
                    one = one_victim()
                    if one is None:
                        over_high |= used > high
                        break
                    victims = (one,)
                for victim in victims:
                    self._evict(owners[victim], tier)
                used = num_slots - len(free) - outgoing[tier]
        self._over_high = over_high

    def _load_source(self, block: int, tier: TierKind, key: Hashable) -> LoadSource:
        self._hits[block] += 1
        self.stats.hits[tier] += 1
        slot = self._slot[tier][block]  # already leased by prepare_load
        self._policies[tier].touch(slot)
        inbound = self._inbound.get(key)
        if self._prefetched[block] or (inbound is not None and inbound.reason is _PREFETCH
                                       and inbound.id not in self._joined):
            self.stats.prefetch_used += 1
            self._prefetched[block] = 0
        if inbound is not None and inbound.reason is _PREFETCH:
            self._joined.add(inbound.id)
        if inbound is not None:
            self._readers[tier][slot] -= 1  # read the copy on its way up instead
            return self._lease_inbound(inbound)
        up = self._promote_now
        if up is not None and tier > up and self._slot[up][block] < 0:
            dst = self._take_slot(up, False, self._hits[block])
            if dst is not None:
                move = self._start_move(block, tier, up, dst, MoveReason.PROMOTE)
                self._readers[tier][slot] -= 1  # the move holds its own lease
                return self._lease_inbound(move)
        return LoadSource(key, tier, slot, None, self._checksums.get(block), self._fallback(block, tier))

    def _lease_inbound(self, move: Move) -> LoadSource:
        self._readers[move.dst][move.dst_slot] += 1
        return LoadSource(move.key, move.dst, move.dst_slot, move.id, self._checksums.get(self._ids[move.key]))

    def _start_move(self, block: int, src: TierKind, dst: TierKind, slot: int, reason: MoveReason) -> Move:
        """Claims `slot` of `dst` and leases the source copy for a move; returns the move.

        Under `store_now` / `load_now` the move is queued for them instead of handed out (and a
        demotion there does not come here: `_evict` queues it without a `Move`).
        """
        self._claim(block, dst, slot)  # raises, changing nothing, where `dst` holds a copy already
        key, source = self._key_of(block), self._slot[src][block]
        self._readers[src][source] += 1
        fallback = self._fallback(block, src) if reason is not _DEMOTE else None
        move = Move(next(self._ids_made), key, src, source, dst, slot, reason, self._checksums.get(block), fallback)
        self._moves[move.id] = move
        if reason is _DEMOTE:
            self._outgoing[src] += 1
        else:
            self._inbound[key] = move
        if self._queue is None:
            self._new_moves.append(move)
        else:
            self._queue.append((block, src, dst, move))
        return move

    def _drain(self) -> tuple[Move, ...]:
        if not self._new_moves:
            return ()
        moves, self._new_moves = tuple(self._new_moves), []
        return moves

    # ---- internals: copy lifecycle -------------------------------------------------------

    def _live(self, block: int) -> bool:
        """Whether `block` has a copy that is or will become servable (READY or WRITING)."""
        slots, state = self._slot, self._state
        for t in self.order:
            slot = slots[t][block]
            if slot >= 0 and state[t][slot] != FREEING:
                return True
        return False

    def _refresh(self, block: int) -> None:
        """Recomputes `block`'s fastest READY tier; after a change other than one more READY copy."""
        slots, state = self._slot, self._state
        for t in self.order:  # fastest first
            slot = slots[t][block]
            if slot >= 0 and state[t][slot] == READY:
                self._ready[block] = t
                return
        self._ready[block] = NO_TIER

    def _claim(self, block: int, tier: TierKind, slot: int) -> None:
        """Gives `block` a WRITING copy in free `slot` of `tier`."""
        slots = self._slot[tier]
        if slots[block] >= 0:
            raise KVTierError(f"block {_short(self._key_of(block))} already has a copy in {tier.name}")
        slots[block] = slot
        self._state[tier][slot] = WRITING
        self._owner[tier][slot] = block
        self._num_copies[block] += 1

    def _make_ready(self, block: int, tier: TierKind) -> None:
        slot, state = self._slot[tier][block], self._state[tier]
        if slot < 0 or state[slot] != WRITING:
            raise KVTierError(f"block {_short(self._key_of(block))} in {tier.name} completed twice")
        state[slot] = READY
        if tier < self._ready[block]:  # what `_refresh` would find: one more READY copy (NO_TIER is 255)
            self._ready[block] = tier
        self._policies[tier].insert(slot)
        if self._residency is not None:
            self._residency.append(_STORED, tier, self._key_of(block))

    # ---- a copy leaves: two steps, two verbs ---------------------------------------------
    # `_retire`: the copy leaves service (FREEING: no new reader, out of its policy; the block is
    # dropped, and counted, if it was its last live copy). `_free`: its slot goes back, once no
    # read of it is left (`_free_if_unread`). `_retire_unlisted` is `_retire` for a copy its
    # policy has already let go (a victim it handed out, a copy never READY).

    def _retire_unlisted(self, block: int, tier: TierKind, reason: str | None) -> None:
        """Takes a copy (already out of its policy) out of service; frees it once unread.

        If it was the block's last live copy, the block is dropped and counted under `reason`
        (None: not counted, the caller stores it again elsewhere).
        """
        slots, state = self._slot[tier], self._state[tier]
        slot = slots[block]
        if state[slot] != FREEING:
            if self._residency is not None and state[slot] == READY:  # a failed write was never servable
                self._residency.append(_REMOVED, tier, self._key_of(block))
            state[slot] = FREEING
            if self._num_copies[block] == 1:  # the only copy (once per block dropped): no READY copy is left
                self._ready[block] = NO_TIER
                if reason is not None:
                    self.stats.dropped[reason] += 1
                self._pins[block] = 0
                if self._readers[tier][slot] == 0:  # `_free`, inlined: once per block dropped
                    slots[block] = -1
                    state[slot] = FREE
                    self._owner[tier][slot] = -1
                    self._free_lists[tier].append(slot)
                    self._num_copies[block] = 0
                    self.index.remove(block)
                return
            else:
                if self._ready[block] == tier:  # else the fastest READY copy is still the same one
                    self._refresh(block)
                if not self._live(block):
                    if reason is not None:
                        self.stats.dropped[reason] += 1
                    self._pins[block] = 0
        if self._readers[tier][slot] == 0:  # what `_free_if_unread` checks; the copy is FREEING by now
            self._free(block, tier, slot)

    def _retire(self, block: int, tier: TierKind, reason: str) -> None:
        """Like `_retire_unlisted`, for a copy that may still be in its policy."""
        slot = self._slot[tier][block]
        if self._state[tier][slot] == READY:
            self._policies[tier].remove(slot)
        self._retire_unlisted(block, tier, reason)

    def _free_if_unread(self, block: int, tier: TierKind) -> None:
        """`_free` for a retired copy whose last reader has ended."""
        slot = self._slot[tier][block]
        if self._state[tier][slot] == FREEING and self._readers[tier][slot] == 0:
            self._free(block, tier, slot)

    def _free(self, block: int, tier: TierKind, slot: int) -> None:
        """Gives an unread FREEING copy's slot back; the block leaves the index with its last copy."""
        self._slot[tier][block] = -1
        self._state[tier][slot] = FREE
        self._owner[tier][slot] = -1
        self._free_lists[tier].append(slot)  # `SlotAllocator.release`, without its range check
        left = self._num_copies[block] - 1
        self._num_copies[block] = left
        if not left:
            self.index.remove(block)


def _short(key: Hashable) -> str:
    return key.hex()[:16] if isinstance(key, bytes) else repr(key)
