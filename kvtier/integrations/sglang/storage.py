"""SGLang HiCache storage backend (its L3, below SGLang's own host-memory L2), backed by kvtier.

SGLang 0.5.23 loads it with `--hicache-storage-backend dynamic`: its `StorageBackendFactory` reads
`backend_name`, `module_path` and `class_name` from the extra config, imports the module, checks
that the class subclasses `HiCacheStorage` and calls `KVTierHiCacheStorage(storage_config, {})`.
Every other key of the extra config reaches this class in `storage_config.extra_config`:

    python -m sglang.launch_server --model-path MODEL --page-size 64 \\
        --enable-hierarchical-cache --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
            "module_path": "kvtier.integrations.sglang.storage", "class_name": "KVTierHiCacheStorage",
            "interface_v1": 1, "kvtier_config": "/etc/kvtier/sglang.yaml"}'

`interface_v1: 1` makes SGLang call `batch_get_v1`/`batch_set_v1` with host-pool indices (one
allocation per batch here); without it SGLang allocates a page per key and calls `batch_get`/
`batch_set`. Both work. Keys of our own (`sglang_options`): `kvtier_config` (required: a kvtier
YAML file), `kvtier_timeout_s` (default 30: how long one batch may wait before its pages count as
misses) and `kvtier_weights_id` (names the weights; default: a fingerprint of the weight files).
The YAML's tiers are *per SGLang rank process*; a GPU tier would take memory SGLang budgeted for
itself, so `tiers.hbm` is refused unless `device: cpu`. For example:

    model: my-model            # the namespace's model when SGLang does not name one
    tiers:
      dram: {capacity: 16GiB}
      ssd:  {capacity: 200GiB, path: /nvme/kvtier}

Why the page geometry comes from SGLang, not from `model`: an SGLang page is what one rank holds
(its share of KV heads, in the host pool's layout), so the block layout is built when SGLang
registers its host pool: one block is one page, stored as opaque bytes (one "layer": the page's
byte order is SGLang's, not layer-major). A page of any other byte size is a miss with a counted
error, never a crash. Keys (`page_keys`): `xxh3_128(namespace ‖ epoch [‖ extras] ‖ SGLang page
hash)`. SGLang's page hash chains the tokens, its `extra_key` (with the LoRA `lora_id`) and the
`cache_salt`; the namespace covers the served model, a fingerprint of its weights (`kvtier.model.weights`),
the server's settings (`options.served_settings`: overrides, dtypes, quantization, the files of
its `--lora-paths` adapters, weight version), the page dtype and size, the host layout, the tenant
and the rank's shard (TP rank unless MLA, PP and CP); the extras, a weight version that moved and
the call's `extra_info`. What SGLang does not pass, kvtier cannot key: see README.md (SGLang).

Sharing: with a pool tier, pages go to the pool under these keys, so every SGLang process of the
tenant serving the same model and shard finds the pages any other backed up (`KVTier`'s shared pool
tier). Without one, pages live in this process's kvtier (DRAM, SSD files) and outlive it only on a
persistent SSD tier (`persist: true`; never across changed weights, which change the keys).

Limitations: MLA with TP > 1 is refused: SGLang
writes replicated MLA pages from one rank only and takes the minimum hit count over ranks. Sidecar
pools of hybrid models (`*_v2` calls: Mamba, SWA, indexer) are not stored: they report misses, so
those models recompute. `clear()` starts a new key epoch: old pages are unreachable at once and
their slots are reclaimed by eviction.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvtier.errors import ConfigError, KVTierError
from kvtier.integrations.hints import HintReader
from kvtier.integrations.sglang.options import (
    Options,
    log_key_change,
    page_namespace,
    served_settings,
    weight_version_reader,
)
from kvtier.integrations.sglang.page_keys import PageKeys, UnkeyableCall
from kvtier.model.keys import BlockKey
from kvtier.model.layout import BlockLayout
from kvtier.runtime import KVTier
from kvtier.tiers.dram import host_rows

try:
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        PoolName,
        PoolTransferResult,
    )
except ImportError as e:  # this module is only ever imported by SGLang itself, or by its tests
    raise ImportError(f"kvtier.integrations.sglang.storage needs SGLang (pip install sglang): {e}") from e

log = logging.getLogger(__name__)

class Errors:
    """Why a page was refused (labels of `KVTierHiCacheStorage.errors`)."""

    PAGE_SIZE = "page_size_mismatch"
    NOT_ATTACHED = "not_attached"  # before register_mem_pool_host, or after close
    TIMEOUT = "timeout"
    RUNTIME = "runtime_error"
    BAD_INDICES = "host_indices_mismatch"
    SIDECAR = "sidecar_pool_unsupported"
    UNKEYABLE = "unkeyable_extra_info"  # an identity kvtier cannot encode: misses, never stored


class KVTierHiCacheStorage(HiCacheStorage):
    """SGLang's `HiCacheStorage` over a `KVTier`: a miss is None/False, never an exception or wrong bytes.

    Args:
        storage_config: SGLang's `HiCacheStorageConfig` (ranks, model name, extra config).
        backend_kwargs: what SGLang's dynamic loader passes besides (always `{}` in 0.5.23).
        runtime: an already-built runtime to use (tests, embedding); then `kvtier_config` is
            optional and the caller closes the runtime. Its block size must equal a page's bytes.
    Raises:
        ConfigError: a missing or invalid extra-config key or YAML file, or MLA with TP > 1.
    """

    def __init__(self, storage_config: Any, backend_kwargs: Mapping[str, Any] | None = None, *,
                 runtime: KVTier | None = None) -> None:
        if storage_config.is_mla_model and storage_config.tp_size > 1:
            raise ConfigError(f"kvtier keeps pages per process, but SGLang writes replicated MLA pages from "
                              f"one of {storage_config.tp_size} TP ranks only: the others would never hit; "
                              f"run MLA models with TP 1 or another storage backend")
        self.storage_config = storage_config
        self.options = Options.parse(storage_config.extra_config, need_config=runtime is None)
        if runtime is not None and self.options.config is not None:
            raise ConfigError("extra_config.kvtier_config: given together with a runtime; give one of them")
        self.runtime = runtime
        self._owns_runtime = runtime is None
        self._host: Any = None
        self._page_keys: PageKeys | None = None  # set with the host pool; replaced by clear()
        self._lock = threading.Lock()
        self.errors: Counter = Counter()
        self.hints: HintReader | None = None  # made with the runtime's `hints.max_retain_s` at the first hint
        self._metrics: dict[str, list] = {"prefetch_pgs": [], "backup_pgs": [],
                                          "prefetch_bandwidth": [], "backup_bandwidth": []}

    # ---- attach: SGLang registers its host pool right after construction ---------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Builds the runtime for this host pool's page geometry.

        Raises:
            ConfigError: an injected runtime's block size differs from the host pool's page bytes.
            CapacityError, TierIOError: a configured tier cannot be built (as `KVTier`).
        """
        super().register_mem_pool_host(mem_pool_host)
        page_bytes = _nbytes(mem_pool_host.get_dummy_flat_data_page())
        page_tokens = int(mem_pool_host.page_size)
        if self.runtime is None:
            layout = BlockLayout(page_tokens, (page_bytes,))
            self.runtime = KVTier(self.options.config, layout=layout)
        elif self.runtime.layout.block_bytes != page_bytes:
            raise ConfigError(f"kvtier block_bytes {self.runtime.layout.block_bytes} != SGLang page of "
                              f"{page_bytes} bytes ({page_tokens} tokens, {mem_pool_host.dtype}, "
                              f"layout {getattr(mem_pool_host, 'layout', '?')})")
        dtype = str(mem_pool_host.dtype).removeprefix("torch.")
        settings = served_settings()
        namespace = page_namespace(self.storage_config, self.options, self.runtime.config, dtype, page_tokens,
                                   getattr(mem_pool_host, "layout", ""), settings)
        version = weight_version_reader() if settings is not None else None
        with self._lock:
            self._host = mem_pool_host
            self._page_keys = PageKeys(namespace.digest, 0, version, version() if version else None)
        if settings is not None:
            log_key_change(self.runtime.config)
        log.info("kvtier HiCache storage: %d-byte pages of %d tokens (%s, %s), tiers %s", page_bytes,
                 page_tokens, dtype, getattr(mem_pool_host, "layout", "?"), list(self.runtime.usage()))

    def block_key(self, key: str) -> BlockKey:
        """The kvtier key of an SGLang page hash in the current epoch, for a call without extra info.

        Raises:
            KVTierError: no host pool is registered yet.
        """
        page_keys = self._page_keys
        if page_keys is None:
            raise KVTierError("no SGLang host pool registered: call register_mem_pool_host first")
        return page_keys.keys([key])[0]

    # ---- the ABC: single and batched, generic (page tensors) -----------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Fills each target (default: a new page) with its key's page; None where it is a miss."""
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        targets = [self._new_page() if t is None else t for t in targets]
        ok = self._load(keys, targets)
        return [t if good else None for t, good in zip(targets, ok)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Stores each page (any dtype or shape); True only if every page is stored (or already was)."""
        if values is None or any(not isinstance(v, torch.Tensor) for v in values):
            raise TypeError("batch_set: values must be one page tensor per key")
        return all(self._store(keys, list(values)))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Number of leading keys whose pages are stored (SGLang's prefix semantics)."""
        runtime, page_keys = self.runtime, self._page_keys
        if page_keys is None or runtime is None:
            return 0
        bkeys = self._keys_of(page_keys, keys, extra_info)
        return runtime.lookup(bkeys) if bkeys is not None else 0

    # ---- v1: pages addressed by host-pool indices (`interface_v1: 1`) --------------------------

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Loads page i into the host pool at `host_indices[i * page_size]`; False where a miss.

        Pages land in a staging buffer first, so a failed or late transfer never writes host memory.
        """
        host = self._host_for(keys, host_indices)
        if host is None:
            return [False] * len(keys)
        staging = host_rows(len(keys), self.runtime.layout.block_bytes)
        ok = self._load(keys, list(staging), extra_info)
        for i, good in enumerate(ok):
            if good:
                host.set_from_flat_data_page(int(host_indices[i * host.page_size]), staging[i].view(host.dtype))
        return ok

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Stores the host pool's page at `host_indices[i * page_size]` under `keys[i]`."""
        host = self._host_for(keys, host_indices)
        if host is None:
            return [False] * len(keys)
        pages = [host.get_data_page(int(host_indices[i * host.page_size]), flat=True) for i in range(len(keys))]
        return self._store(keys, pages, extra_info)

    # ---- v2: sidecar pools of hybrid models, not stored (misses) --------------------------------

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None):
        if pool_transfers:
            self._count(Errors.SIDECAR, len(pool_transfers), f"{[str(t.name) for t in pool_transfers]}")
            return PoolTransferResult(0, {}, [])
        hits = self.batch_exists(keys, extra_info)
        return PoolTransferResult(hits, {PoolName.KV: hits} if hits else {}, list(range(1, hits + 1)))

    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        return self._sidecar_misses(transfers)

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        return self._sidecar_misses(transfers)

    # ---- retention hints (SGLang passes none to its storage: a caller that knows the request's does) ----

    def apply_hint(self, keys: list[str], params: Any, extra_info: Any = None, *, session_id: str | None = None,
                   tenant: str | None = None) -> bool:
        """Applies a request's retention hint (`kvtier.integrations.hints`) to its pages, once backed up.

        Args:
            keys: SGLang's page hashes of the request, head first, as `batch_set` took them.
            params: `{"kvtier": {"retain_s": .., "session": .., "closed": ..}}`, as vLLM takes it in
                `kv_transfer_params`; None or a mapping without `kvtier`: no hint.
            extra_info: as the pages' `batch_set` had it (it is in their keys).
            session_id: the caller's session for the request, used when the hint names none.
            tenant: whose retention budget a lease is charged to (default: the kvtier config's).
        Returns:
            Whether a hint was applied. A malformed one is refused, counted in `self.hints.refused`
            and logged; one kvtier refuses is counted in `snapshot()["hints"]`; never raised.
        """
        runtime, page_keys = self.runtime, self._page_keys
        if runtime is None or page_keys is None:
            self._count(Errors.NOT_ATTACHED, len(keys), "hint before register_mem_pool_host or after close")
            return False
        if self.hints is None:
            self.hints = HintReader(runtime.config.hints.limits.max_retain_s)
        hint = self.hints.read(params, session_id)
        block_keys = self._keys_of(page_keys, keys, extra_info) if hint is not None else None
        if block_keys is None:
            return False
        return runtime.apply_hint(block_keys, session=hint.session, retain_s=hint.retain_s, closed=hint.closed,
                                  tenant=tenant)

    # ---- lifecycle and metrics ----------------------------------------------------------------

    def clear(self) -> None:
        """Makes every stored page unreachable at once (a new key epoch); eviction reclaims their slots."""
        with self._lock:
            if self._page_keys is not None:
                self._page_keys = self._page_keys.next_epoch()

    def get_stats(self):
        """SGLang's `StorageMetrics` since the last call (None unless storage metrics are enabled)."""
        with self._lock:
            drained = {name: values[:] for name, values in self._metrics.items()}
            for values in self._metrics.values():
                values.clear()
        if not self.storage_config.enable_storage_metrics:
            return None
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return None
        return StorageMetrics(**drained)

    def snapshot(self) -> dict[str, object]:
        """kvtier's counters and usage, plus the pages this adapter refused, by reason."""
        runtime = self.runtime
        with self._lock:
            errors = dict(self.errors)
        return {**(runtime.snapshot() if runtime is not None else {}), "sglang_errors": errors}

    def close(self) -> None:
        """Closes the runtime if this backend built it (SGLang calls this on detach). Idempotent."""
        runtime, self.runtime = self.runtime, None
        if runtime is not None and self._owns_runtime:
            runtime.close()

    # ---- internals ----------------------------------------------------------------------------

    def _load(self, keys: Sequence[str], targets: Sequence[torch.Tensor], extra_info: Any = None) -> list[bool]:
        """Loads into each target's bytes (staged when a target is not contiguous)."""
        if len(targets) != len(keys):
            raise ValueError(f"{len(targets)} targets for {len(keys)} keys")
        start = time.perf_counter()
        bufs = {i: _byte_view(t) for i, t in enumerate(targets)}
        for i, t in enumerate(targets):
            if bufs[i] is None:  # not contiguous: load into staging, copy on success
                bufs[i] = torch.empty(_nbytes(t), dtype=torch.uint8)
        ok = self._transfer("load", keys, bufs, extra_info)
        for i, good in enumerate(ok):
            if good and not _shares_memory(bufs[i], targets[i]):
                targets[i].copy_(bufs[i].view(targets[i].dtype).reshape(targets[i].shape))
        self._record("prefetch", sum(ok), time.perf_counter() - start)
        return ok

    def _store(self, keys: Sequence[str], pages: Sequence[torch.Tensor], extra_info: Any = None) -> list[bool]:
        if len(pages) != len(keys):
            raise ValueError(f"{len(pages)} pages for {len(keys)} keys")
        start = time.perf_counter()
        bufs = {i: _byte_view(p) if p.is_contiguous() else _byte_view(p.contiguous()) for i, p in enumerate(pages)}
        ok = self._transfer("store", keys, bufs, extra_info)
        self._record("backup", sum(ok), time.perf_counter() - start)
        return ok

    def _transfer(self, verb: str, keys: Sequence[str], bufs: dict[int, torch.Tensor],
                  extra_info: Any = None) -> list[bool]:
        """Runs one batched load or store of the pages whose size fits; True per page that made it."""
        runtime, page_keys, ok = self.runtime, self._page_keys, [False] * len(keys)
        if runtime is None or page_keys is None:
            self._count(Errors.NOT_ATTACHED, len(keys), f"{verb} before register_mem_pool_host or after close")
            return ok
        all_keys = self._keys_of(page_keys, keys, extra_info)
        if all_keys is None:
            return ok
        block_bytes = runtime.layout.block_bytes
        key_of: dict[int, BlockKey] = {}
        first: dict[BlockKey, int] = {}  # a key twice in one batch: one transfer, one result
        for i, key in enumerate(keys):
            if bufs[i].numel() != block_bytes:
                self._count(Errors.PAGE_SIZE, 1, f"page {key}: {bufs[i].numel()} bytes, kvtier blocks are {block_bytes}")
                continue
            key_of[i] = all_keys[i]
            first.setdefault(key_of[i], i)
        if not first:
            return ok
        bkeys = list(first)
        try:
            blocks = [bufs[first[k]] for k in bkeys]
            handle = runtime.store(bkeys, blocks) if verb == "store" else runtime.load(bkeys, blocks)
            self._wait(handle)
        except KVTierError as e:
            self._count(Errors.RUNTIME, len(bkeys), f"{verb} of {len(bkeys)} pages: {e!r}")
            return ok
        for i, bkey in key_of.items():
            ok[i] = bkey not in handle.failed
        return ok

    def _keys_of(self, page_keys: PageKeys, keys: Sequence[str], extra_info: Any) -> list[BlockKey] | None:
        """The call's kvtier keys; None (counted) where its extra info cannot be keyed: misses, nothing stored."""
        try:
            return page_keys.keys(keys, extra_info)
        except UnkeyableCall as e:
            self._count(Errors.UNKEYABLE, len(keys), str(e))
            return None

    def _wait(self, handle) -> None:
        """Waits for a transfer; past the timeout, cancels it and waits for it to stop, so that no
        transfer still touches SGLang's memory once we return (a cancelled copy ends its current page)."""
        try:
            handle.wait(self.options.timeout_s)
        except TimeoutError:
            self._count(Errors.TIMEOUT, len(handle.keys), f"transfer of {len(handle.keys)} pages")
            handle.cancel()
            handle.wait()

    def _host_for(self, keys: Sequence[str], host_indices: torch.Tensor) -> Any:
        host = self._host
        if host is None or self.runtime is None:
            self._count(Errors.NOT_ATTACHED, len(keys), "v1 call before register_mem_pool_host or after close")
            return None
        if host_indices is None or host_indices.numel() != len(keys) * host.page_size:
            got = None if host_indices is None else host_indices.numel()
            self._count(Errors.BAD_INDICES, len(keys), f"{got} host indices for {len(keys)} pages of {host.page_size}")
            return None
        return host

    def _sidecar_misses(self, transfers: list[Any]) -> dict[str, list[bool]]:
        if transfers:
            self._count(Errors.SIDECAR, len(transfers), f"{[str(t.name) for t in transfers]}")
        return {t.name: [False] * len(t.keys or []) for t in transfers}

    def _new_page(self) -> torch.Tensor:
        host = self._host
        if host is not None:
            return host.get_dummy_flat_data_page()
        return torch.empty(self.runtime.layout.block_bytes if self.runtime else 0, dtype=torch.uint8)

    def _count(self, reason: str, n: int, detail: str) -> None:
        with self._lock:
            first = reason not in self.errors
            self.errors[reason] += n
        if first:  # once per reason: SGLang retries the same pages, and the counts tell the rest
            log.warning("kvtier HiCache storage: %s (%s); counted in snapshot()['sglang_errors']", reason, detail)

    def _record(self, what: str, num_pages: int, elapsed_s: float) -> None:
        if not self.storage_config.enable_storage_metrics or num_pages == 0:
            return
        gb = num_pages * self.runtime.layout.block_bytes / 1e9 if self.runtime else 0.0
        with self._lock:
            self._metrics[f"{what}_pgs"].append(num_pages)
            self._metrics[f"{what}_bandwidth"].append(gb / max(elapsed_s, 1e-9))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _byte_view(t: torch.Tensor) -> torch.Tensor | None:
    """`t`'s bytes as a flat uint8 tensor sharing its memory; None when `t` is not contiguous."""
    if not t.is_contiguous():
        return None
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.device == b.device
