"""The node's memory: one anonymous mapping, on hugepages when asked and available.

Hugepages cut TLB misses for a many-GiB region and, under RDMA, the page count the NIC must
translate. `MAP_HUGETLB` needs pages reserved beforehand (`vm.nr_hugepages`); when they are not
there the arena says so, in `description`, and uses ordinary pages with transparent hugepages
advised, so a node still starts. Memory is prefaulted at start (MAP_POPULATE; RDMA registration
would pin it anyway), so no put pays for first-touch page faults.
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)  # Linux; absent from Python's mmap module before 3.12
HUGEPAGE_BYTES = 2 << 20


class Arena:
    """`capacity_bytes` of zero-filled memory and a `memoryview` over it. One owner: the node.

    Attributes:
        address: where the memory starts (for `zero` and RDMA registration).
        hugepages: True when the mapping is on MAP_HUGETLB pages.
        description: what the memory is, for `kvtier pool stats` and the node's start line.
    """

    def __init__(self, capacity_bytes: int, hugepages: bool = False, prefault: bool = True) -> None:
        self.capacity_bytes = capacity_bytes
        self.hugepages = False
        self._mm: mmap.mmap | None = None
        why = ""
        populate = getattr(mmap, "MAP_POPULATE", 0) if prefault else 0
        if hugepages:
            why = hugepage_shortfall(capacity_bytes)
            if not why:
                try:
                    self._mm = _map(capacity_bytes, MAP_HUGETLB | populate)
                    self.hugepages = True
                except OSError as e:
                    why = f"mmap(MAP_HUGETLB) failed: {e.strerror}"
        if self._mm is None:
            self._mm = _map(capacity_bytes, populate)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                self._mm.madvise(mmap.MADV_HUGEPAGE)
        self.description = ("anonymous mmap on 2 MiB hugepages" if self.hugepages else
                            "anonymous mmap, 4 KiB pages (transparent hugepages advised)"
                            + (f"; hugepages requested but unavailable: {why}" if why else "")
                            + (", prefaulted" if prefault else ""))
        self.view = memoryview(self._mm)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))  # the export ends with the temporary

    def zero(self, offset: int, length: int) -> None:
        """Sets `length` bytes at `offset` to zero (memory about to pass to another tenant).

        Raises:
            ValueError: the range is outside the arena, or the arena is closed.
        """
        if self._mm is None or offset < 0 or length < 0 or offset + length > self.capacity_bytes:
            raise ValueError(f"arena: cannot zero [{offset}, {offset + length}) of {self.capacity_bytes} bytes")
        ctypes.memset(self.address + offset, 0, length)  # releases the GIL, unlike a slice assignment

    def close(self) -> None:
        """Unmaps the memory. Idempotent. Raises BufferError while a slice of `view` is alive."""
        if self._mm is not None:
            self.view.release()
            self._mm.close()
            self._mm = None


def _map(size: int, extra_flags: int) -> mmap.mmap:
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | extra_flags,
                     prot=mmap.PROT_READ | mmap.PROT_WRITE)


def hugepage_shortfall(capacity_bytes: int, meminfo: Path = Path("/proc/meminfo")) -> str:
    """Why `capacity_bytes` cannot be mapped on hugepages here ("" when it can)."""
    if capacity_bytes % HUGEPAGE_BYTES:
        return f"capacity {capacity_bytes} is not a multiple of 2 MiB"
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        free = int(fields["HugePages_Free"].split()[0])
        size_kib = int(fields["Hugepagesize"].split()[0])
    except (OSError, KeyError, ValueError):
        return f"{meminfo} has no hugepage counters"
    need = capacity_bytes // HUGEPAGE_BYTES
    if size_kib * 1024 != HUGEPAGE_BYTES:
        return f"default hugepage size is {size_kib} KiB, not 2 MiB"
    if free < need:
        return (f"{need} free 2 MiB hugepages needed, {free} reserved "
                f"(as root: sysctl -w vm.nr_hugepages={need})")
    return ""
