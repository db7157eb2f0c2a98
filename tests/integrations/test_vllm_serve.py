"""The README's `vllm serve` line, run as written: a real OpenAI-compatible server with kvtier.

The commands are read from README.md ("Serving with vLLM"): the tiny model is built by its first
line, the server started by its `vllm serve` line (the connector named with no module path: vLLM
finds it through kvtier's plugin entry point), and its client block (a chat sent twice, then
kvtier's metrics) run in bash, its output compared with the lines the README shows. The test
changes only what must be local (the model folder and the ports; the tiers come from a kvtier
YAML in tmp_path, with a persistent SSD tier for the restart) and adds the flags of a small test (a
host and port, a small `--max-model-len` and `--num-gpu-blocks-override`). Neither the block size
nor the dtype nor `kv_load_failure_policy` is given: kvtier follows vLLM's defaults (128-token
blocks and bf16 on CPU). Then: a completion over HTTP, the same long prompt again, kvtier's
metrics endpoint scraped
(per-tier hits from the worker process, served by the engine-core process), kvtier's start-up
lines found in the server's log, a clean stop (SIGTERM), and a second server on the same
persistent SSD tier, its connector given in the long form (`kv_connector_module_path`), that says
how many blocks it restored and hits them. On that second server, requests carrying retention hints
in `kv_transfer_params` (a lease in a session, then the session's close) and one with a malformed
hint (answered all the same), the hint counters and the leased blocks read off the metrics endpoint.

Cost: 1-3 minutes on 2 cores: two server starts (~25-60 s each, mostly vLLM's start-up).
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvtier.integrations.hf.tiny_model import build_tiny_llama
from kvtier.testing.ports import listening

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
START_DEADLINE_S = 300  # a safety net on a loaded machine, not a measurement
PROMPT = [random.Random(7).randrange(3, 512) for _ in range(600)]  # 4 full blocks of 128 tokens
HINTED = [random.Random(8).randrange(3, 512) for _ in range(600)]  # 4 blocks a session leases, then closes
MALFORMED = [random.Random(9).randrange(3, 512) for _ in range(300)]


README_MODEL = "/tmp/tiny-llama"  # the model folder the README's blocks name


def readme_blocks() -> tuple[list[str], list[str], str]:
    """README.md's "Serving with vLLM" blocks: the server's commands, the client's, and the output shown."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Serving with vLLM"):]
    section = section[:section.index("\n## ", 10)]
    fenced = re.findall(r"^```(\w*)\n(.*?)^```$", section, re.S | re.M)
    (server, client), (output,) = [b for lang, b in fenced if lang == "bash"][:2], [b for lang, b in fenced if not lang][:1]
    return server.splitlines(), client.splitlines(), output


def readme_command() -> tuple[dict[str, str], list[str]]:
    """The `vllm serve` line of the README's server block, split as a shell would: its leading
    VAR=value assignments (the environment) and the command."""
    words = shlex.split(next(line for line in readme_blocks()[0] if " vllm serve " in f" {line}"))
    i = next(i for i, w in enumerate(words) if "=" not in w)
    return dict(w.split("=", 1) for w in words[:i]), words[i:]


