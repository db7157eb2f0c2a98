"""The SGLang storage backend's former module path, kept so that existing
`--hicache-storage-backend-extra-config` lines (`"module_path": "kvtier.integrations.sglang_storage"`)
work. New configurations name `kvtier.integrations.sglang.storage`.
"""

from kvtier.integrations.sglang.storage import KVTierHiCacheStorage

__all__ = ["KVTierHiCacheStorage"]
