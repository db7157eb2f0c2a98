"""bench/gpu_check.py run as a user runs it, in a subprocess (cost: ~25 s here; the gpu test ~1 min).

Here there is no GPU: the script must say so, exit 3, and still record the nvcc build. Its
`--simulate-cpu` mode runs the other sections on CPU stand-ins, which tests the script's own logic
(byte checks, JSON, exit code) but nothing about a GPU. The `gpu` test runs `--quick` on a device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier.moving.native import find_nvcc

pytestmark = pytest.mark.slow  # seconds per test here: kept out of `make test-fast`

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
TIMEOUT_S = 600  # a safety net against hangs, never a measurement


def run_check(out_dir: Path, *args: str, hide_cuda: bool = False) -> tuple[subprocess.CompletedProcess, dict]:
    env = dict(os.environ)
    env.pop("OUT", None)
    if hide_cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out_dir), *args], check=False,
                          capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    report = out_dir / "gpu_check.json"
    return done, json.loads(report.read_text()) if report.exists() else {}


def test_without_cuda_it_says_so_exits_3_and_still_builds_with_nvcc(tmp_path):
    done, report = run_check(tmp_path, "--quick", hide_cuda=True)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "no CUDA device: nothing to check" in done.stdout
    assert report["cuda"] is False
    assert report["sections"]["env"]["reason"]
    assert set(report["sections"]) == {"env", "nvcc"}
    nvcc = report["sections"]["nvcc"]
    if find_nvcc() is None:
        assert nvcc["status"] == "skip"
    else:
        assert nvcc["status"] == "pass" and nvcc["arch"] == "sm_90" and not nvcc["missing_kernels"]
        assert Path(nvcc["cubin"]).read_bytes()[:4] == b"\x7fELF"


@pytest.mark.skipif(torch.cuda.is_available(), reason="simulates the GPU sections where there is no GPU")
def test_simulated_on_cpu_every_section_runs_and_passes(tmp_path):
    done, report = run_check(tmp_path, "--quick", "--simulate-cpu")
    assert done.returncode == 0, done.stdout + done.stderr
    sections = report["sections"]
    assert {"kernels", "layouts", "runtime", "bandwidth"} <= set(sections)
    assert sections["kernels"]["backends"] == ["torch"] and sections["kernels"]["cases"] > 0
    assert sections["layouts"]["backends"] == ["torch"] and sections["layouts"]["cases"] == 2 * 8
    assert set(sections["runtime"]["where_after_store"].values()) == {"HBM", "DRAM", "SSD"}
    rows = sections["bandwidth"]["rows"]
    assert [r["block_mib"] for r in rows] == [1.0, 4.0] and all(r["bytes_ok"] for r in rows)
    assert all(r["kvtier_h2d_gbps"] > 0 and r["ratio_d2h"] > 0 for r in rows)
    copier = sections["copier"]  # through the stand-in driver: the batch path and the forced loop
    assert copier["status"] == "pass" and copier["copiers"]["batch"]["path"] == "BATCH_V2"
    assert copier["copiers"]["loop"]["path"] == "LOOP"
    assert [r["block_kib"] for r in copier["rows"]] == [64, 1024, 4096] and all(r["bytes_ok"] for r in copier["rows"])
    assert all(r["batch_descriptors"] == r["num_blocks"] and r["ratio_loop_h2d"] > 0 for r in copier["rows"])
    assert "PASS" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only: the gate is exercised on CPU stand-ins")
def test_an_unreachable_ratio_gate_fails_the_run(tmp_path):
    done, report = run_check(tmp_path, "--quick", "--simulate-cpu", "--min-ratio", "1000")
    assert done.returncode == 1
    assert report["sections"]["bandwidth"]["status"] == "fail"
    assert report["passed"] is False


def test_the_kernel_check_catches_a_backend_that_moves_nothing():
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_check

    gen = torch.Generator().manual_seed(0)
    for kv_dim in (0, 1, None):
        assert gpu_check.run_case(gpu_check.Kernels.TORCH, kv_dim, torch.bfloat16, 3, gpu_check.PAGES[0], "cpu", gen)
        assert not gpu_check.run_case(lambda calls: None, kv_dim, torch.float16, 3, gpu_check.PAGES[1], "cpu", gen)


def test_the_layout_check_catches_a_backend_that_moves_nothing_or_misreads_the_layout():
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_check

    gen = torch.Generator().manual_seed(0)
    shape = gpu_check.LAYOUT_SHAPES[0]
    for layout in gpu_check.VLLM_LAYOUTS:
        for ratio in gpu_check.kernel_ratios(layout):
            assert gpu_check.layout_case(gpu_check.Kernels.TORCH, layout, ratio, torch.bfloat16, shape, "cpu", gen)
            assert not gpu_check.layout_case(lambda calls: None, layout, ratio, torch.bfloat16, shape, "cpu", gen)
    # the reference tells the two interior orders apart: same bytes, other places
    kv = gpu_check.vllm_layout_caches("LBHNC", 1, 4, 2, 16, 8, torch.bfloat16, "cpu")[0]
    heads_first, tokens_first = (gpu_check.expected_block_bytes(kv, 1, 1, major, 8) for major in (True, False))
    assert not torch.equal(heads_first, tokens_first)
    assert torch.equal(heads_first.sort().values, tokens_first.sort().values)


@pytest.mark.gpu
def test_quick_check_passes_on_a_gpu(tmp_path):
    done, report = run_check(tmp_path, "--quick")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert report["cuda"] is True and report["passed"] is True
    assert all(s["status"] == "pass" for s in report["sections"].values())