def _get(url: str, timeout_s: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode()


METRICS_LINE = re.compile(r"kvtier: metrics of \d+ worker rank\(s\) on http://127\.0\.0\.1:(\d+)/metrics")


class Server:
    """One `vllm serve` process (its own process group), its log file, and the ports it bound itself:
    the API's read from /proc once it listens, kvtier's metrics from the connector's log line."""

    def __init__(self, argv: list[str], log_path: Path, cwd: Path, readme_env: dict[str, str]) -> None:
        self.api_port = self.metrics_port = 0
        self.log_path = log_path
        env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_LOGGING_COLOR": "0", "NO_COLOR": "1", **readme_env}
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                         start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self) -> None:
        """Polls /health until it answers 200, to a deadline; fails with the log if the server dies."""
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {self.proc.returncode} before it was healthy:\n{self.log()[-6000:]}")
            for port in sorted(p for a, p in listening(self.proc.pid) if a == "127.0.0.1"):
                try:
                    if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                        found = METRICS_LINE.findall(self.log())
                        assert found, f"no kvtier metrics line in the log of a healthy server:\n{self.log()[-6000:]}"
                        self.api_port, self.metrics_port = port, int(found[-1])
                        return
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    pass
            try:
                self.proc.wait(timeout=0.5)  # the poll interval: returns early if the server dies
            except subprocess.TimeoutExpired:
                pass
        pytest.fail(f"vllm serve not healthy within {START_DEADLINE_S} s:\n{self.log()[-6000:]}")

    def complete(self, prompt: list[int], model: str, **fields) -> dict:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, **fields}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.api_port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.load(response)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        from prometheus_client.parser import text_string_to_metric_families

        text = _get(f"http://127.0.0.1:{self.metrics_port}/metrics")
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def stop(self) -> int | None:
        """SIGTERM, as an operator stops it; returns the exit status, None if it had to be killed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pass
        else:
            return self.proc.returncode
        os.killpg(self.proc.pid, signal.SIGKILL)  # its workers too: the group is the server's own
        self.proc.wait()
        return None


def _summed(metrics: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in metrics.items() if n == name and labels.items() <= dict(ls).items())


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("serve")
    model = work / "model"
    build = shlex.split(readme_blocks()[0][0].replace(README_MODEL, str(model)))  # the README's model, built as it says
    assert build[:2] == ["python", "-m"], build
    done = subprocess.run([sys.executable, *build[1:]], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == str(model), done.stderr[-3000:]
    assert model == build_tiny_llama(model, hidden_size=128, num_heads=4, num_kv_heads=2, num_layers=4)  # reused
    import yaml

    # block_tokens as the embedded default (16): vLLM's 128 must win. Inclusive: every block is
    # written through to the persistent SSD tier, which the second server restores.
    config = work / "kvtier.yaml"
    config.write_text(yaml.safe_dump({"model": str(model), "block_tokens": 16, "mode": "inclusive", "tiers": {
        "dram": {"capacity": "8MiB"}, "ssd": {"capacity": "16MiB", "path": str(work / "ssd"), "persist": True}}}))
    return {"work": work, "model": str(model), "config": str(config)}


def _start(setup: dict, name: str, module_path: bool = False) -> Server:
    """The README's server; `module_path`: in the long form, the connector's module named as well."""
    env, argv = readme_command()
    assert argv[:2] == ["vllm", "serve"] and "--kv-transfer-config" in argv and argv[2] == README_MODEL
    argv[0], argv[2] = str(Path(sys.executable).with_name("vllm")), setup["model"]
    i = argv.index("--kv-transfer-config") + 1
    transfer = json.loads(argv[i])
    assert "kv_load_failure_policy" not in transfer  # vLLM's default ('fail') must work
    assert "kv_connector_module_path" not in transfer  # vLLM finds the connector by name (kvtier's plugin)
    if module_path:
        transfer["kv_connector_module_path"] = "kvtier.integrations.vllm.connector"
    extra = transfer["kv_connector_extra_config"]
    assert set(extra) == {"dram", "metrics_port"}
    del extra["dram"]  # the test's YAML gives the tiers: a small DRAM and a persistent SSD for the restart
    extra.update(kvtier_config=setup["config"], metrics_port=0)  # 0: any free port, named in the log
    argv[i] = json.dumps(transfer)
    assert {"--enforce-eager", "--no-enable-prefix-caching"} <= set(argv)
    argv += ["--host", "127.0.0.1", "--port", "0", "--max-model-len", "1024", "--num-gpu-blocks-override", "64"]
    server = Server(argv, setup["work"] / f"{name}.log", setup["work"], env)
    try:
        server.wait_healthy()
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def first(setup) -> dict:
    """The README's server: the same prompt twice, a scrape, the README's client block, then SIGTERM."""
    server = _start(setup, "first")
    try:
        outputs = [server.complete(PROMPT, setup["model"]) for _ in range(2)]
        metrics = server.metrics()
        client = "\n".join(readme_blocks()[1]).replace(README_MODEL, setup["model"])
        client = client.replace("localhost:8000", f"127.0.0.1:{server.api_port}")
        client = client.replace("localhost:9464", f"127.0.0.1:{server.metrics_port}")
        readme_client = subprocess.run(["bash", "-euo", "pipefail", "-c", client], capture_output=True, text=True,
                                       timeout=300)
    finally:
        status = server.stop()
    return {"outputs": outputs, "metrics": metrics, "log": server.log(), "status": status,
            "readme_client": readme_client}


@pytest.fixture(scope="module")
def second(setup, first) -> dict:
    """A fresh server on the first one's persistent SSD tier, its connector given in the long form
    (with its module path): the prompt once, a scrape, SIGTERM."""
    server = _start(setup, "second", module_path=True)
    try:
        output = server.complete(PROMPT, setup["model"])
        metrics = server.metrics()
        hinted = _hinted_requests(server, setup["model"])
    finally:
        status = server.stop()
    return {"output": output, "metrics": metrics, "log": server.log(), "status": status, "hinted": hinted}


def _hinted_requests(server: Server, model: str) -> dict:
    """A lease in session s-42, a scrape; a malformed hint; the session's closing turn, a scrape."""
    leased = server.complete(HINTED, model, kv_transfer_params={"kvtier": {"retain_s": 300, "session": "s-42"}})
    during = server.metrics()
    malformed = server.complete(MALFORMED, model, kv_transfer_params={"kvtier": {"retain_s": "forever"}})
    closing = server.complete(HINTED + HINTED[:40], model, kv_transfer_params={"kvtier": {"session": "s-42",
                                                                                           "closed": True}})
    return {"outputs": [leased, malformed, closing], "during": during, "after": server.metrics()}


