"""The vLLM connector (`kvtier.integrations.vllm.connector`), with vLLM's CPU build.

First the parts without an engine: settings checked against the engine at start-up (including a
real `VllmConfig` → connector construction), the scheduler half (keys, hits, load and store plans)
and the worker half (layer-wise loads, failures, stores) over a real `KVTier`. Then real engines on
a tiny random Llama, each in its own process (`tests/integrations/vllm_worker.py`), compared token for token
with an engine that runs without the connector.

Cost: 2-4 minutes on 2 cores (load-dependent), nearly all of it the nine engine processes (~10-20 s
each in single-process mode, ~25-50 s for the one that runs scheduler and worker in separate
processes) and one `kvtier pool serve` node.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from kvtier.errors import ConfigError, TierIOError
from kvtier.integrations.hf.tiny_model import build_tiny_llama
from kvtier.integrations.vllm.scheduler import (
    KeyDirectory,
    LoadSpec,
    ScheduledRequest,
    SchedulerSide,
    StoreSpec,
)
from kvtier.integrations.vllm.backends import SHARED, open_backend
from kvtier.integrations.vllm.settings import (
    EngineFacts,
    KVGroup,
    read_settings,
)
from kvtier.integrations.vllm.transfers import WorkerSide
from kvtier.config import config_from_dict
from kvtier.moving.native import gather_blocks
from kvtier.model.keys import block_keys
from kvtier.runtime import KVTier
from kvtier.tiers.base import SpanIO, TierKind, host_tensor
from kvtier.tiers.ssd import SSDTier
from kvtier.model.weights import WeightsSource, weights_fingerprint

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

from support.vllm import BASIC_PHASES, BLOCK, HEAD_DIM, KV_HEADS, NUM_LAYERS, P1, P2, Q, SINGLE_PROCESS, SPILL, _spec, _tokens, _yaml, assert_same_as_reference, run_engine


from support.vllm import FakeRequest, LAYER_NAMES, PAGE_BYTES












def _facts(**changes) -> EngineFacts:
    facts = EngineFacts(model_id="tiny", block_size=BLOCK, kv_dtype="float32", layer_names=LAYER_NAMES,
                        page_bytes=PAGE_BYTES, device_type="cpu", kv_role="kv_both")
    return replace(facts, **changes)


@pytest.fixture
def dram_yaml(tmp_path, tiny_model) -> Path:
    return _yaml(tmp_path / "kvtier.yaml", tiny_model, {"dram": {"capacity": "4MiB"}})


# ---- settings, checked at start-up ---------------------------------------------------------------


@pytest.mark.parametrize("device_type, layout, name", [
    ("cpu", None, "vllm-cpu:h(kv)nd"), ("cpu", "LBHNC", "vllm-cpu:h(kv)nd"),
    *[("cuda", layout, "vllm:hn(kv)d") for layout in ("LBHNC", "LHBNC", "BLHNC", "BHLNC")],
    *[("cuda", layout, "vllm:nh(kv)d") for layout in ("LBNHC", "BLNHC")],
])
def test_the_page_format_follows_the_layouts_interior_and_the_backends_reading(dram_yaml, device_type, layout, name):
    settings = read_settings({"kvtier_config": str(dram_yaml)}, _facts(device_type=device_type, kv_cache_layout=layout))
    assert settings.namespace.kv_dtype == f"float32;{name}"
    assert settings.page_format.head_major == (name != "vllm:nh(kv)d")


def test_settings_name_the_page_format_in_the_keys(dram_yaml):
    settings = read_settings({"kvtier_config": str(dram_yaml)}, _facts())
    assert settings.layout.layer_bytes == (PAGE_BYTES,) * NUM_LAYERS
    assert settings.namespace.kv_dtype == "float32;vllm-cpu:h(kv)nd"
    assert settings.namespace.block_tokens == BLOCK
    assert settings.layer_index[LAYER_NAMES[2]] == 2
    assert read_settings({"kvtier_config": str(dram_yaml), "model_id": "m@v1"}, _facts()).namespace.model == "m@v1"


def test_settings_name_a_local_attention_window_in_the_keys(dram_yaml):
    plain = read_settings({"kvtier_config": str(dram_yaml)}, _facts())
    windowed = [read_settings({"kvtier_config": str(dram_yaml)}, _facts(attention=f"window={w}")) for w in (64, 128)]
    assert plain.namespace.kv_dtype == "float32;vllm-cpu:h(kv)nd"  # plain models keep their keys
    assert windowed[0].namespace.kv_dtype == "float32;vllm-cpu:h(kv)nd;window=64"
    assert len({plain.namespace.digest, windowed[0].namespace.digest, windowed[1].namespace.digest}) == 3


def test_settings_name_the_weights_in_the_keys(dram_yaml, tiny_model):
    facts = _facts(weights=WeightsSource(str(tiny_model)))
    fingerprint = weights_fingerprint(WeightsSource(str(tiny_model)))
    assert fingerprint.startswith("files:")
    assert read_settings({"kvtier_config": str(dram_yaml)}, facts).namespace.weights == fingerprint
    given = read_settings({"kvtier_config": str(dram_yaml), "weights_id": "ckpt-7"}, facts)
    assert given.namespace.weights == "id:ckpt-7"  # the user's name wins; the files are not read
    loaded = [read_settings({"kvtier_config": str(dram_yaml)}, replace(facts, load_settings=f"quantization={q}"))
              for q in ("None", "fp8")]
    assert loaded[0].namespace.digest != loaded[1].namespace.digest, "the same files loaded another way"


@pytest.mark.parametrize("extra, facts, message", [
    ({"kvtier_config": None, "dram": "0B"}, {}, "kv_connector_extra_config.dram: 0B is not a positive size"),
    ({"kvtier_config": "/nonexistent/kvtier.yaml"}, {}, "/nonexistent/kvtier.yaml"),
    ({"shared_storage_path": "/tmp"}, {}, "shared_storage_path: unknown field"),
    ({"load_timeout_s": 0}, {}, "load_timeout_s"),
    ({"lookup_timeout_s": "1s"}, {}, "lookup_timeout_s: expected a positive number of seconds"),
    ({"model_id": ""}, {}, "model_id"),
    ({"weights_id": ""}, {}, "weights_id: expected a non-empty string"),
    ({}, {"layer_names": LAYER_NAMES[:3]}, "describes 4 KV layers"),
    ({}, {"page_bytes": PAGE_BYTES // 2}, "is not the served model's geometry"),
    ({}, {"kv_dtype": "int3"}, "the engine's KV cache dtype"),
    ({}, {"device_type": "tpu"}, "'tpu' is not supported yet"),
    ({}, {"kv_cache_layout": "LBNHC"}, "CPU attention backend takes the LBHNC KV cache layout"),
    ({}, {"device_type": "cuda", "kv_cache_layout": "HND"}, "KV cache layout 'HND' is unknown to kvtier"),
])
def test_bad_settings_are_clear_errors(dram_yaml, extra, facts, message):
    extra = {k: v for k, v in {"kvtier_config": str(dram_yaml), **extra}.items() if v is not None}
    with pytest.raises(ConfigError, match=re.escape(message)):
        read_settings(extra, _facts(**facts))


@pytest.mark.parametrize("engine, pages", [({"block_size": 64}, 2), ({"block_size": 16}, 0.5),
                                           ({"kv_dtype": "bfloat16"}, 0.5), ({"kv_dtype": "float16", "block_size": 64}, 1)])
def test_block_size_and_kv_dtype_follow_the_engine(dram_yaml, engine, pages, caplog):
    facts = _facts(page_bytes=int(PAGE_BYTES * pages), **engine)  # the YAML says 32 tokens, fp32
    with caplog.at_level("INFO", logger="kvtier"):
        settings = read_settings({"kvtier_config": str(dram_yaml)}, facts)
    assert settings.block_tokens == settings.namespace.block_tokens == settings.config.block_tokens == facts.block_size
    assert settings.layout.layer_bytes == (facts.page_bytes,) * NUM_LAYERS
    assert settings.namespace.kv_dtype.startswith(facts.kv_dtype + ";")
    assert settings.config.kv_dtype == {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[facts.kv_dtype]
    said = [r.getMessage() for r in caplog.records if r.name.startswith("kvtier")]
    if "block_size" in engine:
        assert any(f"blocks of {facts.block_size} tokens, the engine's block size" in m for m in said), said
    if "kv_dtype" in engine:
        assert any("the engine's KV cache dtype (kv_dtype: fp32" in m for m in said), said
    others = read_settings({"kvtier_config": str(dram_yaml)}, _facts())
    assert settings.namespace.digest != others.namespace.digest  # keys name the block size and format


def _connector(model: Path, role: str, extra: dict, *, block_size: int = BLOCK, policy: str = "recompute",
               engine_id: str | None = None):
    """A connector built the way vLLM builds it, from a real `VllmConfig`."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    from kvtier.integrations.vllm.connector import KVTierConnector

    transfer = KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both", kv_load_failure_policy=policy,
                                kv_connector_module_path="kvtier.integrations.vllm.connector",
                                kv_connector_extra_config=extra, engine_id=engine_id)
    config = EngineArgs(model=str(model), block_size=block_size, dtype="float32", enforce_eager=True,
                        max_model_len=512, kv_transfer_config=transfer).create_engine_config()
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    kv_cache = KVCacheConfig(num_blocks=16, kv_cache_tensors=[],
                             kv_cache_groups=[KVCacheGroupSpec(list(reversed(LAYER_NAMES)), spec)])
    return KVTierConnector(config, KVConnectorRole[role], kv_cache)


