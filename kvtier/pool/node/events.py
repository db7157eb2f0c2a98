"""The pool node's shared-tier KV events, per tenant (issue 32): what a tenant's subscribers learn.

A writing client ANNOUNCEs, for blocks it stored, the engine's block hashes (vLLM's
`ExternalBlockHash`, with parent and tokens). The node keeps them per block id (`Announced`) and
publishes, to the subscribers of the tenant that owns the block and to no one else:
- `BlockStored` when a READY block is announced (it is visible to lookups from then on);
- `BlockRemoved` when an announced block leaves by any path: eviction, quota, DELETE, an expired or
  dropped lease, because every one of them ends in `Slabs.remove`, which calls `on_remove`.

Blocks never announced publish nothing: their only name is the pool key, which no router can join
to a prefix (an event keyed by it would be indexed as an unknown hash and never match), and a
later ANNOUNCE would have to retract it. A subscriber learns of them through STATS' `num_blocks`.

Events are encoded as vLLM 0.32's `KVEventBatch` goes on the wire (msgspec, `array_like` batch,
tagged map events): `[ts, [event, ...], None]`, each event a map with `"type"` first and vLLM's field names
in its order, defaults omitted as msgspec omits them (tests decode it with vLLM's own decoder). The
medium is `SHARED` with locality `REMOTE` and ownership `kvtier-pool`: vLLM has no pool medium,
and `SHARED` is what Dynamo maps to its External tier (design, 4.4).

Bounds (`EventLimits`): producers (puts, evictions, announcements) only append to a per-tenant
pending list under the store lock; one flusher thread (`run`) cuts it into batches, encodes them
outside every lock, numbers them per tenant (`seq`), keeps them in a bounded replay ring and
offers each to every subscriber's bounded queue. A full queue drops its oldest batch and carries
the count to the next frame it sends (`dropped`: exactly the gap in `seq` before that frame) and to
the tenant's `events_dropped`. Nothing waits on a subscriber: a stalled one costs its queue.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import msgpack

from kvtier.errors import ConfigError
from kvtier.pool.node.blocks import AccessError
from kvtier.pool.protocol import ErrorCode

MEDIUM, LOCALITY, OWNERSHIP = "SHARED", "REMOTE", "kvtier-pool"
_ENTRY_BYTES = 256  # an `Announced`, its token array's header and its dict slot (what a tenant is charged besides)
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EventLimits:
    """How much the node keeps for events. Counts of batches unless named otherwise."""

    max_subscribers_per_tenant: int = 4
    queue_batches: int = 256  # per subscriber
    queue_bytes: int = 8 << 20  # per subscriber
    ring_batches: int = 4096  # per tenant, replayed from by SUBSCRIBE's from_seq
    ring_bytes: int = 32 << 20  # per tenant
    batch_events: int = 512  # events in one batch at most
    pending_events: int = 1 << 17  # per tenant, waiting for the flusher; past it the oldest are lost (a seq gap)
    batch_s: float = 0.01  # the flusher gathers events this long before it publishes
    meta_fraction: float = 1 / 16  # announced metadata a tenant may keep, as a fraction of its quota
    sndbuf_bytes: int = 256 << 10  # a subscribing socket's kernel send buffer
    poll_s: float = 0.5  # how often an idle subscriber's connection is checked for a peer that left

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (value > 0 if f.name != "meta_fraction" else 0 <= value <= 1):
                raise ConfigError(f"pool node events: {f.name} must be {'in [0, 1]' if f.name == 'meta_fraction' else '> 0'}, "
                                  f"got {value}")


@dataclass(frozen=True, slots=True)
class Announced:
    """The engine's name for one stored block of `tenant`."""

    tenant: str
    hash: int | bytes
    parent: int | bytes | None
    tokens: array  # of u64: 8 bytes a token, where a list of Python ints costs 36
    block_size: int
    cost_bytes: int


