"""kvtier's KV events through vLLM's connector events API: a `BlockStored` or `BlockRemoved` per
block that becomes loadable in, or leaves, kvtier's DRAM, SSD or pool tier.

vLLM publishes its own GPU blocks' events (`--kv-events-config`); a router that tracks them (llm-d,
Dynamo) learns from these which prefixes an engine can also load from kvtier, per tier, under
vLLM's own block hashes, so it matches them to the GPU events it already holds.

The flow, one engine step (docs/design-kv-events-and-hints.md, section 4):
  * worker rank r: its `KVTier` logs every READY copy that appears or leaves below HBM
    (`kvtier.deciding.residency`); `WorkerResidency.take` drains it, turns this rank's keys back
    into the engine's (group) keys, and the connector sends them in `KVTierWorkerMetadata`;
  * scheduler: `KVEvents.add` joins the ranks (`ResidencyJoin`: a block is stored in a tier when
    every rank holds its slice there, removed as soon as one rank lost it), looks up each key's
    vLLM block hash (`BlockHashes`, filled as the scheduler keys each request), and queues it;
  * `KVEvents.take` (the connector's `take_events`) builds vLLM's events, coalescing runs of
    chained blocks into one event, at most `max_per_step` blocks per step.

Bounded everywhere, never blocking: the worker's log holds `max_per_step_per_rank` entries
between steps, the scheduler's queue `max_per_step` blocks (removals up to twice as many); what
does not fit is dropped (stores first: a router told too little only misses a hit) and counted
in `EventCounts`, which the metrics endpoint serves (`kvtier_kv_events_dropped_total`).

Why not vLLM's worker-side `get_kv_connector_kv_cache_events`: its aggregator keeps only events
that every rank emitted in the same step, and kvtier's ranks finish demotions on their own
threads, in different steps; the join here is kept across steps, per block.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.deciding.residency import REMOVED, STORED, ResidencyBatch, ResidencyOp
from kvtier.kinds import TierKind

ExternalHash = int | bytes  # vLLM's `ExternalBlockHash`


@dataclass(frozen=True, slots=True)
class Medium:
    """How a kvtier tier is named in vLLM's events: `medium`, `locality`, `ownership`."""

    medium: str
    locality: str = "LOCAL"
    ownership: str = "kvtier"


# vLLM names CPU and STORAGE (`kv_events.MEDIUM_CPU`, `MEDIUM_STORAGE`); it has no name for a
# pool shared across hosts. "SHARED" is the nearest one both llm-d and Dynamo parse (an unknown
# medium counts as GPU to both), with vLLM's own `locality` saying it is remote.
MEDIA = {TierKind.DRAM: Medium("CPU"), TierKind.SSD: Medium("STORAGE"),
         TierKind.POOL: Medium("SHARED", "REMOTE", "kvtier-pool")}


@dataclass(frozen=True, slots=True)
class EventSettings:
    """Bounds of kvtier's KV events (all counts of blocks).

    Attributes:
        max_per_step: blocks handed to vLLM per step; the rest wait, up to as many again.
        max_per_step_per_rank: entries a worker's residency log holds between two steps.
        max_mapped_keys: kvtier keys whose vLLM hash the scheduler remembers (oldest forgotten).
        max_joined_keys: (block, tier) pairs the join across ranks remembers (oldest forgotten).
    """

    max_per_step: int = 4096
    max_per_step_per_rank: int = 8192
    max_mapped_keys: int = 1 << 20
    max_joined_keys: int = 1 << 20


@dataclass(frozen=True, slots=True)
class ExtBlock:
    """What vLLM's events say of one block besides where it is: its hash (as vLLM publishes it),
    its parent's, its tokens (empty where its hash covers more than tokens: LoRA, multimodal,
    cache salt), tokens per block, KV cache group and LoRA adapter."""

    hash: ExternalHash
    parent: ExternalHash | None
    token_ids: tuple[int, ...]
    block_size: int
    group_idx: int = 0
    lora_name: str | None = None
    lora_id: int | None = None


