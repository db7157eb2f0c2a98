"""Which of the demo's figures a busy machine made, decided from the measured numbers alone.

The demo times on whatever machine runs it, often a shared one. Three figures cannot come from
kvtier itself, so when one shows up the report says so in one line, next to the figure, with the
evidence: the machine's load average (from /proc/loadavg) and the spread of repeated
measurements of the same work.

- A turn slower than recomputing by more than kvtier's lookup and load. On a miss kvtier computes
  the whole prompt exactly as recompute does; what it adds before the first token is the lookup
  (hashing the prompt's blocks, asking the index). Storing the computed blocks happens after the
  first token, outside TTFT.
- DRAM reading slower than a lower tier, for a prefix of the same size: a DRAM hit is a memory
  copy, which a pool node or an SSD cannot beat for the same bytes. (Pool against SSD is left
  alone: which is faster depends on the machine, a loopback socket against the page cache here.)
- Repeated timings of the same work (recomputing prompts of one length) that spread widely.

The deciding functions are pure: numbers in, note lines (or None) out. Only `read_load_average`
and `load_since` read the machine.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# A turn's kvtier TTFT may exceed recompute's plus its measured lookup and load by this share of
# recompute's before the excess is called the machine's noise.
TTFT_TOLERANCE = 0.10
# Repeated timings of the same work whose (max - min) / median exceeds this are called widely spread.
SPREAD_TOLERANCE = 0.5

MISS_COST = ("A miss costs kvtier a lookup of the prompt's blocks (in its TTFT) on top of computing the prompt as "
             "recompute does, then a store of the computed blocks after the first token (outside TTFT): a miss "
             "reads about as fast as recomputing, a little slower.")


@dataclass(frozen=True, slots=True)
class Load:
    """The machine's 1-minute load average at the start of the demo and at the end (or now), and its cores.

    A load average is None where /proc/loadavg cannot be read.
    """

    start: float | None
    end: float | None
    num_cores: int

    def describe(self) -> str:
        if self.start is None or self.end is None:
            return f"load average unknown, {self.num_cores} cores"
        return f"load average {self.start:.1f} -> {self.end:.1f} on {self.num_cores} cores"


def read_load_average(path: Path = Path("/proc/loadavg")) -> float | None:
    """The 1-minute load average; None where `path` cannot be read."""
    try:
        return float(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def load_since(start: float | None) -> Load:
    """The load from `start` (a 1-minute load average read earlier) to now."""
    return Load(start, read_load_average(), os.cpu_count() or 1)


def spread(values: Sequence[float]) -> float:
    """(max - min) / median of repeated timings; 0 for fewer than two."""
    if len(values) < 2:
        return 0.0
    return (max(values) - min(values)) / statistics.median(values)


def turn_note(turn: Mapping[str, Any], load: Load) -> str | None:
    """A note when a turn's kvtier TTFT exceeds what kvtier adds to (or saves from) recomputing.

    On a miss kvtier computes what recompute does, plus its lookup; on a hit it computes less,
    after loading the prefix. Either way, kvtier's TTFT above recompute's plus the measured
    lookup-and-load and a `TTFT_TOLERANCE` margin is not kvtier's doing.

    Args:
        turn: a workload turn: `cached_tokens`, `prompt_tokens`, `kvtier_ms`, `recompute_ms`, and
            `prepare_ms` (the lookup, and loading what it found).
        load: the machine's load so far.
    Returns:
        One line, or None when the figures are what kvtier costs.
    """
    excess_ms = turn["kvtier_ms"] - turn["prepare_ms"] - turn["recompute_ms"]
    if excess_ms <= TTFT_TOLERANCE * turn["recompute_ms"]:
        return None
    if turn["cached_tokens"]:
        did = (f"a hit: kvtier loaded the prefix in {turn['prepare_ms']:.1f} ms and computed "
               f"{turn['prompt_tokens'] - turn['cached_tokens']:,} tokens, recompute all {turn['prompt_tokens']:,}")
    else:
        did = f"a miss: kvtier computed what recompute did plus a {turn['prepare_ms']:.1f} ms lookup"
    return (f"note: {did}; the other {excess_ms:.0f} ms was not spent in kvtier's lookup or load: the machine's "
            f"noise ({load.describe()})")


def spread_notes(timings_ms: Mapping[int, Sequence[float]], what: str, load: Load) -> list[str]:
    """A note per size whose repeated timings of the same work spread more than `SPREAD_TOLERANCE`.

    Args:
        timings_ms: tokens -> repeated timings (ms) of the same work at that size.
        what: what was timed, with `{n:,}` where the size goes, e.g. "recomputing {n:,}-token prompts".
        load: the machine's load over the run.
    """
    return [f"note: {what.format(n=n)} {_spread_text(values)} over {len(values)} runs of the same work, so "
            f"figures at this size carry that much of the machine's noise ({load.describe()})"
            for n, values in sorted(timings_ms.items()) if spread(values) > SPREAD_TOLERANCE]


def experiment_notes(rows: Iterable[Mapping[str, Any]], tier_order: Sequence[str], load: Load) -> list[str]:
    """A note per prefix length where the fastest tier's TTFT read slower than a lower tier's, or
    where recomputing that length (once per tier: the same work) spread more than `SPREAD_TOLERANCE`.

    Args:
        rows: prefix-experiment rows: `prefix_tokens`, `tier`, `kvtier_ms`, `recompute_ms`.
        tier_order: tier names, fastest first; only the first is held to be the fastest (DRAM: a
            memory copy), the order of the others depends on the machine.
        load: the machine's load over the run.
    """
    by_length: dict[int, dict[str, Mapping[str, Any]]] = {}
    for r in rows:
        by_length.setdefault(r["prefix_tokens"], {})[r["tier"]] = r
    notes = []
    for length, tiers in sorted(by_length.items()):
        ranked = [tiers[t] for t in tier_order if t in tiers]
        recompute = [r["recompute_ms"] for r in ranked]
        inverted = _inversions(ranked)
        if not inverted and spread(recompute) <= SPREAD_TOLERANCE:
            continue
        what = (f"{'; '.join(inverted)}: a {ranked[0]['tier']} hit is a memory copy, no slower than the others for "
                "the same bytes, and each figure is one timing" if inverted else "these timings are rough")
        notes.append(f"note: at {length:,} tokens {what}; recomputing this length {len(recompute)} times "
                     f"{_spread_text(recompute)} ({load.describe()})")
    return notes


def _inversions(ranked: Sequence[Mapping[str, Any]]) -> list[str]:
    """["dram (9.0 ms) read slower than pool (8.1 ms) and ssd (7.0 ms)"] where the first (fastest)
    tier read slower than any after it; [] otherwise."""
    if not ranked:
        return []
    fast = ranked[0]
    beat = [s for s in ranked[1:] if s["kvtier_ms"] < fast["kvtier_ms"]]
    if not beat:
        return []
    return [f"{fast['tier']} ({fast['kvtier_ms']:.1f} ms) read slower than "
            + " and ".join(f"{s['tier']} ({s['kvtier_ms']:.1f} ms)" for s in beat)]


def _spread_text(values: Sequence[float]) -> str:
    return f"took {min(values):.1f}-{max(values):.1f} ms ({100 * spread(values):.0f}% spread)"
