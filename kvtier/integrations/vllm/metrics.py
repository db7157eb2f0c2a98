"""kvtier's Prometheus metrics from inside vLLM: every worker rank's, served by the scheduler's process.

Under `vllm serve` the scheduler runs in the engine-core process and each worker rank in a process
of its own (one even without tensor parallelism), so no process sees all of kvtier. The scheduler
side, set up with `metrics_port`, serves one endpoint; at each scrape it asks every rank for its
report (`rank_report`) over the rank's lookup socket (`vllm_lookup.fetch_report`), so counters are
those of that moment, an idle engine included, and nothing is added to vLLM's steps. Each rank's
families (`kvtier.observing.metrics.RuntimeCollector`: per-tier hits, stores, evictions, usage, misses,
drops, bytes moved and transfer latency by route, store backlog; plus the connector's own counters)
are exported under a `rank` label; sum over it for the engine. A rank that does not answer is
`kvtier_vllm_rank_up{rank} 0` and leaves out its families.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvtier.errors import ConfigError
from kvtier.integrations.hints import HintReader, HintRefusal
from kvtier.integrations.vllm.events import EventCounts
from kvtier.integrations.vllm.inputs import RefusalReason
from kvtier.integrations.vllm.scheduler import PromptBlocks
from kvtier.integrations.vllm.settings import EXTRA, Settings
from kvtier.integrations.vllm.transfers import WorkerStats
from kvtier.observing.metrics import RuntimeCollector, serve_metrics

log = logging.getLogger(__name__)

# WorkerStats field -> (metric, help); counters unless named in _GAUGES
_CONNECTOR = {
    "num_loads": ("kvtier_vllm_loads", "Loads started by the connector (one per request and step)"),
    "num_blocks_loaded": ("kvtier_vllm_blocks_loaded", "Blocks loaded into vLLM's pages"),
    "num_blocks_failed": ("kvtier_vllm_blocks_failed", "Blocks that failed to load, reported to vLLM and recomputed"),
    "num_layer_waits": ("kvtier_vllm_layer_waits", "Times the forward waited for a layer of a load"),
    "layer_wait_s": ("kvtier_vllm_layer_wait_seconds", "Time the forward spent waiting for loaded layers"),
    "num_blocks_stored": ("kvtier_vllm_blocks_stored", "Blocks the connector stored"),
    "num_blocks_stored_in_place": ("kvtier_vllm_blocks_stored_in_place",
                                   "Blocks stored by gathering them straight into kvtier's DRAM slots (one copy)"),
    "num_blocks_not_stored": ("kvtier_vllm_blocks_not_stored", "Blocks the connector dropped instead of storing "
                                                               "(a failed store, or KV computed on a failed load)"),
    "forward_thread_s": ("kvtier_vllm_forward_thread_seconds", "Time the engine's forward thread spent in kvtier "
                                                               "(loads started and waited for, gathers, stores sent)"),
}


def rank_report(rank: int, backend: Any, stats: WorkerStats, num_stores_in_flight: int) -> dict[str, Any]:
    """One worker rank's report, JSON-ready: its backend's (`KVTier`) `snapshot()` and `describe()`,
    and the connector's counters."""
    return {"rank": rank, "snapshot": backend.snapshot(), "describe": backend.describe(),
            "connector": {**vars(stats), "num_stores_in_flight": num_stores_in_flight}}


class EngineCollector:
    """The scheduler's collector: every rank's report, merged under a `rank` label.

    Args:
        num_ranks: worker ranks of the engine (tensor_parallel_size).
        fetch: returns rank r's `rank_report`, or None when it cannot be had.
        prompt_blocks: the scheduler's counts of where prompt blocks came from.
        event_counts: the counters of kvtier's KV events (`vllm_events`), where they are on.
        hint_reader: the scheduler's reader of requests' retention hints, where they are on.
    """

    def __init__(self, num_ranks: int, fetch: Callable[[int], dict | None], prompt_blocks: PromptBlocks,
                 event_counts: EventCounts | None = None, hint_reader: HintReader | None = None) -> None:
        self._num_ranks, self._fetch, self._prompt_blocks = num_ranks, fetch, prompt_blocks
        self._event_counts = event_counts
        self._hint_reader = hint_reader

    def collect(self) -> Iterator[Metric]:
        reports = {rank: self._fetch(rank) for rank in range(self._num_ranks)}
        up = GaugeMetricFamily("kvtier_vllm_rank_up", "1 when the worker rank answered this scrape", labels=["rank"])
        for rank, report in reports.items():
            up.add_metric([str(rank)], 0 if report is None else 1)
        yield up
        yield self._prompt_block_family()
        skipped = CounterMetricFamily("kvtier_vllm_window_skipped_bytes", "Bytes of sliding-window groups' blocks "
                                      "that kvtier hits did not load: out of the window, never read again")
        skipped.add_metric([], self._prompt_blocks.window_skipped_bytes)
        yield skipped
        yield from self._unkeyable_families()
        if self._event_counts is not None:
            yield from event_families(self._event_counts)
        if self._hint_reader is not None:
            yield from hint_families(self._hint_reader)
        yield from merge_ranks((str(rank), _families(report)) for rank, report in reports.items() if report)

    def _prompt_block_family(self) -> CounterMetricFamily:
        family = CounterMetricFamily("kvtier_vllm_prompt_blocks", "Full prompt blocks of scheduled requests, by "
                                     "where their KV came from", labels=["source"])
        for source in ("engine", "kvtier", "computed"):
            family.add_metric([source], getattr(self._prompt_blocks, source))
        return family


    def _unkeyable_families(self) -> Iterator[Metric]:
        blocks = CounterMetricFamily("kvtier_vllm_unkeyable_prompt_blocks", "Full prompt blocks of requests kvtier "
                                     "could not key safely (served without kvtier, never stored)")
        blocks.add_metric([], self._prompt_blocks.unkeyable)
        yield blocks
        requests = CounterMetricFamily("kvtier_vllm_unkeyable_requests", "Requests kvtier could not key safely, by "
                                       "why: an adapter it cannot read or whose files changed under its id, a "
                                       "multimodal item without a content hash", labels=["reason"])
        for reason in RefusalReason:
            requests.add_metric([reason.value], self._prompt_blocks.unkeyable_requests.get(reason.value, 0))
        yield requests


