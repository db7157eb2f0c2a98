"""Runs one vLLM engine on a scenario and prints its results as JSON (helper of tests/integrations/test_vllm.py).

    python tests/integrations/vllm_worker.py SPEC.json

Each engine runs in its own process: vLLM keeps global state (distributed groups, the KV transfer
group) that a second engine in one process would trip over. SPEC is a JSON object:

    model        the tiny model directory (built by the test)
    kvtier       path of the kvtier YAML, or null to run without the connector
    engine       extra `LLM(...)` keyword arguments (num_gpu_blocks_override, enable_prefix_caching, ...)
    env          environment variables to set before vLLM is imported
    failure_policy  kv_load_failure_policy (default 'recompute'; null: vLLM's own default)
    rank_stats   true: also collect every worker rank's connector counters (`collective_rpc`; for
                 engines whose workers run in other processes, e.g. tensor-parallel ones)
    phases       a list of phases, run in order, each {"prompts": [[token ids], ...], "max_tokens": n} and:
                   a prompt may also be {"prompt": text or [token ids], "images": [image, ...]}, each
                   image {"seed": n, "width": w, "height": h}: random RGB pixels drawn from `seed`,
                   built in memory (a vision-language model's placeholders go in the prompt); and
                   "cache_salt": str (vLLM's per-request salt), "lora": {"name", "id", "path"} (served
                   with that LoRA adapter), "embeds": [seed, n] instead of "prompt" (`prompt_embeds`:
                   n random rows of the model's hidden size drawn from seed)
                   "follow_up": [token ids]  also run, for each prompt of the previous phase, that
                                             prompt + its completion + these tokens (a next turn)
                   "corrupt_ssd": true       first overwrite kvtier's SSD files with random bytes
                   "overwrite_files": glob   first overwrite the files matching it with random bytes
                                             (SSD files of worker ranks in other processes)
                   "zero_loaded_kv": true    negative control: blocks loaded from kvtier reach the
                                             engine as zeros, unreported (a connector that lies)
                   "kill_pid": pid           first SIGKILL that process (a pool node going down)
                   "copy_files": [src, dst]  first copy every file of folder src into folder dst (an
                                             adapter rebuilt in place)

It prints one line `RESULT {"phases": [...]}`: per phase its prompts and, for each, the generated
token ids, their logprobs and `num_cached_tokens`; then, where the worker connector lives in this
process (single-process mode), its counters (cumulative) and kvtier's per-tier usage; with
`rank_stats`, each rank's counters (cumulative) as `rank_stats`.
An exception at start-up prints `STARTUP_ERROR <type>: <message>` and exits with status 3.
"""

from __future__ import annotations

import json
import os
import signal
import sys


def _sampling(max_tokens: int):
    from vllm import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)


def _build(spec: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs = {"model": spec["model"], "enforce_eager": True, "block_size": 32, "max_model_len": 512,
              "max_num_seqs": 4, "dtype": "float32", "seed": 0, **spec.get("engine", {})}
    if spec.get("kvtier"):
        policy = spec.get("failure_policy", "recompute")
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm.connector",
            kv_role="kv_both", **({"kv_load_failure_policy": policy} if policy else {}),
            kv_connector_extra_config={"kvtier_config": spec["kvtier"], **spec.get("extra", {})})
    return LLM(**kwargs)


def _connector():
    """The worker-side connector when it lives in this process, else None."""
    from vllm.distributed.kv_transfer import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )
    return get_kv_transfer_group() if has_kv_transfer_group() else None


def _corrupt_ssd() -> int:
    """Overwrites every SSD slab file of this process's kvtier backends; returns the files hit."""
    from kvtier.integrations.vllm.backends import SHARED
    from kvtier.tiers.base import TierKind

    count = 0
    for backend in SHARED.backends():
        tier = getattr(backend, "tiers", {}).get(TierKind.SSD)
        for path in (tier.paths if tier is not None else ()):
            size = os.path.getsize(path)
            with open(path, "r+b") as f:
                f.write(os.urandom(size))
            count += 1
    return count


def _overwrite_files(pattern: str) -> int:
    """Overwrites every file matching `pattern` with random bytes; returns the files hit."""
    import glob

    paths = glob.glob(pattern)
    for path in paths:
        with open(path, "r+b") as f:
            f.write(os.urandom(os.path.getsize(path)))
    return len(paths)


def _zero_loaded_kv() -> None:
    import kvtier.integrations.vllm.transfers as transfers

    scatter = transfers.scatter_blocks

    def scatter_zeros(layer_kv, block_ids, blocks, *args, **kwargs):
        blocks.zero_()
        scatter(layer_kv, block_ids, blocks, *args, **kwargs)

    transfers.scatter_blocks = scatter_zeros


def _rank_stats(worker) -> dict:
    """Runs on each worker (through `collective_rpc`): its connector's counters."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return dict(vars(get_kv_transfer_group().stats))


def _image(spec: dict):
    """A PIL image of random RGB pixels drawn from `spec["seed"]`, `spec["width"]` x `spec["height"]`."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(spec["seed"]).integers(0, 256, (spec["height"], spec["width"], 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def _embeds(llm, seed: int, num_rows: int):
    """`num_rows` random input embeddings of the model's hidden size and dtype, drawn from `seed`."""
    import torch

    config = llm.llm_engine.model_config
    rows = torch.randn(num_rows, config.get_hidden_size(), generator=torch.Generator().manual_seed(seed))
    return rows.to(config.dtype)


