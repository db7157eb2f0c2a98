"""The `EvictionPolicy` contract: what every policy must do, as reusable pytest pieces.

kvtier runs it against each of its policies (tests/policy/test_policy_contract.py); an out-of-tree
policy runs it the same way:

    from kvtier.testing.policy_contract import PolicyContract, policy_machine

    class TestMyPolicy(PolicyContract):
        @pytest.fixture
        def new_policy(self):
            return lambda capacity_hint: MyPolicy(capacity_hint)

    TestMyPolicyMachine = policy_machine(lambda hint: MyPolicy(hint), "MyPolicy")

`new_policy(capacity_hint) -> EvictionPolicy` builds a fresh, empty policy. Atomicity ("on None
nothing changed") is checked by behaviour, never by peeking at internals: a twin policy receives
the same history minus the failed call, and both must then agree on length, membership and the
full order in which they evict everything that is left.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtier.policy.base import EvictionPolicy

MakePolicy = Callable[[int], EvictionPolicy]

CAPACITY_HINT = 16


def never(key: Hashable) -> bool:
    """A `protected` callback that protects nothing."""
    return False


def drain(policy: EvictionPolicy) -> list[Hashable]:
    """Evicts everything, one victim at a time, and returns the eviction order."""
    order: list[Hashable] = []
    while len(policy):
        order += policy.evict(1, never)
    return order


def with_history(new_policy: MakePolicy) -> EvictionPolicy:
    """A policy taken through inserts, touches, evictions, removals and re-inserts of evicted keys,
    so that every internal queue (S3-FIFO's main and ghost, ARC's T2, B1 and B2) holds keys."""
    policy = new_policy(CAPACITY_HINT)
    evicted: list[Hashable] = []
    for i in range(40):
        if len(policy) >= CAPACITY_HINT - 2:
            evicted += policy.evict(3, never)
        policy.insert(i)
        policy.touch(i // 2)
        policy.touch(i // 3)
        if i % 5 == 4 and evicted:
            policy.remove(i - 1)
            policy.insert(evicted.pop(0))
    for key in range(34, 40):  # touched keys waiting in S3-FIFO's small queue / ARC's T1
        policy.touch(key)
    return policy


class PolicyContract:
    """Every test an `EvictionPolicy` must pass; a subclass provides the `new_policy` fixture."""

    @pytest.fixture
    def new_policy(self) -> MakePolicy:
        raise NotImplementedError("a PolicyContract subclass provides the new_policy fixture")

    def test_insert_of_a_resident_key_raises_key_error_and_changes_nothing(self, new_policy: MakePolicy) -> None:
        policy, twin = with_history(new_policy), with_history(new_policy)
        resident = next(k for k in range(40) if k in policy)
        with pytest.raises(KeyError):
            policy.insert(resident)
        assert len(policy) == len(twin)
        assert drain(policy) == drain(twin)


    def test_touch_and_remove_of_unknown_keys_are_noops(self, new_policy: MakePolicy) -> None:
        empty = new_policy(CAPACITY_HINT)
        empty.touch("nope")
        empty.remove("nope")
        assert len(empty) == 0
        policy, twin = with_history(new_policy), with_history(new_policy)
        policy.touch("nope")
        policy.remove("nope")
        assert "nope" not in policy
        assert drain(policy) == drain(twin)


    def test_note_hint_reorders_at_most(self, new_policy: MakePolicy) -> None:
        """`note_hint` (kvtier.deciding.retention) ignores unknown keys and never adds or drops one."""
        from kvtier.policy.base import HintKind

        policy, twin = with_history(new_policy), with_history(new_policy)
        policy.note_hint(999, HintKind.CLOSED)
        assert drain(policy) == drain(twin)
        policy, twin = with_history(new_policy), with_history(new_policy)
        for key in [k for k in range(40) if k in policy][:3]:
            policy.note_hint(key, HintKind.CLOSED)
            policy.note_hint(key, HintKind.RETAINED)
        assert len(policy) == len(twin)
        assert sorted(drain(policy)) == sorted(drain(twin))

    def test_remove_forgets_a_resident_key(self, new_policy: MakePolicy) -> None:
        policy = with_history(new_policy)
        key = next(k for k in range(40) if k in policy)
        size = len(policy)
        policy.remove(key)
        assert key not in policy
        assert len(policy) == size - 1
        assert key not in drain(policy)


    def test_evict_zero_returns_an_empty_list(self, new_policy: MakePolicy) -> None:
        assert new_policy(CAPACITY_HINT).evict(0, never) == []
        policy = with_history(new_policy)
        size = len(policy)
        assert policy.evict(0, lambda key: True) == []
        assert len(policy) == size


    def test_evict_of_a_negative_count_raises_value_error(self, new_policy: MakePolicy) -> None:
        with pytest.raises(ValueError):
            with_history(new_policy).evict(-1, never)


    @pytest.mark.parametrize("n", [1, 3, 7])
    def test_evict_returns_n_distinct_resident_unprotected_victims(self, new_policy: MakePolicy, n: int) -> None:
        policy = with_history(new_policy)
        before = {k for k in range(40) if k in policy}
        protected = set(sorted(before)[::3])
        victims = policy.evict(n, protected.__contains__)
        assert victims is not None and len(victims) == n
        assert len(set(victims)) == n
        assert set(victims) <= before - protected
        assert not any(v in policy for v in victims)
        assert len(policy) == len(before) - n
        assert all(k in policy for k in protected)


    @pytest.mark.parametrize("case", ["more_than_resident", "too_few_unprotected", "all_protected"])
    def test_evict_returns_none_and_changes_nothing_when_too_few(self, new_policy: MakePolicy, case: str) -> None:
        policy, twin = with_history(new_policy), with_history(new_policy)
        resident = [k for k in range(40) if k in policy]
        protected = {
            "more_than_resident": set(),
            "too_few_unprotected": set(resident[2:]),
            "all_protected": set(resident),
        }[case]
        n = len(resident) + 1 if case == "more_than_resident" else 3
        assert policy.evict(n, protected.__contains__) is None
        assert len(policy) == len(twin) == len(resident)
        assert all(k in policy for k in resident)
        assert drain(policy) == drain(twin)


    def test_an_exception_from_protected_propagates_and_changes_nothing(self, new_policy: MakePolicy) -> None:
        policy, twin = with_history(new_policy), with_history(new_policy)
        resident = [k for k in range(40) if k in policy]
        calls = []

        def explode_late(key: Hashable) -> bool:
            calls.append(key)
            if len(calls) > len(resident) // 2:
                raise RuntimeError("protected failed")
            return key in resident[::2]

        with pytest.raises(RuntimeError, match="protected failed"):
            policy.evict(len(resident) - 1, explode_late)
        assert len(policy) == len(resident)
        assert drain(policy) == drain(twin)


# --- random histories against a model ----------------------------------------------------------

KEYS = st.integers(0, 15)


class PolicyMachine(RuleBasedStateMachine):
    """Random insert/touch/remove/evict sequences checked against a model set and a twin policy.

    The twin gets every call that succeeds and none that fails (KeyError, None), so at teardown a
    failed call that changed anything shows up as a different eviction order.
    """

    new_policy: Callable[[int], EvictionPolicy]  # set by `policy_machine`

    def __init__(self) -> None:
        super().__init__()
        self.model: set[int] = set()

    @initialize(capacity_hint=st.integers(1, 24))
    def create(self, capacity_hint: int) -> None:
        self.policy = type(self).new_policy(capacity_hint)
        self.twin = type(self).new_policy(capacity_hint)

    @rule(key=KEYS)
    def insert(self, key: int) -> None:
        if key in self.model:
            with pytest.raises(KeyError):
                self.policy.insert(key)
            return
        self.policy.insert(key)
        self.twin.insert(key)
        self.model.add(key)

    @rule(key=KEYS)
    def touch(self, key: int) -> None:
        self.policy.touch(key)
        self.twin.touch(key)

    @rule(key=KEYS)
    def remove(self, key: int) -> None:
        self.policy.remove(key)
        self.twin.remove(key)
        self.model.discard(key)

    @rule(n=st.integers(0, 6), protected=st.frozensets(KEYS))
    def evict(self, n: int, protected: frozenset[int]) -> None:
        victims = self.policy.evict(n, protected.__contains__)
        if victims is None:
            assert len(self.model - protected) < n
            return
        assert len(victims) == n == len(set(victims))
        assert set(victims) <= self.model - protected
        assert self.twin.evict(n, protected.__contains__) == victims
        self.model -= set(victims)

    @rule(keys=st.lists(KEYS, max_size=6, unique=True), partial_tail=st.booleans())
    def order_chain(self, keys: list[int], partial_tail: bool) -> None:
        """A chain-aware policy's re-ranking (`order_chain`) reorders and never adds or forgets."""
        if getattr(self.policy, "chain_aware", False):
            self.policy.order_chain(keys, partial_tail)
            self.twin.order_chain(keys, partial_tail)

    @invariant()
    def membership_matches_the_model(self) -> None:
        policy = getattr(self, "policy", None)
        if policy is not None:
            assert len(policy) == len(self.model)
            assert {k for k in range(16) if k in policy} == self.model

    def teardown(self) -> None:
        if getattr(self, "policy", None) is not None:
            assert drain(self.policy) == drain(self.twin)


def policy_machine(new_policy: MakePolicy, name: str, max_examples: int = 60) -> type:
    """A unittest TestCase running `PolicyMachine` on `new_policy`; assign it to a `Test...` name:

        TestMyPolicyMachine = policy_machine(lambda hint: MyPolicy(hint), "MyPolicy")
    """
    machine = type(f"{name}Machine", (PolicyMachine,), {"new_policy": staticmethod(new_policy)})
    test_case = machine.TestCase
    test_case.settings = settings(max_examples=max_examples, stateful_step_count=60, deadline=None)
    return test_case