def test_connector_reads_the_engine_from_vllms_config(tiny_model, dram_yaml):
    connector = _connector(tiny_model, "SCHEDULER", {"kvtier_config": str(dram_yaml)})
    assert connector.settings.namespace.model == str(tiny_model)
    assert connector.settings.namespace.weights == (weights_fingerprint(WeightsSource(str(tiny_model)))
                                                 + ";dtype=torch.float32;quantization=None")
    assert list(connector.settings.layer_index) == list(LAYER_NAMES)  # model order, whatever vLLM's order


@pytest.mark.parametrize("extra, message", [
    ({"ssd": "/no/size"}, "kv_connector_extra_config.ssd: expected DIR:SIZE"),
    ({"kvtier_config": "<yaml>", "metrics_port": "9090"}, "metrics_port: expected a port number"),
])
def test_connector_refuses_bad_settings_at_start_up(tiny_model, dram_yaml, extra, message):
    extra = {k: str(dram_yaml) if v == "<yaml>" else v for k, v in extra.items()}
    for role in ("SCHEDULER", "WORKER"):
        with pytest.raises(ConfigError, match=message):
            _connector(tiny_model, role, extra)
    assert SHARED.backends() == []  # a worker that failed to start holds nothing


def test_connector_follows_the_engines_block_size_and_recomputes_failed_loads(tiny_model, dram_yaml):
    # The YAML says 32 tokens; vLLM's default failure policy would fail a request on a failed load.
    scheduler = _connector(tiny_model, "SCHEDULER", {"kvtier_config": str(dram_yaml)}, block_size=64, policy="fail")
    assert scheduler.settings.block_tokens == scheduler.settings.namespace.block_tokens == 64
    assert scheduler._kv_transfer_config.kv_load_failure_policy == "recompute"  # what vLLM's Scheduler reads next
    scheduler.shutdown()


def test_worker_connector_owns_the_backend_and_checks_the_pages(tiny_model, dram_yaml):
    worker = _connector(tiny_model, "WORKER", {"kvtier_config": str(dram_yaml)})
    try:
        assert SHARED.get(worker.settings.backend_id()) is not None
        with pytest.raises(ConfigError, match="is not vLLM's LBHNC layout"):
            worker.register_kv_caches({n: torch.zeros(16, BLOCK, KV_HEADS, 2 * HEAD_DIM) for n in LAYER_NAMES})
        worker.register_kv_caches({n: torch.zeros(16, KV_HEADS, BLOCK, 2 * HEAD_DIM) for n in LAYER_NAMES})
    finally:
        worker.shutdown()
    assert SHARED.backends() == []


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_scheduler_serves_every_ranks_metrics(tiny_model, dram_yaml):
    extra = {"kvtier_config": str(dram_yaml)}
    worker = _connector(tiny_model, "WORKER", extra, engine_id="metrics-test")
    scheduler = _connector(tiny_model, "SCHEDULER", {**extra, "metrics_port": 0}, engine_id="metrics-test")
    try:
        port = scheduler._metrics_server.server_port
        backend = worker._backend
        keys = block_keys(worker.settings.namespace, P1)
        _store(backend, keys)
        assert backend.load(keys[:3], torch.zeros(3, backend.layout.block_bytes, dtype=torch.uint8)).wait(10)
        request = FakeRequest("a", list(P1))
        scheduler.get_num_new_matched_tokens(request, 0)
        scheduler._scheduler.after_alloc(request, [1, 2, 3, 4, 5], 4 * BLOCK)
        got = _scrape(port)
        assert got[("kvtier_vllm_rank_up", (("rank", "0"),))] == 1
        assert got[("kvtier_hits_total", (("rank", "0"), ("tier", "dram")))] == 3
        assert got[("kvtier_stores_total", (("rank", "0"), ("tier", "dram")))] == len(keys)
        assert got[("kvtier_tier_capacity_bytes", (("rank", "0"), ("tier", "dram")))] == 4 << 20
        assert ("kvtier_store_backlog_bytes", (("rank", "0"),)) in got
        assert ("kvtier_vllm_layer_wait_seconds_total", (("rank", "0"),)) in got
        assert ("kvtier_vllm_forward_thread_seconds_total", (("rank", "0"),)) in got
        assert got[("kvtier_vllm_prompt_blocks_total", (("source", "kvtier"),))] == 4
        assert got[("kvtier_vllm_window_skipped_bytes_total", ())] == 0  # one full-attention group
        assert not any(dict(labels).get("source", "").startswith("window") for _, labels in got)
        worker.shutdown()  # the rank is gone: said, not guessed
        got = _scrape(port)
        assert got[("kvtier_vllm_rank_up", (("rank", "0"),))] == 0
        assert not any(name == "kvtier_hits_total" for name, _ in got)
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_metrics_of_several_ranks_are_labelled_by_rank(dram_yaml):
    from kvtier.integrations.vllm.metrics import EngineCollector, rank_report
    from kvtier.integrations.vllm.scheduler import PromptBlocks
    from kvtier.integrations.vllm.transfers import WorkerStats

    settings = read_settings({"kvtier_config": str(dram_yaml)}, _facts())
    with KVTier(settings.config, layout=settings.layout) as one, KVTier(settings.config, layout=settings.layout) as two:
        _store(two, block_keys(settings.namespace, P1)[:2])
        reports = {0: rank_report(0, one, WorkerStats(), 0), 1: rank_report(1, two, WorkerStats(num_loads=5), 1),
                   2: None}
        families = {f.name: f for f in EngineCollector(3, reports.get, PromptBlocks()).collect()}
    stores = {s.labels["rank"]: s.value for s in families["kvtier_stores"].samples if s.labels.get("tier") == "dram"}
    assert stores == {"1": 2}
    assert {s.labels["rank"]: s.value for s in families["kvtier_vllm_loads"].samples} == {"0": 0, "1": 5}
    assert {s.labels["rank"]: s.value for s in families["kvtier_vllm_rank_up"].samples} == {"0": 1, "1": 1, "2": 0}


