"""Crashing the compiled modules from Python: `kvtier._keytable` (KeyTable, KeyList) and `kvtier._replay`.

The attacks, each through the public Python API only:
  * keys whose `__hash__` or `__eq__` (or a finalizer, or a second thread while they wait) call the
    same KeyList or KeyTable in the middle of a call. Before: "SystemError: KeyTable: side key
    lost", an order with a cycle, a key that can never be popped, SIGSEGV. Now the second call
    raises RuntimeError and changes nothing, and the first goes on: the list is always the
    OrderedDict it stands for;
  * keys equal to a stored key but of another type: True, 1, 1.0, numpy ints, a bytes subclass.
    Before: 1 in the table part and True were two keys. Now they match as in a dict;
  * `replay_lru` given an output array that shares memory with an input, an `on_progress` that
    rewrites `ids`, grows `lengths` or resizes an output, and token counts past 2**63. Before: a
    SIGSEGV, or negative totals. Now: a ValueError naming both arrays, the replay of the trace as
    it was when the call began, and exact totals (those of the manager's replay).
What might crash runs in a fresh interpreter (this file, run as a script), so a crash fails the
test instead of killing pytest. Cost: about 9 s (nine interpreters, four hypothesis searches).
"""

from __future__ import annotations

import faulthandler
import subprocess
import sys
import threading
from collections import OrderedDict
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier._keytable import KeyList, KeyTable
from kvtier._replay import replay_lru

REFUSED = "mutated or read during one of its own lookups"
WAIT_S = 30  # how long a thread waits for the other at most (they meet far sooner: no sleeps)


