"""The processes of bench_serve.py: `vllm serve`, `kvtier pool serve` and `vllm bench serve`.

Every child runs in its own process group and session (so Ctrl-C in the terminal reaches only the
bench, which then stops them), gets SIGTERM if the bench itself dies (PR_SET_PDEATHSIG), and is
stopped group-wide: SIGTERM, a deadline, then SIGKILL, so the engine and worker processes that
`vllm serve` forks go with it. Servers listen on 127.0.0.1 only. Also here: the tiny model and the
kvtier YAML configs the servers load.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvtier.bench.measure import proc_stat, stat_cpu_s
from kvtier.testing.ports import listening

REPO_ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"  # every server listens here only
STOP_TIMEOUT_S = 30.0
POLL_S = 0.25  # how often a starting server is asked whether it is ready
_PR_SET_PDEATHSIG = 1


_EXCEPTION_LINE = re.compile(r"^(?:\(\S+ pid=\d+\) )?((?:\w+\.)*[A-Z]\w*(?:Error|Exception): (?!Engine core initialization failed).+)$",
                             re.MULTILINE)  # a traceback's last line, as vLLM's processes print it


class StartError(RuntimeError):
    """A server exited or did not become ready in time; carries the tail of its log."""

    def __init__(self, message: str, log_tail: str) -> None:
        super().__init__(message)
        self.log_tail = log_tail


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: Ctrl-C and errors are still covered by Procs


class Proc:
    """One child process in a group of its own, its output (stdout and stderr) in `log_path`."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.cmd, self.log_path = name, cmd, log_path
        with open(log_path, "wb") as log:
            self.popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env=env, start_new_session=True, preexec_fn=_die_with_parent)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exited(self) -> bool:
        return self.popen.poll() is not None

    def wait(self, timeout_s: float) -> int | None:
        """The exit status, or None if it still runs after `timeout_s`."""
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM to the whole group, then SIGKILL to what is left of it after `timeout_s`."""
        self._signal_group(signal.SIGTERM)
        if self.wait(timeout_s) is None:
            self._signal_group(signal.SIGKILL)
            self.popen.wait()
        self._signal_group(signal.SIGKILL)  # children that outlived the leader

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)  # the group id is the leader's pid (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass

    def root_cause(self) -> str | None:
        """The last exception line (`SomethingError: why`) of the log but vLLM's own "Engine core
        initialization failed": a failing engine prints its cause above that generic one."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return None
        found = _EXCEPTION_LINE.findall(text)
        return found[-1].strip() if found else None

    def log_tail(self, num_lines: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])


