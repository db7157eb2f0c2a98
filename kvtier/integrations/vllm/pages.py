"""How vLLM lays out one engine block of one layer, and which layouts the connector stores.

Read once at start-up (`vllm_settings`): the page format's name goes into the block keys, and a KV
cache kvtier has not verified is refused with an error that says what and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError

# vLLM 0.32 allocates every layer's cache as a view of one buffer: logically [B, H, N, C] per layer
# (blocks, KV heads, tokens, content), physically in one of six orders (`KVCacheLayout`: LBHNC,
# LBNHC, LHBNC, BLHNC, BLNHC, BHLNC). The connector stores a block of a layer in the order of its
# *interior*, heads before tokens (`hn`) or tokens before heads (`nh`), whatever the nesting of layers
# and blocks around it, so layouts with the same interior yield the same bytes; what C holds is up
# to the attention backend. The name of the resulting format goes into the block keys, so blocks of
# two formats never share a key; two engines whose formats match share blocks, whatever the device.
HEAD_MAJOR_LAYOUTS = ("LBHNC", "LHBNC", "BLHNC", "BHLNC")  # H before N in memory
TOKEN_MAJOR_LAYOUTS = ("LBNHC", "BLNHC")
# Attention backends by what C holds:
#   CPU_ATTN reads a head's [N, C] as [2, N, C/2]: N rows of K, then N rows of V (`h(kv)nd`);
#   the CUDA backends read C as [K (head_size) | V (head_size_v)] of one token and head.
CPU_BACKENDS = ("CPU_ATTN",)
CUDA_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")
# MLA (DeepSeek-V2/V3 and kin) caches one latent per token, no heads and no separate V: each layer is
# `[B, N, C]`, C = the compressed KV (kv_lora_rank) then the decoupled RoPE key (qk_rope_head_dim),
# on every platform (`MLACommonBackend.get_kv_cache_shape`), so CPU and CUDA engines share blocks.
# AMX_MLA (CPUs with AMX tiles) and DeepSeek-V4's sparse backends pack pages otherwise: not listed.
MLA_BACKENDS = ("CPU_MLA", "TRITON_MLA", "FLASHMLA", "FLASH_ATTN_MLA", "CUTLASS_MLA", "FLASHINFER_MLA")
MLA_FORMAT = "vllm:n(c|pe)"
# Per-token-head quantized KV (int8_per_token_head, fp8_per_token_head), TRITON_ATTN only: each
# token and head's C holds [K | K scale (fp32) | V | V scale (fp32)] (`TritonAttentionImpl.
# _ensure_scale_caches`), so a page carries its own scales and is stored whole, scales included.
SCALED_BACKENDS = ("TRITON_ATTN",)
SCALE_BYTES = 2 * 4  # one fp32 scale for K and one for V, per token and head


@dataclass(frozen=True, slots=True)
class PageFormat:
    """How the connector stores one engine block of one layer, read from the engine at start-up.

    Attributes:
        name: goes into the block keys' namespace, e.g. `vllm:hn(kv)d`.
        layout: vLLM's `KVCacheLayout` name.
        head_major: the stored order is [heads, tokens, content], else [tokens, heads, content].
        backends: the attention backends whose reading of the bytes `name` describes.
        latent: an MLA latent page, `[tokens, content]` with no heads (`MLA_FORMAT`).
        scales: each token and head's content holds its quantization scales (`SCALED_BACKENDS`).
    """

    name: str
    layout: str
    head_major: bool
    backends: tuple[str, ...]
    latent: bool = False
    scales: bool = False


def page_format(device_type: str, layout: str | None, mla: bool = False, scales: bool = False) -> PageFormat:
    """The page format of an engine on `device_type` whose KV cache has vLLM layout `layout`.

    Args:
        device_type: vLLM's platform (`cpu`, `cuda`, ...).
        layout: the resolved `KVCacheLayout` name; None (not resolved, e.g. a config built outside
            an engine) means LBHNC, the only layout vLLM's CPU backend takes.
        mla: the cache holds MLA latents (one `[tokens, latent]` page per block, whatever `layout`).
        scales: per-token-head quantized KV whose scales live in the page (`SCALED_BACKENDS`).

    Raises:
        ConfigError: a platform or layout whose page format kvtier has not verified.
    """
    if mla:
        if device_type not in ("cpu", "cuda"):
            raise ConfigError(f"kv_connector: MLA on {device_type!r} is not supported yet (its page layout is "
                              "unverified); supported platforms: cpu, cuda")
        return PageFormat(MLA_FORMAT, "BNC", False, MLA_BACKENDS, latent=True)
    layout = layout or "LBHNC"
    if scales:
        if device_type != "cuda":
            raise ConfigError(f"kv_connector: per-token-head quantized KV on {device_type!r}: only vLLM's CUDA "
                              "TRITON_ATTN backend keeps its scales in the page; kvtier holds those pages on cuda only")
        if layout not in HEAD_MAJOR_LAYOUTS + TOKEN_MAJOR_LAYOUTS:
            raise ConfigError(f"kv_connector: KV cache layout {layout!r} is unknown to kvtier")
        head_major = layout in HEAD_MAJOR_LAYOUTS
        return PageFormat(f"vllm:{'hn' if head_major else 'nh'}(k,ks,v,vs)d", layout, head_major, SCALED_BACKENDS,
                          scales=True)
    if device_type == "cpu":
        # The CPU name predates layouts; kept so that blocks CPU engines already persisted still hit.
        if layout != "LBHNC":
            raise ConfigError(f"kv_connector: vLLM's CPU attention backend takes the LBHNC KV cache layout; "
                              f"this engine resolved {layout!r}, which kvtier has not verified on CPU")
        return PageFormat("vllm-cpu:h(kv)nd", layout, True, CPU_BACKENDS)
    if device_type == "cuda":
        if layout not in HEAD_MAJOR_LAYOUTS + TOKEN_MAJOR_LAYOUTS:
            raise ConfigError(f"kv_connector: KV cache layout {layout!r} is unknown to kvtier; supported: "
                              f"{', '.join(HEAD_MAJOR_LAYOUTS + TOKEN_MAJOR_LAYOUTS)}")
        head_major = layout in HEAD_MAJOR_LAYOUTS
        return PageFormat("vllm:hn(kv)d" if head_major else "vllm:nh(kv)d", layout, head_major, CUDA_BACKENDS)
    raise ConfigError(f"kv_connector: vLLM on {device_type!r} is not supported yet (its KV page layout is "
                      "unverified); supported platforms: cpu, cuda")


def check_spec(spec: Any) -> None:
    """Refuses a KV cache whose blocks are not plain per-token KV of causal attention.

    Held: full attention's K and V (`FullAttentionSpec`); a sliding-window group's
    (`SlidingWindowSpec`: the same pages, of which vLLM keeps those in the window); MLA's latent
    (`MLAAttentionSpec`: DeepSeek-V2/V3-style, one `[tokens, kv_lora_rank + rope]` page per block);
    per-token-head int8/fp8 pages as TRITON_ATTN lays them out, scales in the page (`inline_scales`).
    A `FullAttentionSpec` with a sliding window or an attention chunk is what vLLM makes of a hybrid
    model's layers with its hybrid allocator off: the cache keeps every token's K and V and the
    kernel applies the window, so every block is plain KV (`attention_variant` names the window in
    the keys). Per-tensor fp8 is plain bytes; its scales come with the weights, which every key names.

    Each refusal is a case where a stored block could come back as wrong KV or where its page is not
    one kvtier verified: non-causal (prefix-LM) layers, whose KV depends on later tokens; packed pages
    (int4 or NVFP4 quantization, padded or aligned pages, DeepSeek-V4's sparse MLA).
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    name = type(spec).__name__
    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec):  # others lay pages out otherwise
        raise ConfigError(f"kv_connector: kvtier holds attention KV (K and V, or an MLA latent) per token, of full "
                          f"or sliding-window layers; this model's cache is {name}, whose page layout kvtier has "
                          "not verified")
    mla = isinstance(spec, MLAAttentionSpec)
    sliding = isinstance(spec, SlidingWindowSpec)
    unsupported = {"sliding_window": mla and spec.sliding_window is not None,
                   "attention_chunk_size": mla and spec.attention_chunk_size is not None,
                   "non_causal": getattr(spec, "non_causal", False),
                   "num_head_slots": spec.num_head_slots is not None,
                   "state_content_bytes": spec.state_content_bytes is not None and not inline_scales(spec),
                   "page_size_padded": spec.page_size_padded is not None,
                   "tokens_per_state": spec.tokens_per_state != 1,
                   "kv_quant_mode": spec.kv_quant_mode.name not in ("NONE", "FP8_PER_TENSOR") and not
                   inline_scales(spec)}
    if sliding:
        unsupported["sliding_window"] = spec.sliding_window <= 0
    if mla:
        unsupported.update({
            "model_version": spec.model_version is not None,  # DeepSeek-V4: sparse, compressed pages
            "alignment": spec.alignment is not None,
            "cache_dtype_str": spec.cache_dtype_str not in (None, "auto", "fp8", "fp8_e4m3"),  # fp8_ds_mla packs
            "num_kv_heads": spec.num_kv_heads != 1})
    bad = [field for field, is_bad in unsupported.items() if is_bad]
    if bad:
        raise ConfigError(f"kv_connector: kvtier holds plain KV pages of causal attention; this model's "
                          f"{name} has {bad[0]}={getattr(spec, bad[0])!r}, which is not supported yet")


