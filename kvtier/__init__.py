"""kvtier: an LLM inference engine's KV cache across GPU HBM, host DRAM, a memory pool and NVMe SSD.

What an engine uses, importable from here:

    from kvtier import KVTier, load_config, Namespace, block_keys, TierKind

    kv = KVTier(load_config("kvtier.yaml"))
    keys = block_keys(Namespace(model, kv_dtype, block_tokens), token_ids)
    kv.store(keys, blocks); kv.load(keys, into=buffers)   # blocks, buffers: host_rows(n, block_bytes)

Names are resolved on first use (PEP 562), so `import kvtier` alone loads neither torch nor YAML and
a pool node or the command line starts without them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "KVTier": "kvtier.runtime",
    "KVTierConfig": "kvtier.config", "load_config": "kvtier.config", "config_from_dict": "kvtier.config",
    "Namespace": "kvtier.model.keys", "block_keys": "kvtier.model.keys",
    "TierKind": "kvtier.kinds", "CacheMode": "kvtier.kinds", "host_rows": "kvtier.tiers.dram",
    **{name: "kvtier.errors" for name in ("KVTierError", "ConfigError", "GeometryError", "CapacityError",
                                         "TierIOError", "TierUnavailable", "IntegrityError", "TransferError")},
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from kvtier.config import KVTierConfig, config_from_dict, load_config
    from kvtier.errors import (CapacityError, ConfigError, GeometryError, IntegrityError, KVTierError,
                               TierIOError, TierUnavailable, TransferError)
    from kvtier.model.keys import Namespace, block_keys
    from kvtier.kinds import CacheMode, TierKind
    from kvtier.runtime import KVTier
    from kvtier.tiers.dram import host_rows


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
