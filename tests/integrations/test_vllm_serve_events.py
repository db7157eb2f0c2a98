"""kvtier's KV events on a real `vllm serve`: a ZMQ subscriber sees, beside vLLM's own GPU events,
kvtier's `BlockStored` as blocks land in its DRAM tier (medium `CPU`) and spill to its SSD tier
(`STORAGE`), and `BlockRemoved` as they leave DRAM and are evicted from SSD, under vLLM's own
block hashes (those of its GPU `BlockStored`), with the same tokens and parents.

The server is the one of tests/integrations/test_vllm_serve.py (a tiny random Llama built here,
kvtier as the connector) with `--kv-events-config` publishing over ZMQ to a SUB socket this test
binds on 127.0.0.1 (an endpoint without `*` makes vLLM's publisher connect to it), vLLM's prefix
cache on (its GPU events need it), and tiers of 4 blocks (DRAM) and 8 blocks (SSD) in exclusive
mode, so six 4-block prompts spill DRAM -> SSD and are evicted from SSD. Batches are decoded with
vLLM's own msgspec classes.

A second server has a `pool` tier on a real pool node (`kvtier pool serve` on 127.0.0.1): the
engine writes its blocks through to the pool and names them there with vLLM's hashes
(`vllm_pool_names`), so a subscriber of the node's events (the tenant's SUBSCRIBE) sees them
`BlockStored` (medium SHARED) under the hashes of vLLM's own GPU events, with their tokens.

Cost: ~2-4 minutes on 2 cores (two server starts, mostly vLLM's start-up).
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from pathlib import Path

import pytest

from kvtier.integrations.hf.tiny_model import build_tiny_llama
from kvtier.pool.client.api import PoolClient
from kvtier.pool.node.process import running_node

from test_vllm_serve import Server, _summed

pytest.importorskip("vllm")
zmq = pytest.importorskip("zmq")
pytestmark = pytest.mark.slow

BLOCK_TOKENS = 128  # vLLM's default block size on CPU
BLOCK_BYTES = 4 * 2 * 2 * 32 * BLOCK_TOKENS * 2  # layers x (K, V) x KV heads x head size x tokens x bf16
PROMPTS = [[random.Random(seed).randrange(3, 512) for _ in range(4 * BLOCK_TOKENS + 40)] for seed in range(6)]
EVENTS_DEADLINE_S = 120  # a safety net for events still on their way, not a measurement


class Subscriber:
    """A SUB socket bound on 127.0.0.1 (vLLM's publisher connects to it), decoding every batch
    with vLLM's `KVEventBatch` on a thread of its own until `close`."""

    def __init__(self, topic: str) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        self.batches: list[tuple[int, object]] = []  # (seq, KVEventBatch), in arrival order
        self.payloads: list[bytes] = []  # the same batches as published (what a router reads)
        self.changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):  # ms: how soon `close` is noticed
                continue
            _, seq, payload = self._sock.recv_multipart()
            with self.changed:
                self.batches.append((int.from_bytes(seq, "big"), self._decode(payload)))
                self.payloads.append(payload)
                self.changed.notify_all()

    def events(self) -> list:
        with self.changed:
            return [e for _, batch in self.batches for e in batch.events]

    def wait_for(self, done, timeout_s: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: done([e for _, b in self.batches for e in b.events]), timeout_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)
        self._ctx.term()


def _kvtier(events: list, kind: str, medium: str) -> list:
    return [e for e in events if type(e).__name__ == kind and e.medium == medium]


def _hashes(events: list) -> list:
    return [h for e in events for h in e.block_hashes]


def _spilled_and_evicted(events: list) -> bool:
    return bool(_kvtier(events, "BlockRemoved", "STORAGE")) and bool(_kvtier(events, "BlockRemoved", "CPU"))


