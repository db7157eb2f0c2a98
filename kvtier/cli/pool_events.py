"""`kvtier pool events`: a bridge from one pool node's KV events of a tenant to a ZMQ PUB socket.

A router (llm-d, Dynamo) subscribes to vLLM's KV events on ZMQ; the pool node serves its tenants'
events on its authenticated data port instead (SUBSCRIBE), so that no second authentication system
is needed and a tenant can only ever get its own. This bridge authenticates as the tenant and
republishes each batch in vLLM's framing: multipart `(topic, seq as 8 bytes big-endian, payload)`,
the payload being the node's msgpack `KVEventBatch`, the seq the node's per-tenant batch number (a
gap is a batch the node dropped for this subscriber). With `--replay`, a ROUTER socket answers
vLLM's replay requests (a start seq, 8 bytes big-endian) from the last `--buffer-steps` batches,
ending with seq -1 and an empty payload, as vLLM's `ZmqEventPublisher._service_replay` does. Run it beside the router,
inside the tenant's trust domain: ZMQ here has no authentication.

Prints `{"event": "ready", "publish": ENDPOINT, ...}` once the subscription stands (with port `*`,
the endpoint bound), and `{"event": "stopped", ...}` on SIGTERM/SIGINT or when the node ends the
stream (exit status 2 then). pyzmq is imported here only: it comes with vLLM, or `pip install 'kvtier[events]'`.
"""

from __future__ import annotations

import argparse
import collections
import json
import signal
import sys
import threading
from typing import Any

from kvtier.errors import ConfigError

_END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's ZmqEventPublisher.END_SEQ


def add_events_parser(sub: Any) -> None:
    p = sub.add_parser("events", help="republish a tenant's KV events from a node on a ZMQ PUB socket",
                       description="Subscribe to one node's shared-tier KV events as a tenant and republish "
                                   "them in vLLM's ZMQ framing (topic, 8-byte seq, msgpack KVEventBatch).")
    p.add_argument("--address", required=True, metavar="HOST:PORT", help="the pool node")
    p.add_argument("--tenant", default="default", help="tenant to authenticate as (default: default)")
    p.add_argument("--secret-file", metavar="FILE", help="file holding the tenant's secret")
    p.add_argument("--publish", required=True, metavar="ENDPOINT",
                   help="ZMQ endpoint to bind the PUB socket to, e.g. tcp://127.0.0.1:5557 (port * : any)")
    p.add_argument("--replay", metavar="ENDPOINT", help="ZMQ endpoint to bind a replay ROUTER socket to")
    p.add_argument("--topic", default="", help="topic of every message (vLLM's default: empty)")
    p.add_argument("--from-seq", type=int, metavar="SEQ", help="start with the node's kept batches from SEQ")
    p.add_argument("--buffer-steps", type=int, default=10000, help="batches kept for --replay (default 10000)")
    p.add_argument("--hwm", type=int, default=100000, help="the PUB socket's send high-water mark")
    p.add_argument("--timeout-s", type=float, default=5.0, help="for calls to the node")
    p.set_defaults(func=run_events)


def _zmq():
    try:
        import zmq
    except ImportError:
        raise ConfigError("kvtier pool events: needs pyzmq (installed with vLLM); pip install 'kvtier[events]'") from None
    return zmq


def run_events(args: argparse.Namespace) -> int:
    from kvtier.pool.client.api import PoolClient
    from kvtier.pool.client.connection import NodeUnavailable
    from kvtier.pool.tenants import read_secret_file

    zmq = _zmq()
    if args.buffer_steps < 1 or args.hwm < 0:
        raise ConfigError("kvtier pool events: --buffer-steps must be >= 1 and --hwm >= 0")
    secret = read_secret_file(args.secret_file, "--secret-file") if args.secret_file is not None else b""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ctx = zmq.Context()
    pub, router = _bind(zmq, ctx, args)
    counts = {"batches": 0, "dropped": 0}
    ended = False
    try:
        with PoolClient([args.address], tenant=args.tenant, secret=secret, timeout_s=args.timeout_s,
                        reconnect_s=0.0) as client, client.subscribe(from_seq=args.from_seq) as stream:
            _emit({"event": "ready", "publish": pub.getsockopt(zmq.LAST_ENDPOINT).decode(),
                   "replay": router.getsockopt(zmq.LAST_ENDPOINT).decode() if router is not None else None,
                   "next_seq": stream.next_seq})
            ended = _pump(zmq, stream, pub, router, args, stop, counts)
    except NodeUnavailable as e:
        print(f"kvtier pool events: {e}", file=sys.stderr)
        ended = True
    finally:
        for sock in (pub, router):
            if sock is not None:
                sock.close(linger=0)
        ctx.term()
    _emit({"event": "stopped", **counts})
    return 2 if ended else 0


def _bind(zmq, ctx, args: argparse.Namespace):
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, args.hwm)
    router = ctx.socket(zmq.ROUTER) if args.replay else None
    try:
        pub.bind(args.publish)
        if router is not None:
            router.bind(args.replay)
    except zmq.ZMQError as e:
        pub.close(linger=0)
        if router is not None:
            router.close(linger=0)
        ctx.term()
        raise ConfigError(f"kvtier pool events: cannot bind {args.publish}"
                          f"{' / ' + args.replay if args.replay else ''}: {e}") from None
    return pub, router


def _pump(zmq, stream, pub, router, args: argparse.Namespace, stop: threading.Event, counts: dict) -> bool:
    """Republishes frames until `stop` (False) or the node ends the stream (True)."""
    from kvtier.pool.client.connection import NodeUnavailable

    topic = args.topic.encode()
    kept: collections.deque[tuple[bytes, bytes]] = collections.deque(maxlen=args.buffer_steps)
    poller = zmq.Poller()
    poller.register(stream._conn.sock, zmq.POLLIN)
    if router is not None:
        poller.register(router, zmq.POLLIN)
    while not stop.is_set():
        ready = dict(poller.poll(200))
        if router is not None and router in ready:
            _replay(router, kept, topic)
        try:
            while (frame := stream.next_frame(0)) is not None:  # every frame here, some already buffered
                seq = frame.seq.to_bytes(8, "big")
                pub.send_multipart((topic, seq, frame.payload))
                kept.append((seq, frame.payload))
                counts["batches"] += 1
                counts["dropped"] += frame.dropped
        except NodeUnavailable as e:
            print(f"kvtier pool events: {e}", file=sys.stderr)
            return True
    return False


def _replay(router, kept, topic: bytes) -> None:
    """vLLM's replay protocol: (client, "", start seq) -> (client, "", topic, seq, payload) per kept
    batch from that seq, then (client, "", "", seq -1, ""); a request of another shape is ignored."""
    request = router.recv_multipart()
    if len(request) != 3:
        return
    client, _, start = request
    first = int.from_bytes(start, "big")
    for seq, payload in list(kept):
        if int.from_bytes(seq, "big") >= first:
            router.send_multipart((client, b"", topic, seq, payload))
    router.send_multipart((client, b"", b"", _END_SEQ, b""))


def _emit(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)
