"""The scheduler side of the vLLM connector: which blocks to load and store, as plain data.

It decides (see STYLE.md): per request it keeps the chain of engine-level block keys and a cursor
of blocks known to be in kvtier, answers "how many tokens can kvtier supply" (from every worker
rank: `KeyDirectory`), and turns each scheduler step into `LoadSpec`s and `StoreSpec`s for the
workers, which every rank receives alike and applies to its own slice of each block. Its only
I/O is that lookup (`vllm_lookup`). Nothing here imports
vLLM; the connector passes in what it reads from vLLM's objects.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.integrations.vllm.lookup import RankLookup
from kvtier.integrations.vllm.backends import SHARED, Backend
from kvtier.integrations.vllm.settings import Settings
from kvtier.keys import ROOT_KEY, BlockKey, Namespace, block_keys

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load `keys` into engine blocks `block_ids` (one each), for request `req_id`."""

    req_id: str
    keys: tuple[BlockKey, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """Store engine blocks `block_ids` under `keys`, once their KV is computed in this step.

    `prefix_block_ids` are the request's engine blocks up to the last one stored: if a load into
    any of them fails in this step, the KV computed on top of it is wrong and the store is dropped.
    """

    req_id: str
    keys: tuple[BlockKey, ...]
    block_ids: tuple[int, ...]
    prefix_block_ids: tuple[int, ...]


@dataclass
class StepPlan:
    """What the worker does in one engine step."""

    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request of a scheduler step: tokens scheduled in it, of which speculative."""

    req_id: str
    num_scheduled_tokens: int
    num_spec_tokens: int = 0


class KeyDirectory:
    """Answers `lookup` on the scheduler side: how many leading blocks EVERY worker rank holds.

    Each rank holds its own slice of every block (`Sharding`), so a block is a hit only when every
    rank's slice is there; the answer is the minimum over the ranks, never partial KV. A rank is
    asked where it can be reached, in this order:
      * its backend in this process (`SharedBackends`): exact; the single-process engine;
      * its worker process over that rank's lookup socket (`LookupServer`): exact; every
        multi-process engine, tensor-parallel ones included, and a fresh process hits what an
        earlier one left on a persistent SSD tier or the pool;
      * failing that (a rank on another host), the keys that rank reported stored (bounded, oldest
        dropped first), which can be stale: a block evicted since is a failed load, which the
        worker reports and vLLM recomputes.
    A backend that fails holds nothing; a rank that does not answer within `lookup_timeout_s` is
    taken at its reports.

    Either way a block whose store is planned but not yet reported by every rank (its bytes still
    on their way: kvtier hides a block until it has landed) counts as held. Without that, a request
    arriving just after the one that computed its prefix (the next turn of a conversation) would
    miss blocks that land a few milliseconds later; the worker waits for such a store before
    loading the block, and a store that fails is reported and its load recomputed.
    """

    def __init__(self, settings: Settings, max_keys: int) -> None:
        self._settings = settings
        self._num_ranks = settings.sharding.num_ranks
        self._max_keys = max(1, max_keys)
        self._reported: OrderedDict[BlockKey, set[int]] = OrderedDict()  # key -> ranks that stored it
        self._pending: OrderedDict[BlockKey, set[int]] = OrderedDict()  # planned stores -> ranks yet to report
        self._remote = [RankLookup(settings.lookup_socket(r), settings.lookup_timeout_s)
                        for r in range(self._num_ranks)]

    def backend(self, rank: int = 0) -> Backend | None:
        """Rank `rank`'s backend, where it lives in this process."""
        return SHARED.get(self._settings.backend_id(rank))

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """Leading keys every rank holds or is storing; 0 when a backend fails (a miss, never an error)."""
        n = 0
        while n < len(keys):
            n += self._lookup_stored(keys[n:])
            if n == len(keys) or keys[n] not in self._pending:
                return n
            n += 1
        return n

    def expect(self, keys: Iterable[BlockKey]) -> None:
        """Notes stores just planned; they count as held until every rank reports them."""
        for key in keys:
            self._pending[key] = set(range(self._num_ranks))
        while len(self._pending) > self._max_keys:
            self._pending.popitem(last=False)

    def report(self, stored: Iterable[BlockKey], missing: Iterable[BlockKey], rank: int = 0) -> None:
        """Keys rank `rank` stored, and keys it failed to load or to store."""
        for key in stored:
            waiting = self._pending.get(key)
            if waiting is not None:
                waiting.discard(rank)
                if not waiting:
                    del self._pending[key]
            self._reported.setdefault(key, set()).add(rank)
            self._reported.move_to_end(key)
        for key in missing:
            self._pending.pop(key, None)
            self._reported.get(key, set()).discard(rank)
        while len(self._reported) > self._max_keys:
            self._reported.popitem(last=False)

    def close(self) -> None:
        for remote in self._remote:
            remote.close()

    def _lookup_stored(self, keys: Sequence[BlockKey]) -> int:
        n = len(keys)
        for rank in range(self._num_ranks):
            n = min(n, self._lookup_rank(rank, keys[:n]))
            if n == 0:
                break
        return n

    def _lookup_rank(self, rank: int, keys: Sequence[BlockKey]) -> int:
        backend = self.backend(rank)
        if backend is not None:
            try:
                return backend.loadable(self._settings.sharding.for_rank(rank).keys(keys))
            except Exception as e:  # a broken or unreachable backend is a miss; vLLM computes instead
                log.warning("kvtier lookup failed, treating %d blocks as misses: %r", len(keys), e)
                return 0
        n = self._remote[rank].lookup(keys)
        if n is not None:
            return n
        return next((i for i, k in enumerate(keys) if rank not in self._reported.get(k, ())), len(keys))


class RequestTracker:
    """One request's block keys and how many of its leading blocks kvtier holds."""

    def __init__(self, request: Any, namespace: Namespace) -> None:
        self.request = request  # vLLM's Request: `request_id`, `all_token_ids`, `num_tokens`, `num_computed_tokens`
        self._namespace = namespace
        self.keys: list[BlockKey] = []
        self.num_local_tokens = 0  # vLLM's own (block-aligned) prefix-cache hit, at the last lookup
        self.num_hit_blocks = 0  # leading blocks kvtier held at the last lookup
        self.num_stored_blocks = 0  # leading blocks kvtier holds or is being sent

    def keys_for(self, num_blocks: int) -> list[BlockKey]:
        """The first `num_blocks` keys, extending the chain as tokens arrive."""
        if num_blocks > len(self.keys):
            size = self._namespace.block_tokens
            tokens = self.request.all_token_ids[len(self.keys) * size: num_blocks * size]
            parent = self.keys[-1] if self.keys else ROOT_KEY
            self.keys += block_keys(self._namespace, list(tokens), parent)
        return self.keys[:num_blocks]


@dataclass
class PromptBlocks:
    """Where the full blocks of each scheduled prompt came from (counted when vLLM allocates them)."""

    engine: int = 0  # vLLM's own prefix cache
    kvtier: int = 0  # loaded from kvtier
    computed: int = 0  # in neither: prefilled


class SchedulerSide:
    """The scheduler-side state of one engine's connector."""

    def __init__(self, settings: Settings, directory: KeyDirectory) -> None:
        self.settings = settings
        self.directory = directory
        self.prompt_blocks = PromptBlocks()
        self._trackers: dict[str, RequestTracker] = {}
        self._loads: dict[str, LoadSpec] = {}

    def track(self, request: Any) -> RequestTracker:
        tracker = self._trackers.get(request.request_id)
        if tracker is None:
            tracker = self._trackers[request.request_id] = RequestTracker(request, self.settings.namespace)
        return tracker

    def num_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond `num_computed_tokens` (block-aligned) that kvtier can load.

        At least one token is always left to compute: vLLM needs it to sample from.
        """
        tracker = self.track(request)
        tracker.num_local_tokens = num_computed_tokens
        size = self.settings.block_tokens
        max_blocks = (request.num_tokens - 1) // size
        tracker.num_hit_blocks = self.directory.lookup(tracker.keys_for(max_blocks)) if max_blocks > 0 else 0
        if not self.settings.can_load:
            return 0
        return max(0, tracker.num_hit_blocks * size - num_computed_tokens)

    def after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Records the load of `num_external_tokens` after vLLM's own hit into the request's `block_ids`."""
        tracker = self.track(request)
        tracker.num_stored_blocks = tracker.num_hit_blocks
        size, local = self.settings.block_tokens, tracker.num_local_tokens
        self._count_prompt_blocks(request, local // size, max(num_external_tokens, 0) // size)
        if num_external_tokens <= 0:
            return
        first, end = local // size, (local + num_external_tokens) // size
        keys = tracker.keys_for(end)[first:end]
        self._loads[request.request_id] = LoadSpec(request.request_id, tuple(keys), tuple(block_ids[first:end]))

    def _count_prompt_blocks(self, request: Any, num_engine: int, num_kvtier: int) -> None:
        num_full = max(request.num_tokens - 1, 0) // self.settings.block_tokens
        self.prompt_blocks.engine += num_engine
        self.prompt_blocks.kvtier += num_kvtier
        self.prompt_blocks.computed += max(num_full - num_engine - num_kvtier, 0)

    def plan_step(self, scheduled: Iterable[ScheduledRequest],
                  block_ids_of: Callable[[str], Sequence[int]]) -> StepPlan:
        """The loads recorded since the last step, and the stores of blocks this step completes."""
        plan = StepPlan(loads=list(self._loads.values()))
        self._loads.clear()
        if not self.settings.can_store:
            return plan
        queued: set[BlockKey] = set()
        for item in scheduled:
            spec = self._store_spec(item, block_ids_of, queued)
            if spec is not None:
                plan.stores.append(spec)
                self.directory.expect(spec.keys)
        return plan

    def _store_spec(self, item: ScheduledRequest, block_ids_of: Callable[[str], Sequence[int]],
                    queued: set[BlockKey]) -> StoreSpec | None:
        tracker = self._trackers.get(item.req_id)
        if tracker is None:
            return None
        # Speculative tokens may be rejected: their KV is never stored.
        end_tokens = tracker.request.num_computed_tokens + item.num_scheduled_tokens - item.num_spec_tokens
        end = min(end_tokens, len(tracker.request.all_token_ids)) // self.settings.block_tokens
        first = tracker.num_stored_blocks
        if end <= first:
            return None
        table = block_ids_of(item.req_id)
        if len(table) < end:
            return None
        keys = tracker.keys_for(end)
        tracker.num_stored_blocks = end
        picked = [i for i in range(first, end) if keys[i] not in queued]
        queued.update(keys[i] for i in picked)
        if not picked:
            return None
        return StoreSpec(item.req_id, tuple(keys[i] for i in picked), tuple(table[i] for i in picked),
                         tuple(table[:end]))

    def on_invalid_blocks(self, invalid_block_ids: set[int], block_ids_of: Callable[[str], Sequence[int]]) -> None:
        """Rewinds the store cursor of requests whose blocks failed to load: vLLM recomputes them."""
        for req_id, tracker in self._trackers.items():
            if not tracker.num_stored_blocks:
                continue
            table = block_ids_of(req_id)[:tracker.num_stored_blocks]
            bad = next((i for i, b in enumerate(table) if b in invalid_block_ids), None)
            if bad is not None:
                tracker.num_stored_blocks = bad

    def finished(self, req_id: str) -> None:
        self._trackers.pop(req_id, None)
        self._loads.pop(req_id, None)
