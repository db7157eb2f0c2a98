"""The `EvictionPolicy` contract (`kvtier.testing.policy_contract`), run unchanged against every
policy, plus each policy's own traits.

Cost: 2-5 s on one CPU core, most of it hypothesis's stateful runs (3 policies x 60 examples
x 60 steps). Pure in-memory bookkeeping: no files, sockets, threads or sleeps.

Atomicity ("on None nothing changed") is checked by behaviour, never by peeking at internals: a twin
policy receives the same history minus the failed call, and both must then agree on length,
membership and the full order in which they evict everything that is left.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Iterable

import pytest

from kvtier.errors import ConfigError
from kvtier.policy import (
    AdmissionKind,
    AdmissionRule,
    ARCPolicy,
    ChainARCPolicy,
    EvictionPolicy,
    LRUPolicy,
    PolicyKind,
    S3FIFOPolicy,
    SlotLRUPolicy,
    make_policy,
)
from kvtier.testing.policy_contract import CAPACITY_HINT, MakePolicy, PolicyContract, drain, never, policy_machine
from kvtier.testing.policy_contract import with_history as _with_history


def with_history(kind: PolicyKind) -> EvictionPolicy:
    return _with_history(lambda hint: make_policy(kind, hint))


@pytest.fixture(params=list(PolicyKind), ids=lambda kind: kind.value)
def kind(request: pytest.FixtureRequest) -> PolicyKind:
    return request.param


class TestEveryPolicy(PolicyContract):
    """The whole contract against each of kvtier's policies."""

    @pytest.fixture
    def new_policy(self, kind: PolicyKind) -> MakePolicy:
        return lambda capacity_hint: make_policy(kind, capacity_hint)


TestLRUMachine = policy_machine(lambda hint: make_policy(PolicyKind.LRU, hint), "LRU")
TestS3FIFOMachine = policy_machine(lambda hint: make_policy(PolicyKind.S3FIFO, hint), "S3FIFO")
TestARCMachine = policy_machine(lambda hint: make_policy(PolicyKind.ARC, hint), "ARC")
TestChainARCMachine = policy_machine(lambda hint: make_policy(PolicyKind.CHAIN_ARC, hint), "ChainARC")
TestKeyedLRUMachine = policy_machine(lambda hint: LRUPolicy(), "KeyedLRU")


class TestKeyedLRU(PolicyContract):
    """`LRUPolicy`, the LRU for any hashable keys, passes the same contract."""

    @pytest.fixture
    def new_policy(self) -> MakePolicy:
        return lambda capacity_hint: LRUPolicy()


# --- policy-specific behaviour -----------------------------------------------------------------


def replay(policy: EvictionPolicy, accesses: Iterable[Hashable], capacity: int) -> int:
    """Replays `accesses` through a cache of `capacity` keys run by `policy`; returns the hits."""
    hits = 0
    for key in accesses:
        if key in policy:
            policy.touch(key)
            hits += 1
            continue
        if len(policy) >= capacity:
            assert policy.evict(1, never) is not None
        policy.insert(key)
    return hits


@pytest.mark.parametrize("lru", [LRUPolicy, SlotLRUPolicy], ids=["keyed", "slots"])
def test_lru_evicts_in_exact_recency_order(lru) -> None:
    policy = lru()
    for key in range(6):
        policy.insert(key)
    policy.touch(2)
    policy.touch(0)
    policy.touch(4)
    assert policy.evict(2, {1}.__contains__) == [3, 5]
    assert drain(policy) == [1, 2, 0, 4]


def test_s3fifo_keeps_a_hot_set_through_a_scan_that_flushes_lru() -> None:
    capacity = 100
    hot = [("hot", i) for i in range(20)]
    warm_then_scan = hot * 5 + [("cold", i) for i in range(1000)]
    s3fifo, lru = S3FIFOPolicy(capacity), LRUPolicy()
    replay(s3fifo, warm_then_scan, capacity)
    replay(lru, warm_then_scan, capacity)
    assert replay(s3fifo, hot, capacity) == len(hot)
    assert replay(lru, hot, capacity) == 0