@dataclass
class EventCounts:
    """Counters of the scheduler's events, by (tier name, op name): blocks published, and blocks
    dropped where (`worker`: a rank's log was full; `queue`: the scheduler's queue was full;
    `unmapped`: no vLLM hash known for the key, or a tier vLLM's events have no name for), and
    (block, tier) pairs the join across ranks forgot for its bound."""

    published: dict[tuple[str, str], int] = field(default_factory=dict)
    dropped: dict[tuple[str, str, str], int] = field(default_factory=dict)
    num_join_forgotten: int = 0

    def drop(self, tier: TierKind, op: ResidencyOp, where: str, n: int = 1) -> None:
        key = (tier.name.lower(), op.name.lower(), where)
        self.dropped[key] = self.dropped.get(key, 0) + n

    def publish(self, tier: TierKind, op: ResidencyOp, n: int) -> None:
        key = (tier.name.lower(), op.name.lower())
        self.published[key] = self.published.get(key, 0) + n


class BoundedMap:
    """A dict of at most `max_keys` entries; a `put` refreshes its key, the oldest goes first."""

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max(1, max_keys)
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()

    def put(self, key: Hashable, value: Any) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        if len(self._entries) > self.max_keys:
            self._entries.popitem(last=False)

    def get(self, key: Hashable) -> Any:
        return self._entries.get(key)

    def __len__(self) -> int:
        return len(self._entries)


class BlockHashes:
    """The scheduler's map from kvtier (group) keys to vLLM's hash of the same block (`ExtBlock`).

    Filled as the scheduler keys each request (`record`, from `RequestTracker.keys_for`): vLLM's
    `request.block_hashes` is on the same request, one per `hash_block_size` tokens, viewed at the
    block size as vLLM's GPU events view them (`resolve_block_hashes`) and published in the form
    they publish (`maybe_convert_block_hash`: the low 64 bits as an int, or the bytes, following
    `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`).

    Args:
        group_keys: `Settings.group_keys`: a KV cache group's keys for engine-level keys.
        group_indices: the engine's KV cache groups.
        block_size: tokens per engine (and kvtier) block.
        hash_block_size: tokens per vLLM block hash (`KVCacheConfig.hash_block_size`).
        max_keys: keys remembered, the least recently keyed forgotten first.
    """

    def __init__(self, group_keys: Callable[[int, Sequence[Hashable]], Sequence[Hashable]],
                 group_indices: Sequence[int], block_size: int, hash_block_size: int, max_keys: int) -> None:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash, resolve_block_hashes

        self._group_keys, self._groups = group_keys, tuple(group_indices)
        self.block_size, self.hash_block_size = block_size, hash_block_size
        self._map = BoundedMap(max_keys)
        self._resolve, self._external = resolve_block_hashes, maybe_convert_block_hash

    def record(self, request: Any, first: int, keys: Sequence[Hashable], plain: bool = True) -> int:
        """Maps `keys`, the request's engine-level keys of blocks `first ..`, to vLLM's hashes;
        returns how many (those vLLM has hashed yet). `plain`: the blocks' hashes cover their
        tokens alone (else their tokens are not published)."""
        hashes = self._resolve(request.block_hashes, self.hash_block_size, self.block_size)
        n = min(len(keys), len(hashes) - first)
        if n <= 0:
            return 0
        size, tokens = self.block_size, request.all_token_ids
        lora = getattr(request, "lora_request", None)
        external = self._external
        parent = external(hashes[first - 1]) if first > 0 else None
        blocks = []
        for i in range(first, first + n):
            own = external(hashes[i])
            blocks.append(ExtBlock(own, parent, tuple(tokens[i * size:(i + 1) * size]) if plain else (), size, 0,
                                   lora.name if lora else None, lora.adapter_id if lora else None))
            parent = own
        for group in self._groups:
            for key, block in zip(self._group_keys(group, keys[:n]), blocks):
                self._map.put(key, block if group == 0 else _in_group(block, group))
        return n

    def put(self, key: Hashable, block: ExtBlock) -> None:
        """Maps one key (what `record` does per key and group)."""
        self._map.put(key, block)

    def get(self, key: Hashable) -> ExtBlock | None:
        return self._map.get(key)

    def __len__(self) -> int:
        return len(self._map)


