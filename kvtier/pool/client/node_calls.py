"""`NodeCalls`: the keyed puts and gets of one pool node, each batch in as few round trips as its
data plane allows. `PoolClient` groups a call's keys by node and hands each node's share here.

put, inline (TCP): one MULTI_PUT frame per batch carries every block with its checksum (one PUT
     frame per block, pipelined, to a node older than MULTI_PUT): one round trip, as a raw socket.
     A block the node holds already is sent anyway, then dropped and counted in the node's
     `duplicate_put_bytes` (`PoolNode._put` says why that beats asking first).
put, one-sided (RDMA): PUT_BEGIN (slots under write leases) -> one-sided writes -> PUT_COMMIT
     against the checksums (PUT_ABORT for a write that did not go through).
get: one GET per batch. Inline (TCP), the hits' bytes follow the reply and land in the caller's
     buffers as they come off the socket. One-sided, the hits are leased and read; the leases go
     back with the next GET to the node (or expire), which saves a round trip per get. Either
     way each block is checked against its key-seeded checksum (`block_checksum`) unless the
     caller checks it part by part as it lands. A node that answers LIMIT (this client holds as
     many leases as it may) leased nothing: its keys are misses.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from kvtier.pool.base import Location, RemoteIO, Transport
from kvtier.pool.buffers import block_checksum
from kvtier.pool.client.connection import NodeConnection, NodeLink, NodeUnavailable, RemoteError, Request
from kvtier.pool.protocol import MAX_BATCH, MAX_INLINE_BYTES, ErrorCode, GrantStatus, MsgType

Block = memoryview | tuple[memoryview, ...]  # a block's bytes, whole or as consecutive buffers
Choose = Callable[[int, int], list[memoryview] | None]  # (key position, stored length) -> where its bytes go
Landed = Callable[[int, int], None]  # (key position, part) as that part is in
Summed = Callable[[int, int], Any]  # (key position, part) -> the LayerSums to compute as it lands, or None


@dataclass(frozen=True, slots=True)
class Hit:
    """One row of a GET reply (`protocol.encode_hits`, checked by the reply schema)."""

    found: bool
    location: Location  # where the block is, valid while its slot holds allocation `gen`
    checksum: int  # the block's key-seeded xxh3-64, as its writer committed it
    lease: int  # the read lease to give back (0 where none was taken)
    inline: bool  # its bytes follow the reply

    @classmethod
    def of(cls, row: Sequence) -> Hit:
        found, region, offset, length, gen, checksum, lease, inline = row
        return cls(found, Location(region, offset, length, gen), checksum, lease, inline)


class NodeCalls:
    """Puts and gets of keyed blocks on one node (see the module docstring). Thread-safe.

    Args:
        link: the node's control connections.
        data_plane: the node's transport now (under `auto`, chosen on first use).
        count: adds to the client's counters.
        lease_s, put_lease_s: the read and write leases asked for.
    """

    def __init__(self, link: NodeLink, data_plane: Callable[[], Transport], count: Callable[[dict[str, int]], None],
                 lease_s: float, put_lease_s: float) -> None:
        self.link = link
        self._data_plane, self._count = data_plane, count
        self.lease_s, self.put_lease_s = lease_s, put_lease_s
        self._releases: list[int] = []  # read leases done with, given back with the next GET
        self._lock = threading.Lock()

    # ---- put ------------------------------------------------------------------------------

    def put(self, keys: list[bytes], views: list[Block]) -> list[GrantStatus | None]:
        """Stores each block under its key; per block GRANTED, EXISTS, BUSY, the node's refusal,
        or None (not stored: the write or commit did not go through).

        Raises:
            NodeUnavailable: the node did not answer or broke the protocol.
        """
        transport = self._data_plane()
        if transport.inline:
            return self._put_inline(keys, views)
        with self.link.connection() as conn:  # the write leases are this connection's: see `get`
            return self._put_leased(conn, transport, keys, views)

    def _put_leased(self, conn: NodeConnection, transport: Transport, keys: list[bytes],
                    views: list[Block]) -> list[GrantStatus | None]:
        """PUT_BEGIN, one-sided writes and PUT_COMMIT (or PUT_ABORT) on `conn`, which holds the leases."""
        sums: list[int] = []
        grants = conn.request(Request(MsgType.PUT_BEGIN, {"keys": keys, "lengths": [_length(v) for v in views],
                                                          "lease_s": self.put_lease_s}),
                              overlap=lambda: sums.extend(map(_checksum, keys, views)))["grants"]
        out: list[GrantStatus | None] = [grant_status(g[0]) for g in grants]
        self._count_outcomes([g[0] for g in grants], puts=None)  # counted once committed
        todo = [j for j, g in enumerate(grants) if g[0] == GrantStatus.GRANTED]
        for j in todo:
            out[j] = None  # until written and committed
        if not todo:
            return out
        ios, owner = [], []  # one io per buffer; owner: the block each belongs to
        for j in todo:
            location, at = Location(grants[j][1], grants[j][2], _length(views[j]), grants[j][3]), 0
            parts = views[j] if isinstance(views[j], tuple) else (views[j],)
            if transport.inline and len(parts) > 1:
                raise ValueError("a block of several buffers needs the put's own commit, not WRITE_COMMIT")
            for part in parts:
                ios.append(RemoteIO(location.sub(at, len(part)), part, sums[j] if transport.inline else None))
                owner.append(j)
                at += len(part)
        written = transport.write_many(ios)
        bad = {j for j, ok in zip(owner, written) if not ok}
        done = [j for j in todo if j not in bad]
        lost = [j for j in todo if j in bad]
        if lost:  # a write or commit that did not go through: free the slot now, not at lease expiry
            conn.call(MsgType.PUT_ABORT, {"keys": [keys[j] for j in lost], "gens": [grants[j][3] for j in lost]})
        if done and not transport.inline:
            ok = conn.call(MsgType.PUT_COMMIT, {"keys": [keys[j] for j in done], "gens": [grants[j][3] for j in done],
                                                "checksums": [sums[j] for j in done]})["ok"]
            done = [j for j, committed in zip(done, ok) if committed]
        for j in done:
            out[j] = GrantStatus.GRANTED
        self._count({"puts": len(done)})
        return out

    def _put_inline(self, keys: list[bytes], views: list[Block]) -> list[GrantStatus | None]:
        """The batch's blocks with their bytes in the request: one MULTI_PUT frame (more only past
        the node's frame limit), or, to a node older than MULTI_PUT, one PUT frame per block."""
        with self.link.connection() as conn:  # its handshake tells the link whether MULTI_PUT is served
            put = self._put_multi if self.link.multi_put else self._put_each
            statuses, stored = put(conn, keys, views)
        out: list[GrantStatus | None] = [
            GrantStatus.GRANTED if ok else None if s == GrantStatus.GRANTED else grant_status(s)
            for s, ok in zip(statuses, stored)]
        self._count_outcomes(statuses, puts=out.count(GrantStatus.GRANTED))
        return out

    def _put_multi(self, conn: NodeConnection, keys: list[bytes], views: list[Block]) -> tuple[list[int], list[bool]]:
        """MULTI_PUT frames of the batch, each at most the node's frame limit in bytes (a block
        above it alone is TOO_LARGE); returns (status, stored) per block.

        Raises:
            NodeUnavailable: the node did not answer, refused a frame, or answered it wrongly.
        """
        statuses, stored = [int(GrantStatus.TOO_LARGE)] * len(keys), [False] * len(keys)
        lengths = [_length(v) for v in views]
        frames = _frames_within(lengths, conn.max_payload)
        requests = [Request(MsgType.MULTI_PUT, {
            "keys": [keys[j] for j in js], "lengths": [lengths[j] for j in js],
            "checksums": [_checksum(keys[j], views[j]) for j in js], "lease_s": self.put_lease_s},
            payload=tuple(p for j in js for p in (views[j] if isinstance(views[j], tuple) else (views[j],))))
            for js in frames]
        try:
            replies = conn.call_many(requests)
        except NodeUnavailable as e:
            if e.code is ErrorCode.MALFORMED:
                self.link.multi_put = None  # the node may have been replaced by an older one: ask again
            raise
        self._count({"put_frames": len(requests)})
        for js, reply in zip(frames, replies):
            results = reply.get("results") if isinstance(reply, dict) else None
            if results is None or len(results) != len(js):
                raise NodeUnavailable(f"pool node {self.link.name}: multi-put of {len(js)} blocks: "
                                      f"{reply if results is None else f'{len(results)} results'}")
            for j, (status, ok) in zip(js, results):
                statuses[j], stored[j] = status, ok
        return statuses, stored

    def _put_each(self, conn: NodeConnection, keys: list[bytes], views: list[Block]) -> tuple[list[int], list[bool]]:
        """A PUT frame per block, pipelined (a node older than MULTI_PUT); returns as `_put_multi`."""
        sent = [j for j, v in enumerate(views) if _length(v) <= conn.max_payload]
        replies = conn.call_many([Request(MsgType.PUT, {"key": keys[j], "lease_s": self.put_lease_s,
                                                        "checksum": _checksum(keys[j], views[j])},
                                          payload=views[j]) for j in sent])
        self._count({"put_frames": len(sent)})
        statuses, stored = [int(GrantStatus.TOO_LARGE)] * len(keys), [False] * len(keys)
        for j, reply in zip(sent, replies):
            if isinstance(reply, RemoteError):
                raise NodeUnavailable(f"pool node {self.link.name}: put of {keys[j].hex()}: {reply}")
            statuses[j], stored[j] = reply["status"], reply["stored"]
        return statuses, stored

    def _count_outcomes(self, statuses: Sequence[int], puts: int | None) -> None:
        counts = {"put_exists": statuses.count(GrantStatus.EXISTS)}
        if puts is not None:
            counts["puts"] = puts
        for s in statuses:
            if s not in STORED:
                counts[_rejection(s)] = counts.get(_rejection(s), 0) + 1
        self._count(counts)

    # ---- get ------------------------------------------------------------------------------

    def get(self, keys: list[bytes], choose: Choose, strict: bool, landed: Landed | None = None,
            checks_parts: Callable[[int, int], bool] | None = None, summed: Summed | None = None) -> list[bool]:
        """One GET of `keys`, each hit's bytes into `choose(j, stored length)` (None: a length
        the caller does not read; `strict`: a ValueError once the reply is in, else a miss
        counted `wrong_size`), `landed(j, i)` as part i of key j is in, `summed(j, i)` the layer
        checksums to compute as it lands; per key whether its bytes are in and checked (see
        `PoolClient.get_streamed_many`).

        Raises:
            NodeUnavailable: the node did not answer or broke the protocol.
            ValueError: `strict`, and a hit of a length the caller does not read.
        """
        transport = self._data_plane()
        chosen: list[list[memoryview] | None] = [None] * len(keys)
        owners: list[tuple[int, int]] = []  # per buffer of an inline reply: (key, part), part -1 for scratch

        def inline_buffers(header: dict) -> list[memoryview]:
            """Where an inline reply's bytes go, hit by hit (a length not read lands in scratch)."""
            out: list[memoryview] = []
            for j, row in enumerate(header["hits"][: len(keys)]):
                hit = Hit.of(row)
                if hit.found and hit.inline:
                    chosen[j] = choose(j, hit.location.length)
                    if chosen[j] is None:
                        out.append(memoryview(bytearray(hit.location.length)))
                        owners.append((j, -1))
                    else:
                        out.extend(chosen[j])
                        owners.extend((j, i) for i in range(len(chosen[j])))
            return out

        def on_inline_part(b: int) -> None:
            j, part = owners[b]
            if part >= 0:
                landed(j, part)

        def summed_part(b: int):
            j, part = owners[b]
            return summed(j, part) if part >= 0 else None

        request = Request(MsgType.GET, {"keys": keys, "lease_s": self.lease_s, "release": self.take_releases(),
                                        "inline": transport.inline}, into=inline_buffers,
                          max_reply_payload=MAX_INLINE_BYTES, landed=None if landed is None else on_inline_part,
                          summed=None if summed is None else summed_part)
        # One loan for the GET and the reads of its leased hits: the node ends a connection's
        # leases when it closes, and a connection handed back may be closed at once (pool full).
        with self.link.connection() as conn:
            try:
                rows = conn.request(request)["hits"]
            except RemoteError as e:
                if e.code is not ErrorCode.LIMIT:
                    raise
                self._count({"misses": len(keys), "lease_limit": 1})  # the node leased nothing
                return [False] * len(keys)
            if len(rows) != len(keys):
                raise NodeUnavailable(f"pool node {self.link.name}: {len(rows)} answers to {len(keys)} keys")
            hits = [Hit.of(row) for row in rows]
            found, read = self._read_leased(transport, keys, hits, choose, chosen, strict, landed)
        out = [False] * len(keys)
        stale = corrupt = wrong = 0
        for j in found:
            if chosen[j] is None:
                wrong += 1
                continue
            moved = read.get(j, True)  # an inline hit came with the reply
            checked = checks_parts is not None and checks_parts(j, hits[j].location.length)
            out[j] = moved and (checked or _checksum(keys[j], _one_or_tuple(chosen[j])) == hits[j].checksum)
            stale += not moved
            corrupt += moved and not out[j]
        self._count({"hits": sum(out), "stale": stale, "checksum_errors": corrupt, "wrong_size": wrong})
        return out

    def _read_leased(self, transport: Transport, keys: list[bytes], hits: list[Hit], choose: Choose,
                     chosen: list[list[memoryview] | None], strict: bool,
                     landed: Landed | None) -> tuple[list[int], dict[int, bool]]:
        """Queues a GET's leases for release, chooses the leased hits' buffers (into `chosen`) and
        reads them; returns the positions found and, per leased one read, whether its bytes moved.

        Raises:
            ValueError: `strict`, and a hit of a length the caller does not read.
        """
        found = [j for j, h in enumerate(hits) if h.found]
        leased = [j for j in found if not hits[j].inline]
        if leased:  # before anything below can raise
            with self._lock:
                self._releases += [hits[j].lease for j in leased]
        if len(found) < len(keys):
            self._count({"misses": len(keys) - len(found)})
        for j in leased:
            chosen[j] = choose(j, hits[j].location.length)
        for j in found if strict else ():
            if chosen[j] is None:
                raise ValueError(f"pool block {keys[j].hex()}: stored {hits[j].location.length} bytes, "
                                 "not the buffer's size")
        ios, owner = [], []  # owner: per io, (key, part)
        for j in leased:
            location, at = hits[j].location, 0
            for i, view in enumerate(chosen[j] or ()):
                ios.append(RemoteIO(location.sub(at, len(view)), view))
                owner.append((j, i))
                at += len(view)
        if not ios:
            return found, {}
        moved: dict[int, bool] = {}
        on_io = None if landed is None else lambda b: landed(*owner[b])
        for (j, _), ok in zip(owner, transport.read_many(ios, on_io)):
            moved[j] = moved.get(j, True) and ok
        return found, moved

    def take_releases(self) -> list[int]:
        """Up to a batch of the read leases this client is done with, to give back now."""
        if not self._releases:  # a read without the lock: a lease added meanwhile goes next time
            return []
        with self._lock:
            leases, self._releases = self._releases[:MAX_BATCH], self._releases[MAX_BATCH:]
        return leases


