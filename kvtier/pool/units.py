"""Byte sizes for the pool's command line and tenants file.

Same grammar as `kvtier.config.parse_size`, repeated here because `kvtier.config` imports torch
(through the tier interface) and a pool node must start without it (3 s against 0.2 s).
"""

from __future__ import annotations

import re
from typing import Any

from kvtier.errors import ConfigError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_size(value: Any, where: str) -> int:
    """Bytes from an int or a string such as '512MiB', '4GB', '1.5GiB'.

    Raises:
        ConfigError: naming `where` when the value is not a non-negative size.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"{where}: size must be >= 0, got {value}")
        return value
    match = _SIZE_RE.match(value) if isinstance(value, str) else None
    if not match:
        raise ConfigError(f"{where}: expected a size such as 4GiB or 512MB, got {value!r}")
    unit = (match.group(2) or "").upper().removesuffix("B")
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(n: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def parse_address(value: str, where: str) -> tuple[str, int]:
    """`HOST:PORT` (IPv6 as `[::1]:PORT`) -> (host, port).

    Raises:
        ConfigError: naming `where` when the value is not such an address.
    """
    host, sep, port = str(value).rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{where}: expected HOST:PORT, got {value!r}")
    return host, int(port)
