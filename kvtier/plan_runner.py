"""Running the manager's plans: each turned into copies, submitted, and its completion applied.

`KVTier` asks the manager for a plan under its lock and hands it here. A `PlanRunner` makes the
plan's copies (`CopyOp`) from what the plan carries (slots, and the checksums a read from below
DRAM is checked against) and what it knows itself (which tier is which medium), submits them to
the transfer engine, and applies each finished transfer back: to the manager (the matching
`complete_*`/`finish_store` verb, whose moves it submits in turn), to the tier service (a tier
that failed as a whole leaves the cascade) and to the persistent tiers (what landed). It never
reads the manager's index.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence

from kvtier.deciding.cost import LoadCost
from kvtier.deciding.manager import LoadPlan, Move, StorePlan, TierManager
from kvtier.deciding.plans import Fallback, Placement
from kvtier.errors import KVTierError
from kvtier.kinds import Medium, TierKind
from kvtier.model.layout import BlockLayout
from kvtier.moving.engine import CopyOp, Endpoint, TransferEngine
from kvtier.moving.handle import Failure, Stage, TransferHandle
from kvtier.observing.stats import DropReason, Stats
from kvtier.tiers.base import Tier

log = logging.getLogger(__name__)

_BELOW_DRAM = (Medium.REMOTE, Medium.DISK)
_READ_FAILURES = {Stage.VERIFY: DropReason.CHECKSUM, Stage.READ: DropReason.READ_FAILED}


class PlanRunner:
    """Runs plans of one runtime (see the module docstring).

    Args:
        tiers, layout, manager, engine, stats: the runtime's.
        lock: the runtime's lock: the manager is asked and told only under it.
        note: `note(tier, failure)`: the tier service's, told of every copy that failed.
        cost: the load-time estimates, fed by loads that came whole from one tier.
    """

    def __init__(self, tiers: Mapping[TierKind, Tier], layout: BlockLayout, manager: TierManager,
                 engine: TransferEngine, lock: threading.RLock, stats: Stats,
                 note: Callable[[TierKind, Failure], None], cost: LoadCost) -> None:
        self.tiers, self.layout, self.manager, self.engine = tiers, layout, manager, engine
        self.stats, self.cost, self._lock, self._note = stats, cost, lock, note
        # Whether each tier is below DRAM (its writes compute checksums, its reads check them).
        self._below_dram = {kind: tier.medium in _BELOW_DRAM for kind, tier in tiers.items()}
        self._persistent = {kind: tier.persist for kind, tier in tiers.items()}
        self._done = _done_handle(layout)  # what an empty batch of moves returns: shared, finished
        self._move_handles: dict[int, TransferHandle] = {}

    def moves_in_flight(self) -> list[TransferHandle]:
        """The handles of the moves not yet applied (caller holds the lock)."""
        return list({id(h): h for h in self._move_handles.values()}.values())

    def load_ops(self, plan: LoadPlan, buffers: Mapping[Hashable, Endpoint]) -> list[CopyOp]:
        """The copies of a load plan into the caller's buffers (caller holds the lock): each from
        its source, checked where it is below DRAM, after the move it joined, with its fallback."""
        tiers, below, moving = self.tiers, self._below_dram, self._move_handles
        return [CopyOp(s.key, Endpoint(tiers[s.tier], s.slot), buffers[s.key],
                       self._expected(s.key, s.tier, s.checksums) if below[s.tier] else None, False,
                       moving.get(s.after_move) if s.after_move is not None else None,
                       self._fallback_op(s.key, s.fallback, buffers[s.key]) if s.fallback is not None else None)
                for s in plan.sources]

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
        return CopyOp(key, Endpoint(self.tiers[fallback.tier], fallback.slot), dst,
                      verify=self._expected(key, fallback.tier, fallback.checksums), checksum=checksum)

    def submit_moves(self, moves: Sequence[Move], background: bool = True) -> TransferHandle:
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
            handle = self.submit_moves(first, background)
            self.submit_moves(rest, background)
            return handle
        ops = []
        for m in moves:  # a destination below DRAM computes the checksums the plan does not carry
            needs_sum = m.checksums is None and self._below_dram[m.dst]
            dst = Endpoint(self.tiers[m.dst], m.dst_slot)
            ops.append(CopyOp(m.key, Endpoint(self.tiers[m.src], m.src_slot), dst, verify=self._expected(m.key, m.src, m.checksums),
                              checksum=needs_sum, fallback=self._fallback_op(m.key, m.fallback, dst, needs_sum)))
        if not ops:
            return self._done
        handle = TransferHandle([op.key for op in ops], self.layout.num_layers)
        for m in moves:  # before submitting: a small batch runs inline, `_on_moved` included
            self._move_handles[m.id] = handle
        try:
            return self.engine.submit(ops, lambda h: self._on_moved(moves, h), handle=handle, background=background)
        except RuntimeError:  # the engine is closed
            for m in moves:
                self._move_handles.pop(m.id, None)
            raise

    def follow_up(self, moves: Sequence[Move]) -> None:
        """Starts the moves a transfer that just ended asks for (room made below it, a promotion
        due), as `submit_moves`; caller holds the lock. Where kvtier closed meanwhile (a transfer
        in flight when `KVTier.close` began ends while it waits), they are abandoned (`_abandon`),
        not raised to the transfer, which went through."""
        try:
            self.submit_moves(moves)
        except RuntimeError:
            if not self.engine.closed:
                raise
            self._abandon(moves)

    def finish_store(self, plan: StorePlan, first: TransferHandle, caller: TransferHandle,
                     buffers: Mapping[Hashable, Endpoint], refused: Mapping[Hashable, str],
                     on_end: Callable[[], None]) -> None:
        """Completes a store once its first copies landed (`first`), in this thread while the
        caller's buffers are still its to read: writes its write-through copies, then whatever
        the manager plans again below a tier that failed (`TierManager.finish_store`), until
        nothing is left; then gives the caller's handle its outcome, once, and finishes it.

        A block is stored if any of its copies landed; it failed if none did (the last failure is
        the one reported), or if it was refused at once (`refused`: no room, backlog full).
        `on_end` runs last, before the caller's handle finishes, whatever happened."""
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
            on_end()
            caller.finish(error)

    def _write(self, plan: StorePlan, buffers: Mapping[Hashable, Endpoint]) -> TransferHandle:
        """Writes `plan`'s copies from the caller's buffers in this thread; their handle."""
        with self._lock:
            ops = self.store_ops(plan.placements, buffers)
        return self.engine.run_now(ops, TransferHandle([p.key for p in plan.placements], self.layout.num_layers))

    def store_ops(self, placements: Sequence[Placement], buffers: Mapping[Hashable, Endpoint]) -> list[CopyOp]:
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
                self._note(tier, h.failed[key])
            outcome = self.manager.finish_store(plan, failed, sums)
            self.follow_up(outcome.moves)
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

    def loaded(self, plan: LoadPlan, h: TransferHandle, started: float) -> None:
        self._note_load_time(plan, h, time.perf_counter() - started)
        with self._lock:
            failed = None
            if h.failed or h.fell_back:  # else every read went well: nothing to note
                for s in plan.sources:
                    self._note_reads(s.key, s.tier, s.fallback, h)
                # The manager learns what each source copy's own read did (a fallback's is not held against it).
                failed = {k: _failure_reason(f, f.stage) for k, f in {**h.failed, **h.fell_back}.items()}
            self.follow_up(self.manager.complete_load(plan, failed))
            self.manager.order_chain(h.keys)

    def _note_reads(self, key: Hashable, tier: TierKind, fallback: Fallback | None, h: TransferHandle) -> None:
        """Tells the tier service how `key`'s read from `tier`, and from its fallback copy where
        the first failed, went (a tier that failed as a whole leaves the cascade), and counts a
        block its fallback delivered. Caller holds the lock."""
        first, last = h.fell_back.get(key), h.failed.get(key)
        if first is None:
            if last is not None:
                self._note(tier, last)
            return
        self._note(tier, first)
        if last is None:
            self.stats.fallback_reads[fallback.tier] += 1
        else:
            self._note(fallback.tier, last)

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
                    self._note(m.dst, f)
                    if m.key in h.fell_back:  # its source had failed before, its fallback was read
                        self._note(m.src, h.fell_back[m.key])
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
            self.follow_up(follow)

    def _abandon(self, moves: Sequence[Move]) -> None:
        """Moves asked for once the engine closed: never started, and not given back to the
        manager, which would only plan them again (its state goes with the runtime). Logged, not
        counted as drops: nothing is lost that closing would not lose (the copies they would have
        moved stay where they are, and memory tiers end with the runtime)."""
        if moves:
            log.info("kvtier: %d moves asked for while closing were not started", len(moves))

    def _remember(self, landed) -> None:
        """Tells each persistent tier the blocks that just became READY in it, given as (key, tier,
        slot, checksums: those the plan carried or the write computed); caller holds the lock.
        A copy the completion already freed (its slot owned by another block, or by none) is
        not recorded."""
        for key, tier, slot, checksums in landed:
            if checksums is not None and self._persistent.get(tier) and self.manager.owner(tier, slot) == key:
                self.tiers[tier].remember(slot, key, checksums)


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


def _done_handle(layout: BlockLayout) -> TransferHandle:
    h = TransferHandle((), layout.num_layers)
    h.finish()
    return h
