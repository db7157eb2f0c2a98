"""The plain data the manager hands out: where to write, what to move, where to read from.

Plans carry slot numbers, never bytes; the transfer engine executes them and the runtime reports
back to the manager with the matching `complete_*` verb. A plan is the whole interface between
the two: what the runtime needs to execute one (the checksums a read is checked against, whether
a move's destination must compute them) travels in it, copied from the index under the manager's
lock when the plan is made, so the runtime never reads the index. A value so copied stays valid
for the plan's life: a block's checksums are set once, when its first checksummed copy lands, and
a plan's sources are leased (`Copy.readers`), so the copy they describe cannot leave meanwhile.
What may change after the plan is made (whether a prefetch may still be cancelled) is asked of
the manager when needed (`TierManager.cancellable`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from kvtier.policy.admission import AdmissionKind, AdmissionRule
from kvtier.policy.base import EvictionPolicy
from kvtier.kinds import TierKind


class MoveReason(enum.Enum):
    DEMOTE = "demote"  # eviction from a tier into a lower one
    PROMOTE = "promote"  # a load hit below `promote_to`
    PREFETCH = "prefetch"  # an engine hint


@dataclass(frozen=True, slots=True)
class TierSlots:
    """What the manager needs to know of one tier: no bytes, only slots and rules."""

    kind: TierKind
    num_slots: int
    policy: EvictionPolicy
    admission: AdmissionRule = AdmissionRule(AdmissionKind.ALL)
    high_watermark: float = 1.0
    low_watermark: float = 1.0
    # Which stores place a copy here too, whatever the mode: a predicate of the key (a shared pool
    # takes the blocks it can share), or None (only inclusive mode writes through).
    write_through: Callable[[Hashable], bool] | None = None
    # The tier may lose a block on its own (`Tier.may_drop`): a copy there is never reason enough
    # to let a copy above go without demoting it (see `TierManager._evict`).
    may_drop: bool = False


# Placement, Move and LoadSource are plain (not frozen) slots dataclasses: a frozen one's __init__
# sets each field through object.__setattr__, ~0.7 us per Move, and a replay creates one per block
# moved (bench/bench_simulate.py). Nobody mutates them; treat them as read-only.
@dataclass(slots=True)
class Placement:
    """Write the block `key` into `slot` of `tier`."""

    key: Hashable
    tier: TierKind
    slot: int


@dataclass(frozen=True, slots=True)
class Fallback:
    """Another READY copy of a block that a read or a move of it leases beside its source: where
    the source fails (its tier died, its bytes are bad), the same transfer reads the block from
    here instead, so the block is delivered, not missed (issue 29: the first load after a pool
    node died lost every block it read from the node, though each had a copy on SSD).
    `checksums`: as the source's (what a read from below DRAM is checked against)."""

    tier: TierKind
    slot: int
    checksums: tuple[int, ...] | None = None


@dataclass(slots=True)
class Move:
    """Copy block `key` from one tier's slot to another's; `id` names it while in flight.

    `checksums`: the block's per-layer checksums when the move started, what a source below DRAM
    is checked against; None where none are known yet, so a destination below DRAM computes them.
    `fallback`: a promotion's or prefetch's other copy to read from where the source fails.
    """

    id: int
    key: Hashable
    src: TierKind
    src_slot: int
    dst: TierKind
    dst_slot: int
    reason: MoveReason
    checksums: tuple[int, ...] | None = None
    fallback: Fallback | None = None


@dataclass(slots=True)
class LoadSource:
    """Read block `key` from `slot` of `tier`; if `after_move` is set, only once that move lands.

    `checksums`: the block's per-layer checksums (None: none known, as for a block adopted from a
    shared tier), what a read from below DRAM is checked against before delivery. `fallback`:
    another copy to read from where this one fails (leased with it until `complete_load`).
    """

    key: Hashable
    tier: TierKind
    slot: int
    after_move: int | None = None
    checksums: tuple[int, ...] | None = None
    fallback: Fallback | None = None


@dataclass(frozen=True, slots=True)
class StorePlan:
    placements: tuple[Placement, ...]  # the first copy of each block
    present: tuple[Hashable, ...]  # already stored or being stored: nothing to do
    rejected: tuple[Hashable, ...]  # no tier had room: counted as dropped
    moves: tuple[Move, ...]  # demotions this store triggered
    # The further copies write-through tiers take (inclusive mode, `TierConfig.write_through`),
    # one plan per tier: each is written and completed apart, so that a failed copy in one tier
    # fails that copy only (a block stored in DRAM is not lost because the pool could not take it).
    through: tuple[StorePlan, ...] = ()
    # Every copy, first and write-through ones, in the order the manager chose them (what
    # completing the whole plan at once applies them in: a policy's order depends on it).
    chosen: tuple[Placement, ...] = ()

    @property
    def all_placements(self) -> tuple[Placement, ...]:
        """Every copy the plan writes, in the order the manager chose them."""
        return self.chosen if self.through else self.placements

    def first_copies(self) -> StorePlan:
        """The plan without its write-through copies (its moves and outcomes stay with it)."""
        return StorePlan(self.placements, self.present, self.rejected, self.moves) if self.through else self


@dataclass(frozen=True, slots=True)
class StoreOutcome:
    """What a finished store leads to (`TierManager.finish_store`).

    Attributes:
        moves: the demotions it triggered.
        retry: the blocks whose write failed, whose failed copy was their only one, planned again
            in the next tier in service below (None: nothing to retry). The caller writes it and
            finishes it the same way, until no retry is left.
        stored: keys a retry found already stored meanwhile (another copy landed): stored after all.
    """

    moves: tuple[Move, ...]
    retry: StorePlan | None = None
    stored: tuple[Hashable, ...] = ()


@dataclass(frozen=True, slots=True)
class LoadPlan:
    sources: tuple[LoadSource, ...]
    missing: tuple[Hashable, ...]
    moves: tuple[Move, ...]  # promotions (and the demotions they triggered)
