"""Chain-aware ARC: ARC's recency/frequency balance, plus what prefix chains say about KV blocks.

A KV block is usable only behind its whole prefix: block i of a request is worth nothing once block
i - 1 is gone, and a request reads its chain head to tail. ARC (see `kvtier.policy.arc`) ignores
both. This policy adds two rules, applied when the manager tells it one request's blocks in prefix
order (`order_chain`, called by `TierManager.order_chain` after the request's load and store):

1. Deepest first. The request's blocks resident here are re-ranked tail to head, so that within
   each of ARC's lists the head ends up the most recent: when the chain must shrink, it loses its
   tail and keeps a usable prefix, instead of losing its head first (plain recency order, since
   the head was read first) and keeping a tail no lookup can reach.
2. A partial tail leaves first. When the request's last block covers only part of a block's tokens
   (`partial_tail=True`: `kvtier simulate` counts such blocks; engines that cache only full blocks
   never store one), it goes to the least recent end of its list: a block holding a prompt's last
   few tokens is hit only by an identical prompt, since any continuation changes its tokens. On
   the Mooncake conversation trace 0.8 % of such blocks are ever accessed again, against 26 % of
   other first-time blocks (bench/policy_study.py).

Everything else is ARC's, unchanged: insert, touch, evict, ghosts, the adaptation of T1's target.
Without `order_chain` calls it is exactly `ARCPolicy`.

What it gains (one tier, `kvtier simulate`, share of the LRU -> Belady gap closed, ARC's in brackets):
conversation trace at 5 % of its distinct blocks 0.13 (0.09), at 10 % 0.10 (0.07); synthetic trace
at 5 % 0.05 (0.01), at 10 % 0.05 (0.00): short of a third. `bench/policy_study.py` reproduces these
figures and shows why. On the conversation trace Belady wins by not keeping blocks that are never
used again (LRU that skips exactly those closes 70 % and 92 % of the gap; on the synthetic trace
only 17 % and 27 %, the rest being which live blocks to keep), and what a backend knows when it
stores a block barely tells those apart: a block seen once is reused 26 % of the time, twice 42 %,
three times 50 %. LRU that skips the blocks a predictor calls dead, the predictor being told with
hindsight the reuse rate of every combination of six such features (conversation turn, output
length, request length, already-seen prefix, prior accesses, partial tail: 2,825 combinations on the
conversation trace), closes 0.20 and 0.20 of the conversation trace's gap and 0.14 and 0.19 of the
synthetic trace's; with only what `KVTier` has when it stores (request length, seen prefix, prior
accesses, partial tail), 0.16, 0.12, 0.05 and 0.10: chain-arc's 0.13, 0.10, 0.05 and 0.05 are near
that ceiling, which a predictor that must learn those rates as it goes, not in hindsight, is
unlikely to pass (it could only by tracking rates that drift within the trace).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvtier.policy.arc import ARCPolicy
from kvtier.policy.base import HintKind


class ChainARCPolicy(ARCPolicy):
    """ARC that ranks a request's blocks deepest-first and sends a partial tail to the old end."""

    chain_aware = True  # the manager calls `order_chain` after each request
    notes_hints = True  # and `note_hint` when a hint is applied

    def note_hint(self, key: Hashable, kind: HintKind) -> None:
        """A key whose sessions all closed goes to the least recent end of its list, as a
        partial tail does; other hints change nothing. Keys not resident are ignored."""
        if kind is not HintKind.CLOSED:
            return
        for resident in (self._t2, self._t1):
            if key in resident:
                resident.move_to_end(key, False)
                return

    def order_chain(self, keys: Sequence[Hashable], partial_tail: bool = False) -> None:
        """Re-ranks one request's blocks: head most recent, tail least; keys not resident are skipped.

        Args:
            keys: the request's block keys in prefix order (head first), as the engine looked them
                up; those this policy does not track (in another tier, or not stored) are ignored.
            partial_tail: the last key names a block only partly filled with tokens: if resident,
                it goes to the least recent end of its list instead.
        """
        t1, t2 = self._t1, self._t2
        last = len(keys) - 1
        for i in range(last, -1, -1):
            key = keys[i]
            recent = not (partial_tail and i == last)
            if key in t2:
                t2.move_to_end(key, recent)
            elif key in t1:
                t1.move_to_end(key, recent)