def test_untouched_keys_leave_oldest_first_and_protected_ones_keep_their_place(
    kind: PolicyKind,
) -> None:
    """Not the interface contract, but true of all three: without touches they degrade to FIFO."""
    policy = make_policy(kind, CAPACITY_HINT)
    for key in range(6):
        policy.insert(key)
    assert policy.evict(2, {0, 1}.__contains__) == [2, 3]
    assert drain(policy) == [0, 1, 4, 5]


@pytest.mark.parametrize("protect_every", [0, 2, 3])
def test_evict_n_matches_n_single_evictions(kind: PolicyKind, protect_every: int) -> None:
    """Not the interface contract, but true of all three: batching does not change the choice."""
    batched, single = with_history(kind), with_history(kind)
    resident = [k for k in range(40) if k in batched]
    protected = set(resident[::protect_every]) if protect_every else set()
    n = len(resident) - len(protected) - 1
    victims = batched.evict(n, protected.__contains__)
    assert victims == [single.evict(1, protected.__contains__)[0] for _ in range(n)]
    assert drain(batched) == drain(single)


def test_s3fifo_readmits_a_ghost_straight_to_main() -> None:
    policy = S3FIFOPolicy(capacity_hint=10, small_ratio=0.1, ghost_ratio=1.0)
    for key in "abc":
        policy.insert(key)
    assert policy.evict(1, never) == ["a"]  # from small, into the ghost
    policy.insert("a")  # a ghost: into main, which is evicted only once small is drained
    policy.insert("d")
    assert drain(policy) == ["b", "c", "d", "a"]


def test_s3fifo_clears_the_frequency_of_keys_moved_to_main() -> None:
    policy = S3FIFOPolicy(capacity_hint=10, small_ratio=0.2)  # small's target share: 2 keys
    for key in "abx":
        policy.insert(key)
    for _ in range(3):
        policy.touch("a")
    policy.touch("b")
    assert policy.evict(1, never) == ["x"]  # a and b were touched: moved to main, counts cleared
    assert drain(policy) == ["a", "b"]  # main is plain FIFO again until they are touched anew


def test_arc_keeps_frequent_keys_through_scans_better_than_lru() -> None:
    capacity = 40
    frequent = [("f", i) for i in range(10)]
    accesses = []
    for round_ in range(20):
        accesses += frequent * 2 + [("scan", round_, i) for i in range(50)]
    arc_hits = replay(ARCPolicy(capacity), accesses, capacity)
    lru_hits = replay(LRUPolicy(), accesses, capacity)
    assert lru_hits == 10 * 20  # only the second pass of each round
    assert arc_hits == 10 + 20 * 19  # both passes, once the first round promoted them to T2


def test_arc_adapts_its_target_when_the_working_set_shifts() -> None:
    """Stale frequent keys hold T2; a new working set fitting only if T1 grows must win it back."""
    capacity = 40
    arc, lru = ARCPolicy(capacity), LRUPolicy()
    stale = [("stale", i) for i in range(20)] * 3
    replay(arc, stale, capacity)
    replay(lru, stale, capacity)
    working = [("w", i) for i in range(35)] * 30
    arc_hits = replay(arc, working, capacity)
    lru_hits = replay(lru, working, capacity)
    assert arc.target_t1 > 0
    assert arc_hits >= lru_hits - 2 * 35  # at most about two cycles slower to settle than LRU


@pytest.mark.parametrize("batched", [True, False], ids=["evict(3)", "3x evict(1)"])
def test_arc_evicts_from_t1_only_while_it_exceeds_its_target(batched: bool) -> None:
    arc = ARCPolicy(capacity_hint=4)
    for key in "abcd":
        arc.insert(key)
    assert arc.evict(1, never) == ["a"]  # T1's least recent, into B1
    arc.insert("a")  # a B1 hit: T1 was too small, so p grows to 1 and "a" enters T2
    assert arc.target_t1 == 1
    victims = arc.evict(3, never) if batched else [arc.evict(1, never)[0] for _ in range(3)]
    assert victims == ["b", "c", "a"]  # |T1| 3 > 1, 2 > 1, then 1 == p: from T2


