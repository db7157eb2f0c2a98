"""The native replay engine (kvtier/_replay.c) decides exactly as the manager, on every configuration it accepts.

"Exactly": for the same trace and configuration, both engines' counts are equal field by field
(hits, stores, evictions per tier; demotions and promotions per route; blocks read out per tier;
slots in use; drops per reason; accesses, tokens saved), every request's TTFT estimate is the same
float (so are the percentiles built from them), and every tier's final LRU order is the same list
of keys. The traces: random ones from hypothesis, prefix-chained as real ones are, or any ids
(repeats inside a request included), on tiers of a few blocks so that eviction, admission and the
watermarks act all the time; then the shared Mooncake traces. The configurations: every one
`native_declines` accepts (LRU; one to four tiers; either mode; admission on or off; any
`promote_to`; any watermarks; full blocks only or not). The same with retention hints: random
sessions, closes, reopenings, unhinted requests, retentions that lapse and a clock that stalls or
goes back, under the default bounds and tiny ones; and Mooncake slices with derived hints
(session-end, ttl, wrong ends), the hint counters compared as well. Also: what it does not accept
falls back to the manager and says so, and malformed input to the C entry point raises, naming the
argument.

Cost: ~45 s on two CPU cores without the `slow` whole-trace comparisons (~40 s more).
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvtier._replay import replay_lru
from kvtier.config import CacheMode
from kvtier.deciding.retention import HintError, HintLimits
from kvtier.errors import ConfigError
from kvtier.kinds import TierKind
from kvtier.simulate import replay
from kvtier.simulate.hints import derive_hints, parse_hints
from kvtier.simulate.replay import (SimConfig, SimEngine, SimPolicy, VirtualTier, blocks_of_share, native_declines,
                                    replay_counts, simulate)
from kvtier.simulate.trace import Trace, TraceRequest
from support.traces import needs_traces

H, D, P, S = TierKind.HBM, TierKind.DRAM, TierKind.POOL, TierKind.SSD
BLOCK_TOKENS = 4
# Report fields that differ between engines by design: which ran, and how long it took.
ENGINE_FIELDS = ("engine", "engine_fallback", "replay_s", "accesses_per_s")


def make_trace(requests: list[tuple[list, int, bool]], block_tokens: int = BLOCK_TOKENS) -> Trace:
    """A trace of (hash_ids, input_tokens, partial_tail) requests."""
    reqs = tuple(TraceRequest(float(i), tokens, 1, tuple(ids), tail) for i, (ids, tokens, tail) in enumerate(requests))
    unique = {h for r in reqs for h in r.hash_ids}
    return Trace("<test>", block_tokens, reqs, (), sum(len(r.hash_ids) for r in reqs), len(unique))


def assert_same_decisions(trace: Trace, config: SimConfig) -> dict:
    """Replays `trace` on both engines and asserts equal counts, TTFTs, LRU orders and reports."""
    manager = replay_counts(trace, config, engine=SimEngine.MANAGER, lru_orders=True)
    native = replay_counts(trace, config, engine=SimEngine.NATIVE, lru_orders=True)
    assert (manager.engine, native.engine) == ("manager", "native")
    for field in dataclasses.fields(manager):
        if field.name in ("engine", "fallback", "replay_s", "ttft_s", "ttft_no_cache_s"):
            continue
        assert getattr(native, field.name) == getattr(manager, field.name), f"{field.name} differs"
    for name in ("ttft_s", "ttft_no_cache_s"):  # the same floats, request by request, not merely close
        assert np.array_equal(np.asarray(getattr(native, name)), np.asarray(getattr(manager, name))), name
    reports = [simulate(trace, config, engine=e) for e in ("manager", "native")]
    for report in reports:
        for field in ENGINE_FIELDS:
            report.pop(field)
    assert reports[0] == reports[1]
    return reports[1]


# ---- hypothesis: random traces and accepted configurations ----------------------------------------


@st.composite
def requests_of(draw, ids) -> tuple[list, int, bool]:
    """A request of `ids`, with input tokens that list its partial tail or leave it out (or have none)."""
    n = len(ids)
    if n == 0:
        return ids, draw(st.integers(1, BLOCK_TOKENS - 1)), False  # an input shorter than a block
    style = draw(st.sampled_from(["tail_listed", "whole", "tail_absent"]))
    if style == "tail_listed":  # ceil(input / block_tokens) ids, the last a partial block
        return ids, (n - 1) * BLOCK_TOKENS + draw(st.integers(1, BLOCK_TOKENS - 1)), True
    if style == "whole":
        return ids, n * BLOCK_TOKENS, False
    return ids, n * BLOCK_TOKENS + draw(st.integers(1, BLOCK_TOKENS - 1)), False


@st.composite
def prefix_chained_traces(draw) -> Trace:
    """Requests that extend a prefix of an earlier one with fresh blocks, as Mooncake's hash ids do."""
    paths: list[list[int]] = []
    fresh = iter(range(10**6))
    requests = []
    for _ in range(draw(st.integers(1, 40))):
        base = draw(st.sampled_from(paths)) if paths and draw(st.booleans()) else []
        keep = draw(st.integers(0, len(base)))
        ids = base[:keep] + [next(fresh) for _ in range(draw(st.integers(0, 6)))]
        paths.append(ids)
        requests.append(draw(requests_of(ids)))
    return make_trace(requests)


