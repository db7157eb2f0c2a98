"""Building a tier from its configuration section (the runtime's, the CLI's and the bench's way in)."""

from __future__ import annotations

from kvtier.config import TierConfig
from kvtier.errors import ConfigError, TierIOError
from kvtier.tiers.base import Tier, TierKind


def build_tier(cfg: TierConfig, slot_bytes: int) -> Tier:
    """The tier a config section describes.

    Raises:
        ConfigError: the tier kind has no local implementation.
        CapacityError, TierIOError: as the tier's constructor.
    """
    if cfg.kind is TierKind.HBM:
        from kvtier.tiers.hbm import HBMTier
        return HBMTier(cfg.capacity_bytes, slot_bytes, device=cfg.device)
    if cfg.kind is TierKind.DRAM:
        from kvtier.tiers.dram import DRAMTier
        return DRAMTier(cfg.capacity_bytes, slot_bytes)
    if cfg.kind is TierKind.SSD:
        from kvtier.tiers.ssd import SSDTier
        try:
            cfg.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TierIOError(f"tiers.ssd.path {cfg.path}: cannot create the directory: {e.strerror}") from None
        return SSDTier(cfg.path, cfg.capacity_bytes, slot_bytes, num_files=cfg.num_files, direct=cfg.o_direct,
                       persist=cfg.persist)
    if cfg.kind is TierKind.POOL:
        from kvtier.pool.tier import build_pool_tier
        return build_pool_tier(cfg, slot_bytes)
    raise ConfigError(f"tiers.{cfg.kind.name.lower()}: this tier is not available in this build")
