"""The vLLM connector on every KV cache layout vLLM 0.32's CUDA attention backends can hand it.

The caches are allocated by vLLM's own code (`get_kv_cache_config_from_groups`, `allocate_kv_cache`,
which work on CPU tensors), filled with distinct values, and moved through the connector's worker
half (`engine_block_view` + `WorkerSide`) into a real `KVTier` on an SSD directory and back into a
second vLLM allocation. Each stored block must be exactly its tokens' K and V for each layer, read
the way the CUDA backends read the cache (`C.split(head_size)`), in the order the page format names;
the round trip must be byte-for-byte and write nothing else. The `gpu` test does the same on CUDA
tensors with the cupy kernels and the torch path.

Cost: about 10 s on CPU (vLLM imports included).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvtier.errors import ConfigError, GeometryError
from kvtier.integrations.vllm.pages import HEAD_MAJOR_LAYOUTS, TOKEN_MAJOR_LAYOUTS
from kvtier.integrations.vllm.scheduler import LoadSpec, StoreSpec
from kvtier.integrations.vllm.settings import EngineFacts, read_settings
from kvtier.integrations.vllm.transfers import WorkerSide, engine_block_view
from kvtier.model.keys import block_keys
from kvtier.moving.native import Kernels, gather_blocks, scatter_blocks
from kvtier.runtime import KVTier

pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_check

BLOCK, KV_HEADS, HEAD_DIM, NUM_LAYERS, NUM_BLOCKS = 16, 2, 8, 3, 10
LAYER_NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS))
LAYOUTS = HEAD_MAJOR_LAYOUTS + TOKEN_MAJOR_LAYOUTS
CASES = [(layout, ratio) for layout in LAYOUTS for ratio in gpu_check.kernel_ratios(layout)]
DTYPE_NAMES = {torch.bfloat16: ("bfloat16", "bf16"), torch.float16: ("float16", "fp16")}
# On a GPU both copy paths run; the kernel's launches go through cupy.
CUDA_BACKENDS = [pytest.param(Kernels.CUDA, marks=pytest.mark.skipif(importlib.util.find_spec("cupy") is None,
                                                                     reason="Kernels.CUDA needs cupy")),
                 Kernels.TORCH]


def vllm_caches(layout: str, ratio: int, dtype=torch.bfloat16, device="cpu",
                alignment: int | None = None) -> dict[str, torch.Tensor]:
    """The per-layer caches vLLM's GPU model runner registers with a connector, made by vLLM's code
    (`alignment`: a backend's `block_stride_alignment`, which pads the stride between blocks)."""
    from vllm.config import CacheConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    cache_config = CacheConfig(block_size=BLOCK, num_gpu_blocks_override=NUM_BLOCKS)
    cache_config.kv_cache_layout = layout
    vllm_config = SimpleNamespace(cache_config=cache_config, attention_config=SimpleNamespace(hisparse_config=None))
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=dtype,
                             block_stride_alignment=alignment)
    kv_cache_config = get_kv_cache_config_from_groups(vllm_config, [KVCacheGroupSpec(list(LAYER_NAMES), spec)],
                                                      available_memory=1 << 30)
    assert kv_cache_config.num_blocks == NUM_BLOCKS
    return allocate_kv_cache(kv_cache_config, torch.device(device), KVCacheLayout[layout], [BLOCK // ratio])


def fill_distinct(caches: dict[str, torch.Tensor]) -> None:
    """Every 16-bit element of every layer gets its own value (there are fewer than 32,768)."""
    values = torch.arange(sum(kv.numel() for kv in caches.values()), dtype=torch.int16)
    start = 0
    for kv in caches.values():
        raw = kv.view(torch.int16)
        raw.copy_(values[start:start + raw.numel()].reshape(raw.shape))
        start += raw.numel()


def token_kv(kv: torch.Tensor, block: int, ratio: int, head: int, token: int) -> bytes:
    """K then V of one token and head of engine block `block`, as the CUDA backends read them (each
    half of C: K or V, followed by its scale in a per-token-head quantized page)."""
    kernel_tokens = kv.shape[2]
    key, value = kv.transpose(1, 2).split(kv.shape[-1] // 2, dim=-1)  # flash_attn.py / triton_attn.py
    row, col = block * ratio + token // kernel_tokens, token % kernel_tokens
    return bytes(key[row, col, head].contiguous().view(torch.uint8).tolist()
                 + value[row, col, head].contiguous().view(torch.uint8).tolist())


def expected_block(kv: torch.Tensor, block: int, ratio: int, head_major: bool) -> bytes:
    """One layer of a stored block: tokens' K|V, heads outside tokens (head_major) or inside."""
    pairs = [(h, t) for h in range(KV_HEADS) for t in range(BLOCK)] if head_major else \
        [(h, t) for t in range(BLOCK) for h in range(KV_HEADS)]
    return b"".join(token_kv(kv, block, ratio, h, t) for h, t in pairs)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("layouts-model")
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": KV_HEADS * 2 * HEAD_DIM,
        "num_attention_heads": KV_HEADS * 2, "num_key_value_heads": KV_HEADS, "num_hidden_layers": NUM_LAYERS,
        "intermediate_size": 64, "vocab_size": 512, "torch_dtype": "bfloat16"}))
    return path


