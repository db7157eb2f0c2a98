"""How much memory this machine (or this container) has, for tiers that reserve host memory up front.

A DRAM tier or a pool node's arena larger than the memory there is either refused by the kernel
(ENOMEM, a bare OSError with no field named) or, under overcommit, mapped and then killed by the
OOM killer while its pages are touched at start-up. Both are checked before anything is mapped:
against MemTotal, and against the cgroup's memory limit where one is set (a container on a big
host). Linux only; elsewhere nothing is known and nothing is refused. Nothing here imports torch.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path

from kvtier.errors import CapacityError
from kvtier.units import format_bytes

MEMINFO = Path("/proc/meminfo")
PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED_BYTES = 1 << 62  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1

log = logging.getLogger(__name__)


def memory_limit() -> tuple[int, str] | None:
    """The most memory this process can have, and where that figure comes from.

    Returns:
        (bytes, "MemTotal" or the cgroup file), the smaller of the two where both are known; None
        where neither can be read.
    """
    return _smallest(_meminfo_bytes("MemTotal"), "the machine's memory (MemTotal)")


def available_memory() -> tuple[int, str] | None:
    """The memory this process could take now without making room: MemAvailable, or its cgroup's
    limit where that is lower, and where the figure comes from; None where neither can be read."""
    return _smallest(_meminfo_bytes("MemAvailable"), "available now (MemAvailable)")


def _smallest(meminfo: int | None, what: str) -> tuple[int, str] | None:
    """The smaller of a /proc/meminfo figure (`what` says which) and this process's cgroup limit."""
    known = [(meminfo, what)] if meminfo is not None else []
    limit = _cgroup_limit()
    if limit is not None:
        known.append(limit)
    return min(known) if known else None


def _cgroup_limit() -> tuple[int, str] | None:
    """This process's own cgroup memory limit and its file; None where it has none or none can be read."""
    for path in _cgroup_limit_files():
        limit = _read_int(path)
        if limit is None:
            continue  # not there (another cgroup version) or unreadable: the next candidate
        # the first file found is this process's own cgroup: its parents' limits are not read
        return (limit, f"this process's cgroup memory limit ({path})") if limit < _UNLIMITED_BYTES else None
    return None


def _cgroup_limit_files() -> list[Path]:
    """Where this process's cgroup memory limit may be written, its own cgroup's first (v2, then v1)."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        lines = []
    files = []
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        relative = path.strip().lstrip("/")
        if controllers == "":
            files.append(CGROUP_ROOT / relative / "memory.max")
        elif "memory" in controllers.split(","):
            files.append(CGROUP_ROOT / "memory" / relative / "memory.limit_in_bytes")
    fallback = [CGROUP_ROOT / "memory.max", CGROUP_ROOT / "memory" / "memory.limit_in_bytes"]
    return list(dict.fromkeys(files + fallback))


def check_fits(num_bytes: int, where: str) -> None:
    """Refuses a reservation of `num_bytes` of host memory larger than `memory_limit()`.

    Also logs a warning when it exceeds what is available now (MemAvailable): it may still fit
    once caches are dropped, or be killed while its pages are touched.

    Args:
        num_bytes: bytes about to be mapped and touched.
        where: the field or option to name, e.g. `tiers.dram.capacity` or `--capacity`.
    Raises:
        CapacityError: naming `where`, the size asked for and the limit.
    """
    limit = memory_limit()
    if limit is not None and num_bytes > limit[0]:
        raise CapacityError(f"{where}: {format_bytes(num_bytes)} ({num_bytes:,} bytes) is more than "
                            f"{limit[1]}, {format_bytes(limit[0])}; give a smaller capacity")
    available = _meminfo_bytes("MemAvailable")
    if available is not None and num_bytes > available:
        log.warning("%s: %s is more than the memory available now (%s); the start-up may swap or be killed",
                    where, format_bytes(num_bytes), format_bytes(available))


def allocation_failed(e: OSError | RuntimeError, num_bytes: int, where: str) -> CapacityError:
    """The error to raise when mapping `num_bytes` failed with `e` (ENOMEM or the like), naming `where`."""
    why = e.strerror if isinstance(e, OSError) and e.errno == errno.ENOMEM else str(e)
    return CapacityError(f"{where}: cannot reserve {format_bytes(num_bytes)} ({num_bytes:,} bytes) of host "
                         f"memory: {why}; give a smaller capacity")


def _meminfo_bytes(field: str) -> int | None:
    try:
        for line in MEMINFO.read_text().splitlines():
            name, _, value = line.partition(":")
            if name == field:
                number, _, unit = value.strip().partition(" ")
                return int(number) * (1024 if unit.strip().lower() == "kb" else 1)
    except (OSError, ValueError):
        return None
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else (_UNLIMITED_BYTES if text == "max" else None)
