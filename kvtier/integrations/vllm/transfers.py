"""The worker side of the vLLM connector: moves KV between the engine's pages and kvtier, per step.

One engine step, as vLLM drives it:

    start_loads(plan.loads)   before the forward: every load starts, all layers in flight
    wait_layer(l)             before layer l's attention: waits for layer l only, scatters it
    save_layer(l, stores)     after layer l's attention: gathers layer l of the blocks to store
    end_step() -> failed ids  after the forward: finishes the loads, sends the stores

Loads and stores go through host or device staging rows of kvtier's layer-major block layout;
a host engine's stores, where kvtier takes them whole into its DRAM tier (`KVTier.reserve`), are
gathered straight into that tier's slots instead, committed at the end of the step: one copy of
each block where staging makes two. `native.gather_blocks` / `scatter_blocks` copy between those
rows and the engine's caches, given as block-major views (`engine_block_view`, `kv_dim=None`):
one copy, no permute, so a block's bytes keep the engine's own interior order
(`vllm_pages.PageFormat` names it), whether the block is one contiguous page (LBHNC, LBNHC, BL*)
or one run per KV head (LHBNC, BHLNC).

A block that fails to load at any layer is reported by engine block id; the KV that this step
computed on top of it is wrong, so every store whose prefix holds such a block is dropped.

Under tensor parallelism every rank runs this on the same plan, each for its own slice of every
block (`Sharding.keys` names it in the backend). A block that fails on one rank poisons the
step's KV on every rank (attention outputs are all-reduced across ranks), so `end_step` first
agrees with the other ranks on which blocks failed (`agree`: an OR across ranks), and every rank
then reports the same engine blocks and drops the same stores. Nothing here imports vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.errors import GeometryError, KVTierError
from kvtier.moving.handle import TransferHandle
from kvtier.integrations.vllm.backends import Backend
from kvtier.integrations.vllm.events import WorkerResidency
from kvtier.integrations.vllm.scheduler import HintSpec, LoadSpec, StoreSpec
from kvtier.integrations.vllm.shards import Sharding
from kvtier.model.keys import BlockKey
from kvtier.model.layout import BlockLayout
from kvtier.moving.native import PagedLayer, gather_blocks, scatter_blocks
from kvtier.resident import Reservation
from kvtier.tiers.dram import host_rows

log = logging.getLogger(__name__)


def engine_block_view(kv: torch.Tensor, num_blocks: int, block_tokens: int, layer_bytes: int,
                      head_major: bool, latent: bool = False) -> torch.Tensor:
    """One layer's cache as vLLM registers it, `[B * r, H, N / r, C]`, viewed as `[num_blocks, ...]`.

    vLLM gives each layer a `[B, H, N, C]` view (blocks, KV heads, tokens, K|V content) whose strides
    follow its `KVCacheLayout`. Where the attention kernels take smaller blocks than the scheduler,
    a block is r kernel blocks of N / r tokens (rows b*r .. b*r + r - 1). The view lists block b's
    data as `[H, r, N/r, C]` (head_major) or `[r, N/r, H, C]`: tokens in order either way, so the
    bytes stored for a block depend on the interior order only, not on r nor on how layers and
    blocks nest around it. No data moves.

    Args:
        kv: the registered cache of one layer.
        num_blocks: the engine's blocks (vLLM's `KVCacheConfig.num_blocks`).
        block_tokens: tokens per block (N).
        layer_bytes: what kvtier's block layout holds for this layer.
        head_major: the layout puts heads outside tokens (`PageFormat.head_major`).
        latent: an MLA cache, `[B * r, N / r, C]` or `[B * r, 1, N / r, C]` (no heads: one latent
            per token), viewed as `[num_blocks, r, N / r, C]`.

    Raises:
        GeometryError: the shape is not `[num_blocks * r, H, block_tokens / r, C]`, the strides put
            heads and tokens the other way round, a block's bytes are not runs `native.PagedLayer` can
            describe, or they do not add up to layer_bytes.
    """
    if latent:
        if kv.ndim == 4 and kv.shape[1] == 1:  # the CPU backend's `[B, 1, N, C]`: one "head"
            kv = kv.squeeze(1)
        r = kv.shape[0] // num_blocks if kv.ndim == 3 and num_blocks > 0 else 0
        if r == 0 or kv.shape[0] != r * num_blocks or kv.shape[1] * r != block_tokens:
            raise GeometryError(f"expected an MLA cache [{num_blocks} blocks (or a multiple: kernel blocks), "
                                f"tokens, latent] covering {block_tokens} tokens per block, "
                                f"got shape {tuple(kv.shape)}")
        view = kv.unflatten(0, (num_blocks, r))
        page_bytes = PagedLayer.of(view, None).page_bytes
        if page_bytes != layer_bytes:
            raise GeometryError(f"a block holds {page_bytes} bytes of the layer, kvtier's layout {layer_bytes}")
        return view
    r = kv.shape[0] // num_blocks if kv.ndim == 4 and num_blocks > 0 else 0
    if r == 0 or kv.shape[0] != r * num_blocks or kv.shape[2] * r != block_tokens:
        raise GeometryError(f"expected [{num_blocks} blocks (or a multiple: kernel blocks), heads, tokens, K|V] "
                            f"covering {block_tokens} tokens per block, got shape {tuple(kv.shape)}")
    heads, tokens = kv.shape[1], kv.shape[2]
    if heads > 1 and tokens > 1 and (kv.stride(1) > kv.stride(2)) != head_major:
        inner, outer = ("heads", "tokens") if head_major else ("tokens", "heads")
        raise GeometryError(f"strides {kv.stride()} put {outer} outside {inner}, against the layout")
    blocks = kv.unflatten(0, (num_blocks, r))  # [B, r, H, N/r, C]
    view = blocks.permute(0, 2, 1, 3, 4) if head_major else blocks.permute(0, 1, 3, 2, 4)
    page_bytes = PagedLayer.of(view, None).page_bytes
    if page_bytes != layer_bytes:
        raise GeometryError(f"a block holds {page_bytes} bytes of the layer, kvtier's layout {layer_bytes}")
    return view


@dataclass
class WorkerStats:
    """Counters of one worker, for tests, logs and metrics (`vllm_metrics`)."""

    num_loads: int = 0
    num_blocks_loaded: int = 0
    num_blocks_failed: int = 0  # failed to load: reported to vLLM, which recomputes them
    num_layer_waits: int = 0
    layer_wait_s: float = 0.0  # time the forward spent in wait_layer: what loading cost the engine
    num_blocks_stored: int = 0
    num_blocks_stored_in_place: int = 0  # of those, gathered straight into kvtier's DRAM slots (one copy)
    num_blocks_not_stored: int = 0  # dropped: a store that failed, or computed on a block that failed to load
    # Every second the engine's forward thread spent in kvtier: loads started, layers waited for
    # and placed, blocks gathered, stores sent and reaped. What kvtier costs the step itself.
    forward_thread_s: float = 0.0


@dataclass
class _Load:
    spec: LoadSpec
    backend_keys: tuple[BlockKey, ...]  # this rank's keys for spec.keys
    staging: torch.Tensor
    handle: TransferHandle | None  # None: the backend raised, every block failed
    num_layers: int  # its group's layers
    num_layers_placed: int = 0
    timed_out: bool = False

    def failed_rows(self) -> list[int]:
        if self.handle is None or self.timed_out:
            return list(range(len(self.spec.keys)))
        return [i for i, k in enumerate(self.backend_keys) if k in self.handle.failed]


@dataclass
class _Stores:
    specs: list[StoreSpec]
    staging: torch.Tensor  # the rows the blocks are gathered into: staging, or a reserved tier's memory
    block_ids: list[int]
    layers_gathered: set[int] = field(default_factory=set)
    reservation: Reservation | None = None  # the tier slots they are gathered into, where reserved
    slots: torch.Tensor | None = None  # the rows of `staging` they go to (None: rows 0..n-1)
    buffer: torch.Tensor | None = None  # the `HostRows` buffer `staging` lies in, if it came from one


@dataclass
class _InFlight:
    keys: tuple[BlockKey, ...]  # blocks being stored (engine-level keys); () for a load given up on
    backend_keys: tuple[BlockKey, ...]  # this rank's keys for them
    staging: torch.Tensor  # kept alive until the backend is done with it
    handle: TransferHandle | None
    buffer: torch.Tensor | None = None  # as `_Stores.buffer`: given back once every store from it ended


class HostRows:
    """Host staging rows for stores, kept for later steps once the stores from them have ended.

    A fresh `[n, block_bytes]` tensor is new memory whose every page faults when the forward
    thread first gathers into it (53 blocks of 384 KiB: ~2,900 faults and 3.5 ms more than into
    rows already backed, on a 2-vCPU VM), and an engine stores every step. A buffer is taken
    whole by one step (`take`), held once per store sent from it (`hold`) and given back when the
    last of those ends (`release`) or none was sent (`settle`). At most `max_free_bytes` of free
    buffers are kept (the largest first dropped); a larger step gets new memory as before.
    """

    def __init__(self, block_bytes: int, max_free_bytes: int = 256 << 20) -> None:
        self.block_bytes, self.max_free_bytes = block_bytes, max_free_bytes
        self._free: list[torch.Tensor] = []
        self._users: dict[int, int] = {}  # id(buffer) -> stores in flight from it

    def take(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, buffer): `num_blocks` rows of the smallest free buffer that has them, or of new memory."""
        fits = [b for b in self._free if b.shape[0] >= num_blocks]
        if fits:
            buffer = min(fits, key=lambda b: b.shape[0])
            self._free = [b for b in self._free if b is not buffer]
        else:
            buffer = host_rows(num_blocks, self.block_bytes)
        self._users[id(buffer)] = 0
        return buffer[:num_blocks], buffer

    def hold(self, buffer: torch.Tensor) -> None:
        self._users[id(buffer)] += 1

    def release(self, buffer: torch.Tensor) -> None:
        self._users[id(buffer)] -= 1
        self.settle(buffer)

    def settle(self, buffer: torch.Tensor) -> None:
        """Gives `buffer` back if no store from it is in flight."""
        if self._users.get(id(buffer)) != 0:
            return
        del self._users[id(buffer)]
        self._free.append(buffer)
        self._free.sort(key=lambda b: b.shape[0])
        while self._free and sum(b.numel() for b in self._free) > self.max_free_bytes:
            self._free.pop()  # the largest

    @property
    def free_bytes(self) -> int:
        return sum(b.numel() for b in self._free)


