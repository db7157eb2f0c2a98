"""Hugging Face transformers: `HFKVTier` serves a model's prefix KV from kvtier.

`adapter` (`HFKVTier`, `Generation`, `weights_of`, `config_of`, `model_fingerprint`), `codec` (a transformers cache to and from
kvtier blocks), `prefix` (prefix lookup and loading), `stream` (layer-by-layer loading during the
forward), `tiny_model` (a random-weight Llama built locally, for the demo and the benches).
`from kvtier.integrations.hf import HFKVTier` works as before the package split.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"HFKVTier": "adapter", "Generation": "adapter", "weights_of": "adapter", "config_of": "adapter",
            "model_fingerprint": "adapter"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:  # lazy: the package's modules import each other
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvtier.integrations.hf' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvtier.integrations.hf.{_EXPORTS[name]}"), name)
