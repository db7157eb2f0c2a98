"""Start-up of the vLLM connector: its settings and the engine it serves (backends: `vllm_backends`).

Everything here runs once, when vLLM builds the connector, so a wrong setting is a clear error at
start-up and never a surprise mid-request. `read_settings` is pure (tested without an engine);
`engine_facts` is the only function that reads vLLM's config objects.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import tempfile
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import xxhash

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError, GeometryError
from kvtier.model.geometry import KVDtype
from kvtier.integrations.vllm.pages import (
    CPU_BACKENDS,
    SCALE_BYTES,
    PageFormat,
    attention_variant,
    check_spec,
    inline_scales,
    page_format,
)
from kvtier.integrations.vllm.engine_config import ENV, EngineConfig, engine_config
from kvtier.integrations.vllm.overrides import config_overrides, overrides_id
from kvtier.integrations.vllm.shards import Sharding, rank_config
from kvtier.model.keys import BlockKey, Namespace
from kvtier.model.layout import BlockLayout
from kvtier.model.weights import WeightsSource, user_weights_id, weights_fingerprint

log = logging.getLogger(__name__)

EXTRA = "kv_connector_extra_config"
_KEYS = {"dram": f"a DRAM tier of this size, e.g. 8GiB ({ENV['dram']})",
         "ssd": f"an SSD tier, DIR:SIZE, e.g. /nvme/kv:200GiB ({ENV['ssd']})",
         "pool": f"pool nodes, HOST:PORT[,HOST:PORT...], SIZE@ in front for kvtier's share (default 16GiB) "
                 f"({ENV['pool']})",
         "kvtier_config": f"a kvtier YAML config for everything else ({ENV['kvtier_config']}); without any of "
                          "these, a DRAM tier sized from the memory available",
         "model_id": "what names the model in block keys (default: the engine's model and revision)",
         "weights_id": "names the weights in block keys (default: a fingerprint of the files the engine loads)",
         "load_timeout_s": "the longest a layer of a load may take before its blocks count as failed (default 30)",
         "lookup_timeout_s": "the longest the scheduler waits for a worker rank to answer a lookup (default 1)",
         "metrics_port": "serve kvtier's Prometheus metrics, every worker rank's, from the scheduler's process on "
                         "this port (0: any free port, logged; engine i of a data-parallel group: port + i)",
         "metrics_addr": "the address the metrics are served on (default 127.0.0.1)",
         "kv_events": "publish kvtier's DRAM, SSD and pool blocks as vLLM KV events (BlockStored/BlockRemoved) "
                      "where vLLM's --kv-events-config enables them (default true; false: only vLLM's own)"}


NULL_BLOCK_ID = 0  # vLLM's placeholder for a block a group does not keep (`BlockPool.null_block`)
_GROUP_TAG = b"kvtier.vllm.kv-group.v1"


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One of the engine's KV cache groups: layers of one attention kind that share block tables.

    vLLM's hybrid allocator gives each group its own blocks: a full-attention group keeps every
    block of a request; a sliding-window group keeps only those its window can still reach, the
    others being the null block. A kvtier block holds one engine block of one group (its layers in
    model order), under keys that name the group (`Settings.group_keys`).

    Attributes:
        index: the group's index in vLLM's `KVCacheConfig.kv_cache_groups`.
        layer_names: its attention layers, in model order.
        window_tokens: a sliding-window group's window; None for full attention.
        retained_tokens: tokens kept beyond the window (`SlidingWindowSpec.extra_retained_tokens`).
    """

    index: int
    layer_names: tuple[str, ...]
    window_tokens: int | None = None
    retained_tokens: int = 0

    def first_needed_block(self, num_tokens: int, block_tokens: int) -> int:
        """The first block the group needs to compute on from `num_tokens` tokens: 0 for full
        attention; for a sliding window, the first that holds a token the next one attends to
        (vLLM's `SlidingWindowManager.get_num_skipped_tokens`)."""
        if self.window_tokens is None:
            return 0
        return max(0, num_tokens - self.window_tokens + 1 - self.retained_tokens) // block_tokens


