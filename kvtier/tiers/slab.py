"""`SlabTier`: what the memory tiers share — one `[num_slots, slot_bytes]` uint8 tensor, a slot a row.

HBM (device memory, or a CPU stand-in) and DRAM (host memory, pinned when CUDA is present) differ in
where the slab is allocated and how bytes cross it; the slot geometry, the zero-copy views, the
checks and closing are the same, and live here once.
"""

from __future__ import annotations

import torch

from kvtier.errors import ConfigError, TierIOError
from kvtier.tiers.base import Tier, slots_needed


class SlabTier(Tier):
    """A tier whose slots are the rows of one uint8 tensor; subclasses allocate it (`_slab`)."""

    def __init__(self, capacity_bytes: int, slot_bytes: int) -> None:
        """Sets the slot geometry; the subclass then allocates `self._slab`.

        Raises:
            ConfigError: slot_bytes is not positive.
            CapacityError: capacity is below one slot.
        """
        name = self.kind.name
        if slot_bytes <= 0:
            raise ConfigError(f"{name} tier: slot_bytes must be positive, got {slot_bytes}")
        self.slot_bytes = slot_bytes
        self.num_slots = slots_needed(capacity_bytes, slot_bytes, name.lower())
        self._slab: torch.Tensor | None = None

    def view(self, slot: int, offset: int, length: int) -> torch.Tensor:
        """A zero-copy 1-D uint8 tensor over `[offset, offset + length)` of `slot`.

        Raises:
            IndexError: slot or range out of bounds.
            TierIOError: the tier is closed.
        """
        self._check_range(slot, offset, length)
        return self._open_slab()[slot, offset : offset + length]

    def memory_rows(self) -> torch.Tensor | None:
        """The slab itself (see `Tier.memory_rows`); None once closed."""
        return self._slab

    def close(self) -> None:
        """Drops the slab; its memory is freed (or, on a GPU, returns to torch's caching allocator)
        once no caller's view refers to it. Idempotent."""
        self._slab = None

    def _open_slab(self) -> torch.Tensor:
        if self._slab is None:
            raise TierIOError(f"{self._label()} is closed")
        return self._slab

    def _label(self) -> str:
        """How errors name this tier."""
        return f"{self.kind.name} tier"
