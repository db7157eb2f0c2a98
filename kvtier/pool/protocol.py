"""The pool wire protocol, sans-I/O: frames in, frames out, nothing touches a socket here.

A frame is a fixed 20-byte prefix, a msgpack header and an optional raw payload:

    magic "KT" | version u8 | type u8 | request id u64 | header length u32 | payload length u32
    header: a msgpack map whose fields depend on the type (see `REQUESTS` and `REPLIES`)
    payload: raw block bytes; only WRITE/WRITE_COMMIT/PUT/MULTI_PUT requests and READ/GET replies carry one

Block bytes travel outside msgpack so that both ends can `recv_into` their final place (the node's
region, the caller's buffer) without a copy. A reply has the request's id and type | `REPLY`, or
type `ERROR` with `{code, message}`. Every decode path raises `ProtocolError` and nothing else on
bad input: a frame that is malformed, truncated, oversized or of another version.
"""

from __future__ import annotations

import enum
import functools
import operator
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack

MAGIC = b"KT"
VERSION = 1
PREFIX = struct.Struct("!2sBBQII")
PREFIX_BYTES = PREFIX.size  # 20
MAX_HEADER_BYTES = 1 << 20
MAX_HANDSHAKE_HEADER_BYTES = 1024  # before authentication a peer may not make the node buffer more
MAX_BATCH = 4096  # keys, leases or grants in one frame
MAX_KEY_BYTES = 64
MAX_NAME_BYTES = 64
MAX_INLINE_BYTES = 256 << 20  # block bytes one GET reply may carry; a node leases further hits instead
REPLY = 0x80
MAX_ANNOUNCE_TOKENS = 2048  # an announced block's block_size (and tokens) at most: its metadata stays small


class MsgType(enum.IntEnum):
    HELLO = 1  # tenant, client nonce -> server nonce
    AUTH = 2  # HMAC proof -> server proof, transport, limits
    PUT_BEGIN = 3  # keys, lengths -> one grant per key (a write lease on a fresh slot)
    PUT_COMMIT = 4  # keys, gens, checksums -> ok per key; the block becomes visible
    PUT_ABORT = 5
    GET = 6  # keys -> per key a miss, a hit under a read lease, or (inline) a hit with its bytes
    RELEASE = 7  # lease ids
    CONTAINS = 8
    DELETE = 9
    ALLOC = 10  # keys, lengths -> grants on mutable blocks (the Tier adapter's slots)
    READ = 11  # data plane: region, offset, length, gen -> payload
    WRITE = 12  # data plane: region, offset, gen + payload
    STATS = 13
    WRITE_COMMIT = 14  # data plane: WRITE of a whole WRITING block, then its commit with `checksum`
    RDMA_CONNECT = 15  # the client's RC QP (qpn, psn, gid, lid, mtu) -> the node's, and the tenant's regions
    RDMA_REGIONS = 16  # -> the tenant's regions as (id, addr, rkey, length), after it gained some
    PUT = 17  # data plane (TCP): PUT_BEGIN + WRITE_COMMIT of one block in one frame, bytes in the payload
    # data plane (TCP): many PUTs in one frame, the blocks' bytes one after another in the payload ->
    # (status, stored) per entry. Added after version 1 shipped, under the same version byte: a node
    # that predates it answers MALFORMED, which a client probes for once (`PoolClient`) and then
    # sends PUTs to that node instead.
    MULTI_PUT = 18
    # Shared-tier KV events (issue 32), added after version 1 shipped as MULTI_PUT was: a node that
    # predates them answers MALFORMED, which a client probes for once per node (`NodeLink.serves`).
    # SUBSCRIBE: from_seq (nil: live only) -> {next_seq, oldest_seq}, then the connection carries only
    # EVENTS frames (the reply type, the SUBSCRIBE's request id): {seq, dropped} + one msgpack
    # KVEventBatch in vLLM's wire shape, the session's tenant's events only (`kvtier.pool.node.events`).
    SUBSCRIBE = 19
    EVENTS = 20
    ANNOUNCE = 21  # the engine's hashes of blocks the tenant stored -> counts announced and ignored
    # Retention hints (issue 32), probed as ANNOUNCE is (`NodeLink.serves`). RETAIN: a soft lease of
    # ttl_s (capped by the node's max_retain_s, within the tenant's retain budget) on the tenant's
    # blocks under keys; RELEASE_HINT: their session closed, they become the tenant's next victims.
    RETAIN = 22
    RELEASE_HINT = 23
    ERROR = 0xFF