def cuda_settings(tmp_path: Path, model_dir: Path, layout: str, dtype=torch.bfloat16):
    """The connector's settings for a CUDA engine with `layout`, over an SSD tier in tmp_path."""
    import yaml

    engine_dtype, kvtier_dtype = DTYPE_NAMES[dtype]
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump({"model": str(model_dir), "kv_dtype": kvtier_dtype, "block_tokens": BLOCK,
                                    "tiers": {"ssd": {"capacity": "1MiB", "path": str(tmp_path / "ssd"),
                                                      "o_direct": False}}}))
    page_bytes = KV_HEADS * BLOCK * 2 * HEAD_DIM * torch.empty((), dtype=dtype).element_size()
    facts = EngineFacts(model_id="tiny", block_size=BLOCK, kv_dtype=engine_dtype, layer_names=LAYER_NAMES,
                        page_bytes=page_bytes, device_type="cuda",
                        kv_role="kv_both", kv_cache_layout=layout)
    return read_settings({"kvtier_config": str(path)}, facts)


def views_of(caches: dict[str, torch.Tensor], settings) -> list[torch.Tensor]:
    return [engine_block_view(caches[name], NUM_BLOCKS, BLOCK, settings.layout.layer_bytes[i],
                              settings.page_format.head_major) for i, name in enumerate(LAYER_NAMES)]


# ---- vLLM's allocation, pinned ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("layout, ratio", CASES)
def test_the_gpu_checks_reproduction_lays_caches_out_as_vllm_does(layout, ratio):
    ours = gpu_check.vllm_layout_caches(layout, NUM_LAYERS, NUM_BLOCKS, KV_HEADS, BLOCK, HEAD_DIM, torch.bfloat16,
                                        "cpu", ratio=ratio)
    theirs = list(vllm_caches(layout, ratio).values())
    for a, b in zip(ours, theirs, strict=True):
        assert (a.shape, a.stride(), a.storage_offset(), a.dtype) == (b.shape, b.stride(), b.storage_offset(), b.dtype)
    assert ours[0].untyped_storage().nbytes() == theirs[0].untyped_storage().nbytes()
    assert all(b.untyped_storage().data_ptr() == theirs[0].untyped_storage().data_ptr() for b in theirs)  # one buffer


@pytest.mark.parametrize("layout", [x for x in LAYOUTS if 2 not in gpu_check.kernel_ratios(x)])
def test_vllm_splits_blocks_into_kernel_blocks_only_where_a_block_is_one_dense_page(layout):
    with pytest.raises(ValueError, match="cannot be split"):
        vllm_caches(layout, 2)
    with pytest.raises(ValueError, match="does not split"):
        gpu_check.vllm_layout_caches(layout, NUM_LAYERS, NUM_BLOCKS, KV_HEADS, BLOCK, HEAD_DIM, torch.bfloat16,
                                     "cpu", ratio=2)


# ---- geometry read from the tensors -----------------------------------------------------------------


