"""Capacity sweeps for `kvtier simulate`: hit rate against the size of one tier, and a recommendation.

A sweep replays the trace once per (configuration, capacity) pair, changing only the swept tier's
slot count. The grid brackets the target block hit rate; then, for the online configurations (LRU,
S3-FIFO, ARC, chain-ARC, with or without admission) whose first grid point reaching the target is the
smallest, `search_smallest` bisects on whole blocks between the grid point before it and it, as
`--servers` searches its pool (`bisect_capacity`, shared by both), and the smallest capacity found
is recommended: it reaches the target and one block less does not. Hit rate need not grow with
capacity, so the bisection finds *a* boundary inside the bracket, not always the smallest size
anywhere. Belady's MIN is never recommended — no real cache knows the future — and is not bisected
(each of its replays is slow): its smallest swept capacity reaching the target is reported, at the
grid's resolution.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.units import format_bytes
from kvtier.simulate.replay import SimConfig, SimPolicy, VirtualTier, blocks_of_share, simulate
from kvtier.simulate.trace import Trace
from kvtier.kinds import TierKind

# Default sweep points, as shares of the trace's distinct blocks (1.0 holds every block: no evictions).
DEFAULT_SWEEP_SHARES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)
# Default target: this share of the best any cache can do on the trace (its compulsory misses aside).
DEFAULT_TARGET_SHARE_OF_MAX = 0.9


def default_points(trace: Trace) -> list[int]:
    """Slot counts at `DEFAULT_SWEEP_SHARES` of the trace's distinct blocks, ascending and distinct."""
    return sorted({max(1, blocks_of_share(share, trace.num_unique_blocks)) for share in DEFAULT_SWEEP_SHARES})


def default_target(trace: Trace) -> float:
    """`DEFAULT_TARGET_SHARE_OF_MAX` of the trace's best possible block hit rate."""
    return DEFAULT_TARGET_SHARE_OF_MAX * trace.max_block_hit_rate


def with_capacity(config: SimConfig, tier: TierKind, num_slots: int, bandwidth_gbps: float) -> SimConfig:
    """`config` with `tier` resized to `num_slots` (added, at `bandwidth_gbps`, if it was absent)."""
    others = tuple(t for t in config.tiers if t.kind is not tier)
    current = next((t for t in config.tiers if t.kind is tier), None)
    bandwidth = current.bandwidth_gbps if current else bandwidth_gbps
    return dataclasses.replace(config, tiers=(*others, VirtualTier(tier, num_slots, bandwidth)))


def sweep(trace: Trace, configs: Sequence[SimConfig], tier: TierKind, points: Sequence[int],
          bandwidth_gbps: float, *, on_progress: Callable[[int], None] | None = None) -> list[dict]:
    """Replays `trace` for every configuration at every capacity of `tier`.

    Args:
        trace: the requests.
        configs: the configurations to compare (typically one per policy and admission choice).
        tier: the tier whose capacity varies; added to configurations that lack it.
        points: its slot counts (each >= 1).
        bandwidth_gbps: its bandwidth where it is added.
        on_progress: passed on to `simulate`.
    Returns:
        One row per (configuration, point), configurations in order, points ascending: `label`,
        `policy`, `admission`, `capacity_blocks`, `capacity_bytes`, `block_hit_rate`, the per-tier
        hit rates, tokens saved and TTFT percentiles.
    Raises:
        ConfigError: no points.
        CapacityError: a point below one block.
    """
    if not points:
        raise ConfigError("sweep: give at least one capacity point")
    rows = []
    for config in configs:
        for num_slots in sorted(points):
            report = simulate(trace, with_capacity(config, tier, num_slots, bandwidth_gbps), on_progress=on_progress)
            rows.append(_row(report, tier, num_slots))
    return rows


def bisect_capacity(reaches: Callable[[int], bool], below: int, above: int) -> int:
    """The smallest capacity in (below, above] found by bisection on whole blocks.

    Args:
        reaches: whether a capacity (in blocks, called only strictly between `below` and `above`)
            reaches the target; each call is typically one replay.
        below: a capacity known to fall short (0: none at all).
        above: a capacity known to reach the target, > `below`.
    Returns:
        S in (below, above] that reaches the target with S - 1 falling short (or S - 1 == `below`).
    """
    while above - below > 1:
        middle = (below + above) // 2
        if reaches(middle):
            above = middle
        else:
            below = middle
    return above


def planned_bisections(below: int, above: int) -> int:
    """At most how many replays `bisect_capacity` makes between `below` and `above`."""
    return math.ceil(math.log2(above - below)) if above - below > 1 else 0


