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


def rdma_devices(sysfs: Path = SYSFS_RDMA, verbs: str = "pyverbs") -> list[str]:
    """Names of the RDMA devices the kernel exposes (mlx5_0, rxe0, ...); under another verbs
    provider (`kvtier.pool.verbs.load_verbs`), the devices it lists."""
    if verbs != "pyverbs":
        from kvtier.pool.verbs import NoRDMADevice, device_names, load_verbs

        try:
            return device_names(load_verbs(verbs))
        except NoRDMADevice:
            return []
    try:
        return sorted(p.name for p in sysfs.iterdir())
    except OSError:
        return []


def choose_transport(requested: TransportKind, sysfs: Path = SYSFS_RDMA,
                     verbs: str = "pyverbs") -> tuple[TransportKind, str]:
    """The transport to use for `requested` and the reason, e.g. (TCP, "no RDMA device"), the
    devices those of the verbs provider `verbs`.

    Raises:
        ConfigError: RDMA was asked for and cannot be used.
    """
    if requested is TransportKind.TCP:
        return TransportKind.TCP, "requested"
    devices = rdma_devices(sysfs, verbs)
    where = sysfs if verbs == "pyverbs" else f"verbs provider {verbs}"
    if not devices:
        why = f"no RDMA device ({where} is empty or missing)"
    else:  # a provider other than pyverbs already opened and listed its devices in rdma_devices
        why = _verbs_problem() if verbs == "pyverbs" else ""
    if why:
        if requested is TransportKind.RDMA:
            raise ConfigError(f"transport rdma: {why}; use --transport tcp or auto")
        return TransportKind.TCP, why.split(" (")[0] if not devices else why
    how = "requested" if requested is TransportKind.RDMA else "auto"
    return TransportKind.RDMA, f"{how}: RDMA device(s) {', '.join(devices)}"


def _verbs_problem() -> str:
    """Why pyverbs cannot be used here although sysfs lists a device ("" when it can)."""
    from kvtier.pool.verbs import NoRDMADevice, device_names, load_verbs

    try:
        device_names(load_verbs("pyverbs"))
    except NoRDMADevice as e:
        return str(e)
    return ""


def rxe_setup_script() -> Path:
    """The soft-RoCE set-up script shipped inside the package (`sudo bash PATH up IFACE`: an RDMA
    device over an Ethernet interface, for hosts without an RDMA NIC; `check`, `down`)."""
    return Path(__file__).resolve().with_name("rxe_setup.sh")
