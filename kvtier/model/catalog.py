"""A built-in catalog of common models, as the published Hugging Face `config.json` fields that matter.

Each entry keeps the published values (layers, heads, KV heads, head size, sliding window, MLA ranks,
dtype) so `kvtier size` works offline. Names match case-insensitively, in short form (`llama-2-7b`,
`qwen2.5-7b`) or as Hugging Face ids (`meta-llama/Llama-2-7b-hf`, `Qwen/Qwen2.5-7B-Instruct`):
the organisation, a leading `Meta-` and the tags `hf`/`chat`/`instruct`/`it`/`pt`/`base` are ignored,
because those variants share their base model's geometry. They do not share KV: block keys must
name the weights the engine loaded, never the canonical catalog name.
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any

from kvtier.errors import GeometryError
from kvtier.model.geometry import KVDtype, ModelGeometry, from_hf_config, load_hf_config
from kvtier.units import check_number

_IGNORED_TAGS = frozenset({"hf", "chat", "instruct", "it", "pt", "base"})


def _llama(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, **extra: Any) -> dict[str, Any]:
    cfg = {
        "model_type": "llama", "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-05,
    }  # fmt: skip
    return cfg | extra


def _qwen(model_type: str, hidden: int, inter: int, layers: int, heads: int, kv_heads: int,
          **extra: Any) -> dict[str, Any]:
    """Qwen2.5/3: a sliding window is declared but not used (`use_sliding_window` false)."""
    cfg = {
        "model_type": model_type, "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "sliding_window": None,
        "use_sliding_window": False, "rope_theta": 1000000.0, "vocab_size": 151936, "torch_dtype": "bfloat16",
    }  # fmt: skip
    return cfg | extra


def _qwen3(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, **extra: Any) -> dict[str, Any]:
    extra = {"head_dim": 128, "max_position_embeddings": 40960} | extra
    return _qwen(extra.pop("model_type", "qwen3"), hidden, inter, layers, heads, kv_heads, **extra)


def _qwen3_moe(hidden: int, inter: int, expert_inter: int, layers: int, heads: int, kv_heads: int) -> dict[str, Any]:
    """Qwen3 MoE: 128 experts, 8 per token, in every layer; `inter` is the unused dense size."""
    return _qwen3(hidden, inter, layers, heads, kv_heads, model_type="qwen3_moe", moe_intermediate_size=expert_inter,
                  num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
                  tie_word_embeddings=False)  # fmt: skip


def _gemma3(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, head_dim: int) -> dict[str, Any]:
    """Gemma 3's text model: every 6th layer is global, the other five slide over 1,024 tokens."""
    return {
        "model_type": "gemma3_text", "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "sliding_window": 1024, "sliding_window_pattern": 6, "max_position_embeddings": 131072,
        "vocab_size": 262208, "torch_dtype": "bfloat16", "tie_word_embeddings": True,
    }  # fmt: skip


def _gpt_oss(layers: int, num_experts: int) -> dict[str, Any]:
    """gpt-oss: layers alternate a 128-token window and full attention; the experts ship in MXFP4."""
    return {
        "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": layers,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "attention_bias": True,
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
        "num_local_experts": num_experts, "num_experts_per_tok": 4, "max_position_embeddings": 131072,
        "vocab_size": 201088, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "mxfp4"},
    }  # fmt: skip


_LLAMA2 = {"max_position_embeddings": 4096, "vocab_size": 32000, "torch_dtype": "float16"}
_LLAMA3 = {"max_position_embeddings": 8192, "vocab_size": 128256, "rope_theta": 500000.0, "torch_dtype": "bfloat16"}
_LLAMA31 = _LLAMA3 | {"max_position_embeddings": 131072}
_QWEN25 = {
    "model_type": "qwen2", "max_position_embeddings": 131072, "vocab_size": 152064, "rope_theta": 1000000.0,
    "sliding_window": 131072, "use_sliding_window": False, "torch_dtype": "bfloat16",
}  # fmt: skip
_QWEN25_SMALL = {"max_position_embeddings": 32768, "tie_word_embeddings": True}  # 0.5B-3B: vocab 151,936, tied
_QWEN25_LARGE = {"max_position_embeddings": 131072, "vocab_size": 152064, "tie_word_embeddings": False}
_MISTRAL = {
    "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768, "torch_dtype": "bfloat16",
}  # fmt: skip
_DEEPSEEK_MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}

