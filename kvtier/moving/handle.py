"""`TransferHandle`: what a caller holds while blocks move, layer by layer.

Layers complete in order. `wait_layer(l)` returns once layer `l` of every block in the transfer is
in place (or has failed), so an engine can start layer 0's attention while later layers are still
arriving. A block that fails at any layer is in `failed` and must be treated as a miss: its bytes
in the destination are partial.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from kvtier.errors import TierUnavailable, TransferError


class Stage:
    """Where a block's transfer failed."""

    READ = "read"  # the source medium failed
    VERIFY = "verify"  # the bytes read do not match their checksum
    WRITE = "write"  # the destination medium failed
    CANCELLED = "cancelled"
    DEPENDENCY = "dependency"  # the move it was waiting on failed


@dataclass(frozen=True, slots=True)
class Failure:
    """Why one block's transfer failed: the stage, the layer, the error's text, and whether the
    failing tier said it is unavailable as a whole (`TierUnavailable`), not just this block."""

    stage: str
    layer: int
    error: str
    unavailable: bool = False


class TransferHandle:
    """Progress of one batched transfer.

    Args:
        keys: the blocks it carries, in order.
        num_layers: layers per block.
    """

    def __init__(self, keys: Iterable[Hashable], num_layers: int) -> None:
        self.keys = tuple(keys)
        self.num_layers = num_layers
        self.failed: dict[Hashable, Failure] = {}
        # Blocks whose source failed (how: the value) and whose copy's fallback source delivered
        # them instead (`CopyOp.fallback`); a block whose fallback failed too is in `failed` as well.
        self.fell_back: dict[Hashable, Failure] = {}
        self.checksums: dict[Hashable, list[int]] = {}
        self._layers_done = 0
        self._finished = False
        self._cancelled: set[Hashable] | None = None  # None: nothing; empty set: everything
        # One lock, two conditions made by the first waiter of each (most transfers finish before
        # anyone waits: a small one runs in the caller's thread, and a Condition costs µs to
        # make): a layer landing wakes only those waiting for a layer (`wait_layer`), not those
        # waiting for the end (`wait`), to each of whom a wake-up costs a context switch (tens of
        # µs on a virtualized host) per span of a large block.
        self._lock = threading.Lock()
        self._layer_cond: threading.Condition | None = None
        self._end_cond: threading.Condition | None = None
        self.error: BaseException | None = None  # a bug in completion handling, re-raised by wait()
        self.cuda_ready = None  # with CUDA: an event after the caller's queued work on its buffers

    # ---- caller side ---------------------------------------------------------------------

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> None:
        """Blocks until `layer` of every block is in place or failed.

        Raises:
            IndexError: layer out of range.
            TimeoutError: not done within `timeout_s`.
        """
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for {self.num_layers} layers")
        with self._lock:
            if self._layers_done > layer or self._finished:
                return
            if self._layer_cond is None:
                self._layer_cond = threading.Condition(self._lock)
            if not self._layer_cond.wait_for(lambda: self._layers_done > layer or self._finished, timeout_s):
                raise TimeoutError(f"layer {layer} of {len(self.keys)} blocks not in place after {timeout_s}s")

    def wait(self, timeout_s: float | None = None) -> bool:
        """Blocks until the transfer is over and its results are applied; True if no block failed.

        Raises:
            TimeoutError: not done within `timeout_s`.
            TransferError: applying the results failed (a bug, never an expected miss).
        """
        with self._lock:
            if not self._finished:
                if self._end_cond is None:
                    self._end_cond = threading.Condition(self._lock)
                if not self._end_cond.wait_for(lambda: self._finished, timeout_s):
                    raise TimeoutError(f"transfer of {len(self.keys)} blocks not done after {timeout_s}s")
        if self.error is not None:
            raise TransferError(f"completing a transfer failed: {self.error!r}") from self.error
        return not self.failed

    def done(self) -> bool:
        with self._lock:
            return self._finished

    @property
    def layers_done(self) -> int:
        with self._lock:
            return self._layers_done

    @property
    def ok_keys(self) -> list[Hashable]:
        return [k for k in self.keys if k not in self.failed]

    def cancel(self, keys: Iterable[Hashable] | None = None) -> None:
        """Stops moving `keys` (all if None) before their next layer; they end as CANCELLED."""
        with self._lock:
            if keys is None:
                self._cancelled = set()
            elif self._cancelled is None or self._cancelled:
                self._cancelled = (self._cancelled or set()) | set(keys)

    # ---- engine side ---------------------------------------------------------------------

    def is_cancelling(self) -> bool:
        """Whether any block of the transfer was asked to stop (`cancel`)."""
        return self._cancelled is not None

    def is_cancelled(self, key: Hashable) -> bool:
        c = self._cancelled
        return c is not None and (not c or key in c)

    def fail(self, key: Hashable, stage: str, layer: int, error: BaseException | str) -> None:
        if key not in self.failed:
            self.failed[key] = Failure(stage, layer, str(error), isinstance(error, TierUnavailable))

    def layer_done(self, layer: int) -> None:
        with self._lock:
            self._layers_done = max(self._layers_done, layer + 1)
            if self._layer_cond is not None:
                self._layer_cond.notify_all()

    def finish(self, error: BaseException | None = None) -> None:
        with self._lock:
            self.error = error
            self._layers_done = self.num_layers
            self._finished = True
            for cond in (self._layer_cond, self._end_cond):
                if cond is not None:
                    cond.notify_all()
