"""`MooncakeTier`: Mooncake Store as the manager's pool tier, shared by key like `PoolTier`.

The manager addresses slots; the transfer engine tells this tier which block each slot holds
(`bind`). A block whose key is a `BlockKey` (16 bytes naming model, weights, KV format, block size
and tenant) is stored under that key, where every process of the tenant using the same master finds
it (`find`, which `KVTier.lookup` asks for the keys it does not index):

    write   the block's bytes, gathered until the whole block is in (spans of a store come layer
            range by layer range), then one put with its key-seeded trailer. The put is
            `batch_put_from` (`MooncakeClient.put(replace=False)`), which keeps an object already
            under the key: the key names the content, so the object there holds these very bytes,
            and another process may be reading it right now; an upsert would replace it under
            that reader for nothing. A block this tier saw in the store already (found, or put
            before) is asked for instead (`batch_is_exist`) and not sent again: deduplicated.
    read    a get of the whole block, checked against its trailer (a block the store dropped, one
            whose segment left, or one failing its check is a `TierIOError`: a miss, never wrong
            bytes); a read of part of a block keeps the block for the reads of its other parts.
    find    one `batch_is_exist` for the keys asked, behind a short negative cache, so a miss asked
            again at once costs nothing; a master that does not answer makes every key absent.

Where a shared block lives: Mooncake places each object in the segment some client lends
(`segment_bytes`, which `build_mooncake_tier` sets to the tier's capacity; the master's `random`
placement by default), and a segment goes with its client. So a block outlives the process that
stored it only while the process whose segment holds it stays: when that one closes, its blocks
are misses at once (-704); when it is killed, their reads fail (-800, a miss here) until the
master's `--client_ttl` lapses and they are gone (tests/pool/test_pool_mooncake_shared.py). Never
wrong bytes: a get checks the key-seeded trailer. This tier never deletes a shared block (another
process may be reading it): the master's eviction and the segments' lifetimes stay the authority,
as a pool node's index is for `PoolTier`.

A key of any other type cannot be found by another process: such a block goes under a key private
to this tier instance (`xxh3_128(instance id, slot)`); a write of part of it reads, patches and
upserts the block, and the tier deletes its private blocks when it closes.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence

import torch
import xxhash

from kvtier.errors import TierIOError, TransferError
from kvtier.keys import KEY_BYTES
from kvtier.pool.shared_keys import KeyMemory, SpanGather
from kvtier.pool.mooncake.client import MooncakeClient, Outcome, stored_bytes
from kvtier.stats import Stats
from kvtier.tiers.base import Medium, Tier, TierKind, as_byte_buffer, slots_needed

log = logging.getLogger(__name__)

NEGATIVE_CACHE_S = 1.0  # how long a key the store did not hold is answered "absent" without asking
_READ_CACHE_BLOCKS = 64  # blocks kept between the partial reads of one (see `_read_shared`)


class MooncakeTier(Tier):
    """`num_slots` slots in Mooncake Store behind `client`, shared by key (see the module docstring).

    Args:
        client: the Mooncake client; closed with the tier when `owns_client`.
        capacity_bytes, slot_bytes: as every tier; capacity is rounded down to whole slots.
        shared: keep `BlockKey` blocks under their keys, for every process of the tenant (False:
            every block under a key private to this tier, as for other keys).
        negative_cache_s: how long a key found absent is not asked for again.
        stats: where the shared-tier counters go (`Stats.shared`); the runtime sets its own.
    Raises:
        CapacityError: capacity is below one slot.
    """

    kind = TierKind.POOL
    medium = Medium.REMOTE
    checks_reads = True  # every get checks the block's key-seeded trailer
    may_drop = True  # the master evicts, and a segment leaves with its process (see `Tier.may_drop`)

    def __init__(self, client: MooncakeClient, capacity_bytes: int, slot_bytes: int, *, owns_client: bool = False,
                 shared: bool = True, negative_cache_s: float = NEGATIVE_CACHE_S, stats: Stats | None = None) -> None:
        self.slot_bytes = slot_bytes
        self.num_slots = slots_needed(capacity_bytes, slot_bytes, "pool")
        self.shared = shared
        self.stats = stats or Stats()
        self._client, self._owns_client = client, owns_client
        self._instance = os.urandom(16)
        self._written = [False] * self.num_slots  # private blocks stored
        self._keys: list[bytes | None] = [None] * self.num_slots  # the shared key each slot holds, if any
        self._gather = SpanGather(slot_bytes)
        self._reads: OrderedDict[tuple[int, bytes], torch.Tensor] = OrderedDict()
        self._memory = KeyMemory(4 * self.num_slots, negative_cache_s)
        self._lock = threading.Lock()
        self._closed = False

    def bind(self, slot: int, key: Hashable) -> None:
        """Slot `slot` holds block `key`: a `BlockKey` makes it a shared block, anything else a private one."""
        with self._lock:
            self._keys[slot] = bytes(key) if self.can_share(key) else None

    def find(self, keys: Sequence[Hashable]) -> list[bool]:
        """Whether the store holds each key (the master not answering: absent), one `batch_is_exist`
        for the keys not answered from the negative cache; keys that cannot be shared are absent.

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
        """Writes `src` at `offset` of `slot`: a shared block once all its bytes are in, a private
        one at once (read, patched and upserted when only part of it is written).

        Raises:
            TypeError, IndexError: as the `Tier` contract.
            TierIOError: the store did not take the block (no room, master gone), or the tier is
                closed; a private slot's earlier content is then lost.
        """
        src = as_byte_buffer(src, "pool write source")
        self._check_range(slot, offset, src.numel())
        key = self._key(slot)
        if src.numel() == 0:
            return
        src = src.cpu() if src.is_cuda else src
        if key is not None:
            return self._write_shared(slot, key, src, offset)
        self._write_private(slot, src, offset)

    def read(self, slot: int, dst: torch.Tensor, offset: int = 0) -> None:
        """Reads `dst.numel()` bytes at `offset` of `slot`.

        Raises:
            TypeError, IndexError: as the `Tier` contract.
            TierIOError: the slot holds no block here, the store dropped it or its segment left, it
                failed its trailer check, the master is unreachable, or the tier is closed.
        """
        dst = as_byte_buffer(dst, "pool read destination")
        self._check_range(slot, offset, dst.numel())
        key = self._key(slot)
        if dst.numel() == 0:
            return
        if key is not None:
            return self._read_shared(slot, key, dst, offset)
        block = torch.empty(self.slot_bytes, dtype=torch.uint8)
        self._fetch_private(slot, block, "read")
        dst.copy_(block[offset: offset + dst.numel()])

    def describe(self) -> dict[str, object]:
        sharing = "by key, every process of the tenant on this master" if self.shared else "per process"
        return {**super().describe(), **self._client.describe(), "sharing": sharing}

    def close(self) -> None:
        """Drops this tier's private blocks (best effort; shared blocks stay for the other
        processes) and closes the client if owned. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            private = [self._private_key(s) for s, w in enumerate(self._written) if w]
            self._gather.clear()
            self._reads.clear()
        try:
            if private:
                self._client.delete(private)
        except TransferError as e:
            log.debug("mooncake tier close: %s", e)
        finally:
            if self._owns_client:
                self._client.close()

    # ---- internals: shared blocks --------------------------------------------------------------

    def can_share(self, key: Hashable) -> bool:
        return self.shared and isinstance(key, bytes) and len(key) == KEY_BYTES

    def _key(self, slot: int) -> bytes | None:
        with self._lock:
            self._check_open()
            return self._keys[slot]

    def _contains(self, keys: list[bytes]) -> list[bool]:
        """`client.contains`, a closed client or failed call answering absent (logged)."""
        try:
            return self._client.contains(keys)
        except TransferError as e:
            log.warning("mooncake: existence check of %d keys failed, counted absent: %s", len(keys), e)
            return [False] * len(keys)

    def _write_shared(self, slot: int, key: bytes, src: torch.Tensor, offset: int) -> None:
        if not self.writes_shared:  # a peer process sends this block (`Tier.writes_shared`)
            if offset + src.numel() == self.slot_bytes:
                self.stats.count_shared({"left_to_peer": 1})
            return
        if offset != 0 or src.numel() != self.slot_bytes:  # one span of several: gather the block first
            with self._lock:
                src = self._gather.add(slot, key, src, offset)
            if src is None:
                return
        known = self._memory.held(key)
        # A block seen in the store is asked for (a few bytes) rather than sent: the store may have
        # dropped it since, and a block written nowhere would be lost.
        if known and self._contains([key])[0]:
            self.stats.count_shared({"deduplicated": 1})
            return
        try:
            stored = self._client.put(key, src, replace=False)
        except TransferError as e:
            raise TierIOError(f"POOL slot {slot}: block {key.hex()[:16]}: {e}") from None
        if not stored:
            raise TierIOError(f"POOL slot {slot}: mooncake did not take block {key.hex()[:16]} "
                              "(no room, or the master is unreachable)")
        self._memory.note_held(key)

    def _read_shared(self, slot: int, key: bytes, dst: torch.Tensor, offset: int) -> None:
        n = dst.numel()
        if offset == 0 and n == self.slot_bytes and not dst.is_cuda:
            return self._get_shared(slot, key, dst)
        with self._lock:
            block = self._reads.pop((slot, key), None)
        if block is None:
            block = torch.empty(self.slot_bytes, dtype=torch.uint8)
            self._get_shared(slot, key, block)
        dst.copy_(block[offset: offset + n])
        if offset + n < self.slot_bytes:  # more of this block to come: keep it for those reads
            with self._lock:
                self._reads[(slot, key)] = block
                while len(self._reads) > _READ_CACHE_BLOCKS:
                    self._reads.popitem(last=False)

    def _get_shared(self, slot: int, key: bytes, into: torch.Tensor) -> None:
        try:
            outcome = self._client.batch_get_outcomes([key], [into])[0]
        except TransferError as e:
            outcome = Outcome.FAILED
            log.debug("mooncake: get of %s: %s", key.hex(), e)
        if outcome is not Outcome.HIT:
            self._memory.forget(key)
            raise TierIOError(f"POOL slot {slot}: block {key.hex()[:16]}: mooncake answered {outcome.value} "
                              "(dropped, its segment's process gone, failed its check, or the master unreachable)")

    # ---- internals: private blocks -------------------------------------------------------------

    def _write_private(self, slot: int, src: torch.Tensor, offset: int) -> None:
        if offset == 0 and src.numel() == self.slot_bytes:
            block = src
        else:
            block = torch.zeros(self.slot_bytes, dtype=torch.uint8)
            if self._written[slot]:
                self._fetch_private(slot, block, "write")
            block[offset: offset + src.numel()] = src
        if not self._client.put(self._private_key(slot), block):
            self._written[slot] = False
            raise TierIOError(f"POOL slot {slot}: write to mooncake failed")
        self._written[slot] = True

    def _fetch_private(self, slot: int, block: torch.Tensor, verb: str) -> None:
        if not self._written[slot]:
            raise TierIOError(f"POOL slot {slot}: holds no block (never written here)")
        outcome = self._client.batch_get_outcomes([self._private_key(slot)], [block])[0]
        if outcome is not Outcome.HIT:
            self._written[slot] = False
            raise TierIOError(f"POOL slot {slot}: {verb} failed: mooncake answered {outcome.value}")

    def _private_key(self, slot: int) -> bytes:
        return xxhash.xxh3_128_digest(self._instance + slot.to_bytes(8, "little"))

    def _check_open(self) -> None:
        if self._closed:
            raise TierIOError("POOL tier is closed")


def build_mooncake_tier(cfg, slot_bytes: int) -> MooncakeTier:
    """The tier a POOL `TierConfig` with `backend: mooncake` describes (`shared` and
    `negative_cache_s` as for kvtier's own pool); this process lends the store as much memory as
    its share of the tier (plus trailers). The runtime gives the tier its `Stats`.

    Raises:
        TransferError: the master or metadata server is unreachable, or `setup()` failed.
        CapacityError: capacity below one slot.
    """
    num_slots = slots_needed(cfg.capacity_bytes, slot_bytes, "pool")
    segment_bytes = -(-num_slots * stored_bytes(slot_bytes) // (4 << 20)) * (4 << 20)  # setup() wants whole 4 MiB
    client = MooncakeClient(cfg.nodes[0], cfg.metadata_server, segment_bytes=max(16 << 20, segment_bytes),
                            staging_bytes=max(16 << 20, 4 * stored_bytes(slot_bytes)), tenant=cfg.tenant,
                            setup_timeout_s=cfg.timeout_s)
    try:
        return MooncakeTier(client, cfg.capacity_bytes, slot_bytes, owns_client=True, shared=cfg.shared,
                            negative_cache_s=cfg.negative_cache_s)
    except BaseException:
        client.close()
        raise
