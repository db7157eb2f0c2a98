"""`pip install .` works outside the checkout: a wheel built from the source tree, installed on its
own into a fresh folder, imports its compiled modules and finds what it needs at run time.

The wheel is built from a copy of the files git would ship (tracked, and untracked but not
ignored), so the build leaves nothing in the checkout (an egg-info there would shadow the venv's
metadata for anything run from the repository root). It is installed with `pip install --target`
and used from a directory outside the checkout: the compiled modules (`_keytable`, `_replay`,
`_movers`), the embedded default config, the shipped traces (`kvtier simulate --trace
conversation`), the soft-RoCE script `kvtier doctor` names, the `kvtier` console script, and the
`vllm.general_plugins` entry point by which vLLM finds the connector. Its dependencies (torch and
the rest) come from this venv, as they would from any venv that has them.

Cost: ~30-60 s on 2 cores (three C extensions compiled once).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.traces import TRACE_DIR, needs_traces

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys
from pathlib import Path
import kvtier, kvtier._keytable, kvtier._replay, kvtier.moving._movers
from kvtier.config import load_config
from kvtier.simulate.trace import load_trace, resolve_trace_path
from kvtier.pool.detect import rxe_setup_script
config = load_config(None)
trace = resolve_trace_path("conversation")
print(json.dumps({"kvtier": kvtier.__file__, "movers": kvtier.moving._movers.__file__,
                  "tiers": [t.kind.name for t in config.tiers], "trace": str(trace),
                  "requests": len(load_trace(trace, limit=100).requests), "rxe": str(rxe_setup_script())}))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("install")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    source = work / "source"
    for name in filter(None, listed):
        if (REPO / name).is_file():  # a file deleted in the work tree but still tracked is not shipped
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    wheels = work / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                            "-w", str(wheels), str(source)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-4000:]
    (wheel,) = wheels.glob("kvtier-*.whl")
    site = work / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                              "--target", str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-4000:]
    assert not (REPO / "kvtier.egg-info").exists() or (REPO / "kvtier.egg-info").stat().st_mtime < wheel.stat().st_mtime
    return site


def _run(site: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_installed_package_imports_and_finds_its_files(installed, tmp_path):
    out = _run(installed, tmp_path, sys.executable, "-c", PROBE)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for what in ("kvtier", "movers", "trace", "rxe"):
        assert Path(got[what]).is_relative_to(installed), (what, got[what])  # not the checkout's
    assert got["tiers"] and got["requests"] == 100
    assert os.access(got["rxe"], os.R_OK)


def test_the_console_script_and_the_vllm_entry_point_are_installed(installed, tmp_path):
    out = _run(installed, tmp_path, str(installed / "bin" / "kvtier"), "info")
    assert out.returncode == 0, out.stderr[-4000:]
    assert "dram" in out.stdout.lower()
    (dist,) = installed.glob("kvtier-*.dist-info")
    entry_points = (dist / "entry_points.txt").read_text()
    assert "[vllm.general_plugins]" in entry_points
    assert "kvtier = kvtier.integrations.vllm.plugin:register" in entry_points


@needs_traces  # the uncompressed originals: the shared/ directory next to the repo, or KVTIER_TRACE_DIR
def test_the_shipped_traces_are_the_originals_byte_for_byte():
    import zstandard

    from kvtier.simulate.trace import DEFAULT_TRACE_DIR, resolve_trace_path

    for name in ("conversation", "synthetic"):
        shipped = resolve_trace_path(name)
        assert shipped == DEFAULT_TRACE_DIR / f"{name}_trace.jsonl.zst"
        with open(shipped, "rb") as f:
            assert zstandard.ZstdDecompressor().stream_reader(f).read() == \
                (TRACE_DIR / f"{name}_trace.jsonl").read_bytes()
