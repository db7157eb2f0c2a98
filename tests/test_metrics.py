"""A live Prometheus endpoint on a real runtime: the numbers move with the work done (cost: ~2 s)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from test_runtime import BLOCK, WAIT_S, load, runtime, store


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=WAIT_S) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_follow_the_work(tmp_path):
    with runtime(tmp_path, hbm=1, dram=2) as kv:
        port = kv.serve_metrics(0)
        before = scrape(port)
        assert before[("kvtier_tier_capacity_bytes", (("tier", "ssd"),))] == 6 * BLOCK
        assert before[("kvtier_tier_used_blocks", (("tier", "hbm"),))] == 0
        for k in (1, 2, 3, 4):  # one at a time: each store evicts the one before from HBM
            store(kv, [k])
        _, handle = load(kv, [1, 2, 3, 4, 99])
        assert set(handle.failed) == {99}
        kv.prefetch([1]).wait(WAIT_S)
        kv.quiesce(WAIT_S)
        after = scrape(port)
        usage = kv.usage()
        for tier in ("hbm", "dram", "ssd"):
            assert after[("kvtier_tier_used_blocks", (("tier", tier),))] == usage[tier]["used"]
            assert after[("kvtier_tier_used_bytes", (("tier", tier),))] == usage[tier]["used"] * BLOCK
        hits = sum(v for (name, _), v in after.items() if name == "kvtier_hits_total")
        assert hits == 4 and after[("kvtier_misses_total", ())] == 1
        assert after[("kvtier_bytes_moved_total", (("dst", "hbm"), ("src", "buffer:cpu")))] >= BLOCK
        loaded = sum(v for (name, labels), v in after.items()
                     if name == "kvtier_transfer_seconds_count" and ("dst", "buffer:cpu") in labels)
        assert loaded == 4, "one latency sample per block loaded"
        evictions = sum(v for (name, _), v in after.items() if name == "kvtier_evictions_total")
        assert evictions == sum(kv.stats.evictions.values()) > 0
        assert after[("kvtier_checksum_errors_total", ())] == 0
        assert ("kvtier_tier_info", (("device", "cpu"), ("medium", "device"), ("tier", "hbm"))) in after
