"""`MooncakeTier`: Mooncake Store as the manager's pool tier, shared by key like `PoolTier`.

`SharedTier` holds the keyed-store skeleton; this class fills in Mooncake's batched calls
(`batch_put_from`, `batch_get_into`, `batch_is_exist`: one each per batch).

The manager addresses slots; the transfer engine tells this tier which block each slot holds
(`bind`). A block whose key is a `BlockKey` (16 bytes naming model, weights, KV format, block size
and tenant) is stored under that key, where every process of the tenant using the same master finds
it (`find`, which `KVTier.lookup` asks for the keys it does not index):

    write   the block's bytes, gathered until the whole block is in (spans of a store come layer
            range by layer range), then one put of the batch's whole blocks, each with its key-seeded
            trailer. The put is
            `batch_put_from` (`MooncakeClient.put(replace=False)`), which keeps an object already
            under the key: the key names the content, so the object there holds these very bytes,
            and another process may be reading it right now; an upsert would replace it under
            that reader for nothing. A block this tier saw in the store already (found, or put
            before) is asked for instead (`batch_is_exist`) and not sent again: deduplicated.
    read    one get of the batch's whole blocks, each checked against its trailer (a block the store dropped, one
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

import torch

from kvtier.errors import TierIOError, TransferError
from kvtier.pool.mooncake.client import MooncakeClient, Outcome, stored_bytes
from kvtier.observing.stats import Stats
from kvtier.tiers.base import LayerSums, copy_bytes, slots_needed
from kvtier.tiers.shared import NEGATIVE_CACHE_S, STORED, Put, PutResult, SharedTier

log = logging.getLogger(__name__)


class MooncakeTier(SharedTier):
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

    def __init__(self, client: MooncakeClient, capacity_bytes: int, slot_bytes: int, *, owns_client: bool = False,
                 shared: bool = True, negative_cache_s: float = NEGATIVE_CACHE_S, stats: Stats | None = None) -> None:
        super().__init__(capacity_bytes, slot_bytes, shared=shared, negative_cache_s=negative_cache_s, stats=stats)
        self._client, self._owns_client = client, owns_client
        self._written = [False] * self.num_slots  # private blocks stored

    def describe(self) -> dict[str, object]:
        sharing = "by key, every process of the tenant on this master" if self.shared else "per process"
        return {**super().describe(), **self._client.describe(), "sharing": sharing}

    # ---- the keyed store (`SharedTier`) ------------------------------------------------------

    def _put(self, keys: list[bytes], blocks: list[torch.Tensor]) -> list[PutResult]:
        """One `batch_put_from` (`replace=False`: an object the key names already is kept, see the
        module docstring) for the batch."""
        try:
            stored = self._client.batch_put(keys, blocks, replace=False)
        except TransferError as e:
            return [PutResult(Put.REFUSED, str(e))] * len(keys)
        return [STORED if ok else PutResult(Put.REFUSED, "no room, or the master is unreachable") for ok in stored]

    def _get(self, keys: list[bytes], intos: list[torch.Tensor], sums: list[LayerSums | None]) -> list[str | None]:
        """One batch get; the client checks every block (its check is not split from the read)."""
        try:
            outcomes = self._client.batch_get_outcomes(keys, intos)
        except TransferError as e:
            log.debug("mooncake: get of %d keys: %s", len(keys), e)
            outcomes = [Outcome.FAILED] * len(keys)
        return [None if o is Outcome.HIT else f"mooncake answered {o.value} (dropped, its segment's process gone, "
                "failed its check, or the master unreachable)" for o in outcomes]

    def _contains(self, keys: list[bytes]) -> list[bool]:
        """`client.contains`, a closed client or failed call answering absent (logged)."""
        try:
            return self._client.contains(keys)
        except TransferError as e:
            log.warning("mooncake: existence check of %d keys failed, counted absent: %s", len(keys), e)
            return [False] * len(keys)

    # ---- private blocks ----------------------------------------------------------------------

    def _write_private(self, slots: list[int], offset: int, srcs: list[torch.Tensor]) -> dict[int, Exception]:
        """Whole blocks upserted as they are; a part of a block read, patched and upserted; one
        upsert for the batch."""
        failed: dict[int, Exception] = {}
        if offset == 0 and srcs[0].numel() == self.slot_bytes:
            blocks = dict(enumerate(srcs))
        else:
            blocks = {j: torch.zeros(self.slot_bytes, dtype=torch.uint8) for j in range(len(slots))}
            written = [j for j, slot in enumerate(slots) if self._written[slot]]
            if written:
                got = self._fetch_private([slots[j] for j in written], [blocks[j] for j in written], "write")
                failed = {written[m]: e for m, e in got.items()}
            for j, src in enumerate(srcs):
                blocks[j][offset: offset + src.numel()] = src
        todo = [j for j in blocks if j not in failed]
        try:
            stored = self._client.batch_put([self._private_key(slots[j]) for j in todo], [blocks[j] for j in todo])
        except TransferError as e:
            log.debug("mooncake: private put: %s", e)
            stored = [False] * len(todo)
        for j, ok in zip(todo, stored):
            self._written[slots[j]] = ok
            if not ok:
                failed[j] = TierIOError(f"POOL slot {slots[j]}: write to mooncake failed")
        return failed

    def _read_private(self, slots: list[int], offset: int, dsts: list[torch.Tensor]) -> dict[int, Exception]:
        whole = offset == 0 and dsts[0].numel() == self.slot_bytes
        blocks = dsts if whole else list(torch.empty((len(slots), self.slot_bytes), dtype=torch.uint8))
        failed = self._fetch_private(slots, blocks, "read")
        if not whole:
            for j, dst in enumerate(dsts):
                if j not in failed:
                    copy_bytes(dst, blocks[j][offset: offset + dst.numel()])
        return failed

    def _fetch_private(self, slots: list[int], blocks: list[torch.Tensor], verb: str) -> dict[int, Exception]:
        """Private blocks whole into `blocks`, one get for the batch; the failures by index."""
        failed: dict[int, Exception] = {j: TierIOError(f"POOL slot {slot}: holds no block (never written here)")
                                        for j, slot in enumerate(slots) if not self._written[slot]}
        todo = [j for j in range(len(slots)) if j not in failed]
        if not todo:
            return failed
        outcomes = self._client.batch_get_outcomes([self._private_key(slots[j]) for j in todo],
                                                   [blocks[j] for j in todo])
        for j, outcome in zip(todo, outcomes):
            if outcome is not Outcome.HIT:
                self._written[slots[j]] = False
                failed[j] = TierIOError(f"POOL slot {slots[j]}: {verb} failed: mooncake answered {outcome.value}")
        return failed

    def _close_store(self) -> None:
        """Drops this tier's private blocks (best effort) and closes the client if owned."""
        with self._lock:
            private = [self._private_key(s) for s, w in enumerate(self._written) if w]
        try:
            if private:
                self._client.delete(private)
        except TransferError as e:
            log.debug("mooncake tier close: %s", e)
        finally:
            if self._owns_client:
                self._client.close()


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
