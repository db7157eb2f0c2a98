"""The engine's names for the blocks it writes to the pool: the worker ANNOUNCEs vLLM's hashes.

A pool node publishes a tenant's `BlockStored` / `BlockRemoved` (medium SHARED, locality REMOTE)
only for blocks a writing client named with the engine's block hashes (`kvtier.pool.node.events`);
a block never named publishes nothing. This is where an engine names what it writes:

  * scheduler: each store of KV cache group 0 carries vLLM's name of its blocks (`StoreSpec.names`:
    hash, parent, tokens, block size, from the `BlockHashes` that the connector's own events use,
    so tokens are empty where the request had LoRA, multimodal items or a cache salt);
  * worker: `PoolNames.name` keeps them by this rank's pool key (bounded) when the step's metadata
    is bound, before any of the step's stores is sent;
  * pool tier: as a put of shared blocks completes (`SharedTier.listen_puts`: a write-through store
    or a demotion into the pool, whichever wrote the block), the named ones are queued (an append
    under a lock, on the transfer thread);
  * a thread of its own sends the queue in batches (`PoolTier.announce`: one ANNOUNCE per node),
    off the forward path: the round trip never costs the engine a step.

Why not the residency log (`WorkerResidency`): it is drained only as the engine steps, so the
last blocks of a burst would stay unnamed until the next request; and its STORED entries do not
say whether this engine wrote the block or adopted it from another engine.

Once per copy: a block is named when a put of it from here completes. A block another engine
wrote and this one adopted (found in the pool) is never put from here, so never named here; a
block found held is not put again (deduplicated), so not named again; a block both engines put
at once is named by both, and the node keeps the first name and counts the other as ignored.
A block put again after the node lost it is named again (the node dropped the old name with it).

Tensor parallelism: only rank 0, shard 0's writer, names blocks, under its own pool keys. The node
then publishes a block stored when shard 0's slice is on it and removed when that slice leaves; a
router may count a block whose other slices were evicted (that rank's load then misses, and vLLM
recomputes: never wrong KV). A join of every shard's slice at the node is not done.

Bounded, never blocking and never raising into vLLM: `max_names` names kept (the least recently
named forgotten first), `max_pending` blocks queued (past it, dropped), every outcome counted in
`AnnounceCounts` (served with the rank's metrics) and the first failure logged.
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.integrations.vllm.events import BoundedMap, ExternalHash
from kvtier.integrations.vllm.scheduler import StoreSpec
from kvtier.integrations.vllm.settings import Settings
from kvtier.integrations.vllm.shards import Sharding
from kvtier.kinds import PoolBackend, TierKind
from kvtier.pool.client.tier import PoolTier

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AnnounceSettings:
    """Bounds of a worker's pool announcements (counts of blocks).

    Attributes:
        max_names: names kept for blocks not put yet or put before (oldest named forgotten first).
        max_pending: blocks put and waiting to be announced; past it, dropped.
        max_batch: blocks per announcement round (one ANNOUNCE per node, cut by the client).
    """

    max_names: int = 1 << 14
    max_pending: int = 1 << 14
    max_batch: int = 4096


@dataclass
class AnnounceCounts:
    """What became of the blocks this worker's pool tier put (all counts of blocks)."""

    announced: int = 0  # named on their node: it publishes their events
    ignored: int = 0  # the node had them named already, or no longer held them
    failed: int = 0  # the node was not reached, predates events, or the call failed
    unnamed: int = 0  # put with no name known here (another KV cache group, forgotten, KV events off)
    dropped: int = 0  # the queue was full


@dataclass(frozen=True, slots=True)
class _Name:
    hash: ExternalHash
    parent: ExternalHash | None
    tokens: array  # of int64: 8 bytes a token where a tuple of ints costs up to 36
    block_size: int


