"""What a copy is: its two ends, the batch a route moves, and the route's contract.

These are the words the transfer engine (`kvtier.moving.engine`) and its routes (`kvtier.moving.routes`)
share: a `CopyOp` copies one block from an `Endpoint` to another; a `SpanBatch` is one layer span
of every copy of a transfer, handed to a `Route` in one call.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor, wait
from dataclasses import dataclass, field

import torch
import xxhash

from kvtier.moving.handle import TransferHandle
from kvtier.kinds import Medium, TierKind
from kvtier.tiers.base import Tier

_U64 = (1 << 64) - 1
_TIER_NAMES = {kind: kind.name.lower() for kind in TierKind}  # route labels, built once: every copy names two
_BUFFER_NAMES = {"cpu": "buffer:cpu", "cuda": "buffer:cuda"}
_HOST, _DEVICE = Medium.HOST, Medium.DEVICE


# Endpoint and CopyOp are made once per block moved: plain slotted dataclasses, not frozen ones,
# whose __init__ costs ~3x (~1 µs for a CopyOp's seven fields on this host). Nothing changes them
# after they are made.
@dataclass(slots=True)
class Endpoint:
    """One end of a copy: `slot` of `tier`; or a caller's `buffer`: a 1-D tensor holding one whole
    block (`slot` -1), or row `slot` of a 2-D `[num_blocks, block_bytes]` one (a batch of blocks
    in one tensor, which a route then addresses as one piece of memory)."""

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
            block = self.buffer[self.slot] if self.slot >= 0 else self.buffer
            return block[offset: offset + length]
        return self.tier.view(self.slot, offset, length)

    @property
    def medium(self) -> enum.Enum:
        """What the route table knows this end by: its tier's medium; for a buffer, `DEVICE`
        (CUDA memory) or `HOST` (CPU memory)."""
        if self.tier is not None:
            return self.tier.medium
        return _DEVICE if self.buffer.is_cuda else _HOST


@dataclass(slots=True)
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


class StageError(Exception):
    """One block's copy failed at `stage` (`Stage.READ`, `WRITE`, `VERIFY`) because of `cause`, at
    `layer` (None: the first of the span); the block is reported failed, the batch goes on."""

    def __init__(self, stage: str, cause: BaseException, layer: int | None = None) -> None:
        super().__init__(f"{stage}: {cause}")
        self.stage, self.cause, self.layer = stage, cause, layer


@dataclass(slots=True)
class SpanBatch:
    """What a route moves in one call: layers `first..last` of the block of every op in `ops`,
    the bytes `[offset, offset + length)` of each block.

    Attributes:
        ready: the CUDA event after the caller's queued GPU work (None without CUDA), which a copy
            reading a caller's device buffer must wait on.
        workers: I/O threads a block-by-block route may spread its copies over (None: none).
        background: nobody waits on the batch (a demotion, a prefetch, an engine's store): a route
            spends one thread on it, leaving the host's other cores to the engine's own work.
        failed: the route's per-block failures, by index into `ops`.
        checksums: the per-layer checksums (of layers first..last) of the ops that ask for them
            (`CopyOp.checksum`), by index into `ops`.
    """

    ops: Sequence[CopyOp]
    first: int
    last: int
    offset: int
    length: int
    ready: object = None
    workers: Executor | None = None
    background: bool = False
    failed: dict[int, StageError] = field(default_factory=dict)
    checksums: dict[int, Sequence[int]] = field(default_factory=dict)

    def fail(self, i: int, error: StageError) -> None:
        """Records op `i`'s failure (its first one stands)."""
        self.failed.setdefault(i, error)


# `copy(op, first, last, ready)`: one block's span, for `Route.per_block`; returns the span's
# per-layer checksums where `op.checksum` asks (else an empty sequence), raises `StageError`.
BlockCopy = Callable[[CopyOp, int, int, object], Sequence[int]]


@dataclass(frozen=True, slots=True)
class Route:
    """How a batch of copies goes from one medium to another: an entry of a `TransferEngine`'s
    route table.

    Attributes:
        run: `run(batch)` copies layers `batch.first..batch.last` of every op of `batch`. Its
            contract: afterwards, for each op `i`, either the span is in place at the op's
            destination — its source bytes checked against `op.verify` where given, its
            per-layer checksums in `batch.checksums[i]` where `op.checksum` asks — or
            `batch.failed[i]` holds the `StageError` that failed it (the stage, the cause, the
            layer); a failed op's destination bytes are undefined. Any exception is a bug and
            fails the whole transfer. `run` may be called from several threads at once, never
            with two copies of one slot in flight.
        io: the copies wait on a disk or the network: in a transfer that also copies memory,
            this route's batch runs on an I/O worker, in flight while the memory is copied.
    """

    run: Callable[[SpanBatch], None]
    io: bool = False

    @classmethod
    def per_block(cls, copy: BlockCopy, io: bool = False) -> Route:
        """A route that copies block by block with `copy` (see `BlockCopy`): the correct default
        any batched route must agree with. With `io`, a batch's copies are spread over the
        batch's I/O workers, so that they are in flight together (queue depth = workers)."""
        return cls(functools.partial(_run_per_block, copy, io), io)


def copy_one(batch: SpanBatch, i: int, copy: BlockCopy) -> None:
    """Op `i` of `batch` by the single-block `copy`: its checksums, or its failure, recorded."""
    try:
        sums = copy(batch.ops[i], batch.first, batch.last, batch.ready)
    except StageError as e:
        batch.fail(i, e)
        return
    if sums:
        batch.checksums[i] = sums


def _run_per_block(copy: BlockCopy, io: bool, batch: SpanBatch) -> None:
    n = len(batch.ops)
    futures = [batch.workers.submit(copy_one, batch, i, copy) for i in range(n - 1)] if io and batch.workers and n > 1 else []
    for i in range(len(futures), n):  # this thread does the rest (at queue depth 1: no hand-off)
        copy_one(batch, i, copy)
    if futures:
        wait(futures)
        for f in futures:
            f.result()  # a bug in a worker's copy fails the transfer here


def block_seed(key: Hashable) -> int:
    """The 64-bit seed of `key`'s checksums: a digest of the key's bytes (its `repr` for keys that
    are not bytes, e.g. the integers tests use), so equal keys agree across processes and restarts."""
    return xxhash.xxh3_64_intdigest(key if isinstance(key, bytes) else repr(key).encode())


def layer_checksum(host_bytes: torch.Tensor, seed: int = 0, layer: int = 0) -> int:
    """xxh3-64 of a CPU uint8 tensor's bytes, seeded with `seed` (a `block_seed`) and the layer index."""
    return xxhash.xxh3_64_intdigest(host_bytes.numpy(), seed=(seed + layer) & _U64)


__all__ = ["BlockCopy", "CopyOp", "copy_one", "Endpoint", "Route", "SpanBatch", "StageError", "block_seed", "layer_checksum"]