def stored_event(m: Announced) -> dict[str, Any]:
    """vLLM's `BlockStored` as msgspec encodes it (fields in declaration order, defaults left out)."""
    return {"type": "BlockStored", "block_hashes": [m.hash], "parent_block_hash": m.parent,
            "token_ids": m.tokens.tolist(), "block_size": m.block_size, "lora_id": None, "medium": MEDIUM,
            "lora_name": None, "locality": LOCALITY, "ownership": OWNERSHIP}


def removed_event(m: Announced) -> dict[str, Any]:
    """vLLM's `BlockRemoved` as msgspec encodes it."""
    return {"type": "BlockRemoved", "block_hashes": [m.hash], "medium": MEDIUM, "locality": LOCALITY,
            "ownership": OWNERSHIP}


def encode_batch(ts: float, events: list[dict[str, Any]]) -> bytes:
    """A `KVEventBatch` in msgpack: `[ts, events, data_parallel_rank]` (an `array_like` struct keeps
    its trailing None; a pool node has no data-parallel rank)."""
    return msgpack.packb([float(ts), events, None], use_bin_type=True)


class Subscriber:
    """One subscribed connection's bounded queue of `(seq, payload, dropped)` batches.

    `take` blocks its own connection's thread; `offer` (the flusher, under the hub's lock) never
    blocks. `dropped` of a batch: the batches lost just before it, so consumers see it and the gap
    in `seq` agree.
    """

    def __init__(self, hub: EventHub, tenant: str, replay: list[tuple[int, bytes]], missed: int) -> None:
        self.tenant, self._hub, self._limits = tenant, hub, hub.limits
        self._ready = threading.Condition(hub.lock)
        self._replay = collections.deque([seq, payload, 0] for seq, payload in replay)  # ring entries, not copies
        self._queue: collections.deque[list] = collections.deque()
        self._queue_bytes = 0
        self._carry = missed  # batches lost before the next one queued
        if self._replay and missed:
            self._replay[0][2], self._carry = missed, 0
        self.closed = False

    def offer(self, seq: int, payload: bytes) -> int:
        """Queues a batch (hub lock held); returns how many batches the bounds dropped for it."""
        self._queue.append([seq, payload, self._carry])
        self._carry = 0
        self._queue_bytes += len(payload)
        num_dropped = 0
        while len(self._queue) > self._limits.queue_batches or self._queue_bytes > self._limits.queue_bytes:
            _, old, gap = self._queue.popleft()
            self._queue_bytes -= len(old)
            num_dropped += 1
            if self._queue:
                self._queue[0][2] += gap + 1
            else:
                self._carry += gap + 1
        self._ready.notify()
        return num_dropped

    def skip(self) -> None:
        """A seq no batch was published under (hub lock held): the next batch says one more was lost."""
        self._carry += 1

    def end(self) -> None:
        """Marks the subscription closed and wakes its `take` (hub lock held)."""
        self.closed = True
        self._ready.notify_all()

    def take(self, timeout_s: float) -> tuple[int, bytes, int] | None:
        """The next batch `(seq, payload, dropped)`, waiting up to `timeout_s`; None when none came
        or the subscription was closed (`closed`)."""
        with self._ready:
            if not self._ready.wait_for(lambda: self._replay or self._queue or self.closed, timeout_s) or self.closed:
                return None
            if self._replay:
                return tuple(self._replay.popleft())
            seq, payload, gap = self._queue.popleft()
            self._queue_bytes -= len(payload)
            return seq, payload, gap

    def close(self) -> None:
        """Ends the subscription: `take` returns None from now on, and the tenant's slot is free."""
        self._hub.unsubscribe(self)


class _Channel:
    """One tenant's events: numbering, replay ring, subscribers, counters."""

    def __init__(self, meta_budget_bytes: int) -> None:
        self.meta_budget_bytes, self.meta_bytes = meta_budget_bytes, 0
        self.next_seq = 0
        self.ring: collections.deque[tuple[int, bytes]] = collections.deque()
        self.ring_bytes = 0
        self.subscribers: list[Subscriber] = []
        self.pending: list[tuple[bool, Announced]] = []
        self.lost_pending = 0
        self.counters = dict.fromkeys(("events_published", "events_dropped", "events_lost", "blocks_announced",
                                       "announce_ignored"), 0)


