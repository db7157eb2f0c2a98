"""Which CPUs kvtier's own threads run on.

A CPU inference engine binds its compute threads to cores (vLLM's CPU backend binds its worker's
OpenMP threads, and with them every thread the worker starts later, to the cores it computes on,
and leaves the others, `VLLM_CPU_NUM_OF_RESERVED_CPU`, to the rest of the server). Threads that
kvtier starts in such a process would inherit that binding and take their copies, checksums and
I/O out of the forward pass's own cores. `spare_cpus` finds the cores this process may use that
the calling thread is kept off; `pin_thread` moves the calling thread there (best effort).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

log = logging.getLogger(__name__)


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process's tree may run on: those of its parent (which an engine does not
    bind), else every CPU of the machine."""
    try:
        return frozenset(os.sched_getaffinity(os.getppid()))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


def spare_cpus() -> tuple[int, ...] | None:
    """The CPUs this process may use that the calling thread is not bound to, sorted; None when
    the calling thread may run everywhere (nothing to keep off) or where nothing else is left."""
    try:
        mine = frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    spare = allowed_cpus() - mine
    return tuple(sorted(spare)) or None


def pin_thread(cpus: Iterable[int] | None) -> None:
    """Binds the calling thread to `cpus` (None: leaves it); a refusal is logged, not raised."""
    if cpus is None:
        return
    try:
        os.sched_setaffinity(0, set(cpus))
    except (AttributeError, OSError, ValueError) as e:
        log.warning("kvtier thread keeps its CPUs (cannot bind it to %s: %s)", sorted(cpus), e)
