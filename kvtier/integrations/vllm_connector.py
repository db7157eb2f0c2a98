"""The connector's former module path, kept so that existing `--kv-transfer-config` lines work.

New configurations name `kvtier.integrations.vllm.connector`.
"""

from kvtier.integrations.vllm.connector import KVTierConnector

__all__ = ["KVTierConnector"]
