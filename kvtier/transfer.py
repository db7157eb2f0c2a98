"""The transfer engine moves bytes; it decides nothing.

It executes batches of `CopyOp`s between endpoints — a slot of a tier, or a caller's buffer —
layer by layer, and reports per-layer progress and per-block failures on a `TransferHandle`.
Each copy takes the `Route` its engine's route table holds for (source medium, destination
medium): a tier's `Medium`, and for a caller's buffer `Medium.HOST` (CPU memory) or
`Medium.DEVICE` (CUDA memory). Adding a way to move bytes is adding an entry (`add_route`); a
copy between two media with no entry is refused when it is submitted. The built-in entries:

- host ↔ host (DRAM, CPU buffers): one NumPy copy;
- memory ↔ memory with a device end (HBM, CUDA buffers): `Tensor.copy_` on the engine's own CUDA
  stream, the layer completing on a CUDA event (a CPU tensor standing in for HBM: a NumPy copy);
- disk/remote → host: the tier's `read` into the destination itself; → device: into a host
  staging buffer, then up to the device;
- host → disk/remote: the tier's `write` from the source itself; device →: down into a staging
  buffer first; disk/remote → disk/remote: read into a staging buffer, written from it.

Disk and remote routes run on the I/O worker pool so the blocks of one layer are in flight
together (queue depth = workers); a shared tier (the pool) is told each slot's key (`bind`)
before it is read or written.

Every route checks the bytes it reads against the per-layer checksums (xxh3-64) a copy carries
(`CopyOp.verify`: the runtime gives them for every read from below DRAM) before the layer is
reported done, and computes them on the way where the copy asks (`CopyOp.checksum`: every write
below DRAM whose block has none yet). A checksum
is seeded with the block's key and the layer's index (`block_seed`), so it binds the bytes to the
block and the place they belong: a record whose key was moved (a misdirected write, an offset bug,
a swapped journal entry) or a layer read from another layer's offset fails the check and is a
miss, never another block's KV served as good.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch
import xxhash

from kvtier.cpus import pin_thread
from kvtier.errors import IntegrityError, TierUnavailable, TransferError
from kvtier.handle import Failure, Stage, TransferHandle
from kvtier.layout import BlockLayout
from kvtier.stats import Stats
from kvtier.tiers.base import Medium, Tier, TierKind, copy_bytes

log = logging.getLogger(__name__)
_U64 = (1 << 64) - 1
_TIER_NAMES = {kind: kind.name.lower() for kind in TierKind}  # route labels, built once: every copy names two
_BUFFER_NAMES = {"cpu": "buffer:cpu", "cuda": "buffer:cuda"}
_HOST, _DEVICE = Medium.HOST, Medium.DEVICE
_SLOW = (Medium.REMOTE, Medium.DISK)
_NO_SUMS: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One end of a copy: `slot` of `tier`, or a caller's `buffer` holding one whole block."""

    tier: Tier | None = None
    slot: int = -1
    buffer: torch.Tensor | None = None

    @property
    def name(self) -> str:
        if self.tier is not None:
            return _TIER_NAMES[self.tier.kind]
        kind = self.buffer.device.type
        return _BUFFER_NAMES.get(kind) or f"buffer:{kind}"

    def view(self, offset: int, length: int) -> torch.Tensor | None:
        if self.buffer is not None:
            return self.buffer[offset: offset + length]
        return self.tier.view(self.slot, offset, length)

    @property
    def medium(self) -> enum.Enum:
        """What the route table knows this end by: its tier's medium; for a buffer, `DEVICE`
        (CUDA memory) or `HOST` (CPU memory)."""
        if self.tier is not None:
            return self.tier.medium
        return _DEVICE if self.buffer.is_cuda else _HOST

    @property
    def below_dram(self) -> bool:
        return self.tier is not None and self.tier.medium in _SLOW


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy block `key` from `src` to `dst`.

    Attributes:
        verify: expected per-layer checksums of the source bytes, checked after each layer's read.
        checksum: compute per-layer checksums of the bytes (into `handle.checksums`).
        after: a transfer that writes `src` (a move this copy joined); layer `l` is read only after
            `after` has finished layer `l`, and the copy fails if `after` failed this key.
        fallback: the same block's copy from another source (same `key` and `dst`, its own
            `verify`): where a span cannot be read from `src` or fails its check, that span and the
            rest are read from here before the layers are reported, and the block is in
            `handle.fell_back` instead of `handle.failed` (unless the fallback fails too).
    """

    key: Hashable
    src: Endpoint
    dst: Endpoint
    verify: tuple[int, ...] | None = None
    checksum: bool = False
    after: TransferHandle | None = None
    fallback: CopyOp | None = None


def block_seed(key: Hashable) -> int:
    """The 64-bit seed of `key`'s checksums: a digest of the key's bytes (its `repr` for keys that
    are not bytes, e.g. the integers tests use), so equal keys agree across processes and restarts."""
    return xxhash.xxh3_64_intdigest(key if isinstance(key, bytes) else repr(key).encode())


def layer_checksum(host_bytes: torch.Tensor, seed: int = 0, layer: int = 0) -> int:
    """xxh3-64 of a CPU uint8 tensor's bytes, seeded with `seed` (a `block_seed`) and the layer index."""
    return xxhash.xxh3_64_intdigest(host_bytes.numpy(), seed=(seed + layer) & _U64)


