"""A built-in catalog of common models, as the published Hugging Face `config.json` fields that matter.

Each entry keeps the published values (layers, heads, KV heads, head size, sliding window, MLA ranks,
dtype) so `kvtier size` works offline. Names match case-insensitively, in short form (`llama-2-7b`,
`qwen2.5-7b`) or as Hugging Face ids (`meta-llama/Llama-2-7b-hf`, `Qwen/Qwen2.5-7B-Instruct`):
the organisation, a leading `Meta-` and the tags `hf`/`chat`/`instruct`/`it`/`base` are ignored,
because those variants share their base model's geometry. They do not share KV: block keys must
name the weights the engine loaded, never the canonical catalog name.
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any

from kvtier.errors import GeometryError
from kvtier.geometry import KVDtype, ModelGeometry, from_hf_config

_IGNORED_TAGS = frozenset({"hf", "chat", "instruct", "it", "base"})


def _llama(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, **extra: Any) -> dict[str, Any]:
    cfg = {
        "model_type": "llama", "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-05,
    }  # fmt: skip
    return cfg | extra


_LLAMA2 = {"max_position_embeddings": 4096, "vocab_size": 32000, "torch_dtype": "float16"}
_LLAMA3 = {"max_position_embeddings": 8192, "vocab_size": 128256, "rope_theta": 500000.0, "torch_dtype": "bfloat16"}
_QWEN25 = {
    "model_type": "qwen2", "max_position_embeddings": 131072, "vocab_size": 152064, "rope_theta": 1000000.0,
    "sliding_window": 131072, "use_sliding_window": False, "torch_dtype": "bfloat16",
}  # fmt: skip
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
    "Llama-3-8B": (("llama-3.1-8b",), _llama(4096, 14336, 32, 32, 8, **_LLAMA3)),
    "Llama-3-70B": (("llama-3.1-70b", "llama-3.3-70b"), _llama(8192, 28672, 80, 64, 8, **_LLAMA3)),
    "Qwen2.5-7B": ((), {
        **_QWEN25, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "max_window_layers": 28,
    }),
    "Qwen2.5-72B": ((), {
        **_QWEN25, "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "max_window_layers": 80,
    }),
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
    "DeepSeek-V2-Lite": ((), {
        **_DEEPSEEK_MLA, "model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "q_lora_rank": None, "max_position_embeddings": 163840,
        "vocab_size": 102400, "torch_dtype": "bfloat16",
    }),
    "DeepSeek-V3": ((), {
        **_DEEPSEEK_MLA, "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "q_lora_rank": 1536, "n_routed_experts": 256,
        "max_position_embeddings": 163840, "vocab_size": 129280, "torch_dtype": "bfloat16",
    }),
    # Published as float32 weights (served, and sized, as bf16 unless asked for);
    # even layers slide over 4,096 tokens, odd layers are global.
    "Gemma-2-9B": ((), {
        "model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "sliding_window": 4096,
        "max_position_embeddings": 8192, "vocab_size": 256000, "torch_dtype": "float32",
    }),
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
    index: dict[str, str] = {}
    for canonical, (aliases, _) in _CATALOG.items():
        for alias in (canonical, *aliases):
            index[_normalize(alias)] = canonical
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
    if path.is_file() or (path.is_dir() and (path / "config.json").is_file()):
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
