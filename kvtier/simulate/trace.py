"""Reading Mooncake-format request traces for `kvtier simulate`.

One JSON object per line: `{"timestamp": <ms>, "input_length": <tokens>, "output_length": <tokens>,
"hash_ids": [<int>, ...]}`, optionally with retention hints: `"session"` (1-128 printable ASCII
characters), `"closed"` (a bool; needs a session) and `"retain_s"` (seconds, > 0; see
kvtier.deciding.retention). Each hash id names one `block_tokens`-token block of the input (512 in
the Mooncake FAST'25 traces); ids are prefix-chained, so equal ids mean equal prefixes. Traces
differ on the partial tail block: the Mooncake traces list an id for it too
(`len(hash_ids) == ceil(input_length / block_tokens)`), others list full blocks only (floor). Both
are accepted, line by line; each request records which it is (`TraceRequest.partial_tail`) and the
trace counts them (`Trace.tail_counts`). Any other count is a malformed line.

The file is read as a stream, as it comes: plain JSON Lines, gzip or Zstandard, told apart by their
first bytes (not by the name), so a trace of millions of lines is never decompressed whole, on disk
or in memory. Equal hash ids share one int object, so a trace costs one pointer per block access
and one int per distinct block.

A malformed line either stops the load with a `TraceError` naming the file and line, or is skipped
and recorded (line number and reason) in `Trace.skipped_lines`: the caller chooses. Blank lines
are ignored. A compressed file that is cut short or corrupt stops the load, naming the line reached.
"""

from __future__ import annotations

import enum
import gzip
import io
import json
import math
import numbers
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvtier.deciding.retention import MAX_SESSION_CHARS
from kvtier.errors import KVTierError

try:  # a dependency of kvtier; optional here only so that plain and gzip traces never need it
    import zstandard
except ImportError:  # pragma: no cover - installed with kvtier
    zstandard = None
_ZSTD_ERRORS: tuple[type[Exception], ...] = (zstandard.ZstdError,) if zstandard is not None else ()

MOONCAKE_BLOCK_TOKENS = 512
# The Mooncake traces ship inside the package (compressed; see the README there), so an installed
# kvtier finds `--trace conversation` wherever it runs.
DEFAULT_TRACE_DIR = Path(__file__).resolve().parents[1] / "data" / "traces" / "mooncake"
TRACE_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")


class TraceError(KVTierError, ValueError):
    """A trace file is missing, unreadable, empty or has a malformed line; the message names the line."""


class OnError(enum.Enum):
    """What to do with a malformed trace line."""

    STOP = "stop"  # raise TraceError naming the line
    SKIP = "skip"  # drop the line, record its number and reason