def test_a_metrics_port_in_use_is_a_clear_error(tiny_model, dram_yaml):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"metrics_port: cannot serve kvtier metrics on 127.0.0.1:{port}"):
            _connector(tiny_model, "SCHEDULER", {"kvtier_config": str(dram_yaml), "metrics_port": port})


# ---- the scheduler half --------------------------------------------------------------------------




@pytest.fixture
def shared_backend(dram_yaml):
    settings = read_settings({"kvtier_config": str(dram_yaml)}, _facts())
    backend = SHARED.acquire(settings.backend_id(), lambda: KVTier(settings.config, layout=settings.layout))
    yield settings, backend
    SHARED.release(settings.backend_id())


def _store(backend, keys) -> None:
    blocks = torch.randint(0, 256, (len(keys), backend.layout.block_bytes), dtype=torch.uint8)
    assert backend.store(keys, blocks).wait(10)


def test_hits_are_whole_blocks_beyond_the_local_ones_and_leave_a_token(shared_backend):
    settings, backend = shared_backend
    side = SchedulerSide(settings, KeyDirectory(settings, 100))
    keys = block_keys(settings.namespace, P1)  # 4 full blocks of 150 tokens
    _store(backend, keys[:3])
    request = FakeRequest("a", list(P1))
    assert side.num_matched_tokens(request, 0) == 3 * BLOCK
    assert side.num_matched_tokens(request, BLOCK) == 2 * BLOCK  # vLLM's own cache had block 0
    assert side.num_matched_tokens(request, 3 * BLOCK) == 0
    _store(backend, keys[3:])
    exact = FakeRequest("b", list(P1[:4 * BLOCK]))  # every block stored: the last is still computed
    assert side.num_matched_tokens(exact, 0) == 3 * BLOCK


def _grouped(dram_yaml, *groups):
    """Settings and a shared backend for an engine with these KV cache groups (`KVGroup`s)."""
    settings = read_settings({"kvtier_config": str(dram_yaml)}, _facts(groups=tuple(groups)))
    backend = SHARED.acquire(settings.backend_id(), lambda: KVTier(settings.config, layout=settings.layout))
    return settings, backend


SLIDING = KVGroup(0, LAYER_NAMES, window_tokens=48)  # every layer slides over 48 tokens
HYBRID = (KVGroup(0, LAYER_NAMES[0::2]), KVGroup(1, LAYER_NAMES[1::2], window_tokens=48))


def test_a_sliding_group_hit_needs_only_the_blocks_its_window_reaches(dram_yaml):
    settings, backend = _grouped(dram_yaml, SLIDING)
    try:
        assert settings.layout.num_layers == NUM_LAYERS and settings.group_keys(0, ["k"]) == ("k",)
        keys = block_keys(settings.namespace, P1)  # 4 full blocks; a 4-block hit reads from token 81: blocks 2, 3
        _store(backend, keys[2:4])
        side = SchedulerSide(settings, KeyDirectory(settings, 100))
        request = FakeRequest("a", list(P1))
        assert side.num_matched_tokens(request, 0) == 4 * BLOCK, "blocks 0 and 1 are never read again"
        side.after_alloc(request, ([0, 0, 13, 14, 15],), 4 * BLOCK)  # vLLM's null block below the window
        assert side.plan_step([], lambda r: ()).loads == [LoadSpec("a", tuple(keys[2:4]), (13, 14), 0)]
        assert side.prompt_blocks.window_skipped == 2
        assert side.prompt_blocks.window_skipped_bytes == 2 * NUM_LAYERS * PAGE_BYTES
        gap = FakeRequest("b", list(P1))
        SHARED.release(settings.backend_id())
        settings, backend = _grouped(dram_yaml, SLIDING)
        _store(backend, keys[1:3])  # block 3 missing: a 3-block hit reads blocks 1 and 2
        assert SchedulerSide(settings, KeyDirectory(settings, 100)).num_matched_tokens(gap, 0) == 3 * BLOCK
    finally:
        SHARED.release(settings.backend_id())


def test_a_hybrid_hit_is_what_every_group_can_supply_under_keys_of_its_own(dram_yaml):
    settings, backend = _grouped(dram_yaml, *HYBRID)
    try:
        assert settings.layout.num_layers == NUM_LAYERS // 2  # a kvtier block holds one group's layers
        keys = block_keys(settings.namespace, P1)
        full, sliding = settings.group_keys(0, keys), settings.group_keys(1, keys)
        assert not set(full) & set(sliding) & set(keys), "each group's blocks under keys of their own"
        _store(backend, full[:4] + sliding[2:4])
        side = SchedulerSide(settings, KeyDirectory(settings, 100))
        assert side.num_matched_tokens(FakeRequest("a", list(P1)), 0) == 4 * BLOCK
        request = FakeRequest("b", list(P1[:3 * BLOCK + 10]))  # the full group holds 4, the window needs 1-2
        assert side.num_matched_tokens(request, 0) == 0, "3 blocks need sliding block 1, and then 2 and 1 fail too"
        side.after_alloc(FakeRequest("a", list(P1)), ([5, 6, 7, 8, 9], [0, 0, 13, 14, 15]), 4 * BLOCK)
        loads = side.plan_step([], lambda r: ()).loads
        assert loads == [LoadSpec("a", tuple(full[:4]), (5, 6, 7, 8), 0), LoadSpec("a", tuple(sliding[2:4]), (13, 14), 1)]
        # stores: per group, the blocks the step completes that the group still keeps
        c = FakeRequest("c", list(P1))
        side.track(c)
        tables = {"c": ([21, 22, 23, 24, 25], [0, 32, 33, 34, 35])}
        stores = side.plan_step([ScheduledRequest("c", len(P1))], tables.__getitem__).stores
        assert [(s.group, s.block_ids, s.keys) for s in stores] == [(0, (21, 22, 23, 24), tuple(full[:4])),
                                                                  (1, (32, 33, 34), tuple(sliding[1:4]))]
        assert set(stores[0].prefix_block_ids) == {21, 22, 23, 24, 32, 33, 34}, "a failed load in either group taints both"
    finally:
        SHARED.release(settings.backend_id())


