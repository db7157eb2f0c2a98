"""Start-up of the vLLM connector: its settings, the engine it serves, and the backends it shares.

Everything here runs once, when vLLM builds the connector, so a wrong setting is a clear error at
start-up and never a surprise mid-request. `read_settings` is pure (tested without an engine);
`engine_facts` is the only function that reads vLLM's config objects.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import tempfile
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch
import xxhash

from kvtier.config import KVTierConfig, load_config
from kvtier.errors import ConfigError, GeometryError
from kvtier.geometry import KVDtype
from kvtier.handle import TransferHandle
from kvtier.integrations.vllm_pages import (
    CPU_BACKENDS,
    PageFormat,
    check_spec,
    page_format,
)
from kvtier.integrations.vllm_shards import Sharding, rank_config
from kvtier.keys import BlockKey, Namespace
from kvtier.layout import BlockLayout
from kvtier.tiers.kinds import TierKind
from kvtier.weights import WeightsSource, user_weights_id, weights_fingerprint

log = logging.getLogger(__name__)

EXTRA = "kv_connector_extra_config"
_KEYS = {"kvtier_config": "the path of a kvtier YAML config (required)",
         "model_id": "what names the model in block keys (default: the engine's model and revision)",
         "weights_id": "names the weights in block keys (default: a fingerprint of the files the engine loads)",
         "load_timeout_s": "the longest a layer of a load may take before its blocks count as failed (default 30)",
         "lookup_timeout_s": "the longest the scheduler waits for a worker rank to answer a lookup (default 1)"}
class Backend(Protocol):
    """What the connector needs from kvtier: blocks by key, layer-major (see `kvtier.layout`).

    `KVTier` is one (a process-local runtime over HBM/DRAM/SSD). `vllm_pool.PoolBackend` is the
    other (lookups, loads and stores by key against `kvtier pool serve` nodes, which every process
    and server can see, with the local tiers in front): `open_backend` picks it when the kvtier
    config has a `pool` tier; nothing else changes.

    Contract:
        lookup(keys) -> the number of leading keys stored and ready; never raises on a miss.
        loadable(keys) -> as lookup, less the blocks slower to load than to recompute (what the
            scheduler reports to vLLM; `KVTier.loadable`).
        load(keys, into) -> a handle; `wait_layer(l)` returns once layer l of every block is in
            `into` (a `[len(keys), block_bytes]` uint8 tensor) or failed; failed blocks are in
            `handle.failed` and their bytes are garbage.
        store(keys, blocks, background=True) -> a handle; the caller keeps `blocks` unchanged until
            it is done. `background`: off the caller's thread, at low priority (the connector's stores).
        note_compute(num_tokens, seconds) -> the engine's measured compute time of one forward pass.
        close() -> waits for transfers in flight and releases everything.
    Any of them may raise when the backend is broken or unreachable: the connector turns that into
    misses (lookup), failed loads (load) or dropped stores (store).
    """

    layout: BlockLayout

    def lookup(self, keys: Sequence[BlockKey]) -> int: ...

    def loadable(self, keys: Sequence[BlockKey]) -> int: ...

    def load(self, keys: Sequence[BlockKey], into: torch.Tensor) -> TransferHandle: ...

    def store(self, keys: Sequence[BlockKey], blocks: torch.Tensor, *, background: bool = False) -> TransferHandle: ...

    def note_compute(self, num_tokens: int, seconds: float) -> None: ...

    def close(self) -> None: ...


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
        load_failure_policy: vLLM's `kv_load_failure_policy`.
        kv_role: `kv_both`, `kv_producer` (stores only) or `kv_consumer` (loads only).
        sharding: this rank's slice of each block (tensor parallelism).
        engine_tag: names this engine among others on the host (its lookup sockets).
        kv_cache_layout: vLLM's resolved `KVCacheLayout` name (None: not resolved; see `page_format`).
        weights: where the engine loads its weights from; a fingerprint of those files goes into
            every block key (None: unknown, as in tests of the settings alone). Files, not tensors:
            the scheduler's process has no weights, and both roles must compute the same keys.
        load_settings: how the engine turns those files into the model it runs (dtype,
            quantization): the same files loaded another way compute other KV, so they key it too.
    """

    model_id: str
    block_size: int
    kv_dtype: str
    layer_names: tuple[str, ...]
    page_bytes: int
    device_type: str
    load_failure_policy: str
    kv_role: str
    sharding: Sharding = Sharding()
    engine_tag: str = "engine"
    kv_cache_layout: str | None = None
    weights: WeightsSource | None = None
    load_settings: str = ""


