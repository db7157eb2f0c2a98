"""`KVTier`: what an inference engine holds — the manager and the transfer engine, wired.

The engine sees four verbs (see DESIGN.md): `lookup`, `load`, `store`, `prefetch`. Each asks the
manager for a plan under one lock, hands the plan to the transfer engine, and applies the
completion when the transfer reports back. The lock is never held while bytes move.

The plans are the whole interface to the manager: the runtime turns each into copies (`CopyOp`)
from what the plan carries (slots, and the checksums a read from below DRAM is checked against)
and what it knows itself (which tier is which medium), and never reads the manager's index. What
only the manager can answer later, under the lock (may this prefetch still be cancelled, is this
slot still the block's), it asks through the manager's methods. How the bytes go from one medium
to another is the transfer engine's choice (its route table), not the runtime's.
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
from kvtier.errors import ConfigError, KVTierError, TierIOError
from kvtier.moving.handle import Failure, Stage, TransferHandle
from kvtier.tiers.health import TierService
from kvtier.model.layout import BlockLayout
from kvtier.deciding.manager import LoadPlan, Move, StorePlan, TierManager, TierSlots
from kvtier.deciding.plans import Fallback, Placement
from kvtier.tiers.shared_lookup import SharedLookup
from kvtier.policy import make_policy
from kvtier.observing.stats import DropReason, Stats
from kvtier.tiers.base import Medium, Tier, TierKind
from kvtier.tiers.build import build_tier
from kvtier.tiers.shared import SharedTier
from kvtier.moving.engine import CopyOp, Endpoint, TransferEngine

log = logging.getLogger(__name__)

_BELOW_DRAM = (Medium.REMOTE, Medium.DISK)
_READ_FAILURES = {Stage.VERIFY: DropReason.CHECKSUM, Stage.READ: DropReason.READ_FAILED}


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
            self._recall()
        except BaseException:
            self._close_tiers()
            raise
        self.engine = TransferEngine(self.layout, io_workers=config.transfer.io_workers,
                                     chunk_bytes=config.transfer.chunk_bytes,
                                     inline_bytes=config.transfer.inline_bytes, stats=self.stats,
                                     background_nice=config.transfer.background_nice,
                                     cpus=config.transfer.cpus)
        # Whether each tier is below DRAM (its writes compute checksums, its reads check them).
        self._below_dram = {kind: tier.medium in _BELOW_DRAM for kind, tier in self.tiers.items()}
        self._persistent = {kind: tier.persist for kind, tier in self.tiers.items()}
        self._done = _done_handle(self.layout)  # what an empty batch of moves returns: shared, finished
        self._backlog_bytes = 0  # bytes of stores submitted and not yet applied
        self.cost = LoadCost(self.layout.block_tokens)
        self._lock = threading.RLock()
        self._service = TierService(self.tiers, self._lock, self._set_available, self.stats,
                                    config.transfer.tier_retry_s, config.transfer.tier_retry_max_s)
        self._move_handles: dict[int, TransferHandle] = {}
        # The tier other processes store into too (the pool), asked for what the index lacks.
        shared = next((k for k, t in self.tiers.items() if t.shared), None)
        self._shared = None if shared is None else SharedLookup(
            shared, self.tiers[shared], self.manager, self._lock, self.stats, self._submit_moves)
        self._metrics_server = None
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
        buffers = self._caller_ends(keys, blocks, "blocks")
        with self._lock:
            taken, over = self._within_backlog(keys)
            plan = self.manager.prepare_store(taken, target)
            self._submit_moves(plan.moves)
            caller = TransferHandle(keys, self.layout.num_layers)
            refused = {key: "no tier had room for the block" for key in plan.rejected}
            refused.update((key, "the store backlog is full: dropped rather than waited for") for key in over)
            backlog = len(plan.all_placements) * self.layout.block_bytes
            self._backlog_bytes += backlog
            ops = self._store_ops(plan.placements, buffers)
        first = TransferHandle([p.key for p in plan.placements], self.layout.num_layers)

        def on_done(h: TransferHandle) -> None:
            self._finish_store(plan, h, caller, buffers, refused, backlog)

        if sync:  # outside the lock, as a worker would run it: the plan holds the slots until it completes
            self.engine.run_now(ops, first, on_done)
        else:  # a write-through copy (the pool) is never written in the caller's thread
            self.engine.submit(ops, on_done, handle=first, background=background,
                               inline=not background and not plan.through)
        return caller

    def load(self, keys: Sequence[Hashable], into: torch.Tensor | Sequence[torch.Tensor], *,
             sync: bool = False) -> TransferHandle:
        """Copies stored blocks into the caller's buffers, layer by layer.

        `handle.wait_layer(l)` returns once layer `l` of every block is in place. A block that is
        not stored, or fails on the way (I/O error, checksum mismatch), is in `handle.failed` and
        its buffer content is undefined: treat it as a miss. `sync`: the caller would wait for the
        handle at once: the copies run in its thread (no hand-off to a worker and back), the
        handle is done on return, and a hung disk or node holds the caller (no wait timeout).
        """
        buffers = self._caller_ends(keys, into, "into")
        with self._lock:
            plan = self.manager.prepare_load(keys)
            self._submit_moves(plan.moves, background=False)
            tiers, below, moving = self.tiers, self._below_dram, self._move_handles
            ops = [CopyOp(s.key, Endpoint(tiers[s.tier], s.slot), buffers[s.key],
                          self._expected(s.key, s.tier, s.checksums) if below[s.tier] else None, False,
                          moving.get(s.after_move) if s.after_move is not None else None,
                          self._fallback_op(s.key, s.fallback, buffers[s.key]) if s.fallback is not None else None)
                   for s in plan.sources]
            handle = TransferHandle(keys, self.layout.num_layers)
            for key in plan.missing:
                handle.fail(key, Stage.READ, 0, "not stored")
            started = time.perf_counter()

            def on_done(h: TransferHandle) -> None:
                self._on_loaded(plan, h, started)

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
            handle = self._submit_moves(moves)
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
            self._submit_moves(moves)
            return unpinned

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
                handles = {id(h): h for h in self._move_handles.values()}
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
                    "store_backlog_bytes": self._backlog_bytes, "cost": self.cost.facts().as_dict()}
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

    def _end(self, tier: TierKind, slot: int) -> Endpoint:
        return Endpoint(self.tiers[tier], slot)

    def _expected(self, key: Hashable, tier: TierKind, checksums: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """What a read of `key` from `tier` is checked against: the `checksums` its plan carries
        where the tier is below DRAM; None where the read is not checked."""
        if not self._below_dram[tier]:
            return None
        if checksums is None and self.tiers[tier].checks_reads:
            return None  # adopted from a shared tier, which checks each block it reads
        if checksums is None:
            raise KVTierError(f"block {key!r} in {tier.name} has no checksum to verify")
        return checksums

    def _fallback_op(self, key: Hashable, fallback: Fallback | None, dst: Endpoint,
                     checksum: bool = False) -> CopyOp | None:
        """The copy of `key` from its plan's fallback copy into `dst` (see `plans.Fallback`), or None."""
        if fallback is None:
            return None
        return CopyOp(key, self._end(fallback.tier, fallback.slot), dst,
                      verify=self._expected(key, fallback.tier, fallback.checksums), checksum=checksum)

    def _submit_moves(self, moves: Sequence[Move], background: bool = True) -> TransferHandle:
        """Starts `moves` as one batch, on the background workers unless a caller waits on them
        (`background=False`: the promotions a load reads from); caller holds the lock.

        A handle knows one outcome per block, so two moves of one block (a victim demoted both
        into a shared pool and to a tier below that keeps it) go in separate batches; the
        handle returned is the first batch's (only demotions come in pairs, and nobody waits on
        those)."""
        seen: set[Hashable] = set()
        if len(moves) > 1 and len({m.key for m in moves}) != len(moves):
            first, rest = [], []
            for m in moves:
                (rest if m.key in seen else first).append(m)
                seen.add(m.key)
            handle = self._submit_moves(first, background)
            self._submit_moves(rest, background)
            return handle
        ops = []
        for m in moves:  # a destination below DRAM computes the checksums the plan does not carry
            needs_sum = m.checksums is None and self.tiers[m.dst].medium in _BELOW_DRAM
            dst = self._end(m.dst, m.dst_slot)
            ops.append(CopyOp(m.key, self._end(m.src, m.src_slot), dst, verify=self._expected(m.key, m.src, m.checksums),
                              checksum=needs_sum, fallback=self._fallback_op(m.key, m.fallback, dst, needs_sum)))
        if not ops:
            return self._done
        handle = TransferHandle([op.key for op in ops], self.layout.num_layers)
        for m in moves:  # before submitting: a small batch runs inline, `_on_moved` included
            self._move_handles[m.id] = handle
        return self.engine.submit(ops, lambda h: self._on_moved(moves, h), handle=handle, background=background)

    def _within_backlog(self, keys: Sequence[Hashable]) -> tuple[Sequence[Hashable], Sequence[Hashable]]:
        """The leading keys whose stores fit in the backlog, and the rest (counted as dropped).

        Stores in flight hold the caller's buffers and the workers' time; past
        `transfer.max_store_backlog_bytes` a new block is dropped at once, never queued for a
        stall. Caller holds the lock.
        """
        room = self.config.transfer.max_store_backlog_bytes - self._backlog_bytes
        fits = max(room // self.layout.block_bytes, 0)
        if fits >= len(keys):
            return keys, ()
        self.stats.dropped[DropReason.BACKLOG] += len(keys) - fits
        return keys[:fits], keys[fits:]

    def _finish_store(self, plan: StorePlan, first: TransferHandle, caller: TransferHandle,
                      buffers: Mapping[Hashable, Endpoint], refused: Mapping[Hashable, str], backlog: int) -> None:
        """Completes a store once its first copies landed (`first`), in this thread while the
        caller's buffers are still its to read: writes its write-through copies, then whatever
        the manager plans again below a tier that failed (`TierManager.finish_store`), until
        nothing is left; then gives the caller's handle its outcome, once, and finishes it.

        A block is stored if any of its copies landed; it failed if none did (the last failure is
        the one reported), or if it was refused at once (`refused`: no room, backlog full)."""
        error: BaseException | None = None
        failures: dict[Hashable, Failure] = {}
        stored: set[Hashable] = set()
        try:
            retry = self._apply_store(plan.first_copies(), first, failures, stored)
            for copies in plan.through:
                self._apply_store(copies, self._write(copies, buffers), failures, stored)
            while retry is not None:
                retry = self._apply_store(retry, self._write(retry, buffers), failures, stored)
            for key, why in refused.items():
                caller.fail(key, Stage.WRITE, 0, why)
            for key, failure in failures.items():
                if key not in stored:
                    caller.failed.setdefault(key, failure)
            caller.checksums.update((k, v) for k, v in first.checksums.items() if k not in first.failed)
            with self._lock:  # the caller's keys are one request's blocks, head first
                self.manager.order_chain(caller.keys)
        except BaseException as e:  # a bug: surfaced to every waiter by caller.wait()
            log.exception("completing a store of %d blocks failed", len(caller.keys))
            error = e
        finally:
            with self._lock:
                self._backlog_bytes -= backlog
            caller.finish(error)

    def _write(self, plan: StorePlan, buffers: Mapping[Hashable, Endpoint]) -> TransferHandle:
        """Writes `plan`'s copies from the caller's buffers in this thread; their handle."""
        with self._lock:
            ops = self._store_ops(plan.placements, buffers)
        return self.engine.run_now(ops, TransferHandle([p.key for p in plan.placements], self.layout.num_layers))

    def _store_ops(self, placements: Sequence[Placement], buffers: Mapping[Hashable, Endpoint]) -> list[CopyOp]:
        tiers, below = self.tiers, self._below_dram
        return [CopyOp(p.key, buffers[p.key], Endpoint(tiers[p.tier], p.slot), checksum=below[p.tier])
                for p in placements]

    def _apply_store(self, plan: StorePlan, h: TransferHandle, failures: dict[Hashable, Failure],
                     stored: set[Hashable]) -> StorePlan | None:
        """Tells the manager how one group of a store's copies went (`h`); notes each copy's
        failure with the tier service (a tier that failed as a whole leaves the cascade) and
        records the outcome in `failures`/`stored`. Returns what the manager plans again."""
        failed = [(p.key, p.tier) for p in plan.placements if p.key in h.failed]
        sums = {k: tuple(v) for k, v in h.checksums.items() if k not in h.failed}
        with self._lock:
            for key, tier in failed:
                self._service.note(tier, h.failed[key])
            outcome = self.manager.finish_store(plan, failed, sums)
            self._submit_moves(outcome.moves)
            self._remember((p.key, p.tier, p.slot, sums.get(p.key)) for p in plan.placements
                                 if p.key not in h.failed)
        for key, failure in h.failed.items():
            failures[key] = failure
        stored.update(p.key for p in plan.placements if p.key not in h.failed)
        stored.update(outcome.stored)
        if outcome.retry is not None:
            for key in outcome.retry.rejected:
                failures.setdefault(key, Failure(Stage.WRITE, 0, "no tier below had room for the block"))
        return outcome.retry

    def _on_loaded(self, plan: LoadPlan, h: TransferHandle, started: float) -> None:
        self._note_load_time(plan, h, time.perf_counter() - started)
        with self._lock:
            for s in plan.sources:
                self._note_reads(s.key, s.tier, s.fallback, h)
            # The manager learns what each source copy's own read did (a fallback's is not held against it).
            failed = {k: _failure_reason(f, f.stage) for k, f in {**h.failed, **h.fell_back}.items()}
            self._submit_moves(self.manager.complete_load(plan, failed))
            self.manager.order_chain(h.keys)

    def _note_reads(self, key: Hashable, tier: TierKind, fallback: Fallback | None, h: TransferHandle) -> None:
        """Tells the tier service how `key`'s read from `tier`, and from its fallback copy where
        the first failed, went (a tier that failed as a whole leaves the cascade), and counts a
        block its fallback delivered. Caller holds the lock."""
        first, last = h.fell_back.get(key), h.failed.get(key)
        if first is None:
            if last is not None:
                self._service.note(tier, last)
            return
        self._service.note(tier, first)
        if last is None:
            self.stats.fallback_reads[fallback.tier] += 1
        else:
            self._service.note(fallback.tier, last)

    def _note_load_time(self, plan: LoadPlan, h: TransferHandle, seconds: float) -> None:
        """Feeds a load that came whole from one tier to the load-time estimate of that tier (a
        block promoted before it was read counts for the tier it was promoted from)."""
        if not plan.sources or h.failed:
            return
        came_from = {m.id: m.src for m in plan.moves}
        if any(s.after_move is not None and s.after_move not in came_from for s in plan.sources):
            return  # it waited on another's move (a prefetch): its time is not this tier's
        origins = {came_from[s.after_move] if s.after_move is not None else s.tier for s in plan.sources}
        if len(origins) == 1:
            self.cost.note_load(origins.pop(), len(plan.sources), seconds)

    def _on_moved(self, moves: Sequence[Move], h: TransferHandle) -> None:
        with self._lock:
            follow: list[Move] = []
            for m in moves:
                self._move_handles.pop(m.id, None)
                f = h.failed.get(m.key)
                if f is not None and f.stage == Stage.WRITE:
                    self._service.note(m.dst, f)
                    if m.key in h.fell_back:  # its source had failed before, its fallback was read
                        self._service.note(m.src, h.fell_back[m.key])
                else:
                    self._note_reads(m.key, m.src, m.fallback, h)
                f_source = h.fell_back.get(m.key) or f  # what the source's own read did, if it failed
                failure = None if f_source is None or f_source.stage == Stage.CANCELLED else _failure_reason(
                    f_source, DropReason.DEMOTION_FAILED)
                if f is not None and f.stage == Stage.CANCELLED:
                    self.stats.prefetch_cancelled += 1
                sums = tuple(h.checksums[m.key]) if f is None and m.key in h.checksums else None
                follow += self.manager.complete_move(m.id, f is None, sums, failure)
            self._remember((m.key, m.dst, m.dst_slot, m.checksums or _computed(h, m.key))
                                 for m in moves if m.key not in h.failed)
            self._submit_moves(follow)

    def _set_available(self, tier: TierKind, available: bool) -> None:
        """Takes `tier` out of the cascade or puts it back (the tier service's call); lock held."""
        self._submit_moves(self.manager.set_available(tier, available))

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

    def _remember(self, landed) -> None:
        """Tells each persistent tier the blocks that just became READY in it, given as (key, tier,
        slot, checksums: those the plan carried or the write computed); caller holds the lock.
        A copy the completion already freed (its slot owned by another block, or by none) is
        not recorded."""
        for key, tier, slot, checksums in landed:
            if checksums is not None and self._persistent.get(tier) and self.manager.owner(tier, slot) == key:
                self.tiers[tier].remember(slot, key, checksums)

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


def _computed(h: TransferHandle, key: Hashable) -> tuple[int, ...] | None:
    """The checksums transfer `h` computed for `key`, if it did."""
    sums = h.checksums.get(key)
    return tuple(sums) if sums is not None else None


def _failure_reason(failure: Failure, otherwise: str) -> str:
    """What the manager is told of a failed copy: a corrupt or unreadable source (discarded), a
    source whose tier is down (kept: the tier may come back), or `otherwise`."""
    if failure.stage == Stage.READ and failure.unavailable:
        return DropReason.TIER_DOWN
    return _READ_FAILURES.get(failure.stage, otherwise)


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


def _done_handle(layout: BlockLayout) -> TransferHandle:
    h = TransferHandle((), layout.num_layers)
    h.finish()
    return h


def _layout_from_model(config: KVTierConfig) -> BlockLayout:
    from kvtier.model.catalog import resolve_model
    return resolve_model(config.model, kv_dtype=config.kv_dtype).block_layout(config.block_tokens)
