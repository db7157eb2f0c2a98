"""SGLang's `HiCacheStorage` contract, against the real ABC from the sglang 0.5.23 wheel (cost: ~5 s).

The wheel is never installed: the four modules the ABC and its dynamic loader need
(`hicache_storage`, `storage/backend_factory`, `storage/__init__`, `environ`) are extracted into a
temporary directory and imported with torch alone; no SGLang module is stubbed, except
`observability.metrics_collector` in the one `get_stats` test and `runtime_context` in the one
test of the served model path (both pull in the whole server).
SGLang's host pool cannot be imported without its kernels, so `FakeHostPool` copies the page
accessors of `MHATokenToKVPoolHost` (0.5.23) that the storage paths call. Tiers are real: a CPU
stand-in for HBM, DRAM and SSD files under tmp_path, a few pages each, so pages spill to SSD.
"""

from __future__ import annotations

import dataclasses

import importlib
import sys
import threading
import types
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

from kvtier.config import KVTierConfig, PrefetchConfig, TierConfig, TransferConfig
from kvtier.errors import ConfigError
from kvtier.model.layout import BlockLayout
from kvtier.runtime import KVTier
from kvtier.tiers.base import TierKind

H, D, S = TierKind.HBM, TierKind.DRAM, TierKind.SSD
from support.sglang import DTYPE, FakeHostPool, MODULE, PAGE_BYTES, PAGE_TOKENS, WHEEL_DIR, find_wheel, keys, page, same_bytes, storage_config


CLASS = "KVTierHiCacheStorage"




pytestmark = pytest.mark.skipif(find_wheel() is None, reason=(
    f"no sglang-0.5.23 wheel in {WHEEL_DIR}: run `make venv` (it runs `pip download --no-deps sglang==0.5.23`)"))

LAYOUT = BlockLayout(PAGE_TOKENS, (PAGE_BYTES,))








def kv_runtime(tmp_path, hbm=2, dram=3, ssd=8, layout=LAYOUT) -> KVTier:
    """Tiers of a few pages; watermarks off so placements are exact."""
    block = layout.block_bytes
    tiers = (TierConfig(H, hbm * block, device="cpu", high_watermark=1.0, low_watermark=1.0),
             TierConfig(D, dram * block, high_watermark=1.0, low_watermark=1.0),
             TierConfig(S, ssd * block, path=tmp_path / "ssd", high_watermark=1.0, low_watermark=1.0))
    config = KVTierConfig(model="kvtier-tiny", tiers=tiers, prefetch=PrefetchConfig(D, 4 * block),
                          transfer=TransferConfig(io_workers=2, chunk_bytes=0))
    return KVTier(config, layout=layout)


@pytest.fixture
def rt(tmp_path):
    with kv_runtime(tmp_path) as runtime:
        yield runtime


def backend(sgl, runtime, host=None, **overrides):
    store = sgl.adapter.KVTierHiCacheStorage(storage_config(sgl, **overrides), {}, runtime=runtime)
    store.register_mem_pool_host(host or FakeHostPool())
    return store








# ---- the ABC and SGLang's dynamic loader -----------------------------------------------------------


def test_is_a_real_hicache_storage_that_overrides_every_method_sglang_calls(sgl, rt):
    cls, abc = sgl.adapter.KVTierHiCacheStorage, sgl.storage.HiCacheStorage
    assert issubclass(cls, abc) and not cls.__abstractmethods__
    assert abc.__abstractmethods__ == {"get", "batch_get", "set", "batch_set", "exists"}, "the 0.5.23 ABC"
    for name in ("get", "batch_get", "set", "batch_set", "exists", "batch_exists", "batch_get_v1", "batch_set_v1",
                 "batch_exists_v2", "batch_get_v2", "batch_set_v2", "clear", "get_stats"):
        assert getattr(cls, name) is not getattr(abc, name), name
    assert isinstance(backend(sgl, rt), abc)


