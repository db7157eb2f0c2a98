"""README.md as written: its Python blocks run, its YAML is a config kvtier takes, and the figures
it quotes from `kvtier simulate` are what the command prints.

Each ```python block runs verbatim in a fresh interpreter in an empty folder (offline: nothing may
come from a model hub). The ```yaml block is validated as a config. Every block of figures that
starts with `$ kvtier simulate ...` is checked against a real run of that command: each number the
README shows (counts, percentages, sizes) must appear in the command's output; so must the sizes
it says a `kvtier size ...` command prints. The `vllm serve`
blocks run in tests/integrations/test_vllm_serve.py; `pip install .` in tests/test_install.py;
`make run` and `make test` are what CI runs.

Cost: ~15-25 s (a tiny model built, two short replays).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.config import config_from_dict
from kvtier.yaml_strict import load_yaml

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
FIGURE = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?%?")


def blocks(language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(README.read_text()) if lang == language]


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_each_python_block_runs_as_written(index, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(blocks("python")[index])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, f"README python block {index}:\n{run.stderr[-4000:]}"


def test_there_are_python_blocks_to_run():
    assert len(blocks("python")) >= 2  # the runtime's API and the complete Hugging Face example


def test_the_yaml_block_is_a_config_kvtier_takes():
    (block,) = blocks("yaml")
    config = config_from_dict(load_yaml(block))
    assert [t.kind.name.lower() for t in config.tiers] == ["hbm", "dram", "pool", "ssd"]


def _simulate_examples() -> list[tuple[str, list[str]]]:
    """(command, the figures quoted under it) for each `$ kvtier simulate` line in a plain block."""
    found = []
    for lang, body in FENCE.findall(README.read_text()):
        lines = body.splitlines()
        for i, line in enumerate(lines):
            if lang == "" and line.startswith("$ kvtier simulate "):
                command = line[2:].split("#")[0].strip()
                quoted = []
                for figures in lines[i + 1:]:
                    if figures.startswith("$ "):
                        break
                    quoted += FIGURE.findall(figures)
                found.append((command, quoted))
    return found


@pytest.mark.parametrize("command, quoted", _simulate_examples(), ids=lambda v: v if isinstance(v, str) else "")
def test_the_simulate_figures_quoted_are_what_the_command_prints(command, quoted):
    assert len(quoted) > 10, quoted
    argv = shlex.split(command)
    assert argv[0] == "kvtier"
    env = {**os.environ, "COLUMNS": "200"}
    run = subprocess.run([sys.executable, "-m", "kvtier", *argv[1:], "--no-progress"], capture_output=True,
                         text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    printed = set(FIGURE.findall(run.stdout + run.stderr))
    missing = [f for f in quoted if f not in printed]
    assert not missing, f"{command}: the README quotes {missing}, which the command does not print"


SAYS = re.compile(r"`(kvtier size [^`]+)` says (.+?)\.\n", re.S)  # the planner's figures
SIZE = re.compile(r"\d+(?:\.\d+)? (?:KiB|MiB|GiB|GB)")
CLAIMS = [(command, claim) for command, claim in SAYS.findall(README.read_text()) if SIZE.search(claim)]


def test_the_readme_quotes_a_command_with_figures():
    assert CLAIMS  # `kvtier size ...` says ...


@pytest.mark.parametrize("command, claim", CLAIMS, ids=lambda v: v[:40])
def test_a_command_the_readme_says_prints_figures_prints_them(command, claim):
    quoted = SIZE.findall(claim)
    run = subprocess.run([sys.executable, "-m", "kvtier", *shlex.split(command)[1:]], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert run.returncode == 0, run.stderr[-2000:]
    missing = [q for q in quoted if q not in run.stdout]
    assert not missing, f"`{command}`: the README says {missing}, which it does not print"