# canonical name -> (aliases, config). Aliases are matched after `_normalize`.
_CATALOG: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "Llama-2-7B": ((), _llama(4096, 11008, 32, 32, 32, **_LLAMA2)),
    "Llama-2-13B": ((), _llama(5120, 13824, 40, 40, 40, **_LLAMA2)),
    "Llama-2-70B": ((), _llama(8192, 28672, 80, 64, 8, **_LLAMA2)),
    "Llama-3-8B": ((), _llama(4096, 14336, 32, 32, 8, **_LLAMA3)),
    "Llama-3-70B": ((), _llama(8192, 28672, 80, 64, 8, **_LLAMA3)),
    "Llama-3.1-8B": ((), _llama(4096, 14336, 32, 32, 8, **_LLAMA31)),
    "Llama-3.1-70B": (("llama-3.3-70b",), _llama(8192, 28672, 80, 64, 8, **_LLAMA31)),  # 3.3: same architecture
    "Llama-3.1-405B": ((), _llama(16384, 53248, 126, 128, 8, **_LLAMA31)),
    "Llama-3.2-1B": ((), _llama(2048, 8192, 16, 32, 8, head_dim=64, tie_word_embeddings=True, **_LLAMA31)),
    "Llama-3.2-3B": ((), _llama(3072, 8192, 28, 24, 8, head_dim=128, tie_word_embeddings=True, **_LLAMA31)),
    "Qwen2.5-0.5B": ((), _qwen("qwen2", 896, 4864, 24, 14, 2, **_QWEN25_SMALL)),
    "Qwen2.5-1.5B": ((), _qwen("qwen2", 1536, 8960, 28, 12, 2, **_QWEN25_SMALL)),
    "Qwen2.5-3B": ((), _qwen("qwen2", 2048, 11008, 36, 16, 2, **_QWEN25_SMALL)),
    "Qwen2.5-7B": ((), {
        **_QWEN25, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "max_window_layers": 28,
    }),
    "Qwen2.5-14B": ((), _qwen("qwen2", 5120, 13824, 48, 40, 8, **_QWEN25_LARGE)),
    "Qwen2.5-32B": ((), _qwen("qwen2", 5120, 27648, 64, 40, 8, **_QWEN25_LARGE)),
    "Qwen2.5-72B": ((), {
        **_QWEN25, "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "max_window_layers": 80,
    }),
    "Qwen3-0.6B": ((), _qwen3(1024, 3072, 28, 16, 8, tie_word_embeddings=True)),
    "Qwen3-1.7B": ((), _qwen3(2048, 6144, 28, 16, 8, tie_word_embeddings=True)),
    "Qwen3-4B": ((), _qwen3(2560, 9728, 36, 32, 8, tie_word_embeddings=True)),
    "Qwen3-8B": ((), _qwen3(4096, 12288, 36, 32, 8, tie_word_embeddings=False)),
    "Qwen3-14B": ((), _qwen3(5120, 17408, 40, 40, 8, tie_word_embeddings=False)),
    "Qwen3-32B": ((), _qwen3(5120, 25600, 64, 64, 8, tie_word_embeddings=False)),
    "Qwen3-30B-A3B": ((), _qwen3_moe(2048, 6144, 768, 48, 32, 4)),
    "Qwen3-235B-A22B": ((), _qwen3_moe(4096, 12288, 1536, 94, 64, 4)),
    # v0.1 slides every layer over 4,096 tokens; v0.2/v0.3 dropped the window.
    "Mistral-7B": (("mistral-7b-v0.1",), {
        **_MISTRAL, "sliding_window": 4096, "rope_theta": 10000.0, "vocab_size": 32000,
    }),
    "Mistral-7B-v0.3": (("mistral-7b-v0.2",), {
        **_MISTRAL, "sliding_window": None, "rope_theta": 1000000.0, "vocab_size": 32768,
    }),
    "Mixtral-8x7B": (("mixtral-8x7b-v0.1",), {
        **_MISTRAL, "model_type": "mixtral", "sliding_window": None, "rope_theta": 1000000.0, "vocab_size": 32000,
        "num_local_experts": 8, "num_experts_per_tok": 2,
    }),
    "Mixtral-8x22B": (("mixtral-8x22b-v0.1",), {
        **_MISTRAL, "model_type": "mixtral", "hidden_size": 6144, "intermediate_size": 16384,
        "num_hidden_layers": 56, "num_attention_heads": 48, "sliding_window": None, "rope_theta": 1000000.0,
        "max_position_embeddings": 65536, "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2,
    }),
    "Mistral-Large-2": (("mistral-large-2407",), {
        **_MISTRAL, "hidden_size": 12288, "intermediate_size": 28672, "num_hidden_layers": 88,
        "num_attention_heads": 96, "head_dim": 128, "sliding_window": None, "rope_theta": 1000000.0,
        "max_position_embeddings": 131072, "vocab_size": 32768,
    }),
    "DeepSeek-V2-Lite": ((), {
        **_DEEPSEEK_MLA, "model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "q_lora_rank": None, "max_position_embeddings": 163840,
        "vocab_size": 102400, "torch_dtype": "bfloat16",
        "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
    }),
    # R1 and the V3 updates keep V3's architecture.
    "DeepSeek-V3": (("deepseek-v3-0324", "deepseek-v3.1", "deepseek-r1", "deepseek-r1-0528"), {
        **_DEEPSEEK_MLA, "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "q_lora_rank": 1536, "n_routed_experts": 256,
        "max_position_embeddings": 163840, "vocab_size": 129280, "torch_dtype": "bfloat16",
        "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "num_nextn_predict_layers": 1,
    }),
    # Published as float32 weights (served, and sized, as bf16 unless asked for);
    # even layers slide over 4,096 tokens, odd layers are global.
    "Gemma-2-9B": ((), {
        "model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "sliding_window": 4096,
        "max_position_embeddings": 8192, "vocab_size": 256000, "torch_dtype": "float32",
        "tie_word_embeddings": True,
    }),
    # Gemma 3 1B is left out: whether its window is 512 or 1,024 tokens is not settled here.
    "Gemma-3-4B": ((), _gemma3(2560, 10240, 34, 8, 4, 256)),
    "Gemma-3-12B": ((), _gemma3(3840, 15360, 48, 16, 8, 256)),
    "Gemma-3-27B": ((), _gemma3(5376, 21504, 62, 32, 16, 128)),
    "gpt-oss-20b": ((), _gpt_oss(24, 32)),
    "gpt-oss-120b": ((), _gpt_oss(36, 128)),
    # Not a real model: 4 layers x 2 KV heads x 16 dims in fp16 = 512 bytes/token, for tests and demos.
    "kvtier-tiny": (("tiny",), _llama(64, 128, 4, 4, 2, head_dim=16, vocab_size=256, torch_dtype="float16")),
}  # fmt: skip


