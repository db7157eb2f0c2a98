"""bench/policy_study.py: the evidence behind issue 13's part 3 must be computed right, or its
conclusion (no predictor of those features closes a third of the LRU -> Belady gap) means nothing.

Each function is checked on a small trace worked out by hand, and the study's LRU against the
manager's own on a slice of the conversation trace.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvtier.kinds import TierKind
from kvtier.simulate.replay import SimConfig, VirtualTier, simulate
from kvtier.simulate.trace import Trace, TraceRequest
from support.traces import mooncake, needs_traces

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import policy_study as study  # noqa: E402


def make_trace(requests: list[tuple[list[int], int, bool]]) -> Trace:
    """(hash ids, output tokens, partial tail) per request."""
    reqs = tuple(TraceRequest(float(i), 512 * len(ids), out, tuple(ids), tail) for i, (ids, out, tail) in enumerate(requests))
    unique = {b for r in reqs for b in r.hash_ids}
    return Trace("<test>", 512, reqs, (), sum(len(r.hash_ids) for r in reqs), len(unique))


# r0 starts a conversation; r1 extends r0's whole chain (turn 1) and r3 extends r1's (turn 2);
# r2 branches off inside r0's chain (turn 0); r3's last id (8) is a partial tail, so its last full
# block is 6, and r4, which reaches 6 but not 8, extends r3's whole chain (turn 3).
CONVERSATION = make_trace([
    ([1, 2, 3], 10, False),
    ([1, 2, 3, 4], 100, False),
    ([1, 2, 5], 1, False),
    ([1, 2, 3, 4, 6, 8], 3, True),
    ([1, 2, 3, 4, 6, 7], 0, False),
])


def test_request_features_follow_the_conversation_and_the_seen_prefix():
    features = study.request_features(CONVERSATION)
    assert [f[0] for f in features] == [0, 1, 0, 2, 3]  # turns
    assert [f[3] for f in features] == [n.bit_length() for n in (0, 3, 2, 4, 5)]  # seen prefix, in blocks
    assert [f[1] for f in features] == [n.bit_length() for n in (10, 100, 1, 3, 0)]  # output tokens
    assert [f[2] for f in features] == [n.bit_length() for n in (3, 4, 3, 6, 6)]  # blocks


def test_a_partial_tail_is_not_the_end_of_the_chain_a_turn_extends():
    trace = make_trace([([1, 2], 0, True), ([1, 2, 3], 0, False), ([1, 5], 0, False)])
    assert [f[0] for f in study.request_features(trace)] == [0, 0, 1]  # r1 passes the tail 2; r2 ends at 1


def test_access_keys_count_prior_accesses_and_mark_only_a_partial_tail():
    keys = study.access_keys(CONVERSATION)
    assert [k[4] for k in keys[0]] == [0, 0, 0]
    assert [k[4] for k in keys[3]] == [3, 3, 2, 1, 0, 0]  # block 1 accessed 3 times before, capped at 3
    assert [k[5] for k in keys[3]] == [False] * 5 + [True]
    assert not any(k[5] for k in keys[4])  # no partial tail


def test_hindsight_rates_are_the_share_of_accesses_followed_by_another():
    trace = make_trace([([1, 2], 0, False), ([1, 3], 0, False), ([1, 2], 0, False)])
    keys = [[("a", 0), ("b", 0)], [("a", 1), ("b", 1)], [("a", 1), ("b", 1)]]
    rates = study.hindsight_rates(trace, keys)
    # ("a", 0): block 1 in r0, accessed again. ("b", 0): block 2 in r0, again in r2.
    # ("a", 1): block 1 in r1 (again in r2) and in r2 (never again): 1 of 2. ("b", 1): 3 never again, 2 in r2 never.
    assert rates == {("a", 0): 1.0, ("b", 0): 1.0, ("a", 1): 0.5, ("b", 1): 0.0}


def test_prefix_lru_counts_hits_only_inside_the_matched_prefix():
    trace = make_trace([([1, 2, 3], 0, False), ([1, 9, 3], 0, False)])
    assert study.prefix_lru_hits(trace, 10) == 1  # block 3 is resident but behind a miss
    assert study.prefix_lru_hits(trace, 10, stored=[{2, 3}, set()]) == 0  # block 1 was never stored


def test_feature_oracle_skips_dead_keys_and_never_does_worse_than_lru():
    # Two slots. Request 0's blocks come back; request 1's "noise" blocks never do, and would push them out.
    trace = make_trace([([1, 2], 0, False), ([7, 8], 9, False), ([1, 2], 0, False)])
    keys = study.access_keys(trace)
    rates = study.hindsight_rates(trace, keys)
    assert study.prefix_lru_hits(trace, 2) == 0
    best = study.feature_oracle(trace, 2, keys, rates)
    assert best["num_hits"] == 2 and best["threshold"] > 0
    assert study.feature_oracle(make_trace([([1], 0, False), ([1], 0, False)]), 1, [[(0,)], [(0,)]],
                                {(0,): 0.5})["threshold"] == 0.0  # a tie keeps the lowest threshold


@needs_traces
def test_the_studys_lru_is_the_managers_on_a_real_slice():
    full = mooncake("conversation")
    requests = full.requests[:1500]
    trace = Trace(full.path, full.block_tokens, requests, (), sum(len(r.hash_ids) for r in requests),
                  len({b for r in requests for b in r.hash_ids}))
    for num_slots in (300, 3000):
        tier = (VirtualTier(TierKind.HBM, num_slots, 1000.0),)
        report = simulate(trace, SimConfig(tier, study.BLOCK_BYTES))
        assert study.prefix_lru_hits(trace, num_slots) == round(report["block_hit_rate"] * trace.num_accesses)
