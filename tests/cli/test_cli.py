"""`kvtier info` and `kvtier run`: the real commands in subprocesses, on a tiny config.

The config holds kvtier-tiny (8 KiB blocks): HBM 4 blocks, DRAM 8, SSD 64 in real files under
tmp_path, so 40 blocks spill through every tier and none is dropped. Bad configs must exit 2 with
one line on stderr.
`kvtier info` and `kvtier doctor` describe only: on a config of 1 GiB persistent SSD slabs they must
leave the directory as they found it.
Cost: about 8 s on an idle machine (20 s on a busy 2-core one): the nine commands run at once, and
each spends 1-2 s of CPU importing torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

pytestmark = pytest.mark.slow  # its module fixture runs three CLI processes (~15 s here): out of `make test-fast`

REPO_ROOT = Path(__file__).resolve().parents[2]
BLOCK_BYTES = 16 * 512  # kvtier-tiny: 16 tokens x 512 B/token
SLOTS = {"hbm": 4, "dram": 8, "ssd": 64}  # SSD below its 0.95 high watermark even holding all 40
NUM_BLOCKS = 40


def kvtier(*args: Any) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier", *map(str, args)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip


def tiny_config(directory: Path, **overrides: Any) -> Path:
    """Writes the tiny config (with top-level `overrides`) into a new `directory`; returns its path."""
    directory.mkdir()
    raw = {
        "model": "kvtier-tiny",
        "block_tokens": 16,
        "tiers": {
            "hbm": {"capacity": SLOTS["hbm"] * BLOCK_BYTES},
            "dram": {"capacity": f"{SLOTS['dram'] * BLOCK_BYTES // 1024}KiB", "policy": "s3fifo"},
            "ssd": {"capacity": f"{SLOTS['ssd'] * BLOCK_BYTES // 1024}KiB", "path": str(directory / "ssd"),
                    "num_files": 2},
        },
        "transfer": {"io_workers": 2},
        **overrides,
    }
    path = directory / "kvtier.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


BAD = {  # case -> (command, top-level overrides, what the error line must name)
    "unknown-model": ("run", {"model": "llama-9-400b"}, "llama-9-400b"),
    "bad-field": ("info", {"transfer": {"io_workers": 0}}, "transfer.io_workers"),
}


DESCRIBE_ONLY = {"describe-existing-ssd": True, "describe-missing-ssd": False}  # name -> SSD directory exists


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory per command below, each holding its config, SSD directory and results."""
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def results(workdir: Path) -> dict[str, subprocess.CompletedProcess]:
    """Every command of this file by name, started at once (each one is mostly torch importing)."""
    commands: dict[str, list[Any]] = {
        "info-json": ["info", "--config", tiny_config(workdir / "info-json"), "--json"],
        "info-table": ["info", "--config", tiny_config(workdir / "info-table")],
        "run": ["run", "--config", tiny_config(workdir / "run"), "--blocks", NUM_BLOCKS,
                "--json", workdir / "run" / "out" / "r.json"],
    }
    for name, make_ssd in DESCRIBE_ONLY.items():  # persistent SSD slabs: what a build would leave behind
        directory = workdir / name
        config = tiny_config(directory, tiers={"dram": {"capacity": "1GiB"}, "ssd": {
            "capacity": "1GiB", "path": str(directory / "ssd"), "persist": True}})
        if make_ssd:
            (directory / "ssd").mkdir()
        commands[f"{name}-info"] = ["info", "--config", config, "--json"]
        commands[f"{name}-doctor"] = ["doctor", "--config", config, "--json"]
    for case, (command, overrides, _) in BAD.items():
        config = tiny_config(workdir / case, **overrides)
        more = ["--json"] if command == "info" else ["--blocks", 4, "--json", workdir / case / "r.json"]
        commands[case] = [command, "--config", config, *more]
    with ThreadPoolExecutor(len(commands)) as pool:
        done = {name: pool.submit(kvtier, *args) for name, args in commands.items()}
    return {name: future.result() for name, future in done.items()}