def test_the_readme_line_serves_completions(first):
    texts = [out["choices"][0]["text"] for out in first["outputs"]]
    assert all(out["usage"]["prompt_tokens"] == len(PROMPT) for out in first["outputs"])
    assert texts[0] and texts[0] == texts[1]  # greedy: the KV loaded from kvtier is the KV computed


def test_the_readme_client_block_prints_the_metric_lines_it_shows(first):
    run = first["readme_client"]
    assert run.returncode == 0, run.stderr[-3000:]
    shown = dict(line.rsplit(" ", 1) for line in readme_blocks()[2].splitlines())
    printed = dict(line.rsplit(" ", 1) for line in run.stdout.splitlines())
    assert set(printed) == set(shown)  # the same series; counts add to the test's own requests before
    assert float(printed['kvtier_vllm_prompt_blocks_total{source="kvtier"}']) >= float(
        shown['kvtier_vllm_prompt_blocks_total{source="kvtier"}']) > 0
    assert float(printed['kvtier_vllm_prompt_blocks_total{source="engine"}']) == 0  # vLLM's prefix cache is off


def test_a_repeated_prompt_hits_kvtier_on_the_metrics_endpoint(first):
    metrics = first["metrics"]
    assert metrics[("kvtier_vllm_rank_up", (("rank", "0"),))] == 1  # the worker process answered the scrape
    assert _summed(metrics, "kvtier_hits_total", rank="0", tier="dram") > 0
    assert _summed(metrics, "kvtier_vllm_blocks_loaded_total") == _summed(metrics, "kvtier_hits_total") > 0
    assert _summed(metrics, "kvtier_vllm_prompt_blocks_total", source="kvtier") > 0
    assert _summed(metrics, "kvtier_vllm_blocks_failed_total") == 0
    assert ("kvtier_store_backlog_bytes", (("rank", "0"),)) in metrics


def test_kvtier_start_up_lines_are_in_vllms_log(first):
    lines = [line for line in first["log"].splitlines() if "kvtier" in line and " INFO " in line]
    rank = [line for line in lines if "kvtier rank 0: " in line]
    assert len(rank) == 1, lines  # once, from the worker process
    assert "tiers dram 8 MiB" in rank[0] and "ssd 16 MiB" in rank[0] and "blocks restored from disk" in rank[0]
    assert any("blocks of 128 tokens, the engine's block size (block_tokens: 16" in line for line in lines), lines
    assert any("kv_load_failure_policy 'fail' -> 'recompute'" in line for line in lines), lines
    assert any("/metrics" in line and "kvtier: metrics of 1 worker rank" in line for line in lines), lines


def test_the_server_stops_cleanly_on_sigterm(first, second):
    assert first["status"] == 0 and second["status"] == 0  # None: it had to be killed
    # vLLM's default shutdown (--shutdown-timeout 0) kills the engine at once, and its API server
    # may log the engine's death (EngineDeadError), with or without kvtier; nothing of kvtier's may fail.
    for log in (first["log"], second["log"]):
        failed = [line for line in log.splitlines() if ("kvtier" in line and " ERROR " in line)
                  or ('File "' in line and "/kvtier/" in line)]
        assert not failed, failed


def test_a_restarted_server_restores_the_ssd_tier_and_hits_it(first, second):
    restored = [line for line in second["log"].splitlines() if "blocks restored from disk" in line]
    assert restored and " 0 blocks restored" not in restored[0], restored
    assert second["output"]["choices"][0]["text"] == first["outputs"][0]["choices"][0]["text"]
    assert _summed(second["metrics"], "kvtier_hits_total", tier="ssd") > 0


def test_hints_in_kv_transfer_params_lease_blocks_until_their_session_closes(second):
    hinted = second["hinted"]
    prompts = [HINTED, MALFORMED, HINTED + HINTED[:40]]
    assert [out["usage"]["prompt_tokens"] for out in hinted["outputs"]] == [len(p) for p in prompts], \
        "every request answered, the malformed one too"
    during, after = hinted["during"], hinted["after"]
    assert _summed(during, "kvtier_retained_blocks", rank="0") == len(HINTED) // 128, "the session's 4 blocks leased"
    assert _summed(after, "kvtier_hints_read_total") == 2
    assert _summed(after, "kvtier_hints_refused_total", reason="bad_retain_s") == 1
    assert _summed(after, "kvtier_hints_refused_total") == 1
    assert _summed(after, "kvtier_hints_total", rank="0", outcome="applied") >= 3  # lease, the malformed's, close
    assert _summed(after, "kvtier_hints_total", rank="0", outcome="closed") == 1
    assert _summed(after, "kvtier_hints_total", outcome="over_budget") == 0
    assert _summed(after, "kvtier_retained_blocks", rank="0") == 0, "s-42 closed: its blocks lost their lease"
