"""Is a load worth it? Online estimates of load time per tier and of the engine's recompute time.

A hit is only worth loading if the blocks arrive sooner than the engine could compute their
tokens again. Both sides are measured while serving, never configured:

- **Load time per source tier**: `seconds ≈ fixed + per_block × blocks`, fitted from every load
  whose blocks all came from one tier (a block promoted before it is read counts for the tier it
  came from), measured from submission to the last layer landing.
- **Recompute time**: `seconds ≈ fixed + per_token × tokens`, fitted from the engine's forward
  passes (`KVTier.note_compute`: the tokens a step computed and the seconds it spent computing,
  kvtier's own waits excluded). Only the per-token slope counts: the step's fixed cost is paid
  whether or not a prefix is loaded.

`LoadCost.worth_loading` then keeps the longest prefix whose estimated load time is at most the
estimated recompute time of its tokens. Without an estimate for a side, loading is assumed to be
worth it (and measured). A tier judged too slow still gets one load in every `explore_every`, so
its estimate follows the machine when the machine changes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.kinds import TierKind


class OnlineFit:
    """Least-squares line `y ≈ fixed + slope × x` over a stream, old points fading out.

    Each new point multiplies the weight of every earlier one by `decay` (a half-life of
    ln 2 / -ln decay points), so the fit follows a machine whose speed drifts.
    """

    __slots__ = ("decay", "_w", "_x", "_y", "_xx", "_xy", "num_points")

    def __init__(self, decay: float = 0.95) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.num_points = 0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._y = self._y * d + y
        self._xx = self._xx * d + x * x
        self._xy = self._xy * d + x * y
        self.num_points += 1

    @property
    def slope(self) -> float | None:
        """The marginal `y` per unit of `x`, or None before two distinct `x` were seen, when the
        line through the mean of the points from the origin stands in (`y / x`)."""
        if self._w == 0.0 or self._x <= 0.0:
            return None
        var = self._xx / self._w - (self._x / self._w) ** 2
        if var <= 1e-9 * (self._x / self._w) ** 2:  # one size of x only: proportional
            return max(self._y / self._x, 0.0)
        cov = self._xy / self._w - (self._x / self._w) * (self._y / self._w)
        return max(cov / var, 0.0)

    @property
    def fixed(self) -> float:
        """`y` at `x = 0` (never negative); 0 without points or with one size of `x`."""
        slope = self.slope
        if slope is None:
            return 0.0
        return max((self._y - slope * self._x) / self._w, 0.0)

    def predict(self, x: float) -> float | None:
        slope = self.slope
        return None if slope is None else self.fixed + slope * x


@dataclass(frozen=True, slots=True)
class CostFacts:
    """What the estimates say now (metrics and `snapshot()`); seconds."""

    load_fixed_s: dict[TierKind, float]
    load_per_block_s: dict[TierKind, float]
    recompute_per_token_s: float | None
    skipped_blocks: dict[TierKind, int]  # hits reported as misses because loading was slower

    def as_dict(self) -> dict[str, object]:
        """JSON-ready, tiers by name."""
        def named(d: dict) -> dict:
            return {TierKind(t).name.lower(): v for t, v in sorted(d.items())}

        return {"load_fixed_s": named(self.load_fixed_s), "load_per_block_s": named(self.load_per_block_s),
                "recompute_per_token_s": self.recompute_per_token_s, "skipped_blocks": named(self.skipped_blocks)}


class LoadCost:
    """The two estimates and the decision; thread-safe.

    Args:
        block_tokens: tokens per block (a block's recompute time is this many tokens).
        explore_every: a tier judged too slow still serves one in this many decisions.
        decay: how fast old measurements fade (see `OnlineFit`).
    """

    def __init__(self, block_tokens: int, *, explore_every: int = 16, decay: float = 0.95) -> None:
        if block_tokens <= 0 or explore_every <= 0:
            raise ValueError("block_tokens and explore_every must be positive")
        self.block_tokens = block_tokens
        self.explore_every = explore_every
        self._decay = decay
        self._loads: dict[TierKind, OnlineFit] = {}
        self._compute = OnlineFit(decay)
        self._skipped: dict[TierKind, int] = {}
        self._vetoes: dict[TierKind, int] = {}
        self._lock = threading.Lock()

    def note_load(self, tier: TierKind, num_blocks: int, seconds: float) -> None:
        """A load of `num_blocks` blocks, all from `tier`, took `seconds`."""
        if num_blocks <= 0 or seconds < 0:
            return
        with self._lock:
            fit = self._loads.get(tier)
            if fit is None:
                fit = self._loads[tier] = OnlineFit(self._decay)
            fit.add(num_blocks, seconds)

    def note_compute(self, num_tokens: int, seconds: float) -> None:
        """The engine computed `num_tokens` tokens in `seconds` (one forward pass)."""
        if num_tokens > 0 and seconds >= 0:
            with self._lock:
                self._compute.add(num_tokens, seconds)

    def worth_loading(self, tiers: Sequence[TierKind]) -> int:
        """How many of the leading blocks, held in `tiers` (one per block, in order), to load.

        The longest prefix whose estimated load time (the largest fixed cost among its tiers plus
        each block's per-block time) is at most the recompute time of its tokens. Blocks past it
        are counted as skipped, by the tier that would have served the first of them.
        """
        if not tiers:
            return 0
        with self._lock:
            per_token = self._compute.slope
            if per_token is None:
                return len(tiers)
            best, fixed, load_s = 0, 0.0, 0.0
            for i, tier in enumerate(tiers):
                fit = self._loads.get(tier)
                if fit is None or fit.slope is None:  # unmeasured: worth it until measured
                    fixed_t, per_block = 0.0, 0.0
                else:
                    fixed_t, per_block = fit.fixed, fit.slope
                fixed = max(fixed, fixed_t)
                load_s += per_block
                if fixed + load_s <= per_token * self.block_tokens * (i + 1):
                    best = i + 1
            if best < len(tiers):
                slow = tiers[best]
                self._vetoes[slow] = self._vetoes.get(slow, 0) + 1
                if self._vetoes[slow] % self.explore_every == 0:  # re-measure now and then
                    return len(tiers)
                self._skipped[slow] = self._skipped.get(slow, 0) + len(tiers) - best
            return best

    def facts(self) -> CostFacts:
        with self._lock:
            return CostFacts(
                load_fixed_s={t: f.fixed for t, f in self._loads.items() if f.slope is not None},
                load_per_block_s={t: f.slope for t, f in self._loads.items() if f.slope is not None},
                recompute_per_token_s=self._compute.slope,
                skipped_blocks=dict(self._skipped))