@dataclass(frozen=True, slots=True)
class Settings:
    """The connector's validated settings; both roles compute the same ones, but for their rank.

    `config` is this rank's share of the kvtier config (see `rank_config`) and `layout` its slice
    of a block; `namespace` keys engine-level blocks, `sharding.keys` this rank's slices of them.
    """

    config_path: Path
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

    @property
    def block_tokens(self) -> int:
        return self.layout.block_tokens

    def backend_id(self, rank: int | None = None) -> Hashable:
        """Names a rank's backend (default: this one's) in `SHARED`: one per kvtier config and rank."""
        return self.config_path, self.sharding.rank if rank is None else rank, self.sharding.num_ranks

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
            config (block size, KV dtype, model geometry, page format, failure policy); the message
            names the field and the fix.
    """
    if not isinstance(extra, Mapping):
        raise ConfigError(f"{EXTRA}: expected a mapping, got {extra!r}")
    unknown = sorted(set(extra) - set(_KEYS))
    if unknown:
        raise ConfigError(f"{EXTRA}.{unknown[0]}: unknown field; expected "
                          + "; ".join(f"{k}: {v}" for k, v in _KEYS.items()))
    path = extra.get("kvtier_config")
    if not isinstance(path, (str, Path)) or not str(path).strip():
        raise ConfigError(f"{EXTRA}.kvtier_config: missing; expected {_KEYS['kvtier_config']}, got {path!r}")
    config_path = Path(path).expanduser().resolve()
    config = load_config(config_path)
    layout, page = _check_engine(config, config_path, facts)
    model_id = extra.get("model_id", facts.model_id)
    if not isinstance(model_id, str) or not model_id:
        raise ConfigError(f"{EXTRA}.model_id: expected a non-empty string, got {model_id!r}")
    timeouts = [_seconds(extra, name, default) for name, default in (("load_timeout_s", 30.0),
                                                                     ("lookup_timeout_s", 1.0))]
    weights = user_weights_id(extra.get("weights_id"), f"{EXTRA}.weights_id")
    weights = weights or (weights_fingerprint(facts.weights) if facts.weights else "")
    weights += f";{facts.load_settings}" if facts.load_settings else ""
    namespace = Namespace(model_id, f"{facts.kv_dtype};{page.name}", facts.block_size, config.tenant, weights)
    return Settings(config_path, rank_config(config, facts.sharding), layout, namespace,
                    {name: i for i, name in enumerate(facts.layer_names)}, timeouts[0],
                    can_load=facts.kv_role in ("kv_both", "kv_consumer"),
                    can_store=facts.kv_role in ("kv_both", "kv_producer"),
                    sharding=facts.sharding, lookup_timeout_s=timeouts[1], engine_tag=facts.engine_tag,
                    page_format=page)


def _seconds(extra: Mapping[str, Any], name: str, default: float) -> float:
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(f"{EXTRA}.{name}: expected a positive number of seconds, got {value!r}")
    return float(value)


def _check_engine(config: KVTierConfig, path: Path, facts: EngineFacts) -> tuple[BlockLayout, PageFormat]:
    """The kvtier block layout, checked against the engine's KV cache, and the engine's page format."""
    page = page_format(facts.device_type, facts.kv_cache_layout)
    if facts.load_failure_policy != "recompute":
        raise ConfigError(f"kv_load_failure_policy: kvtier is a cache, a block it cannot deliver must be recomputed; "
                          f"set kv_load_failure_policy='recompute' (got {facts.load_failure_policy!r})")
    if config.block_tokens != facts.block_size:
        raise ConfigError(f"block_tokens: {path} has block_tokens={config.block_tokens} but the engine's block_size "
                          f"is {facts.block_size}; they must be equal (set block_tokens: {facts.block_size} "
                          f"or --block-size {config.block_tokens})")
    engine_dtype = _kv_dtype(facts.kv_dtype, "the engine's KV cache dtype")
    from kvtier.catalog import resolve_model
    try:
        geometry = resolve_model(config.model, kv_dtype=config.kv_dtype)
    except GeometryError as e:
        raise ConfigError(f"model: {path}: {e}") from None
    if geometry.kv_dtype is not engine_dtype:
        raise ConfigError(f"kv_dtype: {path} gives {geometry.kv_dtype.value} but the engine caches KV as "
                          f"{facts.kv_dtype}; set kv_dtype: {engine_dtype.value}")
    whole = geometry.block_layout(config.block_tokens)
    if whole.num_layers != len(facts.layer_names):
        raise ConfigError(f"model: {path} describes {whole.num_layers} KV layers ({config.model}) but the engine "
                          f"has {len(facts.layer_names)}; point model at the served model's config.json")
    shards = facts.sharding.num_shards
    wrong = [(i, n) for i, n in enumerate(whole.layer_bytes) if n != facts.page_bytes * shards]
    if wrong:
        split = f" (1/{shards} of it on each tensor-parallel rank)" if shards > 1 else ""
        raise ConfigError(f"model: {path}: layer {wrong[0][0]} of a kvtier block holds {wrong[0][1]} bytes{split} "
                          f"but an engine page holds {facts.page_bytes}; {config.model} is not the served "
                          "model's geometry")
    return BlockLayout(whole.block_tokens, tuple(n // shards for n in whole.layer_bytes)), page


def _kv_dtype(name: str, what: str) -> KVDtype:
    try:
        return KVDtype.parse(name)
    except GeometryError as e:
        raise ConfigError(f"{what}: {e}") from None


def engine_facts(vllm_config: Any, kv_cache_config: Any) -> EngineFacts:
    """Reads what the connector needs from vLLM's `VllmConfig` and `KVCacheConfig`.

    Raises:
        ConfigError: a model kvtier cannot hold yet (several KV cache groups, sliding-window, chunked,
            non-causal, MLA or non-attention layers, packed quantized KV) or a
            parallelism it cannot (pipeline or context parallel).
    """
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.platforms import current_platform

    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups or len(groups) != 1:
        raise ConfigError(f"kv_connector: kvtier holds models with one KV cache group; this one has "
                          f"{len(groups or ())} (hybrid or sliding-window models are not supported yet)")
    spec = groups[0].kv_cache_spec
    check_spec(spec)
    cache_dtype = vllm_config.cache_config.cache_dtype
    kv_dtype = str(spec.dtype).removeprefix("torch.") if cache_dtype == "auto" else str(cache_dtype)
    model = vllm_config.model_config
    model_id = str(model.model) + (f"@{model.revision}" if getattr(model, "revision", None) else "")
    transfer = vllm_config.kv_transfer_config
    parallel = vllm_config.parallel_config
    return EngineFacts(model_id=model_id, block_size=int(vllm_config.cache_config.block_size),
                       kv_dtype=kv_dtype, layer_names=tuple(sorted(groups[0].layer_names, key=extract_layer_index)),
                       page_bytes=int(getattr(spec, "real_page_size_bytes", spec.page_size_bytes)),
                       device_type=str(current_platform.device_type),
                       load_failure_policy=str(transfer.kv_load_failure_policy), kv_role=str(transfer.kv_role),
                       sharding=_sharding(vllm_config),
                       engine_tag=f"{transfer.engine_id}-dp{parallel.data_parallel_rank}",
                       kv_cache_layout=getattr(kv_cache_config, "kv_cache_layout", None)
                       or vllm_config.cache_config.kv_cache_layout,
                       weights=WeightsSource(getattr(model, "model_weights", "") or str(model.model), model.revision,
                                             vllm_config.load_config.download_dir),
                       load_settings=f"dtype={model.dtype};quantization={model.quantization}")


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


def open_backend(settings: Settings) -> Backend:
    """The backend the kvtier config asks for.

    Without a `pool` tier: an in-process `KVTier` over its tiers. With one: a `PoolBackend`
    (`vllm_pool`) that keeps blocks on the pool nodes under their block keys, so that every
    engine reaching those nodes, in any process, sees them; the config's other tiers stay in front
    as a local `KVTier`. (The pool tier's `capacity` then does not apply: the nodes' own capacity
    and the tenant's quota bound what the pool holds.)

    Raises:
        KVTierError: a tier cannot be built (e.g. an SSD directory that cannot be created).
        ConfigError: the pool tier's secret cannot be read.
    """
    from kvtier.runtime import KVTier

    config = settings.config
    pool = config.tier(TierKind.POOL)
    if pool is None:
        return KVTier(config, layout=settings.layout)
    from kvtier.integrations.vllm_pool import PoolBackend
    from kvtier.pool.client import PoolClient
    from kvtier.pool.tenants import read_secret

    secret = read_secret(pool.secret, str(pool.secret_file) if pool.secret_file else None, "tiers.pool")
    client = PoolClient(pool.nodes, tenant=pool.tenant, secret=secret, timeout_s=pool.timeout_s,
                        reconnect_s=pool.reconnect_s)
    others = tuple(t for t in config.tiers if t.kind is not TierKind.POOL)
    try:
        local = KVTier(_without_pool(config, others), layout=settings.layout) if others else None
    except BaseException:
        client.close()
        raise
    return PoolBackend(client, settings.layout, local, write_pool=settings.sharding.writes_shared)


def _without_pool(config: KVTierConfig, tiers: tuple) -> KVTierConfig:
    """`config` over `tiers` only: loads no longer promote into the pool, prefetches go to the top tier."""
    promote_to = None if config.promote_to is TierKind.POOL else config.promote_to
    prefetch = config.prefetch
    if prefetch.target is TierKind.POOL:
        prefetch = replace(prefetch, target=tiers[0].kind)
    return replace(config, tiers=tiers, promote_to=promote_to, prefetch=prefetch)


class SharedBackends:
    """Backends by id (`Settings.backend_id`: kvtier config path and rank), shared within a process.

    vLLM builds two connectors per engine, one per role. The worker's owns its rank's backend (it
    opens and closes it); the scheduler's looks it up here to answer `lookup` exactly, which works
    whenever both live in one process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, or the engine-core
    process of the default mode with the uni-process executor). Where a worker runs in another
    process (any tensor-parallel engine) the scheduler asks it over its lookup socket instead
    (see `vllm_scheduler.KeyDirectory`). Engines of one process with the same config and rank
    share one backend.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Hashable, list] = {}  # id -> [backend, number of owners]

    def acquire(self, backend_id: Hashable, open_fn: Callable[[], Backend]) -> Backend:
        with self._lock:
            entry = self._entries.get(backend_id)
            if entry is None:
                entry = self._entries[backend_id] = [open_fn(), 0]
            entry[1] += 1
            return entry[0]

    def get(self, backend_id: Hashable) -> Backend | None:
        with self._lock:
            entry = self._entries.get(backend_id)
            return entry[0] if entry else None

    def backends(self) -> list[Backend]:
        with self._lock:
            return [entry[0] for entry in self._entries.values()]

    def release(self, backend_id: Hashable) -> None:
        """Drops one owner; the last one closes the backend."""
        with self._lock:
            entry = self._entries.get(backend_id)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._entries[backend_id]
        entry[0].close()

    def close_all(self) -> None:
        """Closes every backend still open (run at interpreter exit).

        vLLM shuts its connectors down only on some paths (not when a single-process `LLM` is
        simply dropped at exit); closing here still waits for stores in flight and, for a
        persistent SSD tier, flushes its journal and releases its lock for the next process.
        """
        with self._lock:
            backends = [entry[0] for entry in self._entries.values()]
            self._entries.clear()
        for backend in backends:
            try:
                backend.close()
            except Exception as e:  # at exit: say so, and close the others
                log.warning("kvtier backend failed to close at exit: %r", e)


SHARED = SharedBackends()
"""The process's backends (one registry per process, by design: see `SharedBackends`)."""
atexit.register(SHARED.close_all)
