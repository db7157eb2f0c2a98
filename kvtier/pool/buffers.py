"""What the pool client does with its callers' bytes: flat views of their buffers, and the
checksum that binds a block's bytes to its key."""

from __future__ import annotations

import ctypes
from typing import Any

import xxhash


def block_checksum(key: bytes, data: Any) -> int:
    """What a pool block's bytes are verified against on every get: xxh3-64 seeded with a 64-bit
    digest of its key, so bytes that land under another key (a node index bug, a misdirected
    write) fail the check and are a miss, never served. Same speed as an unseeded xxh3-64."""
    return xxhash.xxh3_64_intdigest(data, seed=xxhash.xxh3_64_intdigest(key))


def byte_view(buf: Any, *, writable: bool, what: str) -> memoryview:
    """A flat byte `memoryview` of bytes, bytearray, memoryview, a numpy array or a CPU torch tensor.

    Raises:
        ValueError: the buffer is not contiguous, or is read-only where it must be written.
    """
    if hasattr(buf, "numpy") and hasattr(buf, "is_contiguous"):  # a torch tensor, without importing torch
        if not buf.is_cpu or not buf.is_contiguous():
            raise ValueError(f"{what}: expected a contiguous CPU tensor")
        size = buf.numel() * buf.element_size()
        if size:  # a ctypes array over its bytes (~1 µs; through NumPy ~3): it holds the tensor alive
            window = (ctypes.c_uint8 * size).from_address(buf.data_ptr())
            window.owner = buf
            return memoryview(window).cast("B")
        buf = buf.numpy()
    view = memoryview(buf)
    if not view.contiguous:
        raise ValueError(f"{what}: expected a contiguous buffer")
    if writable and view.readonly:
        raise ValueError(f"{what}: expected a writable buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
