"""Built-in hardware catalogs for `kvtier size`: GPUs (HBM, host link) and the fabrics KV reloads over.

Every figure is a planning number with its source in a comment; the planner only compares against
them, so an operator who knows better passes `--hbm` instead of a GPU name. Also the parsers for
the units operators type: `80GiB`, `1.5TB`, `0.5s`, `250ms`, `32k`.
"""

from __future__ import annotations

import difflib
import enum
import re
from dataclasses import dataclass
from fractions import Fraction

from kvtier.errors import KVTierError
from kvtier.sizes import parse_size

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


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


# ---------------------------------------------------------------------------------------------
# units

_TIME_UNITS = {"": 1, "s": 1, "ms": Fraction(1, 1000), "us": Fraction(1, 10**6), "m": 60, "min": 60}
_TOKEN_UNITS = {"": 1, "k": 1024, "m": 1 << 20}  # context lengths count in powers of two: 128k = 131,072
_NUMBER = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?\s*([a-z]*)\s*$", re.IGNORECASE)


def _parse(field: str, text: str, units: dict[str, int | Fraction], example: str) -> Fraction:
    match = _NUMBER.match(str(text))
    unit = match.group(3).lower() if match else None
    if match is None or unit not in units:
        raise HardwareError(f"{field}: cannot read {text!r}; write it like {example}")
    mantissa = Fraction(match.group(1)) * Fraction(10) ** int(match.group(2) or 0)
    return mantissa * units[unit]


def parse_bytes(field: str, text: str) -> int:
    """`80GiB` -> 85899345920, `1.5TB` -> 1.5e12; a bare number is bytes; see `kvtier.sizes`.

    Raises:
        HardwareError: not a non-negative size, or an ambiguous unit such as `80G`; names `field`.
    """
    return parse_size(text, field, HardwareError)


def parse_seconds(field: str, text: str) -> Fraction:
    """`0.5s`, `500ms` or `0.5` -> 1/2 (exact, so the planner's arithmetic stays exact).

    Raises:
        HardwareError: not a duration; the message names `field`.
    """
    return _parse(field, text, _TIME_UNITS, "0.5s or 500ms")


def parse_tokens(field: str, text: str) -> int:
    """`4096` -> 4096, `32k` -> 32768, `1m` -> 1048576, `1.5k` -> 1536.

    Raises:
        HardwareError: not a whole number of tokens; the message names `field`.
    """
    value = _parse(field, text, _TOKEN_UNITS, "4096, 32k or 1m")
    if value.denominator != 1:
        raise HardwareError(f"{field}: {text!r} is not a whole number of tokens")
    return int(value)


def parse_count(field: str, text: str) -> int:
    """A parameter count: `6.74e9`, `7B`, `70b`, `180M` or a plain integer.

    Raises:
        HardwareError: not a whole, positive count; the message names `field`.
    """
    value = _parse(field, text, {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}, "6.74e9 or 7B")
    if value.denominator != 1 or value <= 0:
        raise HardwareError(f"{field}: {text!r} is not a positive whole count")
    return int(value)


def format_bytes(num_bytes: int) -> str:
    """`536870912` -> `512 MiB`; binary units, at most two decimals, trailing zeros dropped."""
    value, unit = float(num_bytes), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, bigger
    text = f"{value:,.2f}".rstrip("0").rstrip(".")
    return f"{text} {unit}"


def format_decimal(value: float, unit: str) -> str:
    """`25e9, "B/s"` -> `25 GB/s`, `13476831232, "B"` -> `13.48 GB`: decimal prefixes, as links and disks are rated."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3), ("", 1)):
        if abs(value) >= scale or not prefix:
            text = f"{value / scale:,.2f}".rstrip("0").rstrip(".")
            return f"{text} {prefix}{unit}"
    raise AssertionError("unreachable")


def format_rate(bytes_per_s: float) -> str:
    """`25e9` -> `25 GB/s`."""
    return format_decimal(bytes_per_s, "B/s")


def format_params(num_params: int) -> str:
    """`6738415616` -> `6.74 B params`; small counts in full."""
    if num_params >= 10**8:
        return f"{num_params / 1e9:,.2f} B params"
    return f"{num_params:,} params"