def run_isolated(scenario: str) -> None:
    """Runs `scenario`, a function of this file, in a fresh interpreter; it must print "ok" and exit 0."""
    done = subprocess.run([sys.executable, __file__, scenario], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("ok"), (
        f"{scenario}: exit status {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")


class Meddler:
    """A key whose `__hash__` or `__eq__` runs `meddle` once, at a chosen call; keys of one
    `group` share a hash, so a dict compares them with `__eq__`."""

    def __init__(self, n: int, group: int = 7) -> None:
        self.n, self.group = n, group
        self.meddle, self.on, self.skip = None, "", 0

    def arm(self, meddle, on: str = "hash", skip: int = 0) -> None:
        """Runs `meddle` at the (skip + 1)-th call of `on` ("hash" or "eq") from now on."""
        self.meddle, self.on, self.skip = meddle, on, skip

    def _called(self, what: str) -> None:
        if self.meddle is None or self.on != what:
            return
        if self.skip:
            self.skip -= 1
            return
        meddle, self.meddle = self.meddle, None
        meddle()

    def __hash__(self) -> int:
        self._called("hash")
        return self.group

    def __eq__(self, other: object) -> bool:
        self._called("eq")
        return isinstance(other, Meddler) and other.n == self.n

    def __repr__(self) -> str:
        return f"M{self.n}"


def refused(call) -> Exception:
    """Runs `call`, which must be refused as a re-entry; returns the error."""
    with pytest.raises(RuntimeError, match=REFUSED) as caught:
        call()
    return caught.value


# ---- KeyList / KeyTable: re-entry ------------------------------------------------------------------


def scenario_a_key_re_enters_its_own_removal() -> None:
    keys = KeyList()
    a, b = Meddler(1), Meddler(2)
    keys[a] = 0

    def meddle() -> None:  # the sequence that left a stale id behind: remove, reuse the id, re-add
        del keys[a]
        keys[b] = 0
        keys[a] = 0

    a.arm(meddle, "hash", skip=1)
    refused(lambda: keys.__delitem__(a))
    assert list(keys) == [a] and len(keys) == 1 and keys[a] == 0  # nothing changed
    keys[b] = 1
    del keys[a]
    assert list(keys) == [b] and keys.popitem() == (b, 1) and len(keys) == 0 and list(keys) == []


def test_a_key_that_re_enters_its_key_list_is_refused_and_the_list_stays_whole():
    run_isolated("scenario_a_key_re_enters_its_own_removal")


def scenario_a_finalizer_re_enters_during_a_removal() -> None:
    keys, seen = KeyList(), []

    class Finalized(Meddler):
        def __del__(self) -> None:  # runs inside `del keys[...]`: the list drops the last reference
            keys.popitem(last=False)

    keys[Finalized(1)] = 0  # the list holds the only reference
    keys[Meddler(2)] = 0
    hook, sys.unraisablehook = sys.unraisablehook, seen.append
    try:
        del keys[Meddler(1)]  # an equal key, not the stored one
    finally:
        sys.unraisablehook = hook
    assert [type(s.exc_value) for s in seen] == [RuntimeError] and REFUSED in str(seen[0].exc_value)
    assert list(keys) == [Meddler(2)] and len(keys) == 1


def test_a_finalizer_that_re_enters_a_key_list_is_refused():
    run_isolated("scenario_a_finalizer_re_enters_during_a_removal")


def scenario_a_key_table_re_entered_from_eq() -> None:
    table = KeyTable()
    a, b, c = Meddler(1), Meddler(2), Meddler(3)
    table.add(a, 0, 0)
    table.add(b, 1, 0)
    a.arm(lambda: (table.pop_id(0), table.add(c, 0, 0)), "eq")
    refused(lambda: table.pop_id(1))  # finding b's entry to remove it compares the stored a with b: a.__eq__
    a.arm(lambda: table.pop_id(1), "eq")
    refused(lambda: table.add(c, 2, 0))
    assert sorted(table.values()) == [0, 1] and table.key_of(0) == a and table[b] == 1 and c not in table
    assert table.pop_id(1) == b and table.pop_id(0) == a and len(table) == 0


def test_a_key_that_re_enters_its_key_table_is_refused():
    run_isolated("scenario_a_key_table_re_entered_from_eq")


def scenario_another_thread_changes_the_list_while_a_key_compares() -> None:
    keys = KeyList()
    a, b = Meddler(1), Meddler(2)
    keys[a], keys[b] = 1, 2
    inside, proceed, popped = threading.Event(), threading.Event(), []

    def wait_for_main() -> None:  # in the worker, inside its lookup of b: a.__eq__(b)
        inside.set()
        assert proceed.wait(WAIT_S)

    a.arm(wait_for_main, "eq")
    worker = threading.Thread(target=lambda: popped.append(keys.pop(b)))
    worker.start()
    try:
        assert inside.wait(WAIT_S)
        for change in (lambda: keys.__delitem__(b), lambda: keys.popitem(), lambda: keys.__setitem__(Meddler(3), 0),
                       lambda: keys.move_to_end(a), lambda: keys.get(b"d" * 16), lambda: next(iter(keys))):
            refused(change)
    finally:
        proceed.set()
        worker.join(WAIT_S)
    assert popped == [2] and list(keys) == [a] and keys[a] == 1 and len(keys) == 1


def test_a_second_thread_is_refused_while_a_key_of_the_list_runs_eq():
    run_isolated("scenario_another_thread_changes_the_list_while_a_key_compares")


def scenario_a_key_whose_hash_changes() -> None:
    class Fickle:
        calls = 0

        def __hash__(self) -> int:
            Fickle.calls += 1
            return Fickle.calls

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Fickle)

    keys = KeyList()
    keys[Fickle()] = 0  # stored under one hash, looked for under others: a dict loses it the same way
    with pytest.raises(KeyError):
        del keys[Fickle()]
    with pytest.raises(RuntimeError, match="not found by its own hash"):
        keys.popitem()
    assert len(keys) == 1 and len(list(keys)) == 1
    table = KeyTable()

    class Liar(Fickle):  # found absent at one hash, then equal to a stored key at the next
        def __hash__(self) -> int:
            Fickle.calls += 1
            return Fickle.calls % 2

    table.add(Liar(), 0, 0)
    with pytest.raises((RuntimeError, ValueError), match="answered two lookups|stored at id 0"):
        for i in range(1, 5):
            table.add(Liar(), i, 0)
    assert len(table) == 1 and table.values() == [0]


def test_a_key_whose_hash_changes_is_an_error_never_a_broken_list():
    run_isolated("scenario_a_key_whose_hash_changes")


STEP = st.tuples(st.integers(0, 7), st.integers(0, 15), st.integers(0, 2), st.booleans())
ARMING = st.none() | st.tuples(st.integers(0, 7), st.sampled_from(["hash", "eq"]), st.integers(0, 2),
                               st.lists(STEP, min_size=1, max_size=3))


def scenario_random_re_entry_matches_an_ordered_dict() -> None:
    @settings(max_examples=150, deadline=None, database=None)
    @given(st.lists(st.tuples(STEP, ARMING), max_size=40))
    def check(steps) -> None:
        keys, model = KeyList(), OrderedDict()
        meddlers = [Meddler(i, group=i % 3) for i in range(8)]
        pool = [*meddlers, *(bytes([i]) * 16 for i in range(4)), 1, True, 2.0, 3]
        live = [False]  # meddle only inside the KeyList's calls, never the model's

        def apply(target, step) -> object:
            op, k, value, last = step
            key = pool[k]
            try:
                return [lambda: target.__setitem__(key, value), lambda: target.pop(key, None),
                        lambda: target.popitem(last=last), lambda: target.move_to_end(key, last=last),
                        lambda: target.get(key), lambda: key in target, lambda: target.__delitem__(key),
                        lambda: list(target)][op]()
            except KeyError:
                return KeyError

        def nested(inner) -> None:
            for step in inner:
                refused(lambda: apply(keys, step))

        for step, arming in steps:
            if arming is not None:
                which, on, skip, inner = arming
                meddlers[which].arm(lambda inner=inner: live[0] and nested(inner), on, skip)
            live[0] = True
            got = apply(keys, step)
            live[0] = False
            for m in meddlers:
                m.meddle = None
            assert got == apply(model, step)
            assert list(keys) == list(model) and len(keys) == len(model)
            assert [keys[k] for k in model] == list(model.values())

    check()


