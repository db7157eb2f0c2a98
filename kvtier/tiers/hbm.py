"""The HBM tier: one preallocated device tensor of fixed-size slots.

On a machine with CUDA the slab lives in GPU memory and host<->device copies run as async
`copy_` calls on a CUDA stream. Where there is no CUDA (or the caller forces `device="cpu"`), a CPU
tensor stands in and every layer above runs the same code; `describe()` says which it is.
"""

from __future__ import annotations

import torch

from kvtier.errors import CapacityError, ConfigError
from kvtier.tiers.host_memory import allocation_failed, check_fits
from kvtier.tiers.base import Medium, TierKind, as_byte_buffer, copy_bytes
from kvtier.tiers.dram import aligned_host_memory
from kvtier.tiers.slab import SlabTier


class HBMTier(SlabTier):
    """GPU memory as `num_slots` slots of `slot_bytes`, one `[num_slots, slot_bytes]` uint8 tensor.

    Copies that cross host and device are issued with `non_blocking=True`. Without a `stream`
    argument, `read`/`write` synchronize the current stream before returning, so the caller's buffer
    is complete (read) or reusable (write) on return. With a `stream`, the copy is only enqueued on
    it: the caller must keep both buffers alive and wait on the stream (or an event) itself.
    """

    kind = TierKind.HBM
    medium = Medium.DEVICE

    def __init__(
        self, capacity_bytes: int, slot_bytes: int, device: str | torch.device | None = None
    ) -> None:
        """Allocates the slab.

        Args:
            capacity_bytes: bytes to reserve; rounded down to whole slots.
            slot_bytes: bytes per slot (one block).
            device: None picks "cuda" when available, else "cpu"; a string or torch.device forces it.
        Raises:
            CapacityError: capacity is below one slot, or the device is out of memory.
            ConfigError: slot_bytes is not positive, or a CUDA device was asked for without CUDA.
        """
        super().__init__(capacity_bytes, slot_bytes)
        self._device, self._stand_in_reason = _pick_device(device)
        self._slab = _allocate(self.num_slots, slot_bytes, self._device)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def is_stand_in(self) -> bool:
        """True when a CPU tensor stands in for GPU memory."""
        return self._device.type != "cuda"

    def write(
        self, slot: int, src: torch.Tensor, offset: int = 0, stream: torch.cuda.Stream | None = None
    ) -> None:
        """Copies `src` (host or device) into `slot` at `offset`; see the class docstring for `stream`.

        Raises:
            TypeError: src is not a 1-D contiguous uint8 tensor.
            IndexError: slot or range out of bounds.
            TierIOError: the tier is closed.
        """
        src = as_byte_buffer(src, "HBM write source")
        dst = self.view(slot, offset, src.numel())
        _copy(dst, src, stream)

    def read(
        self, slot: int, dst: torch.Tensor, offset: int = 0, stream: torch.cuda.Stream | None = None
    ) -> None:
        """Copies `dst.numel()` bytes of `slot` at `offset` into `dst` (host or device).

        Raises:
            TypeError: dst is not a 1-D contiguous uint8 tensor.
            IndexError: slot or range out of bounds.
            TierIOError: the tier is closed.
        """
        dst = as_byte_buffer(dst, "HBM read destination")
        src = self.view(slot, offset, dst.numel())
        _copy(dst, src, stream)

    def describe(self) -> dict[str, object]:
        """Base facts plus the backing device and whether it is a CPU stand-in (and why)."""
        facts = super().describe()
        facts["device"] = str(self._device)
        facts["stand_in"] = self.is_stand_in
        if self.is_stand_in:
            facts["reason"] = self._stand_in_reason
        return facts

    def _label(self) -> str:
        return f"HBM tier on {self._device}"


def _pick_device(device: str | torch.device | None) -> tuple[torch.device, str]:
    """Resolves the `device` argument; returns it and why it is a stand-in (empty if it is not).

    Raises:
        ConfigError: a CUDA device was asked for but CUDA is not available.
    """
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device()), ""
        return torch.device("cpu"), "CUDA is not available"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"HBM tier: device {dev} requested but CUDA is not available")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev, "" if dev.type == "cuda" else f"device {dev} forced by the caller"


def _allocate(num_slots: int, slot_bytes: int, device: torch.device) -> torch.Tensor:
    """A zeroed `[num_slots, slot_bytes]` uint8 tensor on `device`.

    Raises:
        CapacityError: the device cannot hold it.
    """
    if device.type == "cpu":  # the stand-in takes host memory: refused, like the DRAM tier, past the machine's
        check_fits(num_slots * slot_bytes, "HBM tier (a CPU stand-in)")
    try:
        if device.type == "cpu" and num_slots * slot_bytes:
            # page-aligned, as the DRAM slab is: an SSD tier below writes from it with O_DIRECT
            return aligned_host_memory(num_slots * slot_bytes, pinned=False).view(num_slots, slot_bytes)
        return torch.zeros((num_slots, slot_bytes), dtype=torch.uint8, device=device)
    except (RuntimeError, OSError) as e:  # OSError: ENOMEM from the stand-in's mmap
        if device.type == "cpu":  # torch's CPU allocator says ENOMEM as a RuntimeError
            raise allocation_failed(e, num_slots * slot_bytes, "HBM tier (a CPU stand-in)") from None
        if not isinstance(e, torch.cuda.OutOfMemoryError):
            raise
        raise CapacityError(
            f"HBM tier: cannot allocate {num_slots} x {slot_bytes} bytes on {device}: {e}"
        ) from e


def _copy(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
    """`dst.copy_(src)`, correct for the caller whatever devices the two live on.

    Same-device copies need nothing more: on CPU they are synchronous, on one GPU they are ordered on
    the current stream like any later kernel. A host<->device copy is made non-blocking and then,
    unless the caller passed its own stream, the current stream is synchronized so that a host
    buffer is filled (or free to reuse) when this returns.
    """
    if dst.device == src.device:
        if dst.device.type == "cpu":
            copy_bytes(dst, src)
            return
        if stream is None or dst.device.type != "cuda":
            dst.copy_(src)
            return
    cuda_device = dst.device if dst.device.type == "cuda" else src.device
    if stream is not None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        return
    dst.copy_(src, non_blocking=True)
    torch.cuda.current_stream(cuda_device).synchronize()


__all__ = ("HBMTier",)