def test_a_load_goes_into_the_blocks_after_the_local_hit(shared_backend):
    settings, backend = shared_backend
    side = SchedulerSide(settings, KeyDirectory(settings, 100))
    keys = block_keys(settings.namespace, P1)
    _store(backend, keys)
    request = FakeRequest("a", list(P1))
    n = side.num_matched_tokens(request, BLOCK)
    side.after_alloc(request, [10, 11, 12, 13, 14], n)
    plan = side.plan_step([], lambda r: [])
    assert plan.loads == [LoadSpec("a", tuple(keys[1:4]), (11, 12, 13))]
    assert side.plan_step([], lambda r: []).loads == []  # each load is planned once


def test_stores_cover_blocks_completed_in_the_step_once(shared_backend):
    settings, _ = shared_backend
    side = SchedulerSide(settings, KeyDirectory(settings, 100))
    a, b = FakeRequest("a", list(P1)), FakeRequest("b", list(P1[:2 * BLOCK]) + _tokens(7, 40))
    tables = {"a": [1, 2, 3, 4, 5], "b": [6, 7, 8]}
    for r in (a, b):
        side.num_matched_tokens(r, 0)
        side.after_alloc(r, tables[r.request_id], 0)
    plan = side.plan_step([ScheduledRequest("a", 100), ScheduledRequest("b", 104)], tables.get)
    keys = block_keys(settings.namespace, P1)
    assert plan.stores[0] == StoreSpec("a", tuple(keys[:3]), (1, 2, 3), (1, 2, 3))
    # b's first two blocks hold a's tokens: queued once, by a; b stores its third block only.
    assert [s.keys for s in plan.stores[1:]] == [tuple(block_keys(settings.namespace, b.all_token_ids)[2:3])]
    a.num_computed_tokens = 100
    b.num_computed_tokens = 104
    # a's next step: 50 tokens plus 3 speculative ones that may be rejected: block 3 only.
    plan = side.plan_step([ScheduledRequest("a", 53, num_spec_tokens=3), ScheduledRequest("b", 1)], tables.get)
    assert [(s.req_id, s.block_ids) for s in plan.stores] == [("a", (4,))]


def test_a_failed_load_rewinds_the_store_cursor(shared_backend):
    settings, backend = shared_backend
    side = SchedulerSide(settings, KeyDirectory(settings, 100))
    _store(backend, block_keys(settings.namespace, P1))
    request = FakeRequest("a", list(P1))
    side.after_alloc(request, [1, 2, 3, 4, 5], side.num_matched_tokens(request, 0))
    side.on_invalid_blocks({3}, lambda r: [1, 2, 3, 4, 5])
    request.num_computed_tokens = 2 * BLOCK  # vLLM rewinds to the first failed block
    plan = side.plan_step([ScheduledRequest("a", 150 - 2 * BLOCK)], lambda r: [1, 2, 3, 4, 5])
    assert [s.block_ids for s in plan.stores] == [(3, 4)]


def test_a_producer_only_stores_and_a_consumer_only_loads(shared_backend, dram_yaml):
    _, backend = shared_backend
    for role, loads, stores in (("kv_producer", False, True), ("kv_consumer", True, False)):
        settings = read_settings({"kvtier_config": str(dram_yaml)}, _facts(kv_role=role))
        side = SchedulerSide(settings, KeyDirectory(settings, 100))
        _store(backend, block_keys(settings.namespace, P1)[:1])
        request = FakeRequest(role, list(P1))
        n = side.num_matched_tokens(request, 0)
        side.after_alloc(request, [1, 2, 3, 4, 5], n)
        plan = side.plan_step([ScheduledRequest(role, 150 - n)], lambda r: [1, 2, 3, 4, 5])
        assert (n > 0, bool(plan.loads), bool(plan.stores)) == (loads, loads, stores)
        if stores:  # the block kvtier holds is not sent again
            assert plan.stores[0].block_ids == (2, 3, 4)


def test_without_a_backend_in_process_the_directory_follows_worker_reports(dram_yaml):
    settings = read_settings({"kvtier_config": str(dram_yaml)}, _facts())
    directory = KeyDirectory(settings, max_keys=3)
    keys = block_keys(settings.namespace, P1)
    assert directory.lookup(keys) == 0
    directory.report(keys, [])
    assert directory.lookup(keys) == 0  # only the 3 newest are remembered: keys[0] was dropped
    directory.report(keys[:2], [keys[2]])
    assert directory.lookup(keys) == 2


def test_blocks_being_stored_count_as_held_until_reported(shared_backend):
    settings, backend = shared_backend
    directory = KeyDirectory(settings, 100)
    keys = block_keys(settings.namespace, P1)
    _store(backend, keys[:1])
    directory.expect(keys[1:3])  # planned in a step, still on their way
    assert directory.lookup(keys) == 3
    directory.report([], keys[2:3])  # that store failed
    assert directory.lookup(keys) == 2
    directory.report(keys[1:2], [])  # reported: from now on the backend answers for it (it holds keys[0] only)
    assert directory.lookup(keys) == 1


def test_a_broken_backend_is_a_miss(dram_yaml):
    class Broken:
        def lookup(self, keys):
            raise ConnectionError("pool node down")

        loadable = lookup

        def close(self):
            pass

    settings = read_settings({"kvtier_config": str(dram_yaml)}, _facts())
    SHARED.acquire(settings.backend_id(), Broken)
    try:
        assert SchedulerSide(settings, KeyDirectory(settings, 10)).num_matched_tokens(FakeRequest("a", P1), 0) == 0
    finally:
        SHARED.release(settings.backend_id())


# ---- the worker half -----------------------------------------------------------------------------