def attention_variant(spec: Any) -> str:
    """What of a held spec's attention changes its KV beyond the page format: the window or chunk
    of a layer that attends locally (the KV of every later layer depends on it). "" for plain full
    attention, so keys of plain models stay what they were."""
    parts = [f"window={spec.sliding_window}" if getattr(spec, "sliding_window", None) is not None else "",
             f"chunk={spec.attention_chunk_size}" if getattr(spec, "attention_chunk_size", None) is not None else ""]
    return ",".join(p for p in parts if p)


def inline_scales(spec: Any) -> bool:
    """Whether `spec` is per-token-head quantized KV laid out as TRITON_ATTN keeps it: int8 or fp8
    per token and head, each cell [K | fp32 scale | V | fp32 scale] (`state_content_bytes` says so,
    as `TritonAttentionBackend.customize_spec` sets it). Any other per-token-head or packed page
    (int4, NVFP4, TurboQuant) is refused."""
    mode = getattr(spec, "kv_quant_mode", None)
    if mode is None or mode.name not in ("INT8_PER_TOKEN_HEAD", "FP8_PER_TOKEN_HEAD"):
        return False
    head, head_v = spec.head_size, spec.head_size_v
    return head == head_v and head % 4 == 0 and spec.state_content_bytes == head + head_v + SCALE_BYTES and \
        spec.num_head_slots is None and spec.page_size_padded is None
