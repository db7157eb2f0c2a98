"""Random LoRA adapters for the tiny Llama of tests/support/vllm.py, built on disk (nothing downloaded).

An adapter is what PEFT saves and vLLM loads: `adapter_config.json` and `adapter_model.safetensors`
with `lora_A` (rank x in) and `lora_B` (out x rank) of every targeted projection of every layer.
Unlike PEFT's own initialisation (B = 0, an adapter that changes nothing), both are random, so
each adapter changes the keys and values of every layer and its outputs differ from the base model's.
"""

from __future__ import annotations

import json
from pathlib import Path


def build_lora(path: str | Path, *, seed: int, num_layers: int, hidden_size: int, kv_dim: int, rank: int = 8,
               targets: tuple[str, ...] = ("k_proj", "v_proj"), scale: float = 0.5) -> Path:
    """Writes a random rank-`rank` adapter on `targets` of `num_layers` layers into `path`; returns it.

    Args:
        seed: draws the weights; another seed is another adapter of the same shape and size.
        hidden_size: the model's hidden size (the projections' input).
        kv_dim: the output size of k_proj and v_proj (KV heads x head dim).
        scale: standard deviation of the random entries.
    """
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for target in targets:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden_size, generator=generator) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(kv_dim, rank, generator=generator) * scale
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
              "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "base_model_name_or_path": None, "modules_to_save": None, "use_rslora": False, "use_dora": False}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path