def bracket(rows: Sequence[dict], label: str, target_hit_rate: float) -> tuple[int, int] | None:
    """`label`'s grid bracket: (the point before the first reaching the target, or 0; that first point), or None."""
    below = 0
    for row in sorted((r for r in rows if r["label"] == label), key=lambda r: r["capacity_blocks"]):
        if row["block_hit_rate"] >= target_hit_rate:
            return below, row["capacity_blocks"]
        below = row["capacity_blocks"]
    return None


def labels_to_search(rows: Sequence[dict], target_hit_rate: float) -> list[str]:
    """The online configurations worth bisecting: those whose first grid point reaching the target is the smallest."""
    firsts = {label: b[1] for label in dict.fromkeys(r["label"] for r in rows)
              if not _is_belady(label) and (b := bracket(rows, label, target_hit_rate)) is not None}
    smallest = min(firsts.values(), default=None)
    return [label for label, first in firsts.items() if first == smallest]


def search_smallest(trace: Trace, config: SimConfig, tier: TierKind, rows: Sequence[dict], target_hit_rate: float,
                    bandwidth_gbps: float, *, on_progress: Callable[[int], None] | None = None) -> dict | None:
    """Bisects `config`'s grid bracket (see `bracket`) down to the smallest capacity reaching the target.

    Args:
        trace, tier, bandwidth_gbps, on_progress: as for `sweep`.
        config: one configuration swept in `rows`.
        rows: from `sweep`.
        target_hit_rate: the block hit rate to reach.
    Returns:
        None if no grid point of `config` reaches the target; else `label`, `method` ("bisection"),
        `below_blocks` and `above_blocks` (the grid bracket), `capacity_blocks` (the size found) and
        `rows` (one per capacity replayed by the bisection, as `sweep`'s rows).
    """
    found = bracket(rows, config.label, target_hit_rate)
    if found is None:
        return None
    below, above = found
    replayed: list[dict] = []

    def reaches(num_slots: int) -> bool:
        report = simulate(trace, with_capacity(config, tier, num_slots, bandwidth_gbps), on_progress=on_progress)
        replayed.append(_row(report, tier, num_slots))
        return replayed[-1]["block_hit_rate"] >= target_hit_rate

    size = bisect_capacity(reaches, below, above)
    return {"label": config.label, "method": "bisection", "below_blocks": below, "above_blocks": above,
            "capacity_blocks": size, "rows": sorted(replayed, key=lambda r: r["capacity_blocks"])}


def _is_belady(label: str) -> bool:
    return label.startswith(SimPolicy.BELADY.value)


def _row(report: dict, tier: TierKind, num_slots: int) -> dict:
    return {
        "label": report["label"], "policy": report["policy"], "admission": report["admission"],
        "tier": tier.name.lower(), "capacity_blocks": num_slots,
        "capacity_bytes": num_slots * report["block_bytes"],
        "block_hit_rate": report["block_hit_rate"],
        "tier_hit_rates": {name: t["hit_rate"] for name, t in report["tiers"].items()},
        "tokens_saved": report["prefill"]["tokens_saved"], "ttft_s": report["ttft_s"],
    }  # fmt: skip


def recommend(rows: Sequence[dict], target_hit_rate: float, max_hit_rate: float,
              searches: Sequence[dict] = ()) -> dict:
    """The smallest capacity, swept or bisected, at which an online policy reaches `target_hit_rate`.

    Args:
        rows: from `sweep`.
        target_hit_rate: the block hit rate wanted, in (0, 1].
        max_hit_rate: the trace's best possible block hit rate, for the message.
        searches: from `search_smallest`, for some configurations of `rows`; their rows count too.
    Returns:
        `target_hit_rate`, `by_label` (each configuration's smallest capacity reaching it, or None),
        `recommended` (the row chosen, or None), `belady` (Belady's smallest, or None), `search`
        (the bisection that found the recommended capacity, without its rows, or None: a grid
        point) and `message`, which says how the capacity was found.
        A trace that never accesses a block twice (`max_hit_rate` 0) has nothing to size: no
        recommendation, a message saying so, whatever the target.
    Raises:
        ConfigError: the target is not in (0, 1] (on a trace with a possible hit).
    """
    if max_hit_rate <= 0:
        return {"target_hit_rate": target_hit_rate, "by_label": {row["label"]: None for row in rows},
                "recommended": None, "belady": None,
                "message": "no block of this trace is accessed twice: every capacity hits 0.0%, so there is "
                           "nothing to size"}
    if not 0 < target_hit_rate <= 1:
        raise ConfigError(f"target_hit_rate must be in (0, 1], got {target_hit_rate!r}")
    first: dict[str, dict | None] = {}
    searched = [row for search in searches for row in search["rows"]]
    for row in sorted([*rows, *searched], key=lambda r: r["capacity_blocks"]):  # stable: labels keep their order
        first.setdefault(row["label"], None)
        if first[row["label"]] is None and row["block_hit_rate"] >= target_hit_rate:
            first[row["label"]] = row
    belady = next((r for label, r in first.items() if _is_belady(label)), None)
    online = [r for label, r in first.items() if r is not None and not _is_belady(label)]
    best = min(online, key=lambda r: (r["capacity_blocks"], -r["block_hit_rate"]), default=None)
    search = next(({k: v for k, v in s.items() if k != "rows"} | {"num_replays": len(s["rows"])}
                   for s in searches if best is not None and s["label"] == best["label"]), None)
    return {
        "target_hit_rate": target_hit_rate,
        "by_label": {label: (r and _choice(r)) for label, r in first.items()},
        "recommended": best and _choice(best),
        "belady": belady and _choice(belady),
        "search": search,
        "message": _message(best, belady, rows, target_hit_rate, max_hit_rate, _how_found(best, search)),
    }


