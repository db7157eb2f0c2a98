"""`SharedTier`: a keyed store (kvtier's pool nodes, Mooncake Store, a later object store) as the
manager's pool tier — `num_slots` slots of `slot_bytes`, shared by key.

The manager addresses slots; the transfer engine tells the tier which block each slot holds
(`bind`, or the keys of a `SpanIO`). A block whose key is a `BlockKey` (16 bytes naming model,
weights, KV format, block size and tenant) is kept in the store under that key, where every
process of the tenant finds it (`find`, which `KVTier.lookup` asks for the keys it does not index):

    write   the block's bytes, gathered until the whole block is in (spans of a store come layer
            range by layer range), then one keyed put of every block of the batch that is whole
            (`_put`): a store commits a block only whole and checked, so no process sees it
            before. A put answered BUSY (another process storing the same block now) waits for
            that one. A block this tier saw in the store already (found, or put before) is asked
            for instead (`_contains`) and not sent again if the store still holds it: deduplicated.
    read    a keyed get of the whole blocks of a batch (`_get`), each checked against its
            key-seeded checksum, or by the caller where it checks the bytes against checksums
            of its own (`SpanIO.sums`: one pass over them, not two); a block the store
            dropped or that fails a check is a miss, never wrong bytes. A read of part of a
            block (a layer range) fetches the whole block once and keeps it for the reads of
            its other parts (`_read_parts`; `PoolTier` streams it instead, layer by layer as it
            lands).
    find    one `_contains` for the keys asked, behind a short negative cache, so a miss asked
            again at once costs nothing; a store that does not answer makes its keys absent.

The store's own eviction, leases and quotas stay the authority over shared blocks: this tier never
deletes one (another process may be reading it), and one the store dropped is a miss here.

A key of any other type cannot be found by another process: such a block goes under a key private
to this tier instance (`_private_key`), written and read by the subclass (`_write_private`,
`_read_private`), and dropped when the tier closes (`_close_store`).

Batches: `write_spans`/`read_spans` take every block of one span of a load or store and cost one
call per store node (`_put`, `_get`, `_contains` take lists); failures come back by index.

A new keyed store (an object store, another KV store): subclass `SharedTier`, fill in `_put`,
`_get`, `_contains`, `_write_private`, `_read_private` and `_close_store` (and `_failure` where
the whole store can fail at once), and run `kvtier.testing.tier_contract.TierContract` against it
(tests/tiers/test_tier_contract.py runs it on `PoolTier` and `MooncakeTier`).
"""

from __future__ import annotations

import enum
import os
import threading
import time
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
import xxhash

from kvtier.errors import TierIOError
from kvtier.model.keys import KEY_BYTES
from kvtier.pool.shared_keys import KeyMemory, SpanGather
from kvtier.observing.stats import Stats
from kvtier.tiers.base import (LayerSums, Medium, SpanIO, Tier, TierKind, as_byte_buffer, copy_bytes, host_tensor,
                               slots_needed)

NEGATIVE_CACHE_S = 1.0  # how long a key the store did not hold is answered "absent" without asking
_READ_CACHE_BLOCKS = 64  # blocks kept between the partial reads of one (see `_read_parts`)


class Put(enum.Enum):
    """What a keyed put of one block came to."""

    STORED = "stored"  # stored now, or the store holds it already
    BUSY = "busy"  # another process is storing that key now: wait for its copy
    REFUSED = "refused"  # not stored; `PutResult.why` says why


@dataclass(frozen=True, slots=True)
class PutResult:
    status: Put
    why: str = ""


STORED = PutResult(Put.STORED)


