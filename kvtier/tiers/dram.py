"""The DRAM tier: one host-memory slab, pinned when CUDA is present, 4 KiB-aligned.

Pinned memory lets the HBM tier's host<->device copies run as true async DMA. The slab is one
anonymous mmap, registered with CUDA once (`cudaHostRegister`) when pinned and unregistered at
close: torch's pinned allocator would round it up to a power of two (a 40 GiB tier would lock
64 GiB). The 4 KiB alignment lets the SSD tier do O_DIRECT I/O straight to and from DRAM slots,
without a bounce buffer, when `slot_bytes` is a multiple of 4096.
"""

from __future__ import annotations

import mmap
import weakref

import torch

from kvtier.errors import CapacityError, ConfigError
from kvtier.tiers.host_memory import allocation_failed, check_fits
from kvtier.tiers.base import Medium, TierKind, as_byte_buffer, copy_bytes
from kvtier.tiers.slab import SlabTier

PAGE_BYTES = 4096
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


class DRAMTier(SlabTier):
    """Host memory as `num_slots` slots of `slot_bytes`, one `[num_slots, slot_bytes]` uint8 tensor."""

    kind = TierKind.DRAM
    medium = Medium.HOST

    def __init__(self, capacity_bytes: int, slot_bytes: int, pin: bool | None = None) -> None:
        """Allocates the slab.

        Args:
            capacity_bytes: bytes to reserve; rounded down to whole slots.
            slot_bytes: bytes per slot (one block).
            pin: None pins exactly when CUDA is available; True requires CUDA; False never pins.
        Raises:
            CapacityError: capacity is below one slot, more than the machine's (or the cgroup's)
                memory, or the memory cannot be reserved (ENOMEM).
            ConfigError: slot_bytes is not positive, or pin=True without CUDA.
        """
        if pin and not torch.cuda.is_available():
            raise ConfigError("DRAM tier: pin=True needs CUDA, which is not available")
        super().__init__(capacity_bytes, slot_bytes)
        self._pinned = torch.cuda.is_available() if pin is None else pin
        total_bytes = self.num_slots * slot_bytes
        check_fits(total_bytes, "DRAM tier")
        try:
            flat = _mmap_aligned(total_bytes)
        except OSError as e:  # ENOMEM from mmap
            raise allocation_failed(e, total_bytes, "DRAM tier") from None
        # unregistered at close, or when the tier is collected (before its slab is unmapped)
        self._unregister = weakref.finalize(self, *_register(flat, total_bytes)) if self._pinned else None
        self._slab = flat.view(self.num_slots, slot_bytes)

    @property
    def pinned(self) -> bool:
        return self._pinned

    def write(self, slot: int, src: torch.Tensor, offset: int = 0) -> None:
        """Copies `src` into `slot` at `offset`; a CUDA `src` is copied synchronously.

        Raises:
            TypeError: src is not a 1-D contiguous uint8 tensor.
            IndexError: slot or range out of bounds.
            TierIOError: the tier is closed.
        """
        src = as_byte_buffer(src, "DRAM write source")
        view = self.view(slot, offset, src.numel())
        view.copy_(src) if src.is_cuda else copy_bytes(view, src)

    def read(self, slot: int, dst: torch.Tensor, offset: int = 0) -> None:
        """Copies `dst.numel()` bytes of `slot` at `offset` into `dst`; a CUDA `dst` synchronously.

        Raises:
            TypeError: dst is not a 1-D contiguous uint8 tensor.
            IndexError: slot or range out of bounds.
            TierIOError: the tier is closed.
        """
        dst = as_byte_buffer(dst, "DRAM read destination")
        view = self.view(slot, offset, dst.numel())
        dst.copy_(view) if dst.is_cuda else copy_bytes(dst, view)

    def close(self) -> None:
        """Unregisters the slab from CUDA (if pinned), then drops it; see `SlabTier.close`. Idempotent."""
        if self._unregister is not None:
            self._unregister()
        super().close()

    def describe(self) -> dict[str, object]:
        """Base facts plus whether the slab is pinned (how) and 4 KiB-aligned (slab and slot starts)."""
        facts = super().describe()
        facts["pinned"] = self._pinned
        facts["pinned_by"] = "cudaHostRegister" if self._pinned else None
        facts["aligned"] = self._slab is not None and self._slab.data_ptr() % PAGE_BYTES == 0
        facts["slots_aligned"] = bool(facts["aligned"]) and self.slot_bytes % PAGE_BYTES == 0
        return facts



