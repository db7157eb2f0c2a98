"""The byte layout of one block: layer-major, each layer's K and V one contiguous slice.

A block holds the KV of `block_tokens` consecutive tokens for every layer of a model. Layer `l`
occupies `[layer_offset(l), layer_offset(l) + layer_bytes[l])`, K first then V, so a layer-wise
load is a range read on every tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

from kvtier.errors import GeometryError


@dataclass(frozen=True)
class BlockLayout:
    """Where each layer's bytes sit inside one block.

    Attributes:
        block_tokens: tokens per block.
        layer_bytes: bytes of layer `l` (K and V together) for one whole block.
    """

    block_tokens: int
    layer_bytes: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.block_tokens <= 0:
            raise GeometryError(f"block_tokens must be positive, got {self.block_tokens}")
        if not self.layer_bytes:
            raise GeometryError("a block layout needs at least one layer")
        bad = [(i, n) for i, n in enumerate(self.layer_bytes) if n <= 0]
        if bad:
            raise GeometryError(f"layer bytes must be positive, got layer {bad[0][0]} = {bad[0][1]}")

    @classmethod
    def uniform(cls, block_tokens: int, num_layers: int, layer_bytes: int) -> "BlockLayout":
        """A layout whose `num_layers` layers all take `layer_bytes`."""
        return cls(block_tokens, (layer_bytes,) * num_layers)

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        return (0, *accumulate(self.layer_bytes))

    @property
    def block_bytes(self) -> int:
        return self.offsets[-1]

    def layer_range(self, layer: int) -> tuple[int, int]:
        """Returns (offset, length) of `layer` inside the block.

        Raises:
            IndexError: layer is out of range.
        """
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for {self.num_layers} layers")
        return self.offsets[layer], self.layer_bytes[layer]