def _in_group(block: ExtBlock, group: int) -> ExtBlock:
    return ExtBlock(block.hash, block.parent, block.token_ids, block.block_size, group, block.lora_name,
                    block.lora_id)


class ResidencyJoin:
    """Joins the ranks' residency: a block is in a tier when every rank holds its slice there.

    Per (key, tier), a mask of the ranks holding it. A STORED from rank r sets bit r, and is
    passed on when the mask becomes full; a REMOVED from rank r is passed on if the mask was full
    (the block stops being loadable as soon as one rank lacks its slice, as `KeyDirectory` counts
    hits), then clears bit r. With one rank every entry passes through. At most `max_keys` pairs
    are remembered; the oldest is forgotten first, counted in `num_forgotten` (its later removal,
    if it was full, then goes unpublished).
    """

    def __init__(self, num_ranks: int, max_keys: int) -> None:
        self.num_ranks, self._full = num_ranks, (1 << num_ranks) - 1
        self._masks: OrderedDict[tuple[Hashable, int], int] = OrderedDict()
        self.max_keys = max(1, max_keys)
        self.num_forgotten = 0

    def apply(self, rank: int, entries: Iterable[tuple[int, int, Hashable]]) -> list[tuple[int, int, Hashable]]:
        """Rank `rank`'s entries (op, tier, key), in its order; returns the joined ones."""
        if self.num_ranks == 1:
            return list(entries)
        out, masks, bit = [], self._masks, 1 << rank
        for op, tier, key in entries:
            was = masks.get((key, tier), 0)
            if op == STORED:
                now = was | bit
                if now == self._full and was != now:
                    out.append((op, tier, key))
            else:
                now = was & ~bit
                if was == self._full and now != was:
                    out.append((op, tier, key))
            if now:
                masks[key, tier] = now
            elif was:
                del masks[key, tier]
        while len(masks) > self.max_keys:
            masks.popitem(last=False)
            self.num_forgotten += 1
        return out


class KVEvents:
    """The scheduler's side of kvtier's KV events: joined, mapped to vLLM's hashes, bounded.

    Args:
        settings: bounds.
        num_ranks: worker ranks (tensor_parallel_size).
        hashes: kvtier key -> vLLM hash (`BlockHashes`).
        counts: where the counters go (the metrics endpoint reads them).
        media: tier -> how vLLM's events name it.
    """

    def __init__(self, settings: EventSettings, num_ranks: int, hashes: BlockHashes,
                 counts: EventCounts | None = None, media: dict[TierKind, Medium] = MEDIA) -> None:
        self.settings, self.hashes, self.media = settings, hashes, media
        self.counts = counts or EventCounts()
        self._join = ResidencyJoin(num_ranks, settings.max_joined_keys)
        self._queue: deque[tuple[ResidencyOp, TierKind, ExtBlock]] = deque()

    def add(self, rank: int, entries: Iterable[tuple[int, int, Hashable]],
            dropped: dict[tuple[int, int], int] | None = None) -> None:
        """One rank's residency entries of a step, and what its log dropped."""
        for (tier, op), n in (dropped or {}).items():
            self.counts.drop(TierKind(tier), ResidencyOp(op), "worker", n)
        limit, queue = self.settings.max_per_step, self._queue
        for op, tier, key in self._join.apply(rank, entries):
            op, tier = ResidencyOp(op), TierKind(tier)
            block = self.hashes.get(key)
            if block is None or tier not in self.media:
                self.counts.drop(tier, op, "unmapped")
            elif len(queue) >= limit and (op is STORED or len(queue) >= 2 * limit):
                self.counts.drop(tier, op, "queue")
            else:
                queue.append((op, tier, block))
        self.counts.num_join_forgotten = self._join.num_forgotten

    def take(self) -> list[Any]:
        """vLLM's `BlockStored` / `BlockRemoved` for up to `max_per_step` queued blocks, in order;
        runs of one tier, op and group whose blocks chain are one event."""
        queue, records = self._queue, []
        for _ in range(min(len(queue), self.settings.max_per_step)):
            records.append(queue.popleft())
        return [self._event(run) for run in _runs(records)]

    def __len__(self) -> int:
        return len(self._queue)

    def _event(self, run: list[tuple[ResidencyOp, TierKind, ExtBlock]]) -> Any:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        op, tier, first = run[0]
        medium = self.media[tier]
        self.counts.publish(tier, op, len(run))
        hashes = [block.hash for _, _, block in run]
        if op is REMOVED:
            return BlockRemoved(block_hashes=hashes, medium=medium.medium, group_idx=first.group_idx,
                                locality=medium.locality, ownership=medium.ownership)
        tokens = [t for _, _, block in run for t in block.token_ids]
        return BlockStored(block_hashes=hashes, parent_block_hash=first.parent, token_ids=tokens,
                           block_size=first.block_size, lora_id=first.lora_id, medium=medium.medium,
                           lora_name=first.lora_name, group_idx=first.group_idx, locality=medium.locality,
                           ownership=medium.ownership)


