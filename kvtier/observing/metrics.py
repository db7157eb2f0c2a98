"""Prometheus metrics for a running `KVTier`, read from its counters at scrape time.

A custom collector turns `KVTier.snapshot()` into metric families on each scrape, so the hot path
only bumps plain counters and nothing is exported twice. Each exporter has its own registry:
several runtimes in one process each serve their own endpoint, on 127.0.0.1 unless told
otherwise, from a server that holds a bounded number of connections (`kvtier.observing.metrics_server`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily

from kvtier.observing.metrics_server import MetricsServer
from kvtier.observing.stats import TRANSFER_BUCKETS_S  # no torch: the pool node imports this module too


class RuntimeCollector:
    """Exports one runtime's tiers, events and transfer latencies.

    Args:
        snapshot: returns `KVTier.snapshot()`-shaped data (usage, counters, latency histograms).
        describe: returns `KVTier.describe()` (tier media, slot sizes, transports).
    """

    def __init__(self, snapshot: Callable[[], dict[str, Any]], describe: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot
        self._describe = describe

    def collect(self) -> Iterator[Any]:
        snap, info = self._snapshot(), self._describe()
        yield from self._tiers(snap, info)
        yield from self._events(snap)
        yield from self._transfers(snap)
        if "cost" in snap:
            yield from self._cost(snap["cost"])

    def _tiers(self, snap: dict, info: dict) -> Iterator[Any]:
        cap = GaugeMetricFamily("kvtier_tier_capacity_bytes", "Bytes a tier can hold", labels=["tier"])
        used = GaugeMetricFamily("kvtier_tier_used_bytes", "Bytes of a tier's slots in use", labels=["tier"])
        blocks = GaugeMetricFamily("kvtier_tier_used_blocks", "Slots in use", labels=["tier"])
        media = InfoMetricFamily("kvtier_tier", "What backs each tier", labels=["tier"])
        up = GaugeMetricFamily("kvtier_tier_up", "1 while a tier is in the cascade, 0 while it is out of "
                                                 "service (failed as a whole, probed with backoff)", labels=["tier"])
        for t in info["tiers"]:
            name, usage = t["tier"], snap["usage"][t["tier"]]
            up.add_metric([name], 0 if name in snap.get("unavailable", {}) else 1)
            cap.add_metric([name], t["capacity_bytes"])
            used.add_metric([name], usage["used"] * t["slot_bytes"])
            blocks.add_metric([name], usage["used"])
            media.add_metric([name], {k: str(v) for k, v in t.items()
                                      if k in ("medium", "device", "o_direct", "pinned", "transport")})
        yield from (cap, used, blocks, media, up)

    def _events(self, snap: dict) -> Iterator[Any]:
        yield _by_label("kvtier_hits", "Blocks served, by tier", "tier", snap["hits"])
        yield _by_label("kvtier_stores", "Blocks written by stores, by tier", "tier", snap["stores"])
        yield _by_label("kvtier_evictions", "Copies evicted, by tier", "tier", snap["evictions"])
        yield _by_label("kvtier_dropped", "Blocks that left the cache, by reason", "reason", snap["dropped"])
        yield _by_label("kvtier_prefetch", "Prefetched blocks by outcome", "outcome", snap["prefetch"])
        yield _by_label("kvtier_hints", "Retention hints by outcome: applied, refused:<reason>, disabled; and "
                        "blocks over_budget (not retained: the tenant's budget was spent), session_blocks_over, "
                        "doomed_evicted; sessions closed and sessions_forgotten", "outcome", snap.get("hints", {}))
        yield _by_label("kvtier_tier_failures", "Times a tier was taken out of service", "tier", snap["tier_failures"])
        yield _by_label("kvtier_tier_recoveries", "Times a tier came back after a probe", "tier",
                        snap["tier_recoveries"])
        retained = GaugeMetricFamily("kvtier_retained_blocks", "Blocks under a retention hint's lease now")
        retained.add_metric([], snap.get("retained_blocks", 0))
        yield retained
        backlog = GaugeMetricFamily("kvtier_store_backlog_bytes", "Bytes of stores submitted and not yet landed "
                                    "(past transfer.max_store_backlog a store is dropped, never waited for)")
        backlog.add_metric([], snap.get("store_backlog_bytes", 0))
        yield backlog
        for name, help_text in (("misses", "Blocks asked for and not stored"),
                                ("checksum_errors", "Blocks whose bytes failed their checksum"),
                                ("io_errors", "Failed reads and writes"),
                                ("store_retries", "Blocks stored again further down after a failed write")):
            c = CounterMetricFamily(f"kvtier_{name}", help_text)
            c.add_metric([], snap[name])
            yield c

    def _transfers(self, snap: dict) -> Iterator[Any]:
        moved = CounterMetricFamily("kvtier_bytes_moved", "Bytes copied, by route", labels=["src", "dst"])
        for route, n in snap["bytes_moved"].items():
            moved.add_metric(route.split("->"), n)
        yield moved
        hist = HistogramMetricFamily("kvtier_transfer_seconds", "Per-block transfer latency, submit to landed",
                                     labels=["src", "dst"])
        for route, (counts, total_s) in snap["transfer_latency"].items():
            cumulative, buckets = 0, []
            for bound, n in zip((*map(str, TRANSFER_BUCKETS_S), "+Inf"), counts):
                cumulative += n
                buckets.append((bound, cumulative))
            hist.add_metric(route.split("->"), buckets, total_s)
        yield hist


    def _cost(self, cost: dict) -> Iterator[Any]:
        """The online estimates behind `KVTier.loadable` and what they turned away."""
        load = GaugeMetricFamily("kvtier_load_estimate_seconds", "Estimated load time from a tier: the fixed "
                                 "part of a load and the part per block", labels=["tier", "part"])
        for tier, v in cost["load_fixed_s"].items():
            load.add_metric([tier, "fixed"], v)
        for tier, v in cost["load_per_block_s"].items():
            load.add_metric([tier, "per_block"], v)
        yield load
        recompute = GaugeMetricFamily("kvtier_recompute_estimate_seconds_per_token",
                                      "The engine's estimated compute time per token (NaN until measured)")
        per_token = cost["recompute_per_token_s"]
        recompute.add_metric([], float("nan") if per_token is None else per_token)
        yield recompute
        yield _by_label("kvtier_load_skipped_blocks", "Held blocks reported as misses because loading them was "
                        "estimated slower than recomputing", "tier", cost["skipped_blocks"])


class NodeCollector:
    """Exports a pool node's `stats()`: capacity and use as gauges, event counts as counters,
    and the active transport (with the reason it was chosen) as an info metric."""

    GAUGES = frozenset({"capacity_bytes", "used_bytes", "region_bytes", "num_regions", "free_regions",
                        "num_blocks", "active_leases", "accesses_in_flight", "active_connections", "uptime_s",
                        "announced_bytes", "event_subscribers",  # shared-tier KV events
                        "retained_blocks"})  # under a soft lease (RETAIN) now

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        facts = self._stats()
        info = InfoMetricFamily("kvtier_pool_node", "The node's data plane and memory")
        info.add_metric([], {k: str(facts[k]) for k in ("transport", "transport_reason", "memory", "hugepages")
                             if k in facts})
        yield info
        for key, value in sorted(facts.items()):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if key in self.GAUGES:
                family = GaugeMetricFamily(f"kvtier_pool_{key}", f"Pool node {key.replace('_', ' ')}")
            else:
                family = CounterMetricFamily(f"kvtier_pool_{key}", f"Pool node {key.replace('_', ' ')}")
            family.add_metric([], value)
            yield family


def _by_label(name: str, help_text: str, label: str, values: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, help_text, labels=[label])
    for key, n in values.items():
        family.add_metric([key], n)
    return family


def serve_metrics(collector: Any, port: int, addr: str = "127.0.0.1") -> tuple[MetricsServer, int]:
    """Serves `collector` (a `RuntimeCollector`, `NodeCollector` or anything with their `collect()`)
    over HTTP on `addr:port` (0: any free port) from one daemon thread, holding a bounded number of
    connections, each with a deadline (`kvtier.observing.metrics_server`).

    Returns:
        (server, port actually bound); call `server.shutdown()` to stop.
    Raises:
        OSError: the address cannot be resolved or bound.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server = MetricsServer(registry, addr, port)
    return server, server.server_port
