"""Copy descriptors for the GPU <-> host mover: (dst, src, size) arrays built and checked with NumPy.

A transfer of B blocks over S layer spans is B x S descriptors (`span_descriptors`), one per block and
span. Before they go to the driver they are checked (`check_descriptors`) and those that continue
each other on *both* sides are merged into one (`merge_adjacent`): the blocks of a contiguous run of
slots on both tiers become one copy, which is what lets small blocks reach the bandwidth of large ones.
No Python runs per descriptor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Addresses = Sequence[int] | np.ndarray
_MAX_ADDRESS = np.iinfo(np.uint64).max


@dataclass(frozen=True, slots=True)
class CopyDescriptors:
    """Copies `dst[i] <- src[i]` of `sizes[i]` bytes, as three equal-length 1-D uint64 arrays.

    Attributes:
        dst: destination addresses (device or host, under CUDA's unified addressing).
        src: source addresses.
        sizes: bytes of each copy, all positive.
    """

    dst: np.ndarray
    src: np.ndarray
    sizes: np.ndarray

    def __len__(self) -> int:
        return int(self.sizes.shape[0])

    @property
    def num_bytes(self) -> int:
        return int(self.sizes.sum(dtype=np.uint64))


def as_addresses(values: Addresses, name: str) -> np.ndarray:
    """`values` as a 1-D uint64 array (no copy when it already is one).

    Raises:
        TypeError: the values are not integers.
        ValueError: not one-dimensional, or a value is negative or past 2**64 - 1; the message names `name`.
    """
    try:
        arr = np.asarray(values)
    except OverflowError as e:
        raise ValueError(f"{name}: a value does not fit in 64 bits ({e})") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.uint64)
    if arr.dtype == object and all(isinstance(v, int) for v in arr.tolist()):  # Python ints past int64/uint64
        raise ValueError(f"{name}: a value does not fit in 64 bits (max {int(arr.max())})")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        bad = int(np.argmax(arr < 0))
        raise ValueError(f"{name}[{bad}] is negative: {int(arr[bad])}")
    return arr.astype(np.uint64, copy=False)


def descriptors(dst_ptrs: Addresses, src_ptrs: Addresses, sizes: Addresses | int) -> CopyDescriptors:
    """Packs three address lists (or a size for all) into `CopyDescriptors`, unchecked.

    Raises:
        TypeError, ValueError: as `as_addresses`, or the lengths differ (naming them).
    """
    dst = as_addresses(dst_ptrs, "dst_ptrs")
    src = as_addresses(src_ptrs, "src_ptrs")
    if isinstance(sizes, (int, np.integer)):
        sizes = np.full(dst.shape[0], sizes, dtype=np.int64)
    lengths = as_addresses(sizes, "sizes")
    if not dst.shape[0] == src.shape[0] == lengths.shape[0]:
        raise ValueError(f"dst_ptrs, src_ptrs and sizes differ in length: "
                         f"{dst.shape[0]}, {src.shape[0]}, {lengths.shape[0]}")
    return CopyDescriptors(dst, src, lengths)


def span_descriptors(dst_bases: Addresses, src_bases: Addresses, span_offsets_bytes: Addresses,
                     span_lengths_bytes: Addresses, src_span_offsets_bytes: Addresses | None = None
                     ) -> CopyDescriptors:
    """One descriptor per (block, span): block i's span j at `base + offset`, block-major order.

    Args:
        dst_bases: each block's first byte on the destination (e.g. its slot's address).
        src_bases: each block's first byte on the source, in the same block order.
        span_offsets_bytes: where each span starts inside a destination block (a layer's offset).
        span_lengths_bytes: bytes of each span.
        src_span_offsets_bytes: where each span starts inside a source block; default the same offsets.

    Returns:
        B x S descriptors, unchecked and unmerged.

    Raises:
        TypeError, ValueError: as `as_addresses`, or the block or span lists differ in length.
    """
    dst = as_addresses(dst_bases, "dst_bases")
    src = as_addresses(src_bases, "src_bases")
    offsets = as_addresses(span_offsets_bytes, "span_offsets_bytes")
    lengths = as_addresses(span_lengths_bytes, "span_lengths_bytes")
    src_offsets = offsets if src_span_offsets_bytes is None else as_addresses(src_span_offsets_bytes,
                                                                              "src_span_offsets_bytes")
    if dst.shape != src.shape:
        raise ValueError(f"dst_bases has {dst.shape[0]} blocks but src_bases {src.shape[0]}")
    if not offsets.shape == lengths.shape == src_offsets.shape:
        raise ValueError(f"span offsets and lengths differ in length: {offsets.shape[0]}, {lengths.shape[0]}, "
                         f"{src_offsets.shape[0]}")
    return CopyDescriptors((dst[:, None] + offsets[None, :]).ravel(), (src[:, None] + src_offsets[None, :]).ravel(),
                           np.broadcast_to(lengths, (dst.shape[0], lengths.shape[0])).ravel())


def check_descriptors(batch: CopyDescriptors, alignment_bytes: int = 1) -> None:
    """Refuses a batch the driver must never see.

    Args:
        batch: the descriptors.
        alignment_bytes: every address and size must be a multiple of this (1: any).

    Raises:
        ValueError: a size is 0, an address is 0, a range runs past 2**64, an address or size is not
            a multiple of `alignment_bytes`, or two destination ranges overlap (the copies of one batch
            run in no set order, so they would race); the message names the descriptor(s).
    """
    if len(batch) == 0:
        return
    _first_bad(batch.sizes == 0, "sizes", "is 0", batch.sizes)
    for name, arr in (("dst_ptrs", batch.dst), ("src_ptrs", batch.src)):
        _first_bad(arr == 0, name, "is a null address", arr)
        _first_bad(arr > _MAX_ADDRESS - batch.sizes, name, "plus its size runs past 2**64", arr)
    if alignment_bytes > 1:
        for name, arr in (("dst_ptrs", batch.dst), ("src_ptrs", batch.src), ("sizes", batch.sizes)):
            _first_bad(arr % np.uint64(alignment_bytes) != 0, name, f"is not a multiple of {alignment_bytes}", arr)
    order = np.argsort(batch.dst, kind="stable")
    ends = batch.dst[order] + batch.sizes[order]
    overlap = ends[:-1] > batch.dst[order][1:]
    if overlap.any():
        k = int(np.argmax(overlap))
        a, b = int(order[k]), int(order[k + 1])
        raise ValueError(f"destinations overlap: dst_ptrs[{a}]={int(batch.dst[a]):#x} (+{int(batch.sizes[a])} bytes) "
                         f"and dst_ptrs[{b}]={int(batch.dst[b]):#x}")


def _first_bad(mask: np.ndarray, name: str, what: str, values: np.ndarray) -> None:
    if mask.any():
        i = int(np.argmax(mask))
        raise ValueError(f"{name}[{i}] {what}: {int(values[i]):#x}")


def merge_adjacent(batch: CopyDescriptors) -> CopyDescriptors:
    """Merges descriptors that continue each other on both sides, in destination order.

    Sorted by destination, descriptor k+1 joins k when `dst[k] + sizes[k] == dst[k+1]` and
    `src[k] + sizes[k] == src[k+1]`. The bytes copied are the same: each destination byte gets the
    same source byte. The copies of one batch run in no set order, so reordering changes nothing.

    Returns:
        The merged descriptors, sorted by destination (the batch itself when it has fewer than two).
    """
    if len(batch) < 2:
        return batch
    order = np.argsort(batch.dst, kind="stable")
    dst, src, sizes = batch.dst[order], batch.src[order], batch.sizes[order]
    joins = (dst[:-1] + sizes[:-1] == dst[1:]) & (src[:-1] + sizes[:-1] == src[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return CopyDescriptors(dst[starts], src[starts], np.add.reduceat(sizes, starts))


def merge_reference(batch: CopyDescriptors) -> CopyDescriptors:
    """`merge_adjacent` written plainly, one descriptor at a time, for tests."""
    rows = sorted(zip(batch.dst.tolist(), batch.src.tolist(), batch.sizes.tolist()), key=lambda r: r[0])
    merged: list[list[int]] = []
    for d, s, n in rows:
        if merged and merged[-1][0] + merged[-1][2] == d and merged[-1][1] + merged[-1][2] == s:
            merged[-1][2] += n
        else:
            merged.append([d, s, n])
    columns = list(zip(*merged)) if merged else [(), (), ()]
    return CopyDescriptors(*(np.array(c, dtype=np.uint64) for c in columns))