@functools.lru_cache(maxsize=64)
def _group_salt(group: KVGroup) -> bytes:
    """What a group's keys are mixed with (`Settings.group_keys`): its identity, hashed once per
    group, not on every lookup."""
    return _GROUP_TAG + xxhash.xxh3_128_digest(repr((group.index, group.window_tokens, group.retained_tokens,
                                                      group.layer_names)).encode())


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the connector must know about the engine, read once from vLLM's config.

    Attributes:
        model_id: names the model (goes into every block key).
        block_size: tokens per engine block.
        kv_dtype: the cache's exact element format: `fp32`, `bf16`, `fp16`, `fp8_e4m3`, ...
        layer_names: attention layers in model order (layer i of a kvtier block is layer_names[i]).
        page_bytes: bytes of one layer of one engine block (K and V together).
        device_type: vLLM's platform (`cpu`, `cuda`, ...); with `kv_cache_layout`, decides the page format.
        kv_role: `kv_both`, `kv_producer` (stores only) or `kv_consumer` (loads only).
        sharding: this rank's slice of each block (tensor parallelism).
        engine_tag: names this engine among others on the host (its lookup sockets).
        kv_cache_layout: vLLM's resolved `KVCacheLayout` name (None: not resolved; see `page_format`).
        weights: where the engine loads its weights from; a fingerprint of those files goes into
            every block key (None: unknown, as in tests of the settings alone). Files, not tensors:
            the scheduler's process has no weights, and both roles must compute the same keys.
        load_settings: how the engine turns those files into the model it runs (dtype,
            quantization): the same files loaded another way compute other KV, so they key it too.
        config_overrides: what of the model's config the engine changes without changing a file
            (`vllm_overrides.config_overrides`: `--hf-overrides`, ...), by name; () for none, and
            then the keys are those of an engine without overrides.
        data_parallel_rank: this engine's index in a data-parallel group (offsets its metrics port).
        mla: the cache holds MLA latents (`pages.MLA_FORMAT`), not K and V per head.
        attention: what of the attention changes the KV beyond the page format
            (`pages.attention_variant`: a sliding window, an attention chunk); goes into the keys.
        groups: the engine's KV cache groups (vLLM's hybrid allocator); () means one full-attention
            group of every layer.
        scale_bytes: bytes of quantization scales in one page (per-token-head quantized KV,
            `pages.inline_scales`); 0 where the page holds KV alone.
    """

    model_id: str
    block_size: int
    kv_dtype: str
    layer_names: tuple[str, ...]
    page_bytes: int
    device_type: str
    kv_role: str
    sharding: Sharding = Sharding()
    engine_tag: str = "engine"
    kv_cache_layout: str | None = None
    weights: WeightsSource | None = None
    load_settings: str = ""
    data_parallel_rank: int = 0
    mla: bool = False
    attention: str = ""
    groups: tuple[KVGroup, ...] = ()
    scale_bytes: int = 0
    config_overrides: tuple[tuple[str, str], ...] = ()
    kv_events: bool = False  # vLLM's kv_events_config enables KV cache events

    @property
    def element_dtype(self) -> str:
        """The dtype of the KV elements themselves (`int8` of `int8_per_token_head`)."""
        return self.kv_dtype.removesuffix("_per_token_head")


@dataclass(frozen=True, slots=True)
class Settings:
    """The connector's validated settings; both roles compute the same ones, but for their rank.

    `config` is this rank's share of the kvtier config (see `rank_config`) and `layout` its slice
    of a block; `namespace` keys engine-level blocks, `sharding.keys` this rank's slices of them.
    """

    config_path: Path | None  # the YAML read, None where the config came from short forms alone
    config: KVTierConfig
    layout: BlockLayout
    namespace: Namespace
    layer_index: Mapping[str, int]
    load_timeout_s: float
    can_load: bool
    can_store: bool
    sharding: Sharding = Sharding()
    lookup_timeout_s: float = 1.0
    engine_tag: str = "engine"
    page_format: PageFormat = PageFormat("vllm-cpu:h(kv)nd", "LBHNC", True, CPU_BACKENDS)
    metrics_port: int | None = None  # None: no metrics endpoint
    metrics_addr: str = "127.0.0.1"
    groups: tuple[KVGroup, ...] = ()  # () as in `EngineFacts`: one group of every layer
    config_source: str = ""  # where the config came from, for the start-up line (`EngineConfig.source`)
    layer_group: Mapping[str, int] = field(default_factory=dict)  # layer name -> group (absent: 0)
    kv_events: bool = False  # publish kvtier's blocks as vLLM KV events (`vllm_events`)

    @property
    def kv_groups(self) -> tuple[KVGroup, ...]:
        """The engine's KV cache groups (one full-attention group where the engine said none)."""
        return self.groups or (KVGroup(0, tuple(sorted(self.layer_index, key=self.layer_index.get))),)

    def group_keys(self, group: int, keys: Sequence[BlockKey]) -> tuple[BlockKey, ...]:
        """Group `group`'s keys for the engine-level `keys`: the keys themselves with one group, else
        each mixed with the group's identity (its index, window and layers), so two groups' blocks,
        or one group's under another grouping of the layers, never share a key."""
        if len(self.groups) <= 1:
            return tuple(keys)
        salt = _group_salt(self.groups[group])
        return tuple(BlockKey(xxhash.xxh3_128_digest(salt + key)) for key in keys)

    @property
    def block_tokens(self) -> int:
        return self.layout.block_tokens

    def backend_id(self, rank: int | None = None) -> Hashable:
        """Names a rank's backend (default: this one's) in `SHARED`: one per kvtier config and rank."""
        config = self.config_path if self.config_path is not None else self.config
        return config, self.sharding.rank if rank is None else rank, self.sharding.num_ranks

    def lookup_socket(self, rank: int) -> Path:
        """Where rank `rank`'s worker answers lookups (see `vllm_scheduler.LookupServer`).

        Named by a digest of the engine's tag, so the path stays within the ~100 bytes a Unix socket allows.
        """
        name = f"{xxhash.xxh64_hexdigest(self.engine_tag.encode())}-tp{rank}.sock"
        return Path(tempfile.gettempdir()) / f"kvtier-{os.getuid()}" / name