@st.composite
def any_id_traces(draw) -> Trace:
    """Requests of ids from a small range, repeats inside one request included; some ids past 64 bits."""
    big = draw(st.booleans())
    ident = st.integers(0, 12).map(lambda h: h + 2**70 if big and h % 3 == 0 else h)
    return make_trace([draw(requests_of(draw(st.lists(ident, max_size=8)))) for _ in range(draw(st.integers(1, 40)))])


@st.composite
def accepted_configs(draw) -> SimConfig:
    """Any configuration the native engine accepts, with tiers of a few blocks."""
    kinds = draw(st.lists(st.sampled_from([H, D, P, S]), min_size=1, max_size=4, unique=True))
    tiers = tuple(VirtualTier(k, draw(st.integers(1, 8)), draw(st.sampled_from([1.0, 6.0, 25.0, 1000.0])))
                  for k in kinds)
    high = draw(st.sampled_from([1.0, 0.95, 0.9, 0.75, 0.5, 0.3]))
    low = draw(st.sampled_from([x for x in (1.0, 0.85, 0.75, 0.5, 0.25, 0.1) if x <= high]))
    config = SimConfig(tiers, draw(st.sampled_from([1, 1000, 160 * 2**20])), policy=SimPolicy.LRU,
                       admission=draw(st.booleans()), mode=draw(st.sampled_from(list(CacheMode))),
                       promote_to=draw(st.sampled_from([H, D, P, S, None])), high_watermark=high, low_watermark=low,
                       prefill_tokens_per_s=draw(st.sampled_from([20_000.0, 3333.3, 1e6])),
                       full_blocks_only=draw(st.booleans()))
    assert native_declines(config) is None
    return config


HYPOTHESIS = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@HYPOTHESIS
@given(trace=prefix_chained_traces(), config=accepted_configs())
def test_prefix_chained_traces_same_decisions(trace, config):
    assert_same_decisions(trace, config)


@HYPOTHESIS
@given(trace=any_id_traces(), config=accepted_configs())
def test_any_id_traces_same_decisions(trace, config):
    assert_same_decisions(trace, config)


def test_a_key_twice_in_one_load_joins_its_own_promotion():
    """A hit listed twice reads the copy its first read is promoting (`TierManager._inbound`)."""
    trace = make_trace([([1, 2, 3], 12, False), ([4, 5, 6, 7], 16, False), ([1, 2, 1, 2], 16, False)])
    tiers = (VirtualTier(H, 2, 1000.0), VirtualTier(D, 3, 25.0), VirtualTier(S, 8, 6.0))
    report = assert_same_decisions(trace, SimConfig(tiers, 1000, high_watermark=1.0, low_watermark=1.0))
    assert report["tiers"]["dram"]["blocks_moved_in"] > 0


def test_a_copy_released_while_still_read_is_freed_when_the_read_ends():
    """Block 2 listed twice: its first read finds no room in HBM (the victim's slot is busy with its
    demotion), the second promotes it; the promotion retires the DRAM copy while the first read
    still holds it, and the load's end frees it (`_retire_unlisted` with readers, then `_free_if_unread`). Found
    by hypothesis: the rarest path of both engines."""
    trace = make_trace([([2, 4], 8, False), ([0], 4, False), ([1], 4, False), ([3], 4, False), ([4, 2, 2], 12, False)])
    tiers = (VirtualTier(H, 4, 1.0), VirtualTier(D, 1, 1.0), VirtualTier(P, 2, 1.0))
    assert_same_decisions(trace, SimConfig(tiers, 1, promote_to=H))


