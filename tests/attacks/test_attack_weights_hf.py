"""Changed weights at the same path never hit the old KV: Hugging Face transformers.

Attack: a checkpoint is rebuilt under the same path (same config, other weights: retrained or
fine-tuned) and loaded again under a namespace that names only that path, sharing the KVTier the
old model stored into (as a persistent SSD tier or a pool node outlives a process). Before the
namespace carried a fingerprint of the weights, the new model hit the old model's blocks and
generated from the old KV. A real tiny Llama, real tiers. Cost: ~10 s.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from kvtier.integrations.hf.adapter import HFKVTier
from kvtier.integrations.hf.tiny_model import build_tiny_llama
from kvtier.keys import Namespace
from support.hf import BLOCK_TOKENS, GEN, assert_same, default_generate, kvtier, prompts


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


def test_a_checkpoint_rebuilt_at_the_same_path_gets_zero_hits(tmp_path):
    path = tmp_path / "tiny-llama"
    old = _load(build_tiny_llama(path, seed=0))
    new = _load(build_tiny_llama(path, seed=1))  # the same config and path, other weights
    namespace = Namespace(model=str(path), kv_dtype="fp32", block_tokens=BLOCK_TOKENS)
    a, _ = prompts()
    prompt_blocks = (a.shape[1] - 1) // BLOCK_TOKENS  # a fully stored prompt still computes its last token
    with kvtier(path, tmp_path) as kv:
        assert HFKVTier(old, kv, namespace).generate(a, **GEN).num_stored_blocks > prompt_blocks
        fresh = HFKVTier(new, kv, namespace).generate(a, **GEN)
        assert fresh.num_cached_tokens == 0, "the rebuilt weights hit the old weights' KV"
        assert_same(fresh.output, default_generate(new, a), exact_logits=True)
        again = HFKVTier(_load(path), kv, namespace).generate(a, **GEN)  # the same weights, loaded again
        assert again.num_cached_tokens == prompt_blocks * BLOCK_TOKENS
        assert_same(again.output, default_generate(new, a))
