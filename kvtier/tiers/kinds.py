"""The names of tiers and media, importable without torch (the CLI, config and pool node need them)."""

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
