"""The client's side of the pool's shared-tier KV events (issue 32): ANNOUNCE and SUBSCRIBE.

`announce` tells a node the engine's block hashes of blocks this tenant stored there (the node
then publishes `BlockStored`/`BlockRemoved` for them); `EventStream` is one SUBSCRIBE: a connection
of its own that yields the tenant's event batches, each the msgpack of a vLLM `KVEventBatch`.
Both messages came after the protocol's version 1: a node that predates them is detected
(`NodeLink.serves`, or the SUBSCRIBE itself) and named in the error, never mistaken for a dead node.
"""

from __future__ import annotations

import logging
import select
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from kvtier.errors import TransferError
from kvtier.pool.client.connection import AuthFailed, NodeLink, NodeUnavailable, RemoteError
from kvtier.pool.protocol import FATAL, MAX_BATCH, ErrorCode, MsgType, ProtocolError

MAX_EVENTS_PAYLOAD = 64 << 20  # one batch at most (the node's are a few MiB at the very most)
ANNOUNCE_FRAME_BYTES = 512 << 10  # an ANNOUNCE header's estimated size at most (the node takes 1 MiB)
log = logging.getLogger(__name__)
_ANNOUNCE_PROBE = {"keys": [], "hashes": [], "parents": [], "tokens": [], "block_size": 1}


class NotServed(TransferError):
    """The node predates shared-tier events (it does not know ANNOUNCE or SUBSCRIBE)."""


@dataclass(frozen=True, slots=True)
class EventFrame:
    """One EVENTS frame: the tenant's batch number `seq`, the batches this subscriber lost just
    before it (`dropped`: the gap in `seq`), and the batch's msgpack (vLLM's `KVEventBatch`)."""

    seq: int
    dropped: int
    payload: bytes

    def batch(self) -> list[Any]:
        """The batch decoded with msgpack: `[ts, [event map, ...], data_parallel_rank (None)]`."""
        return msgpack.unpackb(self.payload, raw=False)


def announce_by_home(links: Sequence[NodeLink], home: Callable[[bytes], int], keys: Sequence[bytes],
                     hashes: Sequence[int | bytes], block_size: int, parents: Sequence[int | bytes | None],
                     tokens: Sequence[Sequence[int]]) -> dict[str, int]:
    """`PoolClient.announce`: each key's hash to its home node (`home(key)`, an index into `links`).

    Returns:
        {"announced", "ignored", "failed"}: blocks counted by the nodes, and keys whose node could
        not be reached or predates events (`NotServed`, logged).
    Raises:
        AuthFailed: a node refused the credentials.
    """
    out = {"announced": 0, "ignored": 0, "failed": 0}
    groups: dict[int, list[int]] = {}
    for j, key in enumerate(keys):
        groups.setdefault(home(key), []).append(j)
    for node, js in groups.items():
        try:
            got = announce(links[node], [keys[j] for j in js], [hashes[j] for j in js], [parents[j] for j in js],
                           [tokens[j] for j in js], block_size)
        except AuthFailed:
            raise
        except TransferError as e:  # NodeUnavailable, NotServed
            log.log(logging.WARNING if isinstance(e, NotServed) else logging.DEBUG, "%s", e)
            out["failed"] += len(js)
            continue
        out["announced"] += got["announced"]
        out["ignored"] += got["ignored"]
    return out


def announce(link: NodeLink, keys: Sequence[bytes], hashes: Sequence[int | bytes],
             parents: Sequence[int | bytes | None], tokens: Sequence[Sequence[int]], block_size: int) -> dict[str, int]:
    """ANNOUNCE frames for one node's keys (cut at MAX_BATCH keys and ANNOUNCE_FRAME_BYTES).

    Returns:
        {"announced": n, "ignored": n} summed over the frames.
    Raises:
        NotServed: the node predates ANNOUNCE.
        NodeUnavailable, AuthFailed: as `NodeLink.call`; frames sent before stay announced.
    """
    if not link.serves(MsgType.ANNOUNCE, _ANNOUNCE_PROBE):
        raise NotServed(f"pool node {link.name} does not serve ANNOUNCE (a node older than shared-tier events)")
    out = {"announced": 0, "ignored": 0}
    for lo, hi in _frames(keys, hashes, tokens):
        reply = link.call(MsgType.ANNOUNCE, {"keys": list(keys[lo:hi]), "hashes": list(hashes[lo:hi]),
                                             "parents": list(parents[lo:hi]),
                                             "tokens": [list(t) for t in tokens[lo:hi]], "block_size": block_size})
        for name in out:
            out[name] += reply[name]
    return out


