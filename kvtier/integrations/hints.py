"""Retention hints as clients send them, read once at the edge of every engine integration.

A request says how long its KV is worth keeping, and when its conversation is over, in one small
mapping under the `kvtier` name of whatever the engine passes through to its KV connector (vLLM:
the body's `kv_transfer_params`; Hugging Face and SGLang: the same mapping as an argument):

    {"kvtier": {"retain_s": 300, "session": "s-42"}}       keep these blocks 5 minutes
    {"kvtier": {"session": "s-42", "closed": true}}         s-42 is over: its blocks may go first

A hint is advice. One that is malformed is refused, counted under a named reason and logged (the
first of each reason at WARNING, later ones at DEBUG); the request itself is served exactly as it
would have been without it, never failed for its hint.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from kvtier.deciding.retention import HintError, HintLimits, check_hint

log = logging.getLogger(__name__)

NAMESPACE = "kvtier"


class HintRefusal(str, Enum):
    """Why a hint was not taken (the label of `kvtier_hints_refused_total{reason}`)."""

    NOT_A_MAPPING = "not_a_mapping"
    UNKNOWN_FIELD = "unknown_field"
    BAD_RETAIN_S = "bad_retain_s"
    BAD_SESSION = "bad_session"
    BAD_CLOSED = "bad_closed"
    CLOSED_WITHOUT_SESSION = "closed_without_session"
    EMPTY = "empty"


class HintRefused(ValueError):
    """A hint that cannot be taken; `reason` says which rule it broke, the message what it was."""

    def __init__(self, reason: HintRefusal, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class RetentionHint:
    """One request's hint: its session (None: none given), seconds to keep its blocks (None: no
    lease), and whether the session ends with this request."""

    session: str | None = None
    retain_s: float | None = None
    closed: bool = False


def parse_hint(params: object, *, max_retain_s: float, session_id: str | None = None) -> RetentionHint | None:
    """The hint in a request's pass-through parameters, or None where it carries none.

    Args:
        params: the mapping the engine passes through (vLLM's `kv_transfer_params`), or None.
        max_retain_s: the longest lease a request may ask for (config `hints.max_retain_s`).
        session_id: the engine's own session id for the request (vLLM's `request.session_id`),
            used when the hint names no session.
    Raises:
        HintRefused: the `kvtier` entry is present but breaks a rule; the message names the field.
    """
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise HintRefused(HintRefusal.NOT_A_MAPPING, f"kv_transfer_params is a {type(params).__name__}, not a mapping")
    body = params.get(NAMESPACE)
    if body is None:
        return None
    if not isinstance(body, Mapping):
        raise HintRefused(HintRefusal.NOT_A_MAPPING, f"the {NAMESPACE!r} hint is a {type(body).__name__}, not a mapping")
    unknown = sorted(str(k) for k in body if k not in ("retain_s", "session", "closed"))
    if unknown:
        raise HintRefused(HintRefusal.UNKNOWN_FIELD,
                          f"the {NAMESPACE!r} hint has unknown field(s) {', '.join(map(repr, unknown))}; "
                          "known: 'retain_s', 'session', 'closed'")
    if not body:
        raise HintRefused(HintRefusal.EMPTY, f"the {NAMESPACE!r} hint is empty")
    if "session" in body and body["session"] is None:
        raise HintRefused(HintRefusal.BAD_SESSION, "hint field 'session' is null")
    session, retain_s, closed = body.get("session", session_id), body.get("retain_s"), body.get("closed", False)
    try:  # the manager's own check of the values (`retention.check_hint`), its reasons ours
        check_hint(session, retain_s, closed, HintLimits(max_retain_s=max_retain_s))
    except HintError as e:
        raise HintRefused(HintRefusal(e.reason), str(e)) from None
    return RetentionHint(session, None if retain_s is None else float(retain_s), closed)


class HintReader:
    """Reads hints for one engine: counts what it refuses, logs each reason once at WARNING."""

    def __init__(self, max_retain_s: float) -> None:
        if not (isinstance(max_retain_s, (int, float)) and math.isfinite(max_retain_s) and max_retain_s > 0):
            raise ValueError(f"hints.max_retain_s must be a positive number of seconds, not {max_retain_s!r}")
        self.max_retain_s = float(max_retain_s)
        self.refused: Counter[HintRefusal] = Counter()
        self.num_read = 0

    def read(self, params: object, session_id: str | None = None, request: str = "?") -> RetentionHint | None:
        """The request's hint, or None (no hint, or a refused one: counted and logged, never raised)."""
        try:
            hint = parse_hint(params, max_retain_s=self.max_retain_s, session_id=session_id)
        except HintRefused as refused:
            self.refused[refused.reason] += 1
            level = logging.WARNING if self.refused[refused.reason] == 1 else logging.DEBUG
            log.log(level, "request %s: hint refused (%s): %s; served without it", request, refused.reason.value, refused)
            return None
        self.num_read += hint is not None
        return hint
