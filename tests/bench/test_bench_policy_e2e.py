"""bench/bench_policy_e2e.py runs every policy through a real `KVTier` and reports what it measured
(speed is not judged here: the machine is shared)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_policy_e2e.py"


def test_every_policy_stores_and_loads_through_kvtier_and_is_reported(tmp_path):
    out = tmp_path / "e2e.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--policies", "lru,chain-arc", "--capacity", "64",
                           "--requests", "20", "--repeat", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy"] for r in rows] == ["lru", "chain-arc"]
    assert all(r["blocks_per_s"] > 0 and r["cpu_s"] > 0 for r in rows)
    assert rows[0]["ratio_to_lru"] == 1.0
    assert "chain-arc" in done.stdout and "vs lru" in done.stdout


def test_an_unknown_policy_is_refused_by_name():
    done = subprocess.run([sys.executable, str(SCRIPT), "--policies", "lru,mru"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and "unknown policy 'mru'; choose from lru" in done.stderr
