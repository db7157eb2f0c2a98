"""A pool node's shared-tier KV events per tenant (issue 32), against a real `kvtier pool serve` on
127.0.0.1: a tenant's subscriber sees its announced blocks stored and removed, in vLLM's wire shape
(decoded and re-encoded byte for byte by vLLM's own msgspec classes); another tenant's sees none;
unannounced blocks publish nothing; SUBSCRIBE needs AUTH; a subscriber that never reads has batches
dropped and counted while puts complete; replay from a seq; the subscriber limit; malformed frames
refused while the node serves on; the ZMQ bridge. Nothing sleeps: waits are on real calls or reads.
Cost: about 8 s on 2 cores (one node, vLLM's event classes imported once, a bridge subprocess).
"""

from __future__ import annotations

import json
import selectors
import subprocess
import sys

import msgpack
import pytest

from kvtier.pool.client.api import PoolClient
from kvtier.pool.client.connection import RemoteError
from kvtier.pool.client.events import EventFrame, EventStream, NotServed
from kvtier.pool.node.config import NodeConfig
from kvtier.pool.node.server import PoolNode
from kvtier.pool.tenants import open_tenants
from kvtier.pool.node.events import EventHub, EventLimits
from kvtier.pool.node.process import running_node
from kvtier.pool.protocol import REPLY, REQUESTS, ErrorCode, FrameDecoder, MsgType, check_header, encode
from support.pool import Raw, wait_until

KEYS = {name: f"{name}-secret-0123456789".encode() for name in ("ta", "tb", "tc", "td", "te", "tf")}
BLOCK_BYTES = 4096
RING_BATCHES, QUEUE_BATCHES, MAX_SUBSCRIBERS = 8, 4, 3
WAIT_S = 30.0  # a safety net for a loaded machine, never a measurement


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    path = tmp_path_factory.mktemp("events") / "tenants.yaml"
    path.write_text("tenants:\n" + "".join(f"  - {{name: {n}, secret: {s.decode()}, quota: 4MiB}}\n"
                                           for n, s in KEYS.items()))
    extra = ["--event-ring-batches", str(RING_BATCHES), "--event-queue-batches", str(QUEUE_BATCHES),
             "--max-subscribers-per-tenant", str(MAX_SUBSCRIBERS)]
    with running_node(capacity="32MiB", region_size="256KiB", tenants=path, credentials=("ta", KEYS["ta"]),
                      extra=extra) as n:
        yield n


def client(node, tenant: str) -> PoolClient:
    return PoolClient([node.address], tenant=tenant, secret=KEYS[tenant], timeout_s=WAIT_S, reconnect_s=0)