class ErrorCode(enum.IntEnum):
    MALFORMED = 1  # fatal: the connection closes after the reply
    TOO_LARGE = 2  # fatal
    VERSION = 3  # fatal
    AUTH = 4  # fatal
    BUSY = 5  # fatal: the node is at its connection limit
    FORBIDDEN = 6  # the region or block is not this tenant's, or is not writable
    BOUNDS = 7  # offset/length outside the region or the block
    STALE = 8  # the slot no longer holds that block (evicted, deleted, reused): a miss
    SHUTTING_DOWN = 9  # fatal
    INTERNAL = 10  # fatal
    LIMIT = 11  # the connection or tenant holds as many leases as it may: this request leased nothing


FATAL = frozenset({ErrorCode.MALFORMED, ErrorCode.TOO_LARGE, ErrorCode.VERSION, ErrorCode.AUTH,
                   ErrorCode.BUSY, ErrorCode.SHUTTING_DOWN, ErrorCode.INTERNAL})


class GrantStatus(enum.IntEnum):
    """The answer to one key of PUT_BEGIN or ALLOC."""

    GRANTED = 0
    EXISTS = 1  # already stored and ready: nothing to write
    BUSY = 2  # another writer holds the key
    FULL = 3  # no slot could be freed (everything is leased)
    QUOTA = 4  # the tenant's quota is reached and nothing of its own can be evicted
    TOO_LARGE = 5  # longer than a region
    LIMIT = 6  # the tenant or this connection holds as many leases as it may (a slot being written is leased)
    CHECKSUM = 7  # MULTI_PUT only: the bytes that came do not match the entry's key-seeded checksum; not stored


class ProtocolError(Exception):
    """A frame broke the protocol; `code` is what the peer is told."""

    def __init__(self, code: ErrorCode, message: str, request_id: int = 0) -> None:
        super().__init__(message)
        self.code, self.request_id = code, request_id


# ---- header schemas -----------------------------------------------------------------------
# A spec is a type name, ("list", spec) or ("tuple", (spec, ...)); a schema maps field -> spec.
U64 = (1 << 64) - 1
_KEYS = ("list", "key")
_UINTS = ("list", "uint")
_GRANT = ("tuple", ("uint", "uint", "uint", "uint", "uint"))  # status, region, offset, gen, lease
# found, region, offset, length, gen, checksum, lease (0 when inline), inline (bytes in the payload)
_QP_INFO = {"qpn": "uint", "psn": "uint", "gid": "text", "lid": "uint", "mtu": "uint"}
_REGIONS = ("list", ("tuple", ("uint", "uint", "uint", "uint")))  # region id, addr, rkey, length
_HIT = ("tuple", ("bool", "uint", "uint", "uint", "uint", "uint", "uint", "bool"))
_HASHES = ("list", "hash")  # vLLM's ExternalBlockHash: an int (u64) or bytes

