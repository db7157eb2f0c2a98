"""The transfer engine moves bytes; it decides nothing.

It executes batches of `CopyOp`s between endpoints — a slot of a tier, or a caller's buffer —
layer by layer, and reports per-layer progress and per-block failures on a `TransferHandle`.
The route of each copy follows the media of its two ends:

- memory ↔ memory (HBM, DRAM, caller buffers): `Tensor.copy_`; where either end is on a CUDA
  device the copy runs on the engine's own CUDA stream and the layer completes on a CUDA event;
- disk/remote ↔ anything: the tier's `read`/`write`, run on the I/O worker pool so the blocks of
  one layer are in flight together (queue depth = workers), staged through host buffers where the
  other end is a device or another non-memory tier.

Bytes read from a tier below DRAM are checked against their per-layer checksums (xxh3-64) before
they are delivered; bytes written below DRAM get their checksums computed on the way. A checksum
is seeded with the block's key and the layer's index (`block_seed`), so it binds the bytes to the
block and the place they belong: a record whose key was moved (a misdirected write, an offset bug,
a swapped journal entry) or a layer read from another layer's offset fails the check and is a
miss, never another block's KV served as good.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from kvtier.cpus import pin_thread
from kvtier.errors import IntegrityError
from kvtier.handle import Failure, Stage, TransferHandle
from kvtier.layout import BlockLayout
from kvtier.stats import Stats
from kvtier.tiers.base import Medium, Tier, TierKind, copy_bytes

log = logging.getLogger(__name__)
_U64 = (1 << 64) - 1
_TIER_NAMES = {kind: kind.name.lower() for kind in TierKind}  # route labels, built once: every copy names two
_BUFFER_NAMES = {"cpu": "buffer:cpu", "cuda": "buffer:cuda"}


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
    def below_dram(self) -> bool:
        return self.tier is not None and self.tier.medium in (Medium.REMOTE, Medium.DISK)


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy block `key` from `src` to `dst`.

    Attributes:
        verify: expected per-layer checksums of the source bytes, checked after each layer's read.
        checksum: compute per-layer checksums of the bytes (into `handle.checksums`).
        after: a transfer that writes `src` (a move this copy joined); layer `l` is read only after
            `after` has finished layer `l`, and the copy fails if `after` failed this key.
    """

    key: Hashable
    src: Endpoint
    dst: Endpoint
    verify: tuple[int, ...] | None = None
    checksum: bool = False
    after: TransferHandle | None = None


def block_seed(key: Hashable) -> int:
    """The 64-bit seed of `key`'s checksums: a digest of the key's bytes (its `repr` for keys that
    are not bytes, e.g. the integers tests use), so equal keys agree across processes and restarts."""
    return xxhash.xxh3_64_intdigest(key if isinstance(key, bytes) else repr(key).encode())


def layer_checksum(host_bytes: torch.Tensor, seed: int = 0, layer: int = 0) -> int:
    """xxh3-64 of a CPU uint8 tensor's bytes, seeded with `seed` (a `block_seed`) and the layer index."""
    return xxhash.xxh3_64_intdigest(host_bytes.numpy(), seed=(seed + layer) & _U64)