def data(key: bytes) -> bytes:
    return (key * (BLOCK_BYTES // len(key) + 1))[:BLOCK_BYTES]


def put(c: PoolClient, keys: list[bytes]) -> None:
    assert c.batch_put(keys, [data(k) for k in keys]) == [True] * len(keys)


def events_of(frame: EventFrame) -> list[dict]:
    ts, events, dp_rank = frame.batch()
    assert isinstance(ts, float) and dp_rank is None
    return events


def next_events(stream: EventStream) -> tuple[EventFrame, list[dict]]:
    frame = stream.next_frame(WAIT_S)
    assert frame is not None, "no event frame came"
    return frame, events_of(frame)


def tenant_stats(c: PoolClient) -> dict:
    return c.stats()[0]


# ---- the hub and the frames, without sockets -----------------------------------------------------

def announce_header(hashes: list, block_size: int = 4) -> dict:
    n = len(hashes)
    return {"keys": [b"k%d" % i for i in range(n)], "hashes": hashes, "parents": [None] * n,
            "tokens": [[]] * n, "block_size": block_size}


def test_a_full_queue_drops_its_oldest_batches_and_the_next_batch_carries_the_count():
    hub = EventHub(EventLimits(queue_batches=2), {"a": 1 << 20, "b": 1 << 20}, clock=lambda: 1.0)
    sub, next_seq, oldest = hub.subscribe("a", None)
    other, _, _ = hub.subscribe("b", None)
    for block_id in range(5):  # five batches: one block announced and flushed each
        assert hub.announce("a", [block_id], announce_header([100 + block_id])) == {"announced": 1, "ignored": 0}
        hub.flush()
    assert (next_seq, oldest) == (0, 0)
    got = [sub.take(0) for _ in range(2)]
    assert [(seq, dropped) for seq, _, dropped in got] == [(3, 3), (4, 0)], "seqs 0-2 dropped, said once"
    assert sub.take(0) is None and other.take(0) is None, "b's subscriber got none of a's batches"
    assert hub.stats("a")["events_dropped"] == 3 and hub.stats("b")["events_published"] == 0
    hub.on_remove(2)
    hub.on_remove(2)  # a block leaves once; an id not announced publishes nothing
    hub.on_remove(99)
    hub.flush()
    seq, payload, dropped = sub.take(0)
    assert (seq, dropped) == (5, 0)
    assert msgpack.unpackb(payload)[1] == [{"type": "BlockRemoved", "block_hashes": [102], "medium": "SHARED",
                                            "locality": "REMOTE", "ownership": "kvtier-pool"}]


def test_announcements_past_the_tenants_metadata_budget_or_of_missing_blocks_are_ignored_and_counted():
    hub = EventHub(EventLimits(meta_fraction=1 / 1024), {"a": 1 << 20})  # a budget of 1 KiB
    got = hub.announce("a", [-1, 7, 8, 7], announce_header([1, 2, 3, 4], block_size=64) | {
        "tokens": [[0] * 64] * 4})
    assert got == {"announced": 1, "ignored": 3}, "a miss, one past the budget, one announced already"
    stats = hub.stats("a")
    assert stats["blocks_announced"] == 1 and stats["announce_ignored"] == 3 and 0 < stats["announced_bytes"] <= 1024
    hub.on_remove(7)
    assert hub.stats("a")["announced_bytes"] == 0, "a removed block's metadata is given back"


def test_the_new_frames_are_checked_like_every_other():
    check_header(MsgType.SUBSCRIBE, {"from_seq": None}, REQUESTS)
    check_header(MsgType.ANNOUNCE, announce_header([1 << 63, b"h" * 32]), REQUESTS)
    decoder = FrameDecoder(reply=True, max_payload=1 << 20)
    decoder.feed(encode(REPLY | MsgType.EVENTS, 3, {"seq": 9, "dropped": 2}, 5) + b"batch")
    frame = decoder.next_frame()
    assert (frame.type, frame.header, frame.payload) == (MsgType.EVENTS, {"seq": 9, "dropped": 2}, b"batch")


# ---- what a tenant's subscriber sees -------------------------------------------------------------

def test_a_tenant_sees_its_announced_blocks_stored_and_removed_in_vllms_wire_shape(node):
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    msgspec = pytest.importorskip("msgspec")
    decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    keys = [b"ta-block-%d" % i for i in range(3)]
    hashes = [(1 << 64) - 3, 12345, b"\x07" * 32]  # vLLM's ExternalBlockHash: an int (u64) or bytes
    with client(node, "ta") as c, c.subscribe() as stream:
        put(c, keys)
        got = c.announce(keys + [b"ta-never-stored"], hashes + [9], block_size=4,
                         parents=[None, hashes[0], hashes[1], None], tokens=[[1, 2, 3, 4], [5, 6, 7, 8], [], []])
        assert got == {"announced": 3, "ignored": 1, "failed": 0}
        frame, events = next_events(stream)
        assert frame.seq == stream.next_seq and frame.dropped == 0
        assert [(e["type"], e["block_hashes"], e["parent_block_hash"], e["token_ids"], e["block_size"])
                for e in events] == [("BlockStored", [hashes[0]], None, [1, 2, 3, 4], 4),
                                     ("BlockStored", [hashes[1]], hashes[0], [5, 6, 7, 8], 4),
                                     ("BlockStored", [hashes[2]], hashes[1], [], 4)]
        batch = decoder.decode(frame.payload)  # vLLM's own decoder takes the node's bytes...
        assert [type(e).__name__ for e in batch.events] == ["BlockStored"] * 3
        assert {(e.medium, e.locality, e.ownership) for e in batch.events} == {("SHARED", "REMOTE", "kvtier-pool")}
        assert msgspec.msgpack.encode(batch) == frame.payload  # ...and would have sent the same bytes

        assert c.delete([keys[1]]) == 1
        frame, events = next_events(stream)
        assert events == [{"type": "BlockRemoved", "block_hashes": [hashes[1]], "medium": "SHARED",
                           "locality": "REMOTE", "ownership": "kvtier-pool"}]
        assert msgspec.msgpack.encode(decoder.decode(frame.payload)) == frame.payload
        assert c.announce([keys[0]], [77], block_size=4) == {"announced": 0, "ignored": 1, "failed": 0}, \
            "a block announced already keeps its first name"


def test_eviction_removes_announced_blocks_and_unannounced_blocks_publish_nothing(node):
    """tf's quota is 4 MiB of 4 KiB slots: 1,024 blocks. Its first block is announced; 1,100 more
    (never announced) push it out by recency. The stream shows exactly its Stored, then its Removed."""
    with client(node, "tf") as c, c.subscribe() as stream:
        put(c, [b"tf-first"])
        assert c.announce([b"tf-first"], [41], block_size=16)["announced"] == 1
        frame, events = next_events(stream)
        assert [(e["type"], e["block_hashes"]) for e in events] == [("BlockStored", [41])]
        for start in range(0, 1100, 100):
            put(c, [b"tf-filler-%d" % i for i in range(start, start + 100)])
        frame, events = next_events(stream)
        assert [(e["type"], e["block_hashes"]) for e in events] == [("BlockRemoved", [41])]
        stats = tenant_stats(c)
        assert stats["evictions"] >= 1 and stats["events_published"] == 2 and stats["announced_bytes"] == 0
        assert stream.next_frame(0) is None, "no event for the unannounced blocks stored or evicted"


def test_another_tenants_subscriber_sees_none_of_its_events(node):
    with client(node, "ta") as a, client(node, "tb") as b, a.subscribe() as sa, b.subscribe() as sb:
        put(a, [b"shared-name"])
        assert a.announce([b"shared-name"], [1001], block_size=4)["announced"] == 1
        assert [e["block_hashes"] for e in next_events(sa)[1]] == [[1001]]  # published: A's stream has it
        assert b.announce([b"shared-name"], [2002], block_size=4) == {"announced": 0, "ignored": 1, "failed": 0}, \
            "B cannot announce A's block under the same key"
        assert a.delete([b"shared-name"]) == 1
        assert [e["type"] for e in next_events(sa)[1]] == ["BlockRemoved"]
        put(b, [b"shared-name"])
        assert b.announce([b"shared-name"], [2002], block_size=4)["announced"] == 1
        frame, events = next_events(sb)
        assert frame.seq == 0 and frame.dropped == 0, "B's numbering is its own"
        assert [(e["type"], e["block_hashes"]) for e in events] == [("BlockStored", [2002])], \
            "B's first frame is its own block: none of A's events came before it"
        assert tenant_stats(b)["events_published"] == 1


# ---- bounds ------------------------------------------------------------------------------------

def _subscribe_raw(node, tenant: str, from_seq: int | None = None, **kw) -> tuple[Raw, dict]:
    raw = Raw(node.address, tenant, KEYS[tenant], **kw)
    return raw, raw.call(MsgType.SUBSCRIBE, {"from_seq": from_seq})


def _read_frame(raw: Raw) -> tuple[int, int]:
    msg, header, n = raw.recv()
    assert msg is MsgType.EVENTS, header
    raw.frames.drain(n)
    return header["seq"], header["dropped"]


def test_a_subscriber_that_never_reads_has_batches_dropped_and_counted_while_puts_complete(node):
    """td's subscriber (a small receive buffer) reads nothing while another connection stores,
    announces (large token lists: big batches) and deletes, round after round, until td's STATS
    count a dropped batch: every put meanwhile completed. Then the subscriber reads: a frame says
    how many batches it lost, exactly the gap in seq before it."""
    raw, reply = _subscribe_raw(node, "td", rcvbuf=4096)
    rounds = 0
    with client(node, "td") as c:
        while tenant_stats(c)["events_dropped"] == 0:
            rounds += 1
            assert rounds <= 400, "no batch was ever dropped for a subscriber that reads nothing"
            keys = [b"td-%d-%d" % (rounds, i) for i in range(8)]
            put(c, keys)
            tokens = [[(1 << 31) + rounds * 8 + i] * 1024 for i in range(8)]
            assert c.announce(keys, [rounds * 8 + i for i in range(8)], block_size=1024, tokens=tokens)["announced"] == 8
            assert c.delete(keys) == 8
        dropped_by_node = tenant_stats(c)["events_dropped"]
        published = tenant_stats(c)["events_published"]
    seqs, lost = [], 0
    while lost == 0:  # what the kernel buffers held, then the queue's oldest left: its first frame says so
        seq, dropped = _read_frame(raw)
        assert seq == (seqs[-1] + 1 + dropped if seqs else reply["next_seq"] + dropped)
        seqs.append(seq)
        lost += dropped
    assert 0 < lost <= dropped_by_node and seqs[-1] < published
    raw.close()


def test_replay_from_a_seq_comes_from_the_tenants_ring_and_older_batches_count_as_dropped(node):
    with client(node, "te") as c:
        for i in range(RING_BATCHES + 2):  # one batch each: the next round waits until it is published
            put(c, [b"te-%d" % i])
            assert c.announce([b"te-%d" % i], [500 + i], block_size=4)["announced"] == 1
            wait_until(lambda: tenant_stats(c)["events_published"] == i + 1, f"batch {i} published")
        with c.subscribe(from_seq=5) as stream:
            assert (stream.next_seq, stream.oldest_seq) == (RING_BATCHES + 2, 2)
            frames = [stream.next_frame(WAIT_S) for _ in range(5)]
            assert [(f.seq, f.dropped) for f in frames] == [(s, 0) for s in range(5, 10)]
            assert [events_of(f)[0]["block_hashes"] for f in frames] == [[500 + s] for s in range(5, 10)]
        with c.subscribe(from_seq=0) as stream:
            first = stream.next_frame(WAIT_S)
            assert (first.seq, first.dropped) == (2, 2), "seqs 0 and 1 left the ring: reported as dropped"
        with c.subscribe() as stream:  # live only
            put(c, [b"te-live"])
            c.announce([b"te-live"], [999], block_size=4)
            frame, events = next_events(stream)
            assert (frame.seq, events[0]["block_hashes"]) == (RING_BATCHES + 2, [999])


def test_a_tenant_past_its_subscriber_limit_is_refused_and_the_connection_serves_on(node):
    with client(node, "tc") as c:
        streams = [c.subscribe() for _ in range(MAX_SUBSCRIBERS)]
        raw = Raw(node.address, "tc", KEYS["tc"])
        raw.send(MsgType.SUBSCRIBE, {"from_seq": None})
        msg, header, _ = raw.recv()
        assert msg is MsgType.ERROR and header["code"] == ErrorCode.LIMIT, header
        assert "max_subscribers_per_tenant" in header["message"]
        assert "tenant" in raw.call(MsgType.STATS, {})["stats"], "a refused SUBSCRIBE leaves the connection usable"
        with pytest.raises(RemoteError, match="LIMIT"):
            c.subscribe()
        with client(node, "tb") as other, other.subscribe():
            pass  # another tenant's subscribers are not counted against tc
        streams.pop().close()
        wait_until(lambda: tenant_stats(c)["event_subscribers"] == MAX_SUBSCRIBERS - 1, "the closed one gone")
        streams.append(c.subscribe())
        for s in streams:
            s.close()
        raw.close()


# ---- refusals ----------------------------------------------------------------------------------

def test_subscribe_before_auth_is_refused(node):
    raw = Raw(node.address, auth=False)
    raw.send(MsgType.SUBSCRIBE, {"from_seq": None})
    msg, header, _ = raw.recv()
    assert msg is MsgType.ERROR and header["code"] == ErrorCode.AUTH, header
    assert raw.closed_by_peer()
    raw.close()


MALFORMED = [
    (MsgType.SUBSCRIBE, {"from_seq": "0"}),
    (MsgType.SUBSCRIBE, {"from_seq": -1}),
    (MsgType.SUBSCRIBE, {}),
    (MsgType.EVENTS, {"seq": 0, "dropped": 0}),  # a reply's type sent as a request
    (MsgType.ANNOUNCE, {"keys": [b"k"], "hashes": [], "parents": [], "tokens": [], "block_size": 4}),
    (MsgType.ANNOUNCE, {"keys": [b"k"], "hashes": [1], "parents": [None], "tokens": [[1, 2]], "block_size": 4}),
    (MsgType.ANNOUNCE, {"keys": [b"k"], "hashes": [1], "parents": [None], "tokens": [[]], "block_size": 0}),
    (MsgType.ANNOUNCE, {"keys": [b"k"], "hashes": [1], "parents": [None], "tokens": [[]], "block_size": 1 << 20}),
    (MsgType.ANNOUNCE, {"keys": [b"k"], "hashes": [-5], "parents": [None], "tokens": [[]], "block_size": 4}),
    (MsgType.ANNOUNCE, {"keys": [b"k"], "hashes": [b""], "parents": [None], "tokens": [[]], "block_size": 4}),
    (MsgType.ANNOUNCE, {"keys": [b"k"], "hashes": [1], "parents": ["x"], "tokens": [[]], "block_size": 4}),
    (MsgType.SUBSCRIBE, {"from_seq": None}, b"a payload SUBSCRIBE does not carry"),
]


@pytest.mark.parametrize("case", MALFORMED, ids=[f"{c[0].name}-{i}" for i, c in enumerate(MALFORMED)])
def test_malformed_subscribe_and_announce_frames_are_refused_and_the_node_serves_on(node, case):
    raw = Raw(node.address, "ta", KEYS["ta"])
    raw.send(*case)
    got, reply, _ = raw.recv()
    assert got is MsgType.ERROR and reply["code"] == ErrorCode.MALFORMED, reply
    assert raw.closed_by_peer()
    raw.close()
    with client(node, "ta") as c:
        put(c, [b"after-malformed"])
        out = bytearray(BLOCK_BYTES)
        assert c.get(b"after-malformed", out) and bytes(out) == data(b"after-malformed")


def test_a_subscribed_connection_that_sends_a_request_is_closed_and_its_slot_freed(node):
    raw, _ = _subscribe_raw(node, "tb")
    raw.send(MsgType.STATS, {})
    msg, header, _ = raw.recv()
    assert msg is MsgType.ERROR and header["code"] == ErrorCode.MALFORMED, header
    assert raw.closed_by_peer()
    raw.close()
    with client(node, "tb") as c:
        wait_until(lambda: tenant_stats(c)["event_subscribers"] == 0, "the subscription ended with its connection")


def test_a_node_older_than_events_is_named_and_never_marked_down():
    """An in-process node whose SUBSCRIBE and ANNOUNCE handlers are taken away answers MALFORMED
    and closes, as a node from before them does: the client says so, probes once, and the node
    serves its puts and gets on."""
    old = PoolNode(NodeConfig("127.0.0.1", 0, 8 << 20, open_tenants(8 << 20), region_bytes=1 << 20))
    old.start()
    old._streams.pop(MsgType.SUBSCRIBE)
    old._control.pop(MsgType.ANNOUNCE)
    try:
        host, port = old.address
        with PoolClient([f"{host}:{port}"], timeout_s=WAIT_S, reconnect_s=60) as c:
            with pytest.raises(NotServed, match="SUBSCRIBE"):
                c.subscribe()
            put(c, [b"old"])
            for _ in range(2):
                assert c.announce([b"old"], [1], block_size=4) == {"announced": 0, "ignored": 0, "failed": 1}
            assert not c.links[0].down
            out = bytearray(BLOCK_BYTES)
            assert c.get(b"old", out) and bytes(out) == data(b"old")
        assert old.stats()["protocol_errors"] == 2, "the SUBSCRIBE and one ANNOUNCE probe, not one per call"
    finally:
        old.stop()


# ---- the ZMQ bridge ----------------------------------------------------------------------------

def _read_event(proc: subprocess.Popen, name: str) -> dict:
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while sel.select(WAIT_S):
            line = proc.stdout.readline()
            if not line:
                break
            event = json.loads(line)
            if event.get("event") == name:
                return event
    proc.kill()
    raise AssertionError(f"the bridge never said {name!r}: {proc.stderr.read()}")


def test_the_bridge_republishes_in_vllms_zmq_framing_and_answers_replay(node, tmp_path):
    zmq = pytest.importorskip("zmq")
    secret = tmp_path / "ta.key"
    secret.write_bytes(KEYS["ta"] + b"\n")
    proc = subprocess.Popen([sys.executable, "-m", "kvtier", "pool", "events", "--address", node.address,
                             "--tenant", "ta", "--secret-file", str(secret), "--topic", "kv@pool@tiny",
                             "--publish", "tcp://127.0.0.1:*", "--replay", "tcp://127.0.0.1:*"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    sub, dealer = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
    try:
        ready = _read_event(proc, "ready")
        sub.connect(ready["publish"])
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@pool@tiny")
        parts, rounds = None, 0
        with client(node, "ta") as c:
            while parts is None:  # a SUB joins asynchronously: batches before it joined are not its
                rounds += 1
                assert rounds <= 100, "the SUB socket never received a republished batch"
                key = b"bridged-%d" % rounds
                put(c, [key])
                assert c.announce([key], [7000 + rounds], block_size=4)["announced"] == 1
                if sub.poll(int(WAIT_S * 1000 / 100)):
                    parts = sub.recv_multipart()
        topic, seq, payload = parts
        assert topic == b"kv@pool@tiny" and len(seq) == 8
        kv_events = pytest.importorskip("vllm.distributed.kv_events")
        msgspec = pytest.importorskip("msgspec")
        batch = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch).decode(payload)
        assert batch.events[0].medium == "SHARED" and batch.events[0].block_hashes[0] > 7000

        dealer.connect(ready["replay"])
        dealer.send_multipart([b"", seq])  # vLLM's replay request: the start seq, 8 bytes big-endian
        replayed = []
        while True:
            assert dealer.poll(int(WAIT_S * 1000)), "no replay answer"
            _, rtopic, rseq, rpayload = dealer.recv_multipart()
            if rseq == (-1).to_bytes(8, "big", signed=True):
                break
            replayed.append((rtopic, rseq, rpayload))
        assert replayed[0] == (topic, seq, payload)
        proc.terminate()
        stopped = _read_event(proc, "stopped")
        assert proc.wait(WAIT_S) == 0 and stopped["batches"] >= 1
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        ctx.term()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