@pytest.mark.parametrize("layout, ratio", CASES)
def test_each_block_is_read_as_runs_its_layout_implies(tmp_path, model_dir, layout, ratio):
    from kvtier.moving.native import PagedLayer

    settings = cuda_settings(tmp_path, model_dir, layout)
    geometry = PagedLayer.of(views_of(vllm_caches(layout, ratio), settings)[1], None)
    # one page; one run per head where heads sit outside blocks; per head and kernel block where a
    # block is split and heads come first within a kernel block
    runs = {"LHBNC": KV_HEADS, "BHLNC": KV_HEADS}.get(layout, KV_HEADS * ratio if layout == "LBHNC" and ratio > 1 else 1)
    assert geometry.num_runs == runs
    assert geometry.page_bytes == KV_HEADS * BLOCK * 2 * HEAD_DIM * 2


def test_a_cache_that_disagrees_with_the_layout_is_refused(tmp_path, model_dir):
    settings = cuda_settings(tmp_path, model_dir, "LBHNC")
    token_major = vllm_caches("LBNHC", 1)[LAYER_NAMES[0]]  # the engine said LBHNC, the strides say LBNHC
    with pytest.raises(GeometryError, match="put tokens outside heads"):
        engine_block_view(token_major, NUM_BLOCKS, BLOCK, settings.layout.layer_bytes[0], True)
    with pytest.raises(GeometryError, match="covering 16 tokens"):
        engine_block_view(token_major[:, :, :8], NUM_BLOCKS, BLOCK, settings.layout.layer_bytes[0], False)
    with pytest.raises(GeometryError, match="kvtier's layout 512"):
        engine_block_view(token_major, NUM_BLOCKS, BLOCK, 512, False)


# ---- the worker half through a real KVTier on disk --------------------------------------------------


def round_trip(settings, caches, fresh, backend: Kernels | None = None) -> None:
    """Stores blocks (7, 2, 5) of `caches` through WorkerSide, checks kvtier's bytes by meaning, loads them
    into blocks (1, 8, 4) of `fresh` and checks those, byte for byte, and that nothing else changed."""
    ratio = next(iter(caches.values())).shape[0] // NUM_BLOCKS
    head_major = settings.page_format.head_major
    kvtier = KVTier(settings.config, layout=settings.layout)
    try:
        keys = tuple(block_keys(settings.namespace, list(range(3 * BLOCK))))
        source, target = (7, 2, 5), (1, 8, 4)
        saver = WorkerSide(kvtier, settings.layout, views_of(caches, settings), timeout_s=10)
        stores = [StoreSpec("a", keys, source, source)]
        for layer in range(NUM_LAYERS):
            saver.save_layer(layer, stores)
        assert saver.end_step(stores) == set()
        saver.close(10)
        assert saver.stats.num_blocks_stored == 3

        held = torch.zeros(3, settings.layout.block_bytes, dtype=torch.uint8)
        handle = kvtier.load(keys, held)
        handle.wait(10)
        assert not handle.failed
        for row, block in enumerate(source):
            for layer, name in enumerate(LAYER_NAMES):
                start, length = settings.layout.layer_range(layer)
                want = expected_block(caches[name].cpu(), block, ratio, head_major)
                assert bytes(held[row, start:start + length].tolist()) == want, (name, block)

        loader = WorkerSide(kvtier, settings.layout, views_of(fresh, settings), timeout_s=10)
        loader.start_loads([LoadSpec("b", keys, target)])
        for layer in range(NUM_LAYERS):
            loader.wait_layer(layer)
        assert loader.end_step() == set()
        if next(iter(fresh.values())).is_cuda:
            torch.cuda.synchronize()
        for name in LAYER_NAMES:
            old, new = caches[name].cpu(), fresh[name].cpu()
            for src, dst in zip(source, target):
                assert torch.equal(new[dst * ratio:(dst + 1) * ratio].view(torch.uint8),
                                   old[src * ratio:(src + 1) * ratio].view(torch.uint8))
            rest = new.unflatten(0, (NUM_BLOCKS, ratio)).clone()
            rest[list(target)] = 0
            assert rest.view(torch.uint8).count_nonzero() == 0, f"{name}: bytes outside the loaded blocks changed"
    finally:
        kvtier.close()


