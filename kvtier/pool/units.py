"""Byte sizes and addresses for the pool's command line and tenants file."""

from __future__ import annotations


from kvtier.config import parse_size  # torch-free: a pool node starts without importing torch
from kvtier.errors import ConfigError
from kvtier.sizing.hardware import format_bytes as format_size  # torch-free too

__all__ = ["format_size", "parse_address", "parse_size"]


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
