"""The workloads and the arithmetic of bench_serve.py, with nothing about processes.

Requests go to vLLM's OpenAI-compatible `/v1/completions` as token ids (so a prompt is exactly the
tokens meant, with no re-tokenization at a turn boundary), streamed, greedy, `ignore_eos`; the
time to first token is from sending the request to the first streamed chunk that carries a token.

  * chat: conversations, each a long random context then turns of (random user tokens, the model's
    answer); turn t of every conversation runs before turn t+1 of any, so the other conversations'
    prefill pushes a conversation's prefix out of vLLM's own cache before its next turn.
  * miss probes: one at a time, prompts nobody has sent (fresh random tokens): what a miss costs.
  * `distinct_random_seed`: a seed for `vllm bench serve --dataset-name random` whose prompts share
    no block, so that nothing of that workload can hit (see its docstring for why one must look).
  * `engine_counters`: vLLM's prefix-cache counters (its own cache's and the connector's hits).
  * `bench_result`: what the bench keeps of a `vllm bench serve --save-result --save-detailed` file.
"""

from __future__ import annotations

import http.client
import json
import math
import random
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

FIRST_TOKEN_ID = 3  # 0-2 are the tokenizer's special tokens


@dataclass(frozen=True, slots=True)
class Completion:
    ttft_s: float
    latency_s: float
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ChatSpec:
    num_conversations: int
    num_turns: int
    context_tokens: int
    user_tokens: int
    output_tokens: int
    concurrency: int


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation, as numpy's default; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def ratio(value: float | None, reference: float | None) -> float | None:
    """value / reference; None when either is missing or the reference is not positive."""
    if value is None or reference is None or reference <= 0:
        return None
    return value / reference


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n)]


def completion_body(model: str, prompt: list[int], max_tokens: int, kv_transfer_params: dict | None = None) -> dict:
    """The `/v1/completions` body `complete` sends; `kv_transfer_params` (e.g. kvtier's retention
    hint, `session_hint`) goes in as the OpenAI body's field of that name when given."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return body


def complete(host: str, port: int, model: str, prompt: list[int], max_tokens: int, timeout_s: float = 300,
             kv_transfer_params: dict | None = None) -> Completion:
    """One streamed greedy completion of exactly `max_tokens` tokens (`completion_body`).
    Raises OSError/RuntimeError."""
    body = json.dumps(completion_body(model, prompt, max_tokens, kv_transfer_params))
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
        ttft, tokens = None, []
        for line in response:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                new = choice.get("token_ids") or []
                if new and ttft is None:
                    ttft = time.perf_counter() - start
                tokens.extend(new)
        latency = time.perf_counter() - start
    finally:
        conn.close()
    if ttft is None:
        raise RuntimeError("the stream carried no token")
    return Completion(ttft, latency, tuple(tokens))


def run_miss_probes(host: str, port: int, model: str, prompts: list[list[int]], max_tokens: int) -> list[Completion]:
    """Sends each prompt alone, one after the other."""
    return [complete(host, port, model, p, max_tokens) for p in prompts]


def miss_prompts(seed: int, num: int, prompt_tokens: int, vocab_size: int) -> list[list[int]]:
    rng = random.Random(f"miss-{seed}")
    return [random_tokens(rng, prompt_tokens, vocab_size) for _ in range(num)]


@dataclass(frozen=True, slots=True)
class ChatResult:
    completions: dict[str, Completion]  # by "c<conversation>t<turn>"
    duration_s: float

    def ttfts_ms(self, first_turn: bool | None = None) -> list[float]:
        """TTFTs in ms; first_turn True/False keeps turn 0 only / the later turns only."""
        return [c.ttft_s * 1e3 for key, c in self.completions.items()
                if first_turn is None or key.endswith("t0") == first_turn]


def run_chat(host: str, port: int, model: str, spec: ChatSpec, seed: int, vocab_size: int,
             on_turn: Callable[[int], None] = lambda turn: None) -> ChatResult:
    """Runs every conversation turn by turn, `spec.concurrency` requests at a time."""
    rng = random.Random(f"chat-{seed}")
    histories = [random_tokens(rng, spec.context_tokens, vocab_size) for _ in range(spec.num_conversations)]
    done: dict[str, Completion] = {}
    start = time.perf_counter()
    with ThreadPoolExecutor(spec.concurrency) as pool:
        for turn in range(spec.num_turns):
            for history in histories:
                history.extend(random_tokens(rng, spec.user_tokens, vocab_size))
            prompts = [list(h) for h in histories]
            results = pool.map(lambda p: complete(host, port, model, p, spec.output_tokens), prompts)
            for c, (history, result) in enumerate(zip(histories, results)):
                done[f"c{c}t{turn}"] = result
                history.extend(result.token_ids)
            on_turn(turn)
    return ChatResult(done, time.perf_counter() - start)


def engine_counters(host: str, port: int) -> dict[str, float]:
    """vLLM's prefix-cache and prompt-token counters (its own cache's hits, and the connector's),
    and the time the engine's forward thread spent in kvtier (`FORWARD_THREAD`)."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
        return prefix_counters(r.read().decode())