def _normalize(name: str) -> str:
    """`meta-llama/Meta-Llama-3.1-8B-Instruct` -> `llama-3.1-8b`."""
    tail = name.strip().lower().rsplit("/", 1)[-1]
    parts = [p for p in tail.replace("_", "-").split("-") if p and p not in _IGNORED_TAGS]
    if parts[:1] == ["meta"]:
        parts = parts[1:]
    return "-".join(parts)


def _build_index() -> dict[str, str]:
    """Normalized name -> canonical name. Two entries may never share a name: a lookup would pick one silently."""
    index: dict[str, str] = {}
    for canonical, (aliases, _) in _CATALOG.items():
        for alias in (canonical, *aliases):
            key = _normalize(alias)
            if index.setdefault(key, canonical) != canonical:
                raise GeometryError(f"catalog: {alias!r} names both {index[key]} and {canonical}")
    return index


_INDEX = _build_index()


def catalog_names() -> list[str]:
    """The canonical names of every built-in model."""
    return list(_CATALOG)


def lookup_config(name: str) -> tuple[str, dict[str, Any]] | None:
    """Finds a built-in model by any of its names.

    Returns:
        (canonical name, a copy of its HF-shaped config), or None when the name is not in the catalog.
    """
    canonical = _INDEX.get(_normalize(name))
    if canonical is None:
        return None
    return canonical, copy.deepcopy(_CATALOG[canonical][1])


def catalog_match(name_or_path: str | Path) -> str | None:
    """The catalog name `name_or_path` resolves to, as `resolve_model` resolves it.

    Returns:
        The canonical name, or None when the argument is a config on disk or names no catalog model.
    """
    if _is_config_path(Path(name_or_path)):
        return None
    return _INDEX.get(_normalize(str(name_or_path)))


def match_note(name_or_path: str | Path) -> str | None:
    """`model: meta-llama/Llama-3.1-8B-Instruct matched as Llama-3.1-8B`, for a CLI to print.

    Returns:
        The line, or None when the name typed is the catalog's (in any case), a path, or not in the
        catalog: a reader then sees the name they typed, or the config's own name, or an error.
    """
    canonical = catalog_match(name_or_path)
    if canonical is None or str(name_or_path).lower() == canonical.lower():  # the same name, in other case
        return None
    return f"model: {name_or_path} matched as {canonical}"


