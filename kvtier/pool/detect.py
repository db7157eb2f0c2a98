"""Which data-plane transport a node or client can use here, and why.

`auto` picks RDMA only when an RDMA device exists; the choice and its reason are always reported
("tcp (no RDMA device)"), never silently swapped.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path

from kvtier.errors import ConfigError

SYSFS_RDMA = Path("/sys/class/infiniband")


class TransportKind(enum.Enum):
    AUTO = "auto"
    TCP = "tcp"
    RDMA = "rdma"


def rdma_devices(sysfs: Path = SYSFS_RDMA) -> list[str]:
    """Names of the RDMA devices the kernel exposes (mlx5_0, rxe0, ...); with `KVTIER_VERBS=fake`,
    the fake fabric's device when its directory is set."""
    if os.environ.get("KVTIER_VERBS") == "fake":
        fabric = os.environ.get("KVTIER_FAKE_FABRIC")
        return ["fake0"] if fabric and Path(fabric).is_dir() else []
    try:
        return sorted(p.name for p in sysfs.iterdir())
    except OSError:
        return []


def choose_transport(requested: TransportKind, sysfs: Path = SYSFS_RDMA) -> tuple[TransportKind, str]:
    """The transport to use for `requested` and the reason, e.g. (TCP, "no RDMA device").

    Raises:
        ConfigError: RDMA was asked for and cannot be used.
    """
    if requested is TransportKind.TCP:
        return TransportKind.TCP, "requested"
    devices = rdma_devices(sysfs)
    why = f"no RDMA device ({sysfs} is empty or missing)" if not devices else _verbs_problem()
    if why:
        if requested is TransportKind.RDMA:
            raise ConfigError(f"transport rdma: {why}; use --transport tcp or auto")
        return TransportKind.TCP, why.split(" (")[0] if not devices else why
    how = "requested" if requested is TransportKind.RDMA else "auto"
    return TransportKind.RDMA, f"{how}: RDMA device(s) {', '.join(devices)}"


def _verbs_problem() -> str:
    """Why the verbs library cannot be used here ("" when it can)."""
    from kvtier.pool.verbs import NoRDMADevice, device_names, load_verbs

    try:
        device_names(load_verbs())
    except NoRDMADevice as e:
        return str(e)
    return ""