FORWARD_THREAD = "kvtier_vllm_forward_thread_seconds_total"  # every rank's, summed


def prefix_counters(text: str) -> dict[str, float]:
    """The `*_total` prefix-cache and prompt-token counters of a Prometheus text page, and
    `FORWARD_THREAD`, summed over every label but `source` (which is kept as `name[source]`)."""
    from prometheus_client.parser import text_string_to_metric_families

    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            base = sample.name.removeprefix("vllm:")
            if not base.endswith("_total") or not ("prefix_cache" in base or "prompt_tokens" in base
                                                   or base == FORWARD_THREAD):
                continue
            source = sample.labels.get("source")
            key = base + (f"[{source}]" if source else "")
            counters[key] = counters.get(key, 0.0) + float(sample.value)
    return counters


KVTIER_FAMILIES = ("kvtier_hits", "kvtier_stores", "kvtier_evictions", "kvtier_hints", "kvtier_hints_read",
                   "kvtier_hints_refused", "kvtier_vllm_prompt_blocks", "kvtier_load_skipped_blocks")


def kvtier_counters_of(text: str) -> dict[str, float]:
    """The `KVTIER_FAMILIES` counters of kvtier's metrics page, summed over ranks, each other label
    kept as `name_total[value]` (`kvtier_hints_total[applied]`, `kvtier_hits_total[dram]`)."""
    from prometheus_client.parser import text_string_to_metric_families

    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in KVTIER_FAMILIES:
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            labels = [v for k, v in sorted(sample.labels.items()) if k != "rank"]
            key = sample.name + (f"[{','.join(labels)}]" if labels else "")
            counters[key] = counters.get(key, 0.0) + float(sample.value)
    return counters


def bench_result(doc: dict) -> dict:
    """What the bench keeps of a `vllm bench serve` result (TTFTs in ms, texts in request order).

    Raises:
        ValueError: the file lacks the per-request detail (`--save-detailed`) or a field.
    """
    missing = [k for k in ("completed", "failed", "duration", "request_throughput", "ttfts", "generated_texts")
               if k not in doc]
    if missing:
        raise ValueError(f"vllm bench serve result lacks {', '.join(missing)} (run with --save-result --save-detailed)")
    ttfts = [t * 1e3 for t, err in zip(doc["ttfts"], doc.get("errors", [""] * len(doc["ttfts"]))) if not err]
    return {"completed": doc["completed"], "failed": doc["failed"], "duration_s": doc["duration"],
            "req_per_s": doc["request_throughput"], "ttfts_ms": ttfts,
            "ttft_p50_ms": doc.get("p50_ttft_ms", percentile(ttfts, 50)),
            "ttft_p99_ms": doc.get("p99_ttft_ms", percentile(ttfts, 99)),
            "texts": list(doc["generated_texts"]), "input_lens": list(doc.get("input_lens", []))}


