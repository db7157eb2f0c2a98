"""The Hugging Face caches on a real tiny Llama and real tiers (CPU stand-in HBM, DRAM, SSD files).

Every output is checked against the same model with transformers' default cache. The tokens the
model computes are counted by a hook on its embedding. Ordering is proved by a gate on the SSD
tier's reads and by the cache's own event trace, never by timing. Cost: ~10 s (model built once).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvtier.config import KVTierConfig, PrefetchConfig, TierConfig, TransferConfig
from kvtier.errors import ConfigError, GeometryError
from kvtier.integrations.hf.adapter import HFKVTier, KVTierStreamingCache, config_of, model_fingerprint, weights_of
from kvtier.integrations.hf.tiny_model import build_tiny_llama
from kvtier.model.keys import Namespace, block_keys
from kvtier.model.layout import BlockLayout
from kvtier.runtime import KVTier
from kvtier.tiers.base import Tier, TierKind
from kvtier.tiers.ssd import SSDTier
from kvtier.model.weights import WeightsSource, weights_fingerprint

from support.hf import BLOCK_TOKENS, D, GEN, H, NEW_TOKENS, ProbeTier, S, WAIT_S, _layout, assert_same, default_generate, kvtier, prompts


NUM_LAYERS = 4  # build_tiny_llama's default
NS = Namespace(model="kvtier-test/tiny-llama", kv_dtype="fp32", block_tokens=BLOCK_TOKENS)






@pytest.fixture
def counted(model) -> Iterator[list[int]]:
    """Input positions of every forward the model runs (nested ones too)."""
    seen: list[int] = []
    hook = model.model.embed_tokens.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[-1]))
    yield seen
    hook.remove()








@pytest.fixture
def kv(model_dir, tmp_path) -> Iterator[KVTier]:
    with kvtier(model_dir, tmp_path) as runtime:
        yield runtime


@pytest.fixture
def probed(model_dir, tmp_path) -> Iterator[tuple[KVTier, ProbeTier]]:
    with kvtier(model_dir, tmp_path, probe=True) as runtime:
        yield runtime, runtime.tiers[S]








# ---- prefix cache ----------------------------------------------------------------------------


def test_prefix_cache_matches_default_and_skips_the_shared_prefix(model, kv, counted):
    hf = HFKVTier(model, kv, NS)
    a, b = prompts()
    first = hf.generate(a, **GEN)
    assert first.num_cached_tokens == 0 and sum(counted) == a.shape[1] + NEW_TOKENS - 1
    assert_same(first.output, default_generate(model, a), exact_logits=True)
    assert first.num_stored_blocks == (a.shape[1] + NEW_TOKENS - 1) // BLOCK_TOKENS
    assert {t for t in kv.where(block_keys(hf.namespace, a[0])) if t is not None} >= {D, S}, "spilled below HBM"

    counted.clear()
    second = hf.generate(b, **GEN)
    assert second.num_cached_tokens == 88  # the 22 full blocks of the shared 90 tokens
    assert counted == [b.shape[1] - 88] + [1] * (NEW_TOKENS - 1), "only the uncached tokens are computed"
    assert_same(second.output, default_generate(model, b))


def test_prefix_cache_fully_cached_prompt_computes_one_token(model, kv, counted):
    hf = HFKVTier(model, kv, NS)
    ids = prompts()[0][:, :96]  # exactly 24 blocks
    hf.generate(ids, **GEN)
    counted.clear()
    again = hf.generate(ids, **GEN)
    assert again.num_cached_tokens == 95 and counted == [1] * NEW_TOKENS
    assert_same(again.output, default_generate(model, ids))


def test_prefix_cache_step_by_step_api(model, kv):
    hf = HFKVTier(model, kv, NS)
    a, b = prompts()
    with hf.prefix_cache() as cache:
        assert cache.prepare(a) == 0
        out = model.generate(a, past_key_values=cache, **GEN)
        handle = cache.save(out.sequences[0])
        assert handle.wait(WAIT_S) and len(handle.keys) == (a.shape[1] + NEW_TOKENS - 1) // BLOCK_TOKENS
    cache = hf.prefix_cache()
    assert cache.prepare(b) == 88 and cache.get_seq_length() == 88
    with pytest.raises(RuntimeError, match="once"):
        cache.prepare(b)
    with pytest.raises(ValueError, match="start with the prompt"):
        cache.save(a[0])
    with pytest.raises(ValueError, match="batch"):
        hf.prefix_cache().prepare(torch.cat([a, a]))


# ---- streaming cache -------------------------------------------------------------------------


def forwards(events: list[tuple[str, int]]) -> list[list[tuple[str, int]]]:
    """The trace cut at each forward's first `update_enter 0`; item 0 is what came before (prepare)."""
    cut = [[]]
    for event in events:
        if event == ("update_enter", 0):
            cut.append([])
        cut[-1].append(event)
    return cut