@pytest.fixture(scope="module")
def info(results: dict[str, subprocess.CompletedProcess]) -> dict[str, Any]:
    out = results["info-json"]
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def run_result(results: dict[str, subprocess.CompletedProcess], workdir: Path) -> dict[str, Any]:
    out, out_json = results["run"], workdir / "run" / "out" / "r.json"
    assert out.returncode == 0, out.stdout + out.stderr
    assert str(out_json) in out.stdout.replace("\n", "")
    return json.loads(out_json.read_text())


# ---- kvtier info ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_info_json_lists_every_tier_with_capacity_and_medium(info: dict[str, Any], workdir: Path) -> None:
    tiers = {t["tier"]: t for t in info["tiers"]}
    assert list(tiers) == ["hbm", "dram", "ssd"]
    assert {name: t["medium"] for name, t in tiers.items()} == {"hbm": "device", "dram": "host", "ssd": "disk"}
    for name, t in tiers.items():
        assert t["num_slots"] == SLOTS[name], name
        assert t["capacity_bytes"] == SLOTS[name] * BLOCK_BYTES, name
        assert t["slot_bytes"] == BLOCK_BYTES, name
    assert tiers["ssd"]["directory"] == str(workdir / "info-json" / "ssd")


def test_info_json_gives_block_geometry(info: dict[str, Any], workdir: Path) -> None:
    assert info["config"] == str(workdir / "info-json" / "kvtier.yaml")
    assert (info["model"], info["kv_dtype"], info["kv_bytes_per_token"]) == ("kvtier-tiny", "fp16", 512)
    assert (info["block_tokens"], info["num_layers"], info["block_bytes"]) == (16, 4, BLOCK_BYTES)
    assert info["mode"] == "exclusive"


def test_info_json_says_whether_o_direct_is_used_and_why(info: dict[str, Any], workdir: Path) -> None:
    ssd = info["tiers"][-1]
    assert isinstance(ssd["o_direct"], bool)
    assert isinstance(ssd["reason"], str) and ssd["reason"]
    assert not list((workdir / "info-json" / "ssd").glob("*")), "the SSD slab files outlived the command"


def test_info_json_describes_the_environment(info: dict[str, Any]) -> None:
    env, hbm = info["environment"], info["tiers"][0]
    assert env["torch"] == torch.__version__
    assert env["cuda"] is torch.cuda.is_available()
    assert hbm["stand_in"] is not env["cuda"]
    if not env["cuda"]:
        assert env["device"].startswith("cpu") and hbm["device"] == "cpu"
    from kvtier.pool.detect import rdma_devices

    assert env["rdma_devices"] == rdma_devices()  # the guest's test_pool_rdma_guest.py sees rxe0 here
    assert env["pool_transport"].startswith("rdma (" if env["rdma_devices"] else "tcp (no RDMA device")