def test_sglang_dynamic_loader_builds_it_from_the_extra_config(sgl, tmp_path):
    yaml_path = tmp_path / "kvtier.yaml"
    yaml_path.write_text(yaml.safe_dump({"model": "kvtier-tiny", "tiers": {
        "dram": {"capacity": 2 * PAGE_BYTES, "high_watermark": 1.0, "low_watermark": 1.0},
        "ssd": {"capacity": 8 * PAGE_BYTES, "path": str(tmp_path / "ssd"), "num_files": 2}}}))
    extra = {"backend_name": "kvtier", "module_path": MODULE, "class_name": CLASS, "interface_v1": 1,
             "kvtier_config": str(yaml_path)}
    store = sgl.factory.StorageBackendFactory.create_backend("dynamic", storage_config(sgl, extra), None)
    try:
        assert type(store).__name__ == CLASS
        host = FakeHostPool()
        store.register_mem_pool_host(host)  # what attach_storage_backend does next
        assert store.runtime.layout.block_bytes == PAGE_BYTES
        ks = keys(5)
        assert store.batch_set_v1(ks, host.indices(range(5))) == [True] * 5
        assert {store.runtime.where([store.block_key(k)])[0] for k in ks} == {D, S}, "spilled to SSD"
        expected = host.kv_buffer[:, : 5 * PAGE_TOKENS].clone()
        host.kv_buffer.zero_()
        assert store.batch_get_v1(ks, host.indices(range(5))) == [True] * 5
        assert torch.equal(host.kv_buffer[:, : 5 * PAGE_TOKENS], expected)
    finally:
        store.close()


# ---- round trips through every tier -------------------------------------------------------------------


def test_pages_round_trip_byte_identical_through_hbm_dram_and_ssd(sgl, rt):
    store, ks = backend(sgl, rt), keys(10)
    pages = [page(i) for i in range(10)]
    assert store.batch_set(ks, pages) is True
    assert {rt.where([store.block_key(k)])[0] for k in ks} == {H, D, S}
    out = store.batch_get(ks, [torch.zeros_like(p) for p in pages])
    assert all(o is not None and same_bytes(o, p) for o, p in zip(out, pages))
    assert rt.snapshot()["hits"].keys() >= {"hbm", "dram", "ssd"}
    assert store.set(ks[0], pages[0]) is True, "storing a stored page again succeeds"


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_v1_moves_pages_between_host_pool_indices(sgl, rt, layout):
    host = FakeHostPool(layout)
    store, ks = backend(sgl, rt, host), keys(6)
    assert store.batch_set_v1(ks, host.indices([0, 1, 2, 3, 4, 5])) == [True] * 6
    expected = [host.get_data_page(p * PAGE_TOKENS).clone() for p in range(6)]
    host.kv_buffer.zero_()
    assert store.batch_get_v1(ks, host.indices([10, 11, 12, 13, 14, 15])) == [True] * 6
    for i in range(6):
        assert same_bytes(host.get_data_page((10 + i) * PAGE_TOKENS), expected[i])