def _is_config_path(path: Path) -> bool:
    return path.is_file() or (path.is_dir() and (path / "config.json").is_file())


def resolve_model(name_or_path: str | Path, kv_dtype: KVDtype | str | None = None) -> ModelGeometry:
    """The geometry of a catalog model or of a Hugging Face config on disk.

    Args:
        name_or_path: a catalog name or HF id, a path to a config.json, or a directory holding one.
            An existing path wins over a catalog name.
        kv_dtype: cache dtype; defaults to the model's published `torch_dtype`.

    Returns:
        The model's geometry, named by its canonical catalog name (or the config's own name).

    Raises:
        GeometryError: the name is unknown (the message lists close matches), the file is missing or
            unreadable, or its geometry is inconsistent.
    """
    path = Path(name_or_path)
    if _is_config_path(path):
        return from_hf_config(path, kv_dtype=kv_dtype)
    found = lookup_config(str(name_or_path))
    if found is not None:
        canonical, cfg = found
        return from_hf_config(cfg, kv_dtype=kv_dtype, name=canonical)
    if path.suffix == ".json" or path.is_dir():
        raise GeometryError(f"no model config at {str(path)!r}")
    raise GeometryError(_unknown_message(str(name_or_path)))


def _unknown_message(name: str) -> str:
    close = difflib.get_close_matches(_normalize(name), list(_INDEX), n=4, cutoff=0.5)
    suggestions = list(dict.fromkeys(_INDEX[c] for c in close))
    hint = f" (did you mean {' or '.join(suggestions)}?)" if suggestions else ""
    return (
        f"unknown model {name!r}{hint}. Known models: {', '.join(_CATALOG)}; "
        "or pass a path to a Hugging Face config.json"
    )


def resolve_config(name_or_path: str | Path) -> tuple[str, dict[str, Any]]:
    """The display name and HF-shaped config of a catalog model or a config on disk.

    Resolves exactly as `resolve_model` does (an existing path wins over a catalog name), for callers
    that need more of the config than the KV geometry, e.g. `count_weight_params`.

    Raises:
        GeometryError: unknown name (with close matches), or a missing or unreadable file.
    """
    path = Path(name_or_path)
    if _is_config_path(path):
        cfg, source = load_hf_config(path)
        return str(cfg.get("_name_or_path") or source or cfg.get("model_type") or "config"), cfg
    found = lookup_config(str(name_or_path))
    if found is not None:
        return found
    if path.suffix == ".json" or path.is_dir():
        raise GeometryError(f"no model config at {str(path)!r}")
    raise GeometryError(_unknown_message(str(name_or_path)))


# ---------------------------------------------------------------------------------------------
# weights: parameter counts from a config
#
# Counted: token embedding, attention projections (GQA; DeepSeek MLA with its low-rank q/kv
# projections), the MLP (gated SwiGLU/GeGLU unless the family is known to be ungated; MoE routed and
# shared experts and the router), RMSNorm weights and an untied lm_head. Not counted: biases other
# than Qwen2's q/k/v, `attention_bias` and gpt-oss's expert, router and attention-sink parameters,
# rotary buffers, and DeepSeek-V3's multi-token-prediction layer, which engines load only for
# speculative decoding. Checked against the published totals of
# every catalog model (tests/sizing/test_planner.py).

_UNGATED_MLP = frozenset({"gpt2", "gpt_neox", "gpt_bigcode", "starcoder2", "phi", "opt", "falcon"})
_QKV_BIAS = frozenset({"qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl"})
_QK_NORM = frozenset({"qwen3", "qwen3_moe", "gemma3", "gemma3_text", "olmo2"})
_FOUR_NORMS = frozenset({"gemma2", "gemma3", "gemma3_text"})  # pre/post attention and pre/post MLP
_EXPERT_BIAS = frozenset({"gpt_oss"})  # biased experts and router, one attention-sink logit per head