def test_arc_forgets_ghosts_beyond_its_capacity_hint() -> None:
    arc = ARCPolicy(capacity_hint=4)
    for key in "abcd":
        arc.insert(key)
    assert arc.evict(1, never) == ["a"]  # T1 3 + B1 1 == c
    arc.insert("e")  # T1 4 + B1 1 > c: "a" is forgotten
    arc.insert("a")  # so this is a plain miss, not a B1 hit
    assert arc.target_t1 == 0


def test_s3fifo_forgets_ghosts_beyond_ghost_ratio() -> None:
    policy = S3FIFOPolicy(capacity_hint=10, small_ratio=0.1, ghost_ratio=0.1)  # one ghost
    for key in "abcd":
        policy.insert(key)
    assert policy.evict(2, never) == ["a", "b"]  # the ghost now remembers only "b"
    policy.insert("a")  # forgotten: into small, behind c and d
    policy.insert("b")  # a ghost: into main
    assert drain(policy) == ["c", "d", "a", "b"]


# --- factory and admission ---------------------------------------------------------------------


def test_make_policy_builds_each_kind() -> None:
    assert isinstance(make_policy(PolicyKind.LRU, 4), SlotLRUPolicy)
    assert isinstance(make_policy("s3fifo", 4, small_ratio=0.2, max_freq=2), S3FIFOPolicy)
    assert isinstance(make_policy(PolicyKind.ARC, 4), ARCPolicy)


@pytest.mark.parametrize(
    ("kind", "capacity_hint", "params", "named"),
    [
        ("mru", 4, {}, "policy.kind"),
        (PolicyKind.LRU, 0, {}, "capacity_hint"),
        (PolicyKind.ARC, True, {}, "capacity_hint"),
        (PolicyKind.LRU, 4, {"small_ratio": 0.1}, "small_ratio"),
        (PolicyKind.S3FIFO, 4, {"ghost_size": 3}, "ghost_size"),
        (PolicyKind.S3FIFO, 4, {"small_ratio": 1.0}, "small_ratio"),
        (PolicyKind.S3FIFO, 4, {"ghost_ratio": -0.5}, "ghost_ratio"),
        (PolicyKind.S3FIFO, 4, {"ghost_ratio": float("inf")}, "ghost_ratio"),
        (PolicyKind.S3FIFO, 4, {"max_freq": 0}, "max_freq"),
        (PolicyKind.S3FIFO, 4, {"max_freq": 2.5}, "max_freq"),
        (PolicyKind.S3FIFO, 4, {"max_freq": 256}, "max_freq"),  # a count is a byte
    ],
)
def test_make_policy_names_the_bad_parameter(kind, capacity_hint, params, named) -> None:
    with pytest.raises(ConfigError, match=named):
        make_policy(kind, capacity_hint, **params)