REQUESTS: dict[MsgType, dict[str, Any]] = {
    MsgType.HELLO: {"tenant": "name", "nonce": "nonce"},
    MsgType.AUTH: {"mac": "mac"},
    MsgType.PUT_BEGIN: {"keys": _KEYS, "lengths": _UINTS, "lease_s": "num"},
    MsgType.PUT_COMMIT: {"keys": _KEYS, "gens": _UINTS, "checksums": _UINTS},
    MsgType.PUT_ABORT: {"keys": _KEYS, "gens": _UINTS},
    # release: leases done with; inline: send the hits' bytes in the reply (TCP), else lease them
    MsgType.GET: {"keys": _KEYS, "lease_s": "num", "release": _UINTS, "inline": "bool"},
    MsgType.RELEASE: {"leases": _UINTS},
    MsgType.CONTAINS: {"keys": _KEYS},
    MsgType.DELETE: {"keys": _KEYS},
    MsgType.ALLOC: {"keys": _KEYS, "lengths": _UINTS},
    MsgType.READ: {"region": "uint", "offset": "uint", "length": "uint", "gen": "uint"},
    MsgType.WRITE: {"region": "uint", "offset": "uint", "gen": "uint"},
    MsgType.WRITE_COMMIT: {"region": "uint", "offset": "uint", "gen": "uint", "checksum": "uint"},
    MsgType.PUT: {"key": "key", "lease_s": "num", "checksum": "uint"},
    MsgType.MULTI_PUT: {"keys": _KEYS, "lengths": _UINTS, "checksums": _UINTS, "lease_s": "num"},
    MsgType.STATS: {},
    MsgType.RDMA_CONNECT: _QP_INFO,
    MsgType.RDMA_REGIONS: {},
    MsgType.SUBSCRIBE: {"from_seq": "opt_uint"},
    # per key: its vLLM hash, the parent's (nil: none or unknown) and its tokens ([]: not told)
    MsgType.ANNOUNCE: {"keys": _KEYS, "hashes": _HASHES, "parents": ("list", "opt_hash"),
                       "tokens": ("list", _UINTS), "block_size": "uint"},
    MsgType.RETAIN: {"keys": _KEYS, "ttl_s": "num"},
    MsgType.RELEASE_HINT: {"keys": _KEYS},
}
REPLIES: dict[MsgType, dict[str, Any]] = {
    MsgType.HELLO: {"nonce": "nonce", "node": "name"},
    MsgType.AUTH: {"mac": "mac", "node": "name", "transport": "name", "max_payload": "uint", "lease_s": "num"},
    MsgType.PUT_BEGIN: {"grants": ("list", _GRANT)},
    MsgType.PUT_COMMIT: {"ok": ("list", "bool")},
    MsgType.PUT_ABORT: {},
    MsgType.GET: {"hits": ("list", _HIT)},
    MsgType.RELEASE: {},
    MsgType.CONTAINS: {"found": ("list", "bool")},
    MsgType.DELETE: {"deleted": "uint"},
    MsgType.ALLOC: {"grants": ("list", _GRANT)},
    MsgType.READ: {},
    MsgType.WRITE: {},
    MsgType.WRITE_COMMIT: {"committed": "bool"},
    MsgType.PUT: {"status": "uint", "stored": "bool"},  # status: a GrantStatus; stored: the bytes are in
    MsgType.MULTI_PUT: {"results": ("list", ("tuple", ("uint", "bool")))},  # PUT's (status, stored) per entry
    MsgType.STATS: {"stats": "map"},
    MsgType.RDMA_CONNECT: {**_QP_INFO, "regions": _REGIONS},
    MsgType.RDMA_REGIONS: {"regions": _REGIONS},
    MsgType.SUBSCRIBE: {"next_seq": "uint", "oldest_seq": "uint"},
    MsgType.EVENTS: {"seq": "uint", "dropped": "uint"},  # dropped: batches lost to this subscriber since its last frame
    MsgType.ANNOUNCE: {"announced": "uint", "ignored": "uint"},
    MsgType.RETAIN: {"retained": "uint", "over_budget": "uint", "missing": "uint"},
    MsgType.RELEASE_HINT: {"released": "uint"},
    MsgType.ERROR: {"code": "uint", "message": "text"},
}
# Fields that must be lists of equal length.
_PARALLEL = {MsgType.PUT_BEGIN: ("keys", "lengths"), MsgType.PUT_COMMIT: ("keys", "gens", "checksums"),
             MsgType.PUT_ABORT: ("keys", "gens"), MsgType.ALLOC: ("keys", "lengths"),
             MsgType.MULTI_PUT: ("keys", "lengths", "checksums"),
             MsgType.ANNOUNCE: ("keys", "hashes", "parents", "tokens")}


_SEQUENCES = (list, tuple)


