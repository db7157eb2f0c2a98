"""`kvtier demo --quick`: the real command in a subprocess — a tiny Llama, a pool node on loopback,
an SSD directory — checked through its JSON results.

Cost: ~30 s on a busy 2-core machine (one quick demo run, shared by every test in this file).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # seconds per test here: kept out of `make test-fast`

TIERS = ("hbm", "dram", "pool", "ssd")


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, Path]:
    tmp = tmp_path_factory.mktemp("demo")
    out, plots = tmp / "demo.json", tmp / "plots"
    proc = subprocess.run([sys.executable, "-m", "kvtier", "demo", "--quick", "--json", out, "--plot", plots,
                           "--work-dir", tmp / "work"], check=False, capture_output=True, text=True, timeout=300)
    result = json.loads(out.read_text()) if out.exists() else {}
    return proc, result, plots


def test_the_quick_demo_exits_0_and_every_output_equals_recomputation(demo):
    proc, result, _ = demo
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["outputs_identical"] is True
    assert all(t["identical"] for t in result["workload"]["turns"])
    assert "TTFT" in proc.stdout and "Memory under load" in proc.stdout


def test_the_workload_hits_every_tier(demo):
    _, result, _ = demo
    hits = result["workload"]["hits"]
    assert all(hits.get(tier, 0) > 0 for tier in TIERS), hits
    figures = result["workload"]["tiers"]
    assert all(figures[tier]["bytes_loaded"] > 0 for tier in TIERS), figures
    later = [t for t in result["workload"]["turns"] if t["cached_tokens"]]
    assert later and all(t["cached_tokens"] < t["prompt_tokens"] for t in later)


def test_ttft_rows_place_each_prefix_in_its_tier_and_give_ratios(demo):
    _, result, plots = demo
    rows = result["ttft"]
    assert {(r["prefix_tokens"], r["tier"]) for r in rows} == {
        (n, t) for n in result["plan"]["ttft_prefix_tokens"] for t in ("dram", "pool", "ssd")}
    for r in rows:
        assert r["hits_from_tier"] == r["num_blocks"] == r["prefix_tokens"] // 64, r
        assert r["identical"] and r["recompute_ms"] > 0 and r["kvtier_ms"] > 0
        assert r["ratio"] == pytest.approx(r["kvtier_ms"] / r["recompute_ms"])
    assert (plots / "kvtier-demo-ttft.png").stat().st_size > 0


def test_memory_rows_cover_load_prefill_and_generation(demo):
    _, result, _ = demo
    phases = [m["phase"] for m in result["memory"]]
    assert phases[0] == "model loaded" and any("prefill" in p for p in phases) and any(
        "generation" in p for p in phases)
    for m in result["memory"]:
        assert m["rss_bytes"] > 0 and m["peak_rss_bytes"] >= m["rss_bytes"]
        assert set(m["tier_share"]) == set(TIERS) and all(0 <= s <= 1 for s in m["tier_share"].values())
        assert (m["allocated_bytes"] is None) == (result["device"] == "cpu")


def test_every_turn_line_names_a_distinct_round_user_and_turn(demo):
    proc, result, _ = demo
    labels = re.findall(r"^round (\d+) user (\d+) turn (\d+):", proc.stdout, re.MULTILINE)
    assert len(labels) == len(result["workload"]["turns"]) == len(set(labels))
    assert [(str(t["round"] + 1), str(t["user"]), str(t["turn"])) for t in result["workload"]["turns"]] == labels


def test_the_per_tier_tables_follow_their_rounds_once_and_no_progress_line_is_left(demo):
    proc, result, _ = demo
    num_rounds = result["plan"]["num_rounds"]
    assert proc.stdout.count("Per tier over the workload") == 1
    assert proc.stdout.count("Per tier after round") == num_rounds - 1
    assert proc.stdout.index("Per tier over the workload") < proc.stdout.index("Workload TTFT")
    assert not re.search(r"^hits .*\d+%", proc.stdout, re.MULTILINE)  # the progress bar's line
    assert "it/s]" not in proc.stderr  # transformers' own progress bars
    assert "A miss costs kvtier a lookup" in proc.stdout