def test_random_re_entry_leaves_a_key_list_equal_to_an_ordered_dict():
    run_isolated("scenario_random_re_entry_matches_an_ordered_dict")


# ---- KeyList / KeyTable: equal keys of other types -------------------------------------------------


class Digest(bytes):
    """A bytes subclass: equal to, and hashed as, the bytes it holds."""


EQUAL_KEYS = st.one_of(
    st.integers(-3, 3), st.booleans(), st.integers(-3, 3).map(float), st.integers(-3, 3).map(np.int64),
    st.integers(-3, 3).map(Fraction), st.sampled_from([2**64, -(2**63), 2.5, "1", (1,)]),
    st.integers(0, 2).map(lambda i: bytes([i]) * 16), st.integers(0, 2).map(lambda i: Digest(bytes([i]) * 16)),
    st.integers(0, 2).map(lambda i: memoryview(bytes([i]) * 16)))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), EQUAL_KEYS, st.integers(0, 3)), max_size=40))
def test_equal_keys_of_other_types_are_one_key_as_in_a_dict(steps):
    table, ids, keys, ordered = KeyTable(), {}, KeyList(), OrderedDict()  # ids: the table's model
    fresh = iter(range(10**6))
    for op, key, value in steps:
        if op == 0:
            keys[key] = ordered[key] = value
            if key not in ids:
                table[key] = ids[key] = next(fresh)
        elif op == 1 and key in ids:
            block = ids.pop(key)
            if value % 2:
                del table[key]
            else:
                assert table.pop_id(block) == key
        elif op == 2:
            assert keys.pop(key, None) == ordered.pop(key, None)
        elif op == 3 and ordered:
            got, want = keys.popitem(last=bool(value % 2)), ordered.popitem(last=bool(value % 2))
            assert got == want and type(got[0]) is type(want[0])  # the key first stored, as a dict keeps it
        assert (key in table) == (key in ids) and table.get(key) == ids.get(key) and len(table) == len(ids)
        assert (key in keys) == (key in ordered) and keys.get(key) == ordered.get(key)
        assert list(keys) == list(ordered)


@settings(max_examples=300, deadline=None)
@given(st.integers(-(2**63), 2**63 - 1) | st.sampled_from([-1, -2, 2**61 - 2, 2**61 - 1, 2**61, -(2**61) + 1, -(2**63)]))
def test_an_int_key_is_found_by_any_number_equal_to_it(value):
    table = KeyTable()
    table[value] = 5  # the table part: its hash is Python's, computed in C
    assert table.get(Fraction(value)) == table.get(np.int64(value)) == 5
    assert table.get(float(value)) == (5 if float(value) == value else None)


def test_true_one_and_one_point_zero_are_one_key_in_either_part():
    table = KeyTable()
    table[1] = 0  # the table part, int kind
    assert table[True] == table[1.0] == table[np.int64(1)] == table[Fraction(1)] == 0 and table.num_side == 0
    with pytest.raises(ValueError, match="stored at id 0 already"):
        table[True] = 1
    del table[1.0]
    table[True] = 1  # on the side now: the table part is empty but keeps its kind
    assert table.num_side == 1 and table[1] == 1 and table.key_of(1) is True
    digests = KeyList()
    digests[b"k" * 16] = 3
    assert digests[Digest(b"k" * 16)] == 3 and memoryview(b"k" * 16) in digests and len(digests) == 1


# ---- replay_lru: shared, rewritten and resized arrays; totals past int64 ---------------------------


def trace_args(num_requests: int = 48, seed: int = 0) -> dict:
    """A valid `replay_lru` call: requests of 8 blocks each over 40 blocks, one tier of 10 slots."""
    rng = np.random.default_rng(seed)
    return dict(ids=rng.integers(0, 40, num_requests * 8).astype(np.int32),
                starts=np.arange(num_requests, dtype=np.int64) * 8, lengths=np.full(num_requests, 8, dtype=np.int64),
                input_tokens=np.full(num_requests, 128, dtype=np.int64), num_blocks=40,
                tiers=((10, 0, 1, False, 10, 10, 1e-3),), inclusive=False, promote_to=-1, block_tokens=16,
                seconds_per_token=1e-4, ttft_s=np.empty(num_requests), ttft_no_cache_s=np.empty(num_requests))


