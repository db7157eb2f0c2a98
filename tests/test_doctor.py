"""`kvtier doctor` as a user runs it: a subprocess, its JSON and text output. Cost: about 3 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def doctor(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier", "doctor", *args], check=False, capture_output=True, text=True,
                          timeout=120, env=env or {k: v for k, v in os.environ.items() if k != "KVTIER_VERBS"})


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
    env = {**os.environ, "KVTIER_VERBS": "fake", "KVTIER_FAKE_FABRIC": str(tmp_path)}
    checks = json.loads(doctor("--json", "--ssd-dir", str(tmp_path), env=env).stdout)
    gid = next(c for c in checks if c["name"] == "rdma fake0 GID")
    assert gid["status"] == "ok" and "RoCE v2" in gid["detail"]
    assert next(c for c in checks if c["name"].startswith("pool"))["detail"].startswith("rdma")