def _checker(spec: Any) -> Callable[[Any], bool]:
    """A predicate for one field spec, built once per schema entry (headers are checked on every frame)."""
    if isinstance(spec, tuple):
        if spec[0] == "list":
            item = _checker(spec[1])
            return lambda v: type(v) in _SEQUENCES and len(v) <= MAX_BATCH and all(map(item, v))
        items = tuple(_checker(s) for s in spec[1])
        n = len(items)
        return lambda v: type(v) in _SEQUENCES and len(v) == n and all(map(operator.call, items, v))
    checks: dict[str, Callable[[Any], bool]] = {
        "uint": lambda v: type(v) is int and 0 <= v <= U64,
        "bool": lambda v: type(v) is bool,
        "num": lambda v: type(v) in (int, float) and 0 <= v < 1e9,
        "key": lambda v: type(v) is bytes and 1 <= len(v) <= MAX_KEY_BYTES,
        "nonce": lambda v: type(v) is bytes and 16 <= len(v) <= 64,
        "mac": lambda v: type(v) is bytes and len(v) == 32,
        "name": lambda v: type(v) is str and 1 <= len(v) <= MAX_NAME_BYTES and v.isprintable(),
        "text": lambda v: type(v) is str and len(v) <= 4096,
        "map": lambda v: isinstance(v, dict),
        "opt_uint": lambda v: v is None or (type(v) is int and 0 <= v <= U64),
        "hash": _is_hash,
        "opt_hash": lambda v: v is None or _is_hash(v),
    }
    if spec not in checks:
        raise AssertionError(f"unknown spec {spec!r}")  # a bug in the tables above, not bad input
    return checks[spec]


def _is_hash(v: Any) -> bool:
    return (type(v) is int and 0 <= v <= U64) or (type(v) is bytes and 1 <= len(v) <= MAX_KEY_BYTES)


@dataclass(frozen=True, slots=True)
class _Schema:
    fields: frozenset[str]
    checks: tuple[tuple[str, Callable[[Any], bool]], ...]
    parallel: tuple[str, ...]


def _compile(schema: Mapping[MsgType, dict[str, Any]], parallel: bool) -> dict[MsgType, _Schema]:
    return {msg: _Schema(frozenset(fields), tuple((name, _checker(spec)) for name, spec in fields.items()),
                         _PARALLEL.get(msg, ()) if parallel else ())
            for msg, fields in schema.items()}


_COMPILED_REQUESTS = _compile(REQUESTS, parallel=True)
_COMPILED_REPLIES = _compile(REPLIES, parallel=False)


def check_header(msg: MsgType, header: Any, schema: Mapping[MsgType, dict[str, Any]],
                 request_id: int = 0) -> dict[str, Any]:
    """Returns `header` if it is a map with exactly the fields `schema[msg]` names, well typed.

    `schema` is `REQUESTS` or `REPLIES` (or another table of the same form, compiled on each call).
    Raises:
        ProtocolError(MALFORMED): naming the first field at fault.
    """
    compiled = (_COMPILED_REQUESTS if schema is REQUESTS else _COMPILED_REPLIES if schema is REPLIES
                else _compile(schema, parallel=False))
    rules = compiled.get(msg)
    if rules is None:
        raise ProtocolError(ErrorCode.MALFORMED, f"frame type {int(msg)} is not valid here", request_id)
    if type(header) is not dict or header.keys() != rules.fields:
        got = sorted(map(str, header)) if isinstance(header, dict) else type(header).__name__
        raise ProtocolError(ErrorCode.MALFORMED, f"{msg.name}: expected fields {sorted(rules.fields)}, got {got}",
                            request_id)
    for name, valid in rules.checks:
        if not valid(header[name]):
            raise ProtocolError(ErrorCode.MALFORMED, f"{msg.name}.{name}: invalid value", request_id)
    if rules.parallel and len({len(header[f]) for f in rules.parallel}) > 1:
        raise ProtocolError(ErrorCode.MALFORMED, f"{msg.name}: lists of unequal length", request_id)
    return header


# ---- frames -------------------------------------------------------------------------------

class Prefix(NamedTuple):
    type: int
    request_id: int
    header_len: int
    payload_len: int


_packb = functools.partial(msgpack.packb, use_bin_type=True)
_MSG_TYPES = {int(m): m for m in MsgType}