class InstrumentedSSD(SSDTier):
    """A real SSD tier whose reads can be held at a layer or made to fail for one block."""

    def __init__(self, *args, layer_offset: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.layer_offset = layer_offset
        self.gate = threading.Event()
        self.gate.set()
        self.failing_prefix: bytes | None = None  # the first bytes of the block whose reads fail
        self._first: dict[int, bytes] = {}

    def write_spans(self, io):
        if io.offset == 0:
            for slot, address in zip(io.slots, io.addresses):
                self._first[slot] = bytes(host_tensor(int(address), 16).tolist())
        return super().write_spans(io)

    def read_spans(self, io):
        """The batch's reads, except that from `layer_offset` on they wait for the gate, and the
        block whose first bytes are `failing_prefix` fails (the others of the batch are read)."""
        if io.offset < self.layer_offset:
            return super().read_spans(io)
        self.gate.wait()
        bad = [i for i, slot in enumerate(io.slots) if self._first.get(slot) == self.failing_prefix]
        good = [i for i in range(len(io)) if i not in bad]
        failed = {i: TierIOError(f"SSD slot {io.slots[i]}: injected read failure") for i in bad}
        rest = SpanIO([io.slots[i] for i in good], io.offset, io.length, [io.addresses[i] for i in good],
                      [io.keys[i] for i in good])
        failed.update((good[j], e) for j, e in super().read_spans(rest).items())
        return failed


@pytest.fixture
def worker(tmp_path, tiny_model):
    """A WorkerSide over 12 engine blocks and a KVTier on an instrumented SSD tier."""
    path = _yaml(tmp_path / "ssd.yaml", tiny_model, {"ssd": {"capacity": "4MiB", "path": str(tmp_path / "ssd"),
                                                             "o_direct": False}},
                 transfer={"chunk_bytes": 0, "io_workers": 2})
    settings = read_settings({"kvtier_config": str(path)}, _facts())
    (tmp_path / "ssd").mkdir()
    ssd = InstrumentedSSD(tmp_path / "ssd", 4 << 20, settings.layout.block_bytes, num_files=2, direct=False,
                          layer_offset=settings.layout.offsets[1])
    kvtier = KVTier(settings.config, layout=settings.layout, tiers={TierKind.SSD: ssd})
    layers = [torch.randn(12, KV_HEADS, BLOCK, 2 * HEAD_DIM) for _ in range(NUM_LAYERS)]
    side = WorkerSide(kvtier, settings.layout, layers, timeout_s=10)
    yield side, ssd, settings
    ssd.gate.set()
    side.close(10)
    kvtier.close()


def _save(side: WorkerSide, specs: list[StoreSpec]) -> None:
    for layer in range(NUM_LAYERS):
        side.save_layer(layer, specs)
    assert side.end_step(specs) == set()
    side.close(10)


def test_wait_layer_waits_for_that_layer_only(worker):
    side, ssd, settings = worker
    keys = tuple(block_keys(settings.namespace, P1[:3 * BLOCK]))
    _save(side, [StoreSpec("a", keys, (0, 1, 2), (0, 1, 2))])
    assert side.take_reports() == (list(keys), [])
    for kv in side.layers:
        kv[6:9] = 0
    ssd.gate.clear()  # layers 1+ cannot arrive
    side.start_loads([LoadSpec("b", keys, (6, 7, 8))])
    side.wait_layer(0)
    assert torch.equal(side.layers[0][6:9], side.layers[0][0:3])
    assert not side.layers[1][6:9].any()
    ssd.gate.set()
    for layer in range(1, NUM_LAYERS):
        side.wait_layer(layer)
        assert torch.equal(side.layers[layer][6:9], side.layers[layer][0:3])
    assert side.end_step() == set()
    assert (side.stats.num_blocks_loaded, side.stats.num_layer_waits) == (3, NUM_LAYERS)


def test_host_rows_are_reused_once_their_stores_end_within_a_bound():
    """`HostRows`: a step's buffer comes back when the last store sent from it ends (or at once
    when none was sent), the smallest free buffer that fits is taken next (the same memory: no
    new pages to fault in), and free buffers past the bound are dropped, largest first."""
    from kvtier.integrations.vllm.transfers import HostRows

    pool = HostRows(4096, max_free_bytes=10 * 4096)
    rows, big = pool.take(8)
    assert rows.shape == (8, 4096) and rows.data_ptr() == big.data_ptr() and rows.data_ptr() % 4096 == 0
    pool.hold(big)
    pool.hold(big)
    pool.settle(big)  # two stores in flight from it: kept
    assert pool.free_bytes == 0
    pool.release(big)
    assert pool.free_bytes == 0
    pool.release(big)
    assert pool.free_bytes == 8 * 4096
    _, small = pool.take(2)  # 8 rows free, 2 wanted: taken whole, no new memory
    assert small is big and pool.free_bytes == 0
    pool.settle(small)  # no store was sent from it
    _, other = pool.take(9)  # larger than anything free: new memory
    assert other is not big
    pool.settle(other)  # 8 + 9 rows > the bound of 10: the largest goes
    assert pool.free_bytes == 8 * 4096


def test_a_steps_store_staging_is_the_memory_an_earlier_step_used(worker):
    """Stores gathered into staging (not reserved in kvtier's DRAM) reuse the rows of an earlier
    step whose stores have landed, and the stored bytes are the engine's."""
    side, ssd, settings = worker
    assert side.host_rows is not None  # a host engine, whole blocks
    keys = tuple(block_keys(settings.namespace, P1[:4 * BLOCK]))
    assert len(keys) == 4
    ptrs = []
    for step, (first, ids) in enumerate(((0, (0, 1)), (2, (2, 3)))):
        spec = StoreSpec(f"s{step}", keys[first:first + 2], ids, ids)
        for layer in range(NUM_LAYERS):
            side.save_layer(layer, [spec])
        ptrs.append(side._stores[0].staging.data_ptr())
        assert side.end_step([spec]) == set()
        side.close(10)  # waits for the stores, which gives the rows back
    assert ptrs[0] == ptrs[1] and side.host_rows.free_bytes >= 2 * side.layout.block_bytes
    assert side.take_reports() == (list(keys), [])
    side.start_loads([LoadSpec("b", keys, (6, 7, 8, 9))])
    assert side.end_step() == set()
    for kv in side.layers:
        assert torch.equal(kv[6:10], kv[0:4])


def test_the_forward_threads_time_in_kvtier_counts_gathers_sends_and_waits(worker):
    """`forward_thread_s`: every second the engine's forward thread spends in kvtier, stores and
    waits for loads alike; a wait for a layer held back 0.2 s is in it whole."""
    import threading

    side, ssd, settings = worker
    keys = tuple(block_keys(settings.namespace, P1[:3 * BLOCK]))
    for layer in range(NUM_LAYERS):
        side.save_layer(layer, [StoreSpec("a", keys, (0, 1, 2), (0, 1, 2))])
    assert side.stats.forward_thread_s > 0 and side.stats.layer_wait_s == 0
    before = side.stats.forward_thread_s
    assert side.end_step([StoreSpec("a", keys, (0, 1, 2), (0, 1, 2))]) == set()
    assert side.stats.forward_thread_s > before  # the stores sent
    side.close(10)
    ssd.gate.clear()
    side.start_loads([LoadSpec("b", keys, (6, 7, 8))])
    threading.Timer(0.2, ssd.gate.set).start()
    before = side.stats.forward_thread_s
    for layer in range(NUM_LAYERS):
        side.wait_layer(layer)
    assert side.end_step() == set() and side.stats.num_blocks_loaded == 3
    assert side.stats.layer_wait_s >= 0.2 and side.stats.forward_thread_s - before >= side.stats.layer_wait_s


def test_groups_load_layer_by_layer_each_into_its_own_pages_and_a_smaller_group_stores_zeros(tmp_path, tiny_model):
    """Two KV cache groups, of 3 layers and 1: each group's blocks go to and come from its own
    layers' pages; waiting for layer 0 of one group places nothing of the other; the one-layer
    group's blocks carry zeros where the larger group's second and third layers would be."""
    path = _yaml(tmp_path / "dram.yaml", tiny_model, {"dram": {"capacity": "4MiB"}})
    groups = (KVGroup(0, LAYER_NAMES[:3]), KVGroup(1, LAYER_NAMES[3:], window_tokens=64))
    settings = read_settings({"kvtier_config": str(path)}, _facts(groups=groups))
    assert settings.layout.num_layers == 3
    kvtier = KVTier(settings.config, layout=settings.layout)
    try:
        pages = [[torch.randn(12, KV_HEADS, BLOCK, 2 * HEAD_DIM) for _ in g.layer_names] for g in groups]
        side = WorkerSide(kvtier, settings.layout, pages, timeout_s=10)
        keys = block_keys(settings.namespace, P1[:2 * BLOCK])
        full, sliding = settings.group_keys(0, keys), settings.group_keys(1, keys)
        stores = [StoreSpec("a", full, (0, 1), (0, 1, 2, 3), 0), StoreSpec("a", sliding, (2, 3), (0, 1, 2, 3), 1)]
        assert side.end_step(stores) == set()
        side.close(10)
        held = torch.zeros(2, settings.layout.block_bytes, dtype=torch.uint8)
        assert kvtier.load(sliding, held).wait(10)
        assert held[:, settings.layout.offsets[1]:].eq(0).all(), "a one-layer group's block: the rest is zero"
        assert held[:, :settings.layout.offsets[1]].ne(0).any()
        for layers in pages:
            for kv in layers:
                kv[8:12] = 0
        side.start_loads([LoadSpec("b", full, (8, 9), 0), LoadSpec("b", sliding, (10, 11), 1)])
        side.wait_layer(0, group=1)
        assert torch.equal(pages[1][0][10:12], pages[1][0][2:4])
        assert not pages[0][0][8:10].any(), "group 0's layers wait for their own calls"
        for layer in range(3):
            side.wait_layer(layer, group=0)
            assert torch.equal(pages[0][layer][8:10], pages[0][layer][0:2])
        assert side.end_step() == set()
        assert side.stats.num_blocks_loaded == 4
    finally:
        kvtier.close()


def test_a_failed_block_is_reported_and_taints_stores_computed_on_it(worker):
    side, ssd, settings = worker
    keys = tuple(block_keys(settings.namespace, P1[:3 * BLOCK]))
    _save(side, [StoreSpec("a", keys, (0, 1, 2), (0, 1, 2))])
    side.take_reports()
    ssd.failing_prefix = bytes(side.layers[0][1].view(torch.uint8).flatten()[:16].tolist())  # block 1
    side.start_loads([LoadSpec("b", keys, (6, 7, 8))])
    tainted = StoreSpec("b", tuple(block_keys(settings.namespace, P1[:4 * BLOCK])[3:]), (9,), (6, 7, 8, 9))
    clean = StoreSpec("c", tuple(block_keys(settings.namespace, Q[:BLOCK])), (10,), (10,))
    for layer in range(NUM_LAYERS):
        side.wait_layer(layer)
        side.save_layer(layer, [tainted, clean])
    assert side.end_step([tainted, clean]) == {7}
    side.close(10)
    stored, missing = side.take_reports()
    assert (stored, missing) == (list(clean.keys), [keys[1], *tainted.keys])  # failed load, dropped store
    assert side.stats.num_blocks_failed == 1 and side.stats.num_blocks_not_stored == 1


@pytest.fixture
def dram_worker(tmp_path, tiny_model):
    """A WorkerSide over 12 engine blocks and a KVTier of DRAM (room for 6 blocks, no watermark
    demotions) over an SSD."""
    settings = read_settings({"kvtier_config": str(_yaml(tmp_path / "dram.yaml", tiny_model,
                                                         {"dram": {"capacity": "1MiB"}}))}, _facts())
    block = settings.layout.block_bytes
    config = config_from_dict({"model": settings.config.model, "transfer": {"skip_slow_loads": False}, "tiers": {
        "dram": {"capacity": 6 * block, "high_watermark": 1.0, "low_watermark": 1.0},
        "ssd": {"capacity": 64 * block, "path": str(tmp_path / "ssd"), "o_direct": False}}})
    kvtier = KVTier(config, layout=settings.layout)
    layers = [torch.randn(12, KV_HEADS, BLOCK, 2 * HEAD_DIM) for _ in range(NUM_LAYERS)]
    side = WorkerSide(kvtier, settings.layout, layers, timeout_s=10)
    yield side, kvtier, settings
    side.close(10)
    kvtier.close()


def _held(kvtier: KVTier, keys, layout) -> torch.Tensor:
    out = torch.zeros(len(keys), layout.block_bytes, dtype=torch.uint8)
    handle = kvtier.load(list(keys), out)
    assert handle.wait(10) and not handle.failed
    return out


def test_a_host_engines_stores_are_gathered_straight_into_dram_slots(dram_worker):
    """Blocks kvtier takes whole into DRAM are gathered into its slots (no staging rows, no copy
    of kvtier's own), READY once the step ends, byte for byte what staging would have held; a
    block computed on a failed load is given back, never found, its slot free again; once DRAM
    has no free slot for a step's blocks (its victims would go down to the SSD), that step
    stores through staging, as before."""
    side, kvtier, settings = dram_worker
    keys = tuple(block_keys(settings.namespace, P1[:3 * BLOCK]))
    other = tuple(block_keys(settings.namespace, Q[:BLOCK]))
    _save(side, [StoreSpec("a", keys, (0, 1, 2), (0, 1, 2)), StoreSpec("b", other, (3,), (3,))])
    assert side.take_reports() == ([*keys, *other], [])
    assert (side.stats.num_blocks_stored, side.stats.num_blocks_stored_in_place) == (4, 4)
    assert set(kvtier.where(keys + other)) == {TierKind.DRAM}
    staged = torch.zeros(4, settings.layout.block_bytes, dtype=torch.uint8)
    gather_blocks(side.layers, [0, 1, 2, 3], staged, settings.layout, None)
    assert torch.equal(_held(kvtier, keys + other, settings.layout), staged)

    missing = tuple(block_keys(settings.namespace, SPILL[0][:BLOCK]))  # never stored: its load fails
    tainted = StoreSpec("c", tuple(block_keys(settings.namespace, SPILL[0][:2 * BLOCK]))[1:], (5,), (4, 5))
    side.start_loads([LoadSpec("c", missing, (4,))])
    for layer in range(NUM_LAYERS):
        side.wait_layer(layer)
        side.save_layer(layer, [tainted])
    assert side.end_step([tainted]) == {4}
    assert kvtier.lookup(tainted.keys) == 0 and kvtier.where(tainted.keys) == [None]
    assert (side.stats.num_blocks_stored_in_place, side.stats.num_blocks_not_stored) == (4, 1)

    two = tuple(block_keys(settings.namespace, SPILL[1][:2 * BLOCK]))  # the 2 slots left: in place
    _save(side, [StoreSpec("d", two, (6, 7), (6, 7))])
    assert side.stats.num_blocks_stored_in_place == 6
    more = tuple(block_keys(settings.namespace, SPILL[2][:3 * BLOCK]))  # DRAM full, the SSD below
    _save(side, [StoreSpec("e", more, (8, 9, 10), (8, 9, 10))])
    assert (side.stats.num_blocks_stored_in_place, side.stats.num_blocks_stored) == (6, 9)
    assert kvtier.lookup(more) == 3
    staged = torch.zeros(3, settings.layout.block_bytes, dtype=torch.uint8)
    gather_blocks(side.layers, [8, 9, 10], staged, settings.layout, None)
    assert torch.equal(_held(kvtier, more, settings.layout), staged)


def test_a_backend_that_raises_fails_the_load_and_drops_the_store(worker):
    side, _, settings = worker

    class Down:
        layout = settings.layout

        def load(self, keys, into, **kw):
            raise ConnectionError("pool node down")

        store = load

    side.backend = Down()
    keys = tuple(block_keys(settings.namespace, P1[:2 * BLOCK]))
    side.start_loads([LoadSpec("a", keys, (3, 4))])
    spec = StoreSpec("b", keys, (5, 6), (5, 6))
    for layer in range(NUM_LAYERS):
        side.wait_layer(layer)
        side.save_layer(layer, [spec])
    assert side.end_step([spec]) == {3, 4}
    side.close(10)
    stored, missing = side.take_reports()
    assert (stored, set(missing)) == ([], set(keys))
    assert side.stats.num_blocks_not_stored == 2


# ---- the pool tier (cross-process hits) ----------------------------------------------------------


def test_the_pool_tier_shares_blocks_by_key_and_misses_when_the_node_dies(tmp_path, tiny_model, pool_node):
    path = _yaml(tmp_path / "pool.yaml", tiny_model,
                 {"dram": {"capacity": "1MiB"}, "pool": {"capacity": "8MiB", "nodes": [pool_node.address]}})
    settings = read_settings({"kvtier_config": str(path)}, _facts())
    writer, reader = open_backend(settings), open_backend(settings)  # two processes' worth of state
    try:
        assert isinstance(writer, KVTier)  # one path for every engine: the core runtime, its pool tier
        keys = block_keys(settings.namespace, P1)
        blocks = torch.randint(0, 256, (len(keys), settings.layout.block_bytes), dtype=torch.uint8)
        assert writer.store(keys, blocks).wait(10)
        writer.quiesce(10)
        assert writer.where(keys) == [TierKind.DRAM] * len(keys)  # served from DRAM, written through to the pool
        assert writer.lookup(keys) == reader.lookup(keys) == len(keys)  # the reader's DRAM is empty
        assert reader.snapshot()["shared"]["adopted"] == len(keys)
        into = torch.zeros_like(blocks)
        handle = reader.load(keys, into)
        handle.wait_layer(0, 10)
        assert handle.wait(10) and torch.equal(into, blocks)
        assert reader.snapshot()["pool_client"]["hits"] == len(keys)
        # Promoted on the way: the load read the promoted copy as its layers landed, and the
        # promotion commits once its last layer is in, maybe just after the load's handle ends.
        reader.quiesce(10)
        assert reader.where(keys) == [TierKind.DRAM] * len(keys)
        later = block_keys(settings.namespace, P2)[2:]  # P2's own blocks: adopted, then the node dies
        assert writer.store(later, blocks[: len(later)]).wait(10)
        assert reader.lookup(later) == len(later)
        pool_node.kill()
        handle = reader.load(later, into[: len(later)])  # adopted, but on a node now gone: misses
        assert not handle.wait(10) and set(handle.failed) == set(later)
        assert reader.lookup(later) == 0  # the pool is out of service until a probe finds it back
        handle = reader.load(keys, into)  # what it promoted still serves, and so does the writer's DRAM
        assert handle.wait(10) and torch.equal(into, blocks)
        assert writer.lookup(keys) == len(keys)
    finally:
        writer.close()
        reader.close()


# ---- real engines ------------------------------------------------------------------------------












def test_engine_hits_load_layer_by_layer_and_generate_the_same(tmp_path, tiny_model, reference):
    kvtier = _yaml(tmp_path / "kvtier.yaml", tiny_model, {"dram": {"capacity": "16MiB"}})
    phases = run_engine(tmp_path, "basic", _spec(tiny_model, kvtier, BASIC_PHASES))["phases"]
    cached = [[o["num_cached_tokens"] for o in ph["outputs"]] for ph in phases]
    # vLLM's own prefix cache is off: every cached token came from kvtier.
    assert cached == [[0], [2 * BLOCK], [4 * BLOCK, 4 * BLOCK], [0], [4 * BLOCK]]
    # The follow-up's 4th block holds tokens Q generated: blocks are stored during decode too.
    assert len(phases[4]["prompts"][0]) > 4 * BLOCK > len(Q)
    for phase in phases:
        assert_same_as_reference(phase, reference)
    stats = phases[-1]["stats"]
    assert stats["num_blocks_failed"] == 0
    assert stats["num_blocks_loaded"] == 2 + 4 + 4 + 4
    assert stats["num_layer_waits"] == 4 * NUM_LAYERS  # 4 steps loaded, each waited layer by layer


def test_engine_reports_its_compute_time_and_loads_measure_theirs(tmp_path, tiny_model, reference):
    """With the load-or-recompute veto on, the engine's forward passes feed the recompute
    estimate and its loads the DRAM tier's load estimate; whichever way the veto goes on this
    machine, every output is the reference's and every held block is loaded or counted skipped."""
    kvtier = _yaml(tmp_path / "kvtier.yaml", tiny_model, {"dram": {"capacity": "16MiB"}},
                   transfer={"skip_slow_loads": True})
    phases = run_engine(tmp_path, "cost", _spec(tiny_model, kvtier, BASIC_PHASES))["phases"]
    for phase in phases:
        assert_same_as_reference(phase, reference)
    cost = phases[-1]["cost"]
    # measured: the forward passes fed the estimate (a fitted slope: on a loaded machine it can come
    # out 0, so only that it exists is asserted, never its size)
    assert cost["recompute_per_token_s"] is not None and cost["recompute_per_token_s"] >= 0
    loaded, skipped = phases[-1]["stats"]["num_blocks_loaded"], sum(cost["skipped_blocks"].values())
    assert loaded > 0 or skipped > 0
    if loaded:
        assert "dram" in cost["load_per_block_s"]


def test_engine_spills_few_engine_blocks_to_kvtier_and_back(tmp_path, tiny_model, reference):
    # 9 engine blocks of 32 tokens hold one 150-token prompt and a half; kvtier's DRAM holds 4
    # blocks and demotes the rest to SSD.
    kvtier = _yaml(tmp_path / "kvtier.yaml", tiny_model,
                   {"dram": {"capacity": "256KiB"}, "ssd": {"capacity": "8MiB", "path": str(tmp_path / "ssd")}})
    spec = _spec(tiny_model, kvtier, [{"prompts": SPILL}, {"prompts": SPILL}],
                 enable_prefix_caching=True, num_gpu_blocks_override=9, max_model_len=256)
    first, second = run_engine(tmp_path, "spill", spec)["phases"]
    for phase in (first, second):
        assert_same_as_reference(phase, reference)
    assert second["stats"]["num_blocks_loaded"] - first["stats"]["num_blocks_loaded"] >= 3 * len(SPILL)
    assert second["stats"]["num_blocks_failed"] == 0
    assert second["usage"]["ssd"]["used"] > 0 and second["usage"]["dram"]["used"] <= 4


def test_engine_recomputes_blocks_that_fail_to_load(tmp_path, tiny_model, reference):
    kvtier = _yaml(tmp_path / "kvtier.yaml", tiny_model, {"ssd": {"capacity": "8MiB", "path": str(tmp_path / "ssd")}})
    phases = [{"prompts": [P1]}, {"prompts": [P1], "corrupt_ssd": True}, {"prompts": [P1]},
              {"prompts": [P1], "zero_loaded_kv": True}]
    stored, corrupted, again, lying = run_engine(tmp_path, "failure", _spec(tiny_model, kvtier, phases))["phases"]
    assert corrupted["corrupted_files"] > 0
    # Every block failed its checksum, was reported and recomputed: same tokens, nothing loaded.
    assert corrupted["stats"]["num_blocks_failed"] == 4
    assert corrupted["stats"]["num_blocks_loaded"] == stored["stats"]["num_blocks_loaded"] == 0
    # The recomputed blocks were stored again and hit.
    assert again["outputs"][0]["num_cached_tokens"] == 4 * BLOCK
    assert again["stats"]["num_blocks_loaded"] == 4
    for phase in (stored, corrupted, again):
        assert_same_as_reference(phase, reference)
    # Negative control: KV that arrives wrong and unreported changes the output, so the equality
    # above is a real check.
    assert lying["outputs"][0]["tokens"] != reference[json.dumps(P1)]["tokens"]


def test_a_fresh_engine_process_hits_what_another_computed_on_ssd_and_pool(tmp_path, tiny_model, reference,
                                                                          pool_node):
    # Engine A computes P1 and P2 into the pool and, written through, a persistent SSD tier (the
    # pool comes first in the cascade), and exits. B, a fresh process on the SSD alone, hits P1
    # there; C, on the pool alone, hits P2 there; then the node dies and C misses and recomputes.
    ssd = {"capacity": "8MiB", "path": str(tmp_path / "ssd"), "persist": True}
    pool = {"capacity": "8MiB", "nodes": [pool_node.address]}
    both = _yaml(tmp_path / "both.yaml", tiny_model, {"ssd": {**ssd, "write_through": True}, "pool": pool})
    ssd_only = _yaml(tmp_path / "ssd.yaml", tiny_model, {"ssd": ssd})
    pool_only = _yaml(tmp_path / "pool.yaml", tiny_model, {"pool": pool})
    (computed,) = run_engine(tmp_path, "a", _spec(tiny_model, both, [{"prompts": [P1, P2]}]))["phases"]
    assert [o["num_cached_tokens"] for o in computed["outputs"]] == [0, 2 * BLOCK]  # P2 shares P1's blocks
    (from_ssd,) = run_engine(tmp_path, "b", _spec(tiny_model, ssd_only, [{"prompts": [P1]}]))["phases"]
    assert from_ssd["outputs"][0]["num_cached_tokens"] == 4 * BLOCK
    assert from_ssd["stats"]["num_blocks_loaded"] == 4
    phases = [{"prompts": [P2]}, {"prompts": [P1], "kill_pid": pool_node.proc.pid}]
    from_pool, node_down = run_engine(tmp_path, "c", _spec(tiny_model, pool_only, phases))["phases"]
    assert from_pool["outputs"][0]["num_cached_tokens"] == 4 * BLOCK
    assert from_pool["stats"]["num_blocks_loaded"] == 4
    assert node_down["outputs"][0]["num_cached_tokens"] == 0
    for phase in (computed, from_ssd, from_pool, node_down):
        assert_same_as_reference(phase, reference)


def test_engine_with_scheduler_and_worker_in_separate_processes(tmp_path, tiny_model, reference):
    kvtier = _yaml(tmp_path / "kvtier.yaml", tiny_model, {"dram": {"capacity": "16MiB"}})
    spec = _spec(tiny_model, kvtier, [{"prompts": [P1]}, {"prompts": [P1, P2]}],
                 distributed_executor_backend="mp")
    spec["env"] = {**SINGLE_PROCESS, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    first, second = run_engine(tmp_path, "multiprocess", spec, timeout_s=300)["phases"]
    # The scheduler's process has no backend: it knows what the worker stored from its reports.
    assert [o["num_cached_tokens"] for o in second["outputs"]] == [4 * BLOCK, 2 * BLOCK]
    for phase in (first, second):
        assert_same_as_reference(phase, reference)


def test_engine_follows_its_block_size_and_recomputes_under_vllms_default_policy(tmp_path, tiny_model, reference):
    # The YAML says 64-token blocks; the engine's are 32. vLLM's default kv_load_failure_policy
    # ('fail', not passed here) would fail the request whose blocks fail their checksum.
    kvtier = _yaml(tmp_path / "kvtier.yaml", tiny_model, {"ssd": {"capacity": "8MiB", "path": str(tmp_path / "ssd")}},
                   block_tokens=64)
    spec = _spec(tiny_model, kvtier, [{"prompts": [P1]}, {"prompts": [P1]}, {"prompts": [P1], "corrupt_ssd": True}])
    spec["failure_policy"] = None
    stored, hit, corrupted = run_engine(tmp_path, "follows", spec)["phases"]
    assert hit["outputs"][0]["num_cached_tokens"] == 4 * BLOCK  # four 32-token blocks of P1's 150 tokens
    assert corrupted["stats"]["num_blocks_failed"] == 4
    for phase in (stored, hit, corrupted):
        assert_same_as_reference(phase, reference)  # finish_reason "length": recomputed, not failed