# ---- retention hints (kvtier/deciding/retention.py) -------------------------------------------------

# Bounds small enough that a trace of a few dozen requests reaches them (sessions refused, blocks
# past a session's cap), beside the runtime's defaults.
TINY_LIMITS = HintLimits(max_sessions=2, max_session_blocks=3)


@st.composite
def hinted_traces(draw, traces) -> Trace:
    """A trace from `traces` with random hints: a few sessions (some closing, some coming back after
    closing), unhinted requests among them, short retentions that lapse, and a clock that may stall
    or go back (the manager's never does)."""
    trace = draw(traces)
    sessions = st.one_of(st.none(), st.sampled_from(["a", "b", "c", "d"]))
    now_ms, requests = 0.0, []
    for r in trace.requests:
        now_ms = max(now_ms + draw(st.sampled_from([0.0, 1.0, 400.0, 1500.0, -300.0])), -1000.0)
        session = draw(sessions)
        closed = session is not None and draw(st.booleans())
        retain_s = draw(st.sampled_from([None, None, 0.001, 0.5, 1.0, 3.0]))
        requests.append(dataclasses.replace(r, timestamp_ms=now_ms, session=session, closed=closed, retain_s=retain_s))
    assume(any(r.hinted for r in requests))
    return dataclasses.replace(trace, requests=tuple(requests))


def assert_same_hinted_decisions(trace: Trace, config: SimConfig, limits: HintLimits) -> dict:
    """`assert_same_decisions` with both engines under `limits`, and the hint counters compared too."""
    with mock.patch.object(replay, "SIM_HINT_LIMITS", limits):
        report = assert_same_decisions(trace, config)
    assert report["hints"]["applied"] == len(trace.requests)
    return report


@HYPOTHESIS
@given(trace=hinted_traces(prefix_chained_traces()), config=accepted_configs(),
       limits=st.sampled_from([HintLimits(), TINY_LIMITS]))
def test_hinted_prefix_chained_traces_same_decisions(trace, config, limits):
    assert_same_hinted_decisions(trace, config, limits)


@HYPOTHESIS
@given(trace=hinted_traces(any_id_traces()), config=accepted_configs(),
       limits=st.sampled_from([HintLimits(), TINY_LIMITS]))
def test_hinted_any_id_traces_same_decisions(trace, config, limits):
    assert_same_hinted_decisions(trace, config, limits)


def test_hints_change_the_native_replay_as_the_manager_says():
    """One tier of four slots: with hints, session "x" has closed when request 2 needs a victim, so
    its block 5 goes rather than block 1, the oldest, and request 3 hits blocks 1 and 2."""
    plain = make_trace([([1, 2], 8, False), ([5, 6], 8, False), ([8], 4, False), ([1, 2, 3], 12, False)])
    hints = [("y", False), ("x", True), ("z", True), ("y", True)]
    hinted = dataclasses.replace(plain, requests=tuple(dataclasses.replace(r, session=s, closed=c)
                                                       for r, (s, c) in zip(plain.requests, hints)))
    config = SimConfig((VirtualTier(D, 4, 25.0),), 1000)
    assert assert_same_decisions(plain, config)["num_hits"] == 0
    report = assert_same_hinted_decisions(hinted, config, HintLimits())
    assert report["num_hits"] == 2 and report["hints"]["doomed_evicted"] >= 1


def test_a_hint_the_manager_refuses_is_replayed_by_the_manager():
    """A `retain_s` past `max_retain_s` is refused by `apply_hint` (HintError); the native engine
    declines the trace, so "auto" fails as the manager does and "native" says why."""
    trace = make_trace([([1, 2], 8, False)])
    bad = dataclasses.replace(trace, requests=(dataclasses.replace(trace.requests[0], retain_s=7200.0),))
    with pytest.raises(HintError, match="bad_retain_s"):
        simulate(bad, one_tier())
    with pytest.raises(ConfigError, match="engine native: request 0: .*bad_retain_s"):
        simulate(bad, one_tier(), engine=SimEngine.NATIVE)


