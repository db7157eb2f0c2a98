"""The connector's backends: what it needs from kvtier, how one is opened, and sharing them in a process.

The worker side owns its rank's backend (`open_backend`: a `KVTier` over the config's tiers, the
pool among them); `SHARED` lets the scheduler side of the same process find it.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import torch

from kvtier.config import KVTierConfig
from kvtier.moving.handle import TransferHandle
from kvtier.model.keys import BlockKey
from kvtier.model.layout import BlockLayout
from kvtier.kinds import TierKind

if TYPE_CHECKING:
    from kvtier.integrations.vllm.settings import Settings
    from kvtier.resident import Reservation

log = logging.getLogger(__name__)


class Backend(Protocol):
    """What the connector needs from kvtier: blocks by key, layer-major (see `kvtier.model.layout`).

    `KVTier` is the one in use: this process's tiers (HBM, DRAM, SSD) and, where the config has
    one, the pool, whose blocks every engine of the tenant finds, in any process or server (the
    connector's block keys name model, weights, KV format, block size and tenant).

    Contract:
        lookup(keys) -> the number of leading keys stored and ready; never raises on a miss.
        loadable(keys) -> as lookup, less the blocks slower to load than to recompute (what the
            scheduler reports to vLLM; `KVTier.loadable`).
        load(keys, into) -> a handle; `wait_layer(l)` returns once layer l of every block is in
            `into` (a `[len(keys), block_bytes]` uint8 tensor) or failed; failed blocks are in
            `handle.failed` and their bytes are garbage.
        store(keys, blocks, background=True) -> a handle; the caller keeps `blocks` unchanged until
            it is done. `background`: off the caller's thread, at low priority (the connector's stores).
        reserve(keys) -> host memory slots the connector gathers new blocks into, then commits
            (`kvtier.resident.Reservation`), or None: store them instead.
        note_compute(num_tokens, seconds) -> the engine's measured compute time of one forward pass.
        apply_hint(keys, session=, retain_s=, closed=, tenant=) -> whether a request's retention hint
            was applied (`KVTier.apply_hint`); a bad hint is counted, never raised.
        close() -> waits for transfers in flight and releases everything.
    Any of them may raise when the backend is broken or unreachable: the connector turns that into
    misses (lookup), failed loads (load) or dropped stores (store).
    """

    layout: BlockLayout

    def lookup(self, keys: Sequence[BlockKey]) -> int: ...

    def loadable(self, keys: Sequence[BlockKey]) -> int: ...

    def load(self, keys: Sequence[BlockKey], into: torch.Tensor) -> TransferHandle: ...

    def store(self, keys: Sequence[BlockKey], blocks: torch.Tensor, *, background: bool = False) -> TransferHandle: ...

    def reserve(self, keys: Sequence[BlockKey]) -> Reservation | None: ...

    def note_compute(self, num_tokens: int, seconds: float) -> None: ...

    def apply_hint(self, keys: Sequence[BlockKey], *, session: str | None = None, retain_s: float | None = None,
                   closed: bool = False, tenant: str | None = None) -> bool: ...

    def close(self) -> None: ...


def open_backend(settings: Settings) -> Backend:
    """The backend the kvtier config asks for: a `KVTier` over its tiers.

    A `pool` tier shares blocks by key with every process of the tenant, and (by default, its
    `write_through`) every store is written to it as well as to the top tier, so another engine
    finds a prefix as soon as it is stored. Under tensor parallelism with replicated KV (MLA, or
    fewer KV heads than ranks), ranks holding the same slice share its pool keys: only the first
    of them sends the slice to the pool (`Sharding.writes_shared`); the others keep their own
    local copies and read the first one's from the pool.

    Raises:
        KVTierError: a tier cannot be built (e.g. an SSD directory that cannot be created).
        ConfigError: the pool tier's secret cannot be read, or a node refused the tenant.
    Logs one INFO line of what it opened (`vllm_log.backend_summary`).
    """
    from kvtier.integrations.vllm.log import backend_summary

    config = with_transfer_cpus(settings.config)
    backend = _open(settings, config)
    log.info("%s", backend_summary(settings.sharding.rank, backend))
    return backend


def transfer_cpus(config: KVTierConfig) -> tuple[int, ...] | None:
    """The CPUs kvtier's threads in this worker run on: the config's `transfer.cpus`, else the
    cores vLLM leaves free (None: no binding to avoid).

    vLLM's CPU worker binds its compute threads, and so every thread started after them, to the
    cores it computes on; kvtier's copies, checksums and I/O would then take the forward pass's
    own cores while the cores vLLM reserves for the rest of the server sit idle. A GPU worker
    binds nothing, and there is nothing to move.
    """
    from kvtier.moving.cpus import spare_cpus

    return config.transfer.cpus if config.transfer.cpus is not None else spare_cpus()


def with_transfer_cpus(config: KVTierConfig) -> KVTierConfig:
    """`config` with `transfer.cpus` set to `transfer_cpus(config)`; logs where that moves threads."""
    cpus = transfer_cpus(config)
    if cpus is None or cpus == config.transfer.cpus:
        return config
    log.info("kvtier: transfer threads on CPUs %s, off the %s vLLM computes on", list(cpus),
             sorted(os.sched_getaffinity(0)))
    return replace(config, transfer=replace(config.transfer, cpus=cpus))


def _open(settings: Settings, config: KVTierConfig) -> Backend:
    from kvtier.runtime import KVTier

    backend = KVTier(config, layout=settings.layout)
    pool = backend.tiers.get(TierKind.POOL)
    if pool is not None and pool.shared and not settings.sharding.writes_shared:
        pool.writes_shared = False  # another rank of this engine sends this slice (see `SharedTier.writes_shared`)
    return backend


class SharedBackends:
    """Backends by id (`Settings.backend_id`: kvtier config path and rank), shared within a process.

    vLLM builds two connectors per engine, one per role. The worker's owns its rank's backend (it
    opens and closes it); the scheduler's looks it up here to answer `lookup` exactly, which works
    whenever both live in one process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, or the engine-core
    process of the default mode with the uni-process executor). Where a worker runs in another
    process (any tensor-parallel engine) the scheduler asks it over its lookup socket instead
    (see `vllm_scheduler.KeyDirectory`). Engines of one process with the same config and rank
    share one backend.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Hashable, list] = {}  # id -> [backend, number of owners]

    def acquire(self, backend_id: Hashable, open_fn: Callable[[], Backend]) -> Backend:
        with self._lock:
            entry = self._entries.get(backend_id)
            if entry is None:
                entry = self._entries[backend_id] = [open_fn(), 0]
            entry[1] += 1
            return entry[0]

    def get(self, backend_id: Hashable) -> Backend | None:
        with self._lock:
            entry = self._entries.get(backend_id)
            return entry[0] if entry else None

    def backends(self) -> list[Backend]:
        with self._lock:
            return [entry[0] for entry in self._entries.values()]

    def release(self, backend_id: Hashable) -> None:
        """Drops one owner; the last one closes the backend."""
        with self._lock:
            entry = self._entries.get(backend_id)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._entries[backend_id]
        entry[0].close()

    def close_all(self) -> None:
        """Closes every backend still open (run at interpreter exit).

        vLLM shuts its connectors down only on some paths (not when a single-process `LLM` is
        simply dropped at exit); closing here still waits for stores in flight and, for a
        persistent SSD tier, flushes its journal and releases its lock for the next process.
        """
        with self._lock:
            backends = [entry[0] for entry in self._entries.values()]
            self._entries.clear()
        for backend in backends:
            try:
                backend.close()
            except Exception as e:  # at exit: say so, and close the others
                log.warning("kvtier backend failed to close at exit: %r", e)


SHARED = SharedBackends()
"""The process's backends (one registry per process, by design: see `SharedBackends`)."""
atexit.register(SHARED.close_all)
