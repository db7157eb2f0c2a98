"""Time-to-first-token with kvtier versus recomputing the prefix, for the demo.

Two measurements, both on one machine in one run:

- `timed_generate` / `timed_recompute`: one request through `model.generate`, with a kvtier prefix
  cache or with transformers' default cache; the clock stops when generate emits its first token.
- `prefix_experiment`: for each prefix length and each tier, a fresh request (prefix + a short new
  message) is first recomputed and timed; then the prefix's KV is stored *into that tier* and
  checked to be there, and the same request is served through kvtier and timed. The ratio is kvtier's TTFT over
  recompute's: below 1 means kvtier answered first.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.model.keys import block_keys
from kvtier.kinds import TierKind

SUFFIX_TOKENS = 32  # the new message after the stored prefix: what kvtier still has to compute


class FirstTokenClock:
    """A `generate` streamer that notes when the first new token exists.

    transformers calls `put` once with the prompt, then once per generated token; `on_token(i)` is
    called for the i-th generated token (1-based), e.g. to sample memory mid-generation.
    """

    def __init__(self, start_s: float, on_token: Callable[[int], None] | None = None) -> None:
        self.start_s, self.on_token = start_s, on_token
        self.ttft_s: float | None = None
        self._num_puts = 0

    def put(self, value: Any) -> None:
        self._num_puts += 1
        if self._num_puts == 2:
            self.ttft_s = time.perf_counter() - self.start_s
        if self._num_puts > 1 and self.on_token is not None:
            self.on_token(self._num_puts - 1)

    def end(self) -> None:
        """Nothing to flush."""


@dataclass(frozen=True)
class Timed:
    """One request: its tokens (prompt + generated), time to first token, prompt tokens served by kvtier,
    and the part of the TTFT kvtier spent before the model ran (the lookup, and loading what it found)."""

    tokens: torch.Tensor
    ttft_s: float
    num_cached_tokens: int = 0
    prepare_s: float = 0.0


def timed_recompute(model: Any, ids: torch.Tensor, max_new_tokens: int) -> Timed:
    """Greedy `generate` with transformers' default cache: every prompt token is computed."""
    clock = FirstTokenClock(time.perf_counter())
    out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, streamer=clock)
    return Timed(out[0].cpu(), clock.ttft_s)


def timed_generate(hf: Any, ids: torch.Tensor, max_new_tokens: int,
                   on_token: Callable[[int], None] | None = None) -> Timed:
    """Greedy `generate` on a kvtier prefix cache; the clock includes the lookup and loading the stored prefix.

    The request's new full blocks are stored (and waited for) after the clock stops, as a server
    would do after answering.
    """
    clock = FirstTokenClock(time.perf_counter(), on_token)
    cache = hf.prefix_cache()
    try:
        num_cached = cache.prepare(ids)
        prepare_s = time.perf_counter() - clock.start_s
        out = hf.model.generate(ids, past_key_values=cache, do_sample=False, max_new_tokens=max_new_tokens,
                                streamer=clock)
        cache.save(out[0]).wait()
    finally:
        cache.close()
    return Timed(out[0].cpu(), clock.ttft_s, num_cached, prepare_s)


def prefix_experiment(hf: Any, prefix_lengths: Sequence[int], tiers: Sequence[TierKind], *, seed: int,
                      after_prefill: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """TTFT rows for a prefix of each length placed in each tier.

    Args:
        hf: the `HFKVTier` binding.
        prefix_lengths: tokens, multiples of the block size.
        tiers: where to place each prefix (each must be configured).
        seed: for the random token ids; every (length, tier) gets its own prefix.
        after_prefill: called with the prefix length right after the longest prefix is computed, while its
            KV is still held (the demo samples memory there).
    Returns:
        One dict per (length, tier): recompute and kvtier TTFT in ms, their ratio, how many blocks
        the load took from the tier, and whether both produced the same first token.
    """
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for length in prefix_lengths:
        for tier in tiers:
            ids = torch.randint(3, hf.model.config.vocab_size, (1, length + SUFFIX_TOKENS), generator=gen)
            rows.append(_measure(hf, ids.to(hf.device), length, tier,
                                 after_prefill if length == max(prefix_lengths) and tier == tiers[0] else None))
    return rows


def _measure(hf: Any, ids: torch.Tensor, length: int, tier: TierKind,
             after_prefill: Callable[[int], None] | None) -> dict[str, Any]:
    want = timed_recompute(hf.model, ids, max_new_tokens=1)
    with torch.no_grad():  # the prefix's KV, to place (not timed)
        out = hf.model(ids[:, :length], use_cache=True)
    if after_prefill is not None:
        after_prefill(length)
    keys = _place(hf, ids[0, :length].cpu(), out.past_key_values, tier)
    del out
    hits_before = hf.kv.stats.hits[tier]
    got = timed_generate(hf, ids, max_new_tokens=1)
    return {"prefix_tokens": length, "tier": tier.name.lower(), "num_blocks": len(keys),
            "recompute_ms": want.ttft_s * 1e3, "kvtier_ms": got.ttft_s * 1e3, "ratio": got.ttft_s / want.ttft_s,
            "speedup": want.ttft_s / got.ttft_s, "cached_tokens": got.num_cached_tokens,
            "hits_from_tier": hf.kv.stats.hits[tier] - hits_before,
            "identical": torch.equal(want.tokens, got.tokens)}


def _place(hf: Any, prefix: torch.Tensor, cache: Any, tier: TierKind) -> list:
    """Stores the prefix's blocks into `tier` and waits until every one of them is there.

    Raises:
        RuntimeError: a block did not land in `tier` (the tier is too small for the prefix).
    """
    codec, kv = hf.codec, hf.kv
    keys = block_keys(hf.namespace, prefix)
    blocks = codec.pack([(layer.keys, layer.values) for layer in cache.layers], 0, len(keys))
    kv.quiesce()
    done = 0
    while done < len(keys):
        # A store into a full tier spills below it: write only what fits, and let the watermark
        # demotions that follow each write (of older blocks: the policy is LRU) free the next room.
        usage = kv.usage()[tier.name.lower()]
        n = min(len(keys) - done, usage["slots"] - usage["used"])
        if n <= 0:
            break
        kv.store(keys[done:done + n], blocks[done:done + n], target=tier).wait()
        kv.quiesce()
        done += n
    where = kv.where(keys)
    if any(w is not tier for w in where):
        elsewhere = sum(w is not tier for w in where)
        raise RuntimeError(f"{elsewhere} of {len(keys)} prefix blocks are not in {tier.name.lower()}: "
                           f"the tier is too small for a {len(prefix)}-token prefix")
    return keys
