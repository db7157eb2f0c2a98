"""The `Tier` interface: where bytes live.

A tier is a slab of `num_slots` fixed-size slots of `slot_bytes` each. It knows nothing of keys,
recency or free lists: the manager decides which slot holds what; a tier only reads and writes
byte ranges of slots. Every implementation passes `kvtier.testing.tier_contract` unchanged.

Buffers are 1-D contiguous `torch.uint8` tensors. A memory tier (HBM, DRAM) also offers `view`, a
zero-copy tensor over a slot range, which the transfer engine uses to copy without staging.
"""

from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.errors import IntegrityError
from kvtier.kinds import Medium, TierKind


class LayerSums:
    """The per-layer checksums of one block's bytes, for a reader to compute as they land.

    A route that checks a read against checksums of its own (`CopyOp.verify`) hands each block's
    to the tier, so a reader that brings the bytes in piece by piece (a socket) can hash each
    layer while it is still in cache, instead of the route making a second pass over it.

    Attributes:
        rel, lengths: each layer's offset from the start of the block's buffer and its length
            (uint64 arrays, offsets ascending).
        seed: the block's seed; layer l is hashed with `seed + layer0 + l` (mod 2**64), as
            `kvtier.moving._movers.copy_layers` does.
        layer0: the first layer's number.
        out: where layer l's xxh3-64 goes (a writable uint64 array of as many items).
        done: set True by a reader that hashed every layer of the bytes it put in the buffer, after
            they were in; the route then compares `out` and skips its own pass. Left False, the
            route hashes the buffer itself.
    """

    __slots__ = ("rel", "lengths", "seed", "layer0", "out", "done")

    def __init__(self, rel: np.ndarray, lengths: np.ndarray, seed: int, layer0: int, out: np.ndarray) -> None:
        self.rel, self.lengths, self.seed, self.layer0, self.out = rel, lengths, seed, layer0, out
        self.done = False


@dataclass(frozen=True, slots=True)
class SpanIO:
    """One batch of a tier's I/O: the same byte range of many slots, each read into or written
    from its own host memory.

    Attributes:
        slots: the slots, in `[0, num_slots)`.
        offset, length: the range `[offset, offset + length)` of every slot.
        addresses: for slot `slots[i]`, the start of `length` bytes of host memory (a DRAM slot,
            a staging buffer, a caller's CPU tensor) that the caller keeps valid until the call
            returns.
        keys: the block each slot holds or is about to hold: a shared tier files it under its key
            (as `bind`); the others ignore it.
        sums: of a read, per slot: where not None, the caller checks every byte read against
            checksums of its own (a route and `CopyOp.verify`), so a tier may skip a check of its
            own over the same bytes, and may compute the layers' checksums as the bytes land
            (`LayerSums`); empty: none is. A tier that skips its check still fails a block it
            cannot read whole.
    """

    slots: Sequence[int]
    offset: int
    length: int
    addresses: Sequence[int]
    keys: Sequence[Hashable]
    sums: Sequence[LayerSums | None] = ()

    def __len__(self) -> int:
        return len(self.slots)


