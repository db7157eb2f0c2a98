"""`kvtier doctor` as a user runs it: a subprocess, its JSON and text output. Cost: about 3 s."""

from __future__ import annotations

import pytest

import json
import os
import resource
import subprocess
import sys

from kvtier.testing.pool import FAKE_VERBS

pytestmark = pytest.mark.slow  # seconds per test here: kept out of `make test-fast`


def doctor(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier", "doctor", *args], check=False, capture_output=True, text=True,
                          timeout=120, env=env)


def test_json_lists_every_check_with_a_status(tmp_path) -> None:
    run = doctor("--json", "--ssd-dir", str(tmp_path))
    checks = {c["name"].split(" ")[0]: c for c in json.loads(run.stdout)}
    assert {"rdma", "locked", "hugepages", "O_DIRECT", "CUDA", "pool"} <= set(checks)
    assert all(c["status"] in ("ok", "warn", "fail") for c in checks.values())
    assert run.returncode == (1 if any(c["status"] == "fail" for c in checks.values()) else 0)
    assert checks["pool"]["detail"].startswith(("tcp", "rdma"))
    if checks["rdma"]["name"] == "rdma":  # no device here: reported with the reason and a hint
        assert "no RDMA device" in checks["rdma"]["detail"] and checks["rdma"]["hint"]
        assert checks["pool"]["detail"].startswith("tcp (no RDMA device")


def test_text_output_and_a_missing_ssd_dir_fails(tmp_path) -> None:
    run = doctor("--ssd-dir", str(tmp_path / "missing"))
    assert run.returncode == 1 and "[fail] O_DIRECT" in run.stdout and "locked memory" in run.stdout


def test_fake_fabric_is_reported_as_a_device(tmp_path) -> None:
    env = {**os.environ, "KVTIER_FAKE_FABRIC": str(tmp_path)}
    checks = json.loads(doctor("--json", "--verbs", FAKE_VERBS, "--ssd-dir", str(tmp_path), env=env).stdout)
    gid = next(c for c in checks if c["name"] == "rdma fake0 GID")
    assert gid["status"] == "ok" and "RoCE v2" in gid["detail"]
    assert next(c for c in checks if c["name"].startswith("pool"))["detail"].startswith("rdma")


def test_a_config_with_an_rdma_pool_sets_the_locked_memory_it_needs(tmp_path) -> None:
    config = tmp_path / "kvtier.yaml"
    config.write_text(
        "model: kvtier-tiny\n"
        "tiers:\n"
        "  dram: {capacity: 64MiB}\n"
        "  pool: {capacity: 1GiB, nodes: ['127.0.0.1:7070', '127.0.0.1:7071'], transport: auto}\n"
        f"  ssd: {{capacity: 64MiB, path: {tmp_path / 'ssd'}}}\n")
    (tmp_path / "ssd").mkdir()
    memlock = doctor_memlock(config)
    assert memlock["status"] == "warn" and f"pins {(96 << 20) // 1024} KiB" in memlock["detail"], memlock
    assert "DRAM tier (64 MiB, zero copy) and 2 staging buffer(s)" in memlock["detail"] and memlock["hint"]
    checks = json.loads(doctor("--json", "--config", str(config)).stdout)
    assert any(c["name"] == f"O_DIRECT on {tmp_path / 'ssd'}" for c in checks), "the config's SSD path is probed"
    config.write_text(config.read_text().replace("transport: auto", "transport: tcp"))
    assert "pins" not in doctor_memlock(config)["detail"], "a TCP pool pins nothing"


def doctor_memlock(config) -> dict:
    """The locked-memory check of `kvtier doctor --config`, run under a 32 MiB (or lower) limit."""
    _, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    soft = 32 << 20 if hard == resource.RLIM_INFINITY else min(32 << 20, hard)
    run = subprocess.run([sys.executable, "-m", "kvtier", "doctor", "--json", "--config", str(config)],
                         check=False, capture_output=True, text=True, timeout=120,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard)))
    return next(c for c in json.loads(run.stdout) if c["name"] == "locked memory (ulimit -l)")


def test_a_bad_config_is_named(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: kvtier-tiny\ntiers: {dram: {capacity: 4G}}\n")
    run = doctor("--config", str(bad))
    assert run.returncode == 2 and "tiers.dram.capacity" in run.stdout and "ambiguous" in run.stdout