class TransferEngine:
    """Runs batches of copies on worker threads.

    Args:
        layout: the block layout every copy follows.
        io_workers: threads for disk/remote I/O (the queue depth of one layer's batch).
        job_workers: batches that may run at once.
        chunk_bytes: consecutive layers are copied together until a copy reaches this size
            (0: one copy per layer).
        inline_bytes: a batch of at most this many bytes whose copies are all host memory to
            host memory (no CUDA, no disk or remote end, no copy waiting on another transfer) runs
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
    workers, so a load never queues behind a burst of demotions.
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
        self._closed = False

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
        """
        if self._closed:
            raise RuntimeError("transfer engine is closed")
        handle = handle or TransferHandle([op.key for op in ops], self.layout.num_layers)
        if self._cuda is not None:  # the caller's pending GPU work on its buffers comes first
            handle.cuda_ready = self._cuda.mark_caller()
        lane = self._lanes[background]
        if inline and self._runs_inline(ops):  # done when this returns; `on_done` has run in this thread
            self._run_whole(ops, handle, on_done, layers, time.perf_counter())
        else:
            lane.jobs.submit(self._run, lane, list(ops), handle, on_done, layers, time.perf_counter())
        return handle

    def run_now(self, ops: Sequence[CopyOp], handle: TransferHandle,
                on_done: Callable[[TransferHandle], None] | None = None) -> TransferHandle:
        """Copies `ops` in the calling thread (all but one of a batch's disk and remote copies
        still on the I/O workers, so that they are in flight together) and returns when they are
        done, `on_done` run and `handle` finished. For a caller that would only wait for a
        worker (a thread hand-off and the wake-up back cost 60-120 µs on a virtualized host), and
        for a completion callback that must copy more before its own handle finishes (the
        runtime's store retries)."""
        if self._closed:
            raise RuntimeError("transfer engine is closed")
        if self._cuda is not None:
            handle.cuda_ready = self._cuda.mark_caller()
        started = time.perf_counter()
        if self._host_only(ops):  # each block one copy, as an inline batch
            self._run_whole(ops, handle, on_done, None, started)
        else:
            self._run(self._lanes[0], list(ops), handle, on_done, None, started)
        return handle

    def _runs_inline(self, ops: Sequence[CopyOp]) -> bool:
        """Whether `ops` qualify to run in the caller's thread (see `inline_bytes`)."""
        return len(ops) * self.layout.block_bytes <= self.inline_bytes and self._host_only(ops)

    def _host_only(self, ops: Sequence[CopyOp]) -> bool:
        """Copies between host memories alone: no CUDA, no disk or remote end, none waiting on another transfer."""
        return self._cuda is None and all(op.after is None and not op.src.below_dram and not op.dst.below_dram
                                          for op in ops)

    def close(self) -> None:
        """Waits for running transfers, then stops the workers. Idempotent."""
        if not self._closed:
            self._closed = True
            for lane in self._lanes:
                lane.close()

    # ---- execution -----------------------------------------------------------------------

    def _run(self, lane: _Lane, ops: list[CopyOp], handle: TransferHandle, on_done, layers,
             submitted: float) -> None:
        error: BaseException | None = None
        try:
            for first, last in self._spans(layers):
                self._run_span(lane, ops, handle, first, last)
                handle.layer_done(last)
            self._observe(ops, handle, time.perf_counter() - submitted)
            if on_done is not None:
                on_done(handle)
        except BaseException as e:  # a bug: surfaced to every waiter by handle.wait()
            log.exception("transfer of %d blocks failed", len(ops))
            error = e
        handle.finish(error)

    def _run_whole(self, ops: Sequence[CopyOp], handle: TransferHandle, on_done, layers, submitted: float) -> None:
        """An inline batch (`_runs_inline`): the caller sees it only once it is done, so layer
        progress cannot be watched and each block is one copy of its layers, without spans."""
        if layers is not None:
            return self._run(self._lanes[0], list(ops), handle, on_done, layers, submitted)
        error: BaseException | None = None
        last = self.layout.num_layers - 1
        try:
            rows: list[CopyOp] = []  # copied row to row: their bytes are counted once, below
            for op in ops:
                if handle.is_cancelled(op.key):
                    handle.fail(op.key, Stage.CANCELLED, 0, "cancelled")
                elif op.key not in handle.failed:
                    if self._copy_rows(op):
                        rows.append(op)
                    else:
                        self._copy_guarded(op, handle, 0, last)
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
        NumPy copy and no tensor views; False where an end is not such memory (then the general
        path copies it)."""
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

    def _run_span(self, lane: _Lane, ops: list[CopyOp], handle: TransferHandle, first: int, last: int) -> None:
        live = [op for op in ops if self._still_live(op, handle, first, last)]
        slow = [op for op in live if op.src.below_dram or op.dst.below_dram]
        # All but one disk/remote copy go to the I/O workers, so that they are in flight together;
        # this thread does the last itself (at queue depth 1: no hand-off at all) and the memory ones.
        futures = [lane.io.submit(self._copy_guarded, op, handle, first, last) for op in slow[:-1]]
        for op in live:
            if not (op.src.below_dram or op.dst.below_dram):
                self._copy_guarded(op, handle, first, last)
        if slow:
            self._copy_guarded(slow[-1], handle, first, last)
        if futures:
            wait(futures)
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
            if op.key in op.after.failed:
                handle.fail(op.key, Stage.DEPENDENCY, first, op.after.failed[op.key].error)
                return False
        return True

    def _copy_guarded(self, op: CopyOp, handle: TransferHandle, first: int, last: int) -> None:
        try:
            checksums = self._copy_span(op, first, last, handle.cuda_ready)
        except _StageError as e:
            handle.fail(op.key, e.stage, e.layer if e.layer is not None else first, e.cause)
            return
        if checksums:
            handle.checksums.setdefault(op.key, []).extend(checksums)
        self.stats.add_bytes(op.src.name, op.dst.name, self._span_bytes(first, last))

    def _copy_span(self, op: CopyOp, first: int, last: int, ready=None) -> list[int]:
        """Copies layers `first..last` of one block; returns their checksums when asked to compute them."""
        offset, length = self.layout.offsets[first], self._span_bytes(first, last)
        src, dst = op.src.view(offset, length), op.dst.view(offset, length)
        host = _host(src)
        if src is None:  # disk or remote: read into host memory (the destination itself if it can)
            host = _host(dst) if dst is not None and _host(dst) is not None else self._staging(length, 0)
            if op.src.tier.shared:
                op.src.tier.bind(op.src.slot, op.key)
            _stage(Stage.READ, op.src.tier.read, op.src.slot, host, offset)
        if op.verify is not None:
            self._verify(op, host, first, last)
        if host is None and (op.checksum or dst is None):  # a device source bound for a checksum or a disk
            host = self._staging(length, 1)
            self._cuda.copy(host, src, blocking=True, after=ready)
        checksums = self._checksums(host, op.key, first, last) if op.checksum else []
        if dst is None:
            if op.dst.tier.shared:
                op.dst.tier.bind(op.dst.slot, op.key)
            _stage(Stage.WRITE, op.dst.tier.write, op.dst.slot, host, offset)
        elif host is not dst:
            self._copy_tensor(dst, host if host is not None else src, host is not None and src is None, ready)
        return checksums

    def _checksums(self, host: torch.Tensor, key: Hashable, first: int, last: int) -> list[int]:
        """`layer_checksum` of each layer in `host` (layers first..last), from one view of its
        bytes: slicing a memoryview per layer costs a fraction of a tensor slice and `.numpy()`."""
        base, offsets, seed = self.layout.offsets[first], self.layout.offsets, block_seed(key)
        data, digest = memoryview(host.numpy()), xxhash.xxh3_64_intdigest
        return [digest(data[offsets[l] - base: offsets[l + 1] - base], seed=(seed + l) & _U64)
                for l in range(first, last + 1)]

    def _verify(self, op: CopyOp, host: torch.Tensor, first: int, last: int) -> None:
        for layer, got in zip(range(first, last + 1), self._checksums(host, op.key, first, last)):
            if got != op.verify[layer]:
                raise _StageError(Stage.VERIFY, IntegrityError(
                    f"block {_short(op.key)} layer {layer} from {op.src.name} slot {op.src.slot}: "
                    "checksum mismatch"), layer)

    def _copy_tensor(self, dst: torch.Tensor, src: torch.Tensor, staged: bool, ready=None) -> None:
        if dst.is_cuda or src.is_cuda:
            self._cuda.copy(dst, src, blocking=staged, after=ready)  # a staging buffer is reused at once: wait
        else:
            copy_bytes(dst, src)

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


class _StageError(Exception):
    def __init__(self, stage: str, cause: BaseException, layer: int | None = None) -> None:
        super().__init__(f"{stage}: {cause}")
        self.stage, self.cause, self.layer = stage, cause, layer


def _stage(stage: str, fn, *args) -> None:
    try:
        fn(*args)
    except (OSError, IndexError, IntegrityError) as e:
        raise _StageError(stage, e) from e


def _row(end: Endpoint) -> np.ndarray | None:
    """A whole block's bytes at `end` as a NumPy array, where they are host memory; else None."""
    if end.buffer is not None:
        if end.buffer.device.type != "cpu" or end.buffer.requires_grad:
            return None
        return end.buffer.numpy()
    rows = end.tier.host_rows()
    return rows[end.slot] if rows is not None and 0 <= end.slot < len(rows) else None


def _host(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is not None and not t.is_cuda else None


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


__all__ = ["CopyOp", "Endpoint", "Failure", "Stage", "TransferEngine", "TransferHandle", "block_seed", "layer_checksum"]
