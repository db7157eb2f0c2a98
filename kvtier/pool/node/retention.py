"""The pool node's soft leases (RETAIN / RELEASE_HINT, issue 32), sans-I/O: per-block deadlines.

An engine whose request said "keep my blocks N seconds" asks the node to do the same for the
tenant's copies (RETAIN). A deadline is extend-only, capped at `max_retain_s`, and charged to the
tenant's budget, `retain_fraction` of its quota in slot bytes: past it a block is not retained,
and counted. Eviction (`slabs.Slabs`) skips retained blocks, and regions holding any, on its first
pass and takes them only when nothing else is left: a lease is soft, never a reason to refuse a
put. Deadlines lapse lazily: `lapse` runs where they matter (eviction, RETAIN, STATS), so no thread
or timer is needed. Block ids are the table's (`blocks.BlockTable`); keys never reach this module,
so a tenant can only ever name its own blocks (the store resolves keys under its tenant's code).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RetainOutcome:
    """What one RETAIN came to, in blocks."""

    retained: int = 0  # deadline set or extended
    over_budget: int = 0  # not retained: the tenant's budget is spent
    missing: int = 0  # no READY block of the tenant under that key


class Retention:
    """Deadlines of retained blocks, per tenant within budgets. Not thread-safe (the store's lock).

    Args:
        clock: seconds, monotonic (the store's).
        max_retain_s: the longest a RETAIN may keep a block.
        budgets: tenant -> bytes of slots it may retain.
    """

    def __init__(self, clock: Callable[[], float], max_retain_s: float, budgets: Mapping[str, int]) -> None:
        self._clock, self.max_retain_s = clock, max_retain_s
        self.budgets = dict(budgets)
        self._until: dict[int, float] = {}  # block id -> deadline
        self._owner: dict[int, tuple[str, int, int]] = {}  # block id -> (tenant, region id, slot bytes)
        self._heap: list[tuple[float, int]] = []  # (deadline, block id); stale entries skipped
        self._bytes = dict.fromkeys(budgets, 0)
        self._blocks = dict.fromkeys(budgets, 0)
        self._in_region: dict[int, int] = {}  # region id -> retained blocks in it

    def __len__(self) -> int:
        return len(self._until)

    def retain(self, tenant: str, blocks: Iterable[tuple[int, int, int]], ttl_s: float) -> RetainOutcome:
        """Extends each block's deadline to now + min(ttl_s, max_retain_s), within `tenant`'s budget
        (a ttl of 0, or a node whose max_retain_s is 0, retains nothing).

        Args:
            blocks: (block id, region id, slot bytes) of the tenant's READY blocks.
        """
        if min(ttl_s, self.max_retain_s) <= 0:
            return RetainOutcome()
        now = self._clock()
        self.lapse(now)
        deadline = now + min(ttl_s, self.max_retain_s)
        retained = over = 0
        for block, region, slot_bytes in blocks:
            old = self._until.get(block)
            if old is None:
                if self._bytes[tenant] + slot_bytes > self.budgets[tenant]:
                    over += 1
                    continue
                self._owner[block] = (tenant, region, slot_bytes)
                self._bytes[tenant] += slot_bytes
                self._blocks[tenant] += 1
                self._in_region[region] = self._in_region.get(region, 0) + 1
            retained += 1
            if old is not None and old >= deadline:
                continue
            self._until[block] = deadline
            heapq.heappush(self._heap, (deadline, block))
        if len(self._heap) > 2 * len(self._until) + 1024:  # extensions left stale entries behind
            self._heap = [(d, b) for b, d in self._until.items()]
            heapq.heapify(self._heap)
        return RetainOutcome(retained, over)

    def forget(self, block: int) -> bool:
        """Ends `block`'s retention (released, evicted or deleted); whether it was retained."""
        if self._until.pop(block, None) is None:
            return False
        tenant, region, slot_bytes = self._owner.pop(block)
        self._bytes[tenant] -= slot_bytes
        self._blocks[tenant] -= 1
        left = self._in_region[region] - 1
        if left:
            self._in_region[region] = left
        else:
            del self._in_region[region]
        return True

    def lapse(self, now: float | None = None) -> None:
        """Ends the retentions whose deadline has passed."""
        now = self._clock() if now is None else now
        heap, until = self._heap, self._until
        while heap and heap[0][0] <= now:
            deadline, block = heapq.heappop(heap)
            if until.get(block) == deadline:
                self.forget(block)

    def holds(self, block: int) -> bool:
        """Whether `block` is retained (as of the last `lapse`)."""
        return block in self._until

    def holds_in(self, region: int) -> bool:
        """Whether region `region` holds a retained block (as of the last `lapse`)."""
        return region in self._in_region

    def facts(self, tenant: str) -> dict[str, int]:
        """The tenant's retained blocks and bytes now, and its budget."""
        self.lapse()
        return {"retained_blocks": self._blocks[tenant], "retained_bytes": self._bytes[tenant],
                "retain_quota_bytes": self.budgets[tenant]}
