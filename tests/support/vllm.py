"""The vLLM tests' shared pieces: the model's shape, engine configs, running an engine and comparing."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtier.integrations.hf.tiny_model import build_tiny_llama


WORKER = Path(__file__).parents[1] / "integrations" / "vllm_worker.py"
BLOCK = 32  # the CPU attention backend wants a multiple of 32
NUM_LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 32  # head_dim 32: the smallest the CPU backend runs
SINGLE_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                  "VLLM_HOST_IP": "127.0.0.1"}


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]  # 0-2 are the special tokens
P1 = _tokens(1, 150)
P2 = P1[:64] + _tokens(2, 86)  # shares two blocks with P1
Q = _tokens(3, 100)
FOLLOW_UP = _tokens(4, 20)
SPILL = [_tokens(10 + i, 150) for i in range(4)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("vllm-model"), hidden_size=128, num_heads=4,
                            num_kv_heads=KV_HEADS, num_layers=NUM_LAYERS)


def _yaml(path: Path, model: Path, tiers: dict, **top) -> Path:
    """A kvtier config. The tests count hits exactly, so the load-or-recompute veto (which follows
    this machine's measured speed) is off unless a test turns it on."""
    import yaml

    top.setdefault("transfer", {"skip_slow_loads": False})
    path.write_text(yaml.safe_dump({"model": str(model), "kv_dtype": "fp32", "block_tokens": BLOCK,
                                    "tiers": tiers, **top}))
    return path


@pytest.fixture
def pool_node():
    from kvtier.pool.node.process import running_node

    with running_node(capacity="32MiB") as node:
        yield node


def run_engine(tmp_path: Path, name: str, spec: dict, timeout_s: float = 240) -> dict:
    """Runs tests/integrations/vllm_worker.py on `spec`; returns its RESULT (or {"startup_error": message})."""
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, **spec.get("env", SINGLE_PROCESS), "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run([sys.executable, str(WORKER), str(path)], check=False, capture_output=True,
                          text=True, timeout=timeout_s, env=env)
    lines = done.stdout.splitlines()
    for line in lines:
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
        if line.startswith("STARTUP_ERROR "):
            return {"startup_error": line[len("STARTUP_ERROR "):]}
    raise AssertionError(f"{name}: no result (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")


def _spec(model: Path, kvtier: Path | None, phases: list[dict], **engine) -> dict:
    return {"model": str(model), "kvtier": str(kvtier) if kvtier else None, "phases": phases,
            "engine": {"enable_prefix_caching": False, "num_gpu_blocks_override": 40, **engine}}
BASIC_PHASES = [{"prompts": [P1]}, {"prompts": [P2]}, {"prompts": [P1, P2]},
                {"prompts": [Q], "max_tokens": 40}, {"follow_up": FOLLOW_UP, "max_tokens": 4}]


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory) -> dict[str, dict]:
    """What an engine without the connector generates, by prompt."""
    phases = BASIC_PHASES + [{"prompts": SPILL}]
    return outputs_by_prompt(run_engine(tmp_path_factory.mktemp("reference"), "reference",
                                        _spec(tiny_model, None, phases)))


def outputs_by_prompt(result: dict) -> dict[str, dict]:
    """An engine run's outputs, keyed by their prompt (as JSON): what `assert_same_as_reference` reads."""
    return {json.dumps(p): o for ph in result["phases"] for p, o in zip(ph["prompts"], ph["outputs"])}


def assert_same_as_reference(phase: dict, reference: dict[str, dict], logprob_abs: float = 1e-4) -> None:
    for prompt, out in zip(phase["prompts"], phase["outputs"]):
        want = reference[json.dumps(prompt)]
        assert out["finish_reason"] == "length"
        assert out["tokens"] == want["tokens"], f"prompt of {len(prompt)} tokens"
        assert out["logprobs"] == pytest.approx(want["logprobs"], abs=logprob_abs)


PAGE_BYTES = 2 * KV_HEADS * BLOCK * HEAD_DIM * 4  # one layer of one engine block, fp32
LAYER_NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS))


@dataclass
class FakeRequest:
    """The fields of vLLM's `Request` the scheduler half reads, hints included."""

    request_id: str
    all_token_ids: list[int]
    kv_transfer_params: object = None
    session_id: str | None = None
    cache_salt: str | None = None
    num_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)