class WorkerSide:
    """Moves one worker's blocks; see the module docstring for the call order.

    Args:
        backend: where blocks live.
        layout: kvtier's block layout; layer i is `layers[i]`.
        layers: each layer's cache as a block-major view, `[num_engine_blocks, ...]`, a block's data in
            stored order (`engine_block_view`; `native.PagedLayer` says which strides it may have).
            With several KV cache groups, one such list per group (layer i of a group's block is
            its list's i-th; a group of fewer layers than the layout leaves the rest zero).
        timeout_s: the longest one layer of a load may take before its blocks count as failed.
        sharding: this rank's slice of each block (its keys in the backend); default: the only rank.
        agree: combines every rank's failed-row flags of a step's loads (element-wise OR) and
            returns them; called by every rank at the same point of a step with loads. None: one rank.
    """

    def __init__(self, backend: Backend, layout: BlockLayout, layers: Sequence[Any],
                 timeout_s: float, stats: WorkerStats | None = None, sharding: Sharding | None = None,
                 agree: Callable[[list[bool]], list[bool]] | None = None) -> None:
        self.groups: list[list[torch.Tensor]] = [list(g) for g in layers] if layers and \
            isinstance(layers[0], (list, tuple)) else [list(layers)]
        if any(len(g) > layout.num_layers for g in self.groups):
            raise GeometryError(f"a KV cache group has more layers than kvtier's block ({layout.num_layers})")
        self.backend, self.layout, self.layers = backend, layout, self.groups[0]
        self._padded = any(len(g) < layout.num_layers for g in self.groups)  # rows need zeroing
        self.timeout_s = timeout_s
        self.sharding, self.agree = sharding or Sharding(), agree
        self.stats = stats or WorkerStats()
        # KV events on: this rank's residency log, told which engine key each rank key stands for
        self.residency: WorkerResidency | None = None
        self._loads: list[_Load] = []
        self._stores: dict[int, _Stores] = {}  # by group
        self._in_flight: list[_InFlight] = []
        self._stored: list[BlockKey] = []
        self._missing: list[BlockKey] = []
        self._step_kvtier_s = 0.0  # this step's time in start_loads, wait_layer and save_layer
        # Store staging kept across steps (host, unpadded rows: padded ones must start zeroed)
        host = bool(self.layers) and self.layers[0].device.type == "cpu"
        self.host_rows = HostRows(layout.block_bytes) if host and not self._padded else None

    # ---- one step ------------------------------------------------------------------------

    def start_loads(self, specs: Sequence[LoadSpec]) -> None:
        """Starts every load; returns at once, unless a block to load is still being stored here:
        that store is waited for first (the scheduler counts blocks being stored as hits)."""
        started = time.perf_counter()
        for spec in specs:
            self._wait_stores_of(spec.keys)
            staging = self._staging(len(spec.keys))
            keys = self.sharding.keys(spec.keys)
            if self.residency is not None:
                self.residency.note(spec.keys, keys)
            try:
                handle = self.backend.load(keys, staging)
            except Exception as e:  # a broken backend: the blocks are failed loads, vLLM recomputes them
                log.warning("kvtier load of %d blocks failed: %r", len(spec.keys), e)
                handle = None
            self._loads.append(_Load(spec, keys, staging, handle, len(self.groups[spec.group])))
            self.stats.num_loads += 1
        spent = time.perf_counter() - started
        self._step_kvtier_s += spent
        self.stats.forward_thread_s += spent

    def wait_layer(self, layer: int, group: int = 0) -> None:
        """Returns once layer `layer` of group `group` of every block loading in this step is in
        the engine's pages."""
        if not self._loads:
            return
        started = time.perf_counter()
        for load in self._loads:
            while load.spec.group == group and load.num_layers_placed <= min(layer, load.num_layers - 1):
                self._place_next_layer(load)
        self.stats.num_layer_waits += 1
        waited = time.perf_counter() - started
        self._step_kvtier_s += waited
        self.stats.layer_wait_s += waited
        self.stats.forward_thread_s += waited

    def save_layer(self, layer: int, specs: Sequence[StoreSpec], group: int = 0) -> None:
        """Copies layer `layer` of group `group` of the blocks to store out of the engine's pages."""
        specs = [s for s in specs if s.group == group]
        if not specs or layer >= len(self.groups[group]):
            return
        started = time.perf_counter()
        stores = self._stores.get(group)
        if stores is None:
            stores = self._stores[group] = self._new_stores(specs)
        if layer not in stores.layers_gathered:
            gather_blocks([self.groups[group][layer]], stores.block_ids, stores.staging, self.layout,
                          None, slots=stores.slots, layers=[layer])
            stores.layers_gathered.add(layer)
        spent = time.perf_counter() - started
        self._step_kvtier_s += spent
        self.stats.forward_thread_s += spent

    def take_step_seconds(self) -> float:
        """The seconds this step spent in kvtier so far (loads started, layers waited for, layers
        gathered for stores), and a fresh count for the next step: what the engine's measured
        step time must leave out to be its compute time."""
        seconds, self._step_kvtier_s = self._step_kvtier_s, 0.0
        return seconds

    def end_step(self, specs: Sequence[StoreSpec] = ()) -> set[int]:
        """Finishes this step's loads and sends its stores; returns the engine blocks that failed to load."""
        started = time.perf_counter()
        for load in self._loads:
            while load.num_layers_placed < load.num_layers:
                self._place_next_layer(load)
        failed = self._failed_block_ids([self._finish(load) for load in self._loads])
        self._loads = []
        self.stats.forward_thread_s += time.perf_counter() - started
        for group, layers in enumerate(self.groups):  # layers vLLM did not hand to save_layer
            for layer in range(len(layers)):
                self.save_layer(layer, specs, group)  # counts its own time
        started = time.perf_counter()
        for group in sorted(self._stores):
            self._send(self._stores[group], failed)
        self._stores = {}
        self.reap()
        self.stats.forward_thread_s += time.perf_counter() - started
        return failed

    def apply_hints(self, specs: Sequence[HintSpec]) -> None:
        """Applies the step's retention hints to this rank's keys for their blocks; after `end_step`,
        whose stores are then in kvtier's index (a lease covers only blocks it holds). Each rank's
        budget is its own share of the last tier. A hint is advice: a backend that fails is logged."""
        for spec in specs:
            try:
                self.backend.apply_hint(self.sharding.keys(spec.keys), session=spec.session, retain_s=spec.retain_s,
                                        closed=spec.closed, tenant=spec.tenant)
            except Exception as e:  # never worth failing a step for
                log.warning("kvtier: the hint of request %s was not applied: %r", spec.req_id, e)

    # ---- between steps -------------------------------------------------------------------

    def reap(self) -> None:
        """Collects finished stores."""
        still = []
        for store in self._in_flight:
            if store.handle is not None and not store.handle.done():
                still.append(store)
                continue
            failed = store.handle.failed if store.handle is not None else None
            ok = [k for k, b in zip(store.keys, store.backend_keys) if failed is not None and b not in failed]
            landed = set(ok)
            self._report(ok, [k for k in store.keys if k not in landed])
            if store.buffer is not None:
                self.host_rows.release(store.buffer)
        self._in_flight = still

    @property
    def num_stores_in_flight(self) -> int:
        """Stores sent to the backend and not yet reaped (the connector's store backlog)."""
        return len(self._in_flight)

    def take_reports(self) -> tuple[list[BlockKey], list[BlockKey]]:
        """Keys stored and keys found missing since the last call (for the scheduler's directory)."""
        stored, missing = self._stored, self._missing
        self._stored, self._missing = [], []
        return stored, missing

    def close(self, timeout_s: float | None = None) -> None:
        """Waits for transfers in flight; one that does not end in time is left to the backend's close."""
        for store in self._in_flight:
            try:
                if store.handle is not None:
                    store.handle.wait(timeout_s)
            except (TimeoutError, KVTierError) as e:
                log.warning("kvtier transfer of %d blocks still unfinished at shutdown: %r", len(store.keys), e)
        self.reap()

    # ---- internals ---------------------------------------------------------------------

    def _wait_stores_of(self, keys: Sequence[BlockKey]) -> None:
        """Waits (up to the load timeout) for the stores in flight that carry any of `keys`."""
        wanted = set(keys)
        for store in self._in_flight:
            if store.handle is None or wanted.isdisjoint(store.keys):
                continue
            try:
                store.handle.wait(self.timeout_s)
            except (TimeoutError, KVTierError) as e:  # the load then misses those blocks; vLLM recomputes
                log.warning("kvtier store of %d blocks not done before their load: %r", len(store.keys), e)

    def _staging(self, num_blocks: int) -> torch.Tensor:
        # vLLM runs the model under inference mode; kvtier's threads write these rows outside it,
        # which an inference tensor refuses. A smaller group's block: its rest is zero. On the
        # host, rows on page boundaries: an SSD tier reads and writes them without staging.
        device = self.layers[0].device
        with torch.inference_mode(False):
            if device.type == "cpu":
                return host_rows(num_blocks, self.layout.block_bytes, zeroed=self._padded)
            make = torch.zeros if self._padded else torch.empty
            return make((num_blocks, self.layout.block_bytes), dtype=torch.uint8, device=device)

    def _place_next_layer(self, load: _Load) -> None:
        layer = load.num_layers_placed
        load.num_layers_placed += 1
        if load.handle is None or load.timed_out:
            return
        try:
            load.handle.wait_layer(layer, self.timeout_s)
        except TimeoutError:
            log.warning("kvtier load of %d blocks: layer %d not in after %ss; recomputing them",
                        len(load.spec.keys), layer, self.timeout_s)
            load.timed_out = True
            return
        failed = set(load.failed_rows())
        rows = [i for i in range(len(load.spec.keys)) if i not in failed]
        if rows:
            scatter_blocks([self.groups[load.spec.group][layer]], [load.spec.block_ids[i] for i in rows],
                           load.staging, self.layout, None, slots=rows, layers=[layer])

    def _finish(self, load: _Load) -> list[int]:
        """The rows of `load` that failed here; its staging is kept while the backend may write it."""
        if load.handle is not None and not load.timed_out:
            try:
                load.handle.wait(self.timeout_s)
            except TimeoutError:
                load.timed_out = True
            except Exception as e:  # completing the transfer broke: the blocks are not trusted
                log.warning("kvtier load of %d blocks failed to complete: %r", len(load.spec.keys), e)
                load.handle = None
        if load.timed_out and load.handle is not None:
            self._in_flight.append(_InFlight((), (), load.staging, load.handle))
        rows = load.failed_rows()
        self._missing += [load.spec.keys[i] for i in rows]
        return rows

    def _failed_block_ids(self, failed_rows: list[list[int]]) -> set[int]:
        """The engine blocks of this step's loads that failed on this rank or, agreed, on any other."""
        if self.agree is not None and self._loads:
            flags: list[bool] = []
            for load, rows in zip(self._loads, failed_rows):
                bad = set(rows)
                flags += [i in bad for i in range(len(load.spec.keys))]
            agreed = iter(self.agree(flags))
            failed_rows = [[i for i in range(len(load.spec.keys)) if next(agreed)] for load in self._loads]
        failed: set[int] = set()
        for load, rows in zip(self._loads, failed_rows):
            failed.update(load.spec.block_ids[i] for i in rows)
            self.stats.num_blocks_failed += len(rows)
            self.stats.num_blocks_loaded += len(load.spec.keys) - len(rows)
        return failed

    def _new_stores(self, specs: list[StoreSpec]) -> _Stores:
        """Where this step's blocks of one group are gathered: the slots of kvtier's DRAM tier
        (`KVTier.reserve`) where the engine runs on the host, every block is whole (no smaller
        group's zero padding) and kvtier takes them all; else staging rows."""
        block_ids = [b for s in specs for b in s.block_ids]
        if self.layers[0].device.type == "cpu" and not self._padded:
            keys = [k for s in specs for k in self.sharding.keys(s.keys)]
            if self.residency is not None:
                self.residency.note([k for s in specs for k in s.keys], keys)
            try:
                reservation = self.backend.reserve(keys)
            except Exception as e:  # a broken backend: staged, and its store reports the failure
                log.warning("kvtier reserve of %d blocks failed: %r", len(keys), e)
                reservation = None
            if reservation is not None:
                return _Stores(specs, reservation.rows, block_ids, reservation=reservation, slots=reservation.slots)
        if self.host_rows is not None:
            rows, buffer = self.host_rows.take(len(block_ids))
            return _Stores(specs, rows, block_ids, buffer=buffer)
        return _Stores(specs, self._staging(len(block_ids)), block_ids)

    def _commit(self, stores: _Stores, failed_block_ids: set[int]) -> None:
        """Ends a reservation: the specs gathered whole and not computed on a failed load are
        kept (stored now), the rest given back."""
        whole = len(stores.layers_gathered) == len(self.groups[stores.specs[0].group])  # never a partial block
        kept = [whole and not failed_block_ids.intersection(spec.prefix_block_ids) for spec in stores.specs]
        try:
            stores.reservation.commit([ok for spec, ok in zip(stores.specs, kept) for _ in spec.keys])
        except Exception as e:  # a broken or closed backend: the blocks are simply not cached
            log.warning("kvtier commit of %d reserved blocks failed: %r", len(stores.block_ids), e)
            kept = [False] * len(kept)
        for spec, ok in zip(stores.specs, kept):
            self._report(spec.keys if ok else (), () if ok else spec.keys)
            self.stats.num_blocks_stored_in_place += len(spec.keys) if ok else 0

    def _report(self, stored: Sequence[BlockKey], not_stored: Sequence[BlockKey]) -> None:
        """Blocks whose store landed and blocks not stored, for the scheduler and the counters."""
        self._stored += stored
        self._missing += not_stored
        self.stats.num_blocks_stored += len(stored)
        self.stats.num_blocks_not_stored += len(not_stored)

    def _send(self, stores: _Stores, failed_block_ids: set[int]) -> None:
        if stores.reservation is not None:
            self._commit(stores, failed_block_ids)
            return
        row = 0
        for spec in stores.specs:
            rows = stores.staging[row: row + len(spec.keys)]
            row += len(spec.keys)
            if failed_block_ids.intersection(spec.prefix_block_ids):
                self._report((), spec.keys)
                continue
            keys = self.sharding.keys(spec.keys)
            if self.residency is not None:
                self.residency.note(spec.keys, keys)
            try:
                handle = self.backend.store(keys, rows, background=True)
            except Exception as e:  # a broken backend: the blocks are simply not cached
                log.warning("kvtier store of %d blocks failed: %r", len(spec.keys), e)
                handle = None
            self._in_flight.append(_InFlight(spec.keys, keys, stores.staging, handle, stores.buffer))
            if stores.buffer is not None:
                self.host_rows.hold(stores.buffer)
        if stores.buffer is not None:
            self.host_rows.settle(stores.buffer)