def _runs(records: list[tuple[ResidencyOp, TierKind, ExtBlock]]) -> list[list]:
    """Consecutive records of one op, tier, group and adapter, each stored block the child of the
    one before (removals need not chain), with tokens all published or none."""
    runs: list[list] = []
    for record in records:
        op, tier, block = record
        if runs:
            last_op, last_tier, last = runs[-1][-1]
            if (op is last_op and tier is last_tier and block.group_idx == last.group_idx
                    and block.lora_name == last.lora_name
                    and (op is REMOVED or (block.parent == last.hash
                                           and bool(block.token_ids) == bool(last.token_ids)))):
                runs[-1].append(record)
                continue
        runs.append([record])
    return runs


class WorkerResidency:
    """A worker's side: its backend's residency log, drained once per step, in the engine's keys.

    Under tensor parallelism a rank's backend holds its slice of each block under a key of its
    own (`Sharding.keys`); `note` records which engine (group) key each was made from, as the
    worker sends stores and loads, in a map of at most `max_keys`. A key of which nothing is
    noted (adopted from a pool another engine filled) is passed as it is and left unmapped.

    Args:
        backend: the rank's `KVTier` (`log_residency`, `take_residency`).
        limit: entries its log holds between two steps.
        sharded: whether this rank's keys differ from the engine's (`Sharding.num_shards > 1`).
        max_keys: rank keys remembered.
    """

    def __init__(self, backend: Any, limit: int, sharded: bool, max_keys: int) -> None:
        self.backend, self.sharded = backend, sharded
        self._engine_keys = BoundedMap(max_keys) if sharded else None
        backend.log_residency(limit)

    def note(self, engine_keys: Sequence[Hashable], rank_keys: Sequence[Hashable]) -> None:
        """Records that `rank_keys[i]` is this rank's key for `engine_keys[i]`."""
        if self._engine_keys is not None:
            for engine_key, rank_key in zip(engine_keys, rank_keys):
                self._engine_keys.put(rank_key, engine_key)

    def take(self) -> tuple[list[tuple[int, int, Hashable]], dict[tuple[int, int], int]]:
        """The entries (op, tier, engine key) logged since the last call, and the drops by (tier, op)."""
        batch: ResidencyBatch = self.backend.take_residency()
        dropped = {(int(tier), int(op)): n for (tier, op), n in batch.dropped.items()}
        if self._engine_keys is None:
            return [(int(op), int(tier), key) for op, tier, key in batch.entries], dropped
        get = self._engine_keys.get
        return [(int(op), int(tier), get(key) or key) for op, tier, key in batch.entries], dropped

    def close(self) -> None:
        self.backend.log_residency(None)