def replayed(args: dict) -> tuple:
    """`replay_lru(**args)`'s counts and the TTFTs it wrote."""
    return replay_lru(**args), args["ttft_s"].tolist(), args["ttft_no_cache_s"].tolist()


def scenario_an_output_shares_memory_with_an_input() -> None:
    args = trace_args()
    memory = np.zeros(len(args["starts"]) + 1, dtype=np.int64)
    memory[:-1] = args["starts"]
    shared = {**args, "starts": memory[:-1], "ttft_s": memory.view(np.float64)[1:]}  # `ttft_s = starts[1:]`
    with pytest.raises(ValueError, match="ttft_s shares memory with starts"):
        replay_lru(**shared)
    with pytest.raises(ValueError, match="ttft_s shares memory with ttft_no_cache_s"):
        replay_lru(**{**args, "ttft_no_cache_s": args["ttft_s"]})
    assert memory[:-1].tolist() == args["starts"].tolist()  # refused before writing anything


def test_an_output_that_shares_memory_with_an_input_is_refused_by_name():
    run_isolated("scenario_an_output_shares_memory_with_an_input")


def scenario_on_progress_rewrites_ids_grows_lengths_and_resizes_an_output() -> None:
    want = replayed(trace_args())
    args = trace_args()

    def meddle(done: int) -> None:
        args["ids"][:] = 10**9
        args["lengths"][:] = 10**6
        args["starts"][::2] = -(2**62)

    assert replayed({**args, "on_progress": meddle, "progress_every": 1}) == want  # the trace as it was at the call
    args = trace_args()
    ttft = args["ttft_s"]
    with pytest.raises(ValueError, match="ttft_s changed size during the replay"):
        replay_lru(**args, on_progress=lambda done: ttft.resize(10**6, refcheck=False), progress_every=1)


def test_on_progress_that_rewrites_the_trace_or_resizes_an_output_changes_nothing():
    run_isolated("scenario_on_progress_rewrites_ids_grows_lengths_and_resizes_an_output")


ARRAYS = st.sampled_from(["ids", "starts", "lengths", "input_tokens"])
EXTREMES = st.sampled_from([-1, 0, 39, 40, 2**31 - 1, -(2**31), 10**6, 2**62, -(2**63), 2**63 - 1])


def scenario_random_rewrites_from_on_progress() -> None:
    want = replayed(trace_args())

    @settings(max_examples=60, deadline=None, database=None)
    @given(st.lists(st.tuples(ARRAYS, st.integers(0, 10**4), EXTREMES), min_size=1, max_size=6), st.integers(1, 9))
    def check(rewrites, every) -> None:
        args = trace_args()

        def meddle(done: int) -> None:
            for name, at, value in rewrites:
                array = args[name]
                array[at % len(array)] = np.array(value).astype(array.dtype)  # wraps to the item's width

        assert replayed({**args, "on_progress": meddle, "progress_every": every}) == want

    check()


def test_random_rewrites_from_on_progress_leave_the_replay_as_it_began():
    run_isolated("scenario_random_rewrites_from_on_progress")


def test_token_totals_past_int64_are_exact_and_the_managers():
    from kvtier.kinds import TierKind
    from kvtier.simulate.replay import SimConfig, SimEngine, VirtualTier, replay_counts
    from kvtier.simulate.trace import Trace, TraceRequest

    requests = [([1, 2, 3], 2**63 - 1), ([1, 2, 3], 2**63 - 1), ([1, 2, 4], 2**63 - 2), ([1, 2], 5)]
    trace = Trace("<huge>", 2**62, tuple(TraceRequest(float(i), tokens, 1, tuple(ids), False)
                                         for i, (ids, tokens) in enumerate(requests)), (), 11, 4)
    config = SimConfig((VirtualTier(TierKind.HBM, 8, 1000.0),), 4096)
    manager, native = (replay_counts(trace, config, engine=e) for e in (SimEngine.MANAGER, SimEngine.NATIVE))
    assert native.engine == "native" and native.input_tokens == manager.input_tokens == 3 * 2**63 + 1
    # min(hit blocks * 2**62, input) per request: 0, 2**63 - 1, 2**63 - 2, 5
    assert native.cached_tokens == manager.cached_tokens == 2**64 + 2
    assert native.num_accesses == manager.num_accesses == 11
    assert list(native.ttft_s) == list(manager.ttft_s)


if __name__ == "__main__":  # run_isolated: one scenario in this interpreter, a crash reported with its stack
    faulthandler.enable()
    globals()[sys.argv[1]]()
    print("ok")
