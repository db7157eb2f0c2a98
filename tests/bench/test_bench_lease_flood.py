"""bench/bench_lease_flood.py floods a real node from a child process and reports what it measured
(speed and memory are not judged here: the machine is shared; tests/attacks/test_attack_pool_leases.py
asserts the mechanism). Cost: about 5 s (a node start, a small flood, 1 s leases)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_lease_flood.py"


@pytest.mark.slow
def test_a_small_flood_is_measured_and_reported(tmp_path):
    out = tmp_path / "flood.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--connections", "2", "--frames", "3", "--max-lease-s", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    facts = json.loads(out.read_text())
    assert facts["flood"] == {"num_frames": 6, "num_leased": 6, "num_refused": 0}
    assert facts["peak_leases"] <= 6 * 4096 and facts["misses"] == 0  # some may have expired already
    assert [row["phase"] for row in facts["latency"]] == ["before", "flood", "expiry", "after"]
    assert set(facts["rss_mib"]) == {"before", "peak", "after", "after_close"}
    assert "alice's worst get during the flood" in done.stdout
