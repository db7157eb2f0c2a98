"""Model geometry: how many KV bytes a model keeps per token, per layer and per block.

Per token and layer, a model stores:
- full attention: `2 × num_kv_heads × head_dim × dtype_bytes` (K and V; GQA/MQA through `num_kv_heads`);
- sliding-window attention: the same per token, but a sequence only keeps its last `window_tokens`;
- MLA (DeepSeek-V2/V3): one compressed latent of `kv_lora_rank + qk_rope_head_dim` elements (no factor 2).

A kvtier block always stores every layer for all of its tokens (a cached prefix must be complete
for any later window position), so `block_layout` ignores windows; `kv_bytes_for_tokens` honours
them, because that is what an engine keeps resident for one live sequence.
"""

from __future__ import annotations

import enum
import json
import numbers
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvtier.errors import GeometryError
from kvtier.model.layout import BlockLayout
from kvtier.units import check_number


class KVDtype(enum.Enum):
    """The element type of a KV cache; its `bytes` is what sizing multiplies by."""

    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"
    INT8 = "int8"
    FP32 = "fp32"

    @property
    def bytes(self) -> int:
        """Bytes per element."""
        return _DTYPE_BYTES[self]

    @classmethod
    def parse(cls, value: KVDtype | str) -> KVDtype:
        """Reads a dtype name case-insensitively: `fp16`, `float16`, `torch.bfloat16`, `fp8_e4m3`, ...

        Raises:
            GeometryError: the name is not a known KV dtype; the message lists the valid ones.
        """
        if isinstance(value, KVDtype):
            return value
        if not isinstance(value, str):
            raise GeometryError(f"kv_dtype must be a string, got {value!r}; valid: {_valid_dtypes()}")
        key = value.strip().lower().removeprefix("torch.")
        if key not in _DTYPE_ALIASES:
            raise GeometryError(f"unknown kv_dtype {value!r}; valid: {_valid_dtypes()}")
        return _DTYPE_ALIASES[key]


_DTYPE_BYTES = {KVDtype.FP16: 2, KVDtype.BF16: 2, KVDtype.FP8: 1, KVDtype.INT8: 1, KVDtype.FP32: 4}
_DTYPE_ALIASES: dict[str, KVDtype] = {
    **{d.value: d for d in KVDtype},
    "float16": KVDtype.FP16, "half": KVDtype.FP16, "f16": KVDtype.FP16,
    "bfloat16": KVDtype.BF16,
    "fp8_e4m3": KVDtype.FP8, "fp8_e5m2": KVDtype.FP8, "float8_e4m3fn": KVDtype.FP8, "float8_e5m2": KVDtype.FP8,
    "float32": KVDtype.FP32, "float": KVDtype.FP32, "f32": KVDtype.FP32,
}  # fmt: skip


def _valid_dtypes() -> str:
    return ", ".join(d.value for d in KVDtype)


class LayerKind(enum.Enum):
    """How one attention layer keeps its KV. Values match Hugging Face `layer_types` where they exist."""

    FULL = "full_attention"
    SLIDING = "sliding_attention"
    MLA = "mla"


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One attention layer: its kind and, for a sliding layer, how many tokens it keeps."""

    kind: LayerKind
    window_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.kind is LayerKind.SLIDING:
            _check_positive("window_tokens", self.window_tokens)
        elif self.window_tokens is not None:
            raise GeometryError(f"window_tokens is only valid for sliding layers, not {self.kind.value}")

    def tokens_kept(self, num_tokens: int) -> int:
        """How many of a sequence's `num_tokens` tokens this layer holds."""
        if self.kind is LayerKind.SLIDING:
            return min(num_tokens, self.window_tokens)
        return num_tokens


