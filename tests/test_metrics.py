"""A live Prometheus endpoint on a real runtime: the numbers move with the work done (cost: ~2 s)."""

from __future__ import annotations

import math
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from support.runtime import BLOCK, WAIT_S, load, runtime, store


from support.metrics import scrape




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


def test_pool_node_metrics_follow_the_work():
    import json
    import subprocess
    import sys

    from kvtier.pool.client.api import PoolClient

    cmd = [sys.executable, "-m", "kvtier", "pool", "serve", "--listen", "127.0.0.1:0", "--capacity", "8MiB",
           "--region-size", "1MiB", "--metrics-port", "0"]
    node = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        events = {}
        while "ready" not in events:
            line = node.stdout.readline()
            assert line, "the node exited before it was ready"
            event = json.loads(line)
            events[event["event"]] = event
        url, address = events["metrics"]["url"], events["ready"]["listen"]
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        before = scrape(port)
        assert before[("kvtier_pool_capacity_bytes", ())] == 8 << 20
        assert before[("kvtier_pool_num_blocks", ())] == 0
        assert ("kvtier_pool_node_info", (("hugepages", "False"), ("memory", events["ready"]["memory"]),
                                          ("transport", "tcp"), ("transport_reason", events["ready"]["transport_reason"]))) in before
        with PoolClient([address], timeout_s=WAIT_S) as client:
            assert client.put(b"k" * 16, bytes(range(256)) * 64)
            assert client.put(b"k" * 16, bytes(256 * 64))  # held already: its bytes crossed for nothing
            buf = bytearray(256 * 64)
            assert client.get(b"k" * 16, buf) and client.get(b"x" * 16, buf) is False
        after = scrape(port)
        assert after[("kvtier_pool_num_blocks", ())] == 1 and after[("kvtier_pool_used_bytes", ())] >= 256 * 64
        assert after[("kvtier_pool_hits_total", ())] == before.get(("kvtier_pool_hits_total", ()), 0) + 1
        assert after[("kvtier_pool_misses_total", ())] >= 1
        assert after[("kvtier_pool_duplicate_put_bytes_total", ())] == 256 * 64
    finally:
        node.terminate()
        node.wait(WAIT_S)


def test_the_load_or_recompute_estimates_are_exported(tmp_path):
    from kvtier.tiers.base import TierKind

    with runtime(tmp_path) as kv:
        port = kv.serve_metrics(0)
        assert math.isnan(scrape(port)[("kvtier_recompute_estimate_seconds_per_token", ())])  # not measured
        kv.cost.note_load(TierKind.SSD, 1, 0.5)
        kv.cost.note_load(TierKind.SSD, 3, 1.5)
        kv.note_compute(4096, 4096e-6)
        assert kv.cost.worth_loading([TierKind.SSD]) == 0
        after = scrape(port)
        assert after[("kvtier_recompute_estimate_seconds_per_token", ())] == 1e-6
        assert abs(after[("kvtier_load_estimate_seconds", (("part", "per_block"), ("tier", "ssd")))] - 0.5) < 1e-9
        assert after[("kvtier_load_skipped_blocks_total", (("tier", "ssd"),))] == 1
