"""The transfer engine's built-in routes: how a batch goes between two media, in native code.

A route gets a whole `SpanBatch` — one layer span of every block of a load, a store or a move —
and moves it with as few calls as the media allow (see `Route` for the contract):

- host memory ↔ host memory (DRAM slots, CPU buffers, a CPU tensor standing in for HBM): one call
  to `kvtier.moving._movers.copy` for the batch, outside the GIL; where a copy carries checksums to check
  or compute, its layers are separate descriptors, each hashed (xxh3-64, seeded per block and
  layer) and copied in one pass while it is in cache;
- a disk or remote tier → host memory: one `Tier.read_spans` per tier (the SSD: one native call,
  many reads in flight; the pool: one request per node), then one native pass that checks every
  layer read against its checksums;
- host memory → a disk or remote tier: one native pass computing the checksums, then one
  `Tier.write_spans` per tier;
- a disk or remote tier → another: one `read_spans` into a host staging area, one native check,
  one `write_spans` from it;
- memory ↔ memory with a CUDA end: one submission of the batch to the device's batched copier
  (`kvtier.moving.cuda_copy`); block by block (`copy_` on the engine's CUDA stream) where there is none
  or a copy carries checksums.

Addresses come from the tiers' own memory (`Tier.memory_rows`) and the caller's tensors, which the
batch holds for the call's duration; a slot out of its tier's range is that block's failure
(`IndexError`), never an address computed past the end. An end with no host address (a closed
tier, a buffer that is not a contiguous CPU tensor of the block) goes through the block-by-block
path, which raises as it always did.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import numpy as np
import torch
import xxhash

from kvtier.moving import _movers
from kvtier.errors import IntegrityError, TransferError
from kvtier.moving.handle import Stage
from kvtier.model.layout import BlockLayout
from kvtier.tiers.base import LayerSums, SpanIO, Tier, copy_bytes
from kvtier.moving.copies import BlockCopy, CopyOp, Endpoint, SpanBatch, StageError, block_seed, copy_one

_U64 = (1 << 64) - 1
_NO_SUMS: tuple[int, ...] = ()
_OUT_OF_RANGE = -1
# The stream handle a batched device copier is given where no CUDA runtime is loaded: its stand-in
# driver (native/fake_cuda.c, in tests) has one queue for every nonzero handle.
STAND_IN_STREAM = 0x5EED
RELAY_STAGING_BYTES = 64 << 20  # the most host memory one relay (disk/remote → disk/remote) stages at once
# A plain host copy is shared among native threads only where each gets at least this much: on a
# 2-vCPU VM, starting and joining a thread costs ~20-40 µs, and a second thread moved 8-16 MiB
# batches 15-40 % faster (bench/bench_host_path.py, bench/bench_lmcache.py), smaller ones slower.
PARALLEL_COPY_BYTES = 8 << 20


class Addresses:
    """Addresses of copy ends for one batch, holding the memory they lie in until dropped.

    `of(end, offset)` is the address of byte `offset` of the block at `end`: None where the end is
    not memory this can address (with `host_only`, device memory too; a closed tier, a buffer that
    is not a contiguous uint8 tensor of at least the span), `_OUT_OF_RANGE` for a slot or row
    outside its memory. `column(ends, offset)` is every end's address at once, as an array, where
    all lie in one piece of memory (one tier's slab, one 2-D buffer), else None.
    """

    def __init__(self, span_end: int, host_only: bool = True) -> None:
        self._span_end = span_end  # offset + length: how much of a block the batch touches
        self._host_only = host_only
        self._memory: dict[int, tuple[int, int, int] | None] = {}  # id(tier or buffer) -> base, row bytes, rows
        self._held: list[object] = []
        self.device_index = 0  # the CUDA device of the last device memory found (0: none found)

    def of(self, end: Endpoint, offset: int) -> int | None:
        memory = self._memory_of(end)
        if memory is None:
            return None
        base, row_bytes, num_rows = memory
        if num_rows == 0:  # a 1-D buffer: the block itself
            return base + offset
        if not 0 <= end.slot < num_rows:
            return _OUT_OF_RANGE
        return base + end.slot * row_bytes + offset

    def column(self, ends: Sequence[Endpoint], offset: int) -> np.ndarray | None:
        first = ends[0]
        if first.tier is not None:
            if not all(e.tier is first.tier for e in ends):
                return None
        elif first.slot < 0 or not all(e.buffer is first.buffer for e in ends):
            return None
        memory = self._memory_of(first)
        if memory is None:
            return None
        base, row_bytes, num_rows = memory
        slots = [e.slot for e in ends]
        if min(slots) < 0 or max(slots) >= num_rows:
            return None  # the ends out of range fail one by one
        start = base + offset
        return np.array([start + slot * row_bytes for slot in slots], np.uint64)

    def _note_device(self, t: torch.Tensor) -> None:
        if t.is_cuda:
            self.device_index = t.device.index or 0

    def _memory_of(self, end: Endpoint) -> tuple[int, int, int] | None:
        owner = end.tier if end.tier is not None else end.buffer
        memory = self._memory.get(id(owner), False)
        if memory is False:
            memory = self._memory[id(owner)] = self._find(end)
        return memory

    def _find(self, end: Endpoint) -> tuple[int, int, int] | None:
        if end.tier is not None:
            rows = end.tier.memory_rows()
            if rows is None or (self._host_only and not rows.is_cpu) or rows.shape[1] < self._span_end:
                return None
            self._held.append(rows)  # the slab stays allocated while this batch copies into it
            self._note_device(rows)
            return rows.data_ptr(), rows.stride(0), rows.shape[0]
        buffer = end.buffer
        self._note_device(buffer)
        if (self._host_only and not buffer.is_cpu) or buffer.dtype != torch.uint8:
            return None
        if end.slot >= 0:  # row `slot` of a [num_blocks, block_bytes] tensor
            if buffer.dim() != 2 or buffer.shape[1] < self._span_end or (buffer.shape[1] > 1 and buffer.stride(1) != 1):
                return None
            return buffer.data_ptr(), buffer.stride(0), buffer.shape[0]
        if buffer.dim() != 1 or not buffer.is_contiguous() or buffer.numel() < self._span_end:
            return None
        return buffer.data_ptr(), 0, 0


class BuiltinRoutes:
    """The route functions `TransferEngine` fills its table with.

    Args:
        layout: the block layout every copy follows.
        cuda: the engine's CUDA stream copier (None without CUDA).
        staging: `staging(length, which)`, a per-thread host buffer of at least `length` bytes.
        device_copier: `device_copier(device_index)`, the batched device copier of that device
            (`kvtier.moving.cuda_copy.CudaCopier`), or None where there is none (no CUDA, or it could
            not be built: then copies with a device end go block by block on the CUDA stream).
        copy_threads: the most native threads one plain host copy is shared among, each taking
            at least `PARALLEL_COPY_BYTES` of it (1: one thread).
    """

    def __init__(self, layout: BlockLayout, cuda, staging: Callable[[int, int], torch.Tensor],
                 device_copier: Callable[[int], object | None] | None = None, copy_threads: int = 1) -> None:
        self.layout = layout
        self._cuda = cuda
        self._staging = staging
        self._device_copier = device_copier
        self._copy_threads = copy_threads
        self._span_tables: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def plain_copy(self, src: np.ndarray, dst: np.ndarray, length: int, background: bool = False) -> None:
        """One native copy of `length` bytes from each address of `src` to the same row of `dst`,
        on as many threads as the batch's size warrants (`_threads`)."""
        n = len(src)
        _movers.copy(src, dst, np.full(n, length, np.uint64), threads=self._threads(n * length, background))

    def copy_slots(self, slab: torch.Tensor, slots, rows: torch.Tensor, to_rows: bool, background: bool,
                   offset: int, length: int) -> None:
        """One native copy of the bytes `[offset, offset + length)` of every block between rows
        `slots` (int32) of a host `slab` and the rows of a host buffer, in order (into the buffer
        where `to_rows`), on as many threads as the batch's size warrants (`_threads`)."""
        _movers.copy_slots(slab.data_ptr() + offset, slab.stride(0), slab.shape[0], rows.data_ptr() + offset,
                           rows.stride(0), slots, length, to_rows, threads=self._threads(len(slots) * length, background))

    def _threads(self, num_bytes: int, background: bool) -> int:
        """Threads for a plain copy of `num_bytes`: each takes at least `PARALLEL_COPY_BYTES`; one
        for a copy nobody waits on (`SpanBatch.background`)."""
        return 1 if background else min(self._copy_threads, num_bytes // PARALLEL_COPY_BYTES) or 1

    # ---- memory ↔ memory ----------------------------------------------------------------------

    def move_host(self, batch: SpanBatch) -> None:
        """host ↔ host: one native copy of every block's span (checksummed ones layer by layer)."""
        offset, length, ops = batch.offset, batch.length, batch.ops
        addresses = Addresses(offset + length)
        if not any(op.checksum or op.verify is not None for op in ops):  # the usual batch: one column each way
            src = addresses.column([op.src for op in ops], offset)
            dst = addresses.column([op.dst for op in ops], offset) if src is not None else None
            if dst is not None:
                self.plain_copy(src, dst, length, batch.background)
                return
        plain_src: list[int] = []
        plain_dst: list[int] = []
        summed: list[tuple[int, int, int]] = []
        for i, op in enumerate(batch.ops):
            src, dst = addresses.of(op.src, offset), addresses.of(op.dst, offset)
            if src is None or dst is None:
                copy_one(batch, i, self.copy_host)
            elif src == _OUT_OF_RANGE or dst == _OUT_OF_RANGE:
                batch.fail(i, _out_of_range(op, src == _OUT_OF_RANGE))
            elif op.verify is None and not op.checksum:
                plain_src.append(src)
                plain_dst.append(dst)
            else:
                summed.append((i, src, dst))
        if plain_src:
            self.plain_copy(np.array(plain_src, np.uint64), np.array(plain_dst, np.uint64), length, batch.background)
        if summed:
            self._summed(batch, summed, copy=True)

    def move_memory(self, batch: SpanBatch) -> None:
        """memory ↔ memory with a device end: one submission of the whole batch to the device's
        batched copier (`cuMemcpyBatchAsync`, blocks adjacent on both sides merged), waited for;
        as host memory where no CUDA is present (a CPU tensor stands in for HBM); block by block
        on the engine's CUDA stream where there is no batched copier, or for copies that carry
        checksums (computed in host memory)."""
        if self._device_copier is not None and self._batched_device_copy(batch):
            return
        if self._cuda is None:
            return self.move_host(batch)
        for i in range(len(batch.ops)):
            copy_one(batch, i, self.copy_device)

    def _batched_device_copy(self, batch: SpanBatch) -> bool:
        """The whole batch through the device copier, where every end is addressable memory and no
        copy carries checksums; False (nothing copied) otherwise. A failed submission fails every
        block of the batch (the driver reports a batch, not a block)."""
        ops, offset, length = batch.ops, batch.offset, batch.length
        if any(op.checksum or op.verify is not None for op in ops):
            return False
        addresses = Addresses(offset + length, host_only=False)
        src = addresses.column([op.src for op in ops], offset)
        dst = addresses.column([op.dst for op in ops], offset) if src is not None else None
        copier = self._device_copier(addresses.device_index) if dst is not None else None
        if copier is None:
            return False
        stream = self._cuda.stream() if self._cuda is not None else STAND_IN_STREAM
        try:
            copier.submit(dst, src, length, stream, after_event=batch.ready).wait()
        except TransferError as e:
            for i in range(len(ops)):
                batch.fail(i, StageError(Stage.WRITE, e))
        return True

    # ---- disk/remote ↔ memory -------------------------------------------------------------------

    def read(self, batch: SpanBatch) -> None:
        """disk/remote → memory: one `read_spans` per source tier straight into the destinations,
        then one native pass checking every layer read; a device destination block by block."""
        addresses = Addresses(batch.offset + batch.length)
        for tier, indices in _by_tier(batch.ops, lambda op: op.src.tier):
            self._read_direct(batch, tier, self._addressed(batch, indices, addresses, False, self.read_into_device))

    def write(self, batch: SpanBatch) -> None:
        """memory → disk/remote: one native pass computing (and checking) the checksums, then one
        `write_spans` per destination tier from the sources; a device source block by block."""
        offset, length = batch.offset, batch.length
        addresses = Addresses(offset + length)
        for tier, indices in _by_tier(batch.ops, lambda op: op.dst.tier):
            direct = self._addressed(batch, indices, addresses, True, self.write_from_device)
            self._summed(batch, [(i, src, 0) for i, src in direct if _sums_wanted(batch.ops[i])], copy=False)
            ready = [(i, src) for i, src in direct if i not in batch.failed]
            if ready:
                io = SpanIO([batch.ops[i].dst.slot for i, _ in ready], offset, length, [a for _, a in ready],
                            [batch.ops[i].key for i, _ in ready])
                for j, error in tier.write_spans(io).items():
                    batch.fail(ready[j][0], StageError(Stage.WRITE, error))

    def relay(self, batch: SpanBatch) -> None:
        """disk/remote → disk/remote: the batch read into a host staging area (one `read_spans` per
        source tier), checked in one native pass (the checksums computed where asked), then
        written from there (one `write_spans` per destination tier); in chunks of at most
        `RELAY_STAGING_BYTES`, so a large demotion does not hold a buffer of its whole size."""
        per_chunk = max(1, RELAY_STAGING_BYTES // max(batch.length, 1))
        for start in range(0, len(batch.ops), per_chunk):
            part = SpanBatch(batch.ops[start:start + per_chunk], batch.first, batch.last, batch.offset, batch.length,
                             batch.ready, batch.workers, batch.background)
            self._relay_part(part)
            for j, error in part.failed.items():
                batch.fail(start + j, error)
            for j, sums in part.checksums.items():
                batch.checksums[start + j] = sums

    def _relay_part(self, batch: SpanBatch) -> None:
        length, ops = batch.length, batch.ops
        staging = self._staging(len(ops) * length, 0)
        base = staging.data_ptr()
        for tier, indices in _by_tier(ops, lambda op: op.src.tier):
            self._read_direct(batch, tier, [(i, base + i * length) for i in indices])
        for tier, indices in _by_tier(ops, lambda op: op.dst.tier):
            ready = [i for i in indices if i not in batch.failed]
            if ready:
                io = SpanIO([ops[i].dst.slot for i in ready], batch.offset, length, [base + i * length for i in ready],
                            [ops[i].key for i in ready])
                for j, error in tier.write_spans(io).items():
                    batch.fail(ready[j], StageError(Stage.WRITE, error))

    def _addressed(self, batch: SpanBatch, indices: list[int], addresses: Addresses, at_source: bool,
                   per_block: BlockCopy) -> list[tuple[int, int]]:
        """(index, host address) of the memory end (the source where `at_source`, else the
        destination) of each op at `indices`; an op whose end has no host address (device memory)
        is copied block by block with `per_block` instead, one out of its memory's range fails."""
        direct: list[tuple[int, int]] = []
        for i in indices:
            op = batch.ops[i]
            address = addresses.of(op.src if at_source else op.dst, batch.offset)
            if address is None:
                copy_one(batch, i, per_block)
            elif address == _OUT_OF_RANGE:
                batch.fail(i, _out_of_range(op, at_source))
            else:
                direct.append((i, address))
        return direct

    def _read_direct(self, batch: SpanBatch, tier: Tier, direct: list[tuple[int, int]]) -> None:
        """`read_spans` of `direct` (index, host address) from `tier`; each block checked against
        its op's `verify`, by the tier as the bytes land where it can (`LayerSums`), else here."""
        if not direct:
            return
        ops, first, last = batch.ops, batch.first, batch.last
        checked = [j for j, (i, _) in enumerate(direct) if ops[i].verify is not None]
        sums: list[LayerSums | None] = [None] * len(direct)
        if checked:
            rel, lengths = self._span_table(first, last)
            out = np.zeros((len(checked), last - first + 1), np.uint64)
            for row, j in enumerate(checked):
                sums[j] = LayerSums(rel, lengths, block_seed(ops[direct[j][0]].key), first, out[row])
        io = SpanIO([ops[i].src.slot for i, _ in direct], batch.offset, batch.length,
                    [a for _, a in direct], [ops[i].key for i, _ in direct], sums)
        failed = tier.read_spans(io)
        for j, error in failed.items():
            batch.fail(direct[j][0], StageError(Stage.READ, error))
        for j in checked:  # hashed as they landed: compared here (a list compare; NumPy costs more cold)
            if j not in failed and sums[j].done:
                i, got = direct[j][0], sums[j].out.tolist()
                want = ops[i].verify[first:last + 1]
                if got != list(want):  # the first layer that differs (or past the shorter, a malformed verify)
                    _mismatch(batch, i, first + next((l for l, (a, b) in enumerate(zip(got, want)) if a != b),
                                                     min(len(got), len(want))))
                elif ops[i].checksum:
                    batch.checksums[i] = got
        self._summed(batch, [(i, a, 0) for j, (i, a) in enumerate(direct)
                             if j not in failed and _sums_wanted(ops[i]) and (sums[j] is None or not sums[j].done)],
                     copy=False)

    # ---- checksums, in one native pass ----------------------------------------------------------

    def _summed(self, batch: SpanBatch, items: Sequence[tuple[int, int, int]], copy: bool) -> None:
        """Hashes layers `first..last` of each item's source (`(index, src address, dst address)`),
        copying each layer after it is hashed where `copy`; a layer that differs from its op's
        `verify` fails the block (VERIFY, naming the layer) and is not copied; the checksums of
        ops that ask for them go to `batch.checksums`."""
        if not items:
            return
        ops, first, last = batch.ops, batch.first, batch.last
        rel, lengths = self._span_table(first, last)
        k, nl = len(items), last - first + 1
        # k-item arrays; `copy_layers` makes the k x nl descriptors (NumPy calls cost more here
        # than hashing a 64 KiB block: the bytes just moved have taken the caches).
        src = np.fromiter((s for _, s, _ in items), np.uint64, k)
        dst = np.fromiter((d for _, _, d in items), np.uint64, k) if copy else None
        seeds = np.fromiter((block_seed(ops[i].key) for i, _, _ in items), np.uint64, k)
        sums = np.zeros(k * nl, np.uint64)
        indices = [i for i, _, _ in items]
        verifies = [ops[i].verify for i in indices]
        bad = None
        if all(v is None for v in verifies):
            _movers.copy_layers(src, dst, rel, lengths, seeds, first, sums)
        elif all(v is not None for v in verifies):
            bad = np.zeros(k * nl, np.uint8)
            if not _movers.copy_layers(src, dst, rel, lengths, seeds, first, sums, self._expected(batch, indices).ravel(),
                                       bad):
                bad = None  # the usual outcome: nothing to look for
        else:  # only the ops with `verify` are checked (every layer copied)
            _movers.copy_layers(src, dst, rel, lengths, seeds, first, sums)
            bad = ((sums.reshape(k, nl) != self._expected(batch, indices))
                   & np.array([v is not None for v in verifies])[:, None])
        self._report(batch, indices, sums.reshape(k, nl), None if bad is None else bad.reshape(k, nl))

    @staticmethod
    def _expected(batch: SpanBatch, indices: Sequence[int]) -> np.ndarray:
        """The `verify` checksums of layers `first..last` of the ops at `indices`, a row each (zeros
        for an op without)."""
        first, last = batch.first, batch.last
        return np.array([v[first:last + 1] if v is not None else (0,) * (last - first + 1)
                         for v in (batch.ops[i].verify for i in indices)], np.uint64)

    @staticmethod
    def _report(batch: SpanBatch, indices: Sequence[int], sums: np.ndarray, bad: np.ndarray | None) -> None:
        """Of the ops at `indices`, whose layers hashed to the rows of `sums`: each with a layer
        flagged in `bad` fails (VERIFY, naming its first such layer); the others that ask for
        their checksums get them in `batch.checksums`."""
        ops, failed = batch.ops, set()
        if bad is not None:
            for j in np.flatnonzero(bad.any(axis=1)):
                _mismatch(batch, indices[j], batch.first + int(np.flatnonzero(bad[j])[0]))
                failed.add(int(j))
        if any(ops[i].checksum for i in indices):
            for j, i in enumerate(indices):
                if ops[i].checksum and j not in failed:
                    batch.checksums[i] = sums[j].tolist()

    def _span_table(self, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
        """Layers `first..last`: their offsets from the span's start, and lengths, as arrays;
        made once per span (an engine's spans are the same few, and these cost ~10 µs)."""
        table = self._span_tables.get((first, last))
        if table is None:
            offsets = self.layout.offsets
            table = self._span_tables[first, last] = (
                np.array([offsets[l] - offsets[first] for l in range(first, last + 1)], np.uint64),
                np.array(self.layout.layer_bytes[first:last + 1], np.uint64))
        return table

    # ---- block by block (a CUDA end; the fallback of an end with no host address) --------------

    def copy_host(self, op: CopyOp, first: int, last: int, ready=None) -> Sequence[int]:
        """host memory → host memory: one NumPy copy between the two ends' views."""
        offset, length = self._range(first, last)
        src = op.src.view(offset, length)
        checksums = self.check(op, src, first, last)
        copy_bytes(op.dst.view(offset, length), src)
        return checksums

    def copy_device(self, op: CopyOp, first: int, last: int, ready=None) -> Sequence[int]:
        """memory ↔ memory, one end device memory: `copy_` on this thread's CUDA stream, queued
        behind the caller's work (`ready`); the span completes when the stream's event does."""
        offset, length = self._range(first, last)
        src, dst = op.src.view(offset, length), op.dst.view(offset, length)
        checksums = _NO_SUMS
        if op.verify is not None or op.checksum:
            checksums = self.check(op, self._on_host(src, length, ready), first, last)
        if src.is_cuda or dst.is_cuda:
            self._cuda.copy(dst, src, blocking=False, after=ready)
        else:
            copy_bytes(dst, src)
        return checksums

    def read_into_device(self, op: CopyOp, first: int, last: int, ready=None) -> Sequence[int]:
        """disk/remote → memory without a host address (device memory): read into a host staging
        buffer, checked there, then copied up and waited for (the buffer is reused at once)."""
        offset, length = self._range(first, last)
        dst = op.dst.view(offset, length)
        host = self._staging(length, 0) if dst.is_cuda else dst
        _read(op, host, offset)
        checksums = self.check(op, host, first, last)
        if host is not dst:
            self._cuda.copy(dst, host, blocking=True, after=ready)
        return checksums

    def write_from_device(self, op: CopyOp, first: int, last: int, ready=None) -> Sequence[int]:
        """memory without a host address (device memory) → disk/remote: down into a host staging
        buffer (after the caller's work, waited for), then as from host memory."""
        offset, length = self._range(first, last)
        host = self._on_host(op.src.view(offset, length), length, ready)
        checksums = self.check(op, host, first, last)
        _write(op, host, offset)
        return checksums

    def check(self, op: CopyOp, host: torch.Tensor, first: int, last: int) -> Sequence[int]:
        """Checks `host` (layers first..last of the block, in host memory) against `op.verify`,
        where given; returns their checksums where `op.checksum` asks for them."""
        if op.verify is None and not op.checksum:
            return _NO_SUMS
        base, offsets, seed = self.layout.offsets[first], self.layout.offsets, block_seed(op.key)
        data, digest = memoryview(host.numpy()), xxhash.xxh3_64_intdigest
        checksums = [digest(data[offsets[l] - base: offsets[l + 1] - base], seed=(seed + l) & _U64)
                     for l in range(first, last + 1)]
        if op.verify is not None:
            for layer, got in zip(range(first, last + 1), checksums):
                if got != op.verify[layer]:
                    raise StageError(Stage.VERIFY, IntegrityError(
                        f"block {short_key(op.key)} layer {layer} from {op.src.name} slot {op.src.slot}: "
                        "checksum mismatch"), layer)
        return checksums if op.checksum else _NO_SUMS

    def _on_host(self, t: torch.Tensor, length: int, ready=None) -> torch.Tensor:
        """`t` itself where it is host memory; else a staging copy of it, waited for."""
        if not t.is_cuda:
            return t
        host = self._staging(length, 1)
        self._cuda.copy(host, t, blocking=True, after=ready)
        return host

    def _range(self, first: int, last: int) -> tuple[int, int]:
        offsets = self.layout.offsets
        return offsets[first], offsets[last + 1] - offsets[first]


def _by_tier(ops: Sequence[CopyOp], tier_of) -> list[tuple[Tier, list[int]]]:
    """The batch's op indices grouped by `tier_of(op)`, in order of first appearance."""
    first = tier_of(ops[0])
    if all(tier_of(op) is first for op in ops):  # the usual batch: one tier
        return [(first, list(range(len(ops))))]
    groups: dict[int, tuple[Tier, list[int]]] = {}
    for i, op in enumerate(ops):
        tier = tier_of(op)
        groups.setdefault(id(tier), (tier, []))[1].append(i)
    return list(groups.values())


def _sums_wanted(op: CopyOp) -> bool:
    return op.verify is not None or op.checksum


def _mismatch(batch: SpanBatch, i: int, layer: int) -> None:
    """Fails op `i` of `batch`: its `layer` read differs from its `verify` checksum."""
    op = batch.ops[i]
    batch.fail(i, StageError(Stage.VERIFY, IntegrityError(
        f"block {short_key(op.key)} layer {layer} from {op.src.name} slot {op.src.slot}: checksum mismatch"), layer))


def _out_of_range(op: CopyOp, at_source: bool) -> StageError:
    end = op.src if at_source else op.dst
    return StageError(Stage.READ if at_source else Stage.WRITE, IndexError(
        f"{end.name} slot {end.slot} out of range [0, {end.tier.num_slots})"))


def _read(op: CopyOp, host: torch.Tensor, offset: int) -> None:
    """The source tier's `read` of the span at `offset` into `host`; a shared tier is told the key first."""
    tier, slot = op.src.tier, op.src.slot
    if tier.shared:
        tier.bind(slot, op.key)
    _stage(Stage.READ, tier.read, slot, host, offset)


def _write(op: CopyOp, host: torch.Tensor, offset: int) -> None:
    """The destination tier's `write` of `host` at `offset`; a shared tier is told the key first."""
    tier, slot = op.dst.tier, op.dst.slot
    if tier.shared:
        tier.bind(slot, op.key)
    _stage(Stage.WRITE, tier.write, slot, host, offset)


def _stage(stage: str, fn, *args) -> None:
    try:
        fn(*args)
    except (OSError, IndexError, IntegrityError) as e:
        raise StageError(stage, e) from e


def short_key(key: Hashable) -> str:
    return key.hex()[:16] if isinstance(key, bytes) else repr(key)