# The first bytes of the compressed formats a trace may come in.
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    `partial_tail`: the last hash id names a partial block (the line listed ceil(input_length /
    block_tokens) ids and the input is not a whole number of blocks); False when every id names a
    full block (a whole number of blocks, or a line that left the partial tail out).
    """

    timestamp_ms: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]
    partial_tail: bool = False
    # Optional retention hints (kvtier.deciding.retention): the request's conversation, that it
    # ended with this request, and how long to keep its blocks (seconds).
    session: str | None = None
    closed: bool = False
    retain_s: float | None = None

    @property
    def hinted(self) -> bool:
        """Whether the request carries any hint."""
        return self.session is not None or self.retain_s is not None


@dataclass(frozen=True, slots=True)
class Trace:
    """A loaded trace: its requests in timestamp order and what was skipped."""

    path: str
    block_tokens: int
    requests: tuple[TraceRequest, ...]
    skipped_lines: tuple[tuple[int, str], ...]  # (1-based line number, reason)
    num_accesses: int  # block accesses: every hash id of every request
    num_unique_blocks: int
    # Requests by how their line listed the partial tail block: "whole" (the input is a whole number
    # of blocks: floor = ceil), "tail_listed" (ceil: an id for the partial tail), "tail_absent" (floor).
    tail_counts: tuple[tuple[str, int], ...] = ()
    # Requests whose line came after a line with a later timestamp: the file was not in time order,
    # and `requests` is (a stable sort by timestamp, so equal timestamps keep their file order).
    num_reordered: int = 0

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
            "hash_ids_per_request": dict(self.tail_counts),
            "num_reordered": self.num_reordered,
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
    names = (path.name, f"{path.name}.jsonl", f"{path.name}_trace.jsonl")
    for candidate in (*names, *(n + z for n in names[1:] for z in (".gz", ".zst"))):
        if (DEFAULT_TRACE_DIR / candidate).is_file():
            return DEFAULT_TRACE_DIR / candidate
    known = sorted(p.name for p in DEFAULT_TRACE_DIR.iterdir() if p.name.endswith(TRACE_SUFFIXES)) \
        if DEFAULT_TRACE_DIR.is_dir() else []
    hint = f"; traces in {DEFAULT_TRACE_DIR}: {', '.join(known)}" if known else ""
    raise TraceError(f"trace file not found: {str(name)!r}{hint}")


def load_trace(path: str | Path, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS,
               on_error: OnError = OnError.STOP, limit: int | None = None) -> Trace:
    """Reads a Mooncake-format trace: JSON Lines, plain, gzip or Zstandard (see the module's docstring).

    Args:
        path: the trace file.
        block_tokens: tokens per hash id; each line must have floor or ceil(input_length /
            block_tokens) ids.
        on_error: stop at the first malformed line, or skip it and record why.
        limit: read at most this many requests (None: all).
    Returns:
        The requests in timestamp order (file order where the file is in time order, as traces
        usually are; otherwise sorted, stably, and `num_reordered` says how many moved), with the
        skipped lines, access counts and tail counts.
    Raises:
        TraceError: the file cannot be read or decompressed, a line is malformed (with
            `OnError.STOP`; the message gives the file, the 1-based line number and what is wrong),
            no request was read, or no request lists a block (every hash_ids empty).
    """
    path = Path(path)
    requests: list[TraceRequest] = []
    skipped: list[tuple[int, str]] = []
    ids: dict[int, int] = {}  # each distinct hash id once: equal ids share one int object
    tails = {"whole": 0, "tail_listed": 0, "tail_absent": 0}
    number = 0
    try:
        with open_trace_text(path) as f:
            for number, text in enumerate(f, start=1):
                if limit is not None and len(requests) >= limit:
                    break
                if not text.strip():
                    continue
                try:
                    request = parse_line(text, block_tokens, ids)
                except ValueError as e:
                    if on_error is OnError.STOP:
                        raise TraceError(f"{path}: line {number}: {e} (on_error=skip, "
                                         "or --on-error skip, skips malformed lines)") from None
                    skipped.append((number, str(e)))
                    continue
                requests.append(request)
                if request.partial_tail:
                    tails["tail_listed"] += 1
                else:
                    tails["whole" if request.input_tokens % block_tokens == 0 else "tail_absent"] += 1
    except (OSError, EOFError, zlib.error, *_ZSTD_ERRORS) as e:  # unreadable; compressed, cut short or corrupt
        where = f" after line {number}" if number else ""
        raise TraceError(f"cannot read trace {str(path)!r}{where}: {getattr(e, 'strerror', None) or e}") from None
    if not requests:
        raise TraceError(f"{path}: no valid request in the trace ({len(skipped)} malformed lines skipped)")
    num_accesses = sum(len(r.hash_ids) for r in requests)
    if not num_accesses:
        raise TraceError(f"{path}: none of the {len(requests)} requests read lists a hash id (each input is "
                         f"shorter than one block of {block_tokens} tokens): there is no block to replay")
    num_reordered = _num_out_of_order(requests)
    if num_reordered:
        requests.sort(key=lambda r: r.timestamp_ms)  # stable
    return Trace(str(path), block_tokens, tuple(requests), tuple(skipped), num_accesses, len(ids),
                 tuple(tails.items()), num_reordered)


def _num_out_of_order(requests: list[TraceRequest]) -> int:
    """How many requests have a timestamp below that of some request before them."""
    latest, count = -math.inf, 0
    for request in requests:
        if request.timestamp_ms < latest:
            count += 1
        else:
            latest = request.timestamp_ms
    return count


@contextmanager
def open_trace_text(path: Path) -> Iterator[Iterator[str]]:
    """The trace's lines as text, decompressed as they are read (gzip and Zstandard by their first bytes).

    Raises:
        OSError: the file cannot be opened.
        TraceError: a Zstandard file, and the `zstandard` package is missing.
    """
    with path.open("rb") as raw:
        magic = raw.read(4)
        raw.seek(0)
        if magic.startswith(_GZIP_MAGIC):
            stream: io.BufferedIOBase = gzip.GzipFile(fileobj=raw, mode="rb")
        elif magic == _ZSTD_MAGIC:
            if zstandard is None:
                raise TraceError(f"{path}: a Zstandard file; reading it needs the `zstandard` package "
                                 "(pip install zstandard)")
            stream = io.BufferedReader(_ZstdFrames(raw), buffer_size=1 << 20)
        else:
            stream = raw
        with io.TextIOWrapper(stream, encoding="utf-8", errors="replace", newline=None) as text:
            yield _checked_lines(text)


def _checked_lines(text: Iterator[str]) -> Iterator[str]:
    """`text`'s lines, each given once the next one is read: a compressed stream cut short raises
    before the partial line it ends in is parsed (as a malformed line, which it is not)."""
    held = None
    for line in text:
        if held is not None:
            yield held
        held = line
    if held is not None:
        yield held


class _ZstdFrames(io.RawIOBase):
    """A Zstandard file's content, frame after frame, decompressed as it is read; a file that ends
    inside a frame raises EOFError (zstandard's own stream reader ends there silently)."""

    _CHUNK = 1 << 20

    def __init__(self, raw: io.BufferedIOBase) -> None:
        self._raw = raw
        self._frame = zstandard.ZstdDecompressor().decompressobj()
        self._in_frame = False  # input of the current frame was fed and its end not seen yet
        self._out = memoryview(b"")  # decompressed, not read yet

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._out:
            data = self._raw.read(self._CHUNK)
            if not data:
                if self._in_frame:
                    raise EOFError("Zstandard stream cut short (the file ends inside a frame)")
                return 0
            self._out = memoryview(self._feed(data))
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]  # a view: what is left is not copied again
        return n

    def _feed(self, data: bytes) -> bytes:
        out = []
        while data:
            out.append(self._frame.decompress(data))
            self._in_frame = not self._frame.eof
            data = self._frame.unused_data if self._frame.eof else b""
            if self._frame.eof:  # the next frame, if any, starts in what is left
                self._frame = zstandard.ZstdDecompressor().decompressobj()
        return b"".join(out)


def parse_line(text: str, block_tokens: int, ids: dict[int, int] | None = None) -> TraceRequest:
    """One trace line as a request.

    Args:
        text: the line.
        block_tokens: tokens per hash id.
        ids: hash ids seen so far, each mapped to itself: equal ids come back as one int object
            (the trace then holds a pointer per access, not an int); None: not shared.
    Raises:
        ValueError: the line is not a JSON object with the four fields, of the right types and
            consistent lengths; the message says which field is wrong.
    """
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:  # the decoder recurses per nesting level; a trace line nests two deep
        raise ValueError("JSON nested too deeply (a trace line is an object holding one list)") from None
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
    ceil, floor = -(-input_tokens // block_tokens), input_tokens // block_tokens
    if len(hash_ids) != ceil and len(hash_ids) != floor:
        raise ValueError(f"{len(hash_ids)} hash_ids for input_length {input_tokens}: expected "
                         f"ceil({input_tokens} / {block_tokens}) = {ceil}"
                         + (f" or floor = {floor} (the partial tail left out)" if floor != ceil else ""))
    if ids is not None:
        setdefault = ids.setdefault
        hash_ids = [setdefault(h, h) for h in hash_ids]
    return TraceRequest(float(timestamp), input_tokens, output_tokens, tuple(hash_ids),
                        len(hash_ids) == ceil != floor, *_hint_fields(obj))


def _hint_fields(obj: dict) -> tuple[str | None, bool, float | None]:
    """A line's optional hint fields (session, closed, retain_s); ValueError naming a bad one."""
    session, closed, retain_s = obj.get("session"), obj.get("closed", False), obj.get("retain_s")
    if session is not None and (not isinstance(session, str) or not 1 <= len(session) <= MAX_SESSION_CHARS
                                or not session.isascii() or not session.isprintable()):
        raise ValueError(f"session must be a string of 1-{MAX_SESSION_CHARS} printable ASCII characters, "
                         f"got {session!r}")
    if not isinstance(closed, bool):
        raise ValueError(f"closed must be true or false, got {closed!r}")
    if closed and session is None:
        raise ValueError("closed needs a session (the session it closes)")
    if retain_s is not None and (not _is_number(retain_s) or not 0 < retain_s < math.inf):
        raise ValueError(f"retain_s must be a positive number of seconds, got {retain_s!r}")
    return session, closed, None if retain_s is None else float(retain_s)


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _count(obj: dict, field: str, minimum: int) -> int:
    value = obj[field]
    if type(value) is not int or value < minimum:
        raise ValueError(f"{field} must be an integer >= {minimum}, got {value!r}")
    return value
