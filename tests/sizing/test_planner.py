"""The operator's planner: weights, per-GPU HBM, tier cascade, reload bandwidth, and the parsers it reads.

Every expected number is computed by hand in the test (or is a published parameter count).
Cost: under a second, pure Python; no files, no subprocesses.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from kvtier.sizing.capacity import PlanInputs, plan
from kvtier.model.catalog import (
    catalog_names,
    count_weight_params,
    resolve_config,
    resolve_model,
)
from kvtier.errors import ConfigError, GeometryError, KVTierError
from kvtier.errors import ConfigError
from kvtier.sizing.hardware import GPU, HardwareError, resolve_gpu
from kvtier.units import parse_count, parse_seconds, parse_size, parse_tokens
from kvtier.sizing.planner import WeightDtype, Workload, kv_share_per_gpu, workload_report

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
LLAMA2_7B_PARAMS = 6_738_415_616


def gpu(hbm_bytes: int) -> GPU:
    return GPU("test GPU", hbm_bytes, host_link="PCIe-Gen4-x16")


def llama2_7b_plan(contexts=(4096,), concurrency=8, **inputs):
    inputs = {"weight_params": LLAMA2_7B_PARAMS, "weight_dtype": WeightDtype.FP16, "gpu": gpu(24 * GiB)} | inputs
    return plan(resolve_model("llama-2-7b"), Workload.from_contexts(list(contexts), concurrency), 16,
                PlanInputs(**inputs))  # fmt: skip


# --- weights ----------------------------------------------------------------------------------

# Totals of the published safetensors checkpoints (Hugging Face model pages; DeepSeek-V3 without
# its 14 B multi-token-prediction layer, as its technical report counts 671 B).
PUBLISHED_PARAMS = {
    "Llama-2-7B": 6_738_415_616, "Llama-2-13B": 13_015_864_320, "Llama-2-70B": 68_976_648_192,
    "Llama-3-8B": 8_030_261_248, "Llama-3-70B": 70_553_706_496, "Qwen2.5-7B": 7_615_616_512,
    "Qwen2.5-72B": 72_706_203_648, "Mistral-7B": 7_241_732_096, "Mistral-7B-v0.3": 7_248_023_552,
    "Mixtral-8x7B": 46_702_792_704, "DeepSeek-V2-Lite": 15_706_484_224, "DeepSeek-V3": 671_026_419_200,
    "Gemma-2-9B": 9_241_705_984,
}  # fmt: skip


# Newer models, as rounded where they are published: "total" as the Hugging Face model page rounds
# the checkpoint (or, for gpt-oss, OpenAI's model card); "non-embedding" as the Qwen3 model cards and
# the Gemma 3 technical report (Table 1, text model without the vision encoder) give it. The count must
# round to the published figure: within half a unit of its last digit.
PUBLISHED_ROUNDED = {
    "Llama-3.1-8B": ("total", "8.03B"), "Llama-3.1-70B": ("total", "70.6B"), "Llama-3.1-405B": ("total", "406B"),
    "Llama-3.2-1B": ("total", "1.24B"), "Llama-3.2-3B": ("total", "3.21B"),
    "Qwen2.5-0.5B": ("total", "494M"), "Qwen2.5-1.5B": ("total", "1.54B"), "Qwen2.5-3B": ("total", "3.09B"),
    "Qwen2.5-14B": ("total", "14.8B"), "Qwen2.5-32B": ("total", "32.8B"),
    "Qwen3-0.6B": ("non-embedding", "0.44B"), "Qwen3-1.7B": ("non-embedding", "1.4B"),
    "Qwen3-4B": ("non-embedding", "3.6B"), "Qwen3-8B": ("non-embedding", "6.95B"),
    "Qwen3-14B": ("non-embedding", "13.2B"), "Qwen3-32B": ("non-embedding", "31.2B"),
    "Qwen3-30B-A3B": ("non-embedding", "29.9B"), "Qwen3-235B-A22B": ("non-embedding", "234B"),
    "Mixtral-8x22B": ("total", "141B"), "Mistral-Large-2": ("total", "123B"),
    "Gemma-3-4B": ("non-embedding", "3209M"), "Gemma-3-12B": ("non-embedding", "10759M"),
    "Gemma-3-27B": ("non-embedding", "25600M"),
    "gpt-oss-20b": ("total", "20.91B"), "gpt-oss-120b": ("total", "116.83B"),
}  # fmt: skip


@pytest.mark.parametrize(("name", "params"), PUBLISHED_PARAMS.items())
def test_counted_parameters_match_the_published_totals(name, params):
    canonical, cfg = resolve_config(name)
    assert sum(count_weight_params(cfg, canonical).values()) == params


@pytest.mark.parametrize(("name", "published"), PUBLISHED_ROUNDED.items())
def test_counted_parameters_round_to_the_published_figures(name, published):
    what, figure = published
    canonical, cfg = resolve_config(name)
    parts = count_weight_params(cfg, canonical)
    counted = sum(parts.values()) if what == "total" else parts["attention"] + parts["mlp"] + parts["norms"]
    digits, unit = figure[:-1], {"M": 1e6, "B": 1e9}[figure[-1]]
    decimals = len(digits.partition(".")[2])
    assert abs(counted / unit - float(digits)) <= 0.5 * 10**-decimals, (counted, figure)


def test_every_catalog_model_has_a_parameter_count():
    assert set(catalog_names()) - set(PUBLISHED_PARAMS) - set(PUBLISHED_ROUNDED) == {"kvtier-tiny"}


def test_gpt_oss_weights_are_sized_in_mxfp4():
    assert WeightDtype.of_config(resolve_config("openai/gpt-oss-20b")[1]) is WeightDtype.FP4
    assert WeightDtype.of_config(resolve_config("qwen3-8b")[1]) is WeightDtype.BF16


def test_tiny_parameters_by_hand():
    # hidden 64, 4 layers, 4 heads x 16 dims, 2 KV heads, MLP 128, vocab 256, untied
    parts = count_weight_params(resolve_config("tiny")[1])
    assert parts == {
        "embedding": 256 * 64,
        "attention": 4 * (64 * 64 + 2 * 64 * 32 + 64 * 64),
        "mlp": 4 * 3 * 64 * 128,
        "norms": 4 * 2 * 64 + 64,
        "lm_head": 256 * 64,
    }


def test_moe_and_mla_parameters_by_hand():
    moe = {"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
           "vocab_size": 10, "intermediate_size": 4, "num_local_experts": 3, "tie_word_embeddings": True}  # fmt: skip
    assert count_weight_params(moe)["mlp"] == 2 * (3 * 3 * 8 * 4 + 8 * 3)  # experts + router
    assert count_weight_params(moe)["lm_head"] == 0
    mla = {"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10,
           "intermediate_size": 4, "kv_lora_rank": 4, "qk_rope_head_dim": 2, "qk_nope_head_dim": 3,
           "v_head_dim": 5, "q_lora_rank": None}  # fmt: skip
    q, kv_a, kv_b, o = 8 * 2 * (3 + 2), 8 * (4 + 2) + 4, 4 * 2 * (3 + 5), 2 * 5 * 8
    assert count_weight_params(mla)["attention"] == q + kv_a + kv_b + o


def test_a_config_without_vocab_cannot_be_counted():
    with pytest.raises(GeometryError, match="vocab_size"):
        count_weight_params({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}, "mine")


@pytest.mark.parametrize(
    ("cfg", "dtype"),
    [({"torch_dtype": "float16"}, WeightDtype.FP16), ({"torch_dtype": "float32"}, WeightDtype.BF16),
     ({"torch_dtype": "bfloat16", "quantization_config": {"quant_method": "awq", "bits": 4}}, WeightDtype.INT4),
     ({"quantization_config": {"quant_method": "fp8"}}, WeightDtype.FP8), ({}, WeightDtype.FP16)],
)  # fmt: skip
def test_weight_dtype_of_a_checkpoint(cfg, dtype):
    assert WeightDtype.of_config(cfg) is dtype


def test_weight_bytes_follow_the_dtype():
    assert llama2_7b_plan(weight_dtype=WeightDtype.INT4)["weights"]["bytes"] == LLAMA2_7B_PARAMS // 2
    weights = llama2_7b_plan(tensor_parallel=4, gpus_per_server=4)["weights"]
    assert weights["bytes"] == 13_476_831_232
    assert weights["bytes_per_gpu"] == 13_476_831_232 // 4


# --- the seed example: Llama-2-7B fp16, 8 x 4,096 tokens, a 24 GiB card -------------------------


def test_seed_example_does_not_fit_24_gib_and_says_how_much_overflows():
    report = llama2_7b_plan()
    hbm = report["hbm"]
    assert report["kv_bytes_total"] == 16 * GiB
    assert report["weights"]["bytes"] == 2 * LLAMA2_7B_PARAMS == 13_476_831_232  # ~13.5 GB
    assert hbm["reserve_bytes"] == 2_576_980_377  # floor(24 GiB / 10)
    assert hbm["kv_room_bytes"] == 24 * GiB - 13_476_831_232 - 2_576_980_377 == 9_715_992_167
    assert hbm["kv_bytes"] == 9_715_992_167
    assert hbm["overflow_bytes"] == 16 * GiB - 9_715_992_167 == 7_463_877_017
    assert (hbm["fits"], hbm["weights_fit"], hbm["longest_context_fits"]) == (False, True, True)
    assert hbm["max_sequences_at_longest_context"] == 4  # 9.05 GiB // 2 GiB
    assert hbm["min_tensor_parallel_to_fit"] == 2
    assert report["tiers"]["per_server"]["dram_bytes"] == 7_463_877_017  # DRAM has no cap: it takes it all
    assert any(line.startswith("DOES NOT FIT in HBM") and "6.95 GiB" in line for line in report["verdict"])


def test_seed_example_does_not_fit_even_without_a_reserve():
    hbm = llama2_7b_plan(reserve_fraction=Fraction(0))["hbm"]
    assert hbm["overflow_bytes"] == 16 * GiB - (24 * GiB - 13_476_831_232) == 4_886_896_640


def test_weights_that_do_not_fit_say_so():
    report = llama2_7b_plan(gpu=gpu(12 * GiB))
    assert report["hbm"]["weights_fit"] is False
    assert report["hbm"]["kv_bytes"] == 0 and report["hbm"]["overflow_bytes"] == 16 * GiB
    assert report["verdict"][1].startswith("DOES NOT FIT: the weights alone")


def test_a_plan_that_fits_leaves_free_memory():
    hbm = llama2_7b_plan(gpu=gpu(80 * GiB))["hbm"]
    assert hbm["fits"] and hbm["overflow_bytes"] == 0
    assert hbm["free_bytes"] == 80 * GiB - 13_476_831_232 - 8 * GiB - 16 * GiB  # reserve floor(80 GiB / 10) = 8 GiB


# --- tensor parallelism -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "tp", "share"),
    [("llama-3-70b", 4, Fraction(1, 4)), ("llama-3-70b", 8, Fraction(1, 8)),
     ("llama-3-70b", 16, Fraction(1, 8)),  # 8 KV heads on 16 GPUs: each head on two GPUs
     ("qwen2.5-7b", 2, Fraction(1, 2)), ("deepseek-v3", 8, Fraction(1))],  # MLA: every rank holds the latent
)  # fmt: skip
def test_kv_share_per_gpu(name, tp, share):
    assert kv_share_per_gpu(resolve_model(name), tp) == share


@pytest.mark.parametrize(
    ("name", "tp", "message"),
    [("llama-2-7b", 3, "does not divide its 32 attention heads"), ("qwen2.5-7b", 8, "28 attention heads"),
     ("qwen2.5-7b", 7, "its 4 KV heads do not divide one another")],
)  # fmt: skip
def test_tp_that_does_not_fit_the_heads_is_refused(name, tp, message):
    with pytest.raises(GeometryError, match=message) as info:
        kv_share_per_gpu(resolve_model(name), tp)
    assert isinstance(info.value, KVTierError)


def test_tp_splits_weights_and_kv_per_gpu():
    report = llama2_7b_plan(tensor_parallel=2, gpus_per_server=2)
    assert report["hbm"]["weights_bytes"] == 13_476_831_232 // 2
    assert report["hbm"]["kv_demand_bytes"] == 8 * GiB
    assert report["parallel"] == {"tensor_parallel": 2, "gpus_per_server": 2, "num_servers": 1,
                                  "replicas_per_server": 1, "num_replicas": 1, "kv_share_per_gpu": 0.5,
                                  "kv_replication": 1}  # fmt: skip


# --- the tier cascade -------------------------------------------------------------------------


def test_capacities_cascade_dram_then_pool_then_ssd_then_recompute():
    tiers = llama2_7b_plan(dram_bytes_per_server=4 * GiB, pool_bytes=2 * GiB, ssd_bytes_per_server=0)["tiers"]
    overflow = 7_463_877_017
    assert tiers["per_server"] == {"hbm_bytes": 9_715_992_167, "dram_bytes": 4 * GiB, "pool_bytes": 2 * GiB,
                                   "ssd_bytes": 0, "unplaced_bytes": overflow - 6 * GiB}  # fmt: skip


def test_pool_is_sized_for_the_cluster_and_shared_per_server():
    # 3 servers x 4 GPUs, one replica per GPU, no reserve: each replica overflows 4,886,896,640 bytes.
    tiers = llama2_7b_plan(reserve_fraction=Fraction(0), gpus_per_server=4, num_servers=3,
                           dram_bytes_per_server=8 * GiB)["tiers"]  # fmt: skip
    per_server_overflow = 4 * 4_886_896_640
    assert tiers["overflow_bytes_per_server"] == per_server_overflow == 19_547_586_560
    assert tiers["per_server"]["dram_bytes"] == 8 * GiB
    assert tiers["cluster"]["pool_bytes"] == 3 * (per_server_overflow - 8 * GiB) == 32_872_955_904
    assert tiers["per_server"]["pool_bytes"] == 10_957_651_968
    assert tiers["cluster"]["ssd_bytes"] == 0


def test_a_full_pool_spills_to_ssd_split_per_server():
    tiers = llama2_7b_plan(reserve_fraction=Fraction(0), gpus_per_server=4, num_servers=3,
                           dram_bytes_per_server=8 * GiB, pool_bytes=20 * GiB)["tiers"]  # fmt: skip
    assert tiers["cluster"]["ssd_bytes"] == 32_872_955_904 - 20 * GiB == 11_398_119_424
    assert tiers["per_server"]["ssd_bytes"] == 3_799_373_142  # rounded up
    assert tiers["cluster"]["unplaced_bytes"] == 0


def test_lower_tiers_store_every_token_of_a_sliding_window_model():
    # Mistral-7B v0.1: 128 KiB per token, every layer slides over 4,096 tokens.
    # Two 32k sequences keep 2 x 512 MiB in HBM, but their blocks hold 2 x 4 GiB.
    weights = 10 * GiB - GiB // 2  # leaves half of the 1 GiB of resident KV room
    inputs = PlanInputs(weights // 2, WeightDtype.BF16, gpu(10 * GiB), reserve_fraction=Fraction(0))
    report = plan(resolve_model("mistral-7b"), Workload.from_contexts([32768], 2), 16, inputs)
    assert report["hbm"]["kv_demand_bytes"] == GiB
    assert report["hbm"]["overflow_bytes"] == GiB // 2
    assert report["tiers"]["overflow_bytes_per_replica"] == 8 * GiB // 2


# --- workloads --------------------------------------------------------------------------------


def test_distribution_is_linear_between_quantiles():
    # tiny: 512 B/token. Segments 0-4k, 4k-32k, 32k-128k at their midpoints, weights 0.5, 0.4, 0.1.
    workload = Workload.from_quantiles({"p50": 4096, "p90": 32768, "max": 131072}, concurrency=10)
    assert workload.shares == ((2048, 5), (18432, 4), (81920, 1))
    report = workload_report(resolve_model("tiny"), workload, 16)
    assert report["kv_bytes_total"] == (5 * 2048 + 4 * 18432 + 81920) * 512 == 84_934_656
    assert report["workload"]["mean_context_tokens"] == pytest.approx(16588.8)
    assert [(c["label"], c["context_tokens"]) for c in report["contexts"]] == [
        ("p50", 4096), ("p90", 32768), ("max", 131072)]  # fmt: skip


def test_distribution_min_and_odd_midpoints():
    workload = Workload.from_quantiles({"min": 1, "p50": 4, "max": 7}, concurrency=2)
    assert workload.shares == ((3, 1), (6, 1))  # ceil(2.5), ceil(5.5)


@pytest.mark.parametrize(
    ("quantiles", "message"),
    [({"p50": 4096}, "give max="), ({"p50": 4096, "p90": 1024, "max": 8192}, "must be longer"),
     ({"p150": 1, "max": 8}, "unknown key 'p150'"), ({"median": 1, "max": 8}, "unknown key"),
     ({"p50": 0, "max": 8}, "p50: must be a positive")],
)  # fmt: skip
def test_bad_distributions_are_refused(quantiles, message):
    with pytest.raises(ConfigError, match=message):
        Workload.from_quantiles(quantiles, concurrency=1)


def test_trace_lengths_are_sampled_evenly():
    workload = Workload.from_lengths([100, 200, 200, 400], concurrency=2)
    assert workload.shares == ((100, Fraction(1, 2)), (200, 1), (400, Fraction(1, 2)))
    assert workload.points == (("p50", 200), ("p90", 400), ("p99", 400), ("max", 400))
    assert workload_report(resolve_model("tiny"), workload, 16)["kv_bytes_total"] == 450 * 512


def test_plain_contexts_keep_the_old_totals():
    report = workload_report(resolve_model("tiny"), Workload.from_contexts([1000, 3000], 3), 256)
    assert report["kv_bytes_total"] == 3 * 4000 * 512
    assert report["block_bytes_total"] == 3 * (3 + 11) * 256 * 512
    assert report["kv_bytes_total"] == sum(c["kv_bytes_total"] for c in report["contexts"])


# --- reload bandwidth -------------------------------------------------------------------------


def test_reload_bandwidth_against_fabrics():
    # Llama-3-70B, TP 4: 128k tokens x 320 KiB / 4 = 10 GiB per GPU, within 0.5 s -> 20 GiB/s.
    inputs = PlanInputs(None, WeightDtype.BF16, None, tensor_parallel=4, gpus_per_server=4,
                        ttft_target_s=Fraction(1, 2))  # fmt: skip
    reload = plan(resolve_model("llama-3-70b"), Workload.from_contexts([131072], 1), 16, inputs)["reload"]
    assert reload["contexts"] == [{"label": "", "context_tokens": 131072, "bytes_per_gpu": 10 * GiB,
                                   "required_bytes_per_s": 20 * GiB}]  # fmt: skip
    verdicts = {f["name"]: f["contexts"][0] for f in reload["fabrics"]}
    assert verdicts["PCIe-Gen4-x16"]["meets_target"] and verdicts["PCIe-Gen4-x16"]["links_needed"] == 1
    assert verdicts["PCIe-Gen4-x16"]["seconds"] == pytest.approx(10 * GiB / 25e9)
    assert (verdicts["RoCE-100GbE"]["meets_target"], verdicts["RoCE-100GbE"]["links_needed"]) == (False, 2)
    assert verdicts["NVMe-Gen4-x4"]["links_needed"] == 4  # 21.47 GB/s over 7 GB/s drives
    assert verdicts["RoCE-400GbE"]["meets_target"]


def test_without_a_gpu_there_is_no_hbm_plan():
    report = plan(resolve_model("tiny"), Workload.from_contexts([16], 1), 16, PlanInputs(None, WeightDtype.FP16, None))
    assert "hbm" not in report and "tiers" not in report and "weights" not in report
    assert report["reload"]["contexts"][0]["bytes_per_gpu"] == 16 * 512


@pytest.mark.parametrize(
    ("inputs", "message"),
    [({"tensor_parallel": 0}, "tensor_parallel"), ({"gpus_per_server": 3, "tensor_parallel": 2}, "multiple"),
     ({"num_servers": 0}, "--servers"), ({"reserve_fraction": Fraction(1)}, "reserve"),
     ({"pool_bytes": -1}, "pool_bytes"), ({"ttft_target_s": Fraction(0)}, "ttft_target"),
     ({"gpu": GPU("x", 0, "")}, "hbm_bytes"), ({"weight_params": 0}, "weight_params")],
)  # fmt: skip
def test_impossible_inputs_are_refused(inputs, message):
    with pytest.raises(ConfigError, match=message):
        PlanInputs(**({"weight_params": 1, "weight_dtype": WeightDtype.FP16, "gpu": gpu(GiB)} | inputs))


# --- hardware and units -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "canonical"),
    [("H100-80", "H100-80"), ("h100", "H100-80"), ("H200", "H200-141"), ("L4", "L4-24"), ("4090", "RTX-4090-24"),
     ("a100_80", "A100-80"), ("B200-192", "B200-192"), ("A10", "A10-24")],
)  # fmt: skip
def test_gpu_names_resolve(name, canonical):
    assert resolve_gpu(name).name == canonical


def test_unknown_or_ambiguous_gpu_lists_close_matches():
    with pytest.raises(HardwareError, match=r"unknown GPU 'A100' \(did you mean A100-40 or A100-80\?\)"):
        resolve_gpu("A100")
    with pytest.raises(HardwareError, match=r"unknown GPU 'H100-90' \(did you mean H100-80"):
        resolve_gpu("H100-90")


@pytest.mark.parametrize(
    ("text", "value"),
    [("80GiB", 80 * GiB), ("24GB", 24 * 10**9), ("1.5TiB", 3 * 512 * GiB), ("512", 512), ("2 MiB", 2 * MiB)],
)
def test_parse_bytes(text, value):
    assert parse_size(text, "hbm") == value


def test_parse_tokens_seconds_and_counts():
    assert [parse_tokens(t, "context") for t in ("4096", "32k", "128K", "1.5k", "1m")] == [
        4096, 32768, 131072, 1536, 1 << 20]  # fmt: skip
    assert [parse_seconds(t, "ttft") for t in ("0.5s", "500ms", "2")] == [Fraction(1, 2), Fraction(1, 2), 2]
    assert [parse_count(t, "params") for t in ("6.74e9", "7B", "180M")] == [6_740_000_000, 7 * 10**9, 180 * 10**6]


@pytest.mark.parametrize(
    ("parse", "text", "message"),
    [(parse_size, "24XB", "hbm: cannot read '24XB'"), (parse_size, "-1GiB", "cannot read"),
     (parse_tokens, "1.5", "not a whole number of tokens"), (parse_seconds, "soon", "cannot read"),
     (parse_count, "0", "positive")],
)  # fmt: skip
def test_unreadable_units_are_refused(parse, text, message):
    with pytest.raises(ConfigError, match=message):
        parse(text, "hbm")