@pytest.mark.parametrize("layout, ratio", CASES)
def test_round_trip_through_kvtier_on_disk_is_exact_and_means_each_tokens_kv(tmp_path, model_dir, layout, ratio):
    settings = cuda_settings(tmp_path, model_dir, layout)
    caches = vllm_caches(layout, ratio)
    fill_distinct(caches)
    round_trip(settings, caches, vllm_caches(layout, ratio))


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_blocks_padded_apart_round_trip_too(tmp_path, model_dir, layout):
    settings = cuda_settings(tmp_path, model_dir, layout)
    caches = vllm_caches(layout, 1, alignment=1536)  # pages of 1,024 bytes, 1,536 apart
    assert caches[LAYER_NAMES[0]].stride(0) * 2 == 1536
    fill_distinct(caches)
    round_trip(settings, caches, vllm_caches(layout, 1, alignment=1536))


def test_layouts_with_one_interior_order_store_the_same_bytes_under_the_same_keys(tmp_path, model_dir):
    """LHBNC (FlashAttention, per-head runs) and BLHNC (FlashInfer's Blackwell kernels) share blocks."""
    stored = {}
    for layout in ("LHBNC", "BLHNC", "LBHNC"):
        (tmp_path / layout).mkdir()
        settings = cuda_settings(tmp_path / layout, model_dir, layout)
        caches = vllm_caches(layout, 1)
        for name, kv in caches.items():  # the same K/V per (block, head, token) in every layout
            logical = torch.arange(kv.numel(), dtype=torch.int16).reshape(kv.shape)
            kv.view(torch.int16).copy_(logical + 1000 * LAYER_NAMES.index(name))
        rows = torch.zeros(NUM_BLOCKS, settings.layout.block_bytes, dtype=torch.uint8)
        gather_blocks(views_of(caches, settings), list(range(NUM_BLOCKS)), rows, settings.layout, None)
        stored[layout] = (settings.namespace, rows)
    namespaces = {ns for ns, _ in stored.values()}
    assert len(namespaces) == 1
    assert all(torch.equal(rows, stored["LBHNC"][1]) for _, rows in stored.values())


def test_cpu_and_cuda_formats_never_share_keys(tmp_path, model_dir):
    cuda = cuda_settings(tmp_path, model_dir, "LBHNC")
    cpu = read_settings({"kvtier_config": str(tmp_path / "kvtier.yaml")},
                        EngineFacts(model_id="tiny", block_size=BLOCK, kv_dtype="bfloat16", layer_names=LAYER_NAMES,
                                    page_bytes=cuda.layout.layer_bytes[0], device_type="cpu",
                                    kv_role="kv_both"))
    assert cpu.namespace != cuda.namespace
    token_major = cuda_settings(tmp_path, model_dir, "LBNHC")
    assert len({cpu.namespace, cuda.namespace, token_major.namespace}) == 3


# ---- start-up refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize("changes, variant", [({}, ""), ({"sliding_window": 64}, "window=64"),
                                             ({"attention_chunk_size": 64}, "chunk=64")])
