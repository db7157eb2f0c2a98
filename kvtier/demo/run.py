"""`kvtier demo`: a tiny model serving a multi-turn conversation workload on every tier.

The embedded `configs/demo.yaml` gives the tiers: a CPU stand-in for HBM (a CUDA tensor on a GPU
machine), DRAM, a pool node this demo starts on loopback and stops at the end, and an SSD
directory. Several users each hold a conversation; each turn's prompt is the previous turns plus
a new message, so kvtier serves the conversation so far and the model computes only the new
message. The users' KV together overflows HBM, DRAM and the pool, so hits come from every tier.

Every turn is also run without kvtier (transformers' default cache, the whole prompt recomputed):
the greedy tokens must be identical, and the two times to first token are compared. Then a
prefix of each length in `Plan.ttft_prefix_tokens` is placed in DRAM, in the pool and on the SSD,
and its TTFT is measured against recomputing it, in the same run.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress

from kvtier.config import KVTierConfig, load_config
from kvtier.demo.noise import MISS_COST, load_since, read_load_average, turn_note
from kvtier.demo.report import memory_probe, print_report, tier_figures, tier_table
from kvtier.demo.ttft import prefix_experiment, timed_generate, timed_recompute
from kvtier.model.keys import Namespace
from kvtier.kinds import TierKind

NAMESPACE_MODEL = "kvtier-demo/tiny-llama"


@dataclass(frozen=True, slots=True)
class Plan:
    """How much work the demo does. `FULL` takes ~1-2 min on 2 cores, `QUICK` ~20-30 s."""

    num_users: int
    num_rounds: int  # each user speaks once per round; one user per round also sends a follow-up at once
    document_tokens: int  # each user's conversation opens with a document of about this many tokens
    message_tokens: int  # about this many tokens per later message
    reply_tokens: int  # greedy tokens generated per turn
    ttft_prefix_tokens: tuple[int, ...]
    seed: int = 0


FULL = Plan(num_users=8, num_rounds=3, document_tokens=3072, message_tokens=64, reply_tokens=16,
            ttft_prefix_tokens=(2048, 4096, 8192))
QUICK = Plan(num_users=8, num_rounds=2, document_tokens=3072, message_tokens=48, reply_tokens=4,
             ttft_prefix_tokens=(512, 1024, 2048))
TTFT_TIERS = (TierKind.DRAM, TierKind.POOL, TierKind.SSD)
# The model: big enough that an 8k-token prefill takes measurable time, small enough for 2 cores.
MODEL_SHAPE = {"num_layers": 4, "hidden_size": 128, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 512,
               "max_positions": 16384}


def demo_config() -> KVTierConfig:
    """The embedded demo configuration, as written (placeholders not yet filled in)."""
    return load_config(str(resources.files("kvtier").joinpath("configs/demo.yaml")))


def run_demo(plan: Plan, console: Console, work_dir: Path) -> dict[str, Any]:
    """Runs the whole demo; returns the JSON-ready result (see `kvtier demo --json`).

    Args:
        plan: how much work.
        console: where progress and tables go.
        work_dir: the model is built here (and reused across runs).
    """
    load_start = read_load_average()
    console.print(f"machine: {os.cpu_count()} cores, 1-minute load average "
                  f"{'unknown' if load_start is None else f'{load_start:.1f}'} (/proc/loadavg) at the start")
    with serving(demo_config(), work_dir, console) as (hf, node):
        device = hf.device
        memory = [memory_probe("model loaded", hf.kv, device, node.proc.pid)]
        turns, during = run_workload(hf, plan, console, lambda: memory_probe(
            "during generation (peak of the turns)", hf.kv, device, node.proc.pid), load_start)
        workload_snapshot = hf.kv.snapshot()
        after_prefill: list[dict[str, Any]] = []
        with console.status("TTFT experiment: prefixes placed in DRAM, the pool and the SSD"):
            ttft = prefix_experiment(hf, plan.ttft_prefix_tokens, TTFT_TIERS, seed=plan.seed + 1,
                                     after_prefill=lambda n: after_prefill.append(memory_probe(
                                         f"after a {n:,}-token prefill", hf.kv, device, node.proc.pid)))
        memory += after_prefill + [during]
        load = load_since(load_start)
        identical = all(t["identical"] for t in turns) and all(r["identical"] for r in ttft)
        result = {"plan": dataclasses.asdict(plan), "device": str(device), "runtime": hf.kv.describe(),
                  "outputs_identical": identical,
                  "workload": {"turns": turns, "hits": workload_snapshot["hits"],
                               "misses": workload_snapshot["misses"],
                               "tiers": tier_figures(workload_snapshot, hf.kv.layout.block_bytes),
                               "ttft": workload_summary(turns)},
                  "ttft": ttft, "memory": memory, "final": hf.kv.snapshot(),
                  "load": {"start": load.start, "end": load.end, "num_cores": load.num_cores}}
    print_report(console, result)
    return result


@contextmanager
def serving(config: KVTierConfig, work_dir: Path, console: Console) -> Iterator[tuple[Any, Any]]:
    """The model loaded, a pool node on loopback, and a KVTier on the demo config; all torn down after."""
    from transformers import AutoModelForCausalLM

    from kvtier.integrations.hf.adapter import HFKVTier
    from kvtier.integrations.hf.tiny_model import build_tiny_llama
    from kvtier.pool.node.process import NodeProcess
    from kvtier.runtime import KVTier

    with ExitStack() as stack:
        with console.status("building the model, starting a pool node"):
            model_dir = build_tiny_llama(work_dir / "tiny-llama", **MODEL_SHAPE)
            pool = config.tier(TierKind.POOL)
            node = NodeProcess(capacity=str(pool.capacity_bytes + (8 << 20)), region_size="1MiB")
            stack.callback(node.close)
            ssd = config.tier(TierKind.SSD).path
            ssd.mkdir(parents=True, exist_ok=True)
            ssd_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=ssd)))
            config = filled_in(config, model_dir, node.address, ssd_dir)
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            model = AutoModelForCausalLM.from_pretrained(model_dir).to(device).eval()
            kv = stack.enter_context(KVTier(config))
            hf = HFKVTier(model, kv, Namespace(NAMESPACE_MODEL, config.kv_dtype, config.block_tokens))
            warm_up(model, device)
        console.print(f"model: {model_dir} ({MODEL_SHAPE['num_layers']} layers, "
                      f"{kv.layout.block_bytes // kv.layout.block_tokens:,} B of KV per token) on {device}; "
                      f"pool node {node.address} (pid {node.proc.pid}); SSD {ssd_dir}")
        console.print("tiers: " + ", ".join(f"{t}: {u['slots']} blocks" for t, u in kv.usage().items())
                      + f" of {kv.layout.block_bytes // 1024} KiB")
        yield hf, node


def filled_in(config: KVTierConfig, model_dir: Path, node_address: str, ssd_dir: Path) -> KVTierConfig:
    """The demo config with what exists only at run time: the model, the pool node, the SSD directory."""
    def fill(tier):
        if tier.kind is TierKind.POOL:
            return dataclasses.replace(tier, nodes=(node_address,))
        if tier.kind is TierKind.SSD:
            return dataclasses.replace(tier, path=ssd_dir)
        return tier

    return dataclasses.replace(config, model=str(model_dir), tiers=tuple(fill(t) for t in config.tiers))


def warm_up(model: Any, device: torch.device) -> None:
    """A few forwards so the first measured one does not pay for lazy initialisation."""
    with torch.no_grad():
        for n in (256, 1024):
            model(torch.arange(3, 3 + n, device=device)[None] % model.config.vocab_size)


def run_workload(hf: Any, plan: Plan, console: Console, probe,
                 load_start: float | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every user's turns, round by round; each turn served by kvtier and recomputed, compared.

    Prints a line per turn (with a note where its figures are the machine's noise, see
    `kvtier.demo.noise`), and the per-tier table after each round, the last one being the whole
    workload's. Progress shows only in a terminal, and goes away when done.

    Args:
        load_start: the 1-minute load average when the demo started, for the notes.
    Returns:
        One dict per turn (round, user and the user's turn number, 1-based: turn 1 opens the
        conversation), and the memory probe with the highest RSS taken mid-generation.
    """
    tokenizer = _tokenizer(hf)
    conversations = [_text_ids(tokenizer, plan.document_tokens, plan.seed * 1000 + u) for u in range(plan.num_users)]
    schedule = [(r, u) for r in range(plan.num_rounds) for u in range(plan.num_users)
                for _ in range(2 if u == r % plan.num_users else 1)]
    turns, peak = [], {"rss_bytes": -1}
    num_turns = [0] * plan.num_users
    console.print(MISS_COST, soft_wrap=True)
    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("conversations", total=len(schedule))
        for i, (r, u) in enumerate(schedule):
            if len(conversations[u]) > plan.document_tokens:  # a later message of the conversation
                conversations[u] = torch.cat([conversations[u], _text_ids(
                    tokenizer, plan.message_tokens, 7919 * (i + 1) + plan.seed)])
            turn, conversations[u], sample = _turn(hf, conversations[u], plan.reply_tokens, probe)
            num_turns[u] += 1
            turns.append({"round": r, "user": u, "turn": num_turns[u], **turn})
            peak = max(peak, sample, key=lambda m: m["rss_bytes"] or 0)
            progress.console.print(_turn_line(turns[-1]), soft_wrap=True)
            if note := turn_note(turns[-1], load_since(load_start)):
                progress.console.print(f"  {note}", soft_wrap=True)
            progress.update(task, advance=1, description=_hits_line(hf.kv.stats.hits))
            if i + 1 == len(schedule) or schedule[i + 1][0] != r:
                title = (f"Per tier over the workload (after round {r + 1} of {plan.num_rounds})"
                         if r + 1 == plan.num_rounds else f"Per tier after round {r + 1} of {plan.num_rounds}")
                progress.console.print(tier_table(tier_figures(hf.kv.snapshot(), hf.kv.layout.block_bytes), title))
    return turns, peak


