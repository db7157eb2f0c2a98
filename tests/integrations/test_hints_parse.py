"""Retention hints as clients send them: what is taken, what is refused and why (no engine; fast)."""

from __future__ import annotations

import logging
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.integrations.hints import HintReader, HintRefusal, HintRefused, RetentionHint, parse_hint

MAX = 3600.0


@pytest.mark.parametrize("params, hint", [
    (None, None),
    ({}, None),
    ({"other_connector": {"x": 1}}, None),
    ({"kvtier": {"retain_s": 300, "session": "s-42"}}, RetentionHint("s-42", 300.0, False)),
    ({"kvtier": {"session": "s-42", "closed": True}}, RetentionHint("s-42", None, True)),
    ({"kvtier": {"retain_s": 0.5}}, RetentionHint(None, 0.5, False)),
    ({"kvtier": {"retain_s": MAX}}, RetentionHint(None, MAX, False)),
    ({"kvtier": {"session": "x" * 128}}, RetentionHint("x" * 128, None, False)),
])
def test_well_formed_hints_are_taken(params, hint):
    assert parse_hint(params, max_retain_s=MAX) == hint


@pytest.mark.parametrize("params, reason, names", [
    ([1, 2], HintRefusal.NOT_A_MAPPING, "list"),
    ({"kvtier": "keep"}, HintRefusal.NOT_A_MAPPING, "str"),
    ({"kvtier": {}}, HintRefusal.EMPTY, "empty"),
    ({"kvtier": {"retain": 5}}, HintRefusal.UNKNOWN_FIELD, "'retain'"),
    ({"kvtier": {"retain_s": 0}}, HintRefusal.BAD_RETAIN_S, "retain_s"),
    ({"kvtier": {"retain_s": -3}}, HintRefusal.BAD_RETAIN_S, "retain_s"),
    ({"kvtier": {"retain_s": MAX + 1}}, HintRefusal.BAD_RETAIN_S, "3600"),
    ({"kvtier": {"retain_s": math.inf}}, HintRefusal.BAD_RETAIN_S, "inf"),
    ({"kvtier": {"retain_s": math.nan}}, HintRefusal.BAD_RETAIN_S, "nan"),
    ({"kvtier": {"retain_s": True}}, HintRefusal.BAD_RETAIN_S, "True"),
    ({"kvtier": {"retain_s": "300"}}, HintRefusal.BAD_RETAIN_S, "'300'"),
    ({"kvtier": {"session": ""}}, HintRefusal.BAD_SESSION, "session"),
    ({"kvtier": {"session": None}}, HintRefusal.BAD_SESSION, "null"),
    ({"kvtier": {"session": 42}}, HintRefusal.BAD_SESSION, "42"),
    ({"kvtier": {"session": "x" * 129}}, HintRefusal.BAD_SESSION, "128"),
    ({"kvtier": {"session": "s\n1"}}, HintRefusal.BAD_SESSION, "printable"),
    ({"kvtier": {"session": "séance"}}, HintRefusal.BAD_SESSION, "ASCII"),
    ({"kvtier": {"closed": True}}, HintRefusal.CLOSED_WITHOUT_SESSION, "session"),
    ({"kvtier": {"session": "s", "closed": "yes"}}, HintRefusal.BAD_CLOSED, "'yes'"),
])
def test_malformed_hints_are_refused_with_a_named_reason(params, reason, names):
    with pytest.raises(HintRefused, match=names) as refused:
        parse_hint(params, max_retain_s=MAX)
    assert refused.value.reason is reason


def test_the_engines_session_id_stands_in_for_a_missing_session():
    params = {"kvtier": {"closed": True}}
    assert parse_hint(params, max_retain_s=MAX, session_id="conv-7") == RetentionHint("conv-7", None, True)
    assert parse_hint({"kvtier": {"session": "mine", "closed": True}}, max_retain_s=MAX,
                      session_id="conv-7").session == "mine"
    assert parse_hint(None, max_retain_s=MAX, session_id="conv-7") is None, "an engine session alone is no hint"


def test_a_reader_counts_each_refusal_logs_each_reason_once_and_never_raises(caplog):
    reader = HintReader(max_retain_s=60)
    caplog.set_level(logging.DEBUG, logger="kvtier.integrations.hints")
    assert reader.read({"kvtier": {"retain_s": 61}}, request="r1") is None
    assert reader.read({"kvtier": {"retain_s": 120}}, request="r2") is None
    assert reader.read({"kvtier": {"bogus": 1}}, request="r3") is None
    assert reader.read({"kvtier": {"retain_s": 30}}, request="r4") == RetentionHint(None, 30.0, False)
    assert reader.refused == {HintRefusal.BAD_RETAIN_S: 2, HintRefusal.UNKNOWN_FIELD: 1}
    assert reader.num_read == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [("r1" in r.getMessage(), "r3" in r.getMessage()) for r in warnings] == [(True, False), (False, True)]
    assert any(r.levelno == logging.DEBUG and "r2" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("bad", [0, -1, math.inf, math.nan, "60", None])
def test_a_reader_refuses_a_bad_ceiling(bad):
    with pytest.raises(ValueError, match="max_retain_s"):
        HintReader(bad)


JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                       max_leaves=8)


@given(body=st.dictionaries(st.sampled_from(["retain_s", "session", "closed", "x"]), JSONISH, max_size=4))
def test_any_json_a_client_sends_is_taken_or_refused_by_name(body):
    reader = HintReader(MAX)
    hint = reader.read({"kvtier": body})
    assert (hint is None) == (sum(reader.refused.values()) == 1)
    if hint is not None:
        assert hint.retain_s is None or 0 < hint.retain_s <= MAX
        assert hint.session is None or 0 < len(hint.session) <= 128
        assert not hint.closed or hint.session is not None
