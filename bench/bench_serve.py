"""Real serving: `vllm serve` with and without kvtier, measured by `vllm bench serve` (issue 10, part 5).

    python bench/bench_serve.py [--quick] [--json FILE] [--png FILE] [--configs plain,dram,...]

Builds a Llama-shaped model with random weights (6 layers, hidden 512, 8 heads, 4 KV heads, fp32,
~19M parameters: 12 KiB of KV per token, 384 KiB per 32-token block) and a locally trained
tokenizer in a temporary directory, then serves it with real `vllm serve` processes on 127.0.0.1,
one configuration at a time:

    plain          vLLM alone
    dram           kvtier, DRAM tier
    dram+ssd       kvtier, DRAM + SSD (`persist: true`)
    dram+pool      kvtier, DRAM + a `kvtier pool serve` node (a real process)
    dram+pool+ssd  kvtier, DRAM + pool node + SSD (`persist: true`)
    dram+hints     kvtier, DRAM, with a client that sends session hints (the chat-hints workload only:
                   elsewhere it is `dram` again)

Every server keeps vLLM's prefix caching on, with vLLM's own cache cut to `--gpu-blocks` blocks
(160: 5,120 tokens) so that it evicts; kvtier's DRAM is `--dram` (128 MiB: ~2x vLLM's cache), its
SSD and the pool node larger. Each server starts fresh (new SSD directory, new pool node), so no
configuration sees what another computed. Against each server, in order:

  1. a warm-up request (not measured), then half of the miss probes: prompts nobody has sent;
  2. `vllm bench serve --dataset-name prefix_repetition` (random prefixes shared by several prompts,
     shuffled; 16 output tokens, greedy, `--ignore-eos`): req/s and TTFT;
  3. a multi-turn chat: conversations whose prefixes together exceed vLLM's cache, turn by turn;
  4. the other half of the miss probes (with kvtier's tiers now full);
  5. `vllm bench serve --dataset-name random`: `--random-prompts` prompts of `--prefix-tokens +
     --suffix-tokens` tokens that nobody sent before and that share no block with one another
     (`--random-prefix-len 0`, `--random-range-ratio 0`, and a seed per round checked for that:
     see `serve_workloads.distinct_random_seed`), `--output-tokens` out, greedy, `--ignore-eos`,
     `--concurrency` at a time: a workload where NOTHING can hit, neither vLLM's own cache nor
     kvtier, so its req/s against plain vLLM's is what kvtier costs a server that only misses
     (storing every computed block). vLLM's prefix-cache counters are read before and after it:
     the hit tokens of both caches during it are reported (`random_hit_tokens`, 0 when it was
     what it claims to be). It runs last so that it measures misses in a server whose tiers are
     full (every block it stores evicts or demotes another, as on a server that has been up a
     while; an empty kvtier would flatter it), and so that workloads 1-4 run exactly as before it
     existed and stay comparable with earlier runs (run first, its ~20 MB per prompt would have
     filled kvtier's DRAM before the prefix workload).
  6. chat-hints (only when `--workloads` names it): a rolling population of conversations, some
     ending at every step while new ones start (`serve_rolling`); the `dram+hints` configuration's
     client sends `kv_transfer_params.kvtier.session` on every turn and `closed: true` on a
     conversation's last, every other configuration's sends none. kvtier's hit and hint counters
     are read before and after it. Size `--dram` between its live peak and all it has seen (the
     bench logs both, in blocks) for the hints to have something to decide. kvtier's
     `transfer.skip_slow_loads` (on by default) turns held blocks into misses when its load-cost
     estimate says recomputing is faster, which on a busy machine can outweigh what the hints kept
     (`loads skipped` in the table); `--skip-slow-loads off` measures the hints without it.

`--workloads` picks which of prefix, chat, misses, random, chat-hints run (default: the first four,
as before chat-hints existed), in the order above.

A round runs every configuration once, in an order rotated by one each round, so that drift in the
machine's load spreads over all of them; every configuration sees the same prompts in a round, and
its outputs (greedy) are compared with plain vLLM's of that round. Ratios are to plain vLLM in the
same run. Servers run with `--enforce-eager`: on this CPU, compiling costs ~30 s per start-up and
served no faster. The whole run's figures, per-run details and server log tails of failures go to
the JSON; a table to stdout; progress to stderr. `--quick` (one round, fewer prompts) takes ~8-10
minutes on 2 busy cores, nearly half of it server start-ups; the default (3 rounds) ~28 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from kvtier.units import parse_size  # noqa: E402
from serve_procs import (  # noqa: E402
    HOST,
    ModelSpec,
    Procs,
    StartError,
    build_model,
    child_env,
    cpu_seconds,
    kv_transfer_config,
    kvtier_metrics_port,
    start_pool_node,
    terminate_as_interrupt,
    vllm_executable,
    wait_http_ready,
    write_kvtier_config,
)
from serve_workloads import (  # noqa: E402
    ChatSpec,
    bench_result,
    complete,
    distinct_random_seed,
    engine_counters,
    kvtier_counters_of,
    miss_prompts,
    percentile,
    random_tokens,
    run_chat,
    run_miss_probes,
)
from serve_rolling import RollingSpec, footprint_blocks, run_rolling_chat  # noqa: E402
from serve_report import machine_info, print_table, random_hit_tokens, summarize_all, write_png  # noqa: E402

BLOCK_TOKENS = 32  # vLLM's CPU attention wants a multiple of 32
CONFIGS = {"plain": "plain vLLM", "dram": "kvtier DRAM", "dram+ssd": "DRAM + SSD (persist)",
           "dram+pool": "DRAM + pool node", "dram+pool+ssd": "DRAM + pool + SSD",
           "dram+hints": "kvtier DRAM, session hints"}
WORKLOADS = ("prefix", "chat", "misses", "random", "chat-hints")
DEFAULT_WORKLOADS = ("prefix", "chat", "misses", "random")


@dataclass(frozen=True, slots=True)
class Params:
    rounds: int
    num_prefixes: int
    prefix_tokens: int
    suffix_tokens: int
    output_tokens: int
    num_prompts: int
    concurrency: int
    chat: ChatSpec
    num_miss_probes: int
    num_random_prompts: int
    gpu_blocks: int
    max_model_len: int
    dram: str
    ssd: str
    pool: str
    configs: tuple[str, ...]
    rolling: RollingSpec | None = None  # the chat-hints workload; None: not run
    workloads: tuple[str, ...] = DEFAULT_WORKLOADS
    skip_slow_loads: bool = True  # kvtier's transfer.skip_slow_loads
    model: ModelSpec = field(default_factory=ModelSpec)
    start_timeout_s: float = 300.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one round, fewer prompts (~8-10 min on 2 cores)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON here")
    p.add_argument("--png", metavar="FILE", help="plot req/s and TTFT per configuration here")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated subset of {', '.join(CONFIGS)} (plain is always run: ratios need it)")
    p.add_argument("--rounds", type=int, help="rounds over all configurations (default 3, --quick 1)")
    p.add_argument("--num-prompts", type=int, help="prefix_repetition prompts per server (default 36, --quick 18)")
    p.add_argument("--num-prefixes", type=int, default=6)
    p.add_argument("--prefix-tokens", type=int, default=1500)
    p.add_argument("--suffix-tokens", type=int, default=200)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--chat-conversations", type=int, help="default 6, --quick 4")
    p.add_argument("--chat-turns", type=int, help="default 4, --quick 3")
    p.add_argument("--chat-context-tokens", type=int, default=1500)
    p.add_argument("--miss-probes", type=int, help="default 8, --quick 4")
    p.add_argument("--random-prompts", type=int, default=12,
                   help="prompts of the random (nothing hits) workload per server; 0 skips it (default 12: more "
                        "rarely share no block with this model's small vocabulary)")
    p.add_argument("--gpu-blocks", type=int, default=160, help="vLLM's own cache, in 32-token blocks")
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="vLLM's --max-model-len; vLLM's own cache must hold one such request")
    p.add_argument("--dram", default="128MiB", help="kvtier's DRAM tier")
    p.add_argument("--ssd", default="1GiB", help="kvtier's SSD tier")
    p.add_argument("--pool", default="1GiB", help="the pool node's capacity")
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                   help=f"comma-separated subset of {', '.join(WORKLOADS)} (default: {','.join(DEFAULT_WORKLOADS)})")
    p.add_argument("--hints-live", type=int, default=8, help="chat-hints: conversations live at every step")
    p.add_argument("--hints-turns", type=int, default=4, help="chat-hints: turns of a whole conversation")
    p.add_argument("--hints-steps", type=int, default=16, help="chat-hints: steps (a turn of every live conversation)")
    p.add_argument("--hints-context-tokens", type=int, default=1024, help="chat-hints: a conversation's first context")
    p.add_argument("--hints-user-tokens", type=int, default=64, help="chat-hints: user tokens per turn")
    p.add_argument("--skip-slow-loads", choices=("on", "off"), default="on",
                   help="kvtier's transfer.skip_slow_loads (default on, as kvtier's own default): off loads every "
                        "held block, whatever the load-cost estimate says (to tell its effect from the hints')")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (model, configs, logs)")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    args.configs = tuple(n for n in CONFIGS if n in names or n == "plain")
    wanted = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in wanted if w not in WORKLOADS]
    if unknown or not wanted:
        p.error(f"--workloads: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(WORKLOADS)}")
    args.workloads = tuple(w for w in WORKLOADS if w in wanted)
    if args.num_prompts is None:
        args.num_prompts = 18 if args.quick else 36
    if args.random_prompts < 0:
        p.error(f"--random-prompts {args.random_prompts} is negative")
    if args.num_prompts < args.num_prefixes:
        p.error(f"--num-prompts {args.num_prompts} is below --num-prefixes {args.num_prefixes}: "
                "vllm bench serve's prefix_repetition needs at least one prompt per prefix")
    if args.gpu_blocks * BLOCK_TOKENS < args.max_model_len:
        p.error(f"--gpu-blocks {args.gpu_blocks} ({args.gpu_blocks * BLOCK_TOKENS} tokens) cannot hold one request of "
                f"--max-model-len {args.max_model_len}: vLLM refuses to start; lower --max-model-len or raise --gpu-blocks")
    return args


def params_from(args: argparse.Namespace) -> Params:
    def pick(value, full, quick):
        return value if value is not None else (quick if args.quick else full)

    chat = ChatSpec(num_conversations=pick(args.chat_conversations, 6, 4), num_turns=pick(args.chat_turns, 4, 3),
                    context_tokens=args.chat_context_tokens, user_tokens=100, output_tokens=args.output_tokens,
                    concurrency=args.concurrency)
    return Params(rounds=pick(args.rounds, 3, 1), num_prefixes=args.num_prefixes, prefix_tokens=args.prefix_tokens,
                  suffix_tokens=args.suffix_tokens, output_tokens=args.output_tokens,
                  num_prompts=args.num_prompts, concurrency=args.concurrency, chat=chat,
                  num_miss_probes=pick(args.miss_probes, 8, 4), num_random_prompts=args.random_prompts,
                  gpu_blocks=args.gpu_blocks,
                  max_model_len=args.max_model_len,
                  dram=args.dram, ssd=args.ssd, pool=args.pool, configs=args.configs,
                  rolling=rolling_spec(args) if "chat-hints" in args.workloads else None, workloads=args.workloads,
                  skip_slow_loads=args.skip_slow_loads == "on")


def rolling_spec(args: argparse.Namespace) -> RollingSpec:
    return RollingSpec(num_live=args.hints_live, num_turns=args.hints_turns, num_steps=args.hints_steps,
                       context_tokens=args.hints_context_tokens, user_tokens=args.hints_user_tokens,
                       output_tokens=args.output_tokens, concurrency=args.concurrency)


class Log:
    """Progress lines on stderr, with the time since the bench started."""

    def __init__(self) -> None:
        from rich.console import Console
        self.console, self.start = Console(stderr=True, highlight=False), time.monotonic()

    def __call__(self, message: str) -> None:
        elapsed = time.monotonic() - self.start
        self.console.print(f"[dim]{int(elapsed // 60):02d}:{elapsed % 60:04.1f}[/dim] {message}")


@dataclass
class Bench:
    params: Params
    workdir: Path
    model: Path
    vocab_size: int
    procs: Procs
    log: Log
    random_seeds: tuple[int, ...] = ()  # one per round: see `random_seeds`

    def tiers(self, name: str, run_dir: Path, pool_address: str | None) -> dict:
        tiers: dict = {"dram": {"capacity": self.params.dram}}
        if pool_address:
            tiers["pool"] = {"capacity": self.params.pool, "nodes": [pool_address]}
        if "ssd" in name:
            tiers["ssd"] = {"capacity": self.params.ssd, "path": str(run_dir / "ssd"), "persist": True}
        return tiers

    def serve_cmd(self, kvtier_yaml: Path | None) -> list[str]:
        """`vllm serve` on a port of its own choosing (0), which `wait_http_ready` reads back."""
        cmd = [vllm_executable(), "serve", str(self.model), "--host", HOST, "--port", "0",
               "--dtype", "float32", "--block-size", str(BLOCK_TOKENS), "--enable-prefix-caching",
               "--num-gpu-blocks-override", str(self.params.gpu_blocks),
               "--max-model-len", str(self.params.max_model_len),
               "--seed", "0", "--enforce-eager", "--uvicorn-log-level", "warning"]
        return cmd + (["--kv-transfer-config", kv_transfer_config(kvtier_yaml)] if kvtier_yaml else [])

    def prefix_dataset(self) -> list[str]:
        p = self.params
        return ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(p.prefix_tokens),
                "--prefix-repetition-suffix-len", str(p.suffix_tokens),
                "--prefix-repetition-num-prefixes", str(p.num_prefixes),
                "--prefix-repetition-output-len", str(p.output_tokens), "--num-prompts", str(p.num_prompts)]

    def random_dataset(self) -> list[str]:
        """Prompts that share no block (with the seed `random_seeds` found for the round)."""
        p = self.params
        return ["--dataset-name", "random", "--random-input-len", str(p.prefix_tokens + p.suffix_tokens),
                "--random-output-len", str(p.output_tokens), "--random-range-ratio", "0",
                "--random-prefix-len", "0", "--num-prompts", str(p.num_random_prompts)]

    def bench_cmd(self, port: int, seed: int, out: Path, dataset: list[str]) -> list[str]:
        """`vllm bench serve` of `dataset`'s arguments. No ready-check request and no warm-ups (vLLM's
        defaults, stated): either would send the first prompt twice, and the second would hit."""
        p = self.params
        return [vllm_executable(), "bench", "serve", "--backend", "vllm", "--host", HOST, "--port", str(port),
                "--model", str(self.model), *dataset,
                "--max-concurrency", str(p.concurrency), "--temperature", "0", "--ignore-eos",
                "--ready-check-timeout-sec", "0", "--num-warmups", "0",
                "--seed", str(seed), "--save-result", "--save-detailed", "--result-dir", str(out.parent),
                "--result-filename", out.name, "--percentile-metrics", "ttft,e2el",
                "--metric-percentiles", "50,99", "--disable-tqdm"]

    def bench_serve(self, port: int, seed: int, run_dir: Path, name: str, dataset: list[str]) -> dict:
        """Runs `vllm bench serve` to completion; returns `bench_result` of what it saved.

        Raises:
            RuntimeError: it exited with an error (its log's last lines in the message).
        """
        out = run_dir / f"{name}.json"
        bench = self.procs.start(f"vllm bench serve ({name})", self.bench_cmd(port, seed, out, dataset),
                                 run_dir / f"{name}.log", child_env())
        status = bench.wait(600)
        if status != 0:
            raise RuntimeError(f"vllm bench serve ({name}) exited with {status}: {bench.log_tail(15)}")
        self.procs.stop(bench)
        return bench_result(json.loads(out.read_text()))

    def run(self, name: str, round_index: int) -> dict:
        """One fresh server of configuration `name` through every workload of round `round_index`.

        Never raises for a server that fails: the record then carries `error` and its log tail.
        """
        run_dir = self.workdir / f"r{round_index}-{name.replace('+', '-')}"
        run_dir.mkdir()
        record: dict = {"config": name, "round": round_index, "loadavg_start": os.getloadavg()}
        started, server = time.monotonic(), None
        self.server = self.node = None
        try:
            pool_address = None
            if "pool" in name:
                self.node, pool_address = start_pool_node(self.procs, run_dir / "pool.log", self.params.pool)
            kvtier_yaml = None
            if name != "plain":
                kvtier_yaml = write_kvtier_config(run_dir / "kvtier.yaml", self.model, BLOCK_TOKENS,
                                                  self.tiers(name, run_dir, pool_address),
                                                  transfer=None if self.params.skip_slow_loads
                                                  else {"skip_slow_loads": False})
            server = self.server = self.procs.start(f"vllm serve ({name})", self.serve_cmd(kvtier_yaml),
                                                    run_dir / "server.log", child_env())
            port, record["startup_s"] = wait_http_ready(server, "/health", self.params.start_timeout_s)
            self.log(f"  {CONFIGS[name]}: ready in {record['startup_s']:.0f} s")
            self.workloads(record, port, round_index, run_dir, server)
            record["engine"] = engine_counters(HOST, port)
        except StartError as e:
            record.update(error=str(e), log_tail=e.log_tail)
        except Exception as e:  # a workload that failed: keep what was measured, and why
            record.update(error=f"{type(e).__name__}: {e}", log_tail=server.log_tail() if server else "")
        finally:
            self.procs.stop_all()  # the server, its engine and workers, and the pool node
        if server is not None:
            record["kvtier_log"] = kvtier_lines(server.log_path)
            if not record.get("error") and server.popen.returncode not in (0, -15):
                record["exit_status"] = server.popen.returncode
        record.update(wall_s=time.monotonic() - started, loadavg_end=os.getloadavg())
        if record.get("error"):
            self.log(f"  [red]{CONFIGS[name]}: {record['error']}[/red]")
        return record

    def workloads(self, record: dict, port: int, round_index: int, run_dir: Path, server) -> None:
        p, model, wanted = self.params, str(self.model), self.params.workloads
        seed = 1000 + round_index
        complete(HOST, port, model, random_tokens(random.Random(f"warm-{seed}"), 64, self.vocab_size), 2)
        probes = miss_prompts(seed, p.num_miss_probes, p.prefix_tokens + p.suffix_tokens, self.vocab_size)
        half = len(probes) // 2 if "misses" in wanted else 0
        misses = run_miss_probes(HOST, port, model, probes[:half], p.output_tokens)
        if "prefix" in wanted:
            record["prefix"] = self.bench_serve(port, seed, run_dir, "prefix", self.prefix_dataset())
            self.log(f"  prefix_repetition: {record['prefix']['req_per_s']:.2f} req/s, "
                     f"TTFT p50 {record['prefix']['ttft_p50_ms']:.0f} ms")
        if "chat" in wanted:
            chat = run_chat(HOST, port, model, p.chat, seed, self.vocab_size)
            record["chat"] = {"duration_s": chat.duration_s, "num_requests": len(chat.completions),
                              "ttfts_ms": chat.ttfts_ms(), "later_turn_ttfts_ms": chat.ttfts_ms(first_turn=False)}
            record["chat_tokens"] = {k: list(c.token_ids) for k, c in chat.completions.items()}
            self.log(f"  chat: {len(chat.completions) / chat.duration_s:.2f} req/s")
        if "misses" in wanted:
            misses += run_miss_probes(HOST, port, model, probes[half:], p.output_tokens)
            record["miss_ttfts_ms"] = [m.ttft_s * 1e3 for m in misses]
            record["miss_tokens"] = [list(m.token_ids) for m in misses]
        if "random" in wanted and p.num_random_prompts:
            self.random_workload(record, port, round_index, run_dir)
        if p.rolling is not None:
            self.hints_workload(record, port, seed, record["config"].endswith("+hints"))

    def hints_workload(self, record: dict, port: int, seed: int, hints: bool) -> None:
        """Workload 6 (chat-hints), with vLLM's and kvtier's counters over it."""
        metrics = kvtier_metrics_port(self.server)
        before = {**engine_counters(HOST, port), **kvtier_hint_counters(metrics)}
        chat = run_rolling_chat(HOST, port, str(self.model), self.params.rolling, seed, self.vocab_size, hints)
        after = {**engine_counters(HOST, port), **kvtier_hint_counters(metrics)}
        record["hints_chat"] = {"hints": hints, "duration_s": chat.duration_s, "num_requests": len(chat.completions),
                                "ttfts_ms": chat.ttfts_ms(), "later_turn_ttfts_ms": chat.ttfts_ms(first_turn=False),
                                "counters": {k: v - before.get(k, 0.0) for k, v in after.items()
                                             if v - before.get(k, 0.0)}}
        record["hints_chat_tokens"] = {k: list(c.token_ids) for k, c in chat.completions.items()}
        counters = record["hints_chat"]["counters"]
        self.log(f"  chat-hints ({'hints' if hints else 'no hints'}): {len(chat.completions) / chat.duration_s:.2f} "
                 f"req/s, later-turn TTFT p50 {percentile(chat.ttfts_ms(first_turn=False), 50) or 0:.0f} ms, "
                 f"kvtier hit {counters.get('kvtier_hits_total[dram]', 0):.0f} blocks, "
                 f"hints applied {counters.get('kvtier_hints_total[applied]', 0):.0f}, "
                 f"doomed evicted {counters.get('kvtier_hints_total[doomed_evicted]', 0):.0f}")

    def random_workload(self, record: dict, port: int, round_index: int, run_dir: Path) -> None:
        """Workload 5 (nothing can hit), with what both prefix caches counted during it."""
        metrics = kvtier_metrics_port(self.server)
        before = {**engine_counters(HOST, port), **kvtier_counters(metrics)}
        groups = {name: proc.pid for name, proc in (("server", self.server), ("pool node", self.node)) if proc}
        cpu_before = cpu_seconds(groups)
        record["random_seed"] = seed = self.random_seeds[round_index]
        record["random"] = self.bench_serve(port, seed, run_dir, "random", self.random_dataset())
        cpu_after = cpu_seconds(groups)
        after = {**engine_counters(HOST, port), **kvtier_counters(metrics)}
        record["random_cpu_s"] = {k: round(v - cpu_before.get(k, 0.0), 3) for k, v in cpu_after.items()}
        record["random_engine"] = {k: v - before.get(k, 0.0) for k, v in after.items()}
        hits, got = random_hit_tokens(record["random_engine"]), record["random"]
        self.log(f"  random (nothing can hit): {got['req_per_s']:.2f} req/s, TTFT p50 {got['ttft_p50_ms']:.0f} ms"
                 + (f", [red]yet {hits:.0f} prompt tokens hit[/red]" if hits else ""))


def kvtier_counters(port: int | None) -> dict[str, float]:
    """`engine_counters` of kvtier's own metrics endpoint; empty where there is none or it does
    not answer (the run's figures then lack kvtier's forward-thread time, nothing else)."""
    if port is None:
        return {}
    try:
        return engine_counters(HOST, port)
    except OSError:
        return {}


def kvtier_hint_counters(port: int | None) -> dict[str, float]:
    """`kvtier_counters_of` kvtier's metrics endpoint (hits, stores, evictions, hints); empty where
    there is none (plain vLLM) or it does not answer."""
    if port is None:
        return {}
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=10) as r:
            return kvtier_counters_of(r.read().decode())
    except OSError:
        return {}


def random_seeds(model: Path, params: Params) -> tuple[int, ...]:
    """A seed per round for the random workload whose prompts share no block; each round's differs
    (each round gets prompts of its own). Loads vLLM's benchmark code (a few seconds)."""
    if not params.num_random_prompts or "random" not in params.workloads:
        return ()
    from vllm.tokenizers import get_tokenizer

    tokenizer, seeds = get_tokenizer(str(model)), [999]
    for _ in range(params.rounds):
        seeds.append(distinct_random_seed(tokenizer, seeds[-1] + 1, params.num_random_prompts,
                                          params.prefix_tokens + params.suffix_tokens, params.output_tokens,
                                          BLOCK_TOKENS))
    return tuple(seeds[1:])


def kvtier_lines(log_path: Path, limit: int = 12) -> list[str]:
    """Warnings and errors of the server's log that mention kvtier (or a traceback), first few."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    keep = [ln for ln in lines if ("kvtier" in ln.lower() and ("WARNING" in ln or "ERROR" in ln))
            or ln.startswith("Traceback")]
    return keep[:limit]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    params = params_from(args)
    terminate_as_interrupt()
    log = Log()
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-serve-"))
    started, info = time.monotonic(), machine_info()
    runs: list[dict] = []
    try:
        log(f"building the model in {workdir}")
        model, num_params = build_model(workdir / "model", params.model)
        from transformers import AutoTokenizer
        vocab_size = len(AutoTokenizer.from_pretrained(model))
        seeds = random_seeds(model, params)
        if params.rolling is not None:
            need = footprint_blocks(params.rolling, BLOCK_TOKENS)
            dram_blocks = parse_size(params.dram, "--dram") // (BLOCK_TOKENS * params.model.kv_bytes_per_token)
            info["chat_hints_blocks"] = {**need, "dram_blocks": dram_blocks, "gpu_blocks": params.gpu_blocks}
            log(f"chat-hints: {need['num_conversations']} conversations ({need['num_closed']} close); live "
                f"prompts peak at {need['live_peak_blocks']} blocks, all seen {need['seen_blocks']}; kvtier DRAM "
                f"{dram_blocks} blocks, vLLM's own {params.gpu_blocks}")
        if seeds:
            log(f"random workload: seeds {', '.join(map(str, seeds))} (their prompts share no block)")
        with Procs() as procs:
            bench = Bench(params, workdir, model, vocab_size, procs, log, seeds)
            for r in range(params.rounds):
                order = params.configs[r % len(params.configs):] + params.configs[:r % len(params.configs)]
                for i, name in enumerate(order):
                    log(f"round {r + 1}/{params.rounds}, {i + 1}/{len(order)}: {CONFIGS[name]}")
                    runs.append(bench.run(name, r))
    except KeyboardInterrupt:
        log("[red]interrupted: every server stopped; reporting what was measured[/red]")
    finally:
        if not args.keep:
            import shutil
            shutil.rmtree(workdir, ignore_errors=True)
    info.update(loadavg_end=os.getloadavg(), wall_s=time.monotonic() - started)
    result = {"params": {**asdict(params), "block_tokens": BLOCK_TOKENS, "quick": args.quick,
                         "num_params": locals().get("num_params")},
              "machine": info, "configs": summarize_all(runs, params.configs), "runs": strip(runs)}
    print_table(result, CONFIGS)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.png:
        write_png(result, CONFIGS, Path(args.png))
    log(f"done in {info['wall_s'] / 60:.1f} min")
    return 0 if runs and all(not r.get("error") for r in runs) else 1


def strip(runs: list[dict]) -> list[dict]:
    """The runs without their generated outputs (the comparison is in the summary)."""
    drop = {"chat_tokens", "miss_tokens", "hints_chat_tokens"}
    return [{k: ({kk: vv for kk, vv in v.items() if kk != "texts"} if k in ("prefix", "random") else v)
             for k, v in r.items() if k not in drop} for r in runs]


if __name__ == "__main__":
    sys.exit(main())
