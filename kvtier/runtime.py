"""`KVTier`: what an inference engine holds — the manager and the transfer engine, wired.

The engine sees four verbs (see DESIGN.md): `lookup`, `load`, `store`, `prefetch`. Each asks the
manager for a plan under one lock and hands the plan to the `PlanRunner` (`kvtier.plan_runner`),
which turns it into copies, submits them to the transfer engine and applies each completion back
to the manager. The lock is never held while bytes move. What the shared tier (the pool) holds
beyond this process's index is found and adopted by `SharedLookup`; what a persistent tier kept
from an earlier run is adopted at start-up (`Tier.recall`). `KVTier` itself only checks the
caller's arguments, keeps the store backlog within its bound, and delegates.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch
import xxhash

from kvtier.config import KVTierConfig, TierConfig, load_config
from kvtier.deciding.cost import LoadCost
from kvtier.deciding.manager import Move, TierManager, TierSlots
from kvtier.deciding.residency import ResidencyBatch, ResidencyLog
from kvtier.deciding.retention import HintError
from kvtier.errors import ConfigError, KVTierError, TierIOError
from kvtier.kinds import Medium, TierKind
from kvtier.model.layout import BlockLayout
from kvtier.moving.engine import Endpoint, TransferEngine
from kvtier.moving.handle import Stage, TransferHandle
from kvtier.observing.stats import DropReason, Stats
from kvtier.plan_runner import PlanRunner
from kvtier.policy import make_policy
from kvtier.resident import Reservation, ResidentPath
from kvtier.tiers.base import Tier
from kvtier.tiers.build import build_tier
from kvtier.tiers.health import TierService
from kvtier.tiers.shared import SharedTier
from kvtier.tiers.shared_lookup import SharedLookup

log = logging.getLogger(__name__)



@dataclass
class Prefetch:
    """A prefetch in flight. `cancel()` stops the blocks no load has joined yet."""

    handle: TransferHandle
    moves: tuple[Move, ...]
    _runtime: "KVTier"

    def cancel(self) -> None:
        self._runtime._cancel_prefetch(self)

    def wait(self, timeout_s: float | None = None) -> bool:
        return self.handle.wait(timeout_s)


class KVTier:
    """A tiered KV-cache store of fixed-size blocks.

    Args:
        config: tiers, policies and modes.
        layout: the block layout (default: from `config.model` and `config.block_tokens`).
        tiers: already-built tiers by kind (tests inject instrumented ones); the rest are built
            from `config`.
        stats: counters to update (default: a new `Stats`).
    """

    def __init__(self, config: KVTierConfig, *, layout: BlockLayout | None = None,
                 tiers: Mapping[TierKind, Tier] | None = None, stats: Stats | None = None) -> None:
        self.config = config
        self.layout = layout or _layout_from_model(config)
        if config.transfer.max_store_backlog_bytes < self.layout.block_bytes:
            raise ConfigError(f"transfer.max_store_backlog: {config.transfer.max_store_backlog_bytes} bytes is less "
                              f"than one block ({self.layout.block_bytes} bytes): every store would be dropped")
        self.stats = stats or Stats()
        self.tiers: dict[TierKind, Tier] = dict(tiers or {})
        try:
            for cfg in config.tiers:
                if cfg.kind not in self.tiers:
                    self.tiers[cfg.kind] = build_tier(cfg, self.layout.block_bytes)
            self._share_host_memory()
            for tier in self.tiers.values():
                if tier.shared:
                    tier.stats = self.stats  # its counters (`Stats.shared`) beside the runtime's
        except BaseException:
            self._close_tiers()
            raise
        self._num_restored_blocks = 0  # adopted from a persistent SSD tier's journal
        try:  # nothing built so far may leak (SSD files, pool connections) if the rest fails
            self.manager = TierManager(
                [self._slots(cfg) for cfg in config.tiers], mode=config.mode,
                promote_to=config.promote_to, stats=self.stats)
            self.manager.configure_hints(config.hints.limits)
            self._recall()
        except BaseException:
            self._close_tiers()
            raise
        self.engine = TransferEngine(self.layout, io_workers=config.transfer.io_workers,
                                     chunk_bytes=config.transfer.chunk_bytes,
                                     inline_bytes=config.transfer.inline_bytes,
                                     copy_threads=config.transfer.copy_threads, stats=self.stats,
                                     background_nice=config.transfer.background_nice,
                                     cpus=config.transfer.cpus)
        self._backlog_bytes = 0  # bytes of stores submitted and not yet applied
        self.cost = LoadCost(self.layout.block_tokens)
        self._lock = threading.RLock()
        self._runner = PlanRunner(self.tiers, self.layout, self.manager, self.engine, self._lock, self.stats,
                                  lambda tier, failure: self._service.note(tier, failure), self.cost)
        self._resident = ResidentPath(self.tiers, self.layout, self.manager, self.engine, self._runner, self.cost,
                                      self._lock, self._take_backlog)
        self._service = TierService(self.tiers, self._lock, self._set_available, self.stats,
                                    config.transfer.tier_retry_s, config.transfer.tier_retry_max_s)
        # The tier other processes store into too (the pool), asked for what the index lacks.
        shared = next((k for k, t in self.tiers.items() if t.shared), None)
        self._shared = None if shared is None else SharedLookup(
            shared, self.tiers[shared], self.manager, self._lock, self.stats, self._runner.submit_moves)
        self._metrics_server = None
        self._residency: ResidencyLog | None = None  # see `log_residency`
        self._closed = False

    @classmethod
    def from_config_file(cls, path: str | None = None, **kwargs) -> "KVTier":
        return cls(load_config(path), **kwargs)

    # ---- the engine's verbs ----------------------------------------------------------------

    def lookup(self, keys: Sequence[Hashable]) -> int:
        """Number of leading `keys` whose blocks are stored and ready in some tier: this process's
        own, and those a shared tier (the pool) holds from any process of the tenant, which are
        adopted into the index so that `load` serves them (see `kvtier.tiers.shared_lookup`)."""
        if self._shared is None:
            with self._lock:
                return self.manager.lookup(keys)
        return self._shared.leading(keys)

    def loadable(self, keys: Sequence[Hashable]) -> int:
        """Number of leading `keys` worth loading: stored and ready (as `lookup`), and, with
        `transfer.skip_slow_loads`, no slower to load from where they are than to recompute per
        the online estimates (`kvtier.deciding.cost`; the engine reports its compute with `note_compute`).
        Blocks held but not worth loading are counted (`snapshot()["cost"]["skipped_blocks"]`)."""
        held = self._shared.leading(keys) if self._shared is not None else len(keys)
        with self._lock:
            tiers = self.manager.serving_tiers(keys[:held])
        if not self.config.transfer.skip_slow_loads:
            return len(tiers)
        return self.cost.worth_loading(tiers)

    def note_compute(self, num_tokens: int, seconds: float) -> None:
        """The engine computed `num_tokens` tokens in `seconds` of one forward pass (kvtier's own
        waits excluded): the recompute side of `loadable`. Steps of fewer tokens than a block
        (decode) are left out: their time is mostly the step's fixed cost, not per token."""
        if num_tokens >= self.layout.block_tokens:
            self.cost.note_compute(num_tokens, seconds)

    def store(self, keys: Sequence[Hashable], blocks: torch.Tensor | Sequence[torch.Tensor],
              target: TierKind | None = None, *, background: bool = False, sync: bool = False) -> TransferHandle:
        """Saves blocks asynchronously; blocks already stored are skipped.

        Args:
            keys: one key per block.
            blocks: `[len(keys), block_bytes]` uint8 (any device), or one 1-D tensor per block.
                The caller keeps them unchanged until the handle is done.
            target: the tier to write into (default the fastest); a full tier spills downward.
            background: nobody waits on this store (an engine saving what it computed): it never
                runs in the calling thread, and its copies run at the background workers' lower
                priority, so the caller's own work (the next forward pass) comes first.
            sync: the caller would wait for the handle at once: the copies run in its thread and
                the handle is done on return (no hand-off to a worker and back). Demotions the
                store makes room with still run in the background.
        Returns:
            A handle; blocks that could not be stored anywhere are in `handle.failed`.
        Raises:
            ValueError: `background` and `sync` both set, or bad keys or blocks.
        """
        if background and sync:
            raise ValueError("store: background and sync exclude each other (nobody waits, or the caller does)")
        done = self._resident.store(keys, blocks, target, sync, background)
        if done is not None:
            return done
        buffers = self._caller_ends(keys, blocks, "blocks")
        with self._lock:
            taken, over = self._within_backlog(keys)
            plan = self.manager.prepare_store(taken, target)
            self._runner.submit_moves(plan.moves)
            caller = TransferHandle(keys, self.layout.num_layers)
            refused = {key: "no tier had room for the block" for key in plan.rejected}
            refused.update((key, "the store backlog is full: dropped rather than waited for") for key in over)
            backlog = len(plan.all_placements) * self.layout.block_bytes
            self._backlog_bytes += backlog
            ops = self._runner.store_ops(plan.placements, buffers)
        first = TransferHandle([p.key for p in plan.placements], self.layout.num_layers)

        def released() -> None:
            with self._lock:
                self._backlog_bytes -= backlog

        def on_done(h: TransferHandle) -> None:
            self._runner.finish_store(plan, h, caller, buffers, refused, released)

        if sync:  # outside the lock, as a worker would run it: the plan holds the slots until it completes
            self.engine.run_now(ops, first, on_done)
        else:  # a write-through copy (the pool) is never written in the caller's thread
            self.engine.submit(ops, on_done, handle=first, background=background,
                               inline=not background and not plan.through)
        return caller

    def reserve(self, keys: Sequence[Hashable], target: TierKind | None = None) -> Reservation | None:
        """Slots of a host memory tier for new blocks the caller writes in place, then commits
        (`kvtier.resident.Reservation`): one copy of each block (the caller's) where `store`
        makes two. None where a store of `keys` would not stay in that tier (a key already held,
        a full tier whose victims would be demoted, write-through, duplicate keys, no host
        memory tier): nothing changed; store them instead.

        Args:
            keys: one key per block, all new.
            target: the tier (default the fastest), as for `store`.
        """
        return self._resident.reserve(keys, target)

    def load(self, keys: Sequence[Hashable], into: torch.Tensor | Sequence[torch.Tensor], *,
             sync: bool = False) -> TransferHandle:
        """Copies stored blocks into the caller's buffers, layer by layer.

        `handle.wait_layer(l)` returns once layer `l` of every block is in place. A block that is
        not stored, or fails on the way (I/O error, checksum mismatch), is in `handle.failed` and
        its buffer content is undefined: treat it as a miss. `sync`: the caller would wait for the
        handle at once: the copies run in its thread (no hand-off to a worker and back), the
        handle is done on return, and a hung disk or node holds the caller (no wait timeout).
        """
        done = self._resident.load(keys, into, sync)
        if done is not None:
            return done
        buffers = self._caller_ends(keys, into, "into")
        with self._lock:
            plan = self.manager.prepare_load(keys)
            self._runner.submit_moves(plan.moves, background=False)
            ops = self._runner.load_ops(plan, buffers)
            handle = TransferHandle(keys, self.layout.num_layers)
            for key in plan.missing:
                handle.fail(key, Stage.READ, 0, "not stored")
            started = time.perf_counter()

            def on_done(h: TransferHandle) -> None:
                self._runner.loaded(plan, h, started)

            if not sync:
                return self.engine.submit(ops, on_done, handle=handle)
        return self.engine.run_now(ops, handle, on_done)  # outside the lock: the plan leases the sources

    def prefetch(self, keys: Sequence[Hashable], target: TierKind | None = None,
                 budget_bytes: int | None = None) -> Prefetch:
        """Moves blocks toward `target` (default the configured prefetch target), in order,
        within `budget_bytes`. Pinned blocks are never evicted to make room."""
        target = self.config.prefetch.target if target is None else target
        budget = self.config.prefetch.budget_bytes if budget_bytes is None else budget_bytes
        with self._lock:
            moves = self.manager.prepare_prefetch(keys, target, budget // self.layout.block_bytes)
            handle = self._runner.submit_moves(moves)
        return Prefetch(handle, moves, self)

    def pin(self, keys: Sequence[Hashable]) -> list[Hashable]:
        """Protects stored `keys` from eviction; returns the keys pinned (those not stored are
        skipped). Give the same list to `unpin` when done."""
        with self._lock:
            return self.manager.pin(keys)

    def unpin(self, keys: Sequence[Hashable]) -> list[Hashable]:
        """Undoes one `pin` of each key; returns the keys unpinned (a key holding no pin is
        skipped, as `pin` skips a key that is not stored)."""
        with self._lock:
            unpinned, moves = self.manager.unpin(keys)
            self._runner.submit_moves(moves)
            return unpinned

    def apply_hint(self, keys: Sequence[Hashable], *, session: str | None = None, retain_s: float | None = None,
                   closed: bool = False, tenant: str | None = None) -> bool:
        """Applies one request's retention hint to its block keys (see `kvtier.deciding.retention`).

        Call it once the request's blocks are stored or being stored: a lease covers only blocks
        kvtier holds. With no hint fields, the keys count as used outside any session, so that no
        later close dooms them. Deadlines run on this process's monotonic clock.

        Args:
            keys: the request's block keys, head first.
            session, retain_s, closed: the hint, as `kvtier.integrations.hints.RetentionHint` holds it.
            tenant: whose retention budget a lease is charged to (default: the config's tenant).
        Returns:
            True if applied; False if refused: a field out of range (counted `refused:<reason>`) or
            hints off in the config (counted `disabled`), both in `snapshot()["hints"]`. A hint
            never raises: it is advice, and the request it came with is served either way.
        """
        with self._lock:
            if not self.config.hints.enabled:
                self.stats.hints["disabled"] += 1
                return False
            try:
                self.manager.apply_hint(keys, now=time.monotonic(), session=session, retain_s=retain_s,
                                        closed=closed, tenant=self.config.tenant if tenant is None else tenant)
            except HintError as e:  # counted by the manager
                log.debug("kvtier: %s", e)
                return False
            if self._shared is not None:  # the pool's copies keep it too (queued, sent off this thread)
                self._shared.forward_hint(keys, retain_s=retain_s, closed=closed)
        return True

    def num_retained(self, tenant: str | None = None) -> int:
        """Blocks under a retention hint now, `tenant`'s or everyone's."""
        with self._lock:
            return self.manager.num_retained(tenant)

    def log_residency(self, limit: int | None) -> None:
        """Starts logging which blocks become ready in or leave each tier below HBM, up to `limit`
        entries between `take_residency` calls (see `kvtier.deciding.residency`); None stops it.

        Raises:
            ConfigError: `limit` is not a positive number.
        """
        log = ResidencyLog(limit) if limit is not None else None
        with self._lock:
            self.manager.log_residency(log)
            self._residency = log

    def take_residency(self) -> ResidencyBatch:
        """The residency changes logged since the last call, in order, and the drops counted
        (empty when `log_residency` is off)."""
        with self._lock:
            return self._residency.take() if self._residency is not None else ResidencyBatch()

    def where(self, keys: Sequence[Hashable]) -> list[TierKind | None]:
        """The fastest tier holding a ready copy of each key (None: not stored)."""
        with self._lock:
            return [self.manager.where(k) for k in keys]

    def quiesce(self, timeout_s: float | None = None) -> None:
        """Waits until no demotion, promotion or prefetch is in flight (stores and loads: use their handles).

        Raises:
            TimeoutError: moves still in flight after `timeout_s` (per wait).
        """
        while True:
            with self._lock:
                handles = {id(h): h for h in self._runner.moves_in_flight()}
            if not handles:
                return
            for h in handles.values():
                h.wait(timeout_s)

    def recheck(self) -> list[TierKind]:
        """Probes every tier out of service now, without waiting for its backoff (a background
        prober does this on its own); returns the tiers that answered and are back in the cascade."""
        return self._service.recheck()

    def wait_for_tiers(self, timeout_s: float | None = None) -> bool:
        """Waits until every tier is in service again (the background prober puts a tier back as
        soon as it answers); True if so, False if some tier is still out after `timeout_s`."""
        return self._service.wait(timeout_s)

    def usage(self) -> dict[str, dict[str, int]]:
        """Per tier: slots used and total."""
        with self._lock:
            return {k.name.lower(): {"used": self.manager.num_used(k), "slots": self.manager.num_slots(k)}
                    for k in self.manager.order}

    def snapshot(self) -> dict[str, object]:
        """Usage, every counter, and the tiers out of service now (`unavailable`, with why)."""
        with self._lock:
            snap = {"usage": self.usage(), **self.stats.snapshot(), "unavailable": self._service.facts(),
                    "store_backlog_bytes": self._backlog_bytes, "cost": self.cost.facts().as_dict(),
                    "retained_blocks": self.manager.num_retained()}
        pool = self.tiers.get(TierKind.POOL)
        client = pool.client_counters() if isinstance(pool, SharedTier) else None
        if client is not None:
            snap["pool_client"] = client
        return snap

    def describe(self) -> dict[str, object]:
        return {"block_bytes": self.layout.block_bytes, "block_tokens": self.layout.block_tokens,
                "num_layers": self.layout.num_layers, "mode": self.config.mode.value,
                "num_restored_blocks": self._num_restored_blocks,
                "tiers": [self.tiers[k].describe() for k in self.manager.order]}

    def serve_metrics(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Exports Prometheus metrics on http://addr:port/metrics until `close()`; returns the port."""
        from kvtier.observing.metrics import RuntimeCollector, serve_metrics

        if self._metrics_server is not None:
            raise KVTierError("metrics are already being served")
        self._metrics_server, bound = serve_metrics(RuntimeCollector(self.snapshot, self.describe), port, addr)
        return bound

    def close(self) -> None:
        """Waits for transfers in flight, then releases every tier. Idempotent.

        Every part is closed even when one fails (a disk that died, a pool node gone), so nothing
        is left open behind the first failure.

        Raises:
            TierIOError: once, after everything was closed, naming each part that failed to close.
        """
        if self._closed:
            return
        self._closed = True
        steps = [("metrics", self._metrics_server.shutdown if self._metrics_server is not None else None),
                 ("tier prober", self._service.close),
                 ("transfer engine", self.engine.close)]
        failures = _run_all(steps + self._tier_closers())
        if failures:
            raise TierIOError("KVTier.close: " + "; ".join(f"{name}: {e}" for name, e in failures)
                              + " (everything else was closed)") from failures[0][1]

    def __enter__(self) -> "KVTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------------------

    def _share_host_memory(self) -> None:
        """Tells each shared tier (the pool) about the host-memory tiers' slabs (DRAM), so that on
        RDMA it moves blocks between a DRAM slot and the pool without a staging copy."""
        shared = [tier for tier in self.tiers.values() if isinstance(tier, SharedTier)]
        for tier in self.tiers.values():
            rows = tier.memory_rows() if tier.medium is Medium.HOST else None
            if rows is not None and shared:
                for other in shared:
                    other.register_host_memory(rows.view(-1))

    def _slots(self, cfg: TierConfig) -> TierSlots:
        tier = self.tiers[cfg.kind]
        write_through = (tier.can_share if tier.shared else None) if cfg.write_through is None \
            else (lambda key: True) if cfg.write_through else None
        return TierSlots(cfg.kind, tier.num_slots, make_policy(cfg.policy, tier.num_slots),
                         cfg.admission, cfg.high_watermark, cfg.low_watermark, write_through, tier.may_drop)

    def _backlog_room(self) -> int:
        """Bytes the store backlog has left (caller holds the lock)."""
        return self.config.transfer.max_store_backlog_bytes - self._backlog_bytes

    def _take_backlog(self, num_bytes: int) -> bool:
        """Takes `num_bytes` of the store backlog where it has room (a negative count gives
        them back); whether it did. Caller holds the lock."""
        if num_bytes > self._backlog_room():
            return False
        self._backlog_bytes += num_bytes
        return True

    def _within_backlog(self, keys: Sequence[Hashable]) -> tuple[Sequence[Hashable], Sequence[Hashable]]:
        """The leading keys whose stores fit in the backlog, and the rest (counted as dropped).

        Stores in flight hold the caller's buffers and the workers' time; past
        `transfer.max_store_backlog_bytes` a new block is dropped at once, never queued for a
        stall. Caller holds the lock.
        """
        fits = max(self._backlog_room() // self.layout.block_bytes, 0)
        if fits >= len(keys):
            return keys, ()
        self.stats.dropped[DropReason.BACKLOG] += len(keys) - fits
        return keys[:fits], keys[fits:]

    def _set_available(self, tier: TierKind, available: bool) -> None:
        """Takes `tier` out of the cascade or puts it back (the tier service's call); lock held."""
        self._runner.submit_moves(self.manager.set_available(tier, available))

    def _recall(self) -> None:
        """Adopts the blocks a persistent tier (`Tier.persist`) recorded in an earlier run under
        this runtime's model, tenant and block layout."""
        fingerprint = xxhash.xxh3_128_digest(repr((self.config.model, self.config.tenant, self.layout.block_tokens,
                                                   self.layout.layer_bytes)).encode())
        for kind, tier in self.tiers.items():
            if tier.persist:
                entries = tier.recall(fingerprint, self.layout.num_layers)
                if entries:
                    adopted = self.manager.adopt(kind, ((key, slot, sums) for slot, key, sums in entries))
                    self._num_restored_blocks += adopted
                    log.info("kvtier %s tier: %d blocks restored from an earlier run", kind.name, adopted)

    def _cancel_prefetch(self, prefetch: Prefetch) -> None:
        with self._lock:  # asked now, not when the prefetch started: a load may have joined since
            prefetch.handle.cancel(self.manager.cancellable(prefetch.moves))

    def _caller_ends(self, keys: Sequence[Hashable], blocks, what: str) -> dict[Hashable, Endpoint]:
        """The caller's block of each key as a copy's end: row `i` of a `[len(keys), block_bytes]`
        uint8 tensor with dense rows (one piece of memory for the whole batch), or the `i`-th of
        a sequence (or first dimension) of 1-D contiguous uint8 tensors of a block each.

        Raises:
            ValueError: a block of the wrong dtype, shape or layout (naming `what[i]`), a count
                that differs from the keys', or a key twice.
        """
        n = self.layout.block_bytes
        rows = isinstance(blocks, torch.Tensor) and blocks.dim() == 2
        if rows and blocks.shape[1] == n and blocks.dtype == torch.uint8 and (n == 1 or blocks.stride(1) == 1):
            count, ends = blocks.shape[0], [Endpoint(buffer=blocks, slot=i) for i in range(blocks.shape[0])]
        else:
            bufs = blocks.unbind(0) if isinstance(blocks, torch.Tensor) and blocks.dim() else list(blocks)
            for i, b in enumerate(bufs):
                if b.dtype != torch.uint8 or b.dim() != 1 or b.numel() != n or not b.is_contiguous():
                    raise ValueError(f"{what}[{i}]: expected a contiguous uint8 tensor of {n} bytes, "
                                     f"got {b.dtype} {tuple(b.shape)}")
            count, ends = len(bufs), [Endpoint(buffer=b) for b in bufs]
        if count != len(keys):
            raise ValueError(f"{what}: {count} blocks for {len(keys)} keys")
        found = dict(zip(keys, ends))
        if len(found) != len(keys):
            raise ValueError(f"{what}: duplicate keys in one call")
        return found

    def _tier_closers(self) -> list[tuple[str, Callable[[], None]]]:
        return [(f"{kind.name} tier", tier.close) for kind, tier in self.tiers.items()]

    def _close_tiers(self) -> None:
        """Closes every tier built so far, after a failed start: the start's own error is what
        the caller sees, so a tier that also fails to close is only logged."""
        for name, e in _run_all(self._tier_closers()):
            log.warning("closing the %s after a failed start: %s", name, e)


def _run_all(steps: Sequence[tuple[str, Callable[[], None] | None]]) -> list[tuple[str, Exception]]:
    """Runs every step in order, even after one fails; returns the (name, error) of each that failed."""
    failures = []
    for name, step in steps:
        if step is None:
            continue
        try:
            step()
        except Exception as e:  # collected, not swallowed: close() raises them together
            failures.append((name, e))
    return failures


def _layout_from_model(config: KVTierConfig) -> BlockLayout:
    from kvtier.model.catalog import resolve_model
    return resolve_model(config.model, kv_dtype=config.kv_dtype).block_layout(config.block_tokens)
