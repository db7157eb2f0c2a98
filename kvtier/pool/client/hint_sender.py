"""`HintSender`: a pool tier's retention hints, sent to the nodes off the caller's thread.

When the engine applies a request's hint (`KVTier.apply_hint`), the blocks the pool holds keep it
too: retained ones get a soft lease on their node (RETAIN), a closed session's ones go to the cold
end of the tenant's recency there (RELEASE_HINT). Each costs a round trip per node, which the
caller (the engine's step) must not wait for: `send` appends to a queue under a lock, and a thread
of its own, started on the first hint, sends the queue in order, as `PoolNames` sends ANNOUNCEs.

Bounded, never blocking and never raising: at most `max_pending` keys wait (past it, a hint's keys
are dropped and counted), and every outcome is counted in `counts` (`PoolTier.client_counters`
serves them as `hint_*`), the first failure logged at WARNING, later ones at DEBUG.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque

from kvtier.pool.client.api import PoolClient

log = logging.getLogger(__name__)
MAX_PENDING_KEYS = 1 << 16


class HintSender:
    """Sends RETAIN / RELEASE_HINT for `client`'s keys on a thread of its own (see the module docstring).

    Args:
        client: the pool client (its calls are thread-safe).
        max_pending: keys queued at most; a hint past it is dropped, counted `dropped`.
    """

    def __init__(self, client: PoolClient, max_pending: int = MAX_PENDING_KEYS) -> None:
        self._client, self.max_pending = client, max_pending
        self.counts: Counter = Counter()
        self._queue: deque[tuple[list[bytes], float | None]] = deque()  # (keys, ttl_s); None: release
        self._num_pending = 0
        self._busy = False
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = self._warned = False

    def send(self, retain: list[bytes], retain_s: float, release: list[bytes]) -> None:
        """Queues a RETAIN of `retain` for `retain_s` and a RELEASE_HINT of `release`. Quick; never raises."""
        with self._ready:
            if self._closed:
                return
            for keys, ttl_s in ((retain, retain_s), (release, None)):
                if not keys:
                    continue
                if self._num_pending + len(keys) > self.max_pending:
                    self.counts["dropped"] += len(keys)
                    continue
                self._queue.append((list(keys), ttl_s))
                self._num_pending += len(keys)
            if self._queue and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvtier-pool-hints", daemon=True)
                self._thread.start()
            self._ready.notify()

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Waits until every hint queued so far was sent (or failed); False if `timeout_s` passed first."""
        with self._ready:
            return self._ready.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    def close(self, timeout_s: float) -> None:
        """Sends what is queued (within `timeout_s`) and stops the thread. Idempotent."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                keys, ttl_s = self._queue.popleft()
                self._num_pending -= len(keys)
                self._busy = True
            got = self._send(keys, ttl_s)
            with self._ready:
                self.counts.update({name: n for name, n in got.items() if n})
                self._busy = False
                self._ready.notify_all()

    def _send(self, keys: list[bytes], ttl_s: float | None) -> dict[str, int]:
        try:
            got = self._client.release_hint(keys) if ttl_s is None else self._client.retain(keys, ttl_s)
        except Exception as e:  # a hint is never worth failing the engine: counted, logged once
            got = {"failed": len(keys)}
            self._warn(f"{len(keys)} blocks: {e!r}")
        if got.get("failed") or got.get("not_served"):
            self._warn(f"{got.get('failed', 0) + got.get('not_served', 0)} blocks: their node was not reached "
                       "or predates retention hints")
        return got

    def _warn(self, what: str) -> None:
        level = logging.DEBUG if self._warned else logging.WARNING
        self._warned = True
        log.log(level, "kvtier could not pass a retention hint on to the pool (counted): %s", what)
