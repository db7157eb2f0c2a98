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
3. Where the runtime's policies (LRU, ARC, S3-FIFO, chain-arc) and Belady stand at each capacity,
   through `kvtier.simulate.replay.simulate` (the manager's own decisions; one tier).
4. How much of that gap any predictor of dead blocks could close from what a KV-cache backend can
   know when it stores a block: the *feature oracle*. Each block access gets a key of six features
   (`FEATURES`: the request's conversation turn, output length, length and already-seen prefix, the
   block's prior accesses, whether it is a partial tail); the oracle is told, with hindsight, the
   share of accesses under each key that are followed by another access of the block, and runs LRU
   that does not store a block whose key's share is below a threshold (the best of `THRESHOLDS`).
   Its key rates are fitted on the very trace it replays, so it is better than any online
   predictor of those features can be; what it cannot close is beyond them. The *runtime oracle*
   is the same with only the features `KVTier` itself has when it stores (`RUNTIME_FEATURES`: an
   engine does not tell it a request's output length, and it does not track conversations).

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
MAX_TURN = 6  # conversation turns, 6 meaning 6 or more
THRESHOLDS = tuple(i / 20 for i in range(21))  # 0, 0.05, ..., 1: the feature oracle stores keys reused at least this often
FEATURES = ("turn", "log2_output_tokens", "log2_blocks", "log2_seen_prefix", "prior_accesses", "partial_tail")
RUNTIME_FEATURES = ("log2_blocks", "log2_seen_prefix", "prior_accesses", "partial_tail")
ORACLES = {"feature_oracle": FEATURES, "runtime_oracle": RUNTIME_FEATURES}  # name -> the features its keys hold
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


def request_features(trace: Trace) -> list[tuple[int, int, int, int]]:
    """Per request, what a backend knows of it when it stores its blocks (FEATURES[:4]).

    turn: 0 unless the request extends the whole full-block chain of an earlier request (the one that
    first listed the deepest block of its already-seen prefix, when that block was the earlier
    request's last full block): then the earlier request's turn + 1, up to MAX_TURN. The already-seen
    prefix is the run of leading blocks some earlier request listed (an index of ids, not the cache).
    """
    def log2(n: int) -> int:
        return n.bit_length()

    first: dict[int, tuple[int, int]] = {}  # block -> (request that first listed it, its depth there)
    turns: list[int] = []
    result = []
    for i, request in enumerate(trace.requests):
        blocks = request.hash_ids
        seen = 0
        while seen < len(blocks) and blocks[seen] in first:
            seen += 1
        turn = 0
        if seen:
            j, depth = first[blocks[seen - 1]]
            earlier = trace.requests[j]
            if depth == len(earlier.hash_ids) - 1 - earlier.partial_tail:
                turn = min(turns[j] + 1, MAX_TURN)
        turns.append(turn)
        result.append((turn, log2(request.output_tokens), log2(len(blocks)), log2(seen)))
        for depth, block in enumerate(blocks):
            first.setdefault(block, (i, depth))
    return result


def access_keys(trace: Trace) -> list[list[tuple]]:
    """Per request, per block access, its key: the request's features, the block's prior accesses, partial tail."""
    prior: Counter = Counter()
    result = []
    for request, features in zip(trace.requests, request_features(trace)):
        last = len(request.hash_ids) - 1
        keys = []
        for depth, block in enumerate(request.hash_ids):
            keys.append((*features, min(prior[block], MAX_PRIOR), request.partial_tail and depth == last))
            prior[block] += 1
        result.append(keys)
    return result


def hindsight_rates(trace: Trace, keys: list[list[tuple]]) -> dict[tuple, float]:
    """Per key, the share of accesses under it that some later access of the same block follows."""
    counts: dict[tuple, list[int]] = {}
    for request, request_keys, later in zip(trace.requests, keys, reused_later(trace)):
        for block, key in zip(request.hash_ids, request_keys):
            c = counts.setdefault(key, [0, 0])
            c[0] += block in later
            c[1] += 1
    return {key: again / total for key, (again, total) in counts.items()}


def feature_oracle(trace: Trace, num_slots: int, keys: list[list[tuple]], rates: dict[tuple, float]) -> dict:
    """The best threshold's hits: LRU that stores a block only if its access key's hindsight rate reaches it."""
    best = None
    for threshold in THRESHOLDS:
        stored = [{block for block, key in zip(request.hash_ids, request_keys) if rates[key] >= threshold}
                  for request, request_keys in zip(trace.requests, keys)]
        num_hits = prefix_lru_hits(trace, num_slots, stored)
        if best is None or num_hits > best["num_hits"]:
            best = {"num_hits": num_hits, "threshold": threshold}
    return best


def capacity_rows(trace: Trace, shares: list[float]) -> list[dict]:
    """Hit rates at each share of the trace's distinct blocks: the runtime's policies, Belady, the oracle."""
    rows = []
    keys = access_keys(trace)
    oracles = {}  # name -> (its keys, their hindsight rates)
    for name, features in ORACLES.items():
        columns = [FEATURES.index(f) for f in features]
        projected = [[tuple(key[c] for c in columns) for key in request_keys] for request_keys in keys]
        oracles[name] = (projected, hindsight_rates(trace, projected))
    for share in shares:
        num_slots = max(1, int(share / 100 * trace.num_unique_blocks))
        tier = (VirtualTier(TierKind.HBM, num_slots, 1000.0),)
        rates = {p.value: simulate(trace, SimConfig(tier, BLOCK_BYTES, policy=p))["block_hit_rate"] for p in SimPolicy}
        rates["lru_check"] = prefix_lru_hits(trace, num_slots) / trace.num_accesses
        rates["oracle_bypass"] = oracle_bypass_hits(trace, num_slots) / trace.num_accesses
        fitted = {}
        for name, (oracle_keys, key_rates) in oracles.items():
            best = feature_oracle(trace, num_slots, oracle_keys, key_rates)
            rates[name] = best["num_hits"] / trace.num_accesses
            fitted[name] = {"features": ORACLES[name], "threshold": best["threshold"], "num_keys": len(key_rates)}
        gap = rates["belady"] - rates["lru"]
        closed = {name: (rate - rates["lru"]) / gap if gap > 0 else 0.0 for name, rate in rates.items()}
        rows.append({"share_pct": share, "num_slots": num_slots, "hit_rate": rates, "gap_closed": closed,
                     "oracles": fitted})
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
    print("\n2-4. block hit rate, one tier; in brackets the share of the LRU -> Belady gap closed")
    rows = capacity_rows(trace, shares)
    names = list(rows[0]["hit_rate"]) if rows else []
    print(f"{'share':>6}{'slots':>9}" + "".join(f"{n:>22}" for n in names))
    for row in rows:
        print(f"{row['share_pct']:>5g}%{row['num_slots']:>9,}" + "".join(
            f"{row['hit_rate'][n]:>13.2%} ({row['gap_closed'][n]:+.2f})" for n in names))
    for row in rows:
        for name, fit in row["oracles"].items():
            print(f"{name} at {row['share_pct']:g}%: stores keys reused at least {fit['threshold']:.0%} of the time; "
                  f"{fit['num_keys']:,} keys of {', '.join(fit['features'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trace": trace.path, "num_accesses": trace.num_accesses, "reuse": reuse, "capacities": rows},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
