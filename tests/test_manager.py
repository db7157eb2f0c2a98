"""The manager's invariants, proved over random operation sequences (cost: ~20 s).

The manager moves no bytes, so this test plays the transfer engine itself: a dict of
(tier, slot) -> content stands in for the tiers, plans are executed when the test chooses, in any
order, and some fail. Every read checks that the slot holds exactly what was stored under the key.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier.config import CacheMode
from kvtier.errors import ConfigError, KVTierError
from kvtier.deciding.index import CopyState
from kvtier.deciding.manager import MoveReason, TierManager, TierSlots
from kvtier.policy import PolicyKind, make_policy
from kvtier.policy.admission import AdmissionKind, AdmissionRule
from kvtier.observing.stats import DropReason
from kvtier.tiers.base import TierKind

H, D, P, S = TierKind.HBM, TierKind.DRAM, TierKind.POOL, TierKind.SSD
KEYS = st.lists(st.integers(0, 11), min_size=1, max_size=5, unique=True)
# Drops of blocks that were never READY (a store found no room, or its write failed).
NEVER_READY = {DropReason.NO_SPACE, DropReason.STORE_FAILED}


def make_manager(sizes=(2, 3, 4), policy=PolicyKind.LRU, mode=CacheMode.EXCLUSIVE, high=1.0, low=1.0,
                 admission=AdmissionRule(AdmissionKind.ALL), promote_to=D, pool=None) -> TierManager:
    """HBM, DRAM, SSD of `sizes`; `pool`: None, or (slots, shared) for a pool tier that may drop
    blocks on its own, taking a write-through copy of every store where shared."""
    tiers = [TierSlots(k, n, make_policy(policy, n), admission if k is S else AdmissionRule(AdmissionKind.ALL),
                       high, low) for k, n in zip((H, D, S), sizes)]
    if pool is not None:
        n, shared = pool
        tiers.append(TierSlots(P, n, make_policy(policy, n), AdmissionRule(AdmissionKind.ALL), high, low,
                               write_through=(lambda key: True) if shared else None, may_drop=True))
    return TierManager(tiers, mode=mode, promote_to=promote_to)


# The machine's set-up draws (a subclass that extends `setup` repeats its decorator with these).
MACHINE_SETUP = dict(policy=st.sampled_from(list(PolicyKind)), mode=st.sampled_from(list(CacheMode)),
                     sizes=st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 5)),
                     marks=st.sampled_from([(1.0, 1.0), (0.75, 0.5), (0.5, 0.25)]),
                     admission=st.sampled_from(list(AdmissionKind)),
                     pool=st.sampled_from([None, (2, False), (3, True)]))


class ManagerMachine(RuleBasedStateMachine):
    """Random stores, loads, prefetches, pins and out-of-order completions (some failing)."""

    @initialize(**MACHINE_SETUP)
    def setup(self, policy, mode, sizes, marks, admission, pool):
        self.m = make_manager(sizes, policy, mode, *marks, admission=AdmissionRule(admission), pool=pool)
        self.data: dict[tuple[TierKind, int], int] = {}
        self.pending: list[tuple[str, object]] = []
        self.pinned: dict[int, int] = {}
        self.ever_ready: set[int] = set()
        self.losses = 0

    # ---- issuing plans ---------------------------------------------------------------

    def _queue_moves(self, moves):
        for mv in moves:
            assert mv.dst not in self.m.unavailable, "a move into a tier out of service"
            assert mv.checksums == self.m.index.get(mv.key).checksums, "a move carries stale checksums"
        self.pending += [("move", mv) for mv in moves]

    @rule(tier=st.sampled_from([H, D, P, S]), available=st.booleans())
    def set_available(self, tier, available):
        if tier not in self.m.order:
            return
        self._queue_moves(self.m.set_available(tier, available))
        assert (tier in self.m.unavailable) is not available

    @rule(keys=KEYS, tier=st.sampled_from([None, H, D, P, S]))
    def store(self, keys, tier):
        if tier is not None and tier not in self.m.order:
            return
        for key in keys:  # one at a time: a key dropped and stored again in one call is still seen
            plan = self.m.prepare_store([key], tier)
            assert not {p.tier for p in plan.all_placements} & self.m.unavailable, "a store into a tier out of service"
            self.pending.append(("store", plan))
            self._queue_moves(plan.moves)
            self.every_lost_block_is_counted()

    @rule(keys=KEYS)
    def load(self, keys):
        plan = self.m.prepare_load(keys)
        assert set(plan.missing) | {s.key for s in plan.sources} == set(keys)
        for s in plan.sources:
            assert s.checksums == self.m.index.get(s.key).checksums, "a load source carries stale checksums"
        self.pending.append(("load", plan))
        self._queue_moves(plan.moves)

    @rule(keys=KEYS, budget=st.integers(0, 3))
    def prefetch(self, keys, budget):
        self._queue_moves(self.m.prepare_prefetch(keys, D, budget))

    @rule(keys=KEYS)
    def pin(self, keys):
        for k in keys:
            if self.m.pin([k]):
                self.pinned[k] = self.pinned.get(k, 0) + 1

    @precondition(lambda self: self.pinned)
    @rule(data=st.data())
    def unpin(self, data):
        k = data.draw(st.sampled_from(sorted(self.pinned)))
        entry = self.m.index.get(k)
        if entry is None or entry.pins == 0:  # dropped by a failure: its pins went with it
            del self.pinned[k]
            return
        unpinned, moves = self.m.unpin([k])
        assert unpinned == [k]
        self._queue_moves(moves)
        self.pinned[k] -= 1
        if not self.pinned[k]:
            del self.pinned[k]

    # ---- completing plans, in any order ----------------------------------------------

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), ok=st.integers(0, 9))
    def complete(self, data, ok):
        i = data.draw(st.integers(0, len(self.pending) - 1))
        kind, plan = self.pending[i]
        if kind == "load" and any(s.after_move is not None and s.after_move in self._pending_move_ids()
                                  for s in plan.sources):
            return  # a joined load reads only after its move lands (the engine waits)
        self.pending.pop(i)
        getattr(self, f"_complete_{kind}")(plan, ok > 0, data)

    @precondition(lambda self: any(k == "move" for k, _ in self.pending))
    @rule()
    def complete_all_moves_at_once(self):
        """`complete_moves` over every move in flight, in the order they were issued."""
        moves = [p for k, p in self.pending if k == "move"]
        self.pending = [(k, p) for k, p in self.pending if k != "move"]
        for mv in moves:
            assert self.m.owner(mv.src, mv.src_slot) == mv.key, "a move's source slot changed hands"
            assert self.data.get((mv.src, mv.src_slot)) == mv.key, "a move read bytes of another block"
            self.data[(mv.dst, mv.dst_slot)] = mv.key
        self._queue_moves(self.m.complete_moves([mv.id for mv in moves]))

    def _pending_move_ids(self):
        return {p.id for k, p in self.pending if k == "move"}

    def _complete_store(self, plan, ok, data):
        failed = set() if ok else {(p.key, p.tier) for p in plan.all_placements[:1]}
        for p in plan.all_placements:
            assert self.m.owner(p.tier, p.slot) == p.key, "a slot being written changed hands"
            if (p.key, p.tier) not in failed:
                self.data[(p.tier, p.slot)] = p.key
                self.ever_ready.add(p.key)  # READY now, even if this very completion evicts it
        retry = data.draw(st.booleans()) if failed else False  # as the runtime does: again, further down
        again = {p.key: p.tier for p in plan.all_placements if (p.key, p.tier) in failed and self.m.below(p.tier)
                 and not self.m.held_elsewhere(p.key, {p.tier})}
        self._queue_moves(self.m.complete_store(plan, failed, retrying=again if retry else ()))
        for key, tier in (again.items() if retry else ()):
            replan = self.m.prepare_store([key], self.m.below(tier)[0])
            assert all(p.tier > tier for p in replan.all_placements)
            self.pending.append(("store", replan))
            self._queue_moves(replan.moves)

    def _complete_move(self, mv, ok, data):
        assert self.m.owner(mv.src, mv.src_slot) == mv.key, "a move's source slot changed hands"
        assert self.data.get((mv.src, mv.src_slot)) == mv.key, "a move read bytes of another block"
        if ok:
            self.data[(mv.dst, mv.dst_slot)] = mv.key
            self._queue_moves(self.m.complete_move(mv.id, True, (mv.key,)))
            return
        failures = [DropReason.CHECKSUM, DropReason.READ_FAILED, DropReason.DEMOTION_FAILED, DropReason.TIER_DOWN]
        if mv.reason is not MoveReason.DEMOTE:
            failures.append(None)  # cancelled
        failure = data.draw(st.sampled_from(failures))
        self._queue_moves(self.m.complete_move(mv.id, False, None, failure))

    def _complete_load(self, plan, ok, data):
        failed = {}
        for s in plan.sources:
            entry = self.m.index.get(s.key)
            copy = entry.copies.get(s.tier) if entry else None
            if s.after_move is not None and (copy is None or copy.state is not CopyState.READY):
                failed[s.key] = "dependency"  # the move it joined failed: a miss, nothing read
                continue
            assert copy is not None and copy.slot == s.slot and copy.readers > 0, "a leased copy was evicted"
            if s.checksums is not None:
                assert entry.checksums == s.checksums, "checksums changed under a lease"
            assert copy.state is CopyState.READY or copy.state is CopyState.FREEING
            assert self.data.get((s.tier, s.slot)) == s.key, "load served bytes of another block"
        if not ok and plan.sources:
            reason = data.draw(st.sampled_from([DropReason.CHECKSUM, DropReason.READ_FAILED, DropReason.TIER_DOWN]))
            failed.setdefault(plan.sources[0].key, reason)
        self._queue_moves(self.m.complete_load(plan, failed))

    # ---- invariants --------------------------------------------------------------------

    @invariant()
    def slots_are_consistent(self):
        owners = {}
        for entry in self.m.index:
            for tier, copy in entry.copies.items():
                assert (tier, copy.slot) not in owners, "two copies share a slot"
                owners[(tier, copy.slot)] = entry.key
                assert self.m.owner(tier, copy.slot) == entry.key
                assert copy.readers >= 0
            ready = [t for t, c in entry.copies.items() if c.state is CopyState.READY]
            assert entry.best_ready() == (min(ready) if ready else None), "stale cached ready tier"
        for tier in self.m.order:
            used = self.m.num_used(tier)
            assert used <= self.m.num_slots(tier), "tier over capacity"
            assert used == sum(1 for t, _ in owners if t == tier), "a slot leaked or was double-freed"

    @invariant()
    def policies_track_ready_copies(self):
        for tier in self.m.order:
            policy = self.m._tiers[tier].policy
            leaving = {mv.key for mv in self.m.moves_in_flight() if mv.reason is MoveReason.DEMOTE and mv.src is tier}
            ready = {e.key: e.copies[tier].slot for e in self.m.index
                     if e.copies.get(tier) and e.copies[tier].state is CopyState.READY}
            # kvtier's LRU tracks the slot of each copy (`tracks_slots`); the other policies, keys.
            tracked = {k for k, slot in ready.items() if (slot if getattr(policy, "tracks_slots", False) else k) in policy}
            assert set(ready) - leaving == tracked and len(policy) == len(set(ready) - leaving)

    @invariant()
    def lookups_see_only_tiers_in_service(self):
        for entry in self.m.index:
            servable = any(c.state is CopyState.READY and t not in self.m.unavailable for t, c in entry.copies.items())
            assert self.m.lookup([entry.key]) == int(servable)

    @invariant()
    def pinned_blocks_stay(self):
        for k in self.pinned:
            entry = self.m.index.get(k)
            if entry is not None and entry.pins:
                assert entry.live_copies() > 0

    @invariant()
    def every_lost_block_is_counted(self):
        present = {e.key for e in self.m.index if e.best_ready() is not None or e.live_copies()}
        ready_now = {e.key for e in self.m.index if e.best_ready() is not None}
        lost = self.ever_ready - present
        self.losses += len(lost)
        self.ever_ready = (self.ever_ready - lost) | ready_now
        counted = sum(n for reason, n in self.m.stats.dropped.items() if reason not in NEVER_READY)
        assert counted == self.losses, "a block left the cache without being counted as dropped"


TestManagerMachine = pytest.mark.slow(ManagerMachine.TestCase)  # 300 runs of 60 steps: ~12 s
TestManagerMachine.settings = settings(max_examples=300, stateful_step_count=60, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])


# ---- targeted cases ------------------------------------------------------------------------


def _store_ready(m, keys, target=None):
    plan = m.prepare_store(keys, target)
    moves = list(plan.moves) + list(m.complete_store(plan))
    return plan, moves


def _finish(m, moves):
    """Completes moves (and the moves they trigger) successfully."""
    while moves:
        moves = list(moves[1:]) + list(m.complete_move(moves[0].id, True, (0,)))


def test_store_spills_down_and_demotes_lru_first():
    m = make_manager((2, 2, 2))
    _store_ready(m, [1, 2])
    plan, moves = _store_ready(m, [3])
    assert [(mv.key, mv.src, mv.dst) for mv in plan.moves] == [(1, H, D)], "the LRU block is demoted"
    assert [p.tier for p in plan.all_placements] == [D], "HBM's slot frees only when the demotion lands"
    _finish(m, moves)
    assert (m.where(1), m.where(2), m.where(3)) == (D, H, D) and m.lookup([1, 2, 3]) == 3
    _finish(m, _store_ready(m, [4])[1])
    assert m.where(4) is H, "the slot freed by the demotion takes the next store"


def test_last_tier_eviction_is_a_counted_drop():
    m = make_manager((1, 1, 1))
    for k in range(4):
        _finish(m, _store_ready(m, [k])[1])
    assert m.where(3) is H, "the newest block is kept"
    assert m.stats.dropped[DropReason.EVICTED] >= 1
    assert len(m.index) + m.stats.num_dropped == 4, "every block is either stored or counted as dropped"


def test_block_being_written_is_invisible():
    m = make_manager()
    plan = m.prepare_store([7])
    assert m.lookup([7]) == 0 and m.prepare_load([7]).missing == (7,)
    m.complete_store(plan)
    assert m.lookup([7]) == 1


def test_leased_and_pinned_blocks_are_never_evicted():
    m = make_manager((1, 1, 1))
    _store_ready(m, [1])
    load = m.prepare_load([1])
    plan = m.prepare_store([2], H)
    assert [p.tier for p in plan.all_placements] == [D], "the block being read stays; the new one goes below"
    assert m.where(1) is H
    m.complete_load(load)
    m.complete_store(plan)
    assert m.pin([2]) == [2]
    plan = m.prepare_store([3], D)
    assert [p.tier for p in plan.all_placements] == [S] and m.where(2) is D


def test_concurrent_loads_join_one_promotion():
    m = make_manager((1, 2, 4))
    _finish(m, _store_ready(m, [5], S)[1])
    first, second = m.prepare_load([5]), m.prepare_load([5])
    assert len(first.moves) == 1 and first.moves[0].reason is MoveReason.PROMOTE
    assert second.moves == (), "the second load must not issue a second read"
    assert first.sources[0].after_move == second.sources[0].after_move == first.moves[0].id
    m.complete_move(first.moves[0].id, True)
    m.complete_load(first)
    m.complete_load(second)
    assert m.where(5) is D and m.stats.promotions[(S, D)] == 1


def test_load_joins_prefetch_in_flight():
    m = make_manager((1, 2, 4))
    _finish(m, _store_ready(m, [5, 6], S)[1])
    moves = m.prepare_prefetch([5, 6], D, budget_blocks=1)
    assert [mv.key for mv in moves] == [5], "the byte budget caps the prefetch"
    load = m.prepare_load([5])
    assert load.moves == () and load.sources[0].after_move == moves[0].id
    assert m.stats.prefetch_used == 1


def test_plans_carry_the_checksums_reads_are_checked_against():
    m = make_manager((1, 2, 4))
    plan = m.prepare_store([5], S)
    m.complete_store(plan, checksums={5: (11, 12)})
    load = m.prepare_load([5])  # from SSD, promoted to DRAM on the way
    assert load.moves[0].checksums == (11, 12), "the promotion's read from SSD is checked against them"
    assert load.sources[0].checksums == (11, 12) and load.sources[0].after_move == load.moves[0].id
    plan = m.prepare_store([6], D)
    m.complete_store(plan)  # memory: no checksums
    [demotion] = m.prepare_store([7, 8], D).moves  # DRAM full: 6 goes down
    assert (demotion.key, demotion.dst, demotion.checksums) == (6, S, None), "its destination must compute them"


def test_cancellable_names_the_prefetches_no_load_has_joined():
    m = make_manager((1, 4, 4))
    _finish(m, _store_ready(m, [5, 6, 7], S)[1])
    moves = m.prepare_prefetch([5, 6], D, budget_blocks=2)
    assert m.cancellable(moves) == [5, 6]
    joined = m.prepare_load([5])
    assert joined.sources[0].after_move == moves[0].id
    assert m.cancellable(moves) == [6], "a load reads 5 on its way up: no longer cancellable"
    m.complete_move(moves[1].id, True)
    assert m.cancellable(moves) == [], "6 landed"
    promotion = m.prepare_load([7]).moves
    assert promotion[0].reason is MoveReason.PROMOTE and m.cancellable(promotion) == []


def test_prefetch_never_evicts_pinned_blocks():
    m = make_manager((1, 1, 4))
    _finish(m, _store_ready(m, [1], D)[1])
    _finish(m, _store_ready(m, [2], S)[1])
    m.pin([1])
    assert m.prepare_prefetch([2], D, 4) == ()
    assert m.where(1) is D


def test_failed_demotion_goes_on_down_and_drops_only_past_the_last_tier():
    m = make_manager((1, 2, 2))
    _store_ready(m, [1])
    plan, moves = _store_ready(m, [2])
    (demote,) = [mv for mv in moves if mv.reason is MoveReason.DEMOTE]
    assert (demote.src, demote.dst) == (H, D)
    (again,) = m.complete_move(demote.id, False, None, DropReason.DEMOTION_FAILED)
    assert (again.key, again.src, again.dst, again.reason) == (demote.key, H, S, MoveReason.DEMOTE), \
        "the tier below the one that failed takes it"
    assert m.lookup([demote.key]) == 1, "still served from its source meanwhile"
    assert m.complete_move(again.id, False, None, DropReason.DEMOTION_FAILED) == ()
    assert m.lookup([demote.key]) == 0
    assert m.stats.dropped[DropReason.DEMOTION_FAILED] == 1 and m.stats.io_errors == 2


def test_a_tier_out_of_service_is_skipped_and_its_blocks_not_served():
    m = make_manager((1, 2, 2))
    _store_ready(m, [1], S)
    assert m.lookup([1]) == 1
    assert m.set_available(S, False) == () and m.unavailable == {S}
    assert m.lookup([1]) == 0 and m.prepare_load([1]).missing == (1,), "its copy is kept, not served"
    assert m.below(H) == (D,) and m.below(D) == ()
    plan, moves = _store_ready(m, [2, 3, 4])  # HBM and DRAM full: no demotion can go into SSD
    assert all(mv.dst is not S for mv in moves) and all(p.tier is not S for p in plan.all_placements)
    assert m.prepare_prefetch([1], S, 4) == ()
    m.set_available(S, True)
    assert m.lookup([1]) == 1 and m.where(1) is S


def test_checksum_failure_discards_the_copy():
    m = make_manager((1, 1, 2), promote_to=None)
    _finish(m, _store_ready(m, [3], S)[1])
    load = m.prepare_load([3])
    m.complete_load(load, {3: DropReason.CHECKSUM})
    assert m.lookup([3]) == 0 and m.stats.checksum_errors == 1
    assert m.stats.dropped[DropReason.CHECKSUM] == 1 and m.num_used(S) == 0


def test_inclusive_mode_writes_through_and_keeps_lower_copies():
    m = make_manager((2, 3, 4), mode=CacheMode.INCLUSIVE)
    plan, _ = _store_ready(m, [1])
    assert [p.tier for p in plan.all_placements] == [H, D, S]
    _store_ready(m, [2])
    _, moves = _store_ready(m, [3])
    assert not [mv for mv in moves if mv.reason is MoveReason.DEMOTE], "a copy below exists: release, no move"
    assert m.where(1) is D and m.stats.num_dropped == 0


def test_watermarks_demote_down_to_low():
    m = make_manager((4, 4, 4), high=0.75, low=0.5)
    plan, moves = _store_ready(m, [1, 2, 3, 4])
    assert len([mv for mv in moves if mv.src is H]) == 2, "4 of 4 slots > 75%: demote down to 50%"
    _finish(m, moves)
    assert m.num_used(H) == 2


def test_the_last_tier_in_service_fills_up_instead_of_draining_to_its_low_watermark():
    # Draining the last tier drops blocks it has room for: a DRAM-only vLLM server held 85-95 % of
    # its DRAM (watermarks 0.95 / 0.85), and its hit rate fell below DRAM + SSD's.
    def fill(m, target=None):
        for key in range(8):
            _finish(m, _store_ready(m, [key], target)[1])

    only = TierManager([TierSlots(D, 8, make_policy("lru", 8), high_watermark=0.75, low_watermark=0.5)])
    fill(only)
    assert only.num_used(D) == 8 and only.stats.num_dropped == 0
    _finish(only, _store_ready(only, [8])[1])
    assert only.num_used(D) == 8 and only.where(0) is None and only.stats.num_dropped == 1, "on demand: the LRU block"

    m = make_manager((2, 2, 8), high=0.75, low=0.5)
    fill(m, S)
    assert m.num_used(S) == 8 and m.stats.num_dropped == 0, "SSD is the last tier: nothing drained"
    m.set_available(S, False)  # DRAM is now the last tier in service
    for key in (20, 21):
        _finish(m, _store_ready(m, [key], D)[1])
    assert m.num_used(D) == 2, "a full DRAM with no tier below in service keeps its blocks"
    _finish(m, list(m.set_available(S, True)))
    _finish(m, _store_ready(m, [22], D)[1])
    assert m.num_used(D) <= 1, "SSD back below it: DRAM drains to its low watermark again"


def test_admission_keeps_direct_stores_off_ssd():
    m = make_manager((1, 1, 2), admission=AdmissionRule(AdmissionKind.EVICTED))
    _store_ready(m, [1], H)
    _store_ready(m, [2], D)
    plan = m.prepare_store([3], S)
    assert plan.rejected == (3,) and m.stats.dropped[DropReason.NO_SPACE] == 1


def test_bad_configuration_and_misuse_raise():
    with pytest.raises(ConfigError, match="distinct"):
        TierManager([TierSlots(H, 1, make_policy("lru", 1))] * 2)
    with pytest.raises(ConfigError, match="watermark"):
        TierManager([TierSlots(H, 1, make_policy("lru", 1), high_watermark=0.5, low_watermark=0.9)])
    m = make_manager()
    assert m.unpin([42]) == ([], ()), "unpin skips a key holding no pin, as pin skips one not stored"


@pytest.mark.parametrize("policy", list(PolicyKind))
def test_complete_moves_decides_as_complete_move_one_at_a_time(policy):
    def replay(batched):
        m = make_manager((3, 4, 6), policy=policy, high=0.7, low=0.4)
        for i in range(40):
            keys = [i % 13, (i * 7) % 17 + 20, i + 100]
            n = m.lookup(keys)
            plan = m.prepare_load(keys[:n])
            moves = list(plan.moves)
            store = m.prepare_store(keys[n:])
            moves += list(store.moves)
            moves += list(m.complete_store(store))
            moves += list(m.complete_load(plan))
            while moves:
                if batched:
                    moves = list(m.complete_moves([mv.id for mv in moves]))
                else:
                    moves = moves[1:] + list(m.complete_move(moves[0].id, True))
        return {k: m.where(k) for k in range(200)}, dict(m.stats.hits), dict(m.stats.dropped)

    assert replay(batched=True) == replay(batched=False)


# ---- a tier that may drop blocks on its own (a shared pool node) ----------------------------


def test_a_copy_in_a_tier_that_may_drop_it_does_not_let_a_victim_go_undemoted():
    m = make_manager((1, 1, 4), pool=(4, True))  # every store also goes to the pool (write-through)
    plan, moves = _store_ready(m, [1])
    assert sorted(p.tier for p in plan.all_placements) == [H, P]
    plan, moves = _store_ready(m, [2])
    assert [(mv.key, mv.src, mv.dst) for mv in plan.moves] == [(1, H, D)], "demoted as if the pool had no copy"
    assert sorted(p.tier for p in plan.all_placements) == [P, S], "HBM's slot is busy: the pool, and the SSD to keep it"
    _finish(m, moves)
    for k in range(3, 6):  # 5 blocks: HBM, DRAM and the SSD keep 6, less one HBM slot a demotion holds
        _finish(m, _store_ready(m, [k])[1])
        assert all(set(e.copies) - {P} for e in m.index), "no block is left in the pool alone"
    assert m.stats.num_dropped == 0 and len(m.index) == 5


def test_a_victim_demoted_into_a_tier_that_may_drop_it_also_goes_to_one_that_keeps_it():
    m = make_manager((1, 1, 4), pool=(4, False))
    for k in (1, 2, 3):  # 1 goes down to DRAM; 2 finds HBM's slot busy, so the pool and the SSD take it
        _finish(m, _store_ready(m, [k])[1])
    plan, moves = _store_ready(m, [4])  # 3 leaves HBM; DRAM's victim 1 goes to the pool and the SSD
    assert sorted((mv.key, mv.src, mv.dst) for mv in moves if mv.key == 1) == [(1, D, P), (1, D, S)]
    _finish(m, moves)
    entry = m.index.get(1)
    assert set(entry.copies) == {P, S} and all(c.state is CopyState.READY for c in entry.copies.values())
    assert m.num_used(D) == 0, "DRAM's slot freed once both moves read it"
    assert m.stats.demotions[(D, P)] == m.stats.demotions[(D, S)] == 1 and m.stats.num_dropped == 0


def test_a_store_into_a_tier_that_may_drop_it_places_a_copy_below_that_keeps_it():
    m = make_manager((1, 1, 4), pool=(4, False))
    plan = m.prepare_store([1], P)
    assert sorted(p.tier for p in plan.all_placements) == [P, S]
    m.complete_store(plan, failed={(1, P)})  # the pool refused it: the SSD copy stands
    assert m.where(1) is S and m.stats.num_dropped == 0


def test_without_a_tier_below_a_block_may_live_in_the_pool_alone():
    tiers = [TierSlots(k, 1, make_policy(PolicyKind.LRU, 1)) for k in (H, D)]
    tiers.append(TierSlots(P, 2, make_policy(PolicyKind.LRU, 2), may_drop=True))
    m = TierManager(tiers)
    for k in range(3):
        _finish(m, _store_ready(m, [k])[1])
    assert m.stats.num_dropped == 0 and len(m.index) == 3
    assert any(set(e.copies) == {P} for e in m.index), "the pool is the last tier: it may be a block's only home"


def test_a_victim_leaving_to_two_tiers_is_not_taken_back_when_one_of_them_is_down():
    """Found by the state machine: HBM's victim left to the pool (which may drop it) and to the SSD
    (which keeps it); the pool's demotion failed for the tier being down, and HBM's policy took the
    victim back while the SSD's demotion still read it out, so the slot freed by that demotion would
    have stayed in the policy."""
    m = make_manager((1, 1, 1), pool=(2, False))
    first, _ = m.prepare_store([0]), m.prepare_store([1])
    m.complete_store(first)
    to_pool, to_ssd = m.prepare_store([2]).moves
    assert (to_pool.dst, to_ssd.dst) == (P, S) and to_pool.key == to_ssd.key == 0
    m.complete_move(to_pool.id, False, None, DropReason.TIER_DOWN)
    assert m.num_used(H) == 1 and m._tiers[H].policy.evict(1, lambda slot: False) is None  # not back in HBM's policy
    m.complete_move(to_ssd.id, True, (0,))
    assert m.where(0) is S and m.num_used(H) == 0
    assert m.prepare_store([3]).placements[0].tier is H  # HBM's freed slot is reused, its policy agrees


@pytest.mark.parametrize("failure", [DropReason.TIER_DOWN, DropReason.READ_FAILED])
def test_a_read_from_the_pool_leases_the_ssd_copy_to_fall_back_on(failure):
    """Issue 29, finding 7: a load (or a promotion) reading the pool's copy of a block that is on
    SSD too leases the SSD copy as its `fallback`, so the transfer can read it there when the pool
    fails. The pool copy is kept when its tier is down (it may come back), dropped when unreadable;
    either way the block stays, and the fallback's lease ends with the load."""
    m = make_manager((1, 1, 4), pool=(4, False), promote_to=P)
    plan = m.prepare_store([1], P)
    assert sorted(p.tier for p in plan.all_placements) == [P, S]
    m.complete_store(plan)
    load = m.prepare_load([1])
    (source,) = load.sources
    ssd = m.index.get(1).copies[S]
    assert (source.tier, source.fallback.tier, source.fallback.slot) == (P, S, ssd.slot)
    assert ssd.readers == 1, "leased beside the source: not evicted or freed while the load runs"
    m.complete_load(load, {1: failure})
    copies = m.index.get(1).copies
    assert copies[S].readers == 0 and (P in copies) == (failure == DropReason.TIER_DOWN)
    assert m.where(1) is (P if failure == DropReason.TIER_DOWN else S) and m.stats.num_dropped == 0
    assert m.stats.io_errors == (failure == DropReason.READ_FAILED)