@dataclass(frozen=True)
class ModelGeometry:
    """The KV-cache shape of one model.

    Attributes:
        name: display name (catalog name or the config's `_name_or_path`).
        layers: one spec per attention layer.
        num_kv_heads: KV heads per layer (== num_attention_heads for MHA, 1 for MQA).
        head_dim: dimension of one head. Informational for MLA layers.
        num_attention_heads: query heads per layer.
        kv_dtype: element type of the cache.
        kv_lora_rank: MLA latent rank; 0 when the model has no MLA layers.
        qk_rope_head_dim: MLA decoupled RoPE key dimension; 0 without MLA.
    """

    name: str
    layers: tuple[LayerSpec, ...]
    num_kv_heads: int
    head_dim: int
    num_attention_heads: int
    kv_dtype: KVDtype
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "kv_dtype", KVDtype.parse(self.kv_dtype))
        if not self.layers:
            raise GeometryError(f"{self.name}: a model needs at least one layer")
        for field in ("num_kv_heads", "head_dim", "num_attention_heads"):
            _check_positive(field, getattr(self, field), self.name)
        _check_divisible(self.name, self.num_attention_heads, self.num_kv_heads)
        if any(spec.kind is LayerKind.MLA for spec in self.layers):
            _check_positive("kv_lora_rank", self.kv_lora_rank, self.name)
            _check_positive("qk_rope_head_dim", self.qk_rope_head_dim, self.name)

    @classmethod
    def uniform(
        cls,
        name: str,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        kv_dtype: KVDtype | str,
        num_attention_heads: int | None = None,
    ) -> ModelGeometry:
        """A model whose `num_layers` layers are all full attention (attention heads default to KV heads).

        Raises:
            GeometryError: a value is not positive or heads do not divide.
        """
        _check_positive("num_layers", num_layers, name)
        heads = num_kv_heads if num_attention_heads is None else num_attention_heads
        layers = (LayerSpec(LayerKind.FULL),) * num_layers
        return cls(name, layers, num_kv_heads, head_dim, heads, KVDtype.parse(kv_dtype))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_kv_bytes_per_token(self, layer: int) -> int:
        """KV bytes layer `layer` stores for one token.

        Raises:
            IndexError: layer is out of range.
        """
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for {self.num_layers} layers")
        return self._spec_bytes_per_token(self.layers[layer])

    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token over all layers, as if every layer (sliding ones too) kept it."""
        return sum(self._spec_bytes_per_token(spec) for spec in self.layers)

    def kv_bytes_per_token_by_kind(self) -> dict[LayerKind, int]:
        """`kv_bytes_per_token` split by layer kind; only kinds the model has appear."""
        totals: dict[LayerKind, int] = {}
        for spec in self.layers:
            totals[spec.kind] = totals.get(spec.kind, 0) + self._spec_bytes_per_token(spec)
        return totals

    def num_layers_by_kind(self) -> dict[LayerKind, int]:
        """How many layers of each kind the model has."""
        return dict(Counter(spec.kind for spec in self.layers))

    def kv_bytes_for_tokens(self, num_tokens: int) -> int:
        """KV bytes one sequence of `num_tokens` tokens keeps; a sliding layer keeps at most its window.

        Raises:
            GeometryError: num_tokens is negative or not an integer.
        """
        _check_non_negative("num_tokens", num_tokens)
        return sum(self._spec_bytes_per_token(s) * s.tokens_kept(num_tokens) for s in self.layers)

    def kv_bytes_total(self, seq_lens: int | Iterable[int], batch: int = 1) -> int:
        """KV bytes of `batch` copies of every sequence length in `seq_lens`.

        Args:
            seq_lens: one sequence length, or several (each counted once per batch).
            batch: concurrent sequences per length.

        Returns:
            `batch × Σ kv_bytes_for_tokens(n)` over `seq_lens`.

        Raises:
            GeometryError: a length is negative or batch is not positive.
        """
        _check_positive("batch", batch)
        lens = [seq_lens] if isinstance(seq_lens, numbers.Integral) else list(seq_lens)
        return batch * sum(self.kv_bytes_for_tokens(n) for n in lens)

    def with_kv_dtype(self, kv_dtype: KVDtype | str) -> ModelGeometry:
        """The same model with another cache dtype.

        Raises:
            GeometryError: unknown dtype.
        """
        return replace(self, kv_dtype=KVDtype.parse(kv_dtype))

    def block_layout(self, block_tokens: int) -> BlockLayout:
        """The layer-major layout of one block; every layer stores all `block_tokens` tokens.

        Raises:
            GeometryError: block_tokens is not positive.
        """
        _check_positive("block_tokens", block_tokens)
        return BlockLayout(block_tokens, tuple(self._spec_bytes_per_token(s) * block_tokens for s in self.layers))

    def block_bytes(self, block_tokens: int) -> int:
        """Bytes of one block of `block_tokens` tokens (all layers)."""
        return self.block_layout(block_tokens).block_bytes

    def _spec_bytes_per_token(self, spec: LayerSpec) -> int:
        if spec.kind is LayerKind.MLA:
            return (self.kv_lora_rank + self.qk_rope_head_dim) * self.kv_dtype.bytes
        return 2 * self.num_kv_heads * self.head_dim * self.kv_dtype.bytes


# ---------------------------------------------------------------------------------------------
# Hugging Face config.json


def from_hf_config(
    config: Mapping[str, Any] | str | Path,
    kv_dtype: KVDtype | str | None = None,
    name: str | None = None,
) -> ModelGeometry:
    """Reads a model's KV geometry from a Hugging Face `config.json`.

    Args:
        config: the parsed dict, a path to config.json, or a directory holding one. A multimodal
            config's `text_config` is used when the top level has no `num_hidden_layers`.
        kv_dtype: cache dtype; defaults to the config's `torch_dtype` (or `dtype`; float32 becomes
            bf16, as engines serve it), else fp16.
        name: display name; defaults to `_name_or_path`, the directory name, or `model_type`.

    Returns:
        The geometry, with sliding layers from `layer_types`, the Gemma-2/3 patterns, Qwen2's
        `use_sliding_window`/`max_window_layers`, or an all-sliding `sliding_window` (Mistral v0.1).

    Raises:
        GeometryError: the file is missing or not JSON, or a field is missing, non-positive or
            inconsistent (e.g. attention heads not divisible by KV heads); the message names it.
    """
    cfg, source = _load_config(config)
    label = name or cfg.get("_name_or_path") or source or cfg.get("model_type") or "config"
    num_layers = _get_positive(cfg, "num_hidden_layers", label)
    num_heads = _get_positive(cfg, "num_attention_heads", label)
    num_kv_heads = _get_positive(cfg, "num_key_value_heads", label, default=num_heads)
    is_mla = cfg.get("kv_lora_rank") is not None
    head_dim = _head_dim(cfg, num_heads, label, is_mla)
    mla = (0, 0)
    if is_mla:
        mla = (_get_positive(cfg, "kv_lora_rank", label), _get_positive(cfg, "qk_rope_head_dim", label))
    layers = (LayerSpec(LayerKind.MLA),) * num_layers if is_mla else _attention_layers(cfg, num_layers, label)
    dtype = KVDtype.parse(kv_dtype) if kv_dtype is not None else _config_dtype(cfg, label)
    return ModelGeometry(str(label), layers, num_kv_heads, head_dim, num_heads, dtype, *mla)


def load_hf_config(config: Mapping[str, Any] | str | Path) -> tuple[dict[str, Any], str | None]:
    """A Hugging Face config as a dict, read the way `from_hf_config` reads it.

    Args:
        config: the parsed dict, a path to config.json, or a directory holding one.

    Returns:
        (the config, a multimodal config's `text_config` merged up; the name of the directory the
        file sits in, or None for a dict).

    Raises:
        GeometryError: the file is missing, unreadable or not a JSON object.
    """
    return _load_config(config)


def _load_config(config: Mapping[str, Any] | str | Path) -> tuple[dict[str, Any], str | None]:
    if isinstance(config, Mapping):
        cfg, source = dict(config), None
    else:
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise GeometryError(f"no model config at {str(path)!r}")
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise GeometryError(f"cannot read model config {str(path)!r}: {e}") from e
        if not isinstance(cfg, dict):
            raise GeometryError(f"model config {str(path)!r} is not a JSON object")
        source = path.resolve().parent.name
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), Mapping):
        cfg = {"torch_dtype": cfg.get("torch_dtype"), **cfg["text_config"]}
    return cfg, source


def _head_dim(cfg: Mapping[str, Any], num_heads: int, label: str, is_mla: bool) -> int:
    if cfg.get("head_dim") is not None:
        return _get_positive(cfg, "head_dim", label)
    if is_mla and cfg.get("qk_nope_head_dim") is not None:
        return _get_positive(cfg, "qk_nope_head_dim", label) + _get_positive(cfg, "qk_rope_head_dim", label)
    hidden_size = _get_positive(cfg, "hidden_size", label)
    if hidden_size % num_heads:
        raise GeometryError(
            f"{label}: hidden_size ({hidden_size}) is not divisible by num_attention_heads ({num_heads}); "
            "set head_dim explicitly"
        )
    return hidden_size // num_heads


def _attention_layers(cfg: Mapping[str, Any], num_layers: int, label: str) -> tuple[LayerSpec, ...]:
    kinds = _layer_kinds(cfg, num_layers, label)
    window = None
    if LayerKind.SLIDING in kinds:
        window = _get_positive(cfg, "sliding_window", label)
    return tuple(LayerSpec(k, window if k is LayerKind.SLIDING else None) for k in kinds)


def _layer_kinds(cfg: Mapping[str, Any], num_layers: int, label: str) -> list[LayerKind]:
    """Which layers slide, following the rules transformers applies for each model family."""
    if cfg.get("layer_types") is not None:
        return _parse_layer_types(cfg["layer_types"], num_layers, label)
    full, sliding = LayerKind.FULL, LayerKind.SLIDING
    if cfg.get("sliding_window") is None:
        return [full] * num_layers
    if "use_sliding_window" in cfg:  # Qwen2 family: layers at or past max_window_layers slide
        if not cfg["use_sliding_window"]:
            return [full] * num_layers
        first = _get_non_negative(cfg, "max_window_layers", label, default=28)  # transformers' default
        return [sliding if i >= first else full for i in range(num_layers)]
    if cfg.get("model_type") == "gemma2":  # even layers slide, odd layers are global
        return [sliding if (i + 1) % 2 else full for i in range(num_layers)]
    pattern_field = "sliding_window_pattern"
    if cfg.get(pattern_field) is not None or str(cfg.get("model_type", "")).startswith("gemma3"):
        pattern = _get_positive(cfg, pattern_field, label, default=6)  # every pattern-th layer is global
        return [sliding if (i + 1) % pattern else full for i in range(num_layers)]
    return [sliding] * num_layers  # Mistral-7B v0.1 style: every layer slides


def _parse_layer_types(layer_types: Any, num_layers: int, label: str) -> list[LayerKind]:
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        got = len(layer_types) if isinstance(layer_types, list) else type(layer_types).__name__
        raise GeometryError(f"{label}: layer_types must list {num_layers} entries (num_hidden_layers), got {got}")
    valid = {LayerKind.FULL.value: LayerKind.FULL, LayerKind.SLIDING.value: LayerKind.SLIDING}
    bad = [t for t in layer_types if t not in valid]
    if bad:
        raise GeometryError(f"{label}: layer_types has unsupported entry {bad[0]!r}; valid: {', '.join(valid)}")
    return [valid[t] for t in layer_types]


def _config_dtype(cfg: Mapping[str, Any], label: str) -> KVDtype:
    """The cache dtype an engine picks by default ("auto") for this checkpoint.

    A float32 checkpoint (e.g. Gemma-2) is served in 16 bits, as vLLM does; ask for fp32 explicitly.
    """
    value = cfg.get("torch_dtype") or cfg.get("dtype")
    if value is None:
        return KVDtype.FP16  # same width as bf16; only the byte count matters for sizing
    try:
        dtype = KVDtype.parse(value)
    except GeometryError as e:
        raise GeometryError(f"{label}: torch_dtype: {e}; pass kv_dtype explicitly") from e
    return KVDtype.BF16 if dtype is KVDtype.FP32 else dtype


# ---------------------------------------------------------------------------------------------
# validation helpers

_MISSING = object()


def _get_positive(cfg: Mapping[str, Any], field: str, label: str, default: Any = _MISSING) -> int:
    value = _get(cfg, field, label, default)
    _check_positive(field, value, label)
    return value


def _get_non_negative(cfg: Mapping[str, Any], field: str, label: str, default: Any = _MISSING) -> int:
    value = _get(cfg, field, label, default)
    _check_non_negative(field, value, label)
    return value


def _get(cfg: Mapping[str, Any], field: str, label: str, default: Any) -> Any:
    value = cfg.get(field)
    if value is None and default is _MISSING:
        raise GeometryError(f"{label}: config is missing required field {field!r}")
    return default if value is None else value


def _check_positive(field: str, value: Any, label: str | None = None) -> None:
    _check_int(field, value, label, minimum=1)


def _check_non_negative(field: str, value: Any, label: str | None = None) -> None:
    _check_int(field, value, label, minimum=0)


def _check_int(field: str, value: Any, label: str | None, minimum: int) -> None:
    check_number(value, f"{label}: {field}" if label else field, integral=True, positive=minimum == 1,
                 minimum=minimum, error=GeometryError)


def _check_divisible(label: str, num_heads: int, num_kv_heads: int) -> None:
    if num_heads % num_kv_heads:
        raise GeometryError(
            f"{label}: num_attention_heads ({num_heads}) is not divisible by num_key_value_heads ({num_kv_heads})"
        )
