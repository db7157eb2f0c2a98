"""Built-in hardware catalogs for `kvtier size`: GPUs (HBM, host link) and the fabrics KV reloads over.

Every figure is a planning number with its source in a comment; the planner only compares against
them, so an operator who knows better passes `--hbm` instead of a GPU name. The units operators
type (`80GiB`, `0.5s`, `32k`) are read by `kvtier.units`.
"""

from __future__ import annotations

import difflib
import enum
import re
from dataclasses import dataclass

from kvtier.errors import KVTierError
from kvtier.units import MiB


class HardwareError(KVTierError, ValueError):
    """An unknown GPU or fabric name, or a size, duration or token count that cannot be read."""


class Link(enum.Enum):
    """Which lower tier a fabric carries KV from, on its way back to HBM."""

    DRAM = "dram"  # host DRAM -> GPU over PCIe
    POOL = "pool"  # memory pool node -> server over the network (RDMA)
    SSD = "ssd"  # NVMe drive -> host staging buffer


@dataclass(frozen=True, slots=True)
class GPU:
    """One accelerator model: its memory as the driver reports it and its host link."""

    name: str
    hbm_bytes: int
    host_link: str  # a FABRICS name


@dataclass(frozen=True, slots=True)
class Fabric:
    """A link KV can be reloaded over.

    Attributes:
        nominal_bytes_per_s: the line or spec-sheet rate.
        bytes_per_s: what a planner should count on: pinned-copy, RDMA READ or sequential-read
            rates measured in practice, below the nominal one.
    """

    name: str
    link: Link
    nominal_bytes_per_s: int
    bytes_per_s: int


# HBM is the total `nvidia-smi --query-gpu=memory.total` reports (MiB), not the marketing "GB".
GPUS: tuple[GPU, ...] = (
    GPU("A100-40", 40960 * MiB, "PCIe-Gen4-x16"),
    GPU("A100-80", 81920 * MiB, "PCIe-Gen4-x16"),
    GPU("H100-80", 81559 * MiB, "PCIe-Gen5-x16"),
    GPU("H100-NVL-94", 95830 * MiB, "PCIe-Gen5-x16"),
    GPU("H200-141", 143771 * MiB, "PCIe-Gen5-x16"),
    GPU("B200-192", 183359 * MiB, "PCIe-Gen5-x16"),
    GPU("L4-24", 23034 * MiB, "PCIe-Gen4-x16"),
    GPU("A10-24", 23028 * MiB, "PCIe-Gen4-x16"),
    GPU("L40S-48", 46068 * MiB, "PCIe-Gen4-x16"),
    GPU("RTX-A6000-48", 49140 * MiB, "PCIe-Gen4-x16"),
    GPU("RTX-4090-24", 24564 * MiB, "PCIe-Gen4-x16"),
)

# Nominal: PCIe 16/32 GT/s x16 with 128b/130b coding; Ethernet line rate; NVMe x4 link.
# Planning: ~80% of PCIe for pinned cudaMemcpy, ~92% of line rate for RDMA READ (ib_read_bw),
# the top sequential-read figure of current enterprise drives for NVMe (one drive).
FABRICS: tuple[Fabric, ...] = (
    Fabric("PCIe-Gen4-x16", Link.DRAM, 31_500_000_000, 25_000_000_000),
    Fabric("PCIe-Gen5-x16", Link.DRAM, 63_000_000_000, 50_000_000_000),
    Fabric("RoCE-100GbE", Link.POOL, 12_500_000_000, 11_500_000_000),
    Fabric("RoCE-200GbE", Link.POOL, 25_000_000_000, 23_000_000_000),
    Fabric("RoCE-400GbE", Link.POOL, 50_000_000_000, 46_000_000_000),
    Fabric("NVMe-Gen4-x4", Link.SSD, 7_880_000_000, 7_000_000_000),
    Fabric("NVMe-Gen5-x4", Link.SSD, 15_750_000_000, 14_000_000_000),
)


def _normalize(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def resolve_gpu(name: str) -> GPU:
    """A catalog GPU by name, ignoring case and punctuation (`h100-80`, `H100_80`, `h10080`).

    The model alone matches when only one memory size has it (`H200`, `L4`, `4090`; not `A100`).

    Raises:
        HardwareError: the name is unknown or ambiguous; the message lists close matches.
    """
    key = _normalize(name)
    exact = [g for g in GPUS if _normalize(g.name) == key]
    by_model = [g for g in GPUS if key and _normalize(g.name.rsplit("-", 1)[0]).endswith(key)]
    if exact or len(by_model) == 1:
        return (exact or by_model)[0]
    names = [g.name for g in GPUS]
    close = [g.name for g in by_model] or difflib.get_close_matches(name.upper(), names, n=4, cutoff=0.5)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    raise HardwareError(f"unknown GPU {name!r}{hint}. Known GPUs: {', '.join(names)}; or give --hbm SIZE")


def fabric(name: str) -> Fabric:
    """A catalog fabric by exact name.

    Raises:
        HardwareError: no fabric has that name.
    """
    for f in FABRICS:
        if f.name == name:
            return f
    raise HardwareError(f"unknown fabric {name!r}; known: {', '.join(f.name for f in FABRICS)}")
