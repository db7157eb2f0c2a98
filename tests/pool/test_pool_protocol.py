"""The pool wire protocol without sockets: round trips, and a fuzzed parser that only ever returns a
frame, asks for more bytes, or raises `ProtocolError`. Then `wire.FrameSocket`, the reader and writer
the node and the client share, over a socketpair: frames in any chunking, headers larger than its
buffer, payloads hashed layer by layer as they land, peers that close, deadlines. Cost: about three seconds (hypothesis).
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import msgpack
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.pool.protocol import (
    MAGIC,
    MAX_BATCH,
    MAX_HEADER_BYTES,
    PREFIX,
    PREFIX_BYTES,
    REPLY,
    REQUESTS,
    VERSION,
    ErrorCode,
    FrameDecoder,
    MsgType,
    ProtocolError,
    encode,
    encode_error,
    parse_prefix,
)
from kvtier.pool.wire import RECV_BUFFER_BYTES, FrameSocket
from kvtier.tiers.base import LayerSums

MAX_PAYLOAD = 1 << 20

VALID_REQUESTS = [
    (MsgType.HELLO, {"tenant": "team-a", "nonce": b"n" * 32}, b""),
    (MsgType.AUTH, {"mac": b"m" * 32}, b""),
    (MsgType.PUT_BEGIN, {"keys": [b"k1", b"k2"], "lengths": [10, 20], "lease_s": 1.5}, b""),
    (MsgType.PUT_COMMIT, {"keys": [b"k1"], "gens": [7], "checksums": [2**64 - 1]}, b""),
    (MsgType.PUT_ABORT, {"keys": [b"k1"], "gens": [7]}, b""),
    (MsgType.GET, {"keys": [b"k" * 16], "lease_s": 0, "release": [1, 2], "inline": True}, b""),
    (MsgType.RELEASE, {"leases": [3]}, b""),
    (MsgType.CONTAINS, {"keys": []}, b""),
    (MsgType.DELETE, {"keys": [b"x"]}, b""),
    (MsgType.ALLOC, {"keys": [b"x"], "lengths": [4096]}, b""),
    (MsgType.READ, {"region": 1, "offset": 4096, "length": 100, "gen": 9}, b""),
    (MsgType.WRITE, {"region": 1, "offset": 0, "gen": 9}, b"payload bytes"),
    (MsgType.STATS, {}, b""),
]


def frame(msg: int, header: dict, payload: bytes = b"", request_id: int = 5) -> bytes:
    return encode(msg, request_id, header, len(payload)) + payload


def decode_all(data: bytes, reply: bool = False, chunk: int | None = None) -> list:
    dec = FrameDecoder(reply=reply, max_payload=MAX_PAYLOAD)
    frames = []
    step = chunk or len(data) or 1
    for start in range(0, max(len(data), 1), step):
        dec.feed(data[start: start + step])
        while (f := dec.next_frame()) is not None:
            frames.append(f)
    return frames


@pytest.mark.parametrize("msg,header,payload", VALID_REQUESTS, ids=[m.name for m, _, _ in VALID_REQUESTS])
def test_every_request_round_trips_in_any_chunking(msg, header, payload) -> None:
    data = frame(msg, header, payload) * 2
    for chunk in (None, 1, 7):
        frames = decode_all(data, chunk=chunk)
        assert [(f.type, f.request_id, f.header, f.payload) for f in frames] == [(msg, 5, header, payload)] * 2


def test_replies_and_errors_decode_on_the_client_side() -> None:
    data = frame(REPLY | MsgType.READ, {}, b"abc") + encode_error(9, ErrorCode.STALE, "gone")
    frames = decode_all(data, reply=True)
    assert frames[0].type is MsgType.READ and frames[0].payload == b"abc"
    assert frames[1].type is MsgType.ERROR and frames[1].header == {"code": ErrorCode.STALE, "message": "gone"}


@pytest.mark.parametrize("data,code", [
    (b"XX" + bytes(18), ErrorCode.MALFORMED),  # bad magic
    (PREFIX.pack(MAGIC, VERSION + 1, MsgType.STATS, 1, 1, 0) + b"\x80", ErrorCode.VERSION),
    (PREFIX.pack(MAGIC, VERSION, MsgType.STATS, 1, MAX_HEADER_BYTES + 1, 0), ErrorCode.TOO_LARGE),
    (PREFIX.pack(MAGIC, VERSION, MsgType.WRITE, 1, 1, MAX_PAYLOAD + 1), ErrorCode.TOO_LARGE),
    (PREFIX.pack(MAGIC, VERSION, 99, 1, 1, 0) + b"\x80", ErrorCode.MALFORMED),  # unknown type
    (PREFIX.pack(MAGIC, VERSION, MsgType.STATS, 1, 1, 0) + b"\xc1", ErrorCode.MALFORMED),  # bad msgpack
    (PREFIX.pack(MAGIC, VERSION, MsgType.STATS, 1, 2, 0) + b"\x80\x80", ErrorCode.MALFORMED),  # trailing bytes
    (frame(MsgType.STATS, {"extra": 1}), ErrorCode.MALFORMED),
    (frame(MsgType.GET, {"keys": [b""], "lease_s": 1, "release": [], "inline": False}), ErrorCode.MALFORMED),  # empty key
    (frame(MsgType.GET, {"keys": [b"k"] * (MAX_BATCH + 1), "lease_s": 1, "release": [], "inline": False}), ErrorCode.MALFORMED),
    (frame(MsgType.GET, {"keys": [b"k"], "lease_s": float("nan"), "release": [], "inline": False}), ErrorCode.MALFORMED),
    (frame(MsgType.READ, {"region": -1, "offset": 0, "length": 1, "gen": 1}), ErrorCode.MALFORMED),
    (frame(MsgType.READ, {"region": True, "offset": 0, "length": 1, "gen": 1}), ErrorCode.MALFORMED),
    (frame(MsgType.PUT_BEGIN, {"keys": [b"a", b"b"], "lengths": [1], "lease_s": 1}), ErrorCode.MALFORMED),
    (frame(MsgType.STATS, {}, b"payload"), ErrorCode.MALFORMED),  # only WRITE carries a payload
    (frame(REPLY | MsgType.STATS, {"stats": {}}), ErrorCode.MALFORMED),  # a reply sent to a node
    (PREFIX.pack(MAGIC, VERSION, MsgType.STATS, 1, 4, 0) + msgpack.packb([1, 2, 3]), ErrorCode.MALFORMED),
], ids=["magic", "version", "header-size", "payload-size", "type", "msgpack", "trailing", "field", "empty-key",
        "batch", "nan", "negative", "bool-as-int", "unequal-lists", "stray-payload", "reply-to-node", "not-a-map"])
def test_bad_frames_raise_protocol_error_with_the_right_code(data: bytes, code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_all(data)
    assert info.value.code is code


def test_truncated_frames_wait_for_more_bytes_and_a_failed_decoder_stays_failed() -> None:
    whole = frame(MsgType.WRITE, {"region": 0, "offset": 0, "gen": 1}, b"x" * 100)
    dec = FrameDecoder(reply=False, max_payload=MAX_PAYLOAD)
    for i in range(len(whole) - 1):
        dec.feed(whole[i: i + 1])
        assert dec.next_frame() is None
    bad = FrameDecoder(reply=False, max_payload=MAX_PAYLOAD)
    bad.feed(b"garbage!" * 4)
    for _ in range(2):
        with pytest.raises(ProtocolError):
            bad.next_frame()


def test_prefix_must_be_exactly_twenty_bytes() -> None:
    with pytest.raises(ProtocolError):
        parse_prefix(b"KT", MAX_PAYLOAD)
    assert PREFIX_BYTES == 20


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(data: bytes) -> None:
    for reply in (False, True):
        try:
            decode_all(data, reply=reply)
        except ProtocolError:
            pass


def _flip(data: bytes, positions: list[int], values: list[int]) -> bytes:
    buf = bytearray(data)
    for p, v in zip(positions, values):
        buf[p % len(buf)] = v
    return bytes(buf)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(VALID_REQUESTS), st.lists(st.integers(0, 10_000), max_size=4),
       st.lists(st.integers(0, 255), min_size=4, max_size=4), st.integers(0, 200))
def test_fuzz_mutated_and_truncated_valid_frames(req, positions, values, cut) -> None:
    """Valid frames with a few bytes changed and a random tail cut off: a frame with a checked
    header, a request for more bytes, or ProtocolError — never another exception."""
    msg, header, payload = req
    data = _flip(frame(msg, header, payload), positions, values)[: max(0, len(frame(msg, header, payload)) - cut)]
    try:
        for f in decode_all(data):
            assert set(f.header) == set(REQUESTS[f.type])
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70).filter(lambda i: -2**63 <= i < 2**64)
                    | st.floats() | st.binary(max_size=20) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12),
       st.sampled_from(list(MsgType)))
def test_fuzz_arbitrary_msgpack_headers(header, msg) -> None:
    body = msgpack.packb(header, use_bin_type=True)
    data = struct.pack("!2sBBQII", MAGIC, VERSION, msg, 1, len(body), 0) + body
    try:
        decode_all(data)
    except ProtocolError:
        pass


# ---- FrameSocket over a socketpair -------------------------------------------------------------

PIPELINE = [  # requests as a client pipelines them: small, with payloads, and one header beyond the buffer
    (MsgType.PUT, {"key": b"a", "lease_s": 1.0, "checksum": 5}, b"x" * 10),
    (MsgType.GET, {"keys": [bytes([i % 256]) * 16 for i in range(400)], "lease_s": 1, "release": [],
                   "inline": True}, b""),
    (MsgType.WRITE, {"region": 0, "offset": 0, "gen": 1}, bytes(range(256)) * 40),
    (MsgType.STATS, {}, b""),
    (MsgType.PUT, {"key": b"b", "lease_s": 1.0, "checksum": 6}, b"y" * (3 * RECV_BUFFER_BYTES + 7)),
]


def _feed(sock: socket.socket, data: bytes, chunks: list[int]) -> threading.Thread:
    """Writes `data` in pieces of the given sizes (cycled), from a thread, then closes."""
    def run() -> None:
        at, i = 0, 0
        while at < len(data):
            n = chunks[i % len(chunks)]
            sock.sendall(data[at: at + n])
            at, i = at + n, i + 1
        sock.close()

    t = threading.Thread(target=run)
    t.start()
    return t


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 3 * RECV_BUFFER_BYTES), min_size=1, max_size=6))
def test_frame_socket_reads_pipelined_frames_in_any_chunking(chunks: list[int]) -> None:
    data = b"".join(frame(msg, header, payload, request_id=i) for i, (msg, header, payload) in enumerate(PIPELINE))
    ours, theirs = socket.socketpair()
    writer = _feed(theirs, data, chunks)
    frames = FrameSocket(ours, timeout_s=30)  # a safety net, never a measurement
    try:
        for i, (msg, header, payload) in enumerate(PIPELINE):
            prefix, got, got_header = frames.read_head(MAX_PAYLOAD, reply=False)
            into = bytearray(prefix.payload_len)
            frames.recv_into(memoryview(into))
            assert (prefix.request_id, got, got_header, bytes(into)) == (i, msg, header, payload)
        with pytest.raises(EOFError):
            frames.read_head(MAX_PAYLOAD, reply=False)
        assert frames.buffered == 0
    finally:
        writer.join()
        ours.close()


@settings(max_examples=30, deadline=None)
@given(chunks=st.lists(st.integers(1, 3 * RECV_BUFFER_BYTES), min_size=1, max_size=4),
       layer_lengths=st.lists(st.integers(0, 40_000), min_size=1, max_size=5), seed=st.integers(0, 2**64 - 1),
       layer0=st.integers(0, 60))
def test_frame_socket_hashes_each_layer_of_a_payload_as_it_lands(chunks, layer_lengths, seed, layer0) -> None:
    """A payload received with `LayerSums` lands whole, each layer's checksum the xxh3-64 of its
    bytes seeded as the routes seed it, whatever the chunking and however much of the payload
    came in with the header (buffered); the frame after it reads on."""
    payload = np.random.default_rng(len(layer_lengths)).integers(0, 256, sum(layer_lengths) + 3, np.uint8).tobytes()
    data = frame(MsgType.WRITE, {"region": 0, "offset": 0, "gen": 1}, payload) + frame(MsgType.STATS, {})
    ours, theirs = socket.socketpair()
    writer = _feed(theirs, data, chunks)
    frames = FrameSocket(ours, timeout_s=30)
    rel = np.cumsum([0, *layer_lengths[:-1]]).astype(np.uint64)
    sums = LayerSums(rel, np.array(layer_lengths, np.uint64), seed, layer0, np.zeros(len(layer_lengths), np.uint64))
    try:
        prefix, _, _ = frames.read_head(MAX_PAYLOAD, reply=False)
        into = bytearray(prefix.payload_len)
        frames.recv_into(memoryview(into), time.monotonic() + 30, sums)
        assert bytes(into) == payload and sums.done
        assert sums.out.tolist() == [xxhash.xxh3_64_intdigest(payload[int(r): int(r) + n], seed=(seed + layer0 + l) % 2**64)
                                     for l, (r, n) in enumerate(zip(rel, layer_lengths))]
        assert frames.read_head(MAX_PAYLOAD, reply=False)[1] is MsgType.STATS
    finally:
        writer.join()
        ours.close()


def test_a_hashed_receive_fails_as_a_plain_one_and_leaves_its_sums_not_done() -> None:
    """The peer closing inside the payload is a ConnectionError and a silent peer a TimeoutError
    at the deadline: the layers are then not `done` (the route hashes nothing it did not get)."""
    ours, theirs = socket.socketpair()
    frames = FrameSocket(ours, timeout_s=30)
    sums = LayerSums(np.array([0, 50], np.uint64), np.array([50, 50], np.uint64), 1, 0, np.zeros(2, np.uint64))
    theirs.sendall(b"q" * 60)
    with pytest.raises(TimeoutError):
        frames.recv_into(memoryview(bytearray(100)), time.monotonic() + 0.05, sums)
    assert not sums.done
    theirs.sendall(b"q" * 10)
    theirs.close()
    with pytest.raises(ConnectionError, match="peer closed after 10 of 100 bytes"):
        frames.recv_into(memoryview(bytearray(100)), time.monotonic() + 30, sums)
    assert not sums.done
    ours.close()


def test_frame_socket_drains_a_refused_payload_and_reads_on() -> None:
    data = frame(MsgType.WRITE, {"region": 0, "offset": 0, "gen": 1}, b"z" * 100_000) + frame(MsgType.STATS, {})
    ours, theirs = socket.socketpair()
    writer = _feed(theirs, data, [4000])
    frames = FrameSocket(ours, timeout_s=30)
    try:
        prefix, _, _ = frames.read_head(MAX_PAYLOAD, reply=False)
        frames.drain(prefix.payload_len)
        assert frames.read_head(MAX_PAYLOAD, reply=False)[1] is MsgType.STATS
    finally:
        writer.join()
        ours.close()


@pytest.mark.parametrize("cut", [PREFIX_BYTES - 1, PREFIX_BYTES + 3, PREFIX_BYTES + 30])
def test_frame_socket_peer_closing_inside_a_frame_is_a_connection_error(cut: int) -> None:
    whole = frame(MsgType.PUT, {"key": b"k", "lease_s": 1.0, "checksum": 1}, b"p" * 50)
    ours, theirs = socket.socketpair()
    theirs.sendall(whole[:cut])
    theirs.close()
    frames = FrameSocket(ours, timeout_s=30)
    with pytest.raises(ConnectionError):
        prefix, _, _ = frames.read_head(MAX_PAYLOAD, reply=False)
        frames.recv_into(memoryview(bytearray(prefix.payload_len)))
    ours.close()


def test_frame_socket_gives_up_at_the_deadline_and_sends_many_buffers_whole() -> None:
    ours, theirs = socket.socketpair()
    frames = FrameSocket(ours, timeout_s=30)
    with pytest.raises(TimeoutError):  # nothing comes: the kernel timeout armed for the deadline fires
        frames.read_head(MAX_PAYLOAD, reply=True, deadline=time.monotonic() + 0.05)
    with pytest.raises(TimeoutError):  # a deadline already past fails before any system call
        frames.read_head(MAX_PAYLOAD, reply=True, deadline=time.monotonic() - 1)
    pieces = [memoryview(bytes([i % 256]) * 3) for i in range(1500)]  # more buffers than one sendmsg takes
    reader = FrameSocket(theirs, timeout_s=30)
    got = bytearray(3 * len(pieces))
    recv = threading.Thread(target=lambda: (reader.read_head(1 << 20, reply=True), reader.recv_into(memoryview(got))))
    recv.start()
    frames.send(REPLY | MsgType.READ, 1, {}, pieces, deadline=time.monotonic() + 30)
    recv.join()
    assert bytes(got) == b"".join(bytes(p) for p in pieces)
    ours.close()
    theirs.close()
