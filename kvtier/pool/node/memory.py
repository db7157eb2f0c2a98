"""A pool node giving memory back: the reaper that ends expired leases without waiting for
traffic, and glibc's allocator kept from holding what a burst of requests freed.

`LeaseReaper` ends leases as they come due, `EXPIRE_BATCH` at a time with the node's lock let go
between batches, so no request waits behind a whole flood's expiry (131,072 leases at once held
the lock for a quarter of a second), and trims the heap once the lease table gave most of it back.

Why the allocator (issue 29, finding 6): after a lease flood had expired, with the lease table back to nothing,
the node still held about 8 MB more than before on an 8 MiB node. glibc raises its mmap and trim
thresholds each time a large block it had mapped is freed (a lease table's 1 MB columns, a 4,096-hit
reply), up to 32 MB; freed memory below the raised thresholds then stays with the process, in the
main heap and in each connection thread's arena. `pin_malloc_thresholds` fixes both at
1 MiB (`PINNED_THRESHOLD_BYTES`), which also stops the raising; `trim_malloc` hands free heap pages
back after a large release. Both reach glibc through ctypes and do nothing (returning False)
on another C library. Python's own small-object allocator is not touched: the node keeps few
small objects per lease or per request (`leases`, `protocol.encode_hits`), which is what keeps it small.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
import time
from contextlib import AbstractContextManager

from kvtier.pool.node.store import EXPIRE_BATCH, BlockStore

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
# Where the thresholds are pinned: 1 MiB, not glibc's starting 128 KiB. At 128 KiB the heap was
# trimmed and regrown on nearly every request (a 64 KiB GET cost the node ~20 us more system time
# and end-to-end pool loads ~20% of their speed); at 1 MiB requests cost what they did unpinned
# while a flood's lease columns (1 MiB each at the tenant bound) still go back to the kernel.
PINNED_THRESHOLD_BYTES = 1 << 20
REAP_PERIOD_S = 1.0  # the longest the reaper sleeps; it wakes sooner when a lease comes due
REAP_PAUSE_S = 1e-3  # between two batches of expired leases: requests waiting on the lock go first
TRIM_AFTER_SLOTS = 16384  # lease slots freed (~0.6 MB of columns) since the last trim before the next


class LeaseReaper:
    """The node's thread body that expires leases (see the module docstring).

    Args:
        store: the node's store, only touched under `lock`.
        stopping: set when the node stops; `run` returns soon after.
        counters: the node's counters; `malloc_trims` counts the trims that gave pages back.
    """

    def __init__(self, store: BlockStore, lock: AbstractContextManager, stopping: threading.Event,
                 counters: dict[str, int]) -> None:
        self._store, self._lock, self._stopping, self._counters = store, lock, stopping, counters
        self._peak_slots = 0

    def run(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                num_expired = self._store.expire(EXPIRE_BATCH)
                due_s = self._store.next_expiry_s()
                slots = self._store.lease_slots
            if num_expired == EXPIRE_BATCH:
                self._stopping.wait(REAP_PAUSE_S)
                continue
            self._maybe_trim(slots)
            wait_s = REAP_PERIOD_S if due_s is None else due_s - time.monotonic()
            self._stopping.wait(min(max(wait_s, REAP_PAUSE_S), REAP_PERIOD_S))

    def _maybe_trim(self, slots: int) -> None:
        """Trims once the lease table holds a quarter of its peak slots or less, and at least
        TRIM_AFTER_SLOTS fewer (a flood expired, or its connections closed)."""
        self._peak_slots = max(self._peak_slots, slots)
        if self._peak_slots - slots >= TRIM_AFTER_SLOTS and slots <= self._peak_slots // 4:
            self._peak_slots = slots
            trimmed = trim_malloc()
            with self._lock:
                self._counters["malloc_trims"] += trimmed


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library, if it is glibc (the one with `mallopt` and `malloc_trim`); else None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not all(hasattr(libc, f) for f in ("gnu_get_libc_version", "mallopt", "malloc_trim")):
        return None
    return libc


def can_trim() -> bool:
    """Whether this process's C library is glibc, whose allocator `trim_malloc` can trim."""
    return _glibc() is not None


def pin_malloc_thresholds(threshold_bytes: int = PINNED_THRESHOLD_BYTES) -> bool:
    """Fixes glibc's mmap and trim thresholds at `threshold_bytes` for this process (from then on
    glibc no longer raises them). Returns whether it could (glibc, and both settings taken)."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold_bytes)) and bool(libc.mallopt(M_TRIM_THRESHOLD,
                                                                                        threshold_bytes))


def trim_malloc() -> bool:
    """Gives the free pages of glibc's heaps back to the system; True when any went back.
    (ctypes lets the GIL go for the call: other threads run meanwhile.)"""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
