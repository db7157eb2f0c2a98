"""Units, one grammar each, shared by the YAML config, every command line and the planner.

Byte sizes (`parse_size`):

    512MiB  1.5GiB  2TiB     binary units (powers of 1024)
    4GB     500MB   1.2TB    decimal units (powers of 1000), as disks and links are rated
    4096    1e9     64B      plain bytes

Units are case-insensitive. A bare prefix (`4G`, `512m`) is refused rather than guessed: tools
disagree on it (Docker and the JVM read `4g` as GiB, Redis and Kubernetes as 10^9), and a capacity
off by 7 % is the kind of error nobody notices until a tier overflows. `Gi`, `Mi`... (Kubernetes'
spelling) are binary and accepted. Fractions round down to a whole byte. A size above
`MAX_SIZE_BYTES` (8 EiB, what a file offset or a mapping can reach) is refused, as is an exponent
past ±`MAX_EXPONENT` in any of these numbers (`1e99999999` would take minutes to expand).

Durations (`0.5s`, `250ms`), token counts (`32k` = 32,768), parameter counts (`7B`), addresses
(`HOST:PORT`) and the formatting of bytes, rates and counts for people. Every parser takes the field
to name in its errors and the exception class to raise (the caller's vocabulary; `ConfigError` by
default). Nothing here imports anything but `kvtier.errors`, so any layer may use it.
"""


from __future__ import annotations

import math
import numbers
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
MAX_SIZE_BYTES = 2**63 - 1
MAX_EXPONENT = 100


def parse_size(value: Any, where: str, error: type[Exception] = ConfigError) -> int:
    """Bytes from an int or a size string in the grammar above.

    Args:
        value: an int (bytes) or a string such as `1.5GiB`.
        where: the field to name in errors, e.g. `tiers.dram.capacity` or `--hbm`.
        error: the exception class to raise (the caller's vocabulary); ConfigError by default.
    Returns:
        A non-negative number of bytes, at most MAX_SIZE_BYTES.
    Raises:
        error: the value is not a non-negative size, is above MAX_SIZE_BYTES, or its unit is
            ambiguous; the message names `where` and says how to write it.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise error(f"{where}: expected a size such as {EXAMPLES}, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise error(f"{where}: size must be >= 0, got {value}")
        return _at_most_max(value, value, where, error)
    match = _SIZE.match(value)
    unit = match.group(3).lower() if match else ""
    if match and unit in _AMBIGUOUS:
        number = value.strip()[: -len(unit)].strip()
        raise error(f"{where}: {value!r} is ambiguous; write {number}{unit.upper()}iB "
                    f"(powers of 1024) or {number}{unit.upper()}B (powers of 1000)")
    if match is None or unit not in _UNITS:
        raise error(f"{where}: cannot read {value!r} as a size; write it like {EXAMPLES}")
    mantissa = _number(match, value, where, error)
    return _at_most_max(int(mantissa * _UNITS[unit]), value, where, error)  # int() of a Fraction >= 0 rounds down


def _number(match: re.Match, value: Any, where: str, error: type[Exception]) -> Fraction:
    """The number a `_SIZE` match spells (mantissa and exponent), exactly.

    Raises:
        error: the exponent is beyond ±MAX_EXPONENT.
    """
    exponent = int(match.group(2) or 0)
    if abs(exponent) > MAX_EXPONENT:
        raise error(f"{where}: the exponent of {value!r} is out of range (at most {MAX_EXPONENT} either way)")
    return Fraction(match.group(1)) * Fraction(10) ** exponent


def _at_most_max(num_bytes: int, value: Any, where: str, error: type[Exception]) -> int:
    if num_bytes > MAX_SIZE_BYTES:
        raise error(f"{where}: {value!r} is more than {MAX_SIZE_BYTES:,} bytes (8 EiB), the largest size "
                    "a file or a mapping can have")
    return num_bytes


def check_number(value: Any, where: str, *, integral: bool = False, positive: bool = False,
                 minimum: float | None = None, maximum: float | None = None,
                 error: type[Exception] = ConfigError) -> Any:
    """`value`, if it is a finite number (a whole one with `integral`; never a bool) within the bounds.

    Args:
        positive: it must be > 0. minimum, maximum: inclusive bounds (None: none).
    Raises:
        error: naming `where`, with what was expected and what came.
    """
    kinds = numbers.Integral if integral else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise error(f"{where}: expected {'a whole number' if integral else 'a number'}, got {value!r}")
    if not math.isfinite(value):  # NaN would pass every bound check below
        raise error(f"{where}: expected a finite number, got {value!r}")
    if positive and value <= 0:
        raise error(f"{where}: must be a positive {'integer' if integral else 'number'}, got {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bound = (f"in [{minimum}, {maximum}]" if minimum is not None and maximum is not None
                 else f">= {minimum}" if minimum is not None else f"<= {maximum}")
        raise error(f"{where}: must be {bound}, got {value!r}")
    return value


_TIME_UNITS = {"": 1, "s": 1, "ms": Fraction(1, 1000), "us": Fraction(1, 10**6), "m": 60, "min": 60}
_TOKEN_UNITS = {"": 1, "k": 1024, "m": 1 << 20}  # context lengths count in powers of two: 128k = 131,072
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def _parse(value: Any, where: str, units: dict[str, int | Fraction], example: str,
           error: type[Exception]) -> Fraction:
    match = _SIZE.match(str(value))
    unit = match.group(3).lower() if match else None
    if match is None or unit not in units:
        raise error(f"{where}: cannot read {value!r}; write it like {example}")
    return _number(match, value, where, error) * units[unit]


def parse_seconds(value: Any, where: str, error: type[Exception] = ConfigError) -> Fraction:
    """`0.5s`, `500ms` or `0.5` -> 1/2 (exact, so the planner's arithmetic stays exact).

    Raises:
        error: not a duration; the message names `where`.
    """
    return _parse(value, where, _TIME_UNITS, "0.5s or 500ms", error)


def parse_tokens(value: Any, where: str, error: type[Exception] = ConfigError) -> int:
    """`4096` -> 4096, `32k` -> 32768, `1m` -> 1048576, `1.5k` -> 1536.

    Raises:
        error: not a whole number of tokens; the message names `where`.
    """
    number = _parse(value, where, _TOKEN_UNITS, "4096, 32k or 1m", error)
    if number.denominator != 1:
        raise error(f"{where}: {value!r} is not a whole number of tokens")
    return int(number)


def parse_count(value: Any, where: str, error: type[Exception] = ConfigError) -> int:
    """A parameter count: `6.74e9`, `7B`, `70b`, `180M` or a plain integer.

    Raises:
        error: not a whole, positive count; the message names `where`.
    """
    number = _parse(value, where, _COUNT_UNITS, "6.74e9 or 7B", error)
    if number.denominator != 1 or number <= 0:
        raise error(f"{where}: {value!r} is not a positive whole count")
    return int(number)


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


# ---- for people -------------------------------------------------------------------------------


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
