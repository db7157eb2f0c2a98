"""Changed weights at the same model path never hit the old KV: SGLang's HiCache storage backend.

Attack: SGLang serves a model path with kvtier below it on a persistent SSD tier (`persist: true`);
the model's weights file is rebuilt at that path and SGLang starts again with the same storage
config. Before the namespace carried a fingerprint of the weights, the new server's
`batch_exists` found the old server's pages and `batch_get` returned them as good. The real
`HiCacheStorage` ABC from the sglang wheel (see tests/integrations/test_sglang_storage.py), real SSD files.
Cost: ~5 s.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from support.sglang import PAGE_BYTES, FakeHostPool, find_wheel, keys, page, same_bytes, storage_config


safetensors_torch = pytest.importorskip("safetensors.torch")
pytestmark = pytest.mark.skipif(find_wheel() is None, reason="no sglang-0.5.23 wheel: run `make venv`")


def _weights(model_dir, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    safetensors_torch.save_file({"layer.w": torch.randn(256, 64, generator=gen), "norm": torch.ones(64)},
                                model_dir / "model.safetensors")
    (model_dir / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))


def _server(sgl, config_path, model_dir):
    """What SGLang builds at start-up: the backend from its extra config, then the host pool."""
    extra = {"kvtier_config": str(config_path)}
    store = sgl.adapter.KVTierHiCacheStorage(storage_config(sgl, extra, model_name=str(model_dir)), {})
    store.register_mem_pool_host(FakeHostPool())
    return store


def test_weights_rebuilt_at_the_same_model_path_get_zero_hits_after_a_restart(sgl, tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    _weights(model_dir, seed=0)
    config_path = tmp_path / "kvtier.yaml"
    config_path.write_text(yaml.safe_dump({"model": "kvtier-tiny", "tiers": {"ssd": {
        "capacity": 16 * PAGE_BYTES, "path": str(tmp_path / "ssd"), "persist": True}}}))
    ks, pages = keys(4), [page(i) for i in range(4)]
    first = _server(sgl, config_path, model_dir)
    assert first.batch_set(ks, pages)
    first.close()

    restarted = _server(sgl, config_path, model_dir)  # the same weights: the pages outlived the process
    try:
        assert restarted.batch_exists(ks) == 4
        assert all(same_bytes(got, want) for got, want in zip(restarted.batch_get(ks), pages))
    finally:
        restarted.close()

    _weights(model_dir, seed=1)  # rebuilt: same path, same names, shapes and sizes, other values
    rebuilt = _server(sgl, config_path, model_dir)
    try:
        assert rebuilt.batch_exists(ks) == 0, "the rebuilt weights hit the old weights' pages"
        assert rebuilt.batch_get(ks) == [None] * 4
    finally:
        rebuilt.close()