class SharedTier(Tier):
    """The keyed-store skeleton of `PoolTier` and `MooncakeTier` (see the module docstring).

    Args:
        capacity_bytes: this process's share of the store; rounded down to whole slots.
        slot_bytes: bytes per slot (one block).
        shared: keep `BlockKey` blocks under their keys, for every process of the tenant (False:
            every block under a key private to this tier, as for other keys).
        negative_cache_s: how long a key found absent is not asked for again.
        stats: where the shared-tier counters go (`Stats.shared`); the runtime sets its own.
        peer_timeout_s: how long a put answered BUSY waits for the other writer's copy.
    Raises:
        CapacityError: capacity is below one slot.
    """

    kind = TierKind.POOL
    medium = Medium.REMOTE
    checks_reads = True  # every get checks the block's key-seeded checksum
    may_drop = True  # the store evicts by its own authority (see `Tier.may_drop`)
    # False in a process whose shared blocks another process sends (a tensor-parallel rank whose
    # KV slice another rank replicates, under the same keys): writes of shared blocks then send
    # nothing (counted `left_to_peer`), and reads find the peer's copy (or miss, never wrong bytes).
    writes_shared: bool = True

    def __init__(self, capacity_bytes: int, slot_bytes: int, *, shared: bool, negative_cache_s: float,
                 stats: Stats | None, peer_timeout_s: float = 2.0) -> None:
        self.slot_bytes = slot_bytes
        self.num_slots = slots_needed(capacity_bytes, slot_bytes, "pool")
        self.shared = shared
        self.stats = stats or Stats()
        self._peer_timeout_s = peer_timeout_s
        self._instance = os.urandom(16)
        self._keys: list[bytes | None] = [None] * self.num_slots  # the shared key each slot holds, if any
        self._gather = SpanGather(slot_bytes)
        self._parts: OrderedDict[tuple[int, bytes], torch.Tensor] = OrderedDict()  # see `_read_parts`
        self._memory = KeyMemory(4 * self.num_slots, negative_cache_s)
        self._lock = threading.Lock()
        self._closed = False
        self._on_put: Callable[[list[bytes]], None] | None = None  # see `listen_puts`

    # ---- what the runtime tells and asks a shared tier ---------------------------------------

    def listen_puts(self, listener: Callable[[list[bytes]], None] | None) -> None:
        """Calls `listener(keys)` with the keys of the shared blocks this tier has just put in the
        store (stored by this put, or found there by it), once per put, after the store committed
        them; None stops. Blocks sent by a peer (`writes_shared` False, a put answered BUSY) or
        found held without a put (deduplicated) are not this tier's puts and are not passed.

        The listener runs on the writing (transfer) thread: it must be quick and must not raise.
        Why a hook here: the put's completion is the one moment a block is known to be on the
        store, whichever path wrote it (a write-through store, a demotion into the pool).
        """
        self._on_put = listener

    def register_host_memory(self, memory: torch.Tensor) -> None:
        """Told by the runtime about the host memory the memory tiers' slots lie in (the DRAM
        tier's slab): buffers handed to this tier's reads and writes often lie in it. A store
        whose transport can use it directly (the pool over RDMA registers it once, then moves
        blocks without a staging copy) does; the default ignores it."""

    def hint(self, retain: list[bytes], retain_s: float, release: list[bytes]) -> None:
        """Passes a retention hint the manager applied on to the store, for shared blocks this tier
        holds a copy of (`SharedLookup.forward_hint`): `retain` kept `retain_s` seconds more,
        `release` (their session closed) the first to go. Called under the runtime's lock: it must
        be quick and must not raise; a store that does I/O queues it. The default: the store knows
        no hints, nothing is sent."""

    def client_counters(self) -> dict[str, int] | None:
        """The store client's counters (hits, misses, stale, node errors...), for
        `KVTier.snapshot()["pool_client"]`; None (the default) where there are none."""
        return None

    # ---- what a store fills in -------------------------------------------------------------

    @abstractmethod
    def _put(self, keys: list[bytes], blocks: list[torch.Tensor]) -> list[PutResult]:
        """Stores whole blocks under their keys, keeping an object a key already names; one call
        per store node. Never raises for a store that is down (its blocks are REFUSED)."""

    @abstractmethod
    def _get(self, keys: list[bytes], intos: list[torch.Tensor], sums: list[LayerSums | None]) -> list[str | None]:
        """Reads whole blocks into `intos` (host tensors of `slot_bytes`), each checked against its
        key-seeded checksum unless `sums` says the caller checks it (`SpanIO.sums`, whose layer
        checksums a store may compute as the bytes land); one call per store node. Per key None
        (a hit, checked or to be checked) or why not."""

    @abstractmethod
    def _contains(self, keys: list[bytes]) -> list[bool]:
        """Whether the store holds each key; one call per node; a store that does not answer: False."""

    @abstractmethod
    def _write_private(self, slots: list[int], offset: int, srcs: list[torch.Tensor]) -> dict[int, Exception]:
        """Writes private blocks' ranges; the failures by index (`TierIOError`)."""

    @abstractmethod
    def _read_private(self, slots: list[int], offset: int, dsts: list[torch.Tensor]) -> dict[int, Exception]:
        """Reads private blocks' ranges; the failures by index (`TierIOError`: never written here,
        dropped by the store...)."""

    @abstractmethod
    def _close_store(self) -> None:
        """Drops this tier's private blocks (best effort) and closes what the tier owns."""

    def _failure(self, key: bytes) -> type[TierIOError]:
        """The error for a shared block that failed: `TierUnavailable` where the whole store is
        out of reach, else `TierIOError` (the default)."""
        return TierIOError

    # ---- the Tier interface ----------------------------------------------------------------

    def can_share(self, key: Hashable) -> bool:
        """Whether block `key` is kept where other processes find it (a 16-byte `BlockKey`)."""
        return self.shared and isinstance(key, bytes) and len(key) == KEY_BYTES

    def bind(self, slot: int, key: Hashable) -> None:
        """Slot `slot` holds block `key`: a `BlockKey` makes it a shared block, anything else a private one."""
        shared = self.can_share(key)
        with self._lock:
            self._keys[slot] = bytes(key) if shared else None

    def find(self, keys: Sequence[Hashable]) -> list[bool]:
        """Whether the store holds each key (a node down: absent), one `_contains` for the keys not
        answered from the negative cache; keys that cannot be shared are absent.

        Raises:
            TierIOError: the tier is closed.
        """
        with self._lock:
            self._check_open()
        candidates = [i for i, key in enumerate(keys) if self.can_share(key)]
        shared = [bytes(keys[i]) for i in candidates]
        ask = self._memory.to_ask(shared)
        asked = [shared[j] for j in ask]
        found = self._contains(asked) if asked else []
        self._memory.answered(asked, found)
        out = [False] * len(keys)
        for j, hit in zip(ask, found):
            out[candidates[j]] = bool(hit)
        self.stats.count_shared({"asked": len(ask), "found": sum(out), "negative_cached": len(shared) - len(ask)})
        return out

    def write(self, slot: int, src: torch.Tensor, offset: int = 0) -> None:
        """Writes `src` at `offset` of `slot`: a shared block once all its bytes are in (see the
        module docstring), a private one at once.

        Raises:
            TypeError, IndexError: as the `Tier` contract.
            TierIOError: the store did not take the block (no room, quota, unreachable), dropped a
                private slot (its earlier content is then lost), or the tier is closed.
        """
        src = as_byte_buffer(src, "pool write source")
        self._check_range(slot, offset, src.numel())
        key = self._key(slot)
        if src.numel():
            self._raise_first(self._write_batch([slot], [key], offset, [src.cpu() if src.is_cuda else src]))

    def read(self, slot: int, dst: torch.Tensor, offset: int = 0) -> None:
        """Reads `dst.numel()` bytes at `offset` of `slot`.

        Raises:
            TypeError, IndexError: as the `Tier` contract.
            TierIOError: the slot holds no block here, the store dropped it, it failed its
                checksum, the store is unreachable, or the tier is closed.
        """
        dst = as_byte_buffer(dst, "pool read destination")
        self._check_range(slot, offset, dst.numel())
        key = self._key(slot)
        if not dst.numel():
            return
        host = torch.empty(dst.numel(), dtype=torch.uint8) if dst.is_cuda else dst
        self._raise_first(self._read_batch([slot], [key], offset, [host]))
        if host is not dst:
            dst.copy_(host)

    def write_spans(self, io: SpanIO) -> dict[int, Exception]:
        """Every block of the batch bound to its key, then written as `write` does, whole shared
        blocks in one `_put` (one call per store node)."""
        return self._spans(io, self._write_batch)

    def read_spans(self, io: SpanIO) -> dict[int, Exception]:
        """Every block of the batch bound to its key, then read as `read` does, whole shared
        blocks in one `_get` (one call per store node)."""
        return self._spans(io, self._read_batch)

    def close(self) -> None:
        """Drops this tier's private blocks (best effort; shared blocks stay for the other
        processes, the store evicts them) and closes the client if owned. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._gather.clear()
            self._parts.clear()
        self._close_store()

    # ---- batches ---------------------------------------------------------------------------

    def _spans(self, io: SpanIO, batch) -> dict[int, Exception]:
        """`io`'s slots checked and bound, then `batch(slots, keys, offset, tensors, sums)` over
        the good ones; the failures by index into `io`."""
        failed: dict[int, Exception] = {}
        todo = []
        for i, slot in enumerate(io.slots):
            try:
                self._check_range(slot, io.offset, io.length)
                todo.append(i)
            except IndexError as e:
                failed[i] = e
        with self._lock:
            if self._closed:
                return {**failed, **{i: TierIOError("POOL tier is closed") for i in todo}}
            for i in todo:
                key = io.keys[i]
                self._keys[io.slots[i]] = bytes(key) if self.can_share(key) else None
            keys = [self._keys[io.slots[i]] for i in todo]
        if not todo or not io.length:
            return failed
        buffers = [host_tensor(io.addresses[i], io.length) for i in todo]
        sums = [io.sums[i] for i in todo] if io.sums else [None] * len(todo)
        done = batch([io.slots[i] for i in todo], keys, io.offset, buffers, sums)
        return {**failed, **{todo[j]: e for j, e in done.items()}}

    def _write_batch(self, slots: list[int], keys: list[bytes | None], offset: int,
                     srcs: list[torch.Tensor], _sums: Sequence[LayerSums | None] = ()) -> dict[int, Exception]:
        if None not in keys:  # every block shared: the usual batch
            return self._write_shared(slots, keys, offset, srcs)
        return _split(keys, lambda js: self._write_shared(_pick(slots, js), _pick(keys, js), offset, _pick(srcs, js)),
                      lambda js: self._write_private(_pick(slots, js), offset, _pick(srcs, js)))

    def _read_batch(self, slots: list[int], keys: list[bytes | None], offset: int,
                    dsts: list[torch.Tensor], sums: Sequence[LayerSums | None] = ()) -> dict[int, Exception]:
        """`sums`: as `SpanIO.sums`, per position (empty: none is)."""
        sums = sums or [None] * len(slots)
        if None not in keys:  # every block shared: the usual batch
            return self._read_shared(slots, keys, offset, dsts, sums)
        return _split(keys, lambda js: self._read_shared(_pick(slots, js), _pick(keys, js), offset, _pick(dsts, js),
                                                         _pick(sums, js)),
                      lambda js: self._read_private(_pick(slots, js), offset, _pick(dsts, js)))

    # ---- shared blocks ---------------------------------------------------------------------

    def _write_shared(self, slots: list[int], keys: list[bytes], offset: int,
                      srcs: list[torch.Tensor]) -> dict[int, Exception]:
        """Gathers partial spans, then puts the blocks that are whole (see the module docstring)."""
        length = srcs[0].numel()
        if not self.writes_shared:  # a peer process sends these blocks (`writes_shared`)
            if offset + length == self.slot_bytes:
                self.stats.count_shared({"left_to_peer": len(slots)})
            return {}
        if offset == 0 and length == self.slot_bytes:
            blocks: list[torch.Tensor | None] = list(srcs)
        else:  # one span of several: gather each block first
            with self._lock:
                blocks = [self._gather.add(slot, key, src, offset) for slot, key, src in zip(slots, keys, srcs)]
        ready = self._not_held([j for j, b in enumerate(blocks) if b is not None], keys)
        if not ready:
            return {}
        results = self._put([keys[j] for j in ready], [blocks[j] for j in ready])
        busy = [j for j, r in zip(ready, results) if r.status is Put.BUSY]
        awaited = dict(zip(busy, self._await_peers([keys[j] for j in busy]))) if busy else {}
        self.stats.count_shared({"awaited_peer": sum(awaited.values())})
        failed: dict[int, Exception] = {}
        for j, r in zip(ready, results):
            if r.status is Put.STORED or awaited.get(j):
                self._memory.note_held(keys[j])
                continue
            why = "another process was writing it and did not finish in time" if r.status is Put.BUSY else r.why
            failed[j] = self._failure(keys[j])(f"POOL slot {slots[j]}: the pool did not take block "
                                               f"{keys[j].hex()[:16]} ({why})")
        listener = self._on_put
        if listener is not None:
            put = [keys[j] for j, r in zip(ready, results) if r.status is Put.STORED]
            if put:
                listener(put)
        return failed

    def _not_held(self, ready: list[int], keys: list[bytes]) -> list[int]:
        """Those of `ready` to send: a block seen in the store is asked for (a few bytes) rather
        than sent, and sent only where the store dropped it since (a block written nowhere would
        be lost)."""
        known = [j for j in ready if self._memory.held(keys[j])]
        if not known:
            return ready
        there = {j for j, hit in zip(known, self._contains([keys[j] for j in known])) if hit}
        self.stats.count_shared({"deduplicated": len(there)})
        return [j for j in ready if j not in there]

    def _await_peers(self, keys: list[bytes]) -> list[bool]:
        """Whether each block another client is writing now (a put answered BUSY: the same prefix
        stored by two engines at once) becomes visible within `peer_timeout_s`: then nothing needs
        sending from here. Polls `_contains` for those not seen yet, backing off from 1 ms."""
        deadline, pause = time.monotonic() + self._peer_timeout_s, 0.001
        seen = [False] * len(keys)
        while True:
            waiting = [j for j, s in enumerate(seen) if not s]
            for j, hit in zip(waiting, self._contains([keys[j] for j in waiting])):
                seen[j] = hit
            if all(seen) or time.monotonic() + pause > deadline:
                return seen
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def _read_shared(self, slots: list[int], keys: list[bytes], offset: int,
                     dsts: list[torch.Tensor], sums: list[LayerSums | None]) -> dict[int, Exception]:
        """Whole blocks: one `_get` straight into `dsts`. Parts of blocks: `_read_parts`."""
        if offset == 0 and dsts[0].numel() == self.slot_bytes:
            return self._get_whole(slots, keys, dsts, sums)
        return self._read_parts(slots, keys, offset, dsts)

    def _get_whole(self, slots: list[int], keys: list[bytes], intos: list[torch.Tensor],
                   sums: list[LayerSums | None]) -> dict[int, Exception]:
        """`_get`, each miss forgotten (`KeyMemory.forget`) and failed by index."""
        failed: dict[int, Exception] = {}
        for j, why in enumerate(self._get(keys, intos, sums)):
            if why is not None:
                self._memory.forget(keys[j])
                failed[j] = self._failure(keys[j])(f"POOL slot {slots[j]}: block {keys[j].hex()[:16]}: {why}")
        return failed

    def _read_parts(self, slots: list[int], keys: list[bytes], offset: int,
                    dsts: list[torch.Tensor]) -> dict[int, Exception]:
        """Ranges of blocks: the blocks not kept from an earlier range are fetched whole (one
        `_get`), each range copied out, and a block kept while more of its ranges are to come."""
        with self._lock:
            blocks = [self._parts.pop((slot, key), None) for slot, key in zip(slots, keys)]
        missing = [j for j, b in enumerate(blocks) if b is None]
        failed: dict[int, Exception] = {}
        if missing:
            fresh = torch.empty((len(missing), self.slot_bytes), dtype=torch.uint8)
            got = self._get_whole([slots[j] for j in missing], [keys[j] for j in missing], list(fresh),
                                  [None] * len(missing))  # kept for later ranges: checked whole here
            failed = {missing[m]: e for m, e in got.items()}
            for m, j in enumerate(missing):
                blocks[j] = fresh[m]
        end = offset + dsts[0].numel()
        for j, block in enumerate(blocks):
            if j in failed:
                continue
            copy_bytes(dsts[j], block[offset: end])
            if end < self.slot_bytes:  # more of this block to come: keep it for those reads
                with self._lock:
                    self._parts[(slots[j], keys[j])] = block
                    while len(self._parts) > _READ_CACHE_BLOCKS:
                        self._parts.popitem(last=False)
        return failed

    # ---- helpers ---------------------------------------------------------------------------

    def _key(self, slot: int) -> bytes | None:
        with self._lock:
            self._check_open()
            return self._keys[slot]

    def _private_key(self, slot: int) -> bytes:
        """The store key of private slot `slot`: `xxh3_128(instance id, slot)`."""
        return xxhash.xxh3_128_digest(self._instance + slot.to_bytes(8, "little"))

    def _check_open(self) -> None:
        if self._closed:
            raise TierIOError("POOL tier is closed")

    @staticmethod
    def _raise_first(failed: dict[int, Exception]) -> None:
        if failed:
            raise next(iter(failed.values()))


def _pick(items: list, positions: list[int]) -> list:
    return [items[j] for j in positions]


def _split(keys: list[bytes | None], shared, private) -> dict[int, Exception]:
    """`shared(positions)` over the positions bound to a shared key, `private(positions)` over the
    others; their failures by index into `keys`."""
    failed: dict[int, Exception] = {}
    for fn, positions in ((shared, [j for j, k in enumerate(keys) if k is not None]),
                          (private, [j for j, k in enumerate(keys) if k is None])):
        if positions:
            failed.update({positions[j]: e for j, e in fn(positions).items()})
    return failed


__all__ = ("NEGATIVE_CACHE_S", "Put", "PutResult", "STORED", "SharedTier")
