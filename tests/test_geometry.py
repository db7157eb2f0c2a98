"""Model geometry, sizing math, Hugging Face config parsing and the built-in catalog.

Cost: about a second, pure Python; writes a few config.json files under tmp_path.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.model.catalog import catalog_match, catalog_names, lookup_config, match_note, resolve_model
from kvtier.errors import GeometryError, KVTierError
from kvtier.model.geometry import KVDtype, LayerKind, LayerSpec, ModelGeometry, from_hf_config

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def llama_config(**overrides):
    cfg = {
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "torch_dtype": "float16",
    }  # fmt: skip
    return cfg | overrides


# --- dtypes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "dtype", "width"),
    [("fp16", KVDtype.FP16, 2), ("BF16", KVDtype.BF16, 2), ("torch.bfloat16", KVDtype.BF16, 2),
     ("fp8_e4m3", KVDtype.FP8, 1), ("Int8", KVDtype.INT8, 1), ("float32", KVDtype.FP32, 4)],
)  # fmt: skip
def test_kv_dtype_parses_case_insensitively(name, dtype, width):
    assert KVDtype.parse(name) is dtype
    assert dtype.bytes == width


def test_unknown_kv_dtype_lists_valid_values():
    with pytest.raises(GeometryError, match="fp4.*fp16, bf16, fp8, int8, fp32"):
        KVDtype.parse("fp4")


# --- the figures an operator checks by hand ---------------------------------------------------


def test_llama2_7b_fp16_is_512_kib_per_token_and_16_gib_for_8_x_4096():
    model = resolve_model("llama-2-7b")
    assert model.kv_dtype is KVDtype.FP16
    assert model.kv_bytes_per_token() == 512 * KiB
    assert model.kv_bytes_total(4096, batch=8) == 16 * GiB


def test_qwen25_7b_is_56_kib_per_token():
    model = resolve_model("Qwen/Qwen2.5-7B-Instruct")
    assert model.kv_bytes_per_token() == 56 * KiB
    assert [model.kv_bytes_for_tokens(n) // MiB for n in (1024, 8192, 32768)] == [56, 448, 1792]
    assert model.kv_bytes_total([1024, 8192, 32768]) == 2296 * MiB


def test_32_layers_8_kv_heads_128_dims_fp16():
    model = ModelGeometry.uniform("gqa", num_layers=32, num_kv_heads=8, head_dim=128, kv_dtype="fp16",
                                  num_attention_heads=32)  # fmt: skip
    assert model.kv_bytes_per_token() == 128 * KiB
    assert model.kv_bytes_total(32768, batch=8) == 32 * GiB
    assert resolve_model("llama-3-8b").kv_bytes_per_token() == 128 * KiB


@pytest.mark.parametrize("eight_bit", ["fp8", "int8"])
@pytest.mark.parametrize(
    ("name", "tokens", "batch"), [("llama-2-7b", 4096, 8), ("qwen2.5-7b", 32768, 1), ("llama-3-8b", 32768, 8)]
)
def test_an_8_bit_cache_halves_every_figure(name, tokens, batch, eight_bit):
    wide = resolve_model(name, kv_dtype="fp16")
    narrow = resolve_model(name, kv_dtype=eight_bit)
    assert narrow.kv_bytes_per_token() * 2 == wide.kv_bytes_per_token()
    assert narrow.kv_bytes_total(tokens, batch) * 2 == wide.kv_bytes_total(tokens, batch)
    assert narrow.block_bytes(16) * 2 == wide.block_bytes(16)


def test_llama2_70b_gqa_needs_an_eighth_of_full_mha():
    _, cfg = lookup_config("llama-2-70b")
    gqa = from_hf_config(cfg)
    mha = from_hf_config(cfg | {"num_key_value_heads": 64})
    assert (gqa.num_attention_heads, gqa.num_kv_heads) == (64, 8)
    assert gqa.kv_bytes_per_token() * 8 == mha.kv_bytes_per_token()
    assert gqa.kv_bytes_per_token() == 2 * 80 * 8 * 128 * 2  # 320 KiB


# --- MLA and sliding windows, computed by hand ------------------------------------------------


def test_mla_stores_one_latent_per_token_and_layer():
    v2_lite = resolve_model("deepseek-ai/DeepSeek-V2-Lite-Chat")
    v3 = resolve_model("DeepSeek-V3")
    assert v2_lite.kv_bytes_per_token() == 27 * (512 + 64) * 2  # no factor 2 for K and V
    assert v3.kv_bytes_per_token() == 61 * (512 + 64) * 2
    assert v3.num_layers_by_kind() == {LayerKind.MLA: 61}
    assert v3.kv_bytes_for_tokens(1000) == 1000 * 61 * 576 * 2
    assert v3.with_kv_dtype("fp8").kv_bytes_per_token() == 61 * 576
    assert v3.block_layout(16).layer_bytes == (16 * 576 * 2,) * 61


def test_gemma2_alternates_sliding_and_global_layers():
    model = resolve_model("google/gemma-2-9b-it", kv_dtype="bf16")
    per_layer_token = 2 * 8 * 256 * 2  # 8 KiB
    assert [s.kind for s in model.layers[:3]] == [LayerKind.SLIDING, LayerKind.FULL, LayerKind.SLIDING]
    assert model.kv_bytes_per_token() == 42 * per_layer_token
    assert model.kv_bytes_per_token_by_kind() == {LayerKind.SLIDING: 21 * per_layer_token,
                                                  LayerKind.FULL: 21 * per_layer_token}  # fmt: skip
    assert model.kv_bytes_for_tokens(1000) == 42 * 1000 * per_layer_token  # inside the window
    assert model.kv_bytes_for_tokens(8192) == (21 * 8192 + 21 * 4096) * per_layer_token


def test_gemma2_float32_checkpoint_is_sized_in_16_bits_unless_asked():
    assert resolve_model("gemma-2-9b").kv_dtype is KVDtype.BF16
    assert resolve_model("gemma-2-9b", kv_dtype="fp32").kv_bytes_per_token() == 42 * 2 * 8 * 256 * 4


def test_mistral_v01_slides_every_layer():
    model = resolve_model("mistralai/Mistral-7B-v0.1")
    assert model.num_layers_by_kind() == {LayerKind.SLIDING: 32}
    assert model.kv_bytes_for_tokens(32768) == 32 * 4096 * (2 * 8 * 128 * 2)  # 512 MiB, capped at the window
    assert resolve_model("Mistral-7B-Instruct-v0.3").kv_bytes_for_tokens(32768) == 4 * GiB


def test_a_block_stores_every_layer_for_all_its_tokens_even_sliding_ones():
    model = resolve_model("mistral-7b")
    layout = model.block_layout(8192)  # bigger than the window
    assert layout.block_bytes == model.kv_bytes_per_token() * 8192
    assert layout.layer_range(1) == (8192 * 4096, 8192 * 4096)


def test_qwen2_max_window_layers_slide_the_upper_layers():
    cfg = llama_config(model_type="qwen2", num_hidden_layers=28, sliding_window=4096,
                       use_sliding_window=True, max_window_layers=20)  # fmt: skip
    kinds = [s.kind for s in from_hf_config(cfg).layers]
    assert kinds == [LayerKind.FULL] * 20 + [LayerKind.SLIDING] * 8
    assert from_hf_config(cfg | {"use_sliding_window": False}).num_layers_by_kind() == {LayerKind.FULL: 28}


def test_gemma3_pattern_and_explicit_layer_types():
    gemma3 = from_hf_config(llama_config(model_type="gemma3_text", num_hidden_layers=12, sliding_window=1024))
    assert [s.kind is LayerKind.FULL for s in gemma3.layers].count(True) == 2  # layers 5 and 11
    assert gemma3.layers[5].kind is LayerKind.FULL
    types = ["sliding_attention", "full_attention"] * 16
    explicit = from_hf_config(llama_config(layer_types=types, sliding_window=512))
    assert explicit.layers[0] == LayerSpec(LayerKind.SLIDING, 512)
    assert explicit.kv_bytes_for_tokens(2048) == (16 * 2048 + 16 * 512) * (2 * 8 * 128 * 2)


# --- config.json files ------------------------------------------------------------------------


def test_from_hf_config_reads_a_written_file_and_its_directory(tmp_path):
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(llama_config(torch_dtype="bfloat16")))
    by_file = from_hf_config(model_dir / "config.json")
    by_dir = resolve_model(str(model_dir))
    assert by_file == by_dir
    assert by_file.name == "my-model"
    assert (by_file.num_kv_heads, by_file.head_dim, by_file.kv_dtype) == (8, 128, KVDtype.BF16)
    assert resolve_model(model_dir / "config.json", kv_dtype="int8").kv_bytes_per_token() == 64 * KiB


def test_defaults_mha_and_head_dim_from_hidden_size():
    cfg = llama_config()
    del cfg["num_key_value_heads"]
    model = from_hf_config(cfg, name="mha")
    assert (model.name, model.num_kv_heads, model.head_dim) == ("mha", 32, 128)


def test_nested_text_config_is_used():
    model = from_hf_config({"model_type": "llava", "torch_dtype": "float16", "text_config": llama_config()})
    assert model.kv_bytes_per_token() == 128 * KiB


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_key_value_heads": 5}, "num_key_value_heads"),
        ({"hidden_size": 4100}, "hidden_size"),
        ({"num_hidden_layers": -1}, "num_hidden_layers"),
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"head_dim": -128}, "head_dim"),
        ({"num_hidden_layers": True}, "num_hidden_layers"),
        ({"num_hidden_layers": None}, "num_hidden_layers"),
        ({"layer_types": ["full_attention"] * 3}, "layer_types"),
        ({"layer_types": ["chunked_attention"] * 32}, "chunked_attention"),
        ({"layer_types": ["sliding_attention"] * 32}, "sliding_window"),
        ({"sliding_window": -4}, "sliding_window"),
        ({"kv_lora_rank": 512}, "qk_rope_head_dim"),
        ({"torch_dtype": "float4"}, "torch_dtype"),
    ],
)
def test_inconsistent_configs_name_the_field(overrides, field):
    with pytest.raises(GeometryError, match=field):
        from_hf_config(llama_config(**overrides))


def test_missing_hidden_size_and_head_dim_is_named():
    cfg = llama_config()
    del cfg["hidden_size"]
    with pytest.raises(GeometryError, match="missing required field 'hidden_size'"):
        from_hf_config(cfg)


def test_unreadable_config_files(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(GeometryError, match="cannot read model config"):
        from_hf_config(bad)
    with pytest.raises(GeometryError, match="no model config"):
        resolve_model(str(tmp_path / "absent.json"))


def test_model_geometry_validates_itself():
    with pytest.raises(GeometryError, match="not divisible"):
        ModelGeometry.uniform("x", 2, num_kv_heads=3, head_dim=64, kv_dtype="fp16", num_attention_heads=8)
    with pytest.raises(GeometryError, match="window_tokens"):
        LayerSpec(LayerKind.SLIDING)
    with pytest.raises(GeometryError, match="num_tokens"):
        resolve_model("tiny").kv_bytes_for_tokens(-1)
    with pytest.raises(GeometryError, match="block_tokens"):
        resolve_model("tiny").block_layout(0)


# --- catalog ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "canonical"),
    [("llama-2-7b", "Llama-2-7B"), ("meta-llama/Llama-2-7b-hf", "Llama-2-7B"),
     ("meta-llama/Llama-2-13b-chat-hf", "Llama-2-13B"), ("meta-llama/Meta-Llama-3.1-8B-Instruct", "Llama-3.1-8B"),
     ("meta-llama/Meta-Llama-3-8B-Instruct", "Llama-3-8B"), ("meta-llama/Llama-3.1-8B-Instruct", "Llama-3.1-8B"),
     ("meta-llama/Llama-3.3-70B-Instruct", "Llama-3.1-70B"), ("meta-llama/Llama-3.2-1B-Instruct", "Llama-3.2-1B"),
     ("QWEN2.5-7B", "Qwen2.5-7B"), ("Qwen/Qwen2.5-72B-Instruct", "Qwen2.5-72B"), ("Qwen/Qwen2.5-0.5B", "Qwen2.5-0.5B"),
     ("Qwen/Qwen3-8B", "Qwen3-8B"), ("qwen3-8b", "Qwen3-8B"), ("Qwen/Qwen3-30B-A3B", "Qwen3-30B-A3B"),
     ("mistralai/Mixtral-8x7B-Instruct-v0.1", "Mixtral-8x7B"),
     ("mistralai/Mixtral-8x22B-Instruct-v0.1", "Mixtral-8x22B"),
     ("mistralai/Mistral-Large-Instruct-2407", "Mistral-Large-2"), ("deepseek-ai/DeepSeek-V3-Base", "DeepSeek-V3"),
     ("deepseek-ai/DeepSeek-R1", "DeepSeek-V3"), ("google/gemma-3-27b-it", "Gemma-3-27B"),
     ("google/gemma-3-4b-pt", "Gemma-3-4B"), ("openai/gpt-oss-20b", "gpt-oss-20b"), ("tiny", "kvtier-tiny")],
)  # fmt: skip
def test_catalog_names_and_hf_ids_resolve(name, canonical):
    assert resolve_model(name).name == canonical


@pytest.mark.parametrize(
    ("name", "bytes_per_token"),
    [("Llama-2-13B", 2 * 40 * 40 * 128 * 2), ("Llama-3-70B", 2 * 80 * 8 * 128 * 2),
     ("Qwen2.5-72B", 2 * 80 * 8 * 128 * 2), ("Mixtral-8x7B", 2 * 32 * 8 * 128 * 2), ("kvtier-tiny", 512),
     # 2 (K and V) x layers x KV heads x head dim x 2 bytes (bf16)
     ("Llama-3.2-1B", 2 * 16 * 8 * 64 * 2), ("Llama-3.2-3B", 2 * 28 * 8 * 128 * 2),
     ("Llama-3.1-8B", 2 * 32 * 8 * 128 * 2), ("Llama-3.1-70B", 2 * 80 * 8 * 128 * 2),
     ("Llama-3.1-405B", 2 * 126 * 8 * 128 * 2),
     ("Qwen2.5-0.5B", 2 * 24 * 2 * 64 * 2), ("Qwen2.5-1.5B", 2 * 28 * 2 * 128 * 2),
     ("Qwen2.5-3B", 2 * 36 * 2 * 128 * 2),
     ("Qwen2.5-14B", 2 * 48 * 8 * 128 * 2), ("Qwen2.5-32B", 2 * 64 * 8 * 128 * 2),
     ("Qwen3-0.6B", 2 * 28 * 8 * 128 * 2), ("Qwen3-1.7B", 2 * 28 * 8 * 128 * 2), ("Qwen3-4B", 2 * 36 * 8 * 128 * 2),
     ("Qwen3-8B", 2 * 36 * 8 * 128 * 2), ("Qwen3-14B", 2 * 40 * 8 * 128 * 2), ("Qwen3-32B", 2 * 64 * 8 * 128 * 2),
     ("Qwen3-30B-A3B", 2 * 48 * 4 * 128 * 2), ("Qwen3-235B-A22B", 2 * 94 * 4 * 128 * 2),
     ("Mixtral-8x22B", 2 * 56 * 8 * 128 * 2), ("Mistral-Large-2", 2 * 88 * 8 * 128 * 2),
     ("Gemma-3-4B", 2 * 34 * 4 * 256 * 2), ("Gemma-3-12B", 2 * 48 * 8 * 256 * 2),
     ("Gemma-3-27B", 2 * 62 * 16 * 128 * 2),
     ("gpt-oss-20b", 2 * 24 * 8 * 64 * 2), ("gpt-oss-120b", 2 * 36 * 8 * 64 * 2)],
)  # fmt: skip
def test_catalog_published_geometry(name, bytes_per_token):
    assert resolve_model(name).kv_bytes_per_token() == bytes_per_token


def test_every_catalog_entry_is_consistent():
    for name in catalog_names():
        model = resolve_model(name)
        assert model.kv_bytes_per_token() > 0
        assert model.block_layout(16).num_layers == model.num_layers


def test_unknown_model_lists_close_matches():
    with pytest.raises(GeometryError, match=r"unknown model 'llama-2-8b' \(did you mean .*Llama-2-7B") as info:
        resolve_model("llama-2-8b")
    assert isinstance(info.value, KVTierError)
    assert "Known models" in str(info.value)


def test_unknown_newer_name_suggests_its_family_and_never_an_older_model():
    with pytest.raises(GeometryError, match=r"unknown model 'qwen3-9b' \(did you mean Qwen3-8B") as info:
        resolve_model("qwen3-9b")
    assert "Qwen2.5" not in str(info.value).split("Known models")[0]
    with pytest.raises(GeometryError, match=r"did you mean gpt-oss-20b or gpt-oss-120b\?"):
        resolve_model("gpt-oss-60b")


@pytest.mark.parametrize(
    ("name", "note"),
    [("meta-llama/Llama-3.1-8B-Instruct", "model: meta-llama/Llama-3.1-8B-Instruct matched as Llama-3.1-8B"),
     ("qwen3-8b", None), ("llama-2-7b", None),  # the catalog's name in another case: nothing to say
     ("Qwen/Qwen3-8B", "model: Qwen/Qwen3-8B matched as Qwen3-8B"),
     ("meta-llama/Llama-3.3-70B-Instruct", "model: meta-llama/Llama-3.3-70B-Instruct matched as Llama-3.1-70B"),
     ("Llama-3.1-8B", None), ("Qwen3-8B", None), ("no-such-model", None)],
)  # fmt: skip
def test_match_note_names_the_entry_whenever_the_name_typed_differs(name, note):
    assert match_note(name) == note


def test_a_config_on_disk_is_not_a_catalog_match(tmp_path):
    (tmp_path / "qwen3-8b").mkdir()
    (tmp_path / "qwen3-8b" / "config.json").write_text(json.dumps({"num_hidden_layers": 1, "num_attention_heads": 1,
                                                                   "hidden_size": 8}))  # fmt: skip
    assert catalog_match(tmp_path / "qwen3-8b") is None and match_note(tmp_path / "qwen3-8b") is None
    assert catalog_match("qwen3-8b") == "Qwen3-8B"


def test_gemma3_keeps_one_global_layer_in_six():
    model = resolve_model("google/gemma-3-12b-it")
    per_layer_token = 2 * 8 * 256 * 2
    assert [s.kind for s in model.layers[:6]] == [LayerKind.SLIDING] * 5 + [LayerKind.FULL]
    assert model.num_layers_by_kind() == {LayerKind.SLIDING: 40, LayerKind.FULL: 8}
    assert {s.window_tokens for s in model.layers if s.kind is LayerKind.SLIDING} == {1024}
    assert model.kv_bytes_for_tokens(8192) == (40 * 1024 + 8 * 8192) * per_layer_token


def test_gpt_oss_alternates_a_128_token_window_and_full_attention():
    model = resolve_model("openai/gpt-oss-120b")
    per_layer_token = 2 * 8 * 64 * 2
    assert [s.kind for s in model.layers[:4]] == [LayerKind.SLIDING, LayerKind.FULL] * 2
    assert model.num_layers_by_kind() == {LayerKind.SLIDING: 18, LayerKind.FULL: 18}
    assert model.kv_bytes_for_tokens(4096) == (18 * 128 + 18 * 4096) * per_layer_token


def test_newer_models_are_their_own_entries_with_their_own_context():
    assert lookup_config("llama-3.1-8b")[1]["max_position_embeddings"] == 131072
    assert lookup_config("llama-3-8b")[1]["max_position_embeddings"] == 8192
    assert resolve_model("llama-3.1-8b").kv_bytes_per_token() == resolve_model("llama-3-8b").kv_bytes_per_token()


def test_lookup_returns_a_copy():
    _, cfg = lookup_config("llama-2-7b")
    cfg["num_hidden_layers"] = 1
    assert resolve_model("llama-2-7b").num_layers == 32


# --- properties -------------------------------------------------------------------------------

lengths = st.lists(st.integers(min_value=0, max_value=1 << 20), max_size=5)


@given(lens=lengths, batch=st.integers(min_value=1, max_value=64))
def test_total_is_additive_and_linear_in_batch(lens, batch):
    model = resolve_model("gemma-2-9b")
    assert model.kv_bytes_total(lens, batch) == batch * sum(model.kv_bytes_for_tokens(n) for n in lens)


@given(a=st.integers(min_value=0, max_value=1 << 20), b=st.integers(min_value=0, max_value=1 << 20))
def test_window_bytes_grow_monotonically_and_never_exceed_full(a, b):
    model = resolve_model("gemma-2-9b")
    lo, hi = sorted((a, b))
    assert model.kv_bytes_for_tokens(lo) <= model.kv_bytes_for_tokens(hi) <= model.kv_bytes_per_token() * hi