class EventHub:
    """Every tenant's events on one node. `announce` and `on_remove` run under the node's store
    lock; `subscribe`, `stats` and the flusher (`run`) take the hub's own `lock`, which is never
    held while anything waits or is encoded.

    Args:
        limits: the bounds.
        quotas: tenant name -> quota in bytes (a tenant's metadata budget is `meta_fraction` of it).
        clock: wall-clock seconds for a batch's `ts` (vLLM's is `time.time()`).
    """

    def __init__(self, limits: EventLimits, quotas: Mapping[str, int], clock: Callable[[], float] = time.time) -> None:
        self.limits, self._clock = limits, clock
        self.lock = threading.Lock()
        self.wake = threading.Event()  # set when a tenant has events pending
        self._channels = {name: _Channel(int(q * limits.meta_fraction)) for name, q in quotas.items()}
        self._announced: dict[int, Announced] = {}  # block id -> its engine name (store lock)
        self._closed = False

    # ---- producers (store lock held) ---------------------------------------------------------

    def announce(self, tenant: str, ids: Sequence[int], header: dict[str, Any]) -> dict[str, int]:
        """Names the READY blocks `ids` (`BlockStore.find` of the ANNOUNCE's keys; -1 a miss) with
        their hashes and queues a `BlockStored` for each. Ignored and counted: misses, blocks
        announced already, and blocks past the tenant's metadata budget. Returns ANNOUNCE's reply."""
        ch, size = self._channels[tenant], header["block_size"]
        added: list[tuple[bool, Announced]] = []
        for i, h, parent, tokens in zip(ids, header["hashes"], header["parents"], header["tokens"]):
            cost = _ENTRY_BYTES + 8 * len(tokens) + _hash_bytes(h) + _hash_bytes(parent)
            if i < 0 or i in self._announced or ch.meta_bytes + cost > ch.meta_budget_bytes:
                continue
            meta = Announced(tenant, h, parent, array("Q", tokens), size, cost)
            self._announced[i] = meta
            ch.meta_bytes += cost
            added.append((True, meta))
        ignored = len(ids) - len(added)
        ch.counters["blocks_announced"] += len(added)
        ch.counters["announce_ignored"] += ignored
        self._queue(ch, added)
        return {"announced": len(added), "ignored": ignored}

    def on_remove(self, block_id: int) -> None:
        """`Slabs`' hook for every block that leaves: an announced one queues its `BlockRemoved`."""
        meta = self._announced.pop(block_id, None)
        if meta is not None:
            ch = self._channels[meta.tenant]
            ch.meta_bytes -= meta.cost_bytes
            self._queue(ch, [(False, meta)])

    def _queue(self, ch: _Channel, entries: list[tuple[bool, Announced]]) -> None:
        if not entries:
            return
        with self.lock:
            ch.pending += entries
            over = len(ch.pending) - self.limits.pending_events
            if over > 0:  # the flusher is far behind: the oldest never get a seq, and the gap says so
                del ch.pending[:over]
                ch.lost_pending += over
        self.wake.set()

    # ---- subscribers ------------------------------------------------------------------------

    def subscribe(self, tenant: str, from_seq: int | None) -> tuple[Subscriber, int, int]:
        """A new subscriber of `tenant`'s events; with `from_seq`, the ring's batches from that seq
        come first (those older than the ring are reported as `dropped` on the first frame).
        Returns it with the tenant's next seq and the ring's oldest.

        Raises:
            AccessError(LIMIT): the tenant has `max_subscribers_per_tenant` already.
        """
        ch = self._channels[tenant]
        with self.lock:
            if len(ch.subscribers) >= self.limits.max_subscribers_per_tenant:
                raise AccessError(ErrorCode.LIMIT, f"tenant {tenant!r} has {len(ch.subscribers)} event subscribers, "
                                                   f"the most it may (max_subscribers_per_tenant)")
            oldest = ch.ring[0][0] if ch.ring else ch.next_seq
            replay, missed = [], 0
            if from_seq is not None and from_seq < ch.next_seq:
                replay = [entry for entry in ch.ring if entry[0] >= from_seq]
                missed = (replay[0][0] if replay else ch.next_seq) - from_seq
            sub = Subscriber(self, tenant, replay, missed)
            sub.closed = self._closed
            ch.subscribers.append(sub)
            return sub, ch.next_seq, oldest

    def unsubscribe(self, sub: Subscriber) -> None:
        with self.lock:
            subs = self._channels[sub.tenant].subscribers
            if sub in subs:
                subs.remove(sub)
            sub.end()

    # ---- the flusher -----------------------------------------------------------------------

    def run(self, stopping: threading.Event) -> None:
        """The flusher thread's loop: gathers events for `batch_s`, then publishes them; until `stopping`."""
        while True:
            self.wake.wait()
            if stopping.is_set():
                return
            stopping.wait(self.limits.batch_s)
            self.wake.clear()
            try:
                self.flush()
            except Exception:  # a bug: this flush's events are lost (a seq gap is not promised), the next ones go out
                log.exception("pool node: publishing events failed")

    def flush(self) -> None:
        """Publishes every tenant's pending events: batches encoded outside the lock, then numbered,
        kept in the ring and offered to each subscriber under it."""
        with self.lock:
            work = [(ch, ch.pending, ch.lost_pending) for ch in self._channels.values() if ch.pending or ch.lost_pending]
            for ch, _, _ in work:
                ch.pending, ch.lost_pending = [], 0
        ts = self._clock()
        for ch, entries, lost in work:
            n = self.limits.batch_events
            payloads = [encode_batch(ts, [stored_event(m) if stored else removed_event(m)
                                          for stored, m in itertools.islice(entries, at, at + n)])
                        for at in range(0, len(entries), n)]
            with self.lock:
                self._publish(ch, payloads, lost)

    def _publish(self, ch: _Channel, payloads: list[bytes], lost: int) -> None:
        if lost:  # events that never made a batch: one seq skipped, so every consumer sees a gap
            ch.counters["events_lost"] += lost
            ch.next_seq += 1
            for sub in ch.subscribers:
                sub.skip()
        for payload in payloads:
            seq = ch.next_seq
            ch.next_seq += 1
            ch.ring.append((seq, payload))
            ch.ring_bytes += len(payload)
            while len(ch.ring) > self.limits.ring_batches or ch.ring_bytes > self.limits.ring_bytes:
                ch.ring_bytes -= len(ch.ring.popleft()[1])
            ch.counters["events_published"] += 1
            for sub in ch.subscribers:
                ch.counters["events_dropped"] += sub.offer(seq, payload)

    def close(self) -> None:
        """Ends every subscription and the flusher (the node is stopping)."""
        with self.lock:
            self._closed = True
            for ch in self._channels.values():
                for sub in ch.subscribers:
                    sub.end()
        self.wake.set()

    # ---- facts ------------------------------------------------------------------------------

    def stats(self, tenant: str | None = None) -> dict[str, int]:
        """`tenant`'s event figures (batches published and dropped from its subscribers' queues,
        events lost before batching, blocks announced and ignored, metadata bytes kept, subscribers,
        next seq); without `tenant`, summed over tenants (the operator's view)."""
        with self.lock:
            chans = [self._channels[tenant]] if tenant is not None else list(self._channels.values())
            out = {name: sum(ch.counters[name] for ch in chans) for name in chans[0].counters} if chans else {}
            out["announced_bytes"] = sum(ch.meta_bytes for ch in chans)
            out["event_subscribers"] = sum(len(ch.subscribers) for ch in chans)
            if tenant is not None:
                out["events_next_seq"] = chans[0].next_seq
            return out


def _hash_bytes(h: int | bytes | None) -> int:
    """What a hash costs the node kept: a Python bytes or int object (None: nothing)."""
    return 0 if h is None else 33 + len(h) if type(h) is bytes else 32