def _choice(row: dict) -> dict:
    keys = ("label", "tier", "capacity_blocks", "capacity_bytes", "block_hit_rate")
    return {k: row[k] for k in keys}


def _message(best: dict | None, belady: dict | None, rows: Sequence[dict], target: float, max_rate: float,
             how_found: str) -> str:
    if best is not None:
        text = (f"{best['tier']} = {best['capacity_blocks']:,} blocks ({format_bytes(best['capacity_bytes'])}) with "
                f"{best['label']} reaches {best['block_hit_rate']:.1%} >= target {target:.1%}{how_found}")
    elif target > max_rate:
        text = f"target {target:.1%} is above this trace's maximum {max_rate:.1%} (every block's first use misses)"
    else:
        top = max(rows, key=lambda r: r["block_hit_rate"])
        text = (f"no swept capacity reaches {target:.1%}; the best is {top['block_hit_rate']:.1%} "
                f"({top['label']}, {top['capacity_blocks']:,} blocks): sweep larger capacities")
    if belady is not None:
        text += f"; Belady's optimum reaches it at the swept {belady['capacity_blocks']:,} blocks (not bisected)"
    return text


def _how_found(best: dict | None, search: dict | None) -> str:
    if best is None:
        return ""
    if search is None:
        return "; a swept grid point, not bisected"
    below, above, size = search["below_blocks"], search["above_blocks"], best["capacity_blocks"]
    short = f"{size - 1:,} blocks fall short" if size > 1 else "it is a single block"
    return (f"; found by bisection on whole blocks between the swept {below:,} and {above:,} "
            f"({search['num_replays']} more replay{'s' * (search['num_replays'] != 1)}): {short}")


def plot_sweep(rows: Sequence[dict], path: Path, *, target_hit_rate: float | None, max_hit_rate: float) -> Path:
    """Writes a PNG of block hit rate against the swept capacity, one line per configuration."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for label in dict.fromkeys(r["label"] for r in rows):
        mine = [r for r in rows if r["label"] == label]
        ax.plot([r["capacity_blocks"] for r in mine], [100 * r["block_hit_rate"] for r in mine],
                marker="o", linestyle="--" if label.startswith("belady") else "-", label=label)
    ax.axhline(100 * max_hit_rate, color="grey", linewidth=0.8, label="infinite cache")
    if target_hit_rate is not None:
        ax.axhline(100 * target_hit_rate, color="red", linewidth=0.8, linestyle=":", label="target")
    ax.set_xscale("log")
    ax.set_xlabel(f"{rows[0]['tier']} capacity (blocks)")
    ax.set_ylabel("block hit rate (%)")
    ax.set_title("kvtier simulate: hit rate vs capacity")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_runs(runs: Sequence[dict], path: Path) -> Path:
    """Writes a PNG of each run's hit rate per tier, stacked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(runs) + 2), 5))
    labels = [r["label"] for r in runs]
    bottom = [0.0] * len(runs)
    for tier in dict.fromkeys(name for r in runs for name in r["tiers"]):
        heights = [100 * r["tiers"].get(tier, {}).get("hit_rate", 0.0) for r in runs]
        ax.bar(labels, heights, bottom=bottom, label=tier)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel("block hit rate (%)")
    ax.set_title("kvtier simulate: hits by tier")
    ax.legend()
    return _save(fig, path)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    """Writes `fig` as a PNG at `path`.

    Raises:
        ConfigError: it cannot be written (its folder is a file, a full disk...), naming the path.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise ConfigError(f"plot: cannot write {str(path)!r}: {e.strerror or e}") from None
    finally:
        _pyplot().close(fig)
    return path
