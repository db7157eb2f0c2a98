"""What of the engine's effective model config changes K and V without changing a file.

The namespace already names the weight files and `config.json` (`kvtier.model.weights`), the engine's
dtype and quantization method (`EngineFacts.load_settings`), its KV cache dtype and page format
and its attention variant. What vLLM can change besides, at start-up, with the same files:
  * `--hf-overrides`: any field of the model's config (RoPE's `rope_theta` / `rope_parameters`,
    layer counts, ...), applied over `config.json` in memory;
  * `--hf-config-path`: a config read from elsewhere than the weights' folder;
  * `--quantization-config`: the quantization method's settings;
  * `kv_cache_dtype_skip_layers`: layers whose KV stays in the model's dtype;
  * LongRoPE (Phi-3 and kin): vLLM uses the long factors for every position when `max_model_len`
    exceeds `original_max_position_embeddings`, so that choice is part of the KV.
`config_overrides` returns those that are set, and nothing for an engine that sets none, whose
keys therefore stay what they were (persisted blocks stay valid). Any override changes the keys,
whether it touches K and V or not: a miss costs a recompute, a wrong hit a wrong answer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import xxhash

from kvtier.errors import ConfigError
from kvtier.model.weights import fingerprint_config

_LONG_ROPE = "longrope"


def config_overrides(model_config: Any, cache_config: Any) -> dict[str, str]:
    """The engine's config overrides that go into block keys, by name, as canonical JSON; {} for none.

    Args:
        model_config: vLLM's `ModelConfig` (`hf_overrides`, `hf_config_path`, `quantization_config`,
            `hf_text_config`, `max_model_len`).
        cache_config: vLLM's `CacheConfig` (`kv_cache_dtype_skip_layers`).
    """
    found: dict[str, str] = {}
    overrides = getattr(model_config, "hf_overrides", None)
    if callable(overrides):  # a function of the config (Python API): name its result instead
        found["hf_overrides"] = "fn:" + _config_digest(model_config)
    elif overrides:
        found["hf_overrides"] = _canonical(overrides)
    if getattr(model_config, "hf_config_path", None):
        found["hf_config_path"] = f"{model_config.hf_config_path}:{_config_digest(model_config)}"
    for name, value in (("quantization_config", getattr(model_config, "quantization_config", None)),
                        ("kv_cache_dtype_skip_layers", getattr(cache_config, "kv_cache_dtype_skip_layers", None))):
        if value:
            found[name] = _canonical(value)
    long_rope = _long_rope_in_use(model_config)
    if long_rope is not None:
        found["long_rope"] = _canonical(long_rope)
    return found


def overrides_id(overrides: Mapping[str, str]) -> str:
    """What `config_overrides` puts in the namespace: a digest of them all ("" for none)."""
    if not overrides:
        return ""
    return "config:" + xxhash.xxh3_128_hexdigest(_canonical(dict(overrides)).encode())


def _long_rope_in_use(model_config: Any) -> bool | None:
    """For a LongRoPE model, whether vLLM uses the long factors (None: not LongRoPE)."""
    config = getattr(model_config, "hf_text_config", None)
    params = [p for p in _rope_parameters(config) if p.get("rope_type", p.get("type")) == _LONG_ROPE]
    if not params:
        return None
    original = params[0].get("original_max_position_embeddings",
                             getattr(config, "original_max_position_embeddings", None))
    if original is None:
        return None
    return int(model_config.max_model_len) > int(original)


def _rope_parameters(config: Any) -> Iterator[Mapping[str, Any]]:
    """The config's RoPE settings: one mapping, or one per layer type (newer transformers)."""
    for name in ("rope_parameters", "rope_scaling"):
        value = getattr(config, name, None)
        if isinstance(value, Mapping):
            nested = [v for v in value.values() if isinstance(v, Mapping)]
            yield from nested or [value]


def _config_digest(model_config: Any) -> str:
    """A digest of the config the engine runs (after every override): `kvtier.model.weights.fingerprint_config`,
    as the Hugging Face binding names a loaded config.

    Raises:
        ConfigError: a config value has no canonical form (its `repr` could hide a difference).
    """
    config = model_config.hf_config
    try:
        return fingerprint_config(config.to_dict() if hasattr(config, "to_dict") else vars(config))
    except ValueError as e:
        raise ConfigError(f"kv_connector: the engine's model config cannot be named in block keys: {e}") from None


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)
