"""What in a trace predicts that a cached block will be used again: the evidence a KV-aware policy needs.

Not a test and not the simulator: a study of one trace, for whoever designs an eviction policy for it
(issue 13, part 3). It answers three questions, each printed as a table and saved in `--json`:

1. How likely is a block access to be followed by another access of the same block, and how soon,
   by what an online policy can know at that moment: how often the block was accessed before (0, 1,
   2, 3+), and whether it is the last block of its request (a chain's tail: with the partial tail
   counted, as `kvtier simulate` counts it, that block names tokens only an identical prompt repeats).
2. How much of a capacity's LRU-to-Belady gap an oracle closes that knows only which stored blocks
   will never be used again (LRU that does not store them): the share of the gap that is about
   predicting dead blocks rather than ordering live ones.
3. Where the runtime's policies (LRU, ARC, S3-FIFO) and Belady stand at each capacity, through
   `kvtier.simulate.replay.simulate` (the manager's own decisions; one tier).

The oracle of (2) is a plain LRU over an OrderedDict with the simulator's prefix accounting (a hit
counts only inside the matched prefix); it reproduces the manager's LRU figure when it stores every
block (`lru_check` in the JSON), which is how one knows its accounting agrees.

    python bench/policy_study.py [--trace conversation] [--shares 5,10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, OrderedDict

from kvtier.simulate.replay import SimConfig, SimPolicy, VirtualTier, simulate
from kvtier.simulate.trace import Trace, load_trace, resolve_trace_path
from kvtier.kinds import TierKind

HORIZONS = (1_000, 10_000, 100_000)  # block accesses after an access, for "how soon"
MAX_PRIOR = 3  # accesses before this one, 3 meaning 3 or more
BLOCK_BYTES = 1  # the study counts blocks; bytes do not matter


def reuse_table(trace: Trace) -> list[dict]:
    """Per (prior accesses, is tail): accesses, P(accessed again), P(again within each horizon).

    Time is counted in block accesses, in trace order.
    """
    seen: dict[int, list[int]] = {}  # block -> [accesses so far, time of the last one, its row]
    rows: dict[tuple[int, bool], Counter] = {}
    time = 0
    for request in trace.requests:
        last = len(request.hash_ids) - 1
        for depth, block in enumerate(request.hash_ids):
            state = seen.get(block)
            if state is not None:
                gap, row = time - state[1], state[2]
                row["again"] += 1
                for horizon in HORIZONS:
                    row[horizon] += gap <= horizon
            prior = state[0] if state is not None else 0
            row = rows.setdefault((min(prior, MAX_PRIOR), depth == last), Counter())
            row["accesses"] += 1
            seen[block] = [prior + 1, time, row]
            time += 1
    return [{"prior_accesses": f"{prior}+" if prior == MAX_PRIOR else str(prior), "tail": tail,
             "accesses": c["accesses"], "p_again": c["again"] / c["accesses"],
             **{f"p_within_{h}": c[h] / c["accesses"] for h in HORIZONS}}
            for (prior, tail), c in sorted(rows.items())]


def prefix_lru_hits(trace: Trace, num_slots: int, stored: list[set] | None = None) -> int:
    """Block hits of one LRU tier with prefix accounting.

    `stored`: per request, the blocks of it the tier may store (None: every block).
    """
    order: OrderedDict[int, None] = OrderedDict()
    num_hits = 0
    for i, request in enumerate(trace.requests):
        blocks = request.hash_ids
        n = 0
        while n < len(blocks) and blocks[n] in order:
            n += 1
        num_hits += n
        for block in blocks:
            if block in order:
                order.move_to_end(block)
            elif stored is None or block in stored[i]:
                if len(order) >= num_slots:
                    order.popitem(last=False)
                order[block] = None
    return num_hits


def reused_later(trace: Trace) -> list[set]:
    """Per request, the blocks of it that some later request accesses again."""
    later: set = set()
    result = []
    for request in reversed(trace.requests):
        result.append(later & set(request.hash_ids))
        later.update(request.hash_ids)
    return result[::-1]


def oracle_bypass_hits(trace: Trace, num_slots: int) -> int:
    """Hits of LRU that never stores a block no later request accesses (knows dead blocks, nothing else)."""
    return prefix_lru_hits(trace, num_slots, reused_later(trace))


def capacity_rows(trace: Trace, shares: list[float]) -> list[dict]:
    """Hit rates at each share of the trace's distinct blocks: the runtime's policies, Belady, the oracle."""
    rows = []
    for share in shares:
        num_slots = max(1, int(share / 100 * trace.num_unique_blocks))
        tier = (VirtualTier(TierKind.HBM, num_slots, 1000.0),)
        rates = {p.value: simulate(trace, SimConfig(tier, BLOCK_BYTES, policy=p))["block_hit_rate"] for p in SimPolicy}
        rates["lru_check"] = prefix_lru_hits(trace, num_slots) / trace.num_accesses
        rates["oracle_bypass"] = oracle_bypass_hits(trace, num_slots) / trace.num_accesses
        gap = rates["belady"] - rates["lru"]
        closed = {name: (rate - rates["lru"]) / gap if gap > 0 else 0.0 for name, rate in rates.items()}
        rows.append({"share_pct": share, "num_slots": num_slots, "hit_rate": rates, "gap_closed": closed})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="conversation")
    parser.add_argument("--shares", default="5,10", help="capacities, as %% of the trace's distinct blocks")
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args()
    trace = load_trace(resolve_trace_path(args.trace))
    shares = [float(s) for s in args.shares.split(",") if s.strip()]
    print(f"{trace.path}: {len(trace.requests):,} requests, {trace.num_accesses:,} accesses, "
          f"{trace.num_unique_blocks:,} distinct blocks")
    print("\n1. after an access, the chance the block is accessed again (and within N accesses)")
    print(f"{'prior':>6}{'tail':>6}{'accesses':>10}{'ever':>8}" + "".join(f"{'<=' + format(h, ','):>10}" for h in HORIZONS))
    reuse = reuse_table(trace)
    for r in reuse:
        print(f"{r['prior_accesses']:>6}{'yes' if r['tail'] else 'no':>6}{r['accesses']:>10,}{r['p_again']:>8.3f}"
              + "".join(f"{r[f'p_within_{h}']:>10.3f}" for h in HORIZONS))
    print("\n2-3. block hit rate, one tier; in brackets the share of the LRU -> Belady gap closed")
    rows = capacity_rows(trace, shares)
    names = list(rows[0]["hit_rate"]) if rows else []
    print(f"{'share':>6}{'slots':>9}" + "".join(f"{n:>22}" for n in names))
    for row in rows:
        print(f"{row['share_pct']:>5g}%{row['num_slots']:>9,}" + "".join(
            f"{row['hit_rate'][n]:>13.2%} ({row['gap_closed'][n]:+.2f})" for n in names))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trace": trace.path, "num_accesses": trace.num_accesses, "reuse": reuse, "capacities": rows},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
