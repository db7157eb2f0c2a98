"""Every identity input SGLang gives a storage backend reaches kvtier's page keys: SGLang's HiCache.

What SGLang 0.5.23 passes (read from the wheel): per page an opaque hash, SHA-256 chained over the
page's token ids and seeded with the request's `extra_key` (its own extra key plus the LoRA
adapter's `lora_id`) and `cache_salt` (`get_storage_hash_str`); per call a
`HiCacheStorageExtraInfo` (`prefix_keys`, the hashes before the call's pages, and an `extra_info`
dict its HiCache controller leaves empty); at start-up a `HiCacheStorageConfig` and the host pool.
What shapes K/V and reaches a backend only through the server's runtime context: the LoRA adapters'
files, the model overrides and dtypes, and the weight version. Attacks, each the way a deployment
would meet it, on the real `HiCacheStorage` ABC and `HiCacheStorageExtraInfo` from the wheel, a
runtime context published as SGLang's server publishes it, and real tiers:
- a `--lora-paths` adapter rebuilt at the same path under the same name (SGLang gives it the same
  `lora_id`, so the same page hashes), or only its `adapter_config.json` changed (alpha), and the
  server restarted on a persistent SSD tier;
- the same model files restarted with `--json-model-override-args` changing RoPE, or another
  fp8 `--kv-cache-dtype` (e4m3 and e5m2 pages are both uint8 to the host pool);
- weights updated in place under a new `weight_version`, in the same process;
- an `extra_info` dict that names an identity, and one that kvtier cannot encode (refused);
- and what must keep hitting: the same settings after a restart, any `prefix_keys`, and keys
  outside an SGLang server exactly as before.
Before the fix each changed setting hit the old pages (4 of 4) and they were served as good.
Cost: ~5 s.
"""

from __future__ import annotations

import json
import logging
import sys
import types
import uuid
from types import SimpleNamespace

import pytest
import torch
import xxhash
import yaml

from kvtier.config import KVTierConfig, TierConfig
from kvtier.errors import ConfigError
from kvtier.model.keys import Namespace
from kvtier.model.layout import BlockLayout
from kvtier.runtime import KVTier
from kvtier.tiers.base import TierKind
from kvtier.model.weights import WeightsSource, weights_fingerprint
from support.sglang import PAGE_BYTES, PAGE_TOKENS, DTYPE, FakeHostPool, find_wheel, keys, page, same_bytes, storage_config

safetensors_torch = pytest.importorskip("safetensors.torch")
pytestmark = pytest.mark.skipif(find_wheel() is None, reason="no sglang-0.5.23 wheel: run `make venv`")