def _frames(keys: Sequence[bytes], hashes: Sequence[int | bytes], tokens: Sequence[Sequence[int]]) -> Iterator[tuple[int, int]]:
    lo, size = 0, 0
    for i in range(len(keys)):
        cost = 48 + len(keys[i]) + 2 * (len(hashes[i]) if isinstance(hashes[i], bytes) else 9) + 5 * len(tokens[i])
        if i > lo and (i - lo >= MAX_BATCH or size + cost > ANNOUNCE_FRAME_BYTES):
            yield lo, i
            lo, size = i, 0
        size += cost
    if lo < len(keys):
        yield lo, len(keys)


class EventStream:
    """One subscription to a node's events of this tenant, on a connection of its own. Iterating
    yields `EventFrame`s until the node ends the stream; `next_frame(timeout_s)` waits a bounded
    time. Not thread-safe. Close it (or leave its `with`) to unsubscribe.

    Args:
        link: the node.
        from_seq: replay the node's kept batches from this seq first (None: live batches only).
    Raises:
        NotServed: the node predates SUBSCRIBE.
        RemoteError(LIMIT): the tenant has as many subscribers on the node as it may.
        NodeUnavailable, AuthFailed: as `NodeLink.dedicated`.
    """

    def __init__(self, link: NodeLink, from_seq: int | None = None) -> None:
        self._conn = link.dedicated()
        try:
            reply = self._conn.call(MsgType.SUBSCRIBE, {"from_seq": from_seq})
        except NodeUnavailable as e:
            if e.code is ErrorCode.MALFORMED:
                raise NotServed(f"pool node {link.name} does not serve SUBSCRIBE "
                                f"(a node older than shared-tier events)") from None
            raise
        except RemoteError:
            self._conn.close()
            raise
        self.next_seq, self.oldest_seq = reply["next_seq"], reply["oldest_seq"]
        self._rid = self._conn._next_id
        self._readable = select.poll()
        self._readable.register(self._conn.sock, select.POLLIN)

    def next_frame(self, timeout_s: float | None = None) -> EventFrame | None:
        """The next frame, waiting up to `timeout_s` (None: as long as it takes); None when none came.

        Raises:
            NodeUnavailable: the stream ended (the node closed it, stopped, or broke the protocol).
        """
        conn = self._conn
        if not conn.frames.buffered and not self._readable.poll(None if timeout_s is None else int(timeout_s * 1000)):
            return None
        deadline = time.monotonic() + conn.timeout_s  # a frame begun arrives whole within a call's time
        try:
            prefix, msg, header = conn.frames.read_head(MAX_EVENTS_PAYLOAD, reply=True, deadline=deadline)
            if msg is MsgType.ERROR:
                code = header["code"]
                raise ProtocolError(ErrorCode(code) if code in FATAL else ErrorCode.INTERNAL, header["message"])
            if msg is not MsgType.EVENTS or prefix.request_id != self._rid:
                raise ProtocolError(ErrorCode.MALFORMED, f"{msg.name} frame on an event stream")
            payload = bytearray(prefix.payload_len)
            conn.frames.recv_into(memoryview(payload), deadline)
        except (OSError, EOFError, ProtocolError) as e:
            self.close()
            raise NodeUnavailable(f"pool node {conn.name}: event stream ended: {e or type(e).__name__}") from None
        return EventFrame(header["seq"], header["dropped"], bytes(payload))

    def __iter__(self) -> Iterator[EventFrame]:
        while True:
            try:
                frame = self.next_frame()
            except NodeUnavailable:
                return
            if frame is not None:
                yield frame

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