def _turn(hf: Any, ids: torch.Tensor, reply_tokens: int, probe) -> tuple[dict[str, Any], torch.Tensor, dict]:
    """One turn: recomputed, then served by kvtier; returns its figures, the conversation so far
    (prompt + reply) and a memory probe taken mid-generation."""
    prompt = ids[None].to(hf.device)
    hits_before = dict(hf.kv.stats.hits)
    want = timed_recompute(hf.model, prompt, reply_tokens)
    sample: dict[str, Any] = {}
    got = timed_generate(hf, prompt, reply_tokens, on_token=lambda i: sample.update(
        probe() if i == max(reply_tokens // 2, 1) else {}))
    hits = {TierKind(t).name.lower(): n - hits_before.get(t, 0) for t, n in hf.kv.stats.hits.items()
            if n - hits_before.get(t, 0)}
    return ({"prompt_tokens": len(ids), "cached_tokens": got.num_cached_tokens, "hits": hits,
             "recompute_ms": want.ttft_s * 1e3, "kvtier_ms": got.ttft_s * 1e3, "prepare_ms": got.prepare_s * 1e3,
             "identical": torch.equal(want.tokens, got.tokens)}, got.tokens, sample)


def workload_summary(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the turns whose prefix kvtier held (the first turn of a conversation has none)."""
    cached = [t for t in turns if t["cached_tokens"]] or turns
    recompute = statistics.median(t["recompute_ms"] for t in cached)
    kvtier = statistics.median(t["kvtier_ms"] for t in cached)
    return {"num_turns": len(cached), "mean_prompt_tokens": statistics.fmean(t["prompt_tokens"] for t in cached),
            "cached_share": sum(t["cached_tokens"] for t in cached) / sum(t["prompt_tokens"] for t in cached),
            "recompute_ms": recompute, "kvtier_ms": kvtier, "ratio": kvtier / recompute}


def _tokenizer(hf: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf.kv.config.model)


def _text_ids(tokenizer: Any, num_tokens: int, seed: int) -> torch.Tensor:
    """About `num_tokens` token ids of generated text (deterministic in `seed`)."""
    from kvtier.integrations.hf.tiny_model import corpus

    ids: list[int] = []
    lines = iter(corpus(num_lines=num_tokens // 2 + 20, seed=seed))  # >= 5 words a line
    while len(ids) < num_tokens:
        ids += tokenizer.encode(next(lines) + "\n")
    return torch.tensor(ids[:num_tokens], dtype=torch.int64)


def _turn_line(t: dict[str, Any]) -> str:
    hits = ", ".join(f"{tier} {n}" for tier, n in t["hits"].items()) or "none"
    mark = "[green]identical[/]" if t["identical"] else "[red]DIFFERENT[/]"
    return (f"round {t['round'] + 1} user {t['user']} turn {t['turn']}: {t['prompt_tokens']:,} tokens, "
            f"{t['cached_tokens']:,} from kvtier (blocks hit: {hits}); "
            f"TTFT {t['kvtier_ms']:.0f} ms vs {t['recompute_ms']:.0f} ms recomputed; {mark}")


def _hits_line(hits: dict) -> str:
    return "hits " + " ".join(f"{TierKind(t).name.lower()} {n}" for t, n in sorted(hits.items()) if n)
