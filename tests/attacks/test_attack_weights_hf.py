"""Changed weights or a changed config at the same path never hit the old KV: Hugging Face transformers.

Attacks: a checkpoint is rebuilt under the same path and loaded again under a namespace that
names only that path, sharing the KVTier the old model stored into (as a persistent SSD tier or a
pool node outlives a process):
- other weights, same config (retrained or fine-tuned);
- the same tensors with `config.json` changed: RoPE base 1e4 -> 1e6, or linear RoPE scaling x4.
  RoPE frequencies are a non-persistent buffer (`rotary_emb.inv_freq`), outside `state_dict()`,
  so a fingerprint of the tensors alone kept hitting the old KV: 96 of 96 prompt tokens cached,
  logits off a no-cache run by 0.003-0.004;
- a buffer outside `state_dict()` changed in place (RoPE frequencies patched by hand, config as is);
- the config change, under a namespace whose caller names the weights (`weights="id:..."`).
Each changed model must get 0 cached tokens and exactly the logits of a run without kvtier; the
unchanged model loaded again still hits. A real tiny Llama, real tiers. Cost: ~25 s, and
~10 s more for the variants under a caller's weights id (marked slow).
"""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch

pytest.importorskip("transformers")

from kvtier.config import KVTierConfig, TierConfig
from kvtier.integrations.hf.adapter import HFKVTier
from kvtier.integrations.hf.tiny_model import build_tiny_llama
from kvtier.model.keys import Namespace
from kvtier.runtime import KVTier
from kvtier.tiers.base import TierKind
from support.hf import BLOCK_TOKENS, GEN, _layout, assert_same, default_generate, kvtier, prompts


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


def _prompt_blocks(ids) -> int:
    return (ids.shape[1] - 1) // BLOCK_TOKENS  # a fully stored prompt still computes its last token


def test_a_checkpoint_rebuilt_at_the_same_path_gets_zero_hits(tmp_path):
    path = tmp_path / "tiny-llama"
    old = _load(build_tiny_llama(path, seed=0))
    new = _load(build_tiny_llama(path, seed=1))  # the same config and path, other weights
    namespace = Namespace(model=str(path), kv_dtype="fp32", block_tokens=BLOCK_TOKENS)
    a, _ = prompts()
    prompt_blocks = _prompt_blocks(a)
    with kvtier(path, tmp_path) as kv:
        assert HFKVTier(old, kv, namespace).generate(a, **GEN).num_stored_blocks > prompt_blocks
        fresh = HFKVTier(new, kv, namespace).generate(a, **GEN)
        assert fresh.num_cached_tokens == 0, "the rebuilt weights hit the old weights' KV"
        assert_same(fresh.output, default_generate(new, a), exact_logits=True)
        again = HFKVTier(_load(path), kv, namespace).generate(a, **GEN)  # the same weights, loaded again
        assert again.num_cached_tokens == prompt_blocks * BLOCK_TOKENS
        assert_same(again.output, default_generate(new, a))


# ---- the config and the buffers outside state_dict() -------------------------------------------

ROPE_BASE_1E6 = {"rope_type": "default", "rope_theta": 1e6}
ROPE_LINEAR_X4 = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}


def _with_rope(path, rope_parameters: dict):
    """The model at `path` loaded with `config.json`'s RoPE replaced; the file is restored after."""
    config_file = path / "config.json"
    original = config_file.read_text()
    config_file.write_text(json.dumps({**json.loads(original), "rope_parameters": rope_parameters}))
    try:
        return _load(path)
    finally:
        config_file.write_text(original)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.mark.parametrize("rope", [ROPE_BASE_1E6, ROPE_LINEAR_X4], ids=["rope_theta_1e6", "linear_x4"])
@pytest.mark.parametrize("weights", ["", pytest.param("id:ckpt-7", marks=pytest.mark.slow)],
                         ids=["fingerprinted", "named_by_caller"])
def test_a_config_changed_at_the_same_path_gets_zero_hits(llama_dir, tmp_path, rope, weights):
    old = _load(llama_dir)
    changed = _with_rope(llama_dir, rope)
    assert all(torch.equal(t, changed.state_dict()[n]) for n, t in old.state_dict().items()), "same tensors"
    namespace = Namespace(model=str(llama_dir), kv_dtype="fp32", block_tokens=BLOCK_TOKENS, weights=weights)
    a, _ = prompts()
    with kvtier(llama_dir, tmp_path) as kv:
        assert HFKVTier(old, kv, namespace).generate(a, **GEN).num_stored_blocks > _prompt_blocks(a)
        fresh = HFKVTier(changed, kv, namespace).generate(a, **GEN)
        assert fresh.num_cached_tokens == 0, f"RoPE {rope} hit the KV computed under the old config"
        assert_same(fresh.output, default_generate(changed, a), exact_logits=True)
        again = HFKVTier(_load(llama_dir), kv, namespace).generate(a, **GEN)  # unchanged config: hits as before
        assert again.num_cached_tokens == _prompt_blocks(a) * BLOCK_TOKENS
        assert_same(again.output, default_generate(old, a))


def test_a_buffer_changed_in_place_gets_zero_hits(llama_dir, tmp_path):
    old = _load(llama_dir)
    patched = copy.deepcopy(old)  # the same config and state_dict(); RoPE frequencies scaled by hand
    patched.model.rotary_emb.inv_freq.mul_(0.5)
    assert "model.rotary_emb.inv_freq" not in patched.state_dict()
    namespace = Namespace(model=str(llama_dir), kv_dtype="fp32", block_tokens=BLOCK_TOKENS)
    a, _ = prompts()
    with kvtier(llama_dir, tmp_path) as kv:
        HFKVTier(old, kv, namespace).generate(a, **GEN)
        fresh = HFKVTier(patched, kv, namespace).generate(a, **GEN)
        assert fresh.num_cached_tokens == 0, "a changed inv_freq buffer hit the old KV"
        assert_same(fresh.output, default_generate(patched, a), exact_logits=True)


def test_the_key_change_is_logged_once_where_a_persistent_tier_is_configured(llama_dir, tmp_path, caplog):
    model = _load(llama_dir)
    namespace = Namespace(model=str(llama_dir), kv_dtype="fp32", block_tokens=BLOCK_TOKENS)
    layout = _layout(llama_dir, "fp32")
    persistent = KVTierConfig(model=str(llama_dir), kv_dtype="fp32", block_tokens=BLOCK_TOKENS, tiers=(
        TierConfig(TierKind.SSD, 8 * layout.block_bytes, path=tmp_path / "ssd", o_direct=False, persist=True),))
    with caplog.at_level(logging.INFO, logger="kvtier.integrations.hf.adapter"):
        with kvtier(llama_dir, tmp_path) as kv:  # DRAM and SSD files of this process only: nothing to say
            HFKVTier(model, kv, namespace)
        assert not [r for r in caplog.records if "config" in r.getMessage()]
        with KVTier(persistent) as kv:
            HFKVTier(model, kv, namespace)
    lines = [r.getMessage() for r in caplog.records if "older kvtier" in r.getMessage()]
    assert len(lines) == 1 and "misses" in lines[0], lines
