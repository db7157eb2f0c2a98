"""`kvtier simulate --hints`: trace hint fields, derivations, the replay with hints, the gap figure.

Cost: about ten seconds (a hand-made trace, and 2,000 requests of the conversation trace).
"""

from __future__ import annotations

import json

import pytest

from kvtier.cli import main as cli_main
from kvtier.deciding.manager import TierManager, TierSlots
from kvtier.policy import PolicyKind, make_policy
from kvtier.policy.admission import AdmissionKind, AdmissionRule
from kvtier.errors import ConfigError
from kvtier.kinds import TierKind
from kvtier.simulate.hints import HintSpec, compare_hints, derive_hints, parse_hints
from kvtier.simulate.replay import SimConfig, SimEngine, SimPolicy, VirtualTier, blocks_of_share, simulate
from kvtier.simulate.trace import TraceError, load_trace, resolve_trace_path

# (hash ids, timestamp ms): conversation 0 (requests 0 and 3), then 1 and 2 of one request each.
HAND = [([1, 2], 0), ([5, 6], 1000), ([8], 2000), ([1, 2, 3], 3000)]


def write_trace(tmp_path, lines: list[dict], name: str = "t.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def hand_trace(tmp_path, **extra):
    return load_trace(write_trace(tmp_path, [{"timestamp": t, "input_length": 512 * len(ids), "output_length": 1,
                                              "hash_ids": ids, **extra} for ids, t in HAND]))


def dram(num_slots: int, policy: SimPolicy = SimPolicy.LRU) -> SimConfig:
    return SimConfig((VirtualTier(TierKind.DRAM, num_slots, 25.0),), 1 << 20, policy=policy)


def test_session_end_follows_conversations_and_closes_their_last_request(tmp_path):
    hinted = derive_hints(hand_trace(tmp_path), parse_hints("session-end"))
    sessions = [r.session for r in hinted.requests]
    assert sessions[0] == sessions[3] and len(set(sessions)) == 3
    assert [r.closed for r in hinted.requests] == [False, True, True, True]
    assert all(r.retain_s is None for r in hinted.requests)


def test_ttl_and_wrong_session_ends(tmp_path):
    hinted = derive_hints(hand_trace(tmp_path), parse_hints("session-end,ttl=5m,wrong=1"))
    assert [r.retain_s for r in hinted.requests] == [300.0] * 4
    # every conversation of two requests or more closes one request early too, then comes back
    assert [r.closed for r in hinted.requests] == [True, True, True, True]
    assert parse_hints("ttl=300") == HintSpec(ttl_s=300.0)


@pytest.mark.parametrize(("text", "match"), [
    ("sessionend", "unknown item"), ("ttl=", "unknown item"), ("ttl=-3s", "ttl"), ("ttl=abc", "ttl"),
    ("wrong=0.5", "needs session-end"), ("session-end,wrong=2", "wrong"), ("ttl=1,ttl=2", "twice"),
])
def test_bad_hints_option_is_named(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_hints(text)


def test_trace_hint_fields_are_read(tmp_path):
    trace = hand_trace(tmp_path, session="s-42", retain_s=30)
    assert {(r.session, r.retain_s, r.closed) for r in trace.requests} == {("s-42", 30.0, False)}


@pytest.mark.parametrize(("fields", "match"), [
    ({"session": 42}, "session"), ({"session": ""}, "session"), ({"closed": "yes", "session": "a"}, "closed"),
    ({"closed": True}, "closed needs a session"), ({"retain_s": 0}, "retain_s"), ({"retain_s": "1"}, "retain_s"),
])
def test_bad_trace_hint_fields_name_the_line_and_field(tmp_path, fields, match):
    good = {"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}
    path = write_trace(tmp_path, [good, {**good, **fields}])
    with pytest.raises(TraceError, match=f"line 2: .*{match}"):
        load_trace(path)


def test_the_native_engine_replays_hints_and_other_policies_fall_back(tmp_path):
    hinted = derive_hints(hand_trace(tmp_path), parse_hints("session-end"))
    report = simulate(hinted, dram(3))
    assert (report["engine"], report["engine_fallback"]) == ("native", None)
    assert report["hints"] == simulate(hinted, dram(3), engine=SimEngine.MANAGER)["hints"]
    assert report["hints"]["closed"] == 3 and report["hints"]["applied"] == 4
    chain = simulate(hinted, dram(3, SimPolicy.CHAIN_ARC))
    assert chain["engine"] == "manager" and "policy chain-arc" in chain["engine_fallback"]
    with pytest.raises(ConfigError, match="engine native: policy chain-arc"):
        simulate(hinted, dram(3, SimPolicy.CHAIN_ARC), engine=SimEngine.NATIVE)


def test_hints_on_the_hand_trace_keep_the_live_conversation(tmp_path):
    """Four slots: request 2 needs one victim. LRU takes block 1, the oldest, and request 3 then
    misses its whole prefix; with hints conversation 1 has closed, so its block 5 goes instead
    and request 3 hits 1 and 2."""
    trace = hand_trace(tmp_path)
    hinted = derive_hints(trace, parse_hints("session-end"))
    assert simulate(trace, dram(4))["num_hits"] == 0
    for engine in (SimEngine.NATIVE, SimEngine.MANAGER):
        assert simulate(hinted, dram(4), engine=engine)["num_hits"] == 2


@pytest.fixture(scope="module")
def conversation_slice():
    return load_trace(resolve_trace_path("conversation"), limit=2000)


@pytest.mark.parametrize("policy", [SimPolicy.LRU, SimPolicy.CHAIN_ARC])
def test_session_end_hints_close_most_of_the_gap_on_a_slice(conversation_slice, policy):
    trace = conversation_slice
    config = dram(blocks_of_share(0.05, trace.num_unique_blocks), policy)
    [row] = compare_hints(trace, derive_hints(trace, parse_hints("session-end")), [config])
    assert row["belady"] > row["lru"]
    assert row["block_hit_rate_hinted"] > row["block_hit_rate"]
    assert row["gap_closed_hinted"] > 0.5
    if policy is SimPolicy.LRU:  # (chain-arc on this slice gains 0.1 point from them: noise at this size)
        [wrong] = compare_hints(trace, derive_hints(trace, parse_hints("session-end,wrong=0.5")), [config])
        assert wrong["block_hit_rate_hinted"] < row["block_hit_rate_hinted"]  # wrong hints cost hits


def test_cli_hints_report(capsys):
    assert cli_main(["simulate", "--trace", "conversation", "--limit", "500", "--capacity", "dram=5%",
                     "--hints", "session-end", "--json", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    [row] = report["hints"]["rows"]
    assert report["hints"]["spec"] == "session-end" and row["label"] == "lru"
    assert row["engine_hinted"] == "native" and "--hints" not in err


def test_cli_hints_say_which_policies_use_the_manager(capsys):
    assert cli_main(["simulate", "--trace", "conversation", "--limit", "200", "--capacity", "dram=5%",
                     "--policy", "lru,arc", "--hints", "session-end", "--json", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    engines = {row["label"]: row["engine_hinted"] for row in json.loads(out)["hints"]["rows"]}
    assert engines == {"lru": "native", "arc": "manager"}
    assert "policy arc: the native engine replays LRU only; the arc runs use the manager" in err
    assert "policy lru" not in err


def test_cli_hints_refuse_sweep_and_servers(capsys):
    assert cli_main(["simulate", "--trace", "conversation", "--limit", "50", "--sweep",
                     "--hints", "session-end"]) != 0
    assert "--hints needs --capacity and cannot be combined with --sweep" in capsys.readouterr().err
    assert cli_main(["simulate", "--trace", "conversation", "--limit", "50", "--servers", "2",
                     "--capacity", "dram=5%", "--hints", "session-end"]) != 0
    assert "--servers cannot be combined with --hints" in capsys.readouterr().err


def test_a_trace_without_hints_still_runs_natively(tmp_path):
    report = simulate(hand_trace(tmp_path), dram(4))
    assert report["engine"] == "native" and "hints" not in report


def _three_tiers(kind: PolicyKind) -> TierManager:
    return TierManager([TierSlots(t, n, make_policy(kind, n), AdmissionRule(AdmissionKind.ALL),
                                  *((1.0, 1.0) if t is TierKind.SSD else (0.95, 0.85)))
                        for t, n in ((TierKind.HBM, 60), (TierKind.DRAM, 250), (TierKind.SSD, 700))])


def _two_phase(m: TierManager, keys) -> None:
    def complete(moves):
        while moves:
            moves = m.complete_moves([mv.id for mv in moves])

    n = m.lookup(keys)
    if n:
        plan = m.prepare_load(keys[:n])
        complete(plan.moves)
        complete(m.complete_load(plan))
    if n < len(keys):
        plan = m.prepare_store(keys[n:])
        complete(plan.moves)
        complete(m.complete_store(plan))


def _now(m: TierManager, keys) -> None:
    n = m.lookup(keys)
    if n:
        m.load_now(keys[:n])
    if n < len(keys):
        m.store_now(keys[n:])


def _state(m: TierManager) -> tuple:
    return m.stats.snapshot(), sorted((e.key, sorted((t, c.slot, c.state.value) for t, c in e.copies.items()))
                                      for e in m.index)


@pytest.mark.parametrize("kind", list(PolicyKind), ids=lambda k: k.value)
def test_hinted_synchronous_path_decides_as_the_two_phase_verbs(conversation_slice, kind):
    """With hints (session ends, some wrong, and a ttl), `store_now` / `load_now` still decide
    exactly as the two-phase verbs completed at once, in three tiers."""
    hinted = derive_hints(conversation_slice, parse_hints("session-end,ttl=60s,wrong=0.2")).requests[:1200]
    ref, fast = _three_tiers(kind), _three_tiers(kind)
    for i, r in enumerate(hinted):
        _two_phase(ref, r.hash_ids)
        _now(fast, r.hash_ids)
        for m in (ref, fast):
            m.apply_hint(r.hash_ids, now=r.timestamp_ms / 1000, session=r.session, retain_s=r.retain_s,
                         closed=r.closed)
        if i % 100 == 0:
            assert _state(ref) == _state(fast), f"request {i}: the paths diverged"
    assert _state(ref) == _state(fast)
    assert ref.stats.hints["doomed_evicted"] > 0 and ref.num_retained() > 0
