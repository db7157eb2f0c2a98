"""Reading Mooncake-format request traces for `kvtier simulate`.

One JSON object per line: `{"timestamp": <ms>, "input_length": <tokens>, "output_length": <tokens>,
"hash_ids": [<int>, ...]}`. Each hash id names one `block_tokens`-token block of the input (512 in
the Mooncake FAST'25 traces); ids are prefix-chained, so equal ids mean equal prefixes, and the last
id covers the partial tail block, so `len(hash_ids) == ceil(input_length / block_tokens)`.

A malformed line either stops the load with a `TraceError` naming the file and line, or is skipped
and recorded (line number and reason) in `Trace.skipped_lines`: the caller chooses. Blank lines
are ignored.
"""

from __future__ import annotations

import enum
import json
import math
import numbers
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import KVTierError

MOONCAKE_BLOCK_TOKENS = 512
# In CI the repository is cloned next to `shared/`; so is this checkout.
DEFAULT_TRACE_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces" / "mooncake"


class TraceError(KVTierError, ValueError):
    """A trace file is missing, unreadable, empty or has a malformed line; the message names the line."""


class OnError(enum.Enum):
    """What to do with a malformed trace line."""

    STOP = "stop"  # raise TraceError naming the line
    SKIP = "skip"  # drop the line, record its number and reason


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace."""

    timestamp_ms: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Trace:
    """A loaded trace: its requests in file order and what was skipped."""

    path: str
    block_tokens: int
    requests: tuple[TraceRequest, ...]
    skipped_lines: tuple[tuple[int, str], ...]  # (1-based line number, reason)
    num_accesses: int  # block accesses: every hash id of every request
    num_unique_blocks: int

    @property
    def max_block_hit_rate(self) -> float:
        """The block hit rate of an infinite cache: every access but each block's first one hits."""
        return 1 - self.num_unique_blocks / self.num_accesses

    def describe(self) -> dict[str, object]:
        """JSON-ready facts about the trace."""
        return {
            "path": self.path, "block_tokens": self.block_tokens, "num_requests": len(self.requests),
            "num_accesses": self.num_accesses, "num_unique_blocks": self.num_unique_blocks,
            "input_tokens": sum(r.input_tokens for r in self.requests),
            "max_block_hit_rate": self.max_block_hit_rate,
            "num_skipped_lines": len(self.skipped_lines),
            "skipped_lines": [{"line": n, "reason": why} for n, why in self.skipped_lines[:20]],
        }  # fmt: skip


def resolve_trace_path(name: str | Path) -> Path:
    """An existing path as given, else a file of the default Mooncake directory.

    `conversation_trace.jsonl`, `conversation_trace` and `conversation` all name
    `<DEFAULT_TRACE_DIR>/conversation_trace.jsonl`.

    Raises:
        TraceError: no such file; the message lists the traces of the default directory.
    """
    path = Path(name)
    if path.is_file():
        return path
    for candidate in (path.name, f"{path.name}.jsonl", f"{path.name}_trace.jsonl"):
        if (DEFAULT_TRACE_DIR / candidate).is_file():
            return DEFAULT_TRACE_DIR / candidate
    known = sorted(p.name for p in DEFAULT_TRACE_DIR.glob("*.jsonl")) if DEFAULT_TRACE_DIR.is_dir() else []
    hint = f"; traces in {DEFAULT_TRACE_DIR}: {', '.join(known)}" if known else ""
    raise TraceError(f"trace file not found: {str(name)!r}{hint}")


def load_trace(path: str | Path, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS,
               on_error: OnError = OnError.STOP, limit: int | None = None) -> Trace:
    """Reads a Mooncake-format trace.

    Args:
        path: the JSON Lines file.
        block_tokens: tokens per hash id; each line must have ceil(input_length / block_tokens) ids.
        on_error: stop at the first malformed line, or skip it and record why.
        limit: read at most this many requests (None: all).
    Returns:
        The requests in file order, with the skipped lines and access counts.
    Raises:
        TraceError: the file cannot be read, a line is malformed (with `OnError.STOP`; the message
            gives the file, the 1-based line number and what is wrong), or no request was read.
    """
    path = Path(path)
    requests: list[TraceRequest] = []
    skipped: list[tuple[int, str]] = []
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            for number, text in enumerate(f, start=1):
                if limit is not None and len(requests) >= limit:
                    break
                if not text.strip():
                    continue
                try:
                    requests.append(parse_line(text, block_tokens))
                except ValueError as e:
                    if on_error is OnError.STOP:
                        raise TraceError(f"{path}: line {number}: {e} (on_error=skip, "
                                         "or --on-error skip, skips malformed lines)") from None
                    skipped.append((number, str(e)))
    except OSError as e:
        raise TraceError(f"cannot read trace {str(path)!r}: {e.strerror or e}") from None
    if not requests:
        raise TraceError(f"{path}: no valid request in the trace ({len(skipped)} malformed lines skipped)")
    num_accesses = sum(len(r.hash_ids) for r in requests)
    num_unique = len({h for r in requests for h in r.hash_ids})
    return Trace(str(path), block_tokens, tuple(requests), tuple(skipped), num_accesses, num_unique)


def parse_line(text: str, block_tokens: int) -> TraceRequest:
    """One trace line as a request.

    Raises:
        ValueError: the line is not a JSON object with the four fields, of the right types and
            consistent lengths; the message says which field is wrong.
    """
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    for field in ("timestamp", "input_length", "output_length", "hash_ids"):
        if field not in obj:
            raise ValueError(f"missing field {field!r}")
    timestamp = obj["timestamp"]
    if not _is_number(timestamp) or not math.isfinite(timestamp):
        raise ValueError(f"timestamp must be a number, got {timestamp!r}")
    input_tokens = _count(obj, "input_length", minimum=1)
    output_tokens = _count(obj, "output_length", minimum=0)
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list) or not all(type(h) is int for h in hash_ids):
        raise ValueError("hash_ids must be a list of integers")
    expected = -(-input_tokens // block_tokens)
    if len(hash_ids) != expected:
        raise ValueError(f"{len(hash_ids)} hash_ids for input_length {input_tokens}: expected "
                         f"ceil({input_tokens} / {block_tokens}) = {expected}")
    return TraceRequest(float(timestamp), input_tokens, output_tokens, tuple(hash_ids))


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _count(obj: dict, field: str, minimum: int) -> int:
    value = obj[field]
    if type(value) is not int or value < minimum:
        raise ValueError(f"{field} must be an integer >= {minimum}, got {value!r}")
    return value