def encode(msg: int, request_id: int, header: Mapping[str, Any] | bytes, payload_len: int = 0, *,
           pack: Callable[[dict], bytes] = _packb) -> bytes:
    """The prefix and header of a frame; the caller sends `payload_len` payload bytes after it.

    Args:
        header: the header's fields, or their msgpack already made (`encode_hits`).
        pack: msgpack's packing function; a connection passes its own `Packer(use_bin_type=True).pack`
            (packb builds a packer per call).
    """
    if isinstance(header, (bytes, bytearray)):
        body = header
    else:
        body = pack(header if type(header) is dict else dict(header))
    return PREFIX.pack(MAGIC, VERSION, msg, request_id, len(body), payload_len) + body


def encode_hits(hits: Iterable[tuple[bool, int, int, int, int, int, int, bool]], num_hits: int) -> bytes:
    """The msgpack of a GET reply's header, `{"hits": [...]}`, each row packed as `hits` yields it
    (the same bytes as packing the list).

    Why not a list for msgpack: a reply of 4,096 hits was 4,096 tuples and lease ids alive at once,
    per connection, and a lease flood's replies left the node's small-object allocator holding
    their memory afterwards (issue 29, finding 6). Here one row exists at a time.

    Raises:
        ValueError: `hits` yielded other than `num_hits` rows.
    """
    packer = msgpack.Packer(use_bin_type=True, autoreset=False)
    packer.pack_map_header(1)
    packer.pack("hits")
    packer.pack_array_header(num_hits)
    n = 0
    for row in hits:
        packer.pack(row)
        n += 1
    if n != num_hits:
        raise ValueError(f"{n} hits, {num_hits} announced")
    return packer.bytes()


def encode_error(request_id: int, code: ErrorCode, message: str) -> bytes:
    return encode(MsgType.ERROR, request_id, {"code": int(code), "message": message[:4096]})


def parse_prefix(data: bytes | bytearray | memoryview, max_payload: int,
                 max_header: int = MAX_HEADER_BYTES) -> Prefix:
    """Decodes and checks the 20-byte prefix (`max_header`: smaller before authentication).

    Raises:
        ProtocolError: bad magic (MALFORMED), other version (VERSION), header or payload above
            the limits (TOO_LARGE).
    """
    if len(data) != PREFIX_BYTES:
        raise ProtocolError(ErrorCode.MALFORMED, f"frame prefix of {len(data)} bytes, expected {PREFIX_BYTES}")
    magic, version, msg, request_id, header_len, payload_len = PREFIX.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(ErrorCode.MALFORMED, f"bad magic {magic!r}: not a kvtier pool frame")
    if version != VERSION:
        raise ProtocolError(ErrorCode.VERSION, f"protocol version {version}; this node speaks {VERSION}",
                            request_id)
    if header_len > max_header:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"header of {header_len} bytes exceeds {max_header}", request_id)
    if payload_len > max_payload:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"payload of {payload_len} bytes exceeds {max_payload}",
                            request_id)
    return Prefix(msg, request_id, header_len, payload_len)


_REQUEST_PAYLOADS = frozenset({MsgType.WRITE, MsgType.WRITE_COMMIT, MsgType.PUT, MsgType.MULTI_PUT})
_REPLY_PAYLOADS = frozenset({MsgType.READ, MsgType.GET, MsgType.EVENTS})


def parse_header(prefix: Prefix, body: bytes | bytearray | memoryview, *, reply: bool) -> tuple[MsgType, dict]:
    """Decodes the msgpack header of a frame whose prefix is `prefix` and checks it.

    Args:
        reply: True on the client (expects replies), False on the node (expects requests).
    Returns:
        The message type (for a reply: the request's type, or ERROR) and the checked header.
    Raises:
        ProtocolError(MALFORMED): unknown type, bad msgpack, wrong fields, or a payload where
            this type carries none.
    """
    rid = prefix.request_id
    raw_type = prefix.type
    if reply and raw_type != MsgType.ERROR:
        if not raw_type & REPLY:
            raise ProtocolError(ErrorCode.MALFORMED, f"frame type {raw_type} is not a reply", rid)
        raw_type &= ~REPLY
    msg = _MSG_TYPES.get(raw_type)
    if msg is None:
        raise ProtocolError(ErrorCode.MALFORMED, f"unknown frame type {prefix.type}", rid)
    if prefix.payload_len and msg not in (_REPLY_PAYLOADS if reply else _REQUEST_PAYLOADS):
        raise ProtocolError(ErrorCode.MALFORMED, f"{msg.name} frame carries a payload", rid)
    header = _unpack(body, rid)
    return msg, check_header(msg, header, REPLIES if reply else REQUESTS, rid)