@needs_traces
@pytest.mark.parametrize("spec", ["session-end", "ttl=60s", "session-end,wrong=0.3", "session-end,ttl=300s,wrong=0.2"])
@pytest.mark.parametrize("kw", [{}, {"mode": CacheMode.INCLUSIVE, "admission": True, "promote_to": TierKind.HBM}],
                         ids=["bench", "inclusive-admission-promote-hbm"])
def test_hinted_conversation_slice_same_decisions(conversation, spec, kw):
    """The first 1,500 requests with derived hints, on three small tiers and on one of 5 % of the blocks."""
    trace = derive_hints(dataclasses.replace(conversation, requests=conversation.requests[:1500]), parse_hints(spec))
    tiers = (VirtualTier(H, 100, 1000.0), VirtualTier(D, 500, 25.0), VirtualTier(S, 2000, 6.0))
    report = assert_same_hinted_decisions(trace, SimConfig(tiers, 160 * 2**20, **kw), HintLimits())
    assert report["hints"].get("doomed_evicted" if "session-end" in spec else "over_budget", 0) > 0
    if not kw:
        one = SimConfig((VirtualTier(D, blocks_of_share(0.05, trace.num_unique_blocks), 25.0),), 160 * 2**20)
        assert_same_hinted_decisions(trace, one, HintLimits())


# ---- the shared Mooncake traces --------------------------------------------------------------------

def three_tiers(**kw) -> SimConfig:
    """The bench's three tiers (bench/bench_simulate.py)."""
    tiers = (VirtualTier(H, 1000, 1000.0), VirtualTier(D, 5000, 25.0), VirtualTier(S, 20_000, 6.0))
    return SimConfig(tiers, 160 * 2**20, **kw)


@needs_traces
@pytest.mark.parametrize("kw", [
    {}, {"mode": CacheMode.INCLUSIVE}, {"admission": True}, {"promote_to": None}, {"promote_to": TierKind.HBM},
    {"high_watermark": 0.7, "low_watermark": 0.2, "full_blocks_only": True},
], ids=["bench", "inclusive", "admission", "no-promotion", "promote-hbm", "marks-full-blocks"])
def test_conversation_slice_same_decisions(conversation, kw):
    """The first 1,500 requests, on tiers a tenth of the bench's, so that they evict all the time."""
    trace = dataclasses.replace(conversation, requests=conversation.requests[:1500])
    tiers = (VirtualTier(H, 100, 1000.0), VirtualTier(D, 500, 25.0), VirtualTier(S, 2000, 6.0))
    report = assert_same_decisions(trace, SimConfig(tiers, 160 * 2**20, **kw))
    assert sum(t["evictions"] for t in report["tiers"].values()) > 1000


@pytest.mark.slow
@needs_traces
@pytest.mark.parametrize("config", [
    SimConfig((VirtualTier(H, 18_279, 1000.0),), 160 * 2**20), three_tiers(),
    three_tiers(mode=CacheMode.INCLUSIVE, admission=True, promote_to=TierKind.HBM),
], ids=["bench-1-tier", "bench-3-tiers", "inclusive-admission-promote-hbm"])
def test_whole_conversation_trace_same_decisions(conversation, config):
    report = assert_same_decisions(conversation, config)
    if len(config.tiers) == 1:
        assert report["num_hits"] == 80_323  # the independent reference (see test_simulate.py)


@pytest.mark.slow
@needs_traces
@pytest.mark.parametrize(("spec", "share"), [("session-end", 0.05), ("session-end,ttl=300s,wrong=0.2", 0.10)])
def test_whole_conversation_trace_with_hints_same_decisions(conversation, spec, share):
    """`kvtier simulate --capacity dram=5% --hints session-end`'s hinted replay, and a harder one at 10 %."""
    trace = derive_hints(conversation, parse_hints(spec))
    one = SimConfig((VirtualTier(D, blocks_of_share(share, trace.num_unique_blocks), 25.0),), 160 * 2**20)
    assert assert_same_hinted_decisions(trace, one, HintLimits())["hints"]["doomed_evicted"] > 0


@pytest.mark.slow
@needs_traces
def test_whole_synthetic_trace_same_decisions(synthetic):
    tiers = (VirtualTier(D, 2000, 25.0), VirtualTier(P, 3000, 12.5), VirtualTier(S, 8000, 6.0))
    assert_same_decisions(synthetic, SimConfig(tiers, 160 * 2**20, admission=True, full_blocks_only=True))