def test_a_full_attention_cache_of_local_layers_is_held_and_its_window_named_in_the_keys(changes, variant):
    """A hybrid model with vLLM's hybrid allocator off: every layer a FullAttentionSpec that keeps
    every token, the window applied by the kernel; the window changes later layers' KV, so keys name it."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvtier.integrations.vllm.pages import attention_variant, check_spec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16,
                             **changes)
    check_spec(spec)  # held: no error
    assert attention_variant(spec) == variant


@pytest.mark.parametrize("changes, message", [
    ({"non_causal": True}, "non_causal=True"),
    ({"num_head_slots": 4}, "num_head_slots=4"),
    ({"state_content_bytes": 40}, "state_content_bytes=40"),
])
def test_caches_kvtier_cannot_read_are_refused_at_start_up_naming_why(changes, message):
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    from kvtier.integrations.vllm.settings import engine_facts

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16,
                             **changes)
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(list(LAYER_NAMES), spec)])
    with pytest.raises(ConfigError, match=message):
        engine_facts(SimpleNamespace(), config)


MLA_LATENT = 512 + 64  # DeepSeek's kv_lora_rank + qk_rope_head_dim


def mla_caches(dtype=torch.bfloat16, **spec_fields) -> tuple[dict[str, torch.Tensor], object]:
    """The per-layer MLA caches vLLM registers with a connector, made by vLLM's own code, and its
    KVCacheConfig."""
    from vllm.config import CacheConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MLAAttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    cache_config = CacheConfig(block_size=BLOCK, num_gpu_blocks_override=NUM_BLOCKS)
    cache_config.kv_cache_layout = "LBHNC"  # what an engine resolves; MLA pages are [N, latent] in any
    vllm_config = SimpleNamespace(cache_config=cache_config, attention_config=SimpleNamespace(hisparse_config=None))
    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=MLA_LATENT, dtype=dtype, **spec_fields)
    config = get_kv_cache_config_from_groups(vllm_config, [KVCacheGroupSpec(list(LAYER_NAMES), spec)],
                                             available_memory=1 << 30)
    return allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC, [BLOCK]), config


@pytest.fixture(scope="module")
def mla_model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mla-model")
    (path / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": NUM_LAYERS, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32, "intermediate_size": 64,
        "vocab_size": 512, "torch_dtype": "bfloat16"}))
    return path


def test_a_hybrid_of_attention_and_recurrent_state_is_refused_naming_the_layer_type():
    """Mamba-style recurrent state (one state per request, not per token) cannot be held as blocks."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from kvtier.integrations.vllm.settings import engine_facts

    attention = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.bfloat16,))
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(list(LAYER_NAMES[:2]), attention), KVCacheGroupSpec(["model.layers.2.mixer"], mamba)])
    with pytest.raises(ConfigError, match=r"this model's cache is MambaSpec.*model\.layers\.2\.mixer"):
        engine_facts(SimpleNamespace(), config)


def test_groups_of_different_block_sizes_are_refused_naming_what_differs():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    from kvtier.integrations.vllm.settings import engine_facts

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16)
    sliding = SlidingWindowSpec(block_size=2 * BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16,
                                sliding_window=64)
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(list(LAYER_NAMES[:2]), full), KVCacheGroupSpec(list(LAYER_NAMES[2:]), sliding)])
    with pytest.raises(ConfigError, match=r"groups differ in block_size \(\['16', '32'\]\)"):
        engine_facts(SimpleNamespace(), config)


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_mla_latents_round_trip_from_vllms_own_allocation_token_by_token(tmp_path, mla_model_dir, device_type):
    """vLLM views an MLA layer as `[B, 1, N, latent]`; a stored block is its tokens' latents in
    order, the same bytes whatever the platform (CPU and CUDA engines share keys)."""
    import yaml

    from kvtier.integrations.vllm.settings import engine_facts

    caches, config = mla_caches()
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump({"model": str(mla_model_dir), "kv_dtype": "bf16", "block_tokens": BLOCK,
                                    "tiers": {"dram": {"capacity": "1MiB"}}}))
    page_bytes = config.kv_cache_groups[0].kv_cache_spec.real_page_size_bytes
    assert page_bytes == BLOCK * MLA_LATENT * 2
    facts = EngineFacts(model_id="tiny-mla", block_size=BLOCK, kv_dtype="bfloat16", layer_names=LAYER_NAMES,
                        page_bytes=page_bytes, device_type=device_type, kv_role="kv_both", mla=True)
    settings = read_settings({"kvtier_config": str(path)}, facts)
    assert settings.page_format.latent and settings.namespace.kv_dtype == "bfloat16;vllm:n(c|pe)"
    fill_distinct(caches)
    views = [engine_block_view(caches[n], NUM_BLOCKS, BLOCK, page_bytes, False, True) for n in LAYER_NAMES]
    kvtier = KVTier(settings.config, layout=settings.layout)
    try:
        keys = tuple(block_keys(settings.namespace, list(range(2 * BLOCK))))
        saver = WorkerSide(kvtier, settings.layout, views, timeout_s=10)
        stores = [StoreSpec("a", keys, (6, 3), (6, 3))]
        assert saver.end_step(stores) == set()
        saver.close(10)
        held = torch.zeros(2, settings.layout.block_bytes, dtype=torch.uint8)
        assert kvtier.load(keys, held).wait(10)
        for row, block in enumerate((6, 3)):  # layer-major: each layer's 16 tokens' latents in order
            want = b"".join(caches[n][block, 0].contiguous().view(torch.uint8).numpy().tobytes() for n in LAYER_NAMES)
            assert held[row].numpy().tobytes() == want
        fresh, _ = mla_caches()
        loader = WorkerSide(kvtier, settings.layout,
                            [engine_block_view(fresh[n], NUM_BLOCKS, BLOCK, page_bytes, False, True)
                             for n in LAYER_NAMES], timeout_s=10)
        loader.start_loads([LoadSpec("b", keys, (1, 8))])
        assert loader.end_step() == set()
        for n in LAYER_NAMES:
            bits, want = fresh[n].view(torch.int16), caches[n].view(torch.int16)  # bits: some are NaNs
            assert torch.equal(bits[1], want[6]) and torch.equal(bits[8], want[3])
            others = [b for b in range(NUM_BLOCKS) if b not in (1, 8)]
            assert not fresh[n][others].view(torch.int16).any(), "nothing else written"
    finally:
        kvtier.close()