@pytest.mark.parametrize(
    ("rule", "demoted", "hits", "admitted"),
    [
        (AdmissionRule(AdmissionKind.ALL), False, 0, True),
        (AdmissionRule(AdmissionKind.EVICTED), True, 0, True),
        (AdmissionRule(AdmissionKind.EVICTED), False, 5, False),
        (AdmissionRule(AdmissionKind.REUSED, min_hits=2), False, 2, True),
        (AdmissionRule(AdmissionKind.REUSED, min_hits=2), False, 1, False),
        (AdmissionRule(AdmissionKind.REUSED, min_hits=2), True, 1, False),
        (AdmissionRule(AdmissionKind.REUSED, min_hits=2, allow_demoted=True), True, 0, True),
        (AdmissionRule(AdmissionKind.REUSED, min_hits=0), False, 0, True),
    ],
)
def test_admission_rules(rule: AdmissionRule, demoted: bool, hits: int, admitted: bool) -> None:
    assert rule.admits(demoted=demoted, hits=hits) is admitted


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"kind": "all"}, "admission.kind"),
        ({"kind": AdmissionKind.REUSED, "min_hits": -1}, "admission.min_hits"),
        ({"kind": AdmissionKind.REUSED, "min_hits": True}, "admission.min_hits"),
        ({"kind": AdmissionKind.REUSED, "allow_demoted": 1}, "admission.allow_demoted"),
    ],
)
def test_admission_rule_names_the_bad_field(fields: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        AdmissionRule(**fields)


def test_slot_lru_orders_as_the_keyed_lru_and_refuses_keys_that_are_not_slot_numbers() -> None:
    """The manager's LRU over slot numbers evicts in exactly the keyed LRU's order, across growth."""
    import random

    rng = random.Random(7)
    keyed, slots = LRUPolicy(), SlotLRUPolicy(4)  # keys go up to 199: the arrays grow past the hint
    for step in range(5000):
        key, op = rng.randrange(200), rng.random()
        victims = []
        for policy in (keyed, slots):
            if op < 0.4 and key not in policy:
                policy.insert(key)
            elif op < 0.7:
                policy.touch(key)
            elif op < 0.8:
                policy.remove(key)
            elif op < 0.9:
                victims.append(policy.evict(3, lambda k: k % 7 == 0))  # some protected: may be None
        assert len(keyed) == len(slots) and victims[:1] == victims[1:], f"step {step}"
    assert list(slots) == list(keyed._order)
    assert drain(slots) == drain(keyed)
    for bad in ("a", -1, 1.5, b"k", None):
        with pytest.raises(TypeError, match="slot numbers"):
            SlotLRUPolicy(4).insert(bad)


def test_slot_lru_refuses_a_protected_rule_that_changes_it_and_is_unchanged_when_the_rule_raises() -> None:
    policy = SlotLRUPolicy(2)
    for slot in (5, 1, 9):
        policy.insert(slot)

    def meddles(slot: int) -> bool:
        policy.remove(9)
        return False

    with pytest.raises(RuntimeError, match="changed the policy"):
        policy.evict_one(meddles)
    policy.insert(9)

    def fails(slot: int) -> bool:
        if slot == 9:
            raise ValueError("rule failed")
        return slot == 5 or slot == 1

    for evict in (lambda: policy.evict_one(fails), lambda: policy.evict(1, fails)):
        with pytest.raises(ValueError, match="rule failed"):
            evict()
        assert list(policy) == [5, 1, 9]  # a victim is taken only once the walk ends well
    with pytest.raises(TypeError, match="slot numbers"):
        policy.insert(2**31)
    assert 2**31 not in policy and policy.nbytes >= 8 * 10


# --- chain-aware ARC ---------------------------------------------------------------------------


def chain_arc_with(keys: Iterable[Hashable], touched: Iterable[Hashable] = ()) -> ChainARCPolicy:
    policy = ChainARCPolicy(16)
    for key in keys:
        policy.insert(key)
    for key in touched:
        policy.touch(key)
    return policy


def test_chain_arc_ranks_a_chain_deepest_first_so_its_head_stays_longest() -> None:
    policy = chain_arc_with("xabcd")  # T1, oldest first: x a b c d
    policy.order_chain(["a", "b", "c", "d"])
    assert drain(policy) == ["x", "d", "c", "b", "a"]


def test_chain_arc_ranks_within_each_arc_list() -> None:
    policy = chain_arc_with("abcdy", touched="ab")  # T1: c d y; T2: a b (touched once more: T2)
    policy.order_chain(["a", "b", "c", "d"])
    # T1 goes first while it exceeds p (0): its order is now y, d, c; then T2's: b, a.
    assert drain(policy) == ["y", "d", "c", "b", "a"]


def test_chain_arc_sends_a_partial_tail_to_the_old_end_and_skips_keys_it_does_not_hold() -> None:
    policy = chain_arc_with("xabc")
    policy.order_chain(["a", "gone", "b", "c"], partial_tail=True)
    assert drain(policy) == ["c", "x", "b", "a"]
    assert len(policy) == 0


def test_chain_arc_without_order_chain_calls_is_exactly_arc() -> None:
    rng = random.Random(7)
    accesses = [rng.choice(range(40)) if rng.random() < 0.7 else rng.randrange(1000) for _ in range(3000)]
    chain, arc = ChainARCPolicy(20), ARCPolicy(20)
    assert replay(chain, accesses, 20) == replay(arc, accesses, 20)
    assert drain(chain) == drain(arc)
