"""Building a tier from its configuration section (the runtime's, the CLI's and the bench's way in)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from kvtier.config import TierConfig
from kvtier.errors import CapacityError, ConfigError, TierIOError
from kvtier.tiers.base import Medium, Tier, TierKind


def build_tier(cfg: TierConfig, slot_bytes: int) -> Tier:
    """The tier a config section describes.

    Raises:
        ConfigError: the tier kind has no local implementation.
        CapacityError, TierIOError: as the tier's constructor (an HBM or DRAM capacity error
            names `tiers.<tier>.capacity`).
    """
    if cfg.kind is TierKind.HBM:
        from kvtier.tiers.hbm import HBMTier
        return _naming_capacity(cfg, lambda: HBMTier(cfg.capacity_bytes, slot_bytes, device=cfg.device))
    if cfg.kind is TierKind.DRAM:
        from kvtier.tiers.dram import DRAMTier
        return _naming_capacity(cfg, lambda: DRAMTier(cfg.capacity_bytes, slot_bytes))
    if cfg.kind is TierKind.SSD:
        from kvtier.tiers.ssd import SSDTier
        _make_ssd_directory(cfg.path)
        return SSDTier(cfg.path, cfg.capacity_bytes, slot_bytes, num_files=cfg.num_files, direct=cfg.o_direct,
                       persist=cfg.persist)
    if cfg.kind is TierKind.POOL:
        from kvtier.pool.client.tier import build_pool_tier
        return build_pool_tier(cfg, slot_bytes)
    raise ConfigError(f"tiers.{cfg.kind.name.lower()}: this tier is not available in this build")


def planned_facts(cfg: TierConfig, slot_bytes: int) -> dict[str, object]:
    """What `build_tier(cfg, slot_bytes).describe()` would say, without building the tier.

    Describing creates nothing: no slab in memory, no file or directory, no connection (so
    `kvtier info` can run on a production config). Facts only a running tier knows are said as
    plans: the O_DIRECT decision is probed in a temporary file of the SSD directory, or of its
    nearest existing parent when the directory does not exist yet (removed at once); a pool
    tier's data plane is the configured one, decided per node when it connects.

    Raises:
        CapacityError: capacity is below one slot.
        ConfigError: as `build_tier` (an HBM device without CUDA, a tier without a local build).
    """
    from kvtier.tiers.base import slots_needed

    name = cfg.kind.name.lower()
    num_slots = slots_needed(cfg.capacity_bytes, slot_bytes, name)
    facts: dict[str, object] = {"tier": name, "medium": _MEDIA[cfg.kind], "slot_bytes": slot_bytes,
                                "num_slots": num_slots, "capacity_bytes": num_slots * slot_bytes}
    if cfg.kind is TierKind.HBM:
        from kvtier.tiers.hbm import _pick_device
        device, reason = _pick_device(cfg.device)
        facts.update(device=str(device), stand_in=device.type != "cuda", **({"reason": reason} if reason else {}))
    elif cfg.kind is TierKind.DRAM:
        import torch
        facts["pinned"] = torch.cuda.is_available()
    elif cfg.kind is TierKind.SSD:
        facts.update(_planned_ssd(cfg, slot_bytes, num_slots))
    elif cfg.kind is TierKind.POOL:
        facts.update(nodes=list(cfg.nodes), transport=cfg.transport.value, tenant=cfg.tenant,
                     transport_reason="configured; decided per node when it connects", backend=cfg.backend.value)
    return facts


def _naming_capacity(cfg: TierConfig, build: Callable[[], Tier]) -> Tier:
    """`build()`, with a CapacityError (below one block, more than the machine's memory, ENOMEM)
    naming the config field: `tiers.dram.capacity: ...`."""
    try:
        return build()
    except CapacityError as e:
        raise CapacityError(f"tiers.{cfg.kind.name.lower()}.capacity: {e}") from None


def nearest_existing(path: Path) -> Path:
    """`path` itself or its nearest ancestor that exists (a file too: the SSD folder cannot be made under it)."""
    return next(p for p in (path, *path.parents) if os.path.lexists(p))


def _make_ssd_directory(path: Path) -> None:
    """Creates the SSD tier's folder, unless its nearest existing ancestor is a device or kernel
    folder (/dev, /proc, /sys: nothing is made there).

    Raises:
        TierIOError: naming `tiers.ssd.path`, the ancestor is refused or the folder cannot be made.
    """
    from kvtier.tiers.ssd_files import open_directory

    existing = next((p for p in (path, *path.parents) if p.is_dir()), None)
    try:
        if existing is not None:
            os.close(open_directory(str(existing)))
        path.mkdir(parents=True, exist_ok=True)
    except TierIOError as e:
        raise TierIOError(e.errno, f"tiers.ssd.path {path}: {e.strerror}", e.filename) from None
    except OSError as e:
        raise TierIOError(f"tiers.ssd.path {path}: cannot create the directory: {e.strerror}") from None


_MEDIA = {TierKind.HBM: Medium.DEVICE.value, TierKind.DRAM: Medium.HOST.value, TierKind.SSD: Medium.DISK.value,
          TierKind.POOL: Medium.REMOTE.value}


def probe_o_direct_in(directory: Path, prefix: str) -> str | None:
    """The SSD tier's own O_DIRECT probe (so every report agrees with it) on a scratch file named
    `prefix`... in `directory`, removed after.

    Returns:
        Why O_DIRECT is refused there, or None when it works.
    Raises:
        OSError, TierIOError: the scratch file cannot be made or probed.
    """
    import tempfile

    from kvtier.tiers.ssd import ALIGN_BYTES, _probe_direct

    with tempfile.NamedTemporaryFile(dir=directory, prefix=prefix) as f:
        f.truncate(ALIGN_BYTES)
        f.flush()
        return _probe_direct(f.name)


def _planned_ssd(cfg: TierConfig, slot_bytes: int, num_slots: int) -> dict[str, object]:
    from kvtier.tiers.ssd import ALIGN_BYTES

    stride = -(-slot_bytes // ALIGN_BYTES) * ALIGN_BYTES
    facts: dict[str, object] = {"directory": str(cfg.path), "exists": cfg.path.is_dir(),
                                "num_files": min(cfg.num_files, num_slots), "slot_stride_bytes": stride,
                                "disk_bytes": num_slots * stride, "persist": cfg.persist}
    if cfg.o_direct is False:
        return {**facts, "o_direct": False, "reason": "o_direct: false in the config"}
    probe_dir = nearest_existing(cfg.path)
    if not probe_dir.is_dir():  # a file on the way: start-up cannot create the folder
        return {**facts, "o_direct": False, "reason": f"{probe_dir} is not a directory: the tier would fail to start"}
    try:
        refusal = probe_o_direct_in(probe_dir, ".kvtier-info-")
    except (OSError, TierIOError) as e:
        return {**facts, "o_direct": False, "reason": f"cannot probe O_DIRECT in {probe_dir}: {e}"}
    where = "" if probe_dir == cfg.path else f" (probed in {probe_dir}: the directory is created at start-up)"
    if refusal is None:
        return {**facts, "o_direct": True, "reason": "an aligned O_DIRECT write and read succeeded" + where}
    if cfg.o_direct:
        return {**facts, "o_direct": False, "reason": f"o_direct: true in the config, but {refusal}: the tier would "
                                                       "fail to start" + where}
    return {**facts, "o_direct": False, "reason": refusal + "; buffered I/O" + where}