@pytest.mark.parametrize("changes, message", [
    ({"model_version": "deepseek_v4"}, "model_version='deepseek_v4'"),
    ({"cache_dtype_str": "fp8_ds_mla"}, "cache_dtype_str='fp8_ds_mla'"),
    ({"sliding_window": 64}, "sliding_window=64"),
])
def test_mla_caches_kvtier_cannot_read_are_refused_at_start_up_naming_why(changes, message):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    from kvtier.integrations.vllm.settings import engine_facts

    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=MLA_LATENT, dtype=torch.bfloat16, **changes)
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(list(LAYER_NAMES), spec)])
    with pytest.raises(ConfigError, match=message):
        engine_facts(SimpleNamespace(), config)


# ---- per-token-head quantized pages: scales in the page -------------------------------------------


def scaled_caches(layout: str, mode: str) -> dict[str, torch.Tensor]:
    """Per-token-head quantized caches as vLLM's TRITON_ATTN has them allocated: the spec its
    `customize_spec` makes (each token and head's C = K | fp32 scale | V | fp32 scale), by vLLM's code."""
    from vllm.config import CacheConfig
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, KVQuantMode
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    cache_config = CacheConfig(block_size=BLOCK, num_gpu_blocks_override=NUM_BLOCKS)
    cache_config.kv_cache_layout = layout
    vllm_config = SimpleNamespace(cache_config=cache_config, attention_config=SimpleNamespace(hisparse_config=None))
    dtype = torch.int8 if mode == "INT8_PER_TOKEN_HEAD" else torch.uint8  # vLLM's dtypes for the two modes
    spec = TritonAttentionBackend.customize_spec(FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=dtype, kv_quant_mode=KVQuantMode[mode]))
    config = get_kv_cache_config_from_groups(vllm_config, [KVCacheGroupSpec(list(LAYER_NAMES), spec)],
                                             available_memory=1 << 30)
    return allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout[layout], [BLOCK]), spec


