"""Retention hints through the Hugging Face binding (`HFKVTier.generate(kv_hints=...)`,
`HFKVTier.apply_hint`), on a real tiny Llama and real tiers (the SSD tier last, where leases hold).
Cost: ~5 s (the model is built once per module).
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from kvtier.integrations.hf.adapter import HFKVTier
from kvtier.integrations.hints import HintRefusal
from kvtier.model.keys import Namespace, block_keys

from support.hf import BLOCK_TOKENS, GEN, assert_same, default_generate, kvtier, prompts

NS = Namespace(model="kvtier-test/tiny-llama", kv_dtype="fp32", block_tokens=BLOCK_TOKENS)


def test_generate_leases_the_blocks_it_saved_and_a_closing_turn_ends_the_lease(model, model_dir, tmp_path):
    with kvtier(model_dir, tmp_path) as kv:
        hf = HFKVTier(model, kv, NS)
        prompt, _ = prompts(30)  # 37 tokens, 8 generated: 11 full blocks saved
        first = hf.generate(prompt, kv_hints={"kvtier": {"retain_s": 300, "session": "s-1"}}, **GEN)
        keys = block_keys(hf.namespace, first.output.sequences[0][:11 * BLOCK_TOKENS])
        assert first.num_stored_blocks == 11 and kv.num_retained() == 11
        assert all(tier is not None for tier in kv.where(keys))
        assert kv.snapshot()["hints"] == {"applied": 1}
        hf.generate(prompt, kv_hints={"kvtier": {"session": "s-1", "closed": True}}, **GEN)
        assert kv.num_retained() == 0, "every block's only session closed: its lease ends"
        assert kv.snapshot()["hints"] == {"applied": 2, "closed": 1}


def test_a_malformed_hint_is_refused_and_counted_and_the_generation_is_unchanged(model, model_dir, tmp_path):
    with kvtier(model_dir, tmp_path) as kv:
        hf = HFKVTier(model, kv, NS)
        prompt, _ = prompts(30)
        out = hf.generate(prompt, kv_hints={"kvtier": {"retain_s": "forever"}}, **GEN)
        assert_same(out.output, default_generate(model, prompt))
        assert hf.hints.refused == {HintRefusal.BAD_RETAIN_S: 1}
        assert out.num_stored_blocks == 11 and kv.num_retained() == 0
        assert hf.apply_hint(prompt, ["not", "a", "mapping"]) is False
        assert hf.hints.refused[HintRefusal.NOT_A_MAPPING] == 1 and not kv.snapshot()["hints"]


def test_apply_hint_takes_the_callers_session_and_tenant(model, model_dir, tmp_path):
    with kvtier(model_dir, tmp_path) as kv:
        hf = HFKVTier(model, kv, NS)
        prompt, _ = prompts(30)
        out = hf.generate(prompt, **GEN)
        assert hf.apply_hint(out.output.sequences, {"kvtier": {"retain_s": 60}}, session_id="chat-9", tenant="acme")
        assert kv.num_retained("acme") == 11
        assert hf.apply_hint(out.output.sequences, {"kvtier": {"closed": True}}, session_id="chat-9")
        assert kv.num_retained() == 0 and kv.snapshot()["hints"] == {"applied": 2, "closed": 1}
