"""`kvtier bench`: the real command in subprocesses — a real pool node, real files, real sockets.

Asserts structure and sanity, never speed: every tier path has spill and fill rows with positive
GB/s and ratios, p50 <= p99 <= p999, small samples flagged; the PNG plots exist and decode; nothing
is left behind in the SSD directory. A bad SSD directory (missing, refusing files, read-only, full)
exits 2 with a message before anything is written: read-only and full are real tmpfs mounts in a
private mount namespace (`unshare -m`), skipped where the machine does not allow one.
Cost: about 25 s on a busy 2-core machine (one `--quick` run of ~17 s, five refusals in parallel
at ~3 s of torch import each).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvtier.bench.limits import check_ssd_dir
from kvtier.cli import main
from kvtier.errors import TierIOError

pytestmark = pytest.mark.slow  # seconds per test here: kept out of `make test-fast`

REPO_ROOT = Path(__file__).resolve().parents[2]
PATHS = ("hbm-dram", "dram-pool", "dram-ssd", "e2e-hbm-dram", "e2e-hbm-pool", "e2e-hbm-ssd", "e2e-pool-shared")
OPS = {p: ("spill", "fill") for p in PATHS} | {"e2e-pool-shared": ("fill-first", "fill")}  # another process spilled
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def bench_cmd(*args: object) -> list[str]:
    return [sys.executable, "-m", "kvtier", "bench", *map(str, args)]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180, check=False)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    ssd = out / "ssd"
    ssd.mkdir()
    done = run(bench_cmd("--quick", "--ssd-dir", ssd, "--json", out / "bench.json", "--plot", out / "plots"))
    assert done.returncode == 0, done.stderr
    yield done, json.loads((out / "bench.json").read_text()), out


def test_quick_run_has_sane_rows_for_every_path(quick_run):
    _, report, _ = quick_run
    rows = report["rows"]
    assert {(r["path"], r["op"]) for r in rows} == {(p, op) for p in PATHS for op in OPS[p]}
    for r in rows:
        where = f"{r['path']} {r['op']} {r['block_bytes']} qd {r['queue_depth']}"
        assert r["num_ops"] >= 4, where
        assert r["gbps"] > 0 and r["limit_gbps"] > 0 and r["ratio"] > 0, where
        assert 0 < r["p50_us"] <= r["p99_us"] <= r["p999_us"], where
        assert r["limit"], where
        assert r["small_sample"] is (r["num_ops"] < 30), where  # a --quick run has rows of a few ops
        assert r["too_few_ops_for"] == [f for f, n in (("p99_us", 100), ("p999_us", 1000)) if r["num_ops"] < n], where
    sizes = {r["block_bytes"] for r in rows}
    assert sizes == {64 << 10, 1 << 20}
    assert {r["queue_depth"] for r in rows} == {1, 4}


def test_quick_run_reports_where_it_ran(quick_run):
    done, report, _ = quick_run
    assert report["pool"]["started_here"] and report["pool"]["transport"] in ("tcp", "rdma")
    assert report["ssd"]["o_direct"] in (True, False) and report["ssd"]["reason"]
    assert report["hbm"]["stand_in"] is (not report["machine"]["cuda"])
    table = report["table_markdown"].splitlines()
    assert len(table) == 2 + len(report["rows"]) and table[0].startswith("| path | op |")
    assert table[0] in done.stdout  # the same table is printed
    for line, r in zip(table[2:], report["rows"]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert (cells[6] == "-") is (r["num_ops"] < 100) and cells[11].endswith("*") is r["small_sample"], line
    if any(r["small_sample"] for r in report["rows"]):
        assert "*: ratio from fewer than 30 paired ops" in done.stdout
    assert "transport" in done.stdout and "HBM" in done.stdout


def test_quick_run_writes_valid_pngs_and_cleans_up(quick_run):
    import matplotlib.image

    _, _, out = quick_run
    expected = {f"latency-cdf-{p}.png" for p in PATHS} | {"bandwidth.png"}
    assert {p.name for p in (out / "plots").iterdir()} == expected
    for name in expected:
        data = (out / "plots" / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE), name
        height, width, _ = matplotlib.image.imread(out / "plots" / name).shape
        assert height > 100 and width > 100, name
    assert list((out / "ssd").iterdir()) == []  # the scratch directory is gone


def test_refuses_bad_input_before_writing(tmp_path):
    cases = {  # case -> (arguments, what stderr must name)
        "missing": (["--ssd-dir", tmp_path / "nope"], "no such directory"),
        "not-writable": (["--ssd-dir", "/proc"], "cannot create a file"),
        "unreachable-pool": (["--tiers", "dram-pool", "--pool", "127.0.0.1:1"], "127.0.0.1:1"),
    }
    with ThreadPoolExecutor(len(cases)) as pool:
        done = dict(zip(cases, pool.map(lambda c: run(bench_cmd("--quick", *c[0])), cases.values())))
    for case, (_, message) in cases.items():
        assert done[case].returncode == 2, (case, done[case].stderr)
        assert "kvtier bench: error:" in done[case].stderr and message in done[case].stderr, case


def _can_mount_privately() -> bool:
    if shutil.which("unshare") is None or not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False
    probe = "d=$(mktemp -d) && mount -t tmpfs -o size=64k kvtier-probe \"$d\""
    return subprocess.run(["unshare", "-m", "sh", "-c", probe], capture_output=True, check=False).returncode == 0


@pytest.mark.skipif(not _can_mount_privately(), reason="needs root, unshare -m and a tmpfs mount (probed once)")
@pytest.mark.parametrize("options, message", [("ro,size=1m", "read-only"), ("size=1m", "MiB free")])
def test_refuses_read_only_or_full_filesystem(tmp_path, options, message):
    cmd = " ".join(map(shlex.quote, bench_cmd("--quick", "--tiers", "dram-ssd", "--ssd-dir", tmp_path)))
    script = f"mount -t tmpfs -o {options} kvtier-bench-test {shlex.quote(str(tmp_path))} && exec {cmd}"
    done = run(["unshare", "-m", "sh", "-c", script])
    assert "mount:" not in done.stderr, done.stderr
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "--ssd-dir" in done.stderr


def test_check_ssd_dir_refuses_more_than_the_free_space(tmp_path):
    stat = os.statvfs(tmp_path)
    check_ssd_dir(tmp_path, 1 << 20)  # room for a MiB: accepted
    with pytest.raises(TierIOError, match="MiB free"):
        check_ssd_dir(tmp_path, stat.f_bavail * stat.f_frsize + (1 << 40))
    assert list(tmp_path.iterdir()) == []  # the writability probe leaves nothing


@pytest.mark.parametrize("args, message", [
    (["--sizes", "1000"], "multiples of 4 KiB"),
    (["--tiers", "hbm-nvme"], "hbm-nvme"),
    (["--depths", "0"], "--depths"),
])
def test_bad_options_exit_2(capsys, args, message):
    assert main(["bench", *args]) == 2
    assert message in capsys.readouterr().err


def test_cpu_spent_counts_this_process_and_the_other_named():
    """`cpu_spent` (what the CPU benches report): CPU this process burns inside the block is its
    user and system time, a live child's burned meanwhile is `other`; with no other process
    named, `other` is None."""
    from kvtier.bench.measure import cpu_spent

    def spin(seconds: float) -> None:
        import time
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass

    burn = ("import sys, time\nsys.stdin.readline()\nend = time.process_time() + 0.3\n"
            "while time.process_time() < end: pass\nprint('burned', flush=True)\nsys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        with cpu_spent(child.pid) as spent:
            child.stdin.write("go\n")
            child.stdin.flush()
            spin(0.2)
            assert child.stdout.readline() == "burned\n"  # still running: its /proc entry is read on exit
    finally:
        child.kill()
        child.wait(60)
    assert spent.user + spent.system >= 0.15 and spent.other is not None and spent.other >= 0.25
    with cpu_spent() as alone:
        spin(0.05)
    assert alone.other is None and alone.user + alone.system >= 0.04
    row = spent.per(4, "call")  # the rows' fields: µs per call
    assert row == {"cpu_us_per_call": (spent.user + spent.system) * 1e6 / 4, "user_us_per_call": spent.user * 1e6 / 4,
                   "system_us_per_call": spent.system * 1e6 / 4, "node_cpu_us_per_call": spent.other * 1e6 / 4}
    assert alone.per(1, "block")["node_cpu_us_per_block"] is None