def test_streaming_cache_beyond_the_hbm_budget_matches_default_and_loads_ahead(model, kv, counted):
    hf = HFKVTier(model, kv, NS)
    a, b = prompts()
    events: list[tuple[str, int]] = []
    with hf.streaming_cache(observer=lambda e, v: events.append((e, v))) as cache:
        assert cache.prepare(a) == 0
        out = model.generate(a, past_key_values=cache, **GEN)
        streamed = cache.num_streamed_blocks
        assert cache.save(out.sequences[0]).wait(WAIT_S)
    assert_same(out, default_generate(model, a), exact_logits=True)
    assert streamed == a.shape[1] // BLOCK_TOKENS, "the whole prompt left the device"
    tiers = kv.where(block_keys(hf.namespace, a[0]))
    assert tiers.count(H) <= 2 and S in tiers, "24 blocks do not fit a 2-block HBM tier: they stream from below"
    assert kv.stats.hits[S] > 0

    steps = forwards(events)[1:]
    assert len(steps) == NEW_TOKENS
    # The prompt's blocks are stored after forward 0, pinned and dropped from the device after
    # forward 1; from forward 2 on, every forward streams them, from a load issued inside the
    # previous forward's last layer: ahead of the token's sampling and embedding.
    for before, step in itertools.pairwise(steps[1:]):
        last_layer = before[before.index(("update_enter", NUM_LAYERS - 1)):]
        assert last_layer[-2:] == [("load_issued", streamed), ("update_return", NUM_LAYERS - 1)]
        assert [v for e, v in step if e == "layer_loaded"] == list(range(NUM_LAYERS))
    assert not [e for e in events if e[0] == "recompute"]

    counted.clear()
    with hf.streaming_cache() as cache:
        assert cache.prepare(b) == 88
        out = model.generate(b, past_key_values=cache, **GEN)
    assert counted == [b.shape[1] - 88] + [1] * (NEW_TOKENS - 1)
    assert_same(out, default_generate(model, b))