def read_settings(extra: Mapping[str, Any], facts: EngineFacts) -> Settings:
    """Validates the connector's extra config against the engine.

    Raises:
        ConfigError: a field is missing, unknown or wrong, or the engine does not match the kvtier
            config (model geometry, page format); the message names the field and the fix. The
            block size and KV dtype are the engine's (see `_check_engine`).
    """
    if not isinstance(extra, Mapping):
        raise ConfigError(f"{EXTRA}: expected a mapping, got {extra!r}")
    unknown = sorted(set(extra) - set(_KEYS))
    if unknown:
        raise ConfigError(f"{EXTRA}.{unknown[0]}: unknown field; expected "
                          + "; ".join(f"{k}: {v}" for k, v in _KEYS.items()))
    given = engine_config(extra, facts.model_id)
    config = given.config
    layout, page = _check_engine(given, facts)
    config = replace(config, block_tokens=facts.block_size, kv_dtype=_kv_dtype(facts.element_dtype, "kv_dtype").value)
    model_id = extra.get("model_id", facts.model_id)
    if not isinstance(model_id, str) or not model_id:
        raise ConfigError(f"{EXTRA}.model_id: expected a non-empty string, got {model_id!r}")
    timeouts = [_seconds(extra, name, default) for name, default in (("load_timeout_s", 30.0),
                                                                     ("lookup_timeout_s", 1.0))]
    weights = user_weights_id(extra.get("weights_id"), f"{EXTRA}.weights_id")
    weights = weights or (weights_fingerprint(facts.weights) if facts.weights else "")
    weights += f";{facts.load_settings}" if facts.load_settings else ""
    weights += _overrides(facts.config_overrides)
    attention = f";{facts.attention}" if facts.attention else ""
    namespace = Namespace(model_id, f"{facts.kv_dtype};{page.name}{attention}", facts.block_size, config.tenant,
                          weights)
    if facts.groups:  # a layer's index is within its group: layer i of a kvtier block of that group
        layer_index = {name: i for g in facts.groups for i, name in enumerate(g.layer_names)}
        layer_group = {name: g.index for g in facts.groups for name in g.layer_names}
    else:
        layer_index, layer_group = {name: i for i, name in enumerate(facts.layer_names)}, {}
    return Settings(given.path, rank_config(config, facts.sharding), layout, namespace, layer_index, timeouts[0],
                    can_load=facts.kv_role in ("kv_both", "kv_consumer"),
                    can_store=facts.kv_role in ("kv_both", "kv_producer"),
                    sharding=facts.sharding, lookup_timeout_s=timeouts[1], engine_tag=facts.engine_tag,
                    page_format=page, groups=facts.groups, layer_group=layer_group, config_source=given.source,
                    kv_events=facts.kv_events and _flag(extra, "kv_events", True),
                    **_metrics(extra, facts.data_parallel_rank))


