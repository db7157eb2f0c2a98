"""The manager's residency log (kvtier/deciding/residency.py): replayed in order, it equals the set
of READY (key, tier) copies below HBM, through random stores, loads, prefetches, out-of-order
completions and failures (the state machine of tests/test_manager.py), the synchronous verbs
(`store_now`/`load_now`, whose demotions take `_finish_demotion`'s inlined path), the resident
verbs' C paths, adoption and `forget_shared`. Cost: ~5 s.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from kvtier.config import CacheMode
from kvtier.deciding.index import CopyState
from kvtier.deciding.residency import REMOVED, STORED, ResidencyLog
from kvtier.errors import ConfigError
from kvtier.observing.stats import DropReason
from kvtier.tiers.base import TierKind

from test_manager import KEYS, MACHINE_SETUP, ManagerMachine, make_manager
from test_resident import _load, _store

H, D, P, S = TierKind.HBM, TierKind.DRAM, TierKind.POOL, TierKind.SSD


def ready_copies(m) -> set[tuple[object, TierKind]]:
    """The (key, tier) copies the manager holds READY, HBM left out (the engine publishes its own)."""
    return {(e.key, t) for e in m.index for t, c in e.copies.items() if c.state is CopyState.READY and t != H}


class Replay:
    """Applies a log's entries to a set, checking each: a store of a copy not held, a removal of one held."""

    def __init__(self, log: ResidencyLog) -> None:
        self.log, self.held = log, set()
        self.num_entries = 0

    def catch_up(self) -> set[tuple[object, TierKind]]:
        batch = self.log.take()
        assert not batch.dropped
        for op, tier, key in batch.entries:
            assert tier != H, "an HBM copy was logged"
            if op is STORED:
                assert (key, tier) not in self.held, f"{key} stored twice in {tier.name}"
                self.held.add((key, tier))
            else:
                assert (key, tier) in self.held, f"{key} removed from {tier.name} where it was not held"
                self.held.remove((key, tier))
        self.num_entries += len(batch.entries)
        return self.held


class ResidencyMachine(ManagerMachine):
    """ManagerMachine with a residency log set from the start, and the shared tier's verbs."""

    @initialize(**MACHINE_SETUP)
    def setup(self, policy, mode, sizes, marks, admission, pool):
        super().setup(policy, mode, sizes, marks, admission, pool)
        self.log = ResidencyLog(1 << 20)
        self.m.log_residency(self.log)
        self.replay = Replay(self.log)

    @rule(keys=KEYS)
    def adopt_from_pool(self, keys):
        if P in self.m.order:
            # keys not indexed yet: one evicted by this very call and adopted again would be a
            # loss ManagerMachine's own bookkeeping (between rules) cannot see
            fresh = [100 + k for k in keys if self.m.index.get(100 + k) is None]
            adopted, moves = self.m.adopt_shared(P, fresh)
            for key, slot in adopted:  # as another process stored them: bytes there, READY now
                self.data[(P, slot)] = key
                self.ever_ready.add(key)
            self._queue_moves(moves)

    @rule(keys=KEYS)
    def pool_forgets(self, keys):
        if P in self.m.order:
            self.m.forget_shared(P, list(keys) + [100 + k for k in keys])

    @invariant()
    def the_log_replays_to_the_ready_copies(self):
        assert self.replay.catch_up() == ready_copies(self.m)


TestResidencyMachine = ResidencyMachine.TestCase
TestResidencyMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["store", "store", "load"]),
                              st.lists(st.integers(0, 15), min_size=1, max_size=6, unique=True)),
                    min_size=1, max_size=25),
       sizes=st.sampled_from([(1, 2, 3), (2, 2, 4), (1, 1, 2)]),
       mode=st.sampled_from(list(CacheMode)))
def test_the_synchronous_verbs_log_what_they_leave_ready(ops, sizes, mode):
    m = make_manager(sizes, mode=mode)
    replay = Replay(log := ResidencyLog(1 << 16))
    m.log_residency(log)
    for op, keys in ops:
        m.store_now(keys) if op == "store" else m.load_now(keys)
        assert replay.catch_up() == ready_copies(m)