def _events_server(model: Path, config: Path, subscriber: Subscriber, topic: str, work: Path) -> Server:
    """`vllm serve` with kvtier from `config` and KV events published to `subscriber` under `topic`."""
    transfer = {"kv_connector": "KVTierConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"kvtier_config": str(config), "metrics_port": 0}}
    events_config = {"enable_kv_cache_events": True, "publisher": "zmq",
                     "endpoint": f"tcp://127.0.0.1:{subscriber.port}", "topic": topic}
    argv = [str(Path(sys.executable).with_name("vllm")), "serve", str(model), "--enforce-eager",
            "--kv-transfer-config", json.dumps(transfer), "--kv-events-config", json.dumps(events_config),
            "--host", "127.0.0.1", "--port", "0", "--max-model-len", "1024", "--num-gpu-blocks-override", "64"]
    return Server(argv, work / "server.log", work, {"VLLM_CPU_KVCACHE_SPACE": "1"})


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    import yaml

    work = tmp_path_factory.mktemp("serve-events")
    model = build_tiny_llama(work / "model", hidden_size=128, num_heads=4, num_kv_heads=2, num_layers=4)
    config = work / "kvtier.yaml"
    config.write_text(yaml.safe_dump({"model": str(model), "mode": "exclusive", "tiers": {
        "dram": {"capacity": f"{4 * BLOCK_BYTES // 1024}KiB"},
        "ssd": {"capacity": f"{8 * BLOCK_BYTES // 1024}KiB", "path": str(work / "ssd")}}}))
    topic = "kv@pod-a@tiny"
    subscriber = Subscriber(topic)
    server = _events_server(model, config, subscriber, topic, work)
    try:
        server.wait_healthy()
        for prompt in PROMPTS:
            server.complete(prompt, str(model))
        # kvtier's events surface as the engine steps: a few short requests carry the last
        # demotions' and evictions' out (a demotion may land after the step that started it)
        spilled = False
        for i in range(20):
            server.complete([5 + i] * 8, str(model))
            spilled = subscriber.wait_for(_spilled_and_evicted, EVENTS_DEADLINE_S / 20)
            if spilled:
                break
        server.complete([7] * 8, str(model))  # one more step, for what the last one left in flight
        metrics = server.metrics()
    finally:
        server.stop()
        subscriber.close()
    return {"events": subscriber.events(), "batches": subscriber.batches, "payloads": subscriber.payloads,
            "metrics": metrics, "log": server.log(), "spilled": spilled}


def test_kvtier_publishes_stores_in_dram_then_ssd_under_vllms_own_hashes(served):
    events = served["events"]
    gpu = _hashes(_kvtier(events, "BlockStored", "GPU"))
    cpu, ssd = _kvtier(events, "BlockStored", "CPU"), _kvtier(events, "BlockStored", "STORAGE")
    assert served["spilled"], f"no eviction seen; kvtier's events: {[e for e in events if e.medium != 'GPU']}"
    assert cpu and ssd
    assert set(_hashes(cpu)) <= set(gpu) and set(_hashes(ssd)) <= set(gpu)
    # a block reaches SSD demoted out of DRAM, or stored there directly while DRAM's slots are busy
    demoted = set(_hashes(ssd)) & set(_hashes(cpu))
    assert demoted
    for e in cpu + ssd:
        assert (e.locality, e.ownership, e.block_size, e.group_idx) == ("LOCAL", "kvtier", BLOCK_TOKENS, 0)
    order = {}
    for i, e in enumerate(events):
        for h in getattr(e, "block_hashes", ()):
            order.setdefault((e.medium, type(e).__name__, h), i)
    for h in _hashes(ssd):
        assert order["GPU", "BlockStored", h] < order["STORAGE", "BlockStored", h]
    for h in demoted:
        assert order["CPU", "BlockStored", h] < order["STORAGE", "BlockStored", h]


def test_kvtier_stored_events_carry_the_gpu_events_tokens_and_parents(served):
    events = served["events"]
    tokens, parents = {}, {}
    for e in _kvtier(events, "BlockStored", "GPU"):
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            tokens[h] = list(e.token_ids[i * e.block_size:(i + 1) * e.block_size])
            parents[h] = parent
            parent = h
    for e in _kvtier(events, "BlockStored", "CPU") + _kvtier(events, "BlockStored", "STORAGE"):
        assert e.parent_block_hash == parents[e.block_hashes[0]]
        assert e.token_ids == [t for h in e.block_hashes for t in tokens[h]]
        for parent, h in zip(e.block_hashes, e.block_hashes[1:]):  # a coalesced run chains
            assert parents[h] == parent


def test_kvtier_publishes_removals_as_blocks_leave_dram_and_are_evicted_from_ssd(served):
    events = served["events"]
    stored = {m: set(_hashes(_kvtier(events, "BlockStored", m))) for m in ("CPU", "STORAGE")}
    for medium in ("CPU", "STORAGE"):
        removed = _kvtier(events, "BlockRemoved", medium)
        assert removed and set(_hashes(removed)) <= stored[medium]
        assert all(e.locality == "LOCAL" and e.ownership == "kvtier" for e in removed)
    # per tier, a block alternates stored, removed (each removal follows its store)
    for medium in ("CPU", "STORAGE"):
        held: set = set()
        for e in events:
            if e.medium != medium:
                continue
            for h in e.block_hashes:
                if type(e).__name__ == "BlockStored":
                    assert h not in held
                    held.add(h)
                else:
                    assert h in held
                    held.remove(h)
        assert len(held) <= (4 if medium == "CPU" else 8)  # never more than the tier holds


def test_every_batch_arrives_in_sequence_and_the_counters_match_what_was_published(served):
    seqs = [seq for seq, _ in served["batches"]]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no batch lost between vLLM and the subscriber
    metrics, events = served["metrics"], served["events"]
    for tier, medium in (("dram", "CPU"), ("ssd", "STORAGE")):
        for op, kind in (("stored", "BlockStored"), ("removed", "BlockRemoved")):
            published = _summed(metrics, "kvtier_kv_events_published_total", tier=tier, op=op)
            # the scrape follows the last request; a step after it may publish more
            assert 0 < len(_hashes(_kvtier(events, kind, medium))) <= published
    assert _summed(metrics, "kvtier_kv_events_dropped_total") == 0
    assert any("kvtier: publishing its blocks as vLLM KV events" in line for line in served["log"].splitlines())


def test_a_router_reading_the_stream_still_finds_prefixes_when_the_gpu_cache_is_gone(served):
    """What the events are for: fed the published batches, a router's index (kvtier.integrations.router)
    matches prompts block by block; once vLLM's GPU cache is cleared, the prefixes kvtier still
    holds are found through kvtier's own events, at its tiers' weights."""
    from kvtier.integrations.router import DEFAULT_WEIGHTS, PrefixIndex

    index = PrefixIndex()
    for payload in served["payloads"]:
        index.apply("pod-a", payload)
    assert all(index.score("pod-a", p, BLOCK_TOKENS) > 0 for p in PROMPTS[-1:]), "the last prompt is on the GPU"
    index.apply_events("pod-a", [{"type": "AllBlocksCleared"}])
    found = {i: index.prefix_hashes("pod-a", p, BLOCK_TOKENS) for i, p in enumerate(PROMPTS)}
    assert any(found.values()), "kvtier holds some prompt's first blocks after the GPU let them go"
    held = {m: set(_hashes(_kvtier(served["events"], "BlockStored", m))) for m in ("CPU", "STORAGE")}
    for i, hashes in found.items():
        for h in hashes:
            media = index.media("pod-a", h)
            assert media and media <= {"CPU", "STORAGE"} and all(h in held[m] for m in media)
        assert index.score("pod-a", PROMPTS[i], BLOCK_TOKENS) == pytest.approx(
            sum(max(DEFAULT_WEIGHTS[m] for m in index.media("pod-a", h)) for h in hashes))


# ---- the pool tier: the node publishes the blocks the engine wrote, under vLLM's hashes -----------

def _node_stored(stream, num_hashes: int, timeout_s: float) -> list[dict]:
    """The node's BlockStored events (as msgpack maps) until `num_hashes` hashes came or time ran out."""
    stored: list[dict] = []
    deadline = time.monotonic() + timeout_s
    while sum(len(e["block_hashes"]) for e in stored) < num_hashes and time.monotonic() < deadline:
        frame = stream.next_frame(deadline - time.monotonic())
        if frame is not None:
            stored += [e for e in frame.batch()[1] if e["type"] == "BlockStored"]
    return stored


@pytest.fixture(scope="module")
def served_pool(tmp_path_factory) -> dict:
    import yaml

    work = tmp_path_factory.mktemp("serve-pool-events")
    model = build_tiny_llama(work / "model", hidden_size=128, num_heads=4, num_kv_heads=2, num_layers=4)
    prompts = PROMPTS[:2]
    with running_node(capacity="64MiB") as node, PoolClient([node.address], timeout_s=30) as client, \
            client.subscribe() as stream:
        config = work / "kvtier.yaml"
        config.write_text(yaml.safe_dump({"model": str(model), "tiers": {
            "dram": {"capacity": f"{4 * BLOCK_BYTES // 1024}KiB"},
            "pool": {"capacity": f"{32 * BLOCK_BYTES // 1024}KiB", "nodes": [node.address]}}}))
        topic = "kv@pod-b@tiny"
        subscriber = Subscriber(topic)
        server = _events_server(model, config, subscriber, topic, work)
        try:
            server.wait_healthy()
            for prompt in prompts:
                server.complete(prompt, str(model))
            # the pool's names go out as the puts land, on the worker's own thread: no step needed
            node_stored = _node_stored(stream, 4 * len(prompts), EVENTS_DEADLINE_S)
            hashes = {h for e in node_stored for h in e["block_hashes"]}
            subscriber.wait_for(lambda events: hashes <= set(_hashes(_kvtier(events, "BlockStored", "GPU"))),
                                EVENTS_DEADLINE_S)
            metrics = server.metrics()
            node_stats = client.stats()[0]
        finally:
            server.stop()
            subscriber.close()
    return {"events": subscriber.events(), "node_stored": node_stored, "metrics": metrics,
            "node_stats": node_stats, "log": server.log()}


def test_the_pool_node_publishes_the_engines_blocks_under_vllms_gpu_hashes(served_pool):
    events, node_stored = served_pool["events"], served_pool["node_stored"]
    gpu = _kvtier(events, "BlockStored", "GPU")
    tokens = {}
    for e in gpu:
        for i, h in enumerate(e.block_hashes):
            tokens[h] = list(e.token_ids[i * e.block_size:(i + 1) * e.block_size])
    named = [h for e in node_stored for h in e["block_hashes"]]
    assert len(named) == len(set(named)) >= 8, f"the node published {named}; engine log:\n{served_pool['log'][-3000:]}"
    assert set(named) <= set(tokens), "every block the node names is one of vLLM's GPU blocks"
    for e in node_stored:
        assert (e["medium"], e["locality"], e["ownership"], e["block_size"]) == \
            ("SHARED", "REMOTE", "kvtier-pool", BLOCK_TOKENS)
        assert e["token_ids"] == [t for h in e["block_hashes"] for t in tokens[h]]
    # the scrape and the node's stats follow the events read: more may have been named since
    assert _summed(served_pool["metrics"], "kvtier_pool_named_blocks_total", outcome="announced") >= len(named)
    assert served_pool["node_stats"]["blocks_announced"] >= len(named)
    assert _summed(served_pool["metrics"], "kvtier_pool_named_blocks_total", outcome="failed") == 0