# `copy(op, first, last, ready)`: see `Route`.
RouteCopy = Callable[[CopyOp, int, int, "torch.cuda.Event | None"], Sequence[int]]


@dataclass(frozen=True, slots=True)
class Route:
    """How one copy goes from a medium to another: an entry of a `TransferEngine`'s route table.

    Attributes:
        copy: `copy(op, first, last, ready)` copies layers `first..last` of `op`'s block, checks
            the source bytes against `op.verify` where given, and returns their per-layer
            checksums where `op.checksum` asks for them (else an empty sequence). `ready` is the
            CUDA event after the caller's queued GPU work (None without CUDA), which a copy that
            reads a caller's device buffer must wait on. A block that fails raises `StageError`
            (the stage, the cause, the layer); any other exception fails the whole batch as a bug.
            A copy may run on any worker thread, several at once, never two on the same slot.
        io: the copy waits on a disk or the network: it runs on the I/O workers, the blocks of one
            layer in flight together, and never inline in the submitting thread.
        host_rows: both ends are memory, so a whole block between two host-memory rows
            (`Tier.host_rows`, a CPU buffer) may be copied by one NumPy copy instead of `copy`.
    """

    copy: RouteCopy
    io: bool = False
    host_rows: bool = False


class StageError(Exception):
    """One block's copy failed at `stage` (`Stage.READ`, `WRITE`, `VERIFY`) because of `cause`, at
    `layer` (None: the first of the span); the block is reported failed, the batch goes on."""

    def __init__(self, stage: str, cause: BaseException, layer: int | None = None) -> None:
        super().__init__(f"{stage}: {cause}")
        self.stage, self.cause, self.layer = stage, cause, layer


