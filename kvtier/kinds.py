"""The enums every layer shares: tiers, media, cache modes, pool backends.

Imports nothing of kvtier, torch or YAML, so the manager, the config, the CLI and the pool node
can all use them.
"""

import enum


class TierKind(enum.IntEnum):
    """The four tiers, ordered from fastest (0) to slowest; demotion goes to a larger value."""

    HBM = 0
    DRAM = 1
    POOL = 2
    SSD = 3


class Medium(enum.Enum):
    """What a tier's bytes physically are; the transfer engine routes copies by (src, dst) medium."""

    DEVICE = "device"  # GPU memory (or the CPU tensor standing in for it)
    HOST = "host"  # host DRAM, pinned when CUDA is present
    REMOTE = "remote"  # a memory pool node reached over RDMA or TCP
    DISK = "disk"  # NVMe SSD files


class CacheMode(enum.Enum):
    """Exclusive keeps one copy of a block; inclusive writes through to every lower tier."""

    EXCLUSIVE = "exclusive"
    INCLUSIVE = "inclusive"


class PoolBackend(enum.Enum):
    """Who serves the pool tier: kvtier's own pool nodes, or a Mooncake Store master."""

    KVTIER = "kvtier"
    MOONCAKE = "mooncake"
