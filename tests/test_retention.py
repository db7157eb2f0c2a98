"""Retention hints in the manager (kvtier/deciding/retention.py, `TierManager.apply_hint`).

Cost: about two seconds; tiers of a few slots, every policy the manager builds.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.deciding.index import READY
from kvtier.deciding.manager import TierManager, TierSlots
from kvtier.deciding.retention import HintError, HintLimits
from kvtier.errors import ConfigError, KVTierError
from kvtier.kinds import TierKind
from kvtier.policy import PolicyKind, make_policy

D, S = TierKind.DRAM, TierKind.SSD
POLICIES = list(PolicyKind)


def manager(num_slots: int = 4, kind: PolicyKind = PolicyKind.LRU, limits: HintLimits | None = None,
            ssd_slots: int = 0) -> TierManager:
    tiers = [TierSlots(D, num_slots, make_policy(kind, num_slots))]
    if ssd_slots:
        tiers.append(TierSlots(S, ssd_slots, make_policy(kind, ssd_slots)))
    m = TierManager(tiers)
    if limits is not None:
        m.configure_hints(limits)
    return m


def held(m: TierManager, keys) -> list:
    return [k for k in keys if m.where(k) is not None]


@pytest.mark.parametrize("kind", POLICIES)
def test_closed_session_blocks_go_first_and_a_shared_prefix_stays(kind):
    m = manager(4, kind)
    m.store_now([1, 2])
    m.apply_hint([1, 2], session="a", now=0)
    m.store_now([3])
    m.apply_hint([1, 3], session="b", now=1)  # 1 is a prefix both sessions use
    m.store_now([4])  # full now; 4 is unhinted
    m.apply_hint([1, 2], session="a", closed=True, now=2)
    m.store_now([5])  # one victim: 2, the only block every user of which closed
    assert held(m, [1, 2, 3, 4, 5]) == [1, 3, 4, 5]
    assert m.stats.hints["doomed_evicted"] == 1 and m.stats.hints["closed"] == 1


def test_doomed_go_in_the_order_they_were_doomed_then_the_policy_resumes():
    m = manager(4)
    for key, session in ((1, "a"), (2, "b"), (3, "c"), (4, "d")):
        m.store_now([key])
        m.apply_hint([key], session=session, now=0)
    m.apply_hint([3], session="c", closed=True, now=1)
    m.apply_hint([2], session="b", closed=True, now=2)
    m.store_now([5])
    assert held(m, [1, 2, 3, 4, 5]) == [1, 2, 4, 5]  # 3 was doomed first
    m.store_now([6])
    assert held(m, [1, 2, 4, 5, 6]) == [1, 4, 5, 6]
    m.store_now([7])  # nothing doomed is left: LRU's oldest, 1
    assert held(m, [1, 4, 5, 6, 7]) == [4, 5, 6, 7]


def test_unhinted_use_and_reopening_keep_a_block():
    m = manager(3)
    m.store_now([1, 2])
    m.apply_hint([1, 2], session="a", now=0)
    m.apply_hint([1], now=1)  # a request without a session used 1
    m.apply_hint([1, 2], session="a", closed=True, now=2)
    m.apply_hint([2], session="again", now=3)  # 2 is used again by an open session: stale entry
    m.store_now([3, 4])  # two victims, by LRU order, none doomed
    assert m.stats.hints["doomed_evicted"] == 0
    assert held(m, [1, 2, 3, 4]) == [2, 3, 4]


def test_a_doomed_block_demoted_is_doomed_below_too():
    m = manager(2, ssd_slots=3)
    for key in (10, 11, 12):
        m.store_now([key])
        m.apply_hint([key], now=0)
    m.store_now([1])
    m.apply_hint([1], session="a", closed=True, now=1)
    m.store_now([13])  # DRAM's victim is doomed 1, not its LRU block 11: 1 goes down to the SSD
    assert m.where(1) is S and m.where(11) is D and m.stats.hints["doomed_evicted"] == 1
    m.store_now([14])
    m.store_now([15])  # the SSD evicts: 1 again as a doomed victim there
    assert m.where(1) is None and m.stats.hints["doomed_evicted"] == 2


@pytest.mark.parametrize("kind", POLICIES)
def test_retention_protects_in_the_last_tier_until_the_deadline(kind):
    m = manager(4, kind, HintLimits(retain_fraction_per_tenant=0.5, retain_fraction=0.5))
    m.store_now([1])
    m.apply_hint([1], retain_s=10, now=0)
    m.store_now([2, 3, 4, 5, 6, 7])  # 1 is the oldest, but retained
    assert m.where(1) is D
    m.apply_hint([7], now=10.5)  # the clock passes the deadline
    m.store_now([8, 9, 10, 11])
    assert m.where(1) is None and m.num_retained() == 0


def test_retention_is_kept_low_not_in_an_upper_tier():
    m = manager(2, ssd_slots=4, limits=HintLimits(retain_fraction_per_tenant=0.5))
    m.store_now([1])
    m.apply_hint([1], retain_s=100, now=0)
    m.store_now([2, 3, 4, 5, 6, 7])
    assert m.where(1) is S  # demoted as usual out of DRAM, then kept in the SSD


def test_deadlines_only_grow():
    m = manager(4, limits=HintLimits(retain_fraction_per_tenant=0.5))
    m.store_now([1])
    m.apply_hint([1], retain_s=100, now=0)
    m.apply_hint([1], retain_s=5, now=1)  # would shorten to 6: ignored
    m.apply_hint([2], now=50)
    assert m.num_retained() == 1


def test_retention_budget_per_tenant_and_overall():
    m = manager(8, limits=HintLimits(retain_fraction_per_tenant=0.25, retain_fraction=0.375))
    m.store_now(range(8))
    m.apply_hint([0, 1, 2], retain_s=60, tenant="greedy", now=0)  # 2 of 3 fit: 0.25 x 8
    assert m.num_retained("greedy") == 2 and m.stats.hints["over_budget"] == 1
    m.apply_hint([5, 6], retain_s=60, tenant="other", now=0)  # 1 more fits overall: 0.375 x 8
    assert m.num_retained("other") == 1 and m.num_retained() == 3 and m.stats.hints["over_budget"] == 2
    m.store_now(range(100, 120))  # the tier still has victims: all but the retained blocks go
    assert held(m, range(8)) == [0, 1, 5]


def test_session_bounds_are_counted():
    m = manager(8, limits=HintLimits(max_sessions=2, max_session_blocks=2))
    m.store_now([1, 2, 3])
    m.apply_hint([1, 2, 3], session="a", now=0)
    assert m.stats.hints["session_blocks_over"] == 1
    m.apply_hint([1], session="b", now=0)
    m.apply_hint([1], session="a", now=1)  # a is now the more recently used of the two
    m.apply_hint([2], session="c", now=2)  # a third: b, the least recently used, is forgotten
    assert m.stats.hints["sessions_forgotten"] == 1 and m._hints.num_sessions == 2
    m.apply_hint([1, 2, 3], session="a", closed=True, now=3)
    m.apply_hint([2], session="c", closed=True, now=3)
    m.apply_hint([1], session="b", closed=True, now=3)  # b comes back, forgotten: a new session that closes
    assert m.stats.hints["closed"] == 3
    m.store_now([4, 5, 6, 7, 8, 9])
    # 2 is doomed (a and c closed); 1 was listed by the forgotten b (unhinted from then on), 3 was
    # over a's bound
    assert m.stats.hints["doomed_evicted"] == 1 and m.where(2) is None and m.where(1) is not None


def test_clients_that_never_close_cannot_shut_hints_off_for_new_sessions():
    m = manager(8, limits=HintLimits(max_sessions=100))
    m.store_now(range(8))
    for i in range(100_000):  # sessions opened and abandoned
        m.apply_hint([i % 4], session=f"abandoned-{i}", now=i)
    assert m._hints.num_sessions == 100 and m.stats.hints["sessions_forgotten"] == 100_000 - 100
    m.apply_hint([6], session="new", now=100_000)
    m.apply_hint([6], session="new", closed=True, now=100_001)
    m.store_now([8])
    assert m.where(6) is None, "a new session's close still dooms its block first"
    assert all(m.where(k) is not None for k in range(4)), "what forgotten sessions used is not doomed"


@pytest.mark.parametrize(("fields", "reason"), [
    ({"session": ""}, "bad_session"), ({"session": "x" * 129}, "bad_session"), ({"session": "é"}, "bad_session"),
    ({"session": 7}, "bad_session"), ({"retain_s": 0}, "bad_retain_s"), ({"retain_s": float("nan")}, "bad_retain_s"),
    ({"retain_s": 3601}, "bad_retain_s"), ({"retain_s": True}, "bad_retain_s"), ({"closed": 1}, "bad_closed"),
    ({"closed": True}, "closed_without_session"), ({"now": float("inf")}, "bad_now"), ({"now": None}, "bad_now"),
])
def test_bad_hints_are_refused_named_and_counted(fields, reason):
    m = manager(4)
    m.store_now([1])
    with pytest.raises(HintError, match=reason) as caught:
        m.apply_hint([1], **{"now": 0, **fields})
    assert caught.value.reason == reason and m.stats.hints[f"refused:{reason}"] == 1
    assert "applied" not in m.stats.hints


@pytest.mark.parametrize(("field", "value"), [("max_sessions", 0), ("max_session_blocks", 1.5),
                                              ("retain_fraction", 1.0), ("retain_fraction_per_tenant", -0.1),
                                              ("max_retain_s", 0)])
def test_bad_limits_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"hints.{field}"):
        HintLimits(**{field: value})


def test_limits_are_set_before_the_first_hint():
    m = manager(4)
    m.apply_hint([1], now=0)
    with pytest.raises(KVTierError, match="already applied"):
        m.configure_hints(HintLimits())


def test_hints_turn_the_resident_store_path_off():
    m = manager(4)
    m.serve_resident([D])
    assert m.place_resident([1]) is not None
    m.apply_hint([1], now=0)
    assert m.place_resident([2]) is None


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 12), min_size=1, max_size=4),
                          st.sampled_from([None, "a", "b", "c"]), st.booleans(), st.sampled_from([None, 1.0, 5.0])),
                max_size=30),
       st.sampled_from(POLICIES))
def test_hinted_manager_keeps_its_invariants(requests, kind):
    """Any sequence of loads, stores and hints: slots never over-used, the retention budget
    kept, and every READY copy either in its tier's policy (so it can be evicted) or set aside
    for a retention hint in force."""
    m = manager(5, kind, HintLimits(retain_fraction_per_tenant=0.5, retain_fraction=0.5), ssd_slots=4)
    for now, (keys, session, closed, retain_s) in enumerate(requests):
        keys = list(dict.fromkeys(keys))
        n = m.lookup(keys)
        if n:
            m.load_now(keys[:n])
        m.store_now(keys[n:])
        m.apply_hint(keys, session=session, closed=closed and session is not None, retain_s=retain_s, now=now)
        assert m.num_used(D) <= 5 and m.num_used(S) <= 4 and m.num_retained() <= 2
        for tier in (D, S):
            policy = m._tiers[tier].policy
            for slot, block in enumerate(m.index.owner[tier]):
                if block >= 0 and m.index.state[tier][slot] == READY:
                    key = m.index.key_of(block)
                    tracked = (slot if getattr(policy, "tracks_slots", False) else key) in policy
                    assert tracked or (key in m._held and m._hints.retained(key)), (tier, key)


def test_chain_arc_sends_a_closed_key_to_the_cold_end():
    from kvtier.policy.base import HintKind
    from kvtier.policy.chain import ChainARCPolicy

    policy = ChainARCPolicy(8)
    for key in "abcd":
        policy.insert(key)
    policy.note_hint("c", HintKind.CLOSED)
    policy.note_hint("b", HintKind.RETAINED)  # changes nothing
    policy.note_hint("zz", HintKind.CLOSED)  # not resident: ignored
    assert policy.evict(4, lambda key: False) == ["c", "a", "b", "d"]


def test_the_two_phase_verbs_take_a_doomed_victim_too():
    m = manager(3)
    plan = m.prepare_store([1, 2, 3])
    m.complete_store(plan)
    m.apply_hint([1, 2, 3], now=0)  # unhinted use
    m.apply_hint([2], session="a", now=1)
    m.apply_hint([2], session="a", closed=True, now=2)  # 2 was also used unhinted: not doomed
    plan = m.prepare_store([4])
    assert [p.key for p in plan.placements] == [4] and m.where(1) is None  # LRU's choice
    m.complete_store(plan)
    m.apply_hint([4], session="b", closed=True, now=3)
    m.complete_store(m.prepare_store([5]))
    assert m.where(4) is None and m.where(2) is D  # 4 is doomed: it goes before 2, the LRU block


def test_retention_is_not_spent_on_blocks_not_stored():
    m = manager(4, limits=HintLimits(retain_fraction_per_tenant=0.5))
    m.store_now([1])
    m.apply_hint([1, 2, 3], retain_s=10, now=0)
    assert m.num_retained() == 1 and m.stats.hints["over_budget"] == 0


def test_a_doomed_block_loses_its_retention():
    m = manager(4, limits=HintLimits(retain_fraction_per_tenant=0.5))
    m.store_now([1, 2])
    m.apply_hint([1, 2], session="a", retain_s=100, now=0)
    m.apply_hint([2], retain_s=100, now=0)  # 2 was also used unhinted: not doomed, kept retained
    assert m.num_retained() == 2
    m.apply_hint([1], session="a", closed=True, now=1)
    assert m.num_retained() == 1
    m.store_now([3, 4, 5])
    assert m.where(1) is None and m.where(2) is D and m.stats.hints["doomed_evicted"] == 1