class TransferEngine:
    """Runs batches of copies on worker threads, each by the route of its two ends' media.

    Args:
        layout: the block layout every copy follows.
        io_workers: threads for disk/remote I/O (the queue depth of one layer's batch).
        job_workers: batches that may run at once.
        chunk_bytes: consecutive layers are copied together until a copy reaches this size
            (0: one copy per layer).
        inline_bytes: a batch of at most this many bytes whose copies are all host memory to
            host memory (no CUDA, no I/O route, no copy waiting on another transfer) runs
            in the submitting thread instead of a worker (0: never). Handing a small copy to a
            worker and back costs far more than the copy (~100 µs against ~6 µs for 64 KiB on a
            loaded 2-core host), which dominated small stores and loads on CPU engines.
        stats: receives bytes moved per (source, destination).
        background_nice: the nice value added to the threads of background batches (demotions,
            promotions, prefetches; `submit(background=True)`): on a host whose cores the engine's
            own compute threads fill (a CPU engine), moving blocks between tiers then takes only
            the time the engine leaves, instead of slowing its forward passes (0: same priority).
        cpus: the CPUs every worker thread is bound to (None: those of the submitting thread,
            which a CPU engine may have bound to its compute cores; see `kvtier.cpus`).

    Foreground batches (the engine's stores and loads) and background ones run on separate
    workers, so a load never queues behind a burst of demotions. The route table starts with
    the built-in routes between the four `Medium`s (see the module docstring); `add_route`
    adds one.
    """

    def __init__(self, layout: BlockLayout, *, io_workers: int = 4, job_workers: int = 4,
                 chunk_bytes: int = 0, inline_bytes: int = 0, stats: Stats | None = None,
                 background_nice: int = 0, cpus: Sequence[int] | None = None) -> None:
        self.layout = layout
        self.chunk_bytes = chunk_bytes
        self.inline_bytes = inline_bytes
        self.stats = stats or Stats()
        self._lanes = (_Lane("kvtier", job_workers, io_workers, 0, cpus),
                       _Lane("kvtier-bg", job_workers, io_workers, background_nice, cpus))
        self._all_spans = self._layer_spans(range(layout.num_layers))  # the usual case, computed once
        self._local = threading.local()
        self._cuda = _CudaCopier() if torch.cuda.is_available() else None
        self._routes: dict[tuple[enum.Enum, enum.Enum], Route] = {}
        # The same entries keyed by the media's ids, which each copy looks up: an Enum member's
        # hash is a Python call (~250 ns a medium on this host), its id a C one, and members are
        # singletons, so the id names the member.
        self._by_id: dict[tuple[int, int], Route] = {}
        for (src, dst), route in self._builtin_routes().items():
            self.add_route(src, dst, route)
        self._closed = False

    # ---- the route table -----------------------------------------------------------------

    @property
    def routes(self) -> Mapping[tuple[enum.Enum, enum.Enum], Route]:
        """The route table, read-only: (source medium, destination medium) -> `Route`."""
        return MappingProxyType(self._routes)

    def add_route(self, src: enum.Enum, dst: enum.Enum, route: Route) -> None:
        """Adds (or replaces) the route of copies from medium `src` to medium `dst`.

        Media are enum members (a `Medium`, or a new medium's own enum) and the table is keyed by
        the members themselves. Call before submitting copies that take the route.

        Raises:
            TypeError: a medium that is not an enum member, or a route that is not a `Route`.
        """
        if not isinstance(src, enum.Enum) or not isinstance(dst, enum.Enum):
            raise TypeError(f"add_route: media must be enum members (e.g. Medium.DISK), got {src!r} -> {dst!r}")
        if not isinstance(route, Route):
            raise TypeError(f"add_route {src} -> {dst}: expected a Route, got {type(route).__name__}")
        self._routes[src, dst] = route
        self._by_id[id(src), id(dst)] = route

    def route(self, src: Endpoint, dst: Endpoint) -> Route:
        """The route a copy from `src` to `dst` takes.

        Raises:
            TransferError: the table has no route between the two ends' media (it names both).
        """
        # `Endpoint.medium` of each end, inlined: this runs once per copy submitted.
        a = src.tier.medium if src.tier is not None else (_DEVICE if src.buffer.is_cuda else _HOST)
        b = dst.tier.medium if dst.tier is not None else (_DEVICE if dst.buffer.is_cuda else _HOST)
        route = self._by_id.get((id(a), id(b)))
        if route is None:
            raise TransferError(f"no transfer route from {a} ({src.name}) to {b} ({dst.name}); "
                                "add one with TransferEngine.add_route")
        return route

    def _builtin_routes(self) -> dict[tuple[enum.Enum, enum.Enum], Route]:
        host, device = Medium.HOST, Medium.DEVICE
        memory = Route(self._copy_device, host_rows=True)
        routes = {(host, host): Route(self._copy_host, host_rows=True),
                  (host, device): memory, (device, host): memory, (device, device): memory}
        for slow in _SLOW:
            routes[slow, host] = Route(self._read_into_host, io=True)
            routes[slow, device] = Route(self._read_into_device, io=True)
            routes[host, slow] = Route(self._write_from_host, io=True)
            routes[device, slow] = Route(self._write_from_device, io=True)
            for other in _SLOW:
                routes[slow, other] = Route(self._relay, io=True)
        return routes

    # ---- submission ----------------------------------------------------------------------

    def submit(self, ops: Sequence[CopyOp], on_done: Callable[[TransferHandle], None] | None = None,
               layers: Sequence[int] | None = None, handle: TransferHandle | None = None,
               background: bool = False, inline: bool = True) -> TransferHandle:
        """Starts copying `ops`; returns at once.

        Jobs start in submission order, and a copy only waits (`after`) on transfers submitted
        before it, so waiting never deadlocks the worker pool.

        Args:
            ops: the copies, one per block.
            on_done: called on a worker thread once every layer is done, before `wait()` returns.
            layers: copy only these layers (default: all, in order).
            handle: report on this handle (it may carry more keys than `ops`, e.g. misses
                already marked failed); default a new one for the ops' keys.
            background: nobody is waiting on it (a move between tiers, an engine's store): the
                background workers, at a lower priority.
            inline: a small host batch may run in this thread (`inline_bytes`); False keeps this
                thread's time for its own work (an engine's forward pass).
        Raises:
            RuntimeError: the engine is closed.
            TransferError: a copy between two media the route table has no route for (nothing
                of the batch is started).
        """
        if self._closed:
            raise RuntimeError("transfer engine is closed")
        routes = [self.route(op.src, op.dst) for op in ops]
        handle = handle or TransferHandle([op.key for op in ops], self.layout.num_layers)
        if self._cuda is not None:  # the caller's pending GPU work on its buffers comes first
            handle.cuda_ready = self._cuda.mark_caller()
        lane = self._lanes[background]
        if inline and self._runs_inline(ops, routes):  # done when this returns; `on_done` has run in this thread
            self._run_whole(ops, routes, handle, on_done, layers, time.perf_counter())
        else:
            lane.jobs.submit(self._run, lane, list(ops), routes, handle, on_done, layers, time.perf_counter())
        return handle

    def run_now(self, ops: Sequence[CopyOp], handle: TransferHandle,
                on_done: Callable[[TransferHandle], None] | None = None) -> TransferHandle:
        """Copies `ops` in the calling thread (all but one of a batch's disk and remote copies
        still on the I/O workers, so that they are in flight together) and returns when they are
        done, `on_done` run and `handle` finished. For a caller that would only wait for a
        worker (a thread hand-off and the wake-up back cost 60-120 µs on a virtualized host), and
        for a completion callback that must copy more before its own handle finishes (the
        runtime's store retries). Raises as `submit`."""
        if self._closed:
            raise RuntimeError("transfer engine is closed")
        routes = [self.route(op.src, op.dst) for op in ops]
        if self._cuda is not None:
            handle.cuda_ready = self._cuda.mark_caller()
        started = time.perf_counter()
        if self._host_only(ops, routes):  # each block one copy, as an inline batch
            self._run_whole(ops, routes, handle, on_done, None, started)
        else:
            self._run(self._lanes[0], list(ops), routes, handle, on_done, None, started)
        return handle

    def _runs_inline(self, ops: Sequence[CopyOp], routes: list[Route]) -> bool:
        """Whether `ops` qualify to run in the caller's thread (see `inline_bytes`)."""
        return len(ops) * self.layout.block_bytes <= self.inline_bytes and self._host_only(ops, routes)

    def _host_only(self, ops: Sequence[CopyOp], routes: list[Route]) -> bool:
        """Copies between memories alone, without CUDA: no I/O route, none waiting on another transfer."""
        if self._cuda is not None:
            return False
        for op, route in zip(ops, routes):
            if route.io or op.after is not None:
                return False
        return True

    def close(self) -> None:
        """Waits for running transfers, then stops the workers. Idempotent."""
        if not self._closed:
            self._closed = True
            for lane in self._lanes:
                lane.close()

    # ---- execution -----------------------------------------------------------------------

    def _run(self, lane: _Lane, ops: list[CopyOp], routes: list[Route], handle: TransferHandle, on_done,
             layers, submitted: float) -> None:
        error: BaseException | None = None
        try:
            for first, last in self._spans(layers):
                self._run_span(lane, ops, routes, handle, first, last)
                handle.layer_done(last)
            self._observe(ops, handle, time.perf_counter() - submitted)
            if on_done is not None:
                on_done(handle)
        except BaseException as e:  # a bug: surfaced to every waiter by handle.wait()
            log.exception("transfer of %d blocks failed", len(ops))
            error = e
        handle.finish(error)

    def _run_whole(self, ops: Sequence[CopyOp], routes: list[Route], handle: TransferHandle, on_done, layers,
                   submitted: float) -> None:
        """An inline batch (`_runs_inline`): the caller sees it only once it is done, so layer
        progress cannot be watched and each block is one copy of its layers, without spans."""
        if layers is not None:
            return self._run(self._lanes[0], list(ops), routes, handle, on_done, layers, submitted)
        error: BaseException | None = None
        last = self.layout.num_layers - 1
        try:
            rows: list[CopyOp] = []  # copied row to row: their bytes are counted once, below
            for op, route in zip(ops, routes):
                if handle.is_cancelled(op.key):
                    handle.fail(op.key, Stage.CANCELLED, 0, "cancelled")
                elif op.key not in handle.failed:
                    if route.host_rows and self._copy_rows(op):
                        rows.append(op)
                    else:
                        self._copy_guarded(op, route, handle, 0, last)
            if rows:
                self._count_rows(rows)
            handle.layer_done(last)
            self._observe(ops, handle, time.perf_counter() - submitted)
            if on_done is not None:
                on_done(handle)
        except BaseException as e:  # a bug: surfaced to every waiter by handle.wait()
            log.exception("transfer of %d blocks failed", len(ops))
            error = e
        handle.finish(error)

    def _copy_rows(self, op: CopyOp) -> bool:
        """Copies a whole block between host-memory rows (`Tier.host_rows`, a CPU buffer) with one
        NumPy copy and no tensor views; False where an end is not such memory (then its route
        copies it)."""
        if op.verify is not None or op.checksum:
            return False
        src, dst = _row(op.src), _row(op.dst)
        if src is None or dst is None:
            return False
        np.copyto(dst, src, casting="no")
        return True

    def _count_rows(self, ops: list[CopyOp]) -> None:
        """Bytes moved by `_copy_rows` copies, one count per route (the others count themselves)."""
        if len(ops) == 1:
            self.stats.add_bytes(ops[0].src.name, ops[0].dst.name, self.layout.block_bytes)
            return
        for (src, dst), n in Counter((op.src.name, op.dst.name) for op in ops).items():
            self.stats.add_bytes(src, dst, n * self.layout.block_bytes)

    def _observe(self, ops: Sequence[CopyOp], handle: TransferHandle, seconds: float) -> None:
        """Per-block latency, from submission to the last layer landing, by route."""
        if len(ops) == 1:  # the usual small call: no Counter
            if ops[0].key not in handle.failed:
                self.stats.observe_transfer(ops[0].src.name, ops[0].dst.name, seconds, 1)
            return
        routes = Counter((op.src.name, op.dst.name) for op in ops if op.key not in handle.failed)
        for (src, dst), n in routes.items():
            self.stats.observe_transfer(src, dst, seconds, n)

    def _spans(self, layers: Sequence[int] | None) -> list[tuple[int, int]]:
        """Runs of consecutive layers copied as one range, each at least `chunk_bytes` when possible.

        Fewer, larger copies cost less per byte; a layer is still reported as soon as the span
        holding it lands, so `chunk_bytes=0` gives strictly per-layer progress.
        """
        return self._all_spans if layers is None else self._layer_spans(layers)

    def _layer_spans(self, layers: Iterable[int]) -> list[tuple[int, int]]:
        spans: list[tuple[int, int]] = []
        for layer in layers:
            if spans and spans[-1][1] == layer - 1 and self._span_bytes(*spans[-1]) < self.chunk_bytes:
                spans[-1] = (spans[-1][0], layer)
            else:
                spans.append((layer, layer))
        return spans

    def _span_bytes(self, first: int, last: int) -> int:
        return self.layout.offsets[last + 1] - self.layout.offsets[first]

    def _run_span(self, lane: _Lane, ops: list[CopyOp], routes: list[Route], handle: TransferHandle,
                  first: int, last: int) -> None:
        live = [i for i, op in enumerate(ops) if self._still_live(op, handle, first, last)]
        slow = [i for i in live if routes[i].io]
        # All but one I/O copy go to the I/O workers, so that they are in flight together; this
        # thread does the last itself (at queue depth 1: no hand-off at all) and the memory ones.
        futures = [lane.io.submit(self._copy_guarded, ops[i], routes[i], handle, first, last) for i in slow[:-1]]
        for i in live:
            if not routes[i].io:
                self._copy_guarded(ops[i], routes[i], handle, first, last)
        if slow:
            self._copy_guarded(ops[slow[-1]], routes[slow[-1]], handle, first, last)
        if futures:
            wait(futures)
        if handle.fell_back:
            self._take_fallbacks(ops, routes, handle)
        if self._cuda is not None:
            self._cuda.sync()

    def _still_live(self, op: CopyOp, handle: TransferHandle, first: int, last: int) -> bool:
        if op.key in handle.failed:
            return False
        if handle.is_cancelled(op.key):
            handle.fail(op.key, Stage.CANCELLED, first, "cancelled")
            return False
        if op.after is not None:
            op.after.wait_layer(last)
            failure = op.after.failed.get(op.key)
            # The layers the move landed before it failed are in place and checked: they are
            # delivered, whether this copy reaches them before or after the move fails.
            if failure is not None and last >= failure.layer:
                handle.fail(op.key, Stage.DEPENDENCY, max(first, failure.layer), failure.error)
                return False
        return True

    def _take_fallbacks(self, ops: list[CopyOp], routes: list[Route], handle: TransferHandle) -> None:
        """Each copy whose source failed (`handle.fell_back`) reads its later spans from its fallback."""
        for i, op in enumerate(ops):
            if op.fallback is not None and op.key in handle.fell_back:
                ops[i], routes[i] = op.fallback, self.route(op.fallback.src, op.fallback.dst)

    def _copy_guarded(self, op: CopyOp, route: Route, handle: TransferHandle, first: int, last: int) -> None:
        try:
            checksums = route.copy(op, first, last, handle.cuda_ready)
        except StageError as e:
            # The failure is the whole span's: a route reads a span, checks it, then writes it, so
            # no layer of it is in place (the error's text names the layer that failed). Where the
            # source failed and the copy has a fallback, the span is copied from there instead.
            if op.fallback is not None and e.stage in (Stage.READ, Stage.VERIFY):
                handle.fell_back[op.key] = Failure(e.stage, first, str(e.cause), isinstance(e.cause, TierUnavailable))
                fallback = op.fallback
                return self._copy_guarded(fallback, self.route(fallback.src, fallback.dst), handle, first, last)
            handle.fail(op.key, e.stage, first, e.cause)
            return
        if checksums:
            handle.checksums.setdefault(op.key, []).extend(checksums)
        self.stats.add_bytes(op.src.name, op.dst.name, self._span_bytes(first, last))

    # ---- the built-in routes (see `Route` for what each must do) -----------------------------

    def _copy_host(self, op: CopyOp, first: int, last: int, ready=None) -> Sequence[int]:
        """host memory → host memory: one NumPy copy between the two ends' views."""
        offsets = self.layout.offsets
        offset = offsets[first]
        length = offsets[last + 1] - offset
        src = op.src.view(offset, length)
        checksums = self._check(op, src, first, last) if op.verify is not None or op.checksum else _NO_SUMS
        copy_bytes(op.dst.view(offset, length), src)
        return checksums

    def _copy_device(self, op: CopyOp, first: int, last: int, ready=None) -> Sequence[int]:
        """memory ↔ memory, one end device memory: `copy_` on this thread's CUDA stream, queued
        behind the caller's work (`ready`); the layer completes when the stream's event does
        (`_run_span`). A CPU tensor standing in for the device (no CUDA) is copied as host memory."""
        offsets = self.layout.offsets
        offset = offsets[first]
        length = offsets[last + 1] - offset
        src, dst = op.src.view(offset, length), op.dst.view(offset, length)
        checksums = _NO_SUMS
        if op.verify is not None or op.checksum:
            checksums = self._check(op, self._on_host(src, length, ready), first, last)
        if src.is_cuda or dst.is_cuda:
            self._cuda.copy(dst, src, blocking=False, after=ready)
        else:
            copy_bytes(dst, src)
        return checksums

    def _read_into_host(self, op: CopyOp, first: int, last: int, ready=None) -> Sequence[int]:
        """disk/remote → host memory: the tier reads straight into the destination, whose bytes
        are checked before the layer is reported done."""
        offsets = self.layout.offsets
        offset = offsets[first]
        host = op.dst.view(offset, offsets[last + 1] - offset)
        self._read(op, host, offset)
        return self._check(op, host, first, last)

    def _read_into_device(self, op: CopyOp, first: int, last: int, ready=None) -> Sequence[int]:
        """disk/remote → device memory: read into a host staging buffer, checked there, then copied
        up and waited for (the buffer is reused at once); a CPU stand-in is read into directly."""
        offsets = self.layout.offsets
        offset = offsets[first]
        length = offsets[last + 1] - offset
        dst = op.dst.view(offset, length)
        host = self._staging(length, 0) if dst.is_cuda else dst
        self._read(op, host, offset)
        checksums = self._check(op, host, first, last)
        if host is not dst:
            self._cuda.copy(dst, host, blocking=True, after=ready)
        return checksums

    def _write_from_host(self, op: CopyOp, first: int, last: int, ready=None) -> Sequence[int]:
        """host memory → disk/remote: checksums of the source's bytes, then the tier's write from them."""
        offsets = self.layout.offsets
        offset = offsets[first]
        host = op.src.view(offset, offsets[last + 1] - offset)
        checksums = self._check(op, host, first, last)
        self._write(op, host, offset)
        return checksums

    def _write_from_device(self, op: CopyOp, first: int, last: int, ready=None) -> Sequence[int]:
        """device memory → disk/remote: down into a host staging buffer (after the caller's work,
        waited for), then as from host memory."""
        offsets = self.layout.offsets
        offset = offsets[first]
        length = offsets[last + 1] - offset
        host = self._on_host(op.src.view(offset, length), length, ready)
        checksums = self._check(op, host, first, last)
        self._write(op, host, offset)
        return checksums

    def _relay(self, op: CopyOp, first: int, last: int, ready=None) -> Sequence[int]:
        """disk/remote → disk/remote: read into a host staging buffer, checked, written from it."""
        offsets = self.layout.offsets
        offset = offsets[first]
        host = self._staging(offsets[last + 1] - offset, 0)
        self._read(op, host, offset)
        checksums = self._check(op, host, first, last)
        self._write(op, host, offset)
        return checksums

    # ---- what the routes share -------------------------------------------------------------

    def _read(self, op: CopyOp, host: torch.Tensor, offset: int) -> None:
        """The source tier's `read` of the span at `offset` into `host`; a shared tier is told the key first."""
        tier, slot = op.src.tier, op.src.slot
        if tier.shared:
            tier.bind(slot, op.key)
        _stage(Stage.READ, tier.read, slot, host, offset)

    def _write(self, op: CopyOp, host: torch.Tensor, offset: int) -> None:
        """The destination tier's `write` of `host` at `offset`; a shared tier is told the key first."""
        tier, slot = op.dst.tier, op.dst.slot
        if tier.shared:
            tier.bind(slot, op.key)
        _stage(Stage.WRITE, tier.write, slot, host, offset)

    def _on_host(self, t: torch.Tensor, length: int, ready=None) -> torch.Tensor:
        """`t` itself where it is host memory; else a staging copy of it, waited for."""
        if not t.is_cuda:
            return t
        host = self._staging(length, 1)
        self._cuda.copy(host, t, blocking=True, after=ready)
        return host

    def _check(self, op: CopyOp, host: torch.Tensor, first: int, last: int) -> Sequence[int]:
        """Checks `host` (layers first..last of the block, in host memory) against `op.verify`,
        where given; returns their checksums where `op.checksum` asks for them."""
        if op.verify is None and not op.checksum:
            return _NO_SUMS
        checksums = self._checksums(host, op.key, first, last)
        if op.verify is not None:
            for layer, got in zip(range(first, last + 1), checksums):
                if got != op.verify[layer]:
                    raise StageError(Stage.VERIFY, IntegrityError(
                        f"block {_short(op.key)} layer {layer} from {op.src.name} slot {op.src.slot}: "
                        "checksum mismatch"), layer)
        return checksums if op.checksum else _NO_SUMS

    def _checksums(self, host: torch.Tensor, key: Hashable, first: int, last: int) -> list[int]:
        """`layer_checksum` of each layer in `host` (layers first..last), from one view of its
        bytes: slicing a memoryview per layer costs a fraction of a tensor slice and `.numpy()`."""
        base, offsets, seed = self.layout.offsets[first], self.layout.offsets, block_seed(key)
        data, digest = memoryview(host.numpy()), xxhash.xxh3_64_intdigest
        return [digest(data[offsets[l] - base: offsets[l + 1] - base], seed=(seed + l) & _U64)
                for l in range(first, last + 1)]

    def _staging(self, length: int, which: int) -> torch.Tensor:
        """A per-thread host buffer (pinned with CUDA) of at least `length` bytes."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = [torch.empty(0, dtype=torch.uint8)] * 2
        if bufs[which].numel() < length:
            bufs[which] = torch.empty(length, dtype=torch.uint8, pin_memory=self._cuda is not None)
        return bufs[which][:length]


class _Lane:
    """Workers for one kind of batch: jobs (one batch each) and I/O threads (its slow copies),
    their threads `nice`d by `nice` and bound to `cpus` (Linux applies both per thread)."""

    def __init__(self, name: str, job_workers: int, io_workers: int, nice: int,
                 cpus: Sequence[int] | None = None) -> None:
        def init() -> None:
            if nice:
                _lower_priority(nice)
            pin_thread(cpus)
        self.jobs = ThreadPoolExecutor(job_workers, thread_name_prefix=f"{name}-job", initializer=init)
        self.io = ThreadPoolExecutor(io_workers, thread_name_prefix=f"{name}-io", initializer=init)

    def close(self) -> None:
        self.jobs.shutdown(wait=True)
        self.io.shutdown(wait=True)


def _lower_priority(nice: int) -> None:
    """Adds `nice` to the calling thread's nice value (best effort: logged where refused)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + nice, 19))
    except (AttributeError, OSError) as e:
        log.debug("background transfer threads keep their priority: %s", e)