class PoolNames:
    """Names the blocks `tier` puts, on a thread of its own (see the module docstring).

    Args:
        tier: this rank's pool tier; its puts are listened to until `close`.
        sharding: this rank's slice (its pool keys for the engine's keys).
        settings: bounds.
    """

    def __init__(self, tier: PoolTier, sharding: Sharding, settings: AnnounceSettings = AnnounceSettings()) -> None:
        self._tier, self._sharding, self.settings = tier, sharding, settings
        self.counts = AnnounceCounts()
        self._names = BoundedMap(settings.max_names)
        self._pending: dict[bytes, _Name] = {}  # in put order; a key queued twice is announced once
        self._ready = threading.Condition()
        self._closed = False
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="kvtier-pool-names", daemon=True)
        self._thread.start()
        tier.listen_puts(self._on_put)

    def name(self, specs: Sequence[StoreSpec]) -> None:
        """Keeps the names the scheduler sent with this step's stores, by this rank's pool key."""
        named = [(key, block) for spec in specs if spec.names
                 for key, block in zip(self._sharding.keys(spec.keys), spec.names) if block is not None]
        if not named:
            return
        with self._ready:
            for key, block in named:
                self._names.put(bytes(key), _Name(block.hash, block.parent, array("q", block.token_ids),
                                                  block.block_size))

    def close(self, timeout_s: float) -> None:
        """Stops listening, announces what is queued (within `timeout_s`), stops the thread. Idempotent."""
        self._tier.listen_puts(None)
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join(timeout_s)

    # ---- the tier's thread ----------------------------------------------------------------

    def _on_put(self, keys: list[bytes]) -> None:
        """The tier's put listener: queues the named keys. Quick, and never raises."""
        with self._ready:
            if self._closed:
                return
            counts, pending = self.counts, self._pending
            for key in keys:
                found = self._names.get(key)
                if found is None:
                    counts.unnamed += 1
                elif len(pending) >= self.settings.max_pending and key not in pending:
                    counts.dropped += 1
                else:
                    pending[key] = found
            if pending:
                self._ready.notify()

    # ---- the announcing thread ------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._pending or self._closed)
                if not self._pending:
                    return
                batch = list(self._pending.items())[: self.settings.max_batch]
                for key, _ in batch:
                    del self._pending[key]
            self._send(batch)

    def _send(self, batch: list[tuple[bytes, _Name]]) -> None:
        by_size: dict[int, list[tuple[bytes, _Name]]] = {}
        for key, found in batch:
            by_size.setdefault(found.block_size, []).append((key, found))
        for size, items in by_size.items():
            try:
                got = self._tier.announce([k for k, _ in items], [n.hash for _, n in items], block_size=size,
                                          parents=[n.parent for _, n in items], tokens=[n.tokens for _, n in items])
            except Exception as e:  # a name is never worth failing the engine: counted, logged once
                got = {"announced": 0, "ignored": 0, "failed": len(items)}
                self._warn(f"{len(items)} blocks: {e!r}")
            if got["failed"]:
                self._warn(f"{got['failed']} blocks: their pool node was not reached or predates events")
            with self._ready:
                for outcome in ("announced", "ignored", "failed"):
                    setattr(self.counts, outcome, getattr(self.counts, outcome) + got[outcome])

    def _warn(self, what: str) -> None:
        level = logging.DEBUG if self._warned else logging.WARNING
        self._warned = True
        log.log(level, "kvtier could not name pool blocks with vLLM's hashes (the node publishes no events for "
                       "them; counted as failed): %s", what)


def names_pool_blocks(settings: Settings) -> bool:
    """Whether this engine names the blocks it writes to the pool: KV events on and a kvtier pool
    tier that keeps blocks under their keys (the scheduler then sends the names with the stores)."""
    pool = next((t for t in settings.config.tiers if t.kind is TierKind.POOL), None)
    return settings.kv_events and pool is not None and pool.shared and pool.backend is PoolBackend.KVTIER


def pool_names(settings: Settings, backend: Any) -> PoolNames | None:
    """This worker rank's `PoolNames`, where it names pool blocks: `names_pool_blocks`, rank 0
    (shard 0's writer), and a pool tier that sends its shared blocks itself."""
    if not names_pool_blocks(settings) or settings.sharding.rank != 0:
        return None
    tier = getattr(backend, "tiers", {}).get(TierKind.POOL)
    if not isinstance(tier, PoolTier) or not tier.shared or not tier.writes_shared:
        return None
    return PoolNames(tier, settings.sharding)
