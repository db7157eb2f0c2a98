"""What a KV-aware router learns from engines' KV events: which server holds a prompt's prefix, and where.

A router (llm-d's KV cache manager, Dynamo's router) subscribes to each server's KV events (vLLM's
`--kv-events-config` stream; a kvtier pool node's stream, bridged by `kvtier pool events`) and sends
a request to the server that holds the longest prefix of its prompt. This is that bookkeeping,
small and dependency-free, so an operator can see what a router would see and a test can check it:

    index = PrefixIndex()                       # llm-d's weights: GPU 1.0, CPU 0.8, ...
    index.apply("server-a", payload)            # one msgpack `KVEventBatch`, as published
    index.score("server-a", prompt_token_ids, block_size=16)
    index.best(prompt_token_ids, block_size=16) # ("server-a", 12.8)

Blocks are matched by their tokens and their parent: a `BlockStored` carries, per block, the
block's hash, its parent's hash and its tokens, so a prompt's block *i* is the stored block whose
parent is block *i - 1*'s hash and whose tokens are the prompt's. (A router that computes vLLM's
hashes itself can use `score_hashes`.) A block held in several tiers counts at its best tier's
weight, as llm-d scores it; the score of a prefix is the sum over its blocks, stopping at the first
block the server does not hold. A medium the weights do not name counts 0 and is reported by
`unknown_media`, unlike llm-d and Dynamo, which count an unknown medium as GPU.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import msgpack

# llm-d's defaults (pkg/kvcache/backend.go) for the two it names; kvtier's lower tiers below DRAM's.
DEFAULT_WEIGHTS: Mapping[str, float] = {"GPU": 1.0, "CPU": 0.8, "SHARED": 0.6, "STORAGE": 0.5}
GPU = "GPU"  # vLLM's own events name the GPU; an event with no medium is the GPU's too


@dataclass(slots=True)
class _Block:
    parent: Hashable | None
    tokens: tuple[int, ...]
    media: set[str] = field(default_factory=set)


class EventError(ValueError):
    """A payload that is not a KV event batch; the message says what was wrong."""


def decode_batch(payload: bytes) -> tuple[float, list[dict]]:
    """A msgpack `KVEventBatch` (`[ts, [event, ...], dp_rank]`, each event a map tagged `"type"`) as
    its timestamp and events. Raises `EventError` naming what does not fit."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types for bad bytes
        raise EventError(f"not a msgpack KV event batch: {e}") from None
    if not (isinstance(batch, list) and len(batch) >= 2 and isinstance(batch[1], list)):
        raise EventError(f"a KV event batch is [ts, events, dp_rank], got {type(batch).__name__}")
    for event in batch[1]:
        if not (isinstance(event, dict) and isinstance(event.get("type"), str)):
            raise EventError(f"an event is a map with a 'type', got {event!r:.80}")
    return batch[0], batch[1]


class PrefixIndex:
    """Per server, the blocks its events say it holds, and in which media.

    Args:
        weights: medium -> weight of a block held there (defaults: `DEFAULT_WEIGHTS`).
    """

    def __init__(self, weights: Mapping[str, float] = DEFAULT_WEIGHTS) -> None:
        self.weights = dict(weights)
        self._blocks: dict[str, dict[Hashable, _Block]] = defaultdict(dict)
        self._by_tokens: dict[str, dict[tuple[Hashable | None, tuple[int, ...]], Hashable]] = defaultdict(dict)
        self.unknown_media: Counter[str] = Counter()
        self.num_events: Counter[str] = Counter()

    def apply(self, server: str, payload: bytes) -> int:
        """Applies one published batch of `server`'s events; returns how many events it held."""
        _, events = decode_batch(payload)
        self.apply_events(server, events)
        return len(events)

    def apply_events(self, server: str, events: Iterable[Mapping]) -> None:
        """Applies decoded events (maps with vLLM's field names) in order."""
        for event in events:
            kind = event["type"]
            self.num_events[kind] += 1
            if kind == "BlockStored":
                self._stored(server, event)
            elif kind == "BlockRemoved":
                for h in event.get("block_hashes") or ():
                    self._removed(server, h, event.get("medium") or GPU)
            elif kind == "AllBlocksCleared":
                for h in [h for h, b in self._blocks[server].items() if GPU in b.media]:
                    self._removed(server, h, GPU)

    def _stored(self, server: str, event: Mapping) -> None:
        medium = event.get("medium") or GPU
        if medium not in self.weights:
            self.unknown_media[medium] += 1
        hashes, tokens = event.get("block_hashes") or [], event.get("token_ids") or []
        size = event.get("block_size") or 0
        parent = event.get("parent_block_hash")
        blocks = self._blocks[server]
        for i, h in enumerate(hashes):
            own = tuple(tokens[i * size:(i + 1) * size]) if size and len(tokens) == size * len(hashes) else ()
            block = blocks.get(h)
            if block is None:
                block = blocks[h] = _Block(parent, own)
            elif own and not block.tokens:  # an earlier event named it without its tokens
                block.parent, block.tokens = parent, own
            if own:
                self._by_tokens[server][(block.parent, block.tokens)] = h
            block.media.add(medium)
            parent = h

    def _removed(self, server: str, h: Hashable, medium: str) -> None:
        block = self._blocks[server].get(h)
        if block is None:
            return
        block.media.discard(medium)
        if not block.media:
            del self._blocks[server][h]
            if block.tokens:
                self._by_tokens[server].pop((block.parent, block.tokens), None)

    def media(self, server: str, h: Hashable) -> frozenset[str]:
        """Where `server` holds the block `h` (empty: nowhere)."""
        block = self._blocks[server].get(h)
        return frozenset(block.media) if block is not None else frozenset()

    def prefix_hashes(self, server: str, token_ids: Sequence[int], block_size: int) -> list[Hashable]:
        """The hashes of the longest prefix of `token_ids` (whole blocks) that `server` holds."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        found, parent = [], None
        by_tokens = self._by_tokens[server]
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            h = by_tokens.get((parent, tuple(token_ids[start:start + block_size])))
            if h is None:
                break
            found.append(h)
            parent = h
        return found

    def score_hashes(self, server: str, hashes: Iterable[Hashable]) -> float:
        """The sum over the longest held prefix of `hashes` of each block's best weight."""
        total = 0.0
        for h in hashes:
            block = self._blocks[server].get(h)
            if block is None:
                break
            total += max(self.weights.get(m, 0.0) for m in block.media)
        return total

    def score(self, server: str, token_ids: Sequence[int], block_size: int) -> float:
        """How much of the prompt `token_ids` `server` holds, weighted by where (see the module docstring)."""
        return self.score_hashes(server, self.prefix_hashes(server, token_ids, block_size))

    def best(self, token_ids: Sequence[int], block_size: int) -> tuple[str | None, float]:
        """The server with the highest score for the prompt, and the score (None, 0.0: no server holds any)."""
        scores = {s: self.score(s, token_ids, block_size) for s in self._blocks}
        server = max(scores, key=scores.get, default=None)
        return (server, scores[server]) if server is not None and scores[server] > 0 else (None, 0.0)
