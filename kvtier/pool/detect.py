"""Which data-plane transport a node or client can use here, and why.

`auto` picks RDMA only when an RDMA device exists; the choice and its reason are always reported
("tcp (no RDMA device)"), never silently swapped.
"""

from __future__ import annotations

import enum
from pathlib import Path

from kvtier.errors import ConfigError

SYSFS_RDMA = Path("/sys/class/infiniband")


class TransportKind(enum.Enum):
    AUTO = "auto"
    TCP = "tcp"
    RDMA = "rdma"


def rdma_devices(sysfs: Path = SYSFS_RDMA) -> list[str]:
    """Names of the RDMA devices the kernel exposes (mlx5_0, rxe0, ...)."""
    try:
        return sorted(p.name for p in sysfs.iterdir())
    except OSError:
        return []


def choose_transport(requested: TransportKind, sysfs: Path = SYSFS_RDMA) -> tuple[TransportKind, str]:
    """The transport to use for `requested` and the reason, e.g. (TCP, "no RDMA device").

    Raises:
        ConfigError: RDMA was asked for and cannot be used.
    """
    devices = rdma_devices(sysfs)
    if requested is TransportKind.TCP:
        return TransportKind.TCP, "requested"
    if not devices:
        if requested is TransportKind.RDMA:
            raise ConfigError(f"transport rdma: no RDMA device ({sysfs} is empty or missing); "
                              "use --transport tcp or auto")
        return TransportKind.TCP, "no RDMA device"
    # TODO(issue 3): the pyverbs data plane; until then a device is reported, not used.
    if requested is TransportKind.RDMA:
        raise ConfigError(f"transport rdma: device(s) {', '.join(devices)} found, but this build has no "
                          "RDMA data plane yet; use --transport tcp or auto")
    return TransportKind.TCP, f"RDMA device(s) {', '.join(devices)} present; RDMA data plane not in this build"