def test_a_demotion_through_the_inlined_path_logs_stored_then_removed(monkeypatch):
    from kvtier.deciding.manager import TierManager, TierSlots
    from kvtier.policy import make_policy

    m = TierManager([TierSlots(D, 1, make_policy("lru", 1)), TierSlots(S, 3, make_policy("lru", 3))])
    log = ResidencyLog(64)
    m.log_residency(log)
    fast = []
    finish = m._finish_demotion
    monkeypatch.setattr(m, "_finish_demotion", lambda *a: fast.append(finish(*a)) or fast[-1])
    m.store_now(["a"])
    m.store_now(["b"])  # DRAM full: "a" is demoted to SSD (its slot frees only then: "b" goes to SSD)
    assert fast == [True]  # the inlined path: the source unread, the only other copy
    assert log.take().entries == ((STORED, D, "a"), (STORED, S, "a"), (REMOVED, D, "a"), (STORED, S, "b"))


def test_a_failed_write_is_never_logged_and_a_failed_read_logs_the_copy_leaving():
    m = make_manager((1, 2, 2), promote_to=None)
    log = ResidencyLog(64)
    m.log_residency(log)
    plan = m.prepare_store(["a", "b"], D)
    m.complete_store(plan, failed=[("a", D)])
    assert log.take().entries == ((STORED, D, "b"),)
    load = m.prepare_load(["b"])
    m.complete_load(load, {"b": DropReason.CHECKSUM})
    assert log.take().entries == ((REMOVED, D, "b"),)
    assert ready_copies(m) == set()


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["store", "store", "load"]),
                                st.lists(st.integers(0, 11), min_size=1, max_size=4, unique=True)),
                      min_size=1, max_size=30),
       num_slots=st.integers(2, 6))
def test_the_resident_verbs_log_as_the_general_ones(steps, num_slots):
    from kvtier.deciding.manager import TierManager, TierSlots
    from kvtier.policy import make_policy

    m = TierManager([TierSlots(D, num_slots, make_policy("lru", num_slots))])  # DRAM alone: its victims drop
    m.serve_resident({D})
    replay = Replay(log := ResidencyLog(1 << 10))
    m.log_residency(log)
    for op, keys in steps:
        _store(m, keys, None, True) if op == "store" else _load(m, keys, True)
        assert replay.catch_up() == ready_copies(m)


def test_the_resident_store_logs_its_copies_and_leaves_evictions_to_the_general_path():
    from kvtier.deciding.manager import TierManager, TierSlots
    from kvtier.policy import make_policy

    m = TierManager([TierSlots(D, 2, make_policy("lru", 2))])
    m.serve_resident({D})
    log = ResidencyLog(16)
    m.log_residency(log)
    assert _store(m, ["a", "b"], None, True)  # room for both: the C path
    assert log.take().entries == ((STORED, D, "a"), (STORED, D, "b"))
    assert not _store(m, ["c"], None, True)  # full: evicting in C would lose the victim's key
    assert log.take().entries == ((REMOVED, D, "a"), (STORED, D, "c"))
    assert m.stats.dropped[DropReason.EVICTED] == 1
    m.log_residency(None)
    assert _store(m, ["d"], None, True)  # unlogged, the C path evicts again
    assert len(log) == 0


def test_adopted_blocks_are_logged_as_stored():
    m = make_manager((1, 2, 3))
    log = ResidencyLog(16)
    m.log_residency(log)
    assert m.adopt(S, [("x", 0, (1,)), ("y", 1, (2,))]) == 2
    assert log.take().entries == ((STORED, S, "x"), (STORED, S, "y"))


def test_the_log_drops_stores_first_and_counts_by_tier_and_op():
    log = ResidencyLog(2)
    for key in "abc":
        log.append(STORED, D, key)
    for key in "abc":
        log.append(REMOVED, S, key)
    log.append(STORED, H, "z")  # HBM: not logged at all
    batch = log.take()
    assert batch.entries == ((STORED, D, "a"), (STORED, D, "b"), (REMOVED, S, "a"), (REMOVED, S, "b"))
    assert batch.dropped == {(D, STORED): 1, (S, REMOVED): 1}
    assert log.take().entries == () and log.take().dropped == {}
    with pytest.raises(ConfigError, match="limit"):
        ResidencyLog(0)