class Tier(ABC):
    """A fixed array of equal slots holding block bytes.

    Subclasses set `kind`, `medium`, `slot_bytes` and `num_slots` in their constructor.
    Reads and writes of different slots may run concurrently from several threads; the manager
    guarantees no two transfers touch the same slot at once.
    """

    kind: TierKind
    medium: Medium
    slot_bytes: int
    num_slots: int
    # A shared tier (a `kvtier.tiers.shared.SharedTier` with sharing on: the pool) holds blocks
    # under their keys, so that other processes find them: the transfer engine then names the
    # block of every slot it reads or writes (`bind`), and the runtime asks it for blocks it does
    # not index (`SharedTier.find`, `SharedTier.can_share`).
    shared: bool = False
    # Whether the tier checks the bytes it reads itself (the pool checks each block's key-seeded
    # checksum), so that a block adopted from another process needs no checksums in the index.
    checks_reads: bool = False
    # Whether the tier keeps its blocks across restarts (a persistent SSD tier): it then records
    # each block that lands in it (`remember`) and gives back, at start-up, what an earlier run
    # recorded (`recall`), so that the runtime adopts those blocks into its index.
    persist: bool = False
    # Whether the tier may lose a block on its own authority (a pool node evicts by its own
    # recency, under every client's pressure, or restarts): a copy there never lets the manager
    # drop a block's copy above without demoting it to a tier that keeps what it holds.
    may_drop: bool = False

    @property
    def capacity_bytes(self) -> int:
        return self.slot_bytes * self.num_slots

    @abstractmethod
    def write(self, slot: int, src: torch.Tensor, offset: int = 0) -> None:
        """Writes all of `src` into `slot` starting at byte `offset`.

        Args:
            slot: slot index in `[0, num_slots)`.
            src: 1-D contiguous uint8 tensor; `offset + src.numel() <= slot_bytes`.
            offset: byte offset inside the slot.
        Raises:
            IndexError: slot or byte range out of bounds.
            TierIOError: the medium failed (e.g. the disk is full); the slot's content is undefined.
        """

    @abstractmethod
    def read(self, slot: int, dst: torch.Tensor, offset: int = 0) -> None:
        """Reads `dst.numel()` bytes of `slot` starting at byte `offset` into `dst`.

        Raises:
            IndexError: slot or byte range out of bounds.
            TierIOError: the medium failed or returned fewer bytes than asked.
        """

    def view(self, slot: int, offset: int, length: int) -> torch.Tensor | None:
        """A zero-copy uint8 tensor over a slot range, or None where the medium has no such view."""
        return None

    def memory_rows(self) -> torch.Tensor | None:
        """The slots as one `[num_slots, slot_bytes]` uint8 tensor over the tier's own memory (host
        or device), which routes address directly (slot `s` at `data_ptr() + s * stride(0)`)
        instead of building a view per block (a view costs several µs, more than a small block's
        copy); None (the default) where the slots are not memory, or once closed."""
        return None

    def bind(self, slot: int, key: Hashable) -> None:
        """A shared tier learns that `slot` holds (or is about to hold) block `key`; called by the
        transfer engine before each read or write of the slot (and by `write_spans`/`read_spans`
        by default). The default ignores it."""

    def write_spans(self, io: SpanIO) -> dict[int, Exception]:
        """Batched `write`: for each `i`, `io.length` bytes at `io.addresses[i]` into `io.slots[i]`
        at `io.offset`. A tier with a batched path (one native call, one request per node) says so
        by overriding this; the default writes one by one.

        Returns:
            The failures, by index into the batch: the error `write` would raise for that slot
            (`OSError`, including `TierIOError`/`TierUnavailable`; `IndexError`; `IntegrityError`).
            The others are written. Empty when every slot was written.
        Raises:
            What is a bug rather than one block's failure (e.g. `TypeError`), for the whole batch.
        """
        return self._one_by_one(io, self.write)

    def read_spans(self, io: SpanIO) -> dict[int, Exception]:
        """Batched `read`: for each `i`, `io.slots[i]`'s bytes at `io.offset` into the `io.length`
        bytes at `io.addresses[i]`. Returns and raises as `write_spans`; a failed slot's
        destination bytes are undefined."""
        return self._one_by_one(io, self.read)

    def _one_by_one(self, io: SpanIO, method) -> dict[int, Exception]:
        """`write_spans`/`read_spans` by the single-slot `method`, binding each key first."""
        failed: dict[int, Exception] = {}
        for i, (slot, address) in enumerate(zip(io.slots, io.addresses)):
            try:
                if self.shared:
                    self.bind(slot, io.keys[i])
                method(slot, host_tensor(address, io.length), io.offset)
            except (OSError, IndexError, IntegrityError) as e:
                failed[i] = e
        return failed

    def describe(self) -> dict[str, object]:
        """Facts for `kvtier info`: kind, medium, capacity, and anything a user should know."""
        return {
            "tier": self.kind.name.lower(),
            "medium": self.medium.value,
            "slot_bytes": self.slot_bytes,
            "num_slots": self.num_slots,
            "capacity_bytes": self.capacity_bytes,
        }

    def probe(self) -> None:
        """Checks that the tier can serve, after it failed as a whole (`TierUnavailable`); the
        runtime calls it with backoff and puts the tier back in the cascade when it returns.
        Quick, bounded by the tier's own timeouts; the default (memory tiers) always succeeds.

        Raises:
            TierUnavailable: the tier still cannot serve; the message says why.
        """

    def recall(self, fingerprint: bytes, num_layers: int) -> list[tuple[int, Hashable, tuple[int, ...]]]:
        """A persistent tier (`persist`): the blocks an earlier run recorded under `fingerprint`
        (16 bytes naming the block layout and key namespace), as (slot, key, per-layer
        checksums); from now on it records what lands (`remember`). Empty for the others.

        Raises:
            TierIOError: the tier's record cannot be opened.
        """
        return []

    def remember(self, slot: int, key: Hashable, checksums: tuple[int, ...]) -> None:
        """A persistent tier records that `slot` now holds block `key`, with its checksums (the
        default, for the others, records nothing)."""

    def close(self) -> None:
        """Releases the tier's memory or files. Idempotent."""

    def _check_range(self, slot: int, offset: int, length: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"{self.kind.name} slot {slot} out of range [0, {self.num_slots})")
        if offset < 0 or length < 0 or offset + length > self.slot_bytes:
            raise IndexError(
                f"{self.kind.name} slot {slot}: range [{offset}, {offset + length}) "
                f"outside slot of {self.slot_bytes} bytes"
            )


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` for two CPU tensors of the same bytes, as one thread's memcpy.

    Why not `copy_`: torch splits a CPU copy over its intra-op OpenMP threads, which on a host
    whose cores are busy (a CPU inference engine's own OpenMP threads, the usual case for
    kvtier's copies) wait for each other: a 64 KiB copy took ~6 ms against ~4 µs for NumPy's
    single-threaded copy on this 2-core machine while another process computed. NumPy's copy
    releases the GIL, so workers still copy in parallel.
    """
    try:
        np.copyto(dst.numpy(), src.numpy(), casting="no")
    except (RuntimeError, TypeError, ValueError):  # a tensor numpy cannot view (e.g. one needing grad)
        dst.copy_(src)


def host_tensor(address: int, length: int) -> torch.Tensor:
    """A 1-D uint8 CPU tensor over `length` bytes of host memory at `address`, which the caller
    keeps valid while the tensor is used (no copy; nothing is freed with it)."""
    if length == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_uint8 * length).from_address(address), dtype=torch.uint8)


def as_byte_buffer(t: torch.Tensor, what: str) -> torch.Tensor:
    """Checks that `t` is a 1-D contiguous uint8 tensor; returns it.

    Raises:
        TypeError: naming `what` and the offending dtype or shape.
    """
    if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
        raise TypeError(f"{what} must be a 1-D contiguous uint8 tensor, got {t.dtype} {tuple(t.shape)}")
    return t


def slots_needed(capacity_bytes: int, slot_bytes: int, tier: str) -> int:
    """Number of whole slots that fit in `capacity_bytes`.

    Raises:
        CapacityError: fewer than one slot fits.
    """
    from kvtier.errors import CapacityError

    n = capacity_bytes // slot_bytes
    if n < 1:
        raise CapacityError(
            f"tier {tier}: capacity {capacity_bytes} bytes is smaller than one block of {slot_bytes} bytes"
        )
    return n


__all__: Sequence[str] = ("Medium", "SpanIO", "Tier", "TierKind", "as_byte_buffer", "copy_bytes", "host_tensor",
                          "slots_needed")