def _lora(prompt):
    """The prompt's `LoRARequest`, or None."""
    from vllm.lora.request import LoRARequest

    lora = prompt.get("lora") if isinstance(prompt, dict) else None
    return LoRARequest(lora["name"], lora["id"], lora["path"]) if lora else None


def _copy_files(src: str, dst: str) -> None:
    import shutil

    for name in sorted(os.listdir(src)):
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))


def _engine_prompt(prompt, llm=None):
    """vLLM's prompt for a spec prompt: a list of token ids, or a text, token ids or embeddings with
    images and a salt."""
    from vllm.inputs import EmbedsPrompt, TextPrompt, TokensPrompt

    if isinstance(prompt, list):
        return TokensPrompt(prompt_token_ids=prompt)
    extra = {"multi_modal_data": {"image": [_image(i) for i in prompt["images"]]}} if prompt.get("images") else {}
    if prompt.get("cache_salt"):
        extra["cache_salt"] = prompt["cache_salt"]
    if "embeds" in prompt:
        return EmbedsPrompt(prompt_embeds=_embeds(llm, *prompt["embeds"]), **extra)
    if isinstance(prompt["prompt"], str):
        return TextPrompt(prompt=prompt["prompt"], **extra)
    return TokensPrompt(prompt_token_ids=prompt["prompt"], **extra)


def _run_phase(llm, phase: dict, previous: dict | None, spec: dict) -> dict:
    if phase.get("copy_files"):
        _copy_files(*phase["copy_files"])
    if phase.get("kill_pid"):
        os.kill(phase["kill_pid"], signal.SIGKILL)
    corrupted = _corrupt_ssd() if phase.get("corrupt_ssd") else 0
    if phase.get("overwrite_files"):
        corrupted += _overwrite_files(phase["overwrite_files"])
    if phase.get("zero_loaded_kv"):
        _zero_loaded_kv()
    prompts = [p if isinstance(p, dict) else list(p) for p in phase.get("prompts", [])]
    if "follow_up" in phase:
        prompts += [p + o["tokens"] + phase["follow_up"] for p, o in zip(previous["prompts"], previous["outputs"])]
    outs = []
    for prompt in prompts:  # one at a time: the order of stores and evictions is then fixed
        out = llm.generate([_engine_prompt(prompt, llm)], _sampling(phase.get("max_tokens", 4)),
                           use_tqdm=False, lora_request=_lora(prompt))[0]
        completion = out.outputs[0]
        outs.append({"tokens": list(completion.token_ids),
                     "logprobs": [lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs)],
                     "num_cached_tokens": out.num_cached_tokens or 0,
                     "num_prompt_tokens": len(out.prompt_token_ids or ()),
                     "finish_reason": completion.finish_reason})
    facts = _facts(llm)
    if spec.get("rank_stats"):
        facts["rank_stats"] = llm.collective_rpc(_rank_stats)
    return {"prompts": prompts, "outputs": outs, "corrupted_files": corrupted, **facts}


def _scheduler_counts(llm) -> dict | None:
    """The scheduler-side connector's prompt-block counts, where it lives in this process."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    connector = getattr(getattr(core, "scheduler", None), "connector", None)
    scheduler = getattr(connector, "_scheduler", None)
    if scheduler is None:
        return None
    return {k: dict(v) if isinstance(v, dict) else v for k, v in vars(scheduler.prompt_blocks).items()}  # this phase's


def _facts(llm=None) -> dict:
    from kvtier.integrations.vllm.backends import SHARED

    connector = _connector()
    facts: dict = {}
    counts = _scheduler_counts(llm) if llm is not None else None
    if counts is not None:
        facts["prompt_blocks"] = counts
    if connector is not None and hasattr(connector, "stats"):
        facts["stats"] = dict(vars(connector.stats))
        facts["kv_groups"] = len(connector.settings.kv_groups)  # kvtier blocks stored per engine block
    for backend in SHARED.backends():
        if hasattr(backend, "usage"):
            facts["usage"] = backend.usage()
        if hasattr(backend, "snapshot"):
            facts["cost"] = backend.snapshot().get("cost")
        if hasattr(backend, "layout"):  # what one stored block holds: bytes per token, for sizing checks
            facts["block_bytes"], facts["block_tokens"] = backend.layout.block_bytes, backend.layout.block_tokens
    return facts


def main(path: str) -> int:
    with open(path) as f:
        spec = json.load(f)
    os.environ.update(spec.get("env", {}))
    try:
        llm = _build(spec)
    except Exception as e:  # reported to the test, which asserts on the message
        _say(f"STARTUP_ERROR {type(e).__name__}: {e}")
        return 3
    phases: list[dict] = []
    for phase in spec["phases"]:
        phases.append(_run_phase(llm, phase, phases[-1] if phases else None, spec))
    _say("RESULT " + json.dumps({"phases": phases}))
    return 0


def _say(line: str) -> None:
    """One line in one write: `print` writes the text and its newline apart, and a log record from
    another thread (kvtier's, after a phase killed the pool node; vLLM logs to stdout) landed between
    them once, so the RESULT line carried the record's text."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
