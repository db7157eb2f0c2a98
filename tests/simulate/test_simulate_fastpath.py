"""`store_now` / `load_now` (the simulator's synchronous path) decide exactly as the two-phase verbs.

The reference is the two-phase protocol driven the way a transfer engine whose every transfer
succeeds at once would drive it: `prepare_*`, then `complete_moves` on the moves returned, then on
what that returns, until nothing is left, then `complete_*` and the same again. Both managers see
the same requests; after each one, and at the end, their stats, every block's copies (tier, slot,
state, readers), hit counts, cached ready tiers, and each tier's eviction order must be equal.

Cost: ~15 s on two CPU cores (a slice of the Mooncake conversation trace for every policy and
mode, then random request sequences on tiny tiers).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.config import CacheMode
from kvtier.errors import KVTierError
from kvtier.deciding.manager import TierManager, TierSlots
from kvtier.policy import LRUPolicy, PolicyKind, make_policy
from kvtier.policy.admission import AdmissionKind, AdmissionRule
from kvtier.simulate.belady import BeladyPolicy, FutureAccesses
from kvtier.simulate.trace import load_trace
from kvtier.tiers.base import TierKind
from support.traces import TRACE_DIR, needs_traces

pytestmark = pytest.mark.slow  # seconds per test here: kept out of `make test-fast`

H, D, S = TierKind.HBM, TierKind.DRAM, TierKind.SSD
POLICIES = [*PolicyKind, "belady"]


def build(sizes, policy, mode, promote_to, admission, marks, future=None) -> TierManager:
    """Three tiers; the last admits per `admission`; every tier but the last has watermarks `marks`."""
    tiers = []
    for kind, n in zip((H, D, S), sizes):
        rule = admission if kind is S else AdmissionRule(AdmissionKind.ALL)
        made = BeladyPolicy(future) if policy == "belady" else make_policy(policy, n)
        tiers.append(TierSlots(kind, n, made, rule, *((1.0, 1.0) if kind is S else marks)))
    return TierManager(tiers, mode=mode, promote_to=promote_to)


def complete(m: TierManager, moves) -> None:
    while moves:
        moves = m.complete_moves([mv.id for mv in moves])


def serve_two_phase(m: TierManager, keys) -> list[TierKind]:
    """One request through the two-phase verbs; returns the tiers its hits were read from."""
    n = m.lookup(keys)
    tiers = []
    if n:
        plan = m.prepare_load(keys[:n])
        complete(m, plan.moves)
        tiers = [s.tier for s in plan.sources]
        complete(m, m.complete_load(plan))
    if n < len(keys):
        plan = m.prepare_store(keys[n:])
        complete(m, plan.moves)
        complete(m, m.complete_store(plan))
    return tiers


def serve_now(m: TierManager, keys) -> list[TierKind]:
    n = m.lookup(keys)
    tiers = [s.tier for s in m.load_now(keys[:n])] if n else []
    if n < len(keys):
        m.store_now(keys[n:])
    return tiers


def state(m: TierManager) -> dict:
    blocks = {e.key: (sorted((t, c.slot, c.state.value, c.readers) for t, c in e.copies.items()),
                      e.hits, e.pins, e.ready_tier, e.prefetched) for e in m.index}
    return {"stats": m.stats.snapshot(), "blocks": blocks, "in_flight": len(m.moves_in_flight()),
            "used": [m.num_used(t) for t in m.order]}


def eviction_orders(m: TierManager) -> list:
    """Every tier's policy emptied through `evict`: the order victims would leave in (destructive)."""
    return [m._tiers[t].policy.evict(len(m._tiers[t].policy), lambda key: False) for t in m.order]


def replay_both(requests, sizes, policy, mode, promote_to, admission, marks, check_every=1):
    futures = [FutureAccesses(requests) if policy == "belady" else None for _ in range(2)]
    ref, fast = (build(sizes, policy, mode, promote_to, admission, marks, f) for f in futures)
    for i, keys in enumerate(requests):
        for f in futures:
            if f is not None:
                f.begin_request(i)
        assert serve_two_phase(ref, keys) == serve_now(fast, keys), f"request {i}: hits read from other tiers"
        if i % check_every == 0:
            assert state(ref) == state(fast), f"request {i}: the paths diverged"
    assert state(ref) == state(fast)
    assert eviction_orders(ref) == eviction_orders(fast)
    return ref


TRACE = TRACE_DIR / "conversation_trace.jsonl"


@pytest.fixture(scope="module")
def trace_slice():
    return [r.hash_ids for r in load_trace(TRACE).requests[:1500]]


@needs_traces
@pytest.mark.parametrize("policy", POLICIES, ids=str)
@pytest.mark.parametrize("mode", list(CacheMode), ids=lambda m: m.value)
@pytest.mark.parametrize("promote_to", [D, None], ids=["promote-dram", "no-promotion"])
def test_real_trace_slice_same_decisions(trace_slice, policy, mode, promote_to):
    admission = AdmissionRule(AdmissionKind.REUSED, min_hits=1)
    ref = replay_both(trace_slice, (120, 500, 1500), policy, mode, promote_to, admission, (0.95, 0.85),
                      check_every=100)
    assert sum(ref.stats.evictions.values()) > 1000, "the slice must exercise eviction in every tier"
    assert sum(ref.stats.hits.values()) > 0


REQUESTS = st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=8).map(lambda ks: list(dict.fromkeys(ks))),
                    min_size=1, max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=REQUESTS, policy=st.sampled_from(POLICIES), mode=st.sampled_from(list(CacheMode)),
       promote_to=st.sampled_from([H, D, S, None]), admission=st.sampled_from(list(AdmissionKind)),
       sizes=st.tuples(st.integers(1, 4), st.integers(1, 6), st.integers(1, 8)),
       marks=st.sampled_from([(1.0, 1.0), (0.75, 0.5), (0.5, 0.25)]))
def test_random_requests_same_decisions(requests, policy, mode, promote_to, admission, sizes, marks):
    replay_both(requests, sizes, policy, mode, promote_to, AdmissionRule(admission), marks)


def test_repeated_key_in_one_request_joins_its_own_promotion():
    """A key twice in one load: the second read joins the promotion the first started, in both paths."""
    requests = [[1, 2, 3], [4, 5, 6, 7], [1, 2, 1, 2]]
    ref = replay_both(requests, (2, 3, 8), PolicyKind.LRU, CacheMode.EXCLUSIVE, D,
                      AdmissionRule(AdmissionKind.ALL), (1.0, 1.0))
    assert sum(ref.stats.promotions.values()) > 0


class ReentrantLRU(LRUPolicy):
    """Calls back into the manager from `insert`, once: a policy breaking its purity contract."""

    manager: TierManager | None = None

    def insert(self, key):
        super().insert(key)
        m, self.manager = self.manager, None
        if m is not None:
            m.store_now([99])


def test_synchronous_verbs_do_not_nest_and_recover():
    policy = ReentrantLRU()
    m = TierManager([TierSlots(H, 4, policy), TierSlots(S, 4, LRUPolicy())])
    policy.manager = m
    with pytest.raises(KVTierError, match="do not nest"):
        m.store_now([1])
    m.store_now([2])  # the failed call left the manager usable
    assert m.where(2) is H and not m.moves_in_flight()