def _mmap_aligned(num_bytes: int) -> torch.Tensor:
    """A zeroed, page-aligned 1-D uint8 tensor over an anonymous mmap, every page already touched.

    Touched at start-up so that no store pays the page
    faults of a first write into a slot: a store into a never-used slot used to take ~3x as long
    as into a reused one (1,030 against 311 µs at 1 MiB). The tensor keeps the mapping alive; it is
    unmapped when the last tensor over it is freed.
    """
    region = mmap.mmap(-1, _round_up(num_bytes, PAGE_BYTES))
    flat = torch.frombuffer(region, dtype=torch.uint8, count=num_bytes)
    flat.zero_()  # a write per page: the kernel backs each one now (zero pages would fault again)
    return flat


def _register(flat: torch.Tensor, num_bytes: int) -> tuple:
    """Registers `flat`'s pages with CUDA (portable: pinned for every context) and returns the call
    that unregisters them, as (function, *args) for `weakref.finalize`.

    Raises:
        CapacityError: CUDA refused (e.g. not enough memory can be locked), naming tiers.dram.capacity.
    """
    cudart = torch.cuda.cudart()
    ptr, length = flat.data_ptr(), _round_up(num_bytes, PAGE_BYTES)
    code = int(cudart.cudaHostRegister(ptr, length, _HOST_REGISTER_PORTABLE))
    if code != 0:
        raise CapacityError(f"tiers.dram.capacity: cudaHostRegister of {length:,} bytes failed with cudaError {code}; "
                            "lower the capacity or set pin=False")
    return _unregister, cudart, ptr


def _unregister(cudart, ptr: int) -> None:
    code = int(cudart.cudaHostUnregister(ptr))
    if code != 0:
        raise RuntimeError(f"DRAM tier: cudaHostUnregister({ptr:#x}) failed with cudaError {code}")


def aligned_host_memory(num_bytes: int, pinned: bool) -> torch.Tensor:
    """A zeroed, 4 KiB-aligned 1-D uint8 host tensor whose pages are backed now; pinned when asked,
    by torch's pinned allocator (the benches' host buffers; the DRAM tier registers its own mmap)."""
    return host_rows(1, num_bytes, pinned=True, zeroed=True)[0] if pinned else _mmap_aligned(num_bytes)


def host_rows(num_blocks: int, block_bytes: int, pinned: bool = False, zeroed: bool = False) -> torch.Tensor:
    """A `[num_blocks, block_bytes]` uint8 host tensor (uninitialised unless `zeroed`; pinned when
    asked) whose rows start on 4 KiB pages wherever `block_bytes` is a multiple of 4 KiB.

    What an engine should hand `KVTier.store`/`load`: an SSD tier opened with O_DIRECT reads and
    writes such rows straight, where rows off a page boundary are staged through aligned memory
    (one more copy of every block). Costs what `torch.empty` (`torch.zeros`) does plus one page:
    no mapping of its own. Torch's allocators, the pinned one's cache included, do not promise
    page alignment, so the tensor starts at the first aligned byte of one a page longer.
    """
    raw = (torch.zeros if zeroed else torch.empty)(num_blocks * block_bytes + PAGE_BYTES, dtype=torch.uint8,
                                                   pin_memory=pinned)
    skip = (-raw.data_ptr()) % PAGE_BYTES
    return raw[skip: skip + num_blocks * block_bytes].view(num_blocks, block_bytes)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


__all__ = ("DRAMTier", "PAGE_BYTES", "aligned_host_memory", "host_rows")
