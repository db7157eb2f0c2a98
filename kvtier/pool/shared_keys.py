"""What a shared tier (`PoolTier`, `MooncakeTier`) keeps between calls about its shared blocks.

    SpanGather  the spans of a block written range by range (a store's layer ranges), until the
                whole block is in and can be put under its key in one piece.
    KeyMemory   which keys the store answered absent a moment ago (a negative cache: a miss asked
                again at once costs no round trip) and which it is known to hold (put or found
                here: a later write of the same block asks for it instead of sending it).

Both are bounded and hold no bytes but those of blocks still being gathered.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch


class SpanGather:
    """Spans of blocks being written, per slot. Not locked: call it under the tier's lock."""

    def __init__(self, slot_bytes: int) -> None:
        self._slot_bytes = slot_bytes
        self._blocks: dict[int, tuple[bytes, torch.Tensor, int]] = {}  # slot -> (key, bytes so far, count)

    def add(self, slot: int, key: bytes, src: torch.Tensor, offset: int) -> torch.Tensor | None:
        """Adds `src` at `offset` of `slot`'s block `key`; returns the whole block once every byte
        is in, else None. A span at offset 0, or of another key, starts the block afresh (an
        earlier write of the slot that never finished is abandoned)."""
        held_key, block, count = self._blocks.get(slot, (key, None, 0))
        if block is None or held_key != key or offset == 0:
            block, count = torch.empty(self._slot_bytes, dtype=torch.uint8), 0
        n = src.numel()
        block[offset: offset + n].copy_(src)
        count += n
        if count < self._slot_bytes:
            self._blocks[slot] = (key, block, count)
            return None
        self._blocks.pop(slot, None)
        return block

    def clear(self) -> None:
        self._blocks.clear()


class KeyMemory:
    """The store's recent answers about keys (see the module docstring); thread-safe.

    Args:
        limit: how many held keys to remember (the oldest are forgotten first), and how many
            absent answers may pile up before the expired ones are swept.
        negative_cache_s: how long an "absent" answer stands.
    """

    def __init__(self, limit: int, negative_cache_s: float) -> None:
        self._limit = max(1, limit)
        self._negative_cache_s = negative_cache_s
        self._held: OrderedDict[bytes, None] = OrderedDict()
        self._absent: dict[bytes, float] = {}  # key -> when its "absent" answer expires
        self._lock = threading.Lock()

    def to_ask(self, keys: Sequence[bytes]) -> list[int]:
        """The indices of `keys` whose "absent" answer has expired or never was: those to ask."""
        now = time.monotonic()
        with self._lock:
            absent = self._absent
            return [i for i, key in enumerate(keys) if absent.get(key, 0.0) <= now]

    def answered(self, keys: Sequence[bytes], found: Sequence[bool]) -> None:
        """The store answered `found[i]` for `keys[i]`."""
        now = time.monotonic()
        expires = now + self._negative_cache_s
        with self._lock:
            for key, hit in zip(keys, found):
                if hit:
                    self._note_held(key)
                else:
                    self._absent[key] = expires
            if len(self._absent) > self._limit:  # forget expired answers once they pile up
                self._absent = {k: t for k, t in self._absent.items() if t > now}

    def note_held(self, key: bytes) -> None:
        """`key` is in the store now (put from here): no "absent" answer stands for it any more."""
        with self._lock:
            self._note_held(key)

    def held(self, key: bytes) -> bool:
        """Whether the store held `key` when last heard of (it may have dropped it since)."""
        with self._lock:
            return key in self._held

    def forget(self, key: bytes) -> None:
        """The store no longer holds `key` (a read of it missed)."""
        with self._lock:
            self._held.pop(key, None)

    def _note_held(self, key: bytes) -> None:
        self._absent.pop(key, None)
        held = self._held
        held[key] = None
        held.move_to_end(key)
        while len(held) > self._limit:
            held.popitem(last=False)
