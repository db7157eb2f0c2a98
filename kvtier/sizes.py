"""One grammar for byte sizes, shared by the YAML config, every command line and the planner.

    512MiB  1.5GiB  2TiB     binary units (powers of 1024)
    4GB     500MB   1.2TB    decimal units (powers of 1000), as disks and links are rated
    4096    1e9     64B      plain bytes

Units are case-insensitive. A bare prefix (`4G`, `512m`) is refused rather than guessed: tools
disagree on it (Docker and the JVM read `4g` as GiB, Redis and Kubernetes as 10^9), and a capacity
off by 7 % is the kind of error nobody notices until a tier overflows. `Gi`, `Mi`... (Kubernetes'
spelling) are binary and accepted. Fractions round down to a whole byte.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from kvtier.errors import ConfigError

KiB, MiB, GiB, TiB, PiB = (1 << (10 * i) for i in range(1, 6))
_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB, "pib": PiB,
    "ki": KiB, "mi": MiB, "gi": GiB, "ti": TiB, "pi": PiB,
}  # fmt: skip
_AMBIGUOUS = frozenset("kmgtp")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?\s*([a-z]*)\s*$", re.IGNORECASE)
EXAMPLES = "4GiB, 512MiB or 500GB"


def parse_size(value: Any, where: str, error: type[Exception] = ConfigError) -> int:
    """Bytes from an int or a size string in the grammar above.

    Args:
        value: an int (bytes) or a string such as `1.5GiB`.
        where: the field to name in errors, e.g. `tiers.dram.capacity` or `--hbm`.
        error: the exception class to raise (the caller's vocabulary); ConfigError by default.
    Returns:
        A non-negative number of bytes.
    Raises:
        error: the value is not a non-negative size, or its unit is ambiguous; the message names
            `where` and says how to write it.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise error(f"{where}: expected a size such as {EXAMPLES}, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise error(f"{where}: size must be >= 0, got {value}")
        return value
    match = _SIZE.match(value)
    unit = match.group(3).lower() if match else ""
    if match and unit in _AMBIGUOUS:
        number = value.strip()[: -len(unit)].strip()
        raise error(f"{where}: {value!r} is ambiguous; write {number}{unit.upper()}iB "
                    f"(powers of 1024) or {number}{unit.upper()}B (powers of 1000)")
    if match is None or unit not in _UNITS:
        raise error(f"{where}: cannot read {value!r} as a size; write it like {EXAMPLES}")
    mantissa = Fraction(match.group(1)) * Fraction(10) ** int(match.group(2) or 0)
    return int(mantissa * _UNITS[unit])  # int() of a non-negative Fraction rounds down