def _stage(stage: str, fn, *args) -> None:
    try:
        fn(*args)
    except (OSError, IndexError, IntegrityError) as e:
        raise StageError(stage, e) from e


def _row(end: Endpoint) -> np.ndarray | None:
    """A whole block's bytes at `end` as a NumPy array, where they are host memory; else None."""
    if end.buffer is not None:
        if end.buffer.device.type != "cpu" or end.buffer.requires_grad:
            return None
        return end.buffer.numpy()
    rows = end.tier.host_rows()
    return rows[end.slot] if rows is not None and 0 <= end.slot < len(rows) else None


def _short(key: Hashable) -> str:
    return key.hex()[:16] if isinstance(key, bytes) else repr(key)


class _CudaCopier:
    """Device↔host and device↔device copies on a dedicated CUDA stream per worker thread.

    A layer's copies are queued asynchronously; `sync()` at the end of the layer waits on an event
    recorded after them, so the layer is reported done only when its bytes have landed.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def _stream(self) -> torch.cuda.Stream:
        s = getattr(self._local, "stream", None)
        if s is None:
            s = self._local.stream = torch.cuda.Stream()
        return s

    @staticmethod
    def mark_caller() -> "torch.cuda.Event":
        """An event after the work the caller's current stream has queued (e.g. the kernel that
        wrote a buffer now being stored); copies wait on it, not on the whole device."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return event

    def copy(self, dst: torch.Tensor, src: torch.Tensor, blocking: bool, after=None) -> None:
        stream = self._stream()
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        if blocking:
            stream.synchronize()

    def sync(self) -> None:
        stream = getattr(self._local, "stream", None)
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            event.synchronize()


__all__ = ["CopyOp", "Endpoint", "Failure", "Route", "Stage", "StageError", "TransferEngine", "TransferHandle",
           "block_seed", "layer_checksum"]
