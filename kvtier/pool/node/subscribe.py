"""SUBSCRIBE on the node: an authenticated connection becomes a stream of its tenant's EVENTS frames.

The stream runs on the connection's own thread (as every request does) and reads from the
connection's `Subscriber` queue (`events`), so a subscriber that stops reading blocks only its own
thread, in a send bounded by the node's idle timeout, while its queue drops batches. Its socket's
kernel send buffer is made small (`EventLimits.sndbuf_bytes`): what the peer has not read costs
the node at most that plus the queue. A subscribed connection takes no further requests: a frame
it sends is MALFORMED and closes it; closing is how a client unsubscribes.
"""

from __future__ import annotations

import select
import socket
import threading

from kvtier.pool import wire
from kvtier.pool.node.blocks import AccessError
from kvtier.pool.node.events import EventHub
from kvtier.pool.protocol import REPLY, ErrorCode, MsgType, ProtocolError


def serve_subscription(hub: EventHub, frames: wire.FrameSocket, tenant: str, rid: int, header: dict,
                       stopping: threading.Event) -> None:
    """Serves one SUBSCRIBE (its header checked): the reply, then EVENTS frames until the node stops.

    Returns at once, the connection still serving requests, when the tenant has as many
    subscribers as it may (a LIMIT error reply); returns when the node stops.
    Raises:
        EOFError: the peer closed (the usual end of a subscription).
        ProtocolError(MALFORMED): the peer sent something after SUBSCRIBE.
        OSError: a send failed or timed out (a peer that stopped reading for the idle timeout).
    """
    try:
        sub, next_seq, oldest = hub.subscribe(tenant, header["from_seq"])
    except AccessError as e:
        frames.send(MsgType.ERROR, rid, {"code": int(e.code), "message": str(e)})
        return
    try:
        frames.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, hub.limits.sndbuf_bytes)
        frames.send(REPLY | MsgType.SUBSCRIBE, rid, {"next_seq": next_seq, "oldest_seq": oldest})
        readable = select.poll()
        readable.register(frames.sock, select.POLLIN)
        while not stopping.is_set():
            batch = sub.take(hub.limits.poll_s)
            if batch is not None:
                seq, payload, dropped = batch
                frames.send(REPLY | MsgType.EVENTS, rid, {"seq": seq, "dropped": dropped}, [memoryview(payload)])
            _check_peer(frames, readable)
    finally:
        sub.close()


def _check_peer(frames: wire.FrameSocket, readable: select.poll) -> None:
    """Raises EOFError when the subscribed peer closed, MALFORMED when it sent anything."""
    if frames.buffered:
        raise ProtocolError(ErrorCode.MALFORMED, "a subscribed connection takes no further requests")
    if not readable.poll(0):
        return
    try:
        data = frames.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return
    except OSError:
        raise EOFError("peer reset") from None
    if not data:
        raise EOFError("peer closed")
    raise ProtocolError(ErrorCode.MALFORMED, "a subscribed connection takes no further requests")