# ---- which engine runs -----------------------------------------------------------------------------


TINY = make_trace([([1, 2, 3], 11, True), ([1, 2], 8, False), ([1, 2, 4], 12, False)])


def one_tier(**kw) -> SimConfig:
    return SimConfig((VirtualTier(H, 2, 1.0),), 1000, **kw)


def test_lru_runs_native_by_default():
    report = simulate(TINY, one_tier())
    assert (report["engine"], report["engine_fallback"]) == ("native", None)
    assert simulate(TINY, one_tier(), engine="manager")["engine"] == "manager"


@pytest.mark.parametrize("policy", [p for p in SimPolicy if p is not SimPolicy.LRU], ids=lambda p: p.value)
def test_other_policies_fall_back_to_the_manager_and_say_so(policy):
    report = simulate(TINY, one_tier(policy=policy))
    assert report["engine"] == "manager"
    assert f"policy {policy.value}" in report["engine_fallback"]
    with pytest.raises(ConfigError, match=f"engine native: policy {policy.value}"):
        simulate(TINY, one_tier(policy=policy), engine=SimEngine.NATIVE)


def test_ids_that_are_not_ints_fall_back_to_the_manager():
    """The engine takes ints only; the manager replays the rest, matching keys as a dict does."""
    trace = make_trace([([1, 2], 8, False), ([True, "x"], 8, False)])
    report = simulate(trace, one_tier())
    assert report["engine"] == "manager" and "bool, str" in report["engine_fallback"]
    assert report["num_hits"] == 1  # True is block 1, as in a dict
    with pytest.raises(ConfigError, match="int ids only"):
        simulate(trace, one_tier(), engine="native")


def test_unknown_engine_is_a_config_error():
    with pytest.raises(ConfigError, match="engine: expected one of"):
        simulate(TINY, one_tier(), engine="fast")


def test_progress_is_reported_alike():
    trace = make_trace([([i, i + 1], 8, False) for i in range(600)])
    calls = {}
    for engine in ("manager", "native"):
        seen = calls[engine] = []
        simulate(trace, one_tier(), engine=engine, on_progress=seen.append)
    assert calls["native"] == calls["manager"] == [256, 256, 88]


# ---- the C entry point's checks -----------------------------------------------------------------


def good_args() -> dict:
    """A valid call of `replay_lru`: two requests over three blocks, one tier of two slots."""
    return dict(ids=np.array([0, 1, 0, 2], dtype=np.int32), starts=np.array([0, 2], dtype=np.int64),
                lengths=np.array([2, 2], dtype=np.int64), input_tokens=np.array([8, 8], dtype=np.int64),
                num_blocks=3, tiers=((2, 0, 1, False, 2, 2, 1e-3),), inclusive=False, promote_to=-1,
                block_tokens=4, seconds_per_token=1e-4, ttft_s=np.empty(2), ttft_no_cache_s=np.empty(2))


def test_replay_lru_accepts_good_args():
    args = good_args()
    counts = replay_lru(**args)
    assert (counts["hits"], counts["stores"], counts["used_slots"]) == ([1], [3], [2])
    assert args["ttft_s"][1] == 4 * 1e-4 + 1e-3