def test_streaming_layer_computes_while_the_next_layer_is_still_loading(model, probed):
    """Layers 0-1 of the prefix land; layer 2 is held at the SSD. Layer 1 computes and returns anyway."""
    kv, ssd = probed
    hf = HFKVTier(model, kv, NS)
    a, _ = prompts()
    hf.generate(a, **GEN)  # store the prompt's blocks; most land on SSD
    events: list[tuple[str, int]] = []
    layer1_done = threading.Event()

    def observe(event, value):
        events.append((event, value))
        if (event, value) == ("update_return", 1):
            layer1_done.set()

    cache: KVTierStreamingCache = hf.streaming_cache(observer=observe)
    ssd.gate_from, _ = kv.layout.layer_range(2)
    ssd.gate.clear()
    try:
        num_cached = cache.prepare(a)
        assert num_cached == 96  # 24 full blocks; the 97th token is computed
        result = {}
        forward = threading.Thread(target=lambda: result.update(
            logits=model(input_ids=a[:, num_cached:], past_key_values=cache).logits))
        forward.start()
        assert layer1_done.wait(WAIT_S) and ssd.held.wait(WAIT_S)
        assert forward.is_alive() and ("update_return", 2) not in events, "layer 2 waits for its bytes"
        assert events.index(("load_issued", num_cached // BLOCK_TOKENS)) < events.index(("update_enter", 0))
    finally:
        ssd.gate.set()
    forward.join(WAIT_S)
    cache.close()
    with torch.no_grad():
        want = model(input_ids=a).logits[:, num_cached:]
    torch.testing.assert_close(result["logits"], want, rtol=0, atol=1e-5)


# ---- the weights in the namespace -------------------------------------------------------------


def test_the_binding_names_the_weights_and_config_it_computes_with(model, model_dir, kv, tmp_path):
    hf = HFKVTier(model, kv, NS)
    weights, config = hf.namespace.weights.split(";")
    assert hf.namespace == replace(NS, weights=f"{weights_of(model)};{config_of(model)}")
    assert weights.startswith("params:") and config.startswith("config:")
    import shutil

    from transformers import AutoModelForCausalLM

    moved = shutil.copytree(model_dir, tmp_path / "elsewhere")  # the same files at another path
    for path in (model_dir, moved):
        again = AutoModelForCausalLM.from_pretrained(path)
        assert model_fingerprint(again) == hf.namespace.weights, f"loaded again from {path}"
    eager = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    assert config_of(eager) != config, "another attention implementation rounds otherwise"
    named = replace(NS, weights="id:ckpt-7")
    assert HFKVTier(model, kv, named).namespace == replace(NS, weights=f"id:ckpt-7;{config}"), (
        "a namespace that names its weights keeps that name, and gets the config")


def test_offloaded_tensors_are_fingerprinted_by_their_files(model, model_dir):
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        offloaded = LlamaForCausalLM(model.config)  # no bytes in memory, as with disk offload
    offloaded.name_or_path = str(model_dir)
    assert weights_of(offloaded) == weights_fingerprint(WeightsSource(str(model_dir)))
    assert config_of(offloaded).startswith("config:"), "meta buffers enter by name, dtype and shape"
    offloaded.name_or_path = ""
    with pytest.raises(ConfigError, match="Namespace.weights: cannot fingerprint"):
        weights_of(offloaded)


# ---- bad input -------------------------------------------------------------------------------


def test_a_model_that_does_not_match_the_layout_or_namespace_is_refused_at_construction(
        model, model_dir, tmp_path):
    with (kvtier(model_dir, tmp_path / "fp16", kv_dtype="fp16") as kv16,  # half the bytes per layer
          pytest.raises(GeometryError, match="does not match the kvtier block layout")):
        HFKVTier(model, kv16, Namespace(NS.model, "fp16", BLOCK_TOKENS))
    other = KVTierConfig(model="llama-3-8b", kv_dtype="fp32", block_tokens=BLOCK_TOKENS,
                         tiers=(TierConfig(D, 1 << 21),), promote_to=None)
    with KVTier(other) as kv8b, pytest.raises(GeometryError, match="32 layers"):  # another geometry
        HFKVTier(model, kv8b, NS)
    with kvtier(model_dir, tmp_path / "fp32") as kv:
        with pytest.raises(ConfigError, match="block_tokens"):
            HFKVTier(model, kv, Namespace(NS.model, "fp32", 2 * BLOCK_TOKENS))
        with pytest.raises(GeometryError, match="kv_dtype"):
            HFKVTier(model, kv, Namespace(NS.model, "bf16", BLOCK_TOKENS))


def test_generate_refuses_model_inputs_its_keys_cannot_see(model, kv):
    hf = HFKVTier(model, kv, NS)
    a, _ = prompts()
    embeds = model.get_input_embeddings()(a)
    padded = torch.ones_like(a)
    padded[0, 0] = 0
    for name, value in (("inputs_embeds", embeds), ("attention_mask", padded)):
        with pytest.raises(ConfigError, match=f"HFKVTier.generate: {name} shapes the KV"):
            hf.generate(a, **{name: value}, **GEN)
    assert kv.lookup(block_keys(hf.namespace, a[0])) == 0, "nothing stored"
    assert hf.generate(a, attention_mask=torch.ones_like(a), **GEN).num_stored_blocks > 0


def test_prefix_cache_block_that_fails_to_load_is_a_miss_and_recomputed(model, probed, counted):
    kv, ssd = probed
    hf = HFKVTier(model, kv, NS)
    a, b = prompts()
    hf.generate(a, **GEN)
    keys = block_keys(hf.namespace, b[0])[:22]
    kv.prefetch(keys[:3], target=D).wait(WAIT_S)  # the first blocks above SSD, the rest below
    kv.quiesce(WAIT_S)
    tiers = kv.where(keys)
    leading = next(i for i, t in enumerate(tiers) if t is S)
    assert leading >= 3
    ssd.corrupt_next = 10**6  # every SSD read comes back corrupted: checksums catch it
    counted.clear()
    out = hf.generate(b, **GEN)
    assert out.num_cached_tokens == leading * BLOCK_TOKENS, "the prefix ends at the first bad block"
    assert counted[0] == b.shape[1] - leading * BLOCK_TOKENS
    assert kv.stats.checksum_errors > 0
    assert_same(out.output, default_generate(model, b))


def test_streaming_block_lost_mid_decode_is_recomputed(model, probed, counted):
    kv, ssd = probed
    hf = HFKVTier(model, kv, NS)
    a, _ = prompts()
    events: list[tuple[str, int]] = []

    def observe(event, value):
        events.append((event, value))
        if (event, value) == ("update_enter", NUM_LAYERS - 1) and events.count(("update_enter", 0)) == 4:
            ssd.corrupt_next = 1  # one bad read while the prefix is streamed: one block lost

    with hf.streaming_cache(observer=observe) as cache:
        cache.prepare(a)
        out = model.generate(a, past_key_values=cache, **GEN)
        assert cache.num_streamed_blocks == 24, "recomputed, stored again and streamed again"
    assert [v for e, v in events if e == "recompute"] == [96]
    assert kv.stats.checksum_errors == 1
    assert sum(counted) == a.shape[1] + NEW_TOKENS - 1 + 96, "the lost prefix is computed once more"
    assert_same(out, default_generate(model, a))


# ---- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_both_caches_on_cuda_match_default(model_dir, tmp_path):
    """The host staging, pinned buffers and device copies on a real GPU; HBM is device memory."""
    from transformers import AutoModelForCausalLM

    gpu_model = AutoModelForCausalLM.from_pretrained(model_dir).to("cuda").eval()
    layout = _layout(model_dir, "fp32")
    config = KVTierConfig(
        model=str(model_dir), kv_dtype="fp32", block_tokens=BLOCK_TOKENS,
        tiers=(TierConfig(H, 2 * layout.block_bytes, device="cuda"), TierConfig(D, 4 * layout.block_bytes),
               TierConfig(S, 64 * layout.block_bytes, path=tmp_path / "ssd", o_direct=False)))
    a, b = (p.to("cuda") for p in prompts())
    with KVTier(config) as kv:
        hf = HFKVTier(gpu_model, kv, NS)
        for streaming in (False, True):
            for ids in (a, b):
                out = hf.generate(ids, streaming=streaming, **GEN)
                assert_same(out.output, default_generate(gpu_model, ids))
            # b after a: the 22 shared blocks; on the second pass b's own 23 blocks (94 of its 95
            # tokens, one left to compute), stored by the first pass
            assert out.num_cached_tokens == (92 if streaming else 88)