def check_multi_put(header: dict[str, Any], payload_len: int, request_id: int = 0) -> None:
    """Checks that a MULTI_PUT's entry lengths account for its payload exactly (each entry's bytes
    follow the previous one's, so a disagreement leaves no entry's bytes where they are said to be).

    Raises:
        ProtocolError(MALFORMED): the lengths sum to other than `payload_len`.
    """
    total = sum(header["lengths"])
    if total != payload_len:
        raise ProtocolError(ErrorCode.MALFORMED, f"MULTI_PUT.lengths: entries of {total} bytes in all, "
                                                 f"payload of {payload_len}", request_id)


def check_announce(header: dict[str, Any], request_id: int = 0) -> None:
    """Checks an ANNOUNCE's block size and that each key's tokens are none or one block's.

    Raises:
        ProtocolError(MALFORMED): block_size outside [1, MAX_ANNOUNCE_TOKENS], or a key's tokens
            neither empty nor `block_size` long.
    """
    size = header["block_size"]
    if not 1 <= size <= MAX_ANNOUNCE_TOKENS:
        raise ProtocolError(ErrorCode.MALFORMED, f"ANNOUNCE.block_size: {size} outside [1, {MAX_ANNOUNCE_TOKENS}]",
                            request_id)
    if any(len(tokens) not in (0, size) for tokens in header["tokens"]):
        raise ProtocolError(ErrorCode.MALFORMED, f"ANNOUNCE.tokens: each must be empty or {size} long",
                            request_id)


def _unpack(body: bytes | bytearray | memoryview, request_id: int) -> Any:
    limit = len(body)
    try:
        return msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=True,
                               max_str_len=limit, max_bin_len=limit, max_array_len=limit,
                               max_map_len=limit, max_ext_len=0)
    except Exception as e:  # msgpack raises a zoo of types on bad input; all mean "malformed"
        raise ProtocolError(ErrorCode.MALFORMED, f"header is not valid msgpack: {type(e).__name__}",
                            request_id) from None


@dataclass(frozen=True, slots=True)
class Frame:
    type: MsgType
    request_id: int
    header: dict[str, Any]
    payload: bytes = b""


class FrameDecoder:
    """Incremental decoder of whole frames (payload included) from a byte stream.

    The node and the client read frames straight off their sockets with `parse_prefix` and
    `parse_header`; this composes the same two functions over a buffer, for tests and tools.
    After a `ProtocolError` the stream cannot be resynchronised: the decoder stays failed.
    """

    def __init__(self, *, reply: bool, max_payload: int) -> None:
        self._reply, self._max_payload = reply, max_payload
        self._buf = bytearray()
        self._failed: ProtocolError | None = None

    def feed(self, data: bytes) -> None:
        self._buf += data

    def next_frame(self) -> Frame | None:
        """The next complete frame, or None until more bytes arrive.

        Raises:
            ProtocolError: as `parse_prefix`/`parse_header`; again on every later call.
        """
        if self._failed is not None:
            raise self._failed
        if len(self._buf) < PREFIX_BYTES:
            return None
        try:
            prefix = parse_prefix(bytes(self._buf[:PREFIX_BYTES]), self._max_payload)
            end = PREFIX_BYTES + prefix.header_len
            if len(self._buf) < end + prefix.payload_len:
                return None
            msg, header = parse_header(prefix, bytes(self._buf[PREFIX_BYTES:end]), reply=self._reply)
        except ProtocolError as e:
            self._failed = e
            raise
        payload = bytes(self._buf[end: end + prefix.payload_len])
        del self._buf[: end + prefix.payload_len]
        return Frame(msg, prefix.request_id, header, payload)