@pytest.mark.parametrize("change, error, message", [
    ({"ids": np.array([0, 1, 0, 2], dtype=np.int64)}, TypeError, "ids must be a one-dimensional array of 4-byte"),
    ({"ids": [0, 1, 0, 2]}, TypeError, "ids must be a contiguous array"),
    ({"ids": np.array([0, 1, 0, 3], dtype=np.int32)}, ValueError, r"ids\[3\] = 3 is not a block id"),
    ({"ids": np.array([0, -1, 0, 2], dtype=np.int32)}, ValueError, r"ids\[1\] = -1 is not a block id"),
    ({"starts": np.array([0, 3], dtype=np.int64)}, ValueError, r"request 1: ids\[3 : 3 \+ 2\] is not inside"),
    ({"lengths": np.array([2, -1], dtype=np.int64)}, ValueError, "request 1"),
    ({"lengths": np.array([2], dtype=np.int64)}, ValueError, "one item per request"),
    ({"starts": np.array([[0, 2]], dtype=np.int64)}, TypeError, "starts must be a one-dimensional"),
    ({"input_tokens": np.array([8.0, 8.0])}, TypeError, "input_tokens must be a one-dimensional array of 8-byte"),
    ({"ttft_s": np.empty(2)[::-1]}, TypeError, "ttft_s must be a writable contiguous array"),
    ({"ttft_no_cache_s": np.empty(2, dtype=np.int64)}, TypeError, "ttft_no_cache_s must be a one-dimensional"),
    ({"num_blocks": -1}, ValueError, "num_blocks must be in"),
    ({"tiers": ()}, ValueError, "tiers must be a tuple of 1 to 4"),
    ({"tiers": ((2, 0, 1, False, 2, 2, 1e-3),) * 5}, ValueError, "tiers must be a tuple of 1 to 4"),
    ({"tiers": ((2, 0, 1),)}, TypeError, r"tiers\[0\] must be a tuple \(num_slots"),
    ({"tiers": ((0, 0, 1, False, 0, 0, 1e-3),)}, ValueError, r"tiers\[0\]: num_slots must be in"),
    ({"tiers": ((2, 7, 1, False, 2, 2, 1e-3),)}, ValueError, r"tiers\[0\]: admission must be"),
    ({"tiers": ((2, 0, 1, False, 1, 2, 1e-3),)}, ValueError, r"tiers\[0\]: need 0 <= low_slots <= high_slots"),
    ({"promote_to": 1}, ValueError, "promote_to must be -1 or a tier index below 1"),
    ({"block_tokens": 0}, ValueError, "block_tokens and progress_every must be >= 1"),
    ({"on_progress": 5}, TypeError, "on_progress must be callable"),
])
def test_replay_lru_rejects_malformed_input(change, error, message):
    with pytest.raises(error, match=message):
        replay_lru(**{**good_args(), **change})


def good_hints(**change) -> tuple:
    """`replay_lru`'s `hints` for `good_args`: request 0 in a session, request 1 closes it, retaining."""
    fields = dict(now_s=np.array([0.0, 1.0]), retain_s=np.array([0.0, 5.0]), ids=np.array([0, 1, 0, 1], dtype=np.int32),
                  offsets=np.array([0, 0, 2, 2, 2, 2, 4], dtype=np.int64), tenant_cap=0, total_cap=1, prune_keep=8)
    return tuple({**fields, **change}.values())


def test_replay_lru_applies_good_hints():
    counts = replay_lru(**good_args(), hints=good_hints())
    assert counts["hints"] == {"over_budget": 2, "doomed_evicted": 0, "num_retained": 0}
    assert "hints" not in replay_lru(**good_args())


@pytest.mark.parametrize("change, error, message", [
    ({"hints": (1, 2)}, TypeError, "hints must be None or a tuple"),
    ({"hints": good_hints(now_s=np.array([0.0]))}, ValueError, "now_s must have 2 items"),
    ({"hints": good_hints(retain_s=np.array([0.0, -1.0]))}, ValueError, "request 1: .*retain_s finite and >= 0"),
    ({"hints": good_hints(now_s=np.array([0.0, np.inf]))}, ValueError, "request 1: now_s must be finite"),
    ({"hints": good_hints(ids=np.array([0, 1, 0, 3], dtype=np.int32))}, ValueError, r"hints: ids\[3\] = 3"),
    ({"hints": good_hints(offsets=np.array([0, 0, 2, 1, 2, 2, 4], dtype=np.int64))}, ValueError, r"offsets\[3\]"),
    ({"hints": good_hints(offsets=np.array([0, 0, 2, 2, 2, 2, 5], dtype=np.int64))}, ValueError, r"offsets\[6\]"),
    ({"hints": good_hints(offsets=np.array([0, 2, 2], dtype=np.int64))}, ValueError, "offsets must have 7 items"),
    ({"hints": good_hints(prune_keep=-1)}, ValueError, "prune_keep must be >= 0"),
])
def test_replay_lru_rejects_malformed_hints(change, error, message):
    with pytest.raises(error, match=message):
        replay_lru(**{**good_args(), **change})


def test_replay_lru_passes_on_what_on_progress_raises():
    def stop(n):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        replay_lru(**good_args(), on_progress=stop, progress_every=1)