def hint_families(reader: HintReader) -> Iterator[Metric]:
    """Requests' retention hints as the scheduler read them (what each rank did with them: `kvtier_hints`)."""
    read = CounterMetricFamily("kvtier_hints_read", "Requests whose retention hint was taken")
    read.add_metric([], reader.num_read)
    yield read
    refused = CounterMetricFamily("kvtier_hints_refused", "Requests whose retention hint was refused (the request "
                                  "was served without it), by reason", labels=["reason"])
    for reason in HintRefusal:
        refused.add_metric([reason.value], reader.refused.get(reason, 0))
    yield refused


def event_families(counts: EventCounts) -> Iterator[Metric]:
    """kvtier's KV events: blocks published and dropped (never waited for), by tier and op."""
    published = CounterMetricFamily("kvtier_kv_events_published", "Blocks kvtier published as vLLM KV events, "
                                    "by tier and op (stored, removed)", labels=["tier", "op"])
    for (tier, op), n in sorted(counts.published.items()):
        published.add_metric([tier, op], n)
    yield published
    dropped = CounterMetricFamily("kvtier_kv_events_dropped", "Blocks whose KV event kvtier dropped instead of "
                                  "waiting, by tier, op and where: worker (a rank's log was full between steps), "
                                  "queue (the scheduler's was), unmapped (no vLLM block hash known)",
                                  labels=["tier", "op", "where"])
    for (tier, op, where), n in sorted(counts.dropped.items()):
        dropped.add_metric([tier, op, where], n)
    yield dropped
    forgotten = CounterMetricFamily("kvtier_kv_events_join_forgotten", "(block, tier) pairs the join across "
                                    "worker ranks forgot for its bound")
    forgotten.add_metric([], counts.num_join_forgotten)
    yield forgotten


def _families(report: dict) -> Iterator[Metric]:
    snapshot, described = report["snapshot"], report["describe"]
    yield from RuntimeCollector(lambda: snapshot, lambda: described).collect()
    connector = report.get("connector", {})
    for field, (name, help_text) in _CONNECTOR.items():
        family = CounterMetricFamily(name, help_text)
        family.add_metric([], connector.get(field, 0))
        yield family
    backlog = GaugeMetricFamily("kvtier_vllm_stores_in_flight", "Stores the connector sent and kvtier has not "
                                "finished")
    backlog.add_metric([], connector.get("num_stores_in_flight", 0))
    yield backlog
    names = report.get("pool_names")
    if names is not None:  # the rank that names its pool blocks with vLLM's hashes (`vllm_pool_names`)
        family = CounterMetricFamily("kvtier_pool_named_blocks", "Blocks this rank put in the pool, by what became "
                                     "of their announcement with vLLM's hashes", labels=["outcome"])
        for outcome, n in sorted(names.items()):
            family.add_metric([outcome], n)
        yield family
    client = snapshot.get("pool_client")
    if client is not None:
        family = CounterMetricFamily("kvtier_pool_client", "The pool client's counters, by name", labels=["name"])
        for name, n in sorted(client.items()):
            family.add_metric([name], n)
        yield family


def merge_ranks(by_rank: Iterable[tuple[str, Iterable[Metric]]]) -> list[Metric]:
    """One family per name, holding every rank's samples with a `rank` label added."""
    merged: dict[str, Metric] = {}
    for rank, families in by_rank:
        for family in families:
            out = merged.get(family.name)
            if out is None:
                out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples += [s._replace(labels={"rank": rank, **s.labels}) for s in family.samples]
    return list(merged.values())


def start_metrics(settings: Settings, collector: EngineCollector) -> Any:
    """Serves `collector` on the settings' metrics address; returns the server (`shutdown()` stops it).

    Raises:
        ConfigError: the port cannot be bound (in use, or not ours to take), naming it.
    """
    try:
        server, port = serve_metrics(collector, settings.metrics_port or 0, settings.metrics_addr)
    except OSError as e:
        raise ConfigError(f"{EXTRA}.metrics_port: cannot serve kvtier metrics on {settings.metrics_addr}:"
                          f"{settings.metrics_port}: {e.strerror or e}") from None
    log.info("kvtier: metrics of %d worker rank(s) on http://%s:%d/metrics", settings.sharding.num_ranks,
             settings.metrics_addr, port)
    return server
