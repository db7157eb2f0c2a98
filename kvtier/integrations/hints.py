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

log = logging.getLogger(__name__)

NAMESPACE = "kvtier"
MAX_SESSION_CHARS = 128


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
    session = _session(body.get("session", session_id), "session" in body)
    retain_s = _retain_s(body.get("retain_s"), max_retain_s)
    closed = body.get("closed", False)
    if not isinstance(closed, bool):
        raise HintRefused(HintRefusal.BAD_CLOSED, f"hint field 'closed' must be true or false, not {closed!r}")
    if closed and session is None:
        raise HintRefused(HintRefusal.CLOSED_WITHOUT_SESSION, "hint 'closed' needs a 'session' to close")
    return RetentionHint(session, retain_s, closed)


def _session(value: object, given: bool) -> str | None:
    if value is None:
        if given:
            raise HintRefused(HintRefusal.BAD_SESSION, "hint field 'session' is null")
        return None
    if (not isinstance(value, str) or not 0 < len(value) <= MAX_SESSION_CHARS
            or not value.isascii() or not value.isprintable()):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise HintRefused(HintRefusal.BAD_SESSION,
                          f"hint field 'session' must be 1-{MAX_SESSION_CHARS} printable ASCII characters, not {shown}")
    return value


def _retain_s(value: object, max_retain_s: float) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= max_retain_s:
        raise HintRefused(HintRefusal.BAD_RETAIN_S,
                          f"hint field 'retain_s' must be a number of seconds in (0, {max_retain_s:g}], not {value!r}")
    return float(value)


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