def scale_views(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V scales as the backend itself reads them: views its own `_ensure_scale_caches`
    carves (which sets every scale to 1.0 as it does: the bytes are put back)."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    impl, before = object.__new__(TritonAttentionImpl), kv.clone()
    impl._ensure_scale_caches(kv)
    kv.copy_(before)
    return impl._k_scale_cache, impl._v_scale_cache


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize("mode", ["INT8_PER_TOKEN_HEAD", "FP8_PER_TOKEN_HEAD"])
def test_per_token_head_pages_round_trip_with_their_scales(tmp_path, model_dir, layout, mode):
    import yaml

    from kvtier.integrations.vllm.pages import check_spec, inline_scales

    caches, spec = scaled_caches(layout, mode)
    check_spec(spec)
    assert inline_scales(spec) and spec.real_page_size_bytes == KV_HEADS * BLOCK * (2 * HEAD_DIM + 8)
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump({"model": str(model_dir), "kv_dtype": "int8", "block_tokens": BLOCK,
                                    "tiers": {"dram": {"capacity": "1MiB"}}}))
    cache_dtype = "int8_per_token_head" if mode.startswith("INT8") else "fp8_per_token_head"
    facts = EngineFacts(model_id="tiny", block_size=BLOCK, kv_dtype=cache_dtype, layer_names=LAYER_NAMES,
                        page_bytes=spec.real_page_size_bytes, device_type="cuda", kv_role="kv_both",
                        kv_cache_layout=layout, scale_bytes=KV_HEADS * BLOCK * 8)
    settings = read_settings({"kvtier_config": str(path)}, facts)
    assert settings.page_format.scales and settings.namespace.kv_dtype.startswith(f"{cache_dtype};vllm:")
    fill_distinct(caches)
    for kv in caches.values():  # real scales, not the 1.0 a fresh backend writes
        k_scales, v_scales = scale_views(kv)
        k_scales.copy_(torch.rand_like(k_scales) + 0.5)
        v_scales.copy_(torch.rand_like(v_scales) + 2.0)
    fresh, _ = scaled_caches(layout, mode)
    round_trip(settings, caches, fresh)
    for name in LAYER_NAMES:
        (ks, vs), (ks_new, vs_new) = scale_views(caches[name]), scale_views(fresh[name])
        for src, dst in ((7, 1), (2, 8), (5, 4)):  # the blocks round_trip moved
            assert torch.equal(ks_new[dst], ks[src]) and torch.equal(vs_new[dst], vs[src])


def test_restored_scales_survive_the_backends_first_forward(tmp_path, model_dir):
    """TRITON_ATTN carves its scale views on its first forward and sets every scale to 1.0 as it does.
    The connector makes it carve them at registration, so scales a load restores before that first
    forward stay; without that, they are reset (the negative control: the danger is real)."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    from kvtier.integrations.vllm.connector import KVTierConnector

    caches, _ = scaled_caches("LBHNC", "INT8_PER_TOKEN_HEAD")
    for guarded in (True, False):
        layers = {n: SimpleNamespace(impl=object.__new__(TritonAttentionImpl), kv_cache=kv) for n, kv in caches.items()}
        connector = SimpleNamespace(_vllm_config=SimpleNamespace(compilation_config=SimpleNamespace(
            static_forward_context=layers)))
        if guarded:
            KVTierConnector._set_up_scale_views(connector, list(LAYER_NAMES))
        for kv in caches.values():  # a load restores pages, scales included
            k_scales, v_scales = scale_views(kv)
            k_scales.fill_(3.0)
            v_scales.fill_(5.0)
        for name in LAYER_NAMES:  # the first forward
            layers[name].impl._ensure_scale_caches(caches[name])
        k_scales, v_scales = scale_views(caches[LAYER_NAMES[0]])
        assert bool((k_scales == 3.0).all() and (v_scales == 5.0).all()) == guarded
    with pytest.raises(ConfigError, match="cannot keep them from being reset"):
        KVTierConnector._set_up_scale_views(SimpleNamespace(_vllm_config=SimpleNamespace(
            compilation_config=SimpleNamespace(static_forward_context={}))), list(LAYER_NAMES))


def test_per_token_head_pages_are_refused_on_cpu_and_packed_ones_everywhere(tmp_path, model_dir):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

    from kvtier.integrations.vllm.pages import check_spec, page_format

    with pytest.raises(ConfigError, match="TRITON_ATTN backend keeps its scales in the page"):
        page_format("cpu", "LBHNC", scales=True)
    raw = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.int8,
                            kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD)  # no room for scales: not a layout we know
    with pytest.raises(ConfigError, match="kv_quant_mode"):
        check_spec(raw)
    with pytest.raises(ConfigError, match="kv_quant_mode"):
        check_spec(FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.uint8,
                                     kv_quant_mode=KVQuantMode.NVFP4))


# ---- on a GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("layout, ratio", CASES)
def test_on_cuda_tensors_each_backend_round_trips_and_means_each_tokens_kv(tmp_path, model_dir, monkeypatch,
                                                                          layout, ratio, backend):
    import kvtier.integrations.vllm.transfers as transfers

    monkeypatch.setattr(transfers, "gather_blocks", lambda *a, **k: gather_blocks(*a, **k, backend=backend))
    monkeypatch.setattr(transfers, "scatter_blocks", lambda *a, **k: scatter_blocks(*a, **k, backend=backend))
    settings = cuda_settings(tmp_path, model_dir, layout)
    caches = vllm_caches(layout, ratio, device="cuda")
    fill_distinct(caches)
    round_trip(settings, caches, vllm_caches(layout, ratio, device="cuda"))


# ---- the worker connector at start-up, as on a CUDA platform ------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from kvtier.integrations.hf.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("layouts-tiny"), hidden_size=KV_HEADS * 2 * HEAD_DIM,
                            num_heads=KV_HEADS * 2, num_kv_heads=KV_HEADS, num_layers=NUM_LAYERS, dtype="bfloat16")


def cuda_worker_connector(tmp_path: Path, model: Path, layout: str, monkeypatch):
    """A worker connector built from a real VllmConfig, with vLLM's platform reporting CUDA."""
    import yaml
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    from kvtier.integrations.vllm.connector import KVTierConnector

    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump({"model": str(model), "kv_dtype": "bf16", "block_tokens": BLOCK,
                                    "tiers": {"dram": {"capacity": "1MiB"}}}))
    transfer = KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
                                kv_connector_module_path="kvtier.integrations.vllm.connector",
                                kv_connector_extra_config={"kvtier_config": str(path)})
    config = EngineArgs(model=str(model), block_size=BLOCK, dtype="bfloat16", enforce_eager=True, max_model_len=256,
                        kv_transfer_config=transfer).create_engine_config()
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16)
    kv_cache = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                             kv_cache_groups=[KVCacheGroupSpec(list(LAYER_NAMES), spec)])
    kv_cache.kv_cache_layout = layout
    monkeypatch.setattr(current_platform, "device_type", "cuda")
    return KVTierConnector(config, KVConnectorRole.WORKER, kv_cache)


