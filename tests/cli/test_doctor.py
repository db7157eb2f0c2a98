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
        script = checks["rdma"]["hint"].split("sudo bash ")[1].split(" ")[0]  # the installed package's copy
        assert os.path.isfile(script) and script.endswith("kvtier/pool/rxe_setup.sh")
        assert checks["pool"]["detail"].startswith("tcp (no RDMA device")


def test_a_missing_ssd_dir_kvtier_would_create_passes_and_is_not_created(tmp_path) -> None:
    # what the SSD tier does at start-up (and `kvtier info` says): the folder is made, so it is no failure
    run = doctor("--ssd-dir", str(tmp_path / "missing" / "ssd"))
    line = next(line for line in run.stdout.splitlines() if "O_DIRECT on" in line)
    assert line.startswith(("[  ok]", "[warn]")), run.stdout
    assert f"probed in {tmp_path}: the directory is created at start-up" in line
    assert "locked memory" in run.stdout
    assert run.returncode == (1 if "[fail]" in run.stdout else 0)
    assert list(tmp_path.iterdir()) == [], "doctor left something behind"


def test_an_ssd_dir_under_a_regular_file_fails_naming_it(tmp_path) -> None:
    (tmp_path / "file").write_text("")
    run = doctor("--ssd-dir", str(tmp_path / "file" / "ssd"))
    assert run.returncode == 1, run.stdout
    assert f"[fail] O_DIRECT on {tmp_path / 'file' / 'ssd'}: {tmp_path / 'file'} is not a directory" in run.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_an_ssd_dir_that_is_a_regular_file_fails() -> None:
    from kvtier.cli.doctor import check_o_direct

    check = check_o_direct(os.devnull)
    assert (check.status, check.detail) == ("fail", f"{os.devnull} is not a directory") and check.hint


def test_an_ssd_dir_under_a_kernel_folder_fails_naming_it() -> None:
    from kvtier.cli.doctor import check_o_direct

    check = check_o_direct("/proc/kvtier-doctor-test/ssd")
    assert check.status == "fail" and check.detail.startswith("cannot create the directory in /proc: "), check
    assert "device or kernel folder" in check.detail


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a read-only folder")
def test_an_ssd_dir_under_an_unwritable_folder_fails_naming_it(tmp_path) -> None:
    from kvtier.cli.doctor import check_o_direct

    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    try:
        check = check_o_direct(str(locked / "ssd"))
    finally:
        locked.chmod(0o755)
    assert check.status == "fail" and check.name == f"O_DIRECT on {locked / 'ssd'}"
    assert check.detail == f"cannot create the directory in {locked}: Permission denied", check
    assert list(locked.iterdir()) == []


def test_an_existing_ssd_dir_is_probed_in_place_and_left_as_found(tmp_path) -> None:
    from kvtier.cli.doctor import check_o_direct

    check = check_o_direct(str(tmp_path))
    assert check.status in ("ok", "warn") and "created at start-up" not in check.detail, check
    assert list(tmp_path.iterdir()) == []


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
