"""The report of one `kvtier simulate` replay, made from its counts whichever engine ran it.

`ReplayCounts` is what the manager's replay and the native engine both hand back; `make_report`
turns it into the JSON-ready dict that the CLI prints and `--json` writes (see
`kvtier.simulate.replay` for what each count means); `admission_notes` explains, across the runs
of one command, what admission filtered out.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvtier.kinds import TierKind
from kvtier.observing.stats import DropReason
from kvtier.simulate.trace import Trace

if TYPE_CHECKING:
    from kvtier.simulate.replay import SimConfig, VirtualTier

# With admission on, these tiers (slow, wear-limited or shared) admit only blocks hit at least
# ADMISSION_MIN_HITS times, stored directly or demoted (`replay._tier_rules`); defined here, where
# `admission_notes` describes them, because replay imports this module.
ADMISSION_TIERS = frozenset({TierKind.POOL, TierKind.SSD})
ADMISSION_MIN_HITS = 1


@dataclass(frozen=True, slots=True)
class ReplayCounts:
    """What one replay counted, whichever engine ran it: `simulate` makes its report from this alone.

    Attributes:
        engine: the engine that ran: "native" or "manager".
        fallback: why the native engine did not run where `SimEngine.AUTO` asked for it, else None.
        replay_s: wall seconds of the replay itself (see the module docstring for what is outside).
        hits, stores, evictions: per tier, the manager's `Stats` counts.
        engine_reads: per tier, blocks read out of it to the engine.
        used_slots: per tier, slots in use at the end.
        demotions, promotions: per (src, dst) tier pair, the completed moves.
        dropped: per `DropReason`, the blocks lost (non-zero counts only).
        num_accesses, cached_tokens, input_tokens: over all requests.
        ttft_s, ttft_no_cache_s: per request, the TTFT model's estimate with and without the cache.
        lru_orders: per tier, its LRU order at the end (keys, oldest first); only when asked for.
        hints: the manager's `Stats.hints` counters, for a replay with hints; else None.
    """

    engine: str
    fallback: str | None
    replay_s: float
    hits: dict[TierKind, int]
    stores: dict[TierKind, int]
    evictions: dict[TierKind, int]
    engine_reads: dict[TierKind, int]
    used_slots: dict[TierKind, int]
    demotions: dict[tuple[TierKind, TierKind], int]
    promotions: dict[tuple[TierKind, TierKind], int]
    dropped: dict[str, int]
    num_accesses: int
    cached_tokens: int
    input_tokens: int
    ttft_s: Sequence[float]
    ttft_no_cache_s: Sequence[float]
    lru_orders: dict[TierKind, list[Hashable]] | None = None
    hints: dict[str, int] | None = None  # the manager's hint counters, where the trace had hints



def make_report(trace: Trace, cfg: SimConfig, counts: ReplayCounts) -> dict:
    """The JSON-ready report of a finished replay."""
    num_hits = sum(counts.hits.values())
    accesses, replay_s = counts.num_accesses, counts.replay_s
    hints = {"hints": dict(sorted(counts.hints.items()))} if counts.hints is not None else {}
    return hints | {
        "label": cfg.label, "policy": cfg.policy.value, "admission": "on" if cfg.admission else "off",
        "mode": cfg.mode.value, "promote_to": cfg.promote_to.name.lower() if cfg.promote_to else None,
        "partial_blocks": "excluded" if cfg.full_blocks_only else "counted",
        "block_bytes": cfg.block_bytes, "num_requests": len(trace.requests),
        "num_accesses": accesses, "num_hits": num_hits,
        "block_hit_rate": num_hits / accesses if accesses else 0.0,
        "prefill": {
            "input_tokens": counts.input_tokens, "tokens_saved": counts.cached_tokens,
            "token_hit_rate": counts.cached_tokens / counts.input_tokens if counts.input_tokens else 0.0,
            "prefill_tokens_per_s": cfg.prefill_tokens_per_s,
        },
        "ttft_s": _percentiles(counts.ttft_s), "ttft_no_cache_s": _percentiles(counts.ttft_no_cache_s),
        "tiers": {t.kind.name.lower(): _tier_report(cfg, counts, t) for t in cfg.tiers},
        "dropped": dict(counts.dropped),
        "engine": counts.engine, "engine_fallback": counts.fallback,
        "replay_s": replay_s, "accesses_per_s": accesses / replay_s if replay_s > 0 else None,
    }  # fmt: skip


def _tier_report(cfg: SimConfig, counts: ReplayCounts, tier: VirtualTier) -> dict:
    kind, block_bytes, accesses = tier.kind, cfg.block_bytes, counts.num_accesses
    moves = {route: n + counts.promotions[route] for route, n in counts.demotions.items()}
    moved_in = sum(n for (_, dst), n in moves.items() if dst == kind)
    moved_out = sum(n for (src, _), n in moves.items() if src == kind)
    num_hits = counts.hits[kind]
    blocks_written = counts.stores[kind] + moved_in
    blocks_read = counts.engine_reads[kind] + moved_out
    return {
        "num_slots": tier.num_slots, "capacity_bytes": tier.num_slots * block_bytes,
        "bandwidth_gbps": tier.bandwidth_gbps, "used_slots": counts.used_slots[kind],
        "hits": num_hits, "hit_rate": num_hits / accesses if accesses else 0.0,
        "share_of_hits": num_hits / max(1, sum(counts.hits.values())),
        "stores": counts.stores[kind], "evictions": counts.evictions[kind],
        "blocks_moved_in": moved_in, "blocks_moved_out": moved_out,
        "blocks_read": blocks_read, "blocks_written": blocks_written,
        "bytes_read": blocks_read * block_bytes, "bytes_written": blocks_written * block_bytes,
        "bytes_moved": (blocks_read + blocks_written) * block_bytes,
    }  # fmt: skip


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    if len(values) == 0:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
    p50, p90, p99 = np.percentile(np.asarray(values), [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(np.mean(values))}


def admission_notes(runs: list[dict]) -> list[str]:
    """Per run with admission on, one line saying why its pool and SSD tiers hit less: what admission refused.

    With admission on, `replay._tier_rules` gives every pool or SSD tier below the top one the rule
    "admit only blocks hit `ADMISSION_MIN_HITS` times so far", for direct stores and demotions alike;
    a refused block leaves the cache (`DropReason.ADMISSION`). Where the same policy also ran without
    admission, the line gives each filtered tier's hit rate (share of all accesses) in both runs.
    """
    notes = []
    for run in runs:
        filtered = [name for i, name in enumerate(run["tiers"]) if i > 0 and TierKind[name.upper()] in ADMISSION_TIERS]
        if run["admission"] != "on" or not filtered:
            continue
        refused = run["dropped"].get(DropReason.ADMISSION, 0)
        times = f"{ADMISSION_MIN_HITS} time{'s' * (ADMISSION_MIN_HITS != 1)}"
        text = (f"{run['label']}: admission lets {' and '.join(filtered)} take only blocks already hit at least "
                f"{times}, stored or demoted alike; {refused:,} blocks not reused yet found no tier to take them "
                "and left the cache")
        plain = next((r for r in runs if r["policy"] == run["policy"] and r["admission"] == "off"), None)
        if plain is not None:
            rates = ", ".join(f"{n} {plain['tiers'][n]['hit_rate']:.1%} -> {run['tiers'][n]['hit_rate']:.1%}"
                              for n in filtered)
            text += (f"; hit rate without -> with admission: {rates}, all tiers {plain['block_hit_rate']:.1%} -> "
                     f"{run['block_hit_rate']:.1%}")
        notes.append(text)
    return notes