def count_weight_params(cfg: dict[str, Any], label: str = "config") -> dict[str, int]:
    """The parameters of a decoder-only model, by part.

    Args:
        cfg: a Hugging Face config dict (`resolve_config`).
        label: names the model in error messages.

    Returns:
        `{"embedding", "attention", "mlp", "norms", "lm_head"}` -> parameter count; `lm_head` is 0
        when the embedding is tied (`tie_word_embeddings`, which defaults to true only for Gemma).

    Raises:
        GeometryError: a field the count needs (`vocab_size`, `intermediate_size`, ...) is missing or
            not a positive integer; the message names it.
    """
    hidden = _positive(cfg, "hidden_size", label)
    num_layers = _positive(cfg, "num_hidden_layers", label)
    vocab = _positive(cfg, "vocab_size", label)
    model_type = str(cfg.get("model_type", ""))
    tied = cfg.get("tie_word_embeddings", model_type.startswith("gemma"))
    per_layer_norms = (4 if model_type in _FOUR_NORMS else 2) * hidden
    return {
        "embedding": vocab * hidden,
        "attention": num_layers * _attention_params(cfg, hidden, label),
        "mlp": sum(_mlp_params(cfg, hidden, layer, label) for layer in range(num_layers)),
        "norms": num_layers * per_layer_norms + hidden,
        "lm_head": 0 if tied else vocab * hidden,
    }


def _attention_params(cfg: dict[str, Any], hidden: int, label: str) -> int:
    heads = _positive(cfg, "num_attention_heads", label)
    if cfg.get("kv_lora_rank") is not None:
        return _mla_params(cfg, hidden, heads, label)
    kv_heads = _positive(cfg, "num_key_value_heads", label, default=heads)
    head_dim = cfg.get("head_dim") or hidden // heads
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    params = hidden * (q_dim + 2 * kv_dim) + q_dim * hidden
    if cfg.get("attention_bias"):
        params += q_dim + 2 * kv_dim + hidden
    elif cfg.get("model_type") in _QKV_BIAS:
        params += q_dim + 2 * kv_dim
    if cfg.get("model_type") in _QK_NORM:
        params += 2 * head_dim
    if cfg.get("model_type") in _EXPERT_BIAS:
        params += heads
    return params


def _mla_params(cfg: dict[str, Any], hidden: int, heads: int, label: str) -> int:
    """DeepSeek-V2/V3 multi-head latent attention: low-rank q (optional) and kv projections."""
    kv_rank = _positive(cfg, "kv_lora_rank", label)
    rope, nope = _positive(cfg, "qk_rope_head_dim", label), _positive(cfg, "qk_nope_head_dim", label)
    v_dim = _positive(cfg, "v_head_dim", label)
    q_out = heads * (nope + rope)
    q_rank = cfg.get("q_lora_rank")
    q = hidden * q_out if q_rank is None else hidden * q_rank + q_rank + q_rank * q_out
    kv = hidden * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim)
    return q + kv + heads * v_dim * hidden


def _mlp_params(cfg: dict[str, Any], hidden: int, layer: int, label: str) -> int:
    num_matrices = 2 if cfg.get("model_type") in _UNGATED_MLP else 3
    num_experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0
    if not num_experts or not _is_moe_layer(cfg, layer):
        return num_matrices * hidden * _positive(cfg, "intermediate_size", label)
    expert_inter = cfg.get("moe_intermediate_size") or _positive(cfg, "intermediate_size", label)
    shared_inter = (cfg.get("n_shared_experts") or 0) * expert_inter
    router = hidden * num_experts
    if cfg.get("shared_expert_intermediate_size"):  # Qwen-MoE: one shared expert with its own gate
        shared_inter += cfg["shared_expert_intermediate_size"]
        router += hidden
    if cfg.get("model_type") == "deepseek_v3":  # the router's score-correction bias
        router += num_experts
    if cfg.get("model_type") in _EXPERT_BIAS:
        router += num_experts * (2 * expert_inter + hidden + 1)  # gate/up and down biases, router bias
    return num_matrices * hidden * (num_experts * expert_inter + shared_inter) + router


def _is_moe_layer(cfg: dict[str, Any], layer: int) -> bool:
    """DeepSeek keeps its first `first_k_dense_replace` layers dense; Qwen-MoE lists `mlp_only_layers`."""
    if layer < (cfg.get("first_k_dense_replace") or 0) or layer in (cfg.get("mlp_only_layers") or ()):
        return False
    return layer % (cfg.get("moe_layer_freq") or 1) == 0 and (layer + 1) % (cfg.get("decoder_sparse_step") or 1) == 0


def _positive(cfg: dict[str, Any], field: str, label: str, default: Any = None) -> int:
    value = cfg.get(field, default)
    if value is None:
        raise GeometryError(f"{label}: config is missing {field!r}, needed to count the weights")
    return check_number(value, f"{label}: {field}", integral=True, positive=True, error=GeometryError)
