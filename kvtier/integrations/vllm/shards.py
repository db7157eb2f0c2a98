"""Tensor parallelism for the vLLM connector: which slice of every block a worker rank holds, under
which keys, and its share of the kvtier config."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace

import xxhash

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.model.keys import BlockKey
from kvtier.kinds import TierKind

_SHARD_TAG = b"kvtier.vllm.tp-shard.v1"


@dataclass(frozen=True, slots=True)
class Sharding:
    """Which slice of every block one worker rank holds, under tensor parallelism.

    vLLM splits each layer's KV heads over the `num_ranks` ranks of an engine, so a rank's page
    holds only its heads, and each rank stores and loads only that slice, under keys of its own:
    the engine-level key (what the scheduler computes) mixed with the slice's index. Ranks whose
    slices hold the same bytes share keys: every rank when KV is replicated (MLA's latent, or a
    single KV head), or the `num_ranks // num_shards` ranks that vLLM gives the same heads when
    there are fewer KV heads than ranks. With one slice the keys are the engine's own, so an
    engine without TP (or with replicated KV) shares blocks with any other such engine, and never
    with an engine whose pages hold a different slice of the heads.

    Attributes:
        rank: this worker's tensor-parallel rank (0 on the scheduler side).
        num_ranks: tensor_parallel_size.
        num_shards: distinct slices of a block's KV (divides num_ranks).
    """

    rank: int = 0
    num_ranks: int = 1
    num_shards: int = 1

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.num_ranks and 0 < self.num_shards <= self.num_ranks
                and self.num_ranks % self.num_shards == 0):
            raise ConfigError(f"tensor_parallel_size: rank {self.rank} of {self.num_ranks} ranks cannot hold one of "
                              f"{self.num_shards} KV slices; KV heads must divide evenly over the ranks")

    @property
    def shard(self) -> int:
        """The slice this rank holds."""
        return self.rank // (self.num_ranks // self.num_shards)

    @property
    def writes_shared(self) -> bool:
        """Whether this rank is the first of those holding its slice: the one that writes the
        slice where all of them read it (the pool)."""
        return self.rank % (self.num_ranks // self.num_shards) == 0

    def for_rank(self, rank: int) -> Sharding:
        return Sharding(rank, self.num_ranks, self.num_shards)

    def keys(self, keys: Sequence[BlockKey]) -> tuple[BlockKey, ...]:
        """This rank's keys for the engine-level `keys` (the same keys with one slice)."""
        if self.num_shards == 1:
            return tuple(keys)
        salt = _SHARD_TAG + struct.pack("<II", self.shard, self.num_shards)
        return tuple(BlockKey(xxhash.xxh3_128_digest(salt + key)) for key in keys)


def rank_config(config: KVTierConfig, sharding: Sharding) -> KVTierConfig:
    """One rank's share of `config`: capacities are per engine, split evenly over its ranks.

    So a kvtier config sized for a model (`kvtier size`) holds as many tokens under any
    tensor_parallel_size (each rank's slice of a block being 1/tp of it; with replicated KV every
    rank holds whole blocks, so the engine holds 1/tp as many tokens). Each rank's SSD tier lives in
    its own `rank<r>-of-<tp>` directory under `path` (its slab files, and with `persist`, its
    journal and lock), so ranks, and engines of different tensor_parallel_size, never share files.
    With one rank the config is unchanged.
    """
    if sharding.num_ranks == 1:
        return config
    n, rank = sharding.num_ranks, sharding.rank

    def share(tier):
        path = tier.path / f"rank{rank}-of-{n}" if tier.kind is TierKind.SSD else tier.path
        return replace(tier, capacity_bytes=tier.capacity_bytes // n, path=path)

    return replace(config, tiers=tuple(share(t) for t in config.tiers),
                   prefetch=replace(config.prefetch, budget_bytes=config.prefetch.budget_bytes // n))
