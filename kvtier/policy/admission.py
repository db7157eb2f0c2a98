"""Admission rules: whether a block may enter a tier at all.

Eviction decides who leaves a full tier; admission decides who may come in. Slow, wear-limited or
shared tiers (SSD, the memory pool) usually admit only blocks that earned it: ones demoted from the
tier above, or ones that were reused, so a one-pass scan of fresh prefixes does not flush them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier.errors import ConfigError


class AdmissionKind(enum.Enum):
    """Which blocks a tier accepts."""

    ALL = "all"  # every block, stored directly or demoted
    EVICTED = "evicted"  # only blocks demoted from a tier above, never direct stores
    REUSED = "reused"  # only blocks hit at least `min_hits` times (or demoted, if allowed)


@dataclass(frozen=True, slots=True)
class AdmissionRule:
    """One tier's admission rule.

    Attributes:
        kind: which blocks are admitted.
        min_hits: for REUSED, the hit count a block needs (>= 0; 0 admits every block).
        allow_demoted: for REUSED, also admit blocks demoted from a tier above.
    """

    kind: AdmissionKind = AdmissionKind.ALL
    min_hits: int = 1
    allow_demoted: bool = False

    def __post_init__(self) -> None:
        """Validates the fields.

        Raises:
            ConfigError: a field has the wrong type or is out of range; the message names it.
        """
        if not isinstance(self.kind, AdmissionKind):
            raise ConfigError(f"admission.kind must be an AdmissionKind, got {self.kind!r}")
        hits = self.min_hits
        if isinstance(hits, bool) or not isinstance(hits, int) or hits < 0:
            raise ConfigError(f"admission.min_hits must be an integer >= 0, got {hits!r}")
        if not isinstance(self.allow_demoted, bool):
            raise ConfigError(f"admission.allow_demoted must be a bool, got {self.allow_demoted!r}")

    def admits(self, *, demoted: bool, hits: int) -> bool:
        """Says whether a block may enter the tier.

        Args:
            demoted: the block comes from a tier above that is evicting it (not a direct store).
            hits: how many times the block was hit so far.
        Returns:
            True when the block is admitted.
        """
        if self.kind is AdmissionKind.ALL:
            return True
        if self.kind is AdmissionKind.EVICTED:
            return demoted
        return hits >= self.min_hits or (demoted and self.allow_demoted)
