"""The transfer engine moves bytes; it decides nothing.

It executes batches of `CopyOp`s between endpoints — a slot of a tier, or a caller's buffer —
layer span by layer span, and reports per-layer progress and per-block failures on a
`TransferHandle`. Each span of a batch goes to the `Route`s its engine's route table holds for
(source medium, destination medium) — a tier's `Medium`, and for a caller's buffer `Medium.HOST`
(CPU memory) or `Medium.DEVICE` (CUDA memory) — one call per route with every block of the batch
(`SpanBatch`), so a route moves the whole batch in native code, outside the GIL, with no Python
per block. Adding a way to move bytes is adding an entry (`add_route`; `Route.per_block` turns a
single-block copy into one); a copy between two media with no entry is refused when it is
submitted. The built-in entries (`kvtier.moving.routes`):

- host ↔ host (DRAM, CPU buffers, a CPU tensor standing in for HBM): one native copy per batch;
- memory ↔ memory with a CUDA end: `Tensor.copy_` on the engine's own CUDA stream, the span
  completing on a CUDA event;
- disk/remote → memory: the tier's `read_spans` straight into the destinations (into a host
  staging buffer, then up, for device memory); memory → disk/remote: the tier's `write_spans`
  from the sources (down into a staging buffer first from device memory); disk/remote →
  disk/remote: `read_spans` into a host staging area, `write_spans` from it.

Spans: layers are copied in runs of at least `chunk_bytes`, each reported as it lands, so that
`wait_layer(l)` returns before later layers land; a batch nobody can watch (run in the caller's
thread) is one span of every layer.

Every route checks the bytes it reads against the per-layer checksums (xxh3-64) a copy carries
(`CopyOp.verify`: the runtime gives them for every read from below DRAM) before the layer is
reported done, and computes them on the way where the copy asks (`CopyOp.checksum`: every write
below DRAM whose block has none yet). A checksum is seeded with the block's key and the layer's
index (`block_seed`), so it binds the bytes to the block and the place they belong: a record
whose key was moved (a misdirected write, an offset bug, a swapped journal entry) or a layer
read from another layer's offset fails the check and is a miss, never another block's KV
served as good.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from types import MappingProxyType

import torch

from kvtier.moving.copies import BlockCopy, CopyOp, Endpoint, Route, SpanBatch, StageError, block_seed, layer_checksum
from kvtier.moving.cpus import pin_thread
from kvtier.errors import TierIOError, TierUnavailable, TransferError
from kvtier.moving.handle import Failure, Stage, TransferHandle
from kvtier.model.layout import BlockLayout
from kvtier.moving.routes import BuiltinRoutes
from kvtier.observing.stats import Stats
from kvtier.tiers.base import Medium

log = logging.getLogger(__name__)
_HOST, _DEVICE = Medium.HOST, Medium.DEVICE
_SLOW = (Medium.REMOTE, Medium.DISK)
_FALLBACK_STAGES = (Stage.READ, Stage.VERIFY)


class TransferEngine:
    """Runs batches of copies, each span of a batch by one call per route (see `Route`).

    Args:
        layout: the block layout every copy follows.
        io_workers: threads for disk/remote I/O that a block-by-block route spreads one batch's
            copies over (the queue depth), and that run a route's batch beside the memory
            copies of the same transfer.
        job_workers: batches that may run at once.
        chunk_bytes: consecutive layers are copied together until a copy reaches this size
            (0: one copy per layer).
        inline_bytes: a batch of at most this many bytes whose copies are all host memory to
            host memory (no CUDA, no I/O route, no copy waiting on another transfer) runs
            in the submitting thread instead of a worker (0: never). Handing a small copy to a
            worker and back costs far more than the copy (~100 µs against ~6 µs for 64 KiB on a
            loaded 2-core host), which dominated small stores and loads on CPU engines.
        copy_threads: native threads a host-memory copy of at least `PARALLEL_COPY_BYTES` per
            thread is shared among (see `BuiltinRoutes`).
        stats: receives bytes moved per (source, destination).
        background_nice: the nice value added to the threads of background batches (demotions,
            promotions, prefetches; `submit(background=True)`): on a host whose cores the engine's
            own compute threads fill (a CPU engine), moving blocks between tiers then takes only
            the time the engine leaves, instead of slowing its forward passes (0: same priority).
        cpus: the CPUs every worker thread is bound to (None: those of the submitting thread,
            which a CPU engine may have bound to its compute cores; see `kvtier.moving.cpus`).
        device_copier: `device_copier(device_index)`, the batched GPU copier to use for copies
            with a device end (tests give a stand-in); default, where CUDA is present, a
            `kvtier.moving.cuda_copy.CudaCopier` per device, built on first use (where it cannot be built,
            one warning, and such copies go block by block on the CUDA stream).

    Foreground batches (the engine's stores and loads) and background ones run on separate
    workers, so a load never queues behind a burst of demotions. The route table starts with
    the built-in routes between the four `Medium`s (see the module docstring); `add_route`
    adds one.
    """

    def __init__(self, layout: BlockLayout, *, io_workers: int = 4, job_workers: int = 4,
                 chunk_bytes: int = 0, inline_bytes: int = 0, copy_threads: int = 1, stats: Stats | None = None,
                 background_nice: int = 0, cpus: Sequence[int] | None = None,
                 device_copier: Callable[[int], object | None] | None = None) -> None:
        self.layout = layout
        self.chunk_bytes = chunk_bytes
        self.inline_bytes = inline_bytes
        self.stats = stats or Stats()
        self._lanes = (_Lane("kvtier", job_workers, io_workers, 0, cpus),
                       _Lane("kvtier-bg", job_workers, io_workers, background_nice, cpus))
        self._all_spans = self._layer_spans(range(layout.num_layers))  # the usual case, computed once
        self._whole = [(0, layout.num_layers - 1)]
        self._local = threading.local()
        self._cuda = _CudaCopier() if torch.cuda.is_available() else None
        self._copiers = _DeviceCopiers() if device_copier is None and self._cuda is not None else None
        self._builtin = BuiltinRoutes(layout, self._cuda, self._staging,
                                      device_copier or (self._copiers.get if self._copiers else None),
                                      copy_threads=copy_threads)
        self._routes: dict[tuple[enum.Enum, enum.Enum], Route] = {}
        # The same entries keyed by the media's ids, which each copy looks up: an Enum member's
        # hash is a Python call (~250 ns a medium on this host), its id a C one, and members are
        # singletons, so the id names the member.
        self._by_id: dict[tuple[int, int], Route] = {}
        self._builtin_table = self._builtin_routes()
        for (src, dst), route in self._builtin_table.items():
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
        host, device, routes = Medium.HOST, Medium.DEVICE, self._builtin
        memory = Route(routes.move_memory)
        table = {(host, host): Route(routes.move_host),
                 (host, device): memory, (device, host): memory, (device, device): memory}
        relay = Route(routes.relay, io=True)
        for slow in _SLOW:
            table[slow, host] = table[slow, device] = Route(routes.read, io=True)
            table[host, slow] = table[device, slow] = Route(routes.write, io=True)
            for other in _SLOW:
                table[slow, other] = relay
        return table

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
        routes, names = self._routes_of(ops)
        handle = handle or TransferHandle([op.key for op in ops], self.layout.num_layers)
        if self._cuda is not None:  # the caller's pending GPU work on its buffers comes first
            handle.cuda_ready = self._cuda.mark_caller()
        lane = self._lanes[background]
        if inline and self._runs_inline(ops, routes):  # done when this returns; `on_done` has run in this thread
            self._run(lane, list(ops), routes, names, handle, on_done, layers, time.perf_counter(), whole=True)
        else:
            lane.jobs.submit(self._run, lane, list(ops), routes, names, handle, on_done, layers, time.perf_counter())
        return handle

    def run_now(self, ops: Sequence[CopyOp], handle: TransferHandle,
                on_done: Callable[[TransferHandle], None] | None = None) -> TransferHandle:
        """Copies `ops` in the calling thread and returns when they are done, `on_done` run and
        `handle` finished; nobody watches the layers land, so each block's layers are one span
        (one call per route for the whole batch). For a caller that would only wait for a worker
        (a thread hand-off and the wake-up back cost 60-120 µs on a virtualized host), and for a
        completion callback that must copy more before its own handle finishes (the runtime's
        store retries). Raises as `submit`."""
        if self._closed:
            raise RuntimeError("transfer engine is closed")
        routes, names = self._routes_of(ops)
        if self._cuda is not None:
            handle.cuda_ready = self._cuda.mark_caller()
        self._run(self._lanes[0], list(ops), routes, names, handle, on_done, None, time.perf_counter(), whole=True)
        return handle

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def host_only(self) -> bool:
        """Whether no CUDA device is in use (then no copy waits on a stream's work)."""
        return self._cuda is None

    def run_job(self, job: Callable[[], None], background: bool = True) -> None:
        """Runs `job` on a worker of the background lane (or the foreground's), as a batch's
        copies run; for the resident path's background stores and large loads (`kvtier.resident`).

        Raises:
            RuntimeError: the engine is closed.
        """
        if self._closed:
            raise RuntimeError("transfer engine is closed")
        self._lanes[background].jobs.submit(job)

    def runs_inline(self, num_bytes: int) -> bool:
        """Whether a batch of `num_bytes` between host memories may run in the caller's thread
        (`inline_bytes`; never with CUDA present, whose streams order the caller's work)."""
        return self.host_only and num_bytes <= self.inline_bytes

    def copies_rows(self, medium: enum.Enum) -> bool:
        """Whether `copy_rows` may copy between a tier of `medium` and host memory: the route
        table's entries between the two are the built-in ones (a route `add_route` put there
        must see every copy it routes)."""
        host, routes, builtin = Medium.HOST, self._routes, self._builtin_table
        return routes.get((medium, host)) is builtin.get((medium, host)) is not None \
            and routes.get((host, medium)) is builtin.get((host, medium))

    def copy_rows(self, tier, slots, rows: torch.Tensor, into_rows: bool, background: bool = False,
                  on_layers: Callable[[int], None] | None = None) -> None:
        """Copies whole blocks between `slots` (int32) of a tier whose slots are host memory and
        the rows of a caller's `[len(slots), block_bytes]` host buffer, row `i` with `slots[i]`,
        in one native call in this thread; counted in the stats as the same batch of copies
        through the route table would be. The runtime's resident path (`kvtier.resident`): it
        needs no ops, no route lookup and no handle of its own; the caller checks `copies_rows`.
        `background`: nobody waits on the copy, which then takes one thread (see `SpanBatch`).
        `on_layers(last)`: someone watches the layers land: the copy goes in runs of layers
        (`chunk_bytes`), one native call each, and reports each run's last layer as it lands.

        Raises:
            TierIOError: the tier is closed.
        """
        memory = tier.memory_rows()
        if memory is None:
            raise TierIOError(f"tier {tier.kind.name} is closed")
        started = time.perf_counter()
        offsets = self.layout.offsets
        for first, last in self._all_spans if on_layers is not None else self._whole:
            self._builtin.copy_slots(memory, slots, rows, into_rows, background, offsets[first],
                                     offsets[last + 1] - offsets[first])
            if on_layers is not None:
                on_layers(last)
        n = len(slots)
        ends = (Endpoint(tier=tier).name, Endpoint(buffer=rows).name)
        src_name, dst_name = ends if into_rows else ends[::-1]
        self.stats.add_bytes(src_name, dst_name, n * self.layout.block_bytes)
        self.stats.observe_transfer(src_name, dst_name, time.perf_counter() - started, n)

    def _routes_of(self, ops: Sequence[CopyOp]) -> tuple[list[Route], list[tuple[tuple[str, str], int]]]:
        """Each op's route, and the batch's stats labels (`_route_names`); one lookup for the usual
        batch, whose copies all join the same two tiers or buffers.

        Raises:
            TransferError: as `route`.
        """
        if not ops:
            return [], []
        first = ops[0]
        st, sb, dt, db = first.src.tier, first.src.buffer, first.dst.tier, first.dst.buffer
        if all(op.src.tier is st and op.dst.tier is dt and op.src.buffer is sb and op.dst.buffer is db for op in ops):
            return [self.route(first.src, first.dst)] * len(ops), [((first.src.name, first.dst.name), len(ops))]
        # A mixed batch (a store spilling past a full tier): one route lookup per pair of ends.
        pairs, first_of = _by_ends(ops)
        route_of = {pair: self.route(op.src, op.dst) for pair, op in first_of.items()}
        return [route_of[pair] for pair in pairs], _names(pairs, first_of)

    def _runs_inline(self, ops: Sequence[CopyOp], routes: list[Route]) -> bool:
        """Whether `ops` qualify to run in the caller's thread (see `inline_bytes`): few enough
        bytes, copies between memories alone, without CUDA, none waiting on another transfer."""
        if not self.runs_inline(len(ops) * self.layout.block_bytes):
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
            if self._copiers is not None:
                self._copiers.close()

    # ---- execution -----------------------------------------------------------------------

    def _run(self, lane: _Lane, ops: list[CopyOp], routes: list[Route], names, handle: TransferHandle, on_done,
             layers, submitted: float, whole: bool = False) -> None:
        """Copies `ops` span by span (`whole`: nobody watches the layers, so all of them are one
        span where every layer is copied), reports each span's last layer, then applies `on_done`.
        `names`: the batch's stats labels (`_route_names`)."""
        error: BaseException | None = None
        try:
            spans = self._whole if whole and layers is None else self._spans(layers)
            for first, last in spans:
                self._run_span(lane, ops, routes, handle, first, last, names)
                handle.layer_done(last)
            self._observe(ops, handle, time.perf_counter() - submitted, names)
        except BaseException as e:  # a bug in a route: surfaced to every waiter by handle.wait()
            log.exception("transfer of %d blocks failed", len(ops))
            error = e
            for op in ops:  # none of them is known to have landed
                handle.fail(op.key, Stage.WRITE, 0, f"internal error in the transfer: {e!r}")
        try:  # even after a bug: the plan's completion frees its slots and finishes the caller's handle
            if on_done is not None:
                on_done(handle)
        except BaseException as e:
            log.exception("completing a transfer of %d blocks failed", len(ops))
            error = error or e
        handle.finish(error)

    def _observe(self, ops: Sequence[CopyOp], handle: TransferHandle, seconds: float, names) -> None:
        """Per-block latency, from submission to the last layer landing, by route (`names`: the
        batch's `_route_names`, which hold where no block failed)."""
        failed = handle.failed
        if failed:
            names = _route_names([op for op in ops if op.key not in failed])
        for (src, dst), n in names:
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
                  first: int, last: int, names) -> None:
        """Layers first..last of every live op: one batch per route, an I/O route's batch on an I/O
        worker while this thread runs the others; then the fallbacks of blocks whose source failed."""
        live = self._live(ops, handle, first, last)
        if live:
            # The batch's stats labels hold while every op is live and none has been replaced.
            whole = names if len(live) == len(ops) and not handle.fell_back else None
            failed_over = self._run_batches(lane, ops, routes, live, handle, first, last, whole)
            if failed_over:  # their fallbacks, read now, and from there for the later spans
                for i in failed_over:
                    ops[i] = ops[i].fallback
                    routes[i] = self.route(ops[i].src, ops[i].dst)
                self._run_batches(lane, ops, routes, failed_over, handle, first, last, None)
        if self._cuda is not None:
            self._cuda.sync()

    def _run_batches(self, lane: _Lane, ops: list[CopyOp], routes: list[Route], live: list[int],
                     handle: TransferHandle, first: int, last: int, names) -> list[int]:
        """Runs the span of the ops at `live`, grouped by route; applies the outcomes to `handle`
        and returns the ops whose source failed and that have a fallback to read instead.
        `names`: the stats labels of all `ops` where `live` is all of them (else None)."""
        offset = self.layout.offsets[first]
        length = self.layout.offsets[last + 1] - offset
        groups = _by_route(routes, live)
        batches = [SpanBatch([ops[i] for i in indices], first, last, offset, length, handle.cuda_ready, lane.io,
                             lane is self._lanes[1])
                   for _, indices in groups]
        if len(groups) == 1:
            groups[0][0].run(batches[0])
        else:
            futures = [lane.io.submit(route.run, batch) for (route, _), batch in zip(groups, batches) if route.io]
            for (route, _), batch in zip(groups, batches):
                if not route.io:
                    route.run(batch)
            wait(futures)
            for f in futures:
                f.result()  # a bug in a route fails the transfer
        failed_over: list[int] = []
        whole = names if len(groups) == 1 else None
        for (_, indices), batch in zip(groups, batches):
            failed_over += self._apply(batch, indices, handle, whole)
        return failed_over

    def _apply(self, batch: SpanBatch, indices: list[int], handle: TransferHandle, names) -> list[int]:
        """Reports one route's batch to `handle`: failures (or a fallback to take), checksums,
        bytes moved (`names`: the batch's stats labels where known, else None). Returns the
        indices (into the transfer's ops) to read from their fallback."""
        failed_over: list[int] = []
        for j, e in batch.failed.items():
            op = batch.ops[j]
            # The failure is the whole span's: a route reads a span, checks it, then writes it, so
            # no layer of it is in place (the error's text names the layer that failed).
            if op.fallback is not None and e.stage in _FALLBACK_STAGES and op.key not in handle.fell_back:
                handle.fell_back[op.key] = Failure(e.stage, batch.first, str(e.cause),
                                                   isinstance(e.cause, TierUnavailable))
                failed_over.append(indices[j])
            else:
                handle.fail(op.key, e.stage, batch.first, e.cause)
        for j, sums in batch.checksums.items():
            if j not in batch.failed:
                handle.checksums.setdefault(batch.ops[j].key, []).extend(sums)
        if batch.failed or names is None:
            names = _route_names([op for j, op in enumerate(batch.ops) if j not in batch.failed])
        for (src, dst), n in names:
            self.stats.add_bytes(src, dst, n * batch.length)
        return failed_over

    def _live(self, ops: list[CopyOp], handle: TransferHandle, first: int, last: int) -> list[int]:
        """The ops still to copy this span: neither failed nor cancelled, and whose `after`
        transfer has landed the span (failing them where it failed the block)."""
        if not handle.failed and not handle.is_cancelling() and all(op.after is None for op in ops):
            return list(range(len(ops)))  # the usual batch, checked in one pass
        return [i for i, op in enumerate(ops) if self._still_live(op, handle, first, last)]

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

    def _staging(self, length: int, which: int) -> torch.Tensor:
        """A per-thread host buffer (pinned with CUDA) of at least `length` bytes."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = [torch.empty(0, dtype=torch.uint8)] * 2
        if bufs[which].numel() < length:
            bufs[which] = torch.empty(length, dtype=torch.uint8, pin_memory=self._cuda is not None)
        return bufs[which][:length]


def _by_route(routes: list[Route], live: list[int]) -> list[tuple[Route, list[int]]]:
    """The `live` op indices grouped by the route each takes, in order of first appearance."""
    first = routes[live[0]]
    if all(routes[i] is first for i in live):  # the usual batch: one route
        return [(first, live)]
    groups: dict[int, tuple[Route, list[int]]] = {}
    for i in live:
        groups.setdefault(id(routes[i]), (routes[i], []))[1].append(i)
    return list(groups.values())


def _route_names(ops: Sequence[CopyOp]) -> list[tuple[tuple[str, str], int]]:
    """How many of `ops` go between each pair of end names (the stats' labels)."""
    return _names(*_by_ends(ops)) if ops else []


def _by_ends(ops: Sequence[CopyOp]) -> tuple[list[tuple[int, int]], dict[tuple[int, int], CopyOp]]:
    """Each op's pair of ends (`_ends_of`), and the first op of each distinct pair."""
    pairs = [_ends_of(op) for op in ops]
    first_of: dict[tuple[int, int], CopyOp] = {}
    for pair, op in zip(pairs, ops):
        first_of.setdefault(pair, op)
    return pairs, first_of


def _names(pairs: list[tuple[int, int]], first_of: dict[tuple[int, int], CopyOp]) -> list[tuple[tuple[str, str], int]]:
    """The stats labels of ops with these `pairs` of ends: their count per pair of names, each
    pair's names asked of its first op only (two CPU buffers are one `buffer:cpu`)."""
    named: Counter = Counter()
    for pair, n in Counter(pairs).items():
        op = first_of[pair]
        named[op.src.name, op.dst.name] += n
    return list(named.items())


def _ends_of(op: CopyOp) -> tuple[int, int]:
    """What names an op's route and labels: the identity of each end's tier, or of its buffer."""
    src, dst = op.src, op.dst
    return (id(src.tier) if src.tier is not None else id(src.buffer),
            id(dst.tier) if dst.tier is not None else id(dst.buffer))


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


class _CudaCopier:
    """Device↔host and device↔device copies on a dedicated CUDA stream per worker thread.

    A layer's copies are queued asynchronously; `sync()` at the end of the layer waits on an event
    recorded after them, so the layer is reported done only when its bytes have landed.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def stream(self) -> torch.cuda.Stream:
        """This thread's stream (made on first use)."""
        return self._stream()

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


class _DeviceCopiers:
    """One `kvtier.moving.cuda_copy.CudaCopier` per CUDA device, built on first use; a device whose
    copier cannot be built (no nvcc, a driver that refuses) is said once and left to the
    block-by-block path."""

    def __init__(self) -> None:
        self._made: dict[int, object | None] = {}
        self._lock = threading.Lock()

    def get(self, device_index: int):
        copier = self._made.get(device_index, False)
        if copier is not False:
            return copier
        with self._lock:
            if device_index not in self._made:
                self._made[device_index] = self._build(device_index)
            return self._made[device_index]

    @staticmethod
    def _build(device_index: int):
        from kvtier.moving.cuda_copy import CudaCopier
        from kvtier.errors import KVTierError

        try:
            return CudaCopier(device_index)
        except KVTierError as e:
            log.warning("kvtier: no batched GPU copier on device %d (%s); copies with a device end go "
                        "block by block on a CUDA stream", device_index, e)
            return None

    def close(self) -> None:
        with self._lock:
            for copier in self._made.values():
                if copier is not None:
                    copier.close()
            self._made.clear()


__all__ = ["BlockCopy", "CopyOp", "Endpoint", "Failure", "Route", "SpanBatch", "Stage", "StageError", "TransferEngine",
           "TransferHandle", "block_seed", "layer_checksum"]