def first_blocks_distinct(prompts: Sequence[Sequence[int]], block_tokens: int) -> bool:
    """True when no two prompts begin with the same `block_tokens` tokens.

    Prefix caches (vLLM's and kvtier's) key a block on every token before it, so prompts whose
    first blocks differ share no cached block at all.
    """
    firsts = [tuple(p[:block_tokens]) for p in prompts]
    return len(set(firsts)) == len(firsts)


def distinct_random_seed(tokenizer, first_seed: int, num_prompts: int, input_tokens: int, output_tokens: int,
                         block_tokens: int, max_tries: int = 500) -> int:
    """The first seed from `first_seed` on for which `vllm bench serve --dataset-name random
    --random-range-ratio 0 --random-prefix-len 0` sends prompts that share no block.

    vLLM's random prompts are runs of consecutive token ids from a random start, decoded to text
    and re-encoded. With a small byte-level vocabulary (the bench's has 512 ids) every start among
    the 256 byte ids decodes to the same replacement characters, so many prompts come out
    identical: with seed 1000, 24 prompts of 1,700 tokens have 19 distinct first blocks, and 12
    prompts are all distinct for about one seed in ten. Identical prompts would hit vLLM's prefix
    cache and kvtier. This draws the prompts with vLLM's own sampler and tokenizes them as the
    server does (with its special tokens), so the seed it returns is checked, not hoped for.

    Args:
        tokenizer: the served model's tokenizer, as `vllm.tokenizers.get_tokenizer` loads it.
        first_seed: the first seed tried.
        num_prompts, input_tokens, output_tokens: `--num-prompts`, `--random-input-len`,
            `--random-output-len` of the benchmark.
        block_tokens: the engine's block size.
        max_tries: seeds tried before giving up.

    Returns:
        The seed.

    Raises:
        ValueError: no seed of `max_tries` gives distinct prompts (ask for fewer prompts).
    """
    import logging

    from vllm.benchmarks.datasets.datasets import RandomDataset

    quiet = logging.getLogger("vllm.benchmarks")  # a warning per draw about re-encoded lengths
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        for seed in range(first_seed, first_seed + max_tries):
            requests = RandomDataset(random_seed=seed).sample(
                tokenizer=tokenizer, num_requests=num_prompts, input_len=input_tokens, output_len=output_tokens,
                range_ratio=0.0, prefix_len=0)
            if first_blocks_distinct([tokenizer(r.prompt).input_ids for r in requests], block_tokens):
                return seed
    finally:
        quiet.setLevel(level)
    raise ValueError(f"no seed in {first_seed}..{first_seed + max_tries - 1} gives {num_prompts} random prompts "
                     f"of {input_tokens} tokens that share no block: lower --random-prompts")


def compare_outputs(reference: dict[str, object], candidate: dict[str, object]) -> dict:
    """Compares two {request: output} maps on the requests both have.

    Returns {"identical": bool | None, "num_compared", "num_different", "different": first few keys};
    identical is None when nothing could be compared, False when a request of the reference is
    missing from the candidate.
    """
    common = [k for k in reference if k in candidate]
    different = [k for k in common if reference[k] != candidate[k]]
    missing = [k for k in reference if k not in candidate]
    identical = None if not common else not different and not missing
    return {"identical": identical, "num_compared": len(common), "num_different": len(different),
            "num_missing": len(missing), "different": different[:5]}


def outputs_of(run: dict) -> dict[str, object]:
    """Every output of one server run, keyed so that two runs of the same round line up."""
    out: dict[str, object] = {}
    for i, text in enumerate(run.get("prefix", {}).get("texts", [])):
        out[f"prefix{i}"] = text
    for key, tokens in run.get("chat_tokens", {}).items():
        out[f"chat-{key}"] = tokens
    for key, tokens in run.get("hints_chat_tokens", {}).items():
        out[f"chat-hints-{key}"] = tokens
    for i, tokens in enumerate(run.get("miss_tokens", [])):
        out[f"miss{i}"] = tokens
    for i, text in enumerate(run.get("random", {}).get("texts", [])):
        out[f"random{i}"] = text
    return out
