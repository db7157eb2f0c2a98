"""`FairLock`: a mutex that serves its waiters in arrival order.

Why the node needs one (issue 29, finding 6): every request runs the store under one lock, and
`threading.Lock` lets whichever thread runs next take it when it is released. Under a flood, ten
connections that each hold the lock for milliseconds per request kept taking it back while
another tenant's connection waited: one of its gets waited 460 ms for a lock held 25 ms at a time.
Here a thread that finds the lock taken queues, and `release` hands the lock straight to the
oldest waiter, so a request waits at most for the requests queued before it. Uncontended, it costs
two acquisitions of a plain lock.
"""

from __future__ import annotations

import threading
from collections import deque


class FairLock:
    """A non-reentrant lock granted first come, first served. Use as a context manager."""

    __slots__ = ("_state", "_held", "_waiters")

    def __init__(self) -> None:
        self._state = threading.Lock()  # guards `_held` and `_waiters`, held only for a few lines
        self._held = False
        self._waiters: deque[threading.Lock] = deque()

    def acquire(self) -> None:
        """Blocks until this thread holds the lock; threads that asked earlier get it first."""
        with self._state:
            if not self._held:
                self._held = True
                return
            turn = threading.Lock()
            turn.acquire()
            self._waiters.append(turn)
        turn.acquire()  # released by `release`, which hands the lock over still held

    def release(self) -> None:
        """Hands the lock to the oldest waiter, or frees it.

        Raises:
            RuntimeError: the lock is not held.
        """
        with self._state:
            if not self._held:
                raise RuntimeError("FairLock released while not held")
            if self._waiters:
                self._waiters.popleft().release()
            else:
                self._held = False

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