def _checkpoint(path, seed: int, config: dict) -> str:
    path.mkdir(exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    name = "adapter_model.safetensors" if "lora_alpha" in config else "model.safetensors"
    safetensors_torch.save_file({"w": torch.randn(128, 64, generator=gen)}, path / name)
    (path / ("adapter_config.json" if "lora_alpha" in config else "config.json")).write_text(json.dumps(config))
    return str(path)


def _lora_ref(name: str, path: str) -> SimpleNamespace:
    """A resolved `--lora-paths NAME=PATH` entry: SGLang's `LoRARef`, its id uuid5(name, path)."""
    return SimpleNamespace(lora_id=uuid.uuid5(uuid.NAMESPACE_URL, f"{name}\0{path}").hex, lora_name=name,
                           lora_path=path, pinned=False)


def _publish(monkeypatch, model_path: str, lora_paths=None, **model_settings) -> SimpleNamespace:
    """SGLang's runtime context as a server publishes it; returns the serving bag (weight_version)."""
    model = SimpleNamespace(model_path=model_path, revision=None, download_dir=None, json_model_override_args="{}",
                            dtype="auto", kv_cache_dtype="auto", quantization=None, quantization_param_path=None,
                            context_length=None, model_impl="auto", load_format="auto")
    for name, value in model_settings.items():
        setattr(model, name, value)
    lora = SimpleNamespace(enable_lora=bool(lora_paths), lora_paths=lora_paths, max_lora_rank=None,
                           lora_target_modules=None)
    serving = SimpleNamespace(weight_version="default")
    context = types.ModuleType("sglang.srt.runtime_context")
    context.get_model, context.get_lora, context.get_serving = (lambda: model), (lambda: lora), (lambda: serving)
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", context)
    return serving


@pytest.fixture
def persistent(tmp_path):
    config = tmp_path / "kvtier.yaml"
    config.write_text(yaml.safe_dump({"model": "kvtier-tiny", "tiers": {"ssd": {
        "capacity": 16 * PAGE_BYTES, "path": str(tmp_path / "ssd"), "persist": True}}}))
    return config


def _server(sgl, config_path, host=None):
    """What SGLang builds at start-up: the backend from its extra config, then the host pool."""
    store = sgl.adapter.KVTierHiCacheStorage(storage_config(sgl, {"kvtier_config": str(config_path)}), {})
    store.register_mem_pool_host(host or FakeHostPool())
    return store


def _restart_hits(sgl, config_path, ks, host=None) -> int:
    """Pages of `ks` a freshly started server finds (and gets back as good); the server is closed."""
    store = _server(sgl, config_path, host)
    try:
        hits = store.batch_exists(ks)
        got = store.batch_get(ks)
        assert sum(g is not None for g in got) == hits, "exists and get agree"
        return hits
    finally:
        store.close()


def _first_run(sgl, config_path, ks, host=None) -> None:
    store = _server(sgl, config_path, host)
    try:
        assert store.batch_set(ks, [page(i) for i in range(len(ks))])
    finally:
        store.close()


def _runtime(tmp_path) -> KVTier:
    """An injected runtime of DRAM and SSD pages, for the tests of one process."""
    layout = BlockLayout(PAGE_TOKENS, (PAGE_BYTES,))
    tiers = (TierConfig(TierKind.DRAM, 8 * PAGE_BYTES), TierConfig(TierKind.SSD, 16 * PAGE_BYTES, path=tmp_path / "ssd"))
    return KVTier(KVTierConfig(model="kvtier-tiny", tiers=tiers), layout=layout)


# ---- LoRA adapters behind a deterministic lora_id -------------------------------------------------


@pytest.mark.parametrize("change", ["weights", "adapter_config"])
def test_an_adapter_changed_at_the_same_path_under_the_same_name_gets_zero_hits(sgl, tmp_path, monkeypatch,
                                                                                 persistent, change):
    model = _checkpoint(tmp_path / "model", 0, {"num_hidden_layers": 2})
    adapter = _checkpoint(tmp_path / "adapter", 0, {"r": 8, "lora_alpha": 16})
    ks = keys(4, "lora")  # page hashes seeded with the adapter's lora_id: the same before and after
    _publish(monkeypatch, model, lora_paths=[_lora_ref("sql", adapter)])
    _first_run(sgl, persistent, ks)
    assert _restart_hits(sgl, persistent, ks) == 4, "the same adapter after a restart still hits"
    if change == "weights":
        _checkpoint(tmp_path / "adapter", 1, {"r": 8, "lora_alpha": 16})
    else:
        _checkpoint(tmp_path / "adapter", 0, {"r": 8, "lora_alpha": 32})
    _publish(monkeypatch, model, lora_paths=[_lora_ref("sql", adapter)])
    assert _restart_hits(sgl, persistent, ks) == 0, f"an adapter with other {change} hit the old adapter's pages"


# ---- the served model's settings ------------------------------------------------------------------


@pytest.mark.parametrize("setting, before, after", [
    ("json_model_override_args", "{}", '{"rope_theta": 1000000.0}'),
    ("json_model_override_args", "{}", '{"rope_scaling": {"rope_type": "linear", "factor": 4.0}}'),
    ("kv_cache_dtype", "fp8_e4m3", "fp8_e5m2"),
    ("dtype", "bfloat16", "float16"),
    ("quantization", None, "fp8"),
], ids=["rope_theta", "rope_scaling", "kv_cache_dtype", "dtype", "quantization"])
def test_a_setting_changed_at_restart_gets_zero_hits(sgl, tmp_path, monkeypatch, persistent, setting, before, after):
    model = _checkpoint(tmp_path / "model", 0, {"num_hidden_layers": 2})
    ks = keys(4, "cfg")
    host = FakeHostPool()
    if setting == "kv_cache_dtype":
        host.dtype = torch.uint8  # SGLang stores fp8 pages as uint8: the pool dtype cannot tell them apart
    _publish(monkeypatch, model, **{setting: before})
    _first_run(sgl, persistent, ks, host)
    assert _restart_hits(sgl, persistent, ks, host) == 4, "the same settings after a restart still hit"
    _publish(monkeypatch, model, **{setting: after})
    assert _restart_hits(sgl, persistent, ks, host) == 0, f"{setting} {after!r} hit the pages of {before!r}"


def test_weights_updated_in_place_under_a_new_version_get_zero_hits(sgl, tmp_path, monkeypatch, persistent):
    serving = _publish(monkeypatch, _checkpoint(tmp_path / "model", 0, {"num_hidden_layers": 2}))
    ks, pages = keys(4, "rl"), [page(i) for i in range(4)]
    store = _server(sgl, persistent)
    try:
        assert store.batch_set(ks, pages) and store.batch_exists(ks) == 4
        serving.weight_version = "step-100"  # /update_weights_from_disk with weight_version: SGLang flushes
        assert store.batch_exists(ks) == 0, "the updated weights hit the old weights' pages"  # its own caches only
        assert store.batch_get(ks) == [None] * 4
        new_pages = [page(10 + i) for i in range(4)]
        assert store.batch_set(ks, new_pages) and store.batch_exists(ks) == 4
        assert all(same_bytes(got, want) for got, want in zip(store.batch_get(ks), new_pages))
    finally:
        store.close()


# ---- what each call passes ------------------------------------------------------------------------


def test_an_identity_in_extra_info_is_keyed_and_one_that_cannot_be_encoded_is_refused(sgl, tmp_path):
    info = sgl.storage.HiCacheStorageExtraInfo
    host = FakeHostPool()
    ks = keys(4, "xi")
    with _runtime(tmp_path) as runtime:
        store = sgl.adapter.KVTierHiCacheStorage(storage_config(sgl), {}, runtime=runtime)
        store.register_mem_pool_host(host)
        a, b = info(extra_info={"adapter": "a"}), info(extra_info={"adapter": "b"})
        assert store.batch_set_v1(ks, host.indices(range(4)), a) == [True] * 4
        assert store.batch_exists(ks, b) == 0 and store.batch_exists(ks) == 0, "another identity hit a's pages"
        assert store.batch_get_v1(ks, host.indices(range(4, 8)), b) == [False] * 4
        assert store.batch_exists(ks, info(prefix_keys=["x"], extra_info={"adapter": "a"})) == 4
        assert store.batch_get_v1(ks, host.indices(range(4, 8)), a) == [True] * 4
        assert torch.equal(host.kv_buffer[:, 4 * PAGE_TOKENS: 8 * PAGE_TOKENS], host.kv_buffer[:, :4 * PAGE_TOKENS])

        opaque = info(extra_info={"adapter": torch.zeros(4096)})  # no canonical form: never a shared key
        assert store.batch_set_v1(ks, host.indices(range(4)), opaque) == [False] * 4
        assert store.batch_exists(ks, opaque) == 0
        assert store.batch_get_v1(ks, host.indices(range(4)), opaque) == [False] * 4
        assert store.snapshot()["sglang_errors"]["unkeyable_extra_info"] == 12
        store.close()


def test_prefix_keys_do_not_change_a_page_key(sgl, tmp_path):
    """SGLang passes the hashes before a call's pages, which depend on how it cut the batches; the
    page hash already chains over them, so the same page must hit whatever they are."""
    info = sgl.storage.HiCacheStorageExtraInfo
    host = FakeHostPool()
    ks = keys(6, "pk")
    with _runtime(tmp_path) as runtime:
        store = sgl.adapter.KVTierHiCacheStorage(storage_config(sgl), {}, runtime=runtime)
        store.register_mem_pool_host(host)
        assert store.batch_set_v1(ks[:3], host.indices(range(3)), info(prefix_keys=[])) == [True] * 3
        assert store.batch_set_v1(ks[3:], host.indices(range(3, 6)), info(prefix_keys=ks[:3])) == [True] * 3
        assert store.batch_exists(ks, info(prefix_keys=None)) == 6
        assert store.batch_exists(ks[2:], info(prefix_keys=ks[:2])) == 4
        store.close()


def test_outside_an_sglang_server_page_keys_are_what_they_were(sgl, tmp_path):
    """No runtime context (tests, embedding): no settings to add, so the keys of the last release."""
    with _runtime(tmp_path) as runtime:
        store = sgl.adapter.KVTierHiCacheStorage(storage_config(sgl), {}, runtime=runtime)
        store.register_mem_pool_host(FakeHostPool())
        weights = weights_fingerprint(WeightsSource("org/tiny"))
        namespace = Namespace("org/tiny", str(DTYPE).removeprefix("torch."), PAGE_TOKENS,
                              f"{runtime.config.tenant}|tp0/1|page_first", weights)
        k = keys(1)[0]
        assert store.block_key(k) == xxhash.xxh3_128_digest(namespace.digest + bytes(8) + k.encode())
        store.close()


def test_the_key_change_is_logged_once_where_pages_outlive_the_process(sgl, tmp_path, monkeypatch, persistent,
                                                                        caplog):
    _publish(monkeypatch, _checkpoint(tmp_path / "model", 0, {"num_hidden_layers": 2}))
    with caplog.at_level(logging.INFO, logger="kvtier.integrations.sglang"):
        _server(sgl, persistent).close()
    lines = [r.getMessage() for r in caplog.records if "older kvtier" in r.getMessage()]
    assert len(lines) == 1 and "misses" in lines[0], lines


def test_every_form_of_lora_paths_names_its_adapters():
    from kvtier.integrations.sglang.options import lora_refs

    ref = _lora_ref("sql", "/adapters/sql")
    assert lora_refs([ref]) == [("sql", "/adapters/sql", ref.lora_id)]
    assert lora_refs(["sql=/adapters/sql", "/adapters/chat"]) == [("sql", "/adapters/sql", None),
                                                                   ("/adapters/chat", "/adapters/chat", None)]
    assert lora_refs([{"lora_name": "sql", "lora_path": "/adapters/sql"}]) == [("sql", "/adapters/sql", None)]
    assert lora_refs({"sql": "/adapters/sql"}) == [("sql", "/adapters/sql", None)]
    assert lora_refs(None) == []
    with pytest.raises(ConfigError, match="lora_paths: cannot read the adapter entry 3"):
        lora_refs([3])