@pytest.mark.parametrize("name", list(DESCRIBE_ONLY))
def test_info_and_doctor_create_nothing_on_disk(results: dict[str, subprocess.CompletedProcess], workdir: Path,
                                                name: str) -> None:
    # Building these tiers would create 1 GiB of persistent slab files (and the SSD directory).
    for command in ("info", "doctor"):
        out = results[f"{name}-{command}"]
        assert out.returncode in (0, 1) and out.stdout.strip().startswith(("{", "[")), out.stderr
    tree = sorted(str(p.relative_to(workdir / name)) for p in (workdir / name).rglob("*"))
    assert tree == (["kvtier.yaml", "ssd"] if DESCRIBE_ONLY[name] else ["kvtier.yaml"])
    ssd = {t["tier"]: t for t in json.loads(results[f"{name}-info"].stdout)["tiers"]}["ssd"]
    assert (ssd["num_slots"], ssd["persist"], ssd["exists"]) == ((1 << 30) // BLOCK_BYTES, True, DESCRIBE_ONLY[name])
    assert isinstance(ssd["o_direct"], bool) and ssd["reason"]
    # info and doctor agree: a folder kvtier creates at start-up is no failure
    o_direct = next(c for c in json.loads(results[f"{name}-doctor"].stdout) if c["name"].startswith("O_DIRECT on"))
    assert o_direct["name"] == f"O_DIRECT on {workdir / name / 'ssd'}" and o_direct["status"] != "fail", o_direct
    created = "the directory is created at start-up"
    assert (created in ssd["reason"], created in o_direct["detail"]) == (not DESCRIBE_ONLY[name],) * 2


def test_info_table(results: dict[str, subprocess.CompletedProcess]) -> None:
    out = results["info-table"]
    assert out.returncode == 0, out.stderr
    for word in ("kvtier-tiny", "hbm", "dram", "ssd", "device", "host", "disk", "o_direct="):
        assert word in out.stdout, word


# ---- kvtier run ----------------------------------------------------------------------------------


def test_run_returns_every_block_unchanged(run_result: dict[str, Any]) -> None:
    assert run_result["num_blocks"] == NUM_BLOCKS and run_result["block_bytes"] == BLOCK_BYTES
    assert run_result["mismatched_blocks"] == 0 and run_result["checksum_errors"] == 0
    assert run_result["dropped"] == {} and run_result["misses"] == 0
    loads = run_result["load_by_source_tier"]
    assert sum(v["blocks"] for v in loads.values()) == NUM_BLOCKS
    assert all(v["loaded"] == v["blocks"] for v in loads.values())


def test_run_never_fills_a_tier_past_its_slots(run_result: dict[str, Any]) -> None:
    usage = run_result["usage"]
    assert {tier: u["slots"] for tier, u in usage.items()} == SLOTS
    assert all(0 <= u["used"] <= u["slots"] for u in usage.values())
    assert sum(u["used"] for u in usage.values()) == NUM_BLOCKS  # exclusive: one copy per block


def test_run_spills_through_every_tier(run_result: dict[str, Any]) -> None:
    hits = {tier: n for tier, n in run_result["hits"].items() if n}
    assert len(hits) > 1, hits
    assert sum(hits.values()) == NUM_BLOCKS
    demotions = run_result["demotions"]
    assert any(route.startswith("hbm->") for route in demotions), demotions
    assert demotions.get("dram->ssd", 0) > 0, demotions
    assert run_result["usage"]["ssd"]["used"] >= NUM_BLOCKS - SLOTS["hbm"] - SLOTS["dram"]


# ---- bad configurations --------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_exits_2_with_one_line(results: dict[str, subprocess.CompletedProcess], workdir: Path,
                                          case: str) -> None:
    (command, _, named), out = BAD[case], results[case]
    result_json = workdir / case / "r.json"
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"kvtier {command}: error: ") and named in lines[0]
    assert not result_json.exists()


def test_info_says_an_ssd_folder_under_a_file_cannot_be_created(tmp_path: Path) -> None:
    from kvtier.cli.info import collect

    (tmp_path / "a-file").write_text("not a folder")
    config = tiny_config(tmp_path / "cfg")
    raw = yaml.safe_load(config.read_text())
    raw["tiers"]["ssd"]["path"] = str(tmp_path / "a-file" / "ssd")
    config.write_text(yaml.safe_dump(raw))
    ssd = next(t for t in collect(str(config))["tiers"] if t["tier"] == "ssd")
    assert ssd["o_direct"] is False and f"{tmp_path / 'a-file'} is not a directory" in ssd["reason"]
    assert "created at start-up" not in ssd["reason"]


def test_info_says_which_catalog_model_a_name_matched(tmp_path: Path) -> None:
    from kvtier.cli.info import collect

    exact = tiny_config(tmp_path / "exact")
    assert collect(str(exact))["model_note"] is None
    typed = tiny_config(tmp_path / "typed", model="meta-llama/Llama-3.1-8B-Instruct", block_tokens=1)
    raw = yaml.safe_load(typed.read_text())
    raw["tiers"] = {"dram": {"capacity": "1MiB"}}  # a few blocks of 128 KiB
    typed.write_text(yaml.safe_dump(raw))
    info = collect(str(typed))
    assert info["model"] == "Llama-3.1-8B"
    assert info["model_note"] == "model: meta-llama/Llama-3.1-8B-Instruct matched as Llama-3.1-8B"