class Procs:
    """Owns every child the bench starts; stops them all on exit, newest first, whatever happened."""

    def __init__(self) -> None:
        self._procs: list[Proc] = []

    def start(self, name: str, cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> Proc:
        proc = Proc(name, cmd, log_path, env)
        self._procs.append(proc)
        return proc

    def stop(self, proc: Proc) -> None:
        proc.stop()
        if proc in self._procs:
            self._procs.remove(proc)

    def stop_all(self) -> None:
        while self._procs:
            self.stop(self._procs[-1])

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()


def cpu_seconds(groups: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) spent so far by every process of each named process group (a
    `Proc`'s pid is its group's id), split by process name and main thread against the others:
    `{"vllm serve/VLLM::Worker/main": 12.3, ...}`. Processes that ended are not counted, so take
    both readings while the servers run. Linux only; empty where /proc cannot be read."""
    found: dict[str, float] = {}
    wanted = {pgid: name for name, pgid in groups.items()}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm, rest = proc_stat(entry / "stat")
            group = wanted.get(int(rest[2]))  # the fields after the name: state, ppid, pgrp, ...
            if group is None:
                continue
            for task in (entry / "task").iterdir():
                key = f"{group}/{comm}/{'main' if task.name == entry.name else 'threads'}"
                found[key] = found.get(key, 0.0) + stat_cpu_s(proc_stat(task / "stat")[1])
        except (OSError, ValueError, IndexError):
            continue  # a process or thread that ended while being read
    return found


def terminate_as_interrupt() -> None:
    """SIGTERM to the bench raises KeyboardInterrupt, so the same cleanup as Ctrl-C runs."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, handler)


def vllm_executable() -> str:
    beside = Path(sys.executable).with_name("vllm")
    found = str(beside) if beside.exists() else shutil.which("vllm")
    if not found:
        raise SystemExit("bench_serve: no `vllm` executable next to this Python or on PATH")
    return found


def child_env(**extra: str) -> dict[str, str]:
    """The environment of every child: this repository first on PYTHONPATH (vLLM's processes import
    the connector from it), vLLM's CPU KV cache small (its block count is overridden anyway), and
    the same CPUs reserved for every server.

    vLLM's CPU backend keeps `local_world_size` cores away from its engine for the scheduler
    process, and as many again when a KV connector is configured (for NIXL's threads); when that
    leaves no core for the engine it reserves none. On a 2-core machine a plain server thus
    computes on 1 core and any server with a connector on 2: twice the prefill speed for reasons
    that have nothing to do with the cache. `VLLM_CPU_NUM_OF_RESERVED_CPU` fixes the reservation
    for all of them (default: half the cores, at least 1).
    """
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    reserved = os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", str(max(1, (os.cpu_count() or 2) // 2)))
    return {**os.environ, "PYTHONPATH": path, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": reserved, "PYTHONUNBUFFERED": "1", **extra}


def wait_http_ready(proc: Proc, path: str, timeout_s: float) -> tuple[int, float]:
    """Waits until `proc`, started on port 0 (`vllm serve --port 0`), answers 200 at `path` on the port
    it bound; returns that port and the seconds it took. Raises StartError.

    The port is read from /proc, from the sockets the process itself listens on: no port is picked
    here and bound there later, so no other process can take it in between.
    """
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.exited():
            cause = proc.root_cause()
            raise StartError(f"{proc.name} exited with status {proc.popen.returncode} before it was ready"
                             + (f": {cause}" if cause else ""), proc.log_tail())
        for address, port in sorted(listening(proc.pid)):
            if address not in (HOST, "0.0.0.0", "::"):
                continue
            try:
                with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=2) as r:
                    if r.status == 200:
                        return port, time.monotonic() - start
            except (urllib.error.URLError, OSError):
                pass
        time.sleep(POLL_S)
    raise StartError(f"{proc.name} not ready after {timeout_s:.0f} s", proc.log_tail())


def start_pool_node(procs: Procs, log_path: Path, capacity: str, timeout_s: float = 60.0) -> tuple[Proc, str]:
    """A real `kvtier pool serve` on 127.0.0.1 (a port of its choosing); returns it and its HOST:PORT."""
    cmd = [sys.executable, "-m", "kvtier", "pool", "serve", "--listen", "127.0.0.1:0", "--capacity", capacity]
    proc = procs.start("kvtier pool serve", cmd, log_path, child_env())
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        for line in log_path.read_text(errors="replace").splitlines():
            if line.startswith("{") and '"ready"' in line:
                return proc, json.loads(line)["listen"]
        if proc.exited():
            break
        time.sleep(POLL_S)
    raise StartError("kvtier pool serve did not print its ready line", proc.log_tail())


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The Llama-shaped model the bench serves (random weights; 12 KiB of KV per token at fp32)."""

    num_layers: int = 6
    hidden_size: int = 512
    intermediate_size: int = 1536
    num_heads: int = 8
    num_kv_heads: int = 4
    max_positions: int = 4096
    seed: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * (self.hidden_size // self.num_heads) * 4


def build_model(path: Path, spec: ModelSpec) -> tuple[Path, int]:
    """Writes the model and a locally trained tokenizer into `path`; returns it and the parameter count.

    The model's vocabulary is exactly the tokenizer's, so every token it generates decodes.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kvtier.integrations.hf.tiny_model import build_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path, vocab_size=512)
    vocab_size = len(AutoTokenizer.from_pretrained(path))
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                         num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                         num_key_value_heads=spec.num_kv_heads, max_position_embeddings=spec.max_positions,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return path, sum(p.numel() for p in model.parameters())


def write_kvtier_config(path: Path, model: Path, block_tokens: int, tiers: dict,
                        transfer: dict | None = None) -> Path:
    """kvtier's YAML for the served model; `transfer`: its `transfer:` section where given."""
    import yaml

    config = {"model": str(model), "kv_dtype": "fp32", "block_tokens": block_tokens, "tiers": tiers}
    if transfer:
        config["transfer"] = transfer
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def kv_transfer_config(kvtier_yaml: Path) -> str:
    """The --kv-transfer-config JSON, as the README's `vllm serve` line has it: vLLM's default
    `kv_load_failure_policy` (the connector itself asks for `recompute`); kvtier's own metrics
    served on 127.0.0.1, on a port the server picks (`kvtier_metrics_port` finds it)."""
    return json.dumps({"kv_connector": "KVTierConnector",  # found by name: kvtier's plugin entry point
                       "kv_role": "kv_both", "kv_connector_extra_config": {"kvtier_config": str(kvtier_yaml),
                                                                           "metrics_port": 0}})


_METRICS_LINE = re.compile(r"kvtier: metrics of \d+ worker rank\(s\) on http://127\.0\.0\.1:(\d+)/metrics")


def kvtier_metrics_port(proc: Proc) -> int | None:
    """The port of kvtier's metrics endpoint, as `proc`'s log says the connector bound it; None
    where it has not said so (plain vLLM, or not started yet)."""
    try:
        found = _METRICS_LINE.findall(proc.log_path.read_text(errors="replace"))
    except OSError:
        return None
    return int(found[-1]) if found else None