def _flag(extra: Mapping[str, Any], name: str, default: bool) -> bool:
    value = extra.get(name, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{EXTRA}.{name}: expected true or false, got {value!r}")
    return value


def _overrides(overrides: tuple[tuple[str, str], ...]) -> str:
    """The namespace's part for the engine's config overrides ("" for none), said in one line."""
    if not overrides:
        return ""
    log.info("kvtier: block keys name this engine's model config overrides (%s): blocks of the same model "
             "without them, or with others, are misses", ", ".join(name for name, _ in overrides))
    return ";" + overrides_id(dict(overrides))


def _metrics(extra: Mapping[str, Any], data_parallel_rank: int) -> dict[str, Any]:
    port, addr = extra.get("metrics_port"), extra.get("metrics_addr", "127.0.0.1")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
        raise ConfigError(f"{EXTRA}.metrics_port: expected a port number 0-65535 (0: any free port), got {port!r}")
    if not isinstance(addr, str) or not addr:
        raise ConfigError(f"{EXTRA}.metrics_addr: expected an address to listen on, e.g. 127.0.0.1, got {addr!r}")
    if port is None:
        return {"metrics_addr": addr}
    return {"metrics_port": port + data_parallel_rank if port else 0, "metrics_addr": addr}


def _seconds(extra: Mapping[str, Any], name: str, default: float) -> float:
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(f"{EXTRA}.{name}: expected a positive number of seconds, got {value!r}")
    return float(value)


def _check_engine(given: EngineConfig, facts: EngineFacts) -> tuple[BlockLayout, PageFormat]:
    """The kvtier block layout, checked against the engine's KV cache, and the engine's page format.

    Block size and KV dtype follow the engine: a kvtier block is one engine block, in the format
    the engine caches, whatever the kvtier config says (a YAML that sets either is told so in one
    INFO line). The model is the engine's; a YAML that names one has its geometry checked against
    the engine's KV cache.
    """
    config, path = given.config, given.path
    page = page_format(facts.device_type, facts.kv_cache_layout, facts.mla, facts.scale_bytes > 0)
    engine_dtype = _kv_dtype(facts.element_dtype, "the engine's KV cache dtype")
    if "block_tokens" in given.set_in_yaml and config.block_tokens != facts.block_size:
        log.info("kvtier: blocks of %d tokens, the engine's block size (block_tokens: %d in %s does not apply "
                 "under vLLM)", facts.block_size, config.block_tokens, path)
    if "kv_dtype" in given.set_in_yaml and config.kv_dtype is not None \
            and _kv_dtype(config.kv_dtype, f"kv_dtype: {path}") is not engine_dtype:
        log.info("kvtier: KV cached as %s, the engine's KV cache dtype (kv_dtype: %s in %s does not apply "
                 "under vLLM)", engine_dtype.value, config.kv_dtype, path)
    if given.model_given:
        _check_model(config, path, facts, engine_dtype)
    # a kvtier block holds a whole page per layer (scales included) of one group's layers; groups of
    # fewer layers than the largest leave the rest of their blocks zero
    if facts.groups and sorted(n for g in facts.groups for n in g.layer_names) != sorted(facts.layer_names):
        raise ConfigError("kv_connector: the engine's KV cache groups do not cover its attention layers once each")
    per_block = max(len(g.layer_names) for g in facts.groups) if facts.groups else len(facts.layer_names)
    return BlockLayout(facts.block_size, (facts.page_bytes,) * per_block), page


def _check_model(config: KVTierConfig, path: Path | None, facts: EngineFacts, engine_dtype: KVDtype) -> None:
    """Refuses a YAML whose `model` does not describe the engine's KV cache (one line, naming both)."""
    from kvtier.model.catalog import resolve_model
    try:
        geometry = resolve_model(config.model, kv_dtype=engine_dtype)
    except GeometryError as e:
        raise ConfigError(f"model: {path}: {e}") from None
    whole = geometry.block_layout(facts.block_size)
    if whole.num_layers != len(facts.layer_names):
        raise ConfigError(f"model: {path} describes {whole.num_layers} KV layers ({config.model}) but the engine "
                          f"has {len(facts.layer_names)}; leave model out (the engine's is used) or point it at the served "
                          "model's config.json")
    shards = facts.sharding.num_shards
    kv_bytes = facts.page_bytes - facts.scale_bytes  # a page's KV elements, its scales aside
    wrong = [(i, n) for i, n in enumerate(whole.layer_bytes) if n != kv_bytes * shards]
    if wrong:
        split = f" (1/{shards} of it on each tensor-parallel rank)" if shards > 1 else ""
        scales = f" besides {facts.scale_bytes} bytes of scales" if facts.scale_bytes else ""
        raise ConfigError(f"model: {path}: layer {wrong[0][0]} of a kvtier block holds {wrong[0][1]} bytes{split} "
                          f"but an engine page holds {kv_bytes}{scales}; {config.model} is not the served "
                          "model's geometry (leave model out: the engine's is used)")


def _kv_dtype(name: str, what: str) -> KVDtype:
    try:
        return KVDtype.parse(name)
    except GeometryError as e:
        raise ConfigError(f"{what}: {e}") from None


def engine_facts(vllm_config: Any, kv_cache_config: Any) -> EngineFacts:
    """Reads what the connector needs from vLLM's `VllmConfig` and `KVCacheConfig`.

    Every KV cache group is held: full attention, sliding windows (each group's blocks under its own
    keys, `KVGroup`) and MLA, as long as the groups share one block size and one page size (vLLM's
    hybrid allocator makes them so) and one page format.

    Raises:
        ConfigError: a model kvtier cannot hold yet (non-attention layers such as Mamba's recurrent
            state, non-causal layers, packed quantized KV, groups of different block or page
            sizes) or a parallelism it cannot (pipeline or context parallel).
    """
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowSpec

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if not groups:
        raise ConfigError("kv_connector: the engine has no KV cache groups; kvtier holds attention KV")
    specs = [g.kv_cache_spec for g in groups]
    for group, spec in zip(groups, specs):
        try:
            check_spec(spec)
        except ConfigError as e:
            raise ConfigError(f"{e} (KV cache group of {', '.join(list(group.layer_names)[:3])}"
                              f"{', ...' if len(group.layer_names) > 3 else ''})") from None
    spec = specs[0]
    page_bytes = {int(getattr(s, "real_page_size_bytes", s.page_size_bytes)) for s in specs}
    facets = {"block_size": {s.block_size for s in specs}, "page size": page_bytes,
              "dtype": {str(s.dtype) for s in specs}, "MLA": {isinstance(s, MLAAttentionSpec) for s in specs}}
    mixed = [name for name, values in facets.items() if len(values) > 1]
    if mixed:
        raise ConfigError(f"kv_connector: this model's KV cache groups differ in {mixed[0]} "
                          f"({sorted(map(str, facets[mixed[0]]))}), which kvtier does not support yet")
    if len(groups) > 1 or isinstance(spec, SlidingWindowSpec):
        kv_groups = tuple(KVGroup(i, tuple(sorted(g.layer_names, key=extract_layer_index)),
                                  s.sliding_window if isinstance(s, SlidingWindowSpec) else None,
                                  int(getattr(s, "extra_retained_tokens", 0) or 0))
                          for i, (g, s) in enumerate(zip(groups, specs)))
    else:
        kv_groups = ()
    # one group: its attention variant keys its blocks; several: each group's keys name its window
    attention = attention_variant(spec) if len(groups) == 1 else ""
    layer_names = tuple(sorted((n for g in groups for n in g.layer_names), key=extract_layer_index))
    cache_dtype = vllm_config.cache_config.cache_dtype
    kv_dtype = str(spec.dtype).removeprefix("torch.") if cache_dtype == "auto" else str(cache_dtype)
    model = vllm_config.model_config
    model_id = str(model.model) + (f"@{model.revision}" if getattr(model, "revision", None) else "")
    transfer = vllm_config.kv_transfer_config
    parallel = vllm_config.parallel_config
    return EngineFacts(model_id=model_id, block_size=int(spec.block_size),
                       kv_dtype=kv_dtype, layer_names=layer_names,
                       page_bytes=page_bytes.pop(),
                       device_type=str(current_platform.device_type),
                       kv_role=str(transfer.kv_role),
                       sharding=_sharding(vllm_config),
                       engine_tag=f"{transfer.engine_id}-dp{parallel.data_parallel_rank}",
                       kv_cache_layout=getattr(kv_cache_config, "kv_cache_layout", None)
                       or vllm_config.cache_config.kv_cache_layout,
                       weights=WeightsSource(getattr(model, "model_weights", "") or str(model.model), model.revision,
                                             vllm_config.load_config.download_dir),
                       load_settings=f"dtype={model.dtype};quantization={model.quantization}",
                       data_parallel_rank=int(parallel.data_parallel_rank or 0),
                       mla=isinstance(spec, MLAAttentionSpec), attention=attention, groups=kv_groups,
                       scale_bytes=spec.num_kv_heads * spec.block_size * SCALE_BYTES if inline_scales(spec) else 0,
                       config_overrides=tuple(config_overrides(model, vllm_config.cache_config).items()),
                       kv_events=_kv_events_enabled(vllm_config))


def _kv_events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV cache events (`--kv-events-config`), as its offloading connector reads it."""
    events = getattr(vllm_config, "kv_events_config", None)
    return events is not None and bool(events.enable_kv_cache_events)


def _sharding(vllm_config: Any) -> Sharding:
    """This process's tensor-parallel rank and how vLLM splits KV heads over the ranks.

    A worker reads its rank from vLLM's tensor-parallel group (or, where none is initialized, as
    in a test, from `parallel_config.rank`); the scheduler is rank 0.
    """
    from vllm.distributed import parallel_state

    parallel = vllm_config.parallel_config
    for name in ("pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel, name, 1) != 1:
            raise ConfigError(f"{name}: kvtier stores a block's KV for every layer and token of one tensor-parallel "
                              f"rank; {name}={getattr(parallel, name)} splits layers or tokens across ranks, which "
                              f"is not supported yet (set {name}=1; tensor_parallel_size may be any)")
    num_ranks = int(parallel.tensor_parallel_size)
    if num_ranks == 1:
        return Sharding()
    if parallel_state.model_parallel_is_initialized():
        rank = parallel_state.get_tensor_model_parallel_rank()
    else:
        rank = int(parallel.rank) % num_ranks
    model = vllm_config.model_config
    # vLLM gives each rank total/tp heads, or, with fewer heads than ranks, one head replicated on
    # tp/total ranks; MLA's latent is the same on every rank.
    num_shards = 1 if model.use_mla else min(num_ranks, int(model.get_total_num_kv_heads()))
    return Sharding(rank, num_ranks, num_shards)
