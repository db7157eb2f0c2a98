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

from kvtier.integrations.hints import HintReader, RetentionHint
from kvtier.integrations.vllm.inputs import AdapterFingerprints, Refusal, RequestInputs, read_inputs
from kvtier.integrations.vllm.lookup import RankLookup
from kvtier.integrations.vllm.backends import SHARED, Backend
from kvtier.integrations.vllm.events import BlockHashes, ExtBlock
from kvtier.integrations.vllm.settings import NULL_BLOCK_ID, Settings
from kvtier.model.keys import ROOT_KEY, BlockKey, Namespace, block_keys

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load `keys` into engine blocks `block_ids` (one each) of KV cache group `group`, for request `req_id`."""

    req_id: str
    keys: tuple[BlockKey, ...]
    block_ids: tuple[int, ...]
    group: int = 0


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """Store engine blocks `block_ids` of KV cache group `group` under `keys`, once their KV is
    computed in this step.

    `prefix_block_ids` are the request's engine blocks up to the last one stored, in every group: if
    a load into any of them fails in this step, the KV computed on top of it is wrong (every later
    layer's KV depends on every earlier layer's) and the store is dropped.

    `names`: per key, vLLM's name of the block (`ExtBlock`, None where unknown), sent only where
    the worker announces its pool blocks (`vllm_pool_names`); else empty.
    """

    req_id: str
    keys: tuple[BlockKey, ...]
    block_ids: tuple[int, ...]
    prefix_block_ids: tuple[int, ...]
    group: int = 0
    names: tuple[ExtBlock | None, ...] = ()


@dataclass(frozen=True, slots=True)
class HintSpec:
    """Apply request `req_id`'s retention hint (`kvtier.integrations.hints`) to `keys`, its blocks
    (of every KV cache group) that this step stores or that it hit, charged to `tenant`'s budget.
    With no session, lease nor close it says a request without a hint used them: no close dooms them."""

    req_id: str
    keys: tuple[BlockKey, ...]
    session: str | None = None
    retain_s: float | None = None
    closed: bool = False
    tenant: str = ""


@dataclass
class StepPlan:
    """What the worker does in one engine step."""

    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    hints: list[HintSpec] = field(default_factory=list)


def per_group(block_ids: Sequence[Any]) -> list[Sequence[int]]:
    """A request's block table as one list per KV cache group (vLLM's `get_block_ids()` gives a
    tuple of them; a flat list is the one group's)."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return list(block_ids)
    return [block_ids]


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
    """One request's block keys and how many of its leading blocks kvtier holds.

    The keys chain the request's token ids and, per block, its other inputs (`vllm_inputs`: LoRA
    adapter, multimodal items, cache salt, prompt embeddings). A request that cannot be keyed
    safely (`refusal`) has no keys: kvtier neither loads nor stores any of its blocks.
    """

    def __init__(self, request: Any, namespace: Namespace,
                 inputs: RequestInputs | Refusal = RequestInputs(), hashes: BlockHashes | None = None) -> None:
        self.request = request  # vLLM's Request: `request_id`, `all_token_ids`, `num_tokens`, `num_computed_tokens`
        self._namespace = namespace
        self._hashes = hashes  # where new keys are mapped to vLLM's block hashes (KV events on)
        self._num_mapped = 0  # leading keys mapped there
        self.refusal = inputs if isinstance(inputs, Refusal) else None
        self._inputs = inputs if isinstance(inputs, RequestInputs) else RequestInputs()
        self.keys: list[BlockKey] = []
        self.num_local_tokens = 0  # vLLM's own (block-aligned) prefix-cache hit, at the last lookup
        self.num_hit_blocks = 0  # leading blocks kvtier can supply (every group) at the last lookup
        self.num_stored_blocks: list[int] = []  # per group: leading blocks kvtier holds or is being sent
        self.hint: RetentionHint | None = None  # what the request's `kv_transfer_params` asked for
        self.num_hinted_blocks = 0  # leading blocks a `HintSpec` was sent for
        self.hint_closed = False  # its closing hint was sent: its later blocks belong to no session

    def keys_for(self, num_blocks: int) -> list[BlockKey]:
        """The first `num_blocks` keys, extending the chain as tokens arrive; none when refused."""
        if num_blocks > len(self.keys) and self.refusal is None:
            size, first = self._namespace.block_tokens, len(self.keys)
            tokens = self.request.all_token_ids[first * size: num_blocks * size]
            parent = self.keys[-1] if self.keys else ROOT_KEY
            extras = self._inputs.extras(first, len(tokens) // size, size)
            self.keys += block_keys(self._namespace, list(tokens), parent, extras)
        if self._hashes is not None and self._num_mapped < len(self.keys):  # vLLM hashes a block as it fills
            self._num_mapped += self._hashes.record(self.request, self._num_mapped, self.keys[self._num_mapped:],
                                                    self._inputs.plain)
        return self.keys[:num_blocks]


@dataclass
class PromptBlocks:
    """Where the full blocks of each scheduled prompt came from (counted when vLLM allocates them)."""

    engine: int = 0  # vLLM's own prefix cache
    kvtier: int = 0  # loaded from kvtier
    computed: int = 0  # in neither: prefilled
    # blocks of sliding-window groups a kvtier hit did not load (out of the window), and their bytes
    window_skipped: int = 0
    window_skipped_bytes: int = 0
    # of `engine` and `computed`: blocks of requests kvtier could not key safely (`vllm_inputs.Refusal`),
    # never loaded from or stored in kvtier; and those requests, by `RefusalReason` value
    unkeyable: int = 0
    unkeyable_requests: dict[str, int] = field(default_factory=dict)


class SchedulerSide:
    """The scheduler-side state of one engine's connector."""

    def __init__(self, settings: Settings, directory: KeyDirectory, hashes: BlockHashes | None = None,
                 name_stores: bool = False) -> None:
        self.settings = settings
        self.directory = directory
        self.hashes = hashes  # kvtier key -> vLLM block hash, for KV events (None: off)
        # send group 0's stores with vLLM's names of their blocks (the worker announces them to the pool)
        self._name_stores = name_stores and hashes is not None
        self.prompt_blocks = PromptBlocks()
        self._trackers: dict[str, RequestTracker] = {}
        self._loads: dict[str, list[LoadSpec]] = {}
        self._groups = settings.kv_groups
        self._adapters = AdapterFingerprints()
        hints = settings.config.hints
        # reads each request's retention hint once; None: hints are off in the kvtier config
        self.hint_reader = HintReader(hints.limits.max_retain_s) if hints.enabled else None
        # From the first hint on, every request's blocks go to the workers with its hint or with
        # none (`HintSpec`), so that a close never dooms a prefix unhinted traffic uses; before it,
        # nothing is sent and kvtier runs as without hints.
        self._hints_on = False

    def track(self, request: Any) -> RequestTracker:
        tracker = self._trackers.get(request.request_id)
        if tracker is None:
            inputs = read_inputs(request, self._adapters)
            if isinstance(inputs, Refusal):
                self._refused(inputs)
            tracker = self._trackers[request.request_id] = RequestTracker(request, self.settings.namespace, inputs,
                                                                          self.hashes)
            if self.hint_reader is not None:  # a refused hint is counted and logged, never raised
                tracker.hint = self.hint_reader.read(getattr(request, "kv_transfer_params", None),
                                                     getattr(request, "session_id", None), request.request_id)
                self._hints_on |= tracker.hint is not None
        return tracker

    def _refused(self, refusal: Refusal) -> None:
        """Counts a request kvtier cannot key; the first of each reason is a warning, later ones debug."""
        counts = self.prompt_blocks.unkeyable_requests
        reason = refusal.reason.value
        counts[reason] = counts.get(reason, 0) + 1
        level = logging.WARNING if counts[reason] == 1 else logging.DEBUG
        log.log(level, "kvtier: %s; such requests are served without kvtier (counted as unkeyable, never stored)",
                refusal.detail)

    def num_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond `num_computed_tokens` (block-aligned) that kvtier can load.

        At least one token is always left to compute: vLLM needs it to sample from.
        """
        tracker = self.track(request)
        tracker.num_local_tokens = num_computed_tokens
        size = self.settings.block_tokens
        max_blocks = (request.num_tokens - 1) // size if tracker.refusal is None else 0
        tracker.num_hit_blocks = self._hit_blocks(tracker.keys_for(max_blocks)) if max_blocks > 0 else 0
        if not self.settings.can_load:
            return 0
        return max(0, tracker.num_hit_blocks * size - num_computed_tokens)

    def _hit_blocks(self, keys: Sequence[BlockKey]) -> int:
        """The most leading blocks every group can supply: a full-attention group all of them, a
        sliding-window group those its window reaches from the end of the hit (the blocks before are
        never read again). A sliding group's gap shortens the hit to the gap, and the groups are
        asked again until they agree; each round only shortens it."""
        n, size = len(keys), self.settings.block_tokens
        for group in self._groups:
            if group.window_tokens is None and n:
                n = min(n, self.directory.lookup(self.settings.group_keys(group.index, keys[:n])))
        sliding = [g for g in self._groups if g.window_tokens is not None]
        changed = True
        while n and changed:
            changed = False
            for group in sliding:
                first = group.first_needed_block(n * size, size)
                run = self.directory.lookup(self.settings.group_keys(group.index, keys[first:n]))
                if first + run < n:
                    n, changed = first + run, True
        return n

    def after_alloc(self, request: Any, block_ids: Sequence[Any], num_external_tokens: int) -> None:
        """Records the load of `num_external_tokens` after vLLM's own hit into the request's
        `block_ids` (per group, as vLLM's `get_block_ids()`, or one flat list for one group): every
        block a group keeps; a sliding-window group keeps only those in the window (the others
        are vLLM's null block), counted as `window_skipped`."""
        tracker = self.track(request)
        tracker.num_stored_blocks = [tracker.num_hit_blocks] * len(self._groups)
        size, local = self.settings.block_tokens, tracker.num_local_tokens
        self._count_prompt_blocks(request, local // size, max(num_external_tokens, 0) // size,
                                  tracker.refusal is not None)
        if num_external_tokens <= 0:
            return
        first, end = local // size, (local + num_external_tokens) // size
        keys = tracker.keys_for(end)
        loads = []
        for group, table in zip(self._groups, per_group(block_ids)):
            start = max(first, group.first_needed_block(end * size, size))
            rows = [i for i in range(start, min(end, len(table))) if table[i] != NULL_BLOCK_ID]
            skipped = (end - first) - len(rows)
            self.prompt_blocks.window_skipped += skipped
            layer_bytes = self.settings.layout.layer_bytes[0]
            self.prompt_blocks.window_skipped_bytes += skipped * len(group.layer_names) * layer_bytes
            if rows:
                group_keys = self.settings.group_keys(group.index, [keys[i] for i in rows])
                loads.append(LoadSpec(request.request_id, group_keys, tuple(table[i] for i in rows), group.index))
        self._loads[request.request_id] = loads

    def _count_prompt_blocks(self, request: Any, num_engine: int, num_kvtier: int, refused: bool) -> None:
        num_full = max(request.num_tokens - 1, 0) // self.settings.block_tokens
        self.prompt_blocks.engine += num_engine
        self.prompt_blocks.kvtier += num_kvtier
        self.prompt_blocks.computed += max(num_full - num_engine - num_kvtier, 0)
        self.prompt_blocks.unkeyable += num_full if refused else 0

    def plan_step(self, scheduled: Iterable[ScheduledRequest],
                  block_ids_of: Callable[[str], Sequence[Any]]) -> StepPlan:
        """The loads recorded since the last step, and the stores of blocks this step completes."""
        plan = StepPlan(loads=[spec for specs in self._loads.values() for spec in specs])
        self._loads.clear()
        scheduled = list(scheduled)
        if self._hints_on:
            plan.hints = [spec for spec in map(self._hint_spec, scheduled) if spec is not None]
        if not self.settings.can_store:
            return plan
        queued: set[BlockKey] = set()
        for item in scheduled:
            for spec in self._store_specs(item, block_ids_of, queued):
                plan.stores.append(spec)
                self.directory.expect(spec.keys)
        return plan

    def _end_block(self, tracker: RequestTracker, item: ScheduledRequest) -> int:
        """The request's full blocks once this step is computed (speculative tokens may be rejected:
        left out)."""
        end_tokens = tracker.request.num_computed_tokens + item.num_scheduled_tokens - item.num_spec_tokens
        return min(end_tokens, len(tracker.request.all_token_ids)) // self.settings.block_tokens

    def _hint_spec(self, item: ScheduledRequest) -> HintSpec | None:
        """The request's hint for its blocks not yet sent with one: those it hit and those this step
        computes, in every group. A closing hint is sent once, even with no new block (a closing turn
        may hit them all); the request's later blocks are then sent with none: its session is over.
        The budget is its `cache_salt`'s where it has one (its keys are apart), else the engine's tenant."""
        tracker = self._trackers.get(item.req_id)
        if tracker is None or tracker.refusal is not None or tracker.hint_closed:
            return None
        hint = tracker.hint or RetentionHint()
        first, end = tracker.num_hinted_blocks, self._end_block(tracker, item)
        if end <= first and not hint.closed:
            return None
        tracker.num_hinted_blocks, tracker.hint_closed = max(first, end), hint.closed
        keys = tracker.keys_for(end)[first:end]
        salt = getattr(tracker.request, "cache_salt", None)
        return HintSpec(item.req_id, tuple(k for g in self._groups for k in self.settings.group_keys(g.index, keys)),
                        hint.session, hint.retain_s, hint.closed, salt or self.settings.config.tenant)

    def _store_specs(self, item: ScheduledRequest, block_ids_of: Callable[[str], Sequence[Any]],
                     queued: set[BlockKey]) -> list[StoreSpec]:
        """Per group, the blocks this step completes that the group still keeps (a sliding-window
        group has let go of the null ones: nothing to store there)."""
        tracker = self._trackers.get(item.req_id)
        if tracker is None or tracker.refusal is not None:
            return []
        end = self._end_block(tracker, item)  # speculative tokens may be rejected: their KV is never stored
        if not tracker.num_stored_blocks:
            tracker.num_stored_blocks = [0] * len(self._groups)
        if end <= min(tracker.num_stored_blocks):
            return []
        tables = per_group(block_ids_of(item.req_id))
        if len(tables) != len(self._groups) or any(len(t) < end for t in tables):
            return []
        keys = tracker.keys_for(end)
        prefix = tuple(b for t in tables for b in t[:end] if b != NULL_BLOCK_ID)
        specs = []
        for group, table in zip(self._groups, tables):
            first = tracker.num_stored_blocks[group.index]
            if end <= first:
                continue
            tracker.num_stored_blocks[group.index] = end
            group_keys = self.settings.group_keys(group.index, keys[first:end])
            picked = [(k, table[i]) for k, i in zip(group_keys, range(first, end))
                      if table[i] != NULL_BLOCK_ID and k not in queued]
            queued.update(k for k, _ in picked)
            if picked:
                keys_picked = tuple(k for k, _ in picked)
                names = tuple(self.hashes.get(k) for k in keys_picked) if self._name_stores and group.index == 0 \
                    else ()
                specs.append(StoreSpec(item.req_id, keys_picked, tuple(b for _, b in picked), prefix, group.index,
                                       names))
        return specs

    def on_invalid_blocks(self, invalid_block_ids: set[int], block_ids_of: Callable[[str], Sequence[Any]]) -> None:
        """Rewinds the store cursors of requests whose blocks failed to load: vLLM recomputes them,
        and every group's blocks from the first bad one on (in any group) are computed anew."""
        for req_id, tracker in self._trackers.items():
            if not any(tracker.num_stored_blocks):
                continue
            bad = [next((i for i, b in enumerate(table[:stored]) if b in invalid_block_ids), None)
                   for table, stored in zip(per_group(block_ids_of(req_id)), tracker.num_stored_blocks)]
            bad = [i for i in bad if i is not None]
            if bad:
                tracker.num_stored_blocks = [min(n, min(bad)) for n in tracker.num_stored_blocks]

    def finished(self, req_id: str) -> None:
        self._trackers.pop(req_id, None)
        self._loads.pop(req_id, None)