STORED = (GrantStatus.GRANTED, GrantStatus.EXISTS)


def _frames_within(lengths: Sequence[int], max_bytes: int) -> list[list[int]]:
    """Positions of blocks of `lengths` cut into consecutive frames of at most `max_bytes` each (a
    block longer than that is in none: the node could not take it)."""
    frames: list[list[int]] = []
    room = 0
    for j, n in enumerate(lengths):
        if n > max_bytes:
            continue
        if not frames or n > room:
            frames.append([])
            room = max_bytes
        frames[-1].append(j)
        room -= n
    return frames


def _length(block: memoryview | tuple[memoryview, ...]) -> int:
    return sum(map(len, block)) if isinstance(block, tuple) else len(block)


def _one_or_tuple(views: list[memoryview]) -> memoryview | tuple[memoryview, ...]:
    return views[0] if len(views) == 1 else tuple(views)


def _checksum(key: bytes, block: memoryview | tuple[memoryview, ...]) -> int:
    """`block_checksum` of a block, given whole or as consecutive buffers."""
    if not isinstance(block, tuple):
        return block_checksum(key, block)
    digest = xxhash.xxh3_64(seed=xxhash.xxh3_64_intdigest(key))
    for part in block:
        digest.update(part)
    return digest.intdigest()


def grant_status(status: int) -> GrantStatus | None:
    """A node's grant status as the enum; None for one this client does not know (a newer node)."""
    return GrantStatus(status) if status in GrantStatus._value2member_map_ else None


def _rejection(status: int) -> str:
    """The counter a put refused with `status` adds to."""
    known = status in GrantStatus._value2member_map_
    return f"put_rejected_{GrantStatus(status).name.lower() if known else status}"
