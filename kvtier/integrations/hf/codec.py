"""Between Hugging Face per-layer K/V tensors and kvtier's layer-major blocks.

A transformers cache layer holds K and V as `[batch, kv_heads, tokens, head_dim]`. A kvtier block
holds `block_tokens` tokens of every layer; inside layer `l`'s slice, K comes first, then V, each
token-major `[block_tokens, kv_heads, head_dim]` — the page layout vLLM uses, so the bytes of one
block mean the same thing to every engine that shares a namespace.

`bind_model` checks, once and up front, that a model's geometry is the one a `KVTier` was built
for; a mismatch would otherwise surface mid-request as garbage attention, never as an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.errors import ConfigError, GeometryError
from kvtier.model.geometry import KVDtype, LayerKind, from_hf_config
from kvtier.model.keys import Namespace
from kvtier.model.layout import BlockLayout
from kvtier.tiers.dram import host_rows

_KV_DTYPES = {torch.float32: KVDtype.FP32, torch.float16: KVDtype.FP16, torch.bfloat16: KVDtype.BF16}

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class BlockCodec:
    """Packs and unpacks the blocks of one model (batch 1, full-attention layers only).

    Attributes:
        layout: the kvtier block layout; layer `l`'s slice is K then V.
        num_kv_heads, head_dim: per layer, as the model's attention produces them.
        dtype: the element type of the model's K/V tensors.
    """

    layout: BlockLayout
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_tokens(self) -> int:
        return self.layout.block_tokens

    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    def pack(self, layers: Sequence[KV], start_token: int, num_blocks: int) -> torch.Tensor:
        """`num_blocks` blocks of the tokens from `start_token`, as `[num_blocks, block_bytes]` host uint8.

        Args:
            layers: per layer, K and V `[1, kv_heads, tokens, head_dim]` covering those tokens.
        """
        out = host_rows(num_blocks, self.layout.block_bytes)
        num_tokens = num_blocks * self.block_tokens
        for layer, kv in enumerate(layers):
            offset, length = self.layout.layer_range(layer)
            half = length // 2
            for part, states in enumerate(kv):
                tokens = states[0, :, start_token:start_token + num_tokens, :].transpose(0, 1)  # [T, H, D]
                raw = tokens.to("cpu").contiguous().view(torch.uint8).reshape(num_blocks, half)
                out[:, offset + part * half: offset + (part + 1) * half] = raw
        return out

    def unpack_layer(self, blocks: torch.Tensor, layer: int, num_blocks: int) -> KV:
        """Layer `layer`'s K and V of the first `num_blocks` rows of `blocks`, as `[1, kv_heads, T, head_dim]`.

        The tensors may alias `blocks`: copy them (e.g. `torch.cat`) before `blocks` is reused.
        """
        offset, length = self.layout.layer_range(layer)
        half = length // 2
        parts = []
        for part in range(2):
            raw = blocks[:num_blocks, offset + part * half: offset + (part + 1) * half]
            tokens = raw.view(self.dtype).reshape(num_blocks * self.block_tokens, self.num_kv_heads, self.head_dim)
            parts.append(tokens.permute(1, 0, 2).unsqueeze(0))
        return parts[0], parts[1]

    def check_states(self, key_states: torch.Tensor, value_states: torch.Tensor, layer: int) -> None:
        """Raises unless both are `[1, kv_heads, T, head_dim]` of the bound dtype.

        Raises:
            GeometryError: heads, head size or dtype differ from the bound model's.
            ValueError: a batch other than 1 (these caches hold one sequence).
        """
        for name, states in (("key", key_states), ("value", value_states)):
            if states.dim() != 4 or states.shape[0] != 1:
                raise ValueError(f"layer {layer}: kvtier caches hold one sequence; got {name} states "
                                 f"of shape {tuple(states.shape)} (batch must be 1)")
            if states.shape[1] != self.num_kv_heads or states.shape[3] != self.head_dim or states.dtype != self.dtype:
                raise GeometryError(
                    f"layer {layer}: {name} states are {tuple(states.shape)} {states.dtype}, but the kvtier "
                    f"layout was bound to [1, {self.num_kv_heads}, T, {self.head_dim}] {self.dtype}")


def bind_model(config: Any, dtype: torch.dtype, layout: BlockLayout, namespace: Namespace) -> BlockCodec:
    """The codec of a transformers model, after checking it matches `layout` and `namespace`.

    Args:
        config: the model's `PretrainedConfig` (its decoder text config is used).
        dtype: the dtype the model computes K/V in (`model.dtype`).
        layout: the block layout of the `KVTier` that will hold the blocks.
        namespace: the namespace block keys are made in.

    Raises:
        GeometryError: the model's layers, KV heads, head size or dtype give another layout than
            `layout`, the namespace names another KV dtype, or the model has sliding-window or MLA
            layers (not supported here). The message says which value differs.
        ConfigError: the namespace's block_tokens differ from the layout's.
    """
    kv_dtype = _KV_DTYPES.get(dtype)
    if kv_dtype is None:
        raise GeometryError(f"model dtype {dtype} is not supported by the kvtier HF cache; "
                            f"use one of {', '.join(str(d) for d in _KV_DTYPES)}")
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    raw = text_config.to_dict() if hasattr(text_config, "to_dict") else dict(text_config)
    geometry = from_hf_config(raw, kv_dtype=kv_dtype)
    kinds = {spec.kind for spec in geometry.layers}
    if kinds != {LayerKind.FULL}:
        other = sorted(k.value for k in kinds - {LayerKind.FULL})
        raise GeometryError(f"{geometry.name}: the kvtier HF cache supports full-attention layers only, "
                            f"the model has {', '.join(other)} layers")
    expected = geometry.block_layout(layout.block_tokens)
    if expected != layout:
        raise GeometryError(_layout_mismatch(geometry.name, expected, layout, geometry.num_kv_heads,
                                             geometry.head_dim, kv_dtype))
    if namespace.block_tokens != layout.block_tokens:
        raise ConfigError(f"Namespace.block_tokens is {namespace.block_tokens} but the kvtier layout has "
                          f"block_tokens {layout.block_tokens}; they must be equal")
    if KVDtype.parse(namespace.kv_dtype) is not kv_dtype:
        raise GeometryError(f"Namespace.kv_dtype is {namespace.kv_dtype!r} but {geometry.name} computes "
                            f"its KV in {kv_dtype.value}")
    return BlockCodec(layout, geometry.num_kv_heads, geometry.head_dim, dtype)


def _layout_mismatch(name: str, expected: BlockLayout, layout: BlockLayout, heads: int, head_dim: int,
                     kv_dtype: KVDtype) -> str:
    model_side = (f"{expected.num_layers} layers x {expected.layer_bytes[0]} bytes per layer "
                  f"({layout.block_tokens} tokens x 2 x {heads} KV heads x {head_dim} x {kv_dtype.bytes} bytes "
                  f"for {kv_dtype.value})")
    runtime_side = f"{layout.num_layers} layers x {sorted(set(layout.layer_bytes))} bytes per layer"
    return (f"{name} does not match the kvtier block layout: the model needs {model_side}, the KVTier was built "
            f"for {runtime_side}; build the KVTier from this model's config.json and its KV dtype")