def test_any_dtype_shape_and_non_contiguous_target(sgl, rt):
    store = backend(sgl, rt)
    value = torch.arange(PAGE_BYTES // 4, dtype=torch.int32).reshape(64, -1)
    assert store.set("k", value)
    target = torch.zeros(value.shape[1], value.shape[0], dtype=torch.int32).t()  # a transposed view
    assert store.get("k", target) is target and torch.equal(target, value)
    assert store.get("k") is not None, "no target: a new page"


# ---- misses, prefixes and bad input -------------------------------------------------------------------


def test_batch_exists_counts_the_leading_stored_keys(sgl, rt):
    store, ks = backend(sgl, rt), keys(5)
    assert store.batch_set([k for i, k in enumerate(ks) if i != 2], [page(i) for i in range(5) if i != 2])
    assert store.batch_exists(ks) == 2 and store.batch_exists(ks[3:]) == 2
    assert store.batch_exists([]) == 0 and store.batch_exists(["missing", ks[0]]) == 0
    assert store.exists(ks[1]) and not store.exists(ks[2])
    hits = store.batch_exists_v2(ks)
    assert hits.kv_hit_pages == 2 and hits.restorable_prefix_pages == [1, 2]


def test_misses_are_none_or_false_and_leave_host_memory_alone(sgl, rt):
    host = FakeHostPool()
    store = backend(sgl, rt, host)
    assert store.get("never-stored", torch.zeros(PAGE_BYTES // 2, dtype=DTYPE)) is None
    assert store.set("a", page(1))
    got = store.batch_get(["a", "b"], [torch.zeros(PAGE_BYTES // 2, dtype=DTYPE) for _ in range(2)])
    assert same_bytes(got[0], page(1)) and got[1] is None
    before = host.kv_buffer.clone()
    assert store.batch_get_v1(["b", "a"], host.indices([3, 4])) == [False, True]
    assert torch.equal(host.kv_buffer[:, 3 * PAGE_TOKENS : 4 * PAGE_TOKENS], before[:, 3 * PAGE_TOKENS : 4 * PAGE_TOKENS])


def test_wrong_page_sizes_are_counted_misses(sgl, rt):
    store = backend(sgl, rt)
    assert store.set("short", torch.zeros(100, dtype=DTYPE)) is False
    assert store.batch_set(["ok", "long"], [page(1), torch.zeros(PAGE_BYTES, dtype=DTYPE)]) is False
    assert store.exists("ok") and not store.exists("long")
    assert store.get("ok", torch.zeros(10, dtype=DTYPE)) is None
    assert store.snapshot()["sglang_errors"] == {"page_size_mismatch": 3}
    host = FakeHostPool()
    assert store.batch_get_v1(["ok"], host.indices([0])[:3]) == [False], "indices of a partial page"


def test_bad_configuration_is_a_clear_error_at_start_up(sgl, tmp_path):
    cls = sgl.adapter.KVTierHiCacheStorage
    with pytest.raises(ConfigError, match="kvtier_config: missing"):
        cls(storage_config(sgl, {}), {})
    with pytest.raises(ConfigError, match="kvtier_timeout: unknown"):
        cls(storage_config(sgl, {"kvtier_timeout": 3}), {})
    with pytest.raises(ConfigError, match="extra_config.kvtier_weights_id: expected a non-empty string"):
        cls(storage_config(sgl, {"kvtier_weights_id": ""}), {})
    gpu = tmp_path / "gpu.yaml"
    gpu.write_text(yaml.safe_dump({"model": "m", "tiers": {"hbm": {"capacity": "1MiB"}}}))
    with pytest.raises(ConfigError, match="tiers.hbm"):
        cls(storage_config(sgl, {"kvtier_config": str(gpu)}), {})
    with pytest.raises(ConfigError, match="MLA"):
        cls(storage_config(sgl, {"kvtier_config": str(gpu)}, is_mla_model=True, tp_size=2, tp_rank=1), {})
    with kv_runtime(tmp_path, layout=BlockLayout(PAGE_TOKENS, (PAGE_BYTES // 2,))) as wrong:
        store = cls(storage_config(sgl), {}, runtime=wrong)
        with pytest.raises(ConfigError, match=f"{PAGE_BYTES // 2} != SGLang page of {PAGE_BYTES} bytes"):
            store.register_mem_pool_host(FakeHostPool())


def test_corrupted_ssd_page_is_a_miss_never_data(sgl, rt):
    store, ks = backend(sgl, rt), keys(8)
    assert store.batch_set(ks, [page(i) for i in range(8)])
    victim = next(i for i, k in enumerate(ks) if rt.where([store.block_key(k)])[0] is S)
    slot = rt.manager.index.get(store.block_key(ks[victim])).copies[S].slot
    rt.tiers[S].write(slot, torch.full((64,), 0xAB, dtype=torch.uint8), offset=1000)
    assert store.get(ks[victim], torch.zeros(PAGE_BYTES // 2, dtype=DTYPE)) is None
    assert not store.exists(ks[victim]) and store.batch_exists(ks) == victim
    assert rt.stats.checksum_errors == 1


def test_a_load_past_the_timeout_returns_only_once_the_transfer_has_stopped(sgl, rt, monkeypatch):
    store = backend(sgl, rt)  # the stores get the normal timeout: a loaded machine must not fail them
    assert store.batch_set(keys(8), [page(i) for i in range(8)])
    store.options = dataclasses.replace(store.options, timeout_s=0.01)  # only the held read times out
    on_ssd = next(k for k in keys(8) if rt.where([store.block_key(k)])[0] is S)
    ssd, gate, count = rt.tiers[S], threading.Event(), store._count
    read = ssd.read_spans
    monkeypatch.setattr(ssd, "read_spans", lambda io: (gate.wait(30), read(io))[1])  # held until the timeout is counted
    monkeypatch.setattr(store, "_count", lambda reason, *a: (count(reason, *a), gate.set()))
    target = torch.zeros(PAGE_BYTES // 2, dtype=DTYPE)
    got = store.get(on_ssd, target)
    assert store.errors["timeout"] == 1 and gate.is_set()
    assert got is None or same_bytes(got, page(keys(8).index(on_ssd))), "a miss or the right bytes"


# ---- keys, clear, sidecars, metrics, lifecycle ----------------------------------------------------------


def test_ranks_and_layouts_never_share_pages(sgl, rt):
    rank0 = backend(sgl, rt)
    rank1 = backend(sgl, rt, tp_rank=1, tp_size=2)
    layer_first = backend(sgl, rt, FakeHostPool("layer_first"))
    assert rank0.set("k", page(1))
    assert not rank1.exists("k") and not layer_first.exists("k")


def test_the_weights_name_the_pages(sgl, rt):
    first = backend(sgl, rt, extra={"kvtier_weights_id": "ckpt-1"})
    same, other = (backend(sgl, rt, extra={"kvtier_weights_id": w}) for w in ("ckpt-1", "ckpt-2"))
    assert first.set("k", page(1))
    assert same.exists("k") and not other.exists("k")


def test_inside_sglang_the_served_model_path_is_fingerprinted_not_its_alias(sgl, rt, tmp_path, monkeypatch):
    from kvtier.integrations.sglang.options import served_weights
    from kvtier.model.weights import WeightsSource

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "model.safetensors").write_bytes(bytes(8) + b"weights-1")  # not valid safetensors: read whole
    # SGLang's runtime context (its real module imports the whole server): the model path and revision.
    context = type(sys)("sglang.srt.runtime_context")
    context.get_model = lambda: types.SimpleNamespace(model_path=str(model_dir), revision=None)
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", context)
    assert served_weights(storage_config(sgl, model_name="llama-alias"), rt.config) == WeightsSource(str(model_dir))
    assert backend(sgl, rt, model_name="llama-alias").set("k", page(1))
    assert backend(sgl, rt, model_name="llama-alias").exists("k")
    (model_dir / "model.safetensors").write_bytes(bytes(8) + b"weights-2")
    assert not backend(sgl, rt, model_name="llama-alias").exists("k")


def test_clear_makes_every_page_a_miss(sgl, rt):
    store = backend(sgl, rt)
    assert store.set("k", page(1))
    store.clear()
    assert not store.exists("k") and store.get("k", page(0)) is None
    assert store.set("k", page(2)) and same_bytes(store.get("k", page(0)), page(2))


def test_sidecar_pools_of_hybrid_models_are_misses(sgl, rt):
    store = backend(sgl, rt)
    assert store.set("k", page(1))
    mamba = sgl.storage.PoolTransfer(name=sgl.storage.PoolName.MAMBA, host_indices=torch.arange(4), keys=["k"])
    assert store.batch_exists_v2(["k"], [mamba]).kv_hit_pages == 0
    assert store.batch_get_v2([mamba]) == {"mamba": [False]} and store.batch_set_v2([mamba]) == {"mamba": [False]}


def test_get_stats_reports_sglang_storage_metrics(sgl, rt, monkeypatch):
    assert backend(sgl, rt).get_stats() is None, "metrics off"
    # The real metrics_collector imports the whole server; a stand-in holds its StorageMetrics dataclass.
    stub = type(sys)("sglang.srt.observability.metrics_collector")
    stub.StorageMetrics = type("StorageMetrics", (), {"__init__": lambda self, **kw: self.__dict__.update(kw)})
    monkeypatch.setitem(sys.modules, stub.__name__, stub)
    store = backend(sgl, rt, enable_storage_metrics=True)
    assert store.batch_set(keys(3), [page(i) for i in range(3)])
    store.batch_get(keys(3))
    stats = store.get_stats()
    assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3] and stats.prefetch_bandwidth[0] > 0
    assert store.get_stats().backup_pgs == [], "drained"


def test_after_close_every_call_is_a_counted_miss(sgl, tmp_path):
    runtime = kv_runtime(tmp_path)
    store = backend(sgl, runtime)
    assert store.set("k", page(1))
    store.close()
    runtime.close()
    assert store.get("k", page(0)) is None and store.set("k", page(1)) is False and not store.exists("k")
    assert store.snapshot()["sglang_errors"] == {"not_attached": 2}


def test_the_former_module_path_gives_the_same_backend(sgl):
    """Existing `module_path: kvtier.integrations.sglang_storage` lines keep working."""
    from support.sglang import FORMER_MODULE

    assert importlib.import_module(FORMER_MODULE).KVTierHiCacheStorage is sgl.adapter.KVTierHiCacheStorage