def attention_layers(backend_name: str) -> dict:
    backend = SimpleNamespace(get_name=lambda: backend_name)
    return {name: SimpleNamespace(attn_backend=backend) for name in LAYER_NAMES}


@pytest.mark.parametrize("layout, ratio", [("LHBNC", 1), ("LBNHC", 2)])
def test_a_cuda_worker_connector_checks_backends_and_pages_at_start_up(tmp_path, tiny_model, monkeypatch,
                                                                       layout, ratio):
    from kvtier.integrations.vllm.backends import SHARED

    connector = cuda_worker_connector(tmp_path, tiny_model, layout, monkeypatch)
    context = connector._vllm_config.compilation_config.static_forward_context
    try:
        assert connector.settings.page_format.layout == layout
        with pytest.raises(ConfigError, match="cannot tell which attention backend"):
            connector.register_kv_caches(vllm_caches(layout, ratio))
        context.update(attention_layers("ROCM_ATTN"))
        with pytest.raises(ConfigError, match="uses attention backend ROCM_ATTN"):
            connector.register_kv_caches(vllm_caches(layout, ratio))
        context.update(attention_layers("FLASH_ATTN"))
        other = "LBHNC" if layout == "LBNHC" else "LBNHC"
        with pytest.raises(ConfigError, match=f"is not vLLM's {layout} layout"):
            connector.register_kv_caches(vllm_caches(other, 1))
        shared = dict.fromkeys(LAYER_NAMES, vllm_caches(layout, ratio)[LAYER_NAMES[0]])
        with pytest.raises(ConfigError, match="share one KV cache"):
            connector.register_kv_caches(shared)
        caches = vllm_caches(layout, ratio)
        connector.register_kv_caches(caches)
        assert connector._worker is not None and len(connector._worker.layers) == NUM_LAYERS
    finally:
        for name in LAYER_NAMES:
            context.pop(name, None)
        connector.shutdown()
    assert SHARED.backends() == []
