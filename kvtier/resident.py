"""The resident path: a load or store that stays in one memory tier, without a plan.

Most of what an engine asks is a load whose blocks are all in DRAM, or a store of new blocks
into DRAM. The general path spends a few Python steps per block on it (a plan entry, a copy op,
a route lookup, a completion entry), ~7 µs a block on a 2-vCPU host, more than a 64 KiB block's
copy. Here the same decisions are a few C calls over the manager's columns for the whole batch
(`TierManager.lease_resident`/`end_resident`, `place_resident`/`finish_resident`), made in the
caller's thread, and the copy is one native call (`TransferEngine.copy_rows`): in the caller's
thread, or for a background store (an engine saving what it computed) on a background worker,
for a store too large to run inline on a foreground worker, or for a load too large to run
inline on a worker, in runs of layers each reported as it lands.

A batch qualifies when the caller's blocks are one `[n, block_bytes]` host tensor with dense rows
and the manager finds it plain (see its verbs). Anything else (a miss, a block in flight or on
SSD, a promotion due, a full tier with a tier below, duplicate keys, a bad argument) returns None
before changing anything, and the caller takes the general path, which also gives the errors.
What the general path would count (hits, stores, evictions, bytes and latency per route, the
load-time estimate) is counted the same; `tests/test_resident.py` holds the two paths equal.
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections.abc import Callable, Hashable, Mapping, Sequence

import torch

from kvtier.deciding.cost import LoadCost
from kvtier.deciding.manager import TierManager
from kvtier.kinds import TierKind
from kvtier.model.layout import BlockLayout
from kvtier.moving.engine import TransferEngine
from kvtier.moving.handle import Stage, TransferHandle
from kvtier.plan_runner import PlanRunner
from kvtier.tiers.base import Tier

log = logging.getLogger(__name__)


class ResidentPath:
    """Loads and stores of one runtime that stay in one memory tier (see the module docstring).

    Args:
        tiers, layout, manager, engine, runner, cost: the runtime's.
        lock: the runtime's lock: the manager is asked and told only under it.
        backlog: `backlog(n)`, under the lock: whether the store backlog has room for `n` more
            bytes, taking them if so (`backlog(-n)` gives them back).
    """

    def __init__(self, tiers: Mapping[TierKind, Tier], layout: BlockLayout, manager: TierManager,
                 engine: TransferEngine, runner: PlanRunner, cost: LoadCost, lock: threading.RLock,
                 backlog: Callable[[int], bool]) -> None:
        self.tiers, self.layout, self.manager, self.engine = tiers, layout, manager, engine
        self._runner, self._cost, self._lock, self._backlog = runner, cost, lock, backlog
        memory = [kind for kind, tier in tiers.items() if _host_rows(tier)]
        manager.serve_resident(memory)
        self._media = tuple({tiers[kind].medium for kind in memory})

    def load(self, keys: Sequence[Hashable], into, sync: bool) -> TransferHandle | None:
        """`KVTier.load` of `keys` into `into`; None where the batch does not qualify (nothing
        changed). Done and returned as a finished handle where `sync` or small enough to run
        inline; else copied on a worker, in runs of layers, each reported as it lands (the
        caller's `wait_layer(0)` returns before the last layers are in), as the general path does."""
        if not (sync or self.engine.host_only):
            return None  # with CUDA, only a call copied in this thread (streams order the caller's work)
        now = sync or self.engine.runs_inline(len(keys) * self.layout.block_bytes)
        rows = self._rows(keys, into)
        if rows is None:
            return None
        slots = array("i", bytes(4 * len(keys)))
        started = time.perf_counter()
        with self._lock:
            tier = self.manager.lease_resident(keys, slots)
        if tier is None:
            return None
        handle = TransferHandle(keys, self.layout.num_layers)

        def settle() -> None:
            self._runner.follow_up(self.manager.end_resident(tier, slots))

        def copy() -> None:
            error = self._copy(tier, slots, rows, into_rows=True, on_layers=None if now else handle.layer_done)
            if error is None:
                self._cost.note_load(tier, len(keys), time.perf_counter() - started)
            self._complete(handle, error, settle)

        self._run(copy, now, False, settle)
        return handle

    def store(self, keys: Sequence[Hashable], blocks, target: TierKind | None, sync: bool,
              background: bool) -> TransferHandle | None:
        """`KVTier.store` of `keys` from `blocks` into `target`; None where the batch does not
        qualify (nothing changed). Done and returned as a finished handle where `sync` or small
        enough to run inline; else copied by a worker (the background lane's for a `background`
        store, the foreground's for one too large to run inline) in one native call, and
        returned at once, its handle finished when the blocks are READY."""
        size = len(keys) * self.layout.block_bytes
        now = sync or (not background and self.engine.runs_inline(size))
        if not (now or self.engine.host_only):
            return None  # with CUDA, only a call copied in this thread (streams order the caller's work)
        rows = self._rows(keys, blocks)
        if rows is None:
            return None
        with self._lock:
            if not self._backlog(size):  # a batch the backlog would not take whole: the general path drops
                return None
            placed = self.manager.place_resident(keys, target)
            if placed is None:
                self._backlog(-size)
                return None
        handle = TransferHandle(keys, self.layout.num_layers)

        def settle(ok: bool = False) -> None:
            self._backlog(-size)
            self._runner.follow_up(self.manager.finish_resident(placed, ok=ok))

        def copy() -> None:
            error = self._copy(placed[0], placed[2], rows, into_rows=False, background=background)
            self._complete(handle, error, lambda: settle(ok=error is None))

        self._run(copy, now, background, settle)
        return handle

    def reserve(self, keys: Sequence[Hashable], target: TierKind | None) -> Reservation | None:
        """Slots for new blocks that the caller writes in place (see `Reservation`), placed as a
        store of them would be; None where such a store would not take this path, nothing changed."""
        if not self._plain(keys):
            return None
        with self._lock:
            placed = self.manager.place_resident(keys, target)
        if placed is None:
            return None
        rows = self.tiers[placed[0]].memory_rows()
        if rows is None:  # closed meanwhile
            with self._lock:
                self.manager.withdraw_resident(placed)
            return None
        return Reservation(self, tuple(keys), placed, rows)

    def _commit(self, reservation: Reservation, written: Sequence[bool]) -> None:
        """`Reservation.commit`, under the lock: the written blocks READY, the rest withdrawn."""
        tier, ids, slots = reservation.placed
        keep = [i for i, ok in enumerate(written) if ok]
        drop = [i for i, ok in enumerate(written) if not ok]
        with self._lock:
            if self.engine.closed:
                raise RuntimeError("kvtier is closed: the reserved blocks were not kept")
            moves = ()
            if keep:
                moves += self.manager.finish_resident((tier, _pick(ids, keep), _pick(slots, keep)))
            if drop:
                moves += self.manager.withdraw_resident((tier, _pick(ids, drop), _pick(slots, drop)))
            self._runner.submit_moves(moves)
            if keep:
                self.manager.order_chain([reservation.keys[i] for i in keep])

    def _run(self, copy: Callable[[], None], now: bool, background: bool, undo: Callable[[], None]) -> None:
        """Runs `copy` in this thread (`now`) or on a worker of the engine's background or
        foreground lane; where the engine closed meanwhile, `undo()`, under the lock, gives the
        manager back what the batch took, and the error is raised as the general path raises it."""
        if now:
            copy()
            return
        try:
            self.engine.run_job(copy, background)
        except RuntimeError:
            with self._lock:
                undo()
            raise

    def _complete(self, handle: TransferHandle, error: BaseException | None, settle: Callable[[], None]) -> None:
        """Tells the manager, under the lock, how the batch's copy went (`settle()`), then gives
        `handle` its outcome: a bug in either fails every block and is raised by `handle.wait()`,
        never leaves a waiter hanging."""
        try:
            with self._lock:
                settle()
                self.manager.order_chain(handle.keys)
        except BaseException as e:
            log.exception("completing a transfer of %d blocks failed", len(handle.keys))
            error = error or e
        if error is not None:
            for key in handle.keys:
                handle.fail(key, Stage.WRITE, 0, f"internal error in the transfer: {error!r}")
        handle.finish(error)  # as the transfer engine finishes one whose route raised

    def _plain(self, keys: Sequence[Hashable]) -> bool:
        """Whether a batch of `keys` may take this path at all: some keys, all distinct, an open
        engine whose memory tiers' routes are the built-in ones."""
        n = len(keys)
        if not (self._media and n) or self.engine.closed:
            return False
        if not all(self.engine.copies_rows(medium) for medium in self._media):
            return False  # a route replaced (`TransferEngine.add_route`) must see its copies
        return len(set(keys)) == n

    def _rows(self, keys: Sequence[Hashable], blocks) -> torch.Tensor | None:
        """`blocks` where the batch may take this path (`_plain`): a `[len(keys), block_bytes]`
        uint8 host tensor with dense, disjoint rows; else None."""
        n, size = len(keys), self.layout.block_bytes
        if not (isinstance(blocks, torch.Tensor) and blocks.dim() == 2):
            return None
        if (blocks.shape[0] != n or blocks.shape[1] != size or blocks.dtype != torch.uint8 or not blocks.is_cpu
                or (size > 1 and blocks.stride(1) != 1) or (n > 1 and blocks.stride(0) < size)):
            return None
        return blocks if self._plain(keys) else None

    def _copy(self, tier: TierKind, slots: array, rows: torch.Tensor, into_rows: bool,
              background: bool = False, on_layers=None) -> BaseException | None:
        """The batch's copy; the error that stopped it (a bug: memory copies do not fail), or None."""
        try:
            self.engine.copy_rows(self.tiers[tier], slots, rows, into_rows, background, on_layers)
        except Exception as e:
            log.exception("resident copy of %d blocks failed", len(slots))
            return e
        return None


class Reservation:
    """Slots of a host memory tier held for new blocks that the caller writes in place, row
    `slots[i]` of `rows` for `keys[i]`: an engine gathers what it computed straight into them,
    one copy where a store would make two (its own into a buffer, kvtier's into the tier).

    Until `commit` the blocks are WRITING: never served, never evicted, found by no lookup.
    `commit(written)` makes the blocks written READY (stored, counted, in the policy, as a store
    of them would leave them) and gives the other slots back. A reservation not committed
    keeps its slots: commit it, with nothing written if need be, before dropping it.

    `rows` is the whole tier, every other block's bytes included, handed over so that one
    native gather can write the reserved rows; write rows `slots` only (DRAM reads are not
    checksummed: a byte written elsewhere is another block's, served as it is).

    Attributes:
        keys: the blocks, one per slot.
        rows: the tier's `[num_slots, block_bytes]` uint8 host memory.
        slots: int64, the row of each key (as `native.gather_blocks(..., slots=)` takes them).
    """

    def __init__(self, path: ResidentPath, keys: tuple[Hashable, ...], placed: tuple[TierKind, array, array],
                 rows: torch.Tensor) -> None:
        self.keys, self.placed, self.rows = keys, placed, rows
        self.slots = torch.tensor(placed[2], dtype=torch.int64)
        self._path: ResidentPath | None = path

    @property
    def tier(self) -> TierKind:
        return self.placed[0]

    def commit(self, written: Sequence[bool] | None = None) -> None:
        """Ends the reservation: block i is kept where `written[i]` (default: every block).

        Raises:
            ValueError: `written` is not one flag per key.
            RuntimeError: committed already, or the runtime is closed (nothing is kept).
        """
        written = [True] * len(self.keys) if written is None else [bool(w) for w in written]
        if len(written) != len(self.keys):
            raise ValueError(f"commit: {len(written)} flags for {len(self.keys)} reserved blocks")
        path, self._path = self._path, None
        if path is None:
            raise RuntimeError("commit: this reservation is committed already")
        path._commit(self, written)


def _pick(values: array, positions: list[int]) -> array:
    return values if len(positions) == len(values) else array(values.typecode, (values[i] for i in positions))


def _host_rows(tier: Tier) -> bool:
    """Whether `tier`'s slots are host memory that a copy addresses directly."""
    rows = tier.memory_rows()
    return rows is not None and rows.is_cpu and rows.dim() == 2
