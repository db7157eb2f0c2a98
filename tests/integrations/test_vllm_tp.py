"""The vLLM connector under tensor parallelism: each rank keeps its own slice of every block.

First without an engine, on real parts: per-rank settings and connectors built from real
`VllmConfig`s with tensor_parallel_size=2, real `KVTier` runtimes per rank (DRAM, or SSD files
on disk), the scheduler's lookup across ranks both in-process and over the ranks' real lookup
sockets, and the worker half agreeing on failed loads. Then real tensor-parallel engines (vLLM's
CPU build, TP=2 over gloo, each engine in its own process via `tests/integrations/vllm_worker.py`) on the tiny
random Llama (2 KV heads: one per rank), compared token for token with a TP=2 engine without
the connector.

Cost: ~3 minutes on 2 cores (load-dependent), nearly all of it four engine processes (~35-50 s
for each TP=2 one, ~15 s for the TP=1 one); the engine-free tests take a few seconds.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.integrations.hf.tiny_model import build_tiny_llama
from kvtier.integrations.vllm.lookup import LookupServer
from kvtier.integrations.vllm.scheduler import (
    KeyDirectory,
    LoadSpec,
    SchedulerSide,
    StoreSpec,
)
from kvtier.integrations.vllm.backends import SHARED, open_backend
from kvtier.integrations.vllm.settings import (
    EngineFacts,
    read_settings,
)
from kvtier.integrations.vllm.shards import Sharding
from kvtier.tiers.base import TierKind
from kvtier.integrations.vllm.transfers import WorkerSide
from kvtier.model.keys import block_keys

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

from support.vllm import (  # noqa: E402 (helpers only; after the skip, which needs vLLM)
    BLOCK,
    HEAD_DIM,
    LAYER_NAMES,
    NUM_LAYERS,
    P1,
    P2,
    PAGE_BYTES,
    FakeRequest,
    _tokens,
    _yaml,
    run_engine,
)

RANK_PAGE_BYTES = PAGE_BYTES // 2  # one of the model's 2 KV heads per rank
TP_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1",
          "VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # 2 workers on one NUMA node: vLLM's auto-binding refuses


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("vllm-tp-model"), hidden_size=128, num_heads=4,
                            num_kv_heads=2, num_layers=NUM_LAYERS)


def _facts(rank: int, num_shards: int = 2, tag: str = "engine") -> EngineFacts:
    page = PAGE_BYTES // num_shards
    return EngineFacts(model_id="tiny", block_size=BLOCK, kv_dtype="float32", layer_names=LAYER_NAMES,
                       page_bytes=page, device_type="cpu", kv_role="kv_both",
                       sharding=Sharding(rank, 2, num_shards), engine_tag=tag)


@pytest.fixture
def dram_yaml(tmp_path, tiny_model) -> Path:
    return _yaml(tmp_path / "kvtier.yaml", tiny_model, {"dram": {"capacity": "4MiB"}})


# ---- keys and settings per rank ----------------------------------------------------------------


def test_each_slice_has_its_own_keys_and_replicas_share_them(dram_yaml):
    keys = block_keys(read_settings({"kvtier_config": str(dram_yaml)}, _facts(0)).namespace, P1)
    rank0, rank1 = Sharding(0, 2, 2).keys(keys), Sharding(1, 2, 2).keys(keys)
    assert len({*keys, *rank0, *rank1}) == 3 * len(keys)  # TP=1, rank 0 and rank 1 never collide
    assert Sharding(0, 4, 2).keys(keys) == Sharding(1, 4, 2).keys(keys) == rank0  # 2 heads on 4 ranks: pairs
    assert Sharding(1, 2, 1).keys(keys) == tuple(keys)  # replicated KV (MLA, one KV head): one copy for all


def test_replicated_kv_goes_to_the_pool_once_and_every_rank_hits_it(tmp_path, tiny_model):
    from kvtier.pool.client.api import PoolClient
    from kvtier.pool.node.process import running_node

    assert [Sharding(r, 4, 2).writes_shared for r in range(4)] == [True, False, True, False]
    with running_node(capacity="32MiB") as node:
        path = _yaml(tmp_path / "pool.yaml", tiny_model,
                     {"dram": {"capacity": "1MiB"}, "pool": {"capacity": "8MiB", "nodes": [node.address]}})
        ranks = [read_settings({"kvtier_config": str(path)}, _facts(r, num_shards=1)) for r in (0, 1)]
        backends = [open_backend(s) for s in ranks]
        try:
            assert [b.tiers[TierKind.POOL].writes_shared for b in backends] == [True, False]
            keys = ranks[0].sharding.keys(block_keys(ranks[0].namespace, P1))
            assert ranks[1].sharding.keys(block_keys(ranks[1].namespace, P1)) == keys  # one slice: shared keys
            blocks = torch.randint(0, 256, (len(keys), ranks[0].layout.block_bytes), dtype=torch.uint8)
            for backend in reversed(backends):  # the non-writer first: its store must not touch the pool
                assert backend.store(keys, blocks).wait(10)
                with PoolClient([node.address]) as probe:
                    on_pool = sum(probe.contains([bytes(k) for k in keys]))
                    bytes_in = probe.stats()[0]["bytes_in"]
                assert on_pool == (len(keys) if backend is backends[0] else 0)
            assert backends[1].snapshot()["shared"]["left_to_peer"] == len(keys)
            assert bytes_in == len(keys) * ranks[0].layout.block_bytes, "each block crossed to the pool once"
            fresh = open_backend(ranks[1])  # rank 1 of a new engine: nothing local, hits the writer's copy
            try:
                into = torch.zeros_like(blocks)
                assert fresh.lookup(keys) == len(keys) and fresh.load(keys, into).wait(10)
                assert torch.equal(into, blocks)
            finally:
                fresh.close()
        finally:
            for backend in backends:
                backend.close()


def test_a_rank_holds_its_slice_and_its_share_of_every_tier(tmp_path, tiny_model):
    path = _yaml(tmp_path / "kvtier.yaml", tiny_model, {"dram": {"capacity": "4MiB"},
                                                       "ssd": {"capacity": "8MiB", "path": str(tmp_path / "ssd")}})
    settings = read_settings({"kvtier_config": str(path)}, _facts(1))
    assert settings.layout.layer_bytes == (RANK_PAGE_BYTES,) * NUM_LAYERS
    dram, ssd = settings.config.tiers
    assert (dram.capacity_bytes, ssd.capacity_bytes) == (2 << 20, 4 << 20)  # capacities are per engine
    assert ssd.path == tmp_path / "ssd" / "rank1-of-2"
    assert settings.backend_id() != read_settings({"kvtier_config": str(path)}, _facts(0)).backend_id()
    with pytest.raises(ConfigError, match=re.escape("(1/2 of it on each tensor-parallel rank)")):
        read_settings({"kvtier_config": str(path)}, replace(_facts(1), page_bytes=PAGE_BYTES))  # both heads


def _connector(model: Path, role: str, extra: dict, rank: int = 0, **parallel):
    """A connector built the way vLLM builds it, from a real TP `VllmConfig`, as rank `rank`."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    from kvtier.integrations.vllm.connector import KVTierConnector

    transfer = KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
                                kv_connector_module_path="kvtier.integrations.vllm.connector",
                                kv_connector_extra_config=extra)
    config = EngineArgs(model=str(model), block_size=BLOCK, dtype="float32", enforce_eager=True, max_model_len=512,
                        kv_transfer_config=transfer, distributed_executor_backend="mp",
                        **({"tensor_parallel_size": 2} | parallel)).create_engine_config()
    config.parallel_config.rank = rank
    heads = 2 // config.parallel_config.tensor_parallel_size
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=HEAD_DIM, dtype=torch.float32)
    kv_cache = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYER_NAMES, spec)])
    return KVTierConnector(config, KVConnectorRole[role], kv_cache)


def test_worker_connectors_of_two_ranks_own_separate_backends_and_sockets(tiny_model, dram_yaml):
    workers = [_connector(tiny_model, "WORKER", {"kvtier_config": str(dram_yaml)}, rank) for rank in (0, 1)]
    try:
        assert [w.settings.sharding for w in workers] == [Sharding(0, 2, 2), Sharding(1, 2, 2)]
        assert SHARED.get(workers[0].settings.backend_id()) is not SHARED.get(workers[1].settings.backend_id())
        for rank, w in enumerate(workers):
            assert w.settings.lookup_socket(rank).exists()
            w.register_kv_caches({n: torch.zeros(16, 1, BLOCK, 2 * HEAD_DIM) for n in LAYER_NAMES})  # 1 head each
    finally:
        for w in workers:
            w.shutdown()
    assert SHARED.backends() == []
    assert not workers[0].settings.lookup_socket(0).exists()


def test_pipeline_parallelism_is_refused_at_start_up_naming_the_field(tiny_model, dram_yaml):
    for role in ("SCHEDULER", "WORKER"):
        with pytest.raises(ConfigError, match="pipeline_parallel_size: .*set pipeline_parallel_size=1"):
            _connector(tiny_model, role, {"kvtier_config": str(dram_yaml)}, tensor_parallel_size=1,
                       pipeline_parallel_size=2)
    assert SHARED.backends() == []


# ---- the scheduler's lookup across ranks -------------------------------------------------------


@pytest.fixture
def ranks(tmp_path, tiny_model):
    """Two ranks' settings and real backends (DRAM and SSD files on disk), not registered anywhere."""
    path = _yaml(tmp_path / "kvtier.yaml", tiny_model, {"dram": {"capacity": "256KiB"},
                                                       "ssd": {"capacity": "8MiB", "path": str(tmp_path / "ssd"),
                                                               "o_direct": False}})
    tag = f"test-{os.getpid()}-{tmp_path.name}"
    settings = [read_settings({"kvtier_config": str(path)}, _facts(r, tag=tag)) for r in (0, 1)]
    backends = [open_backend(s) for s in settings]
    yield settings, backends
    for backend in backends:
        backend.close()


def _store(settings, backend, keys) -> None:
    shard_keys = settings.sharding.keys(keys)
    blocks = torch.randint(0, 256, (len(keys), settings.layout.block_bytes), dtype=torch.uint8)
    assert backend.store(shard_keys, blocks).wait(10)


def test_a_block_hits_only_when_every_rank_holds_its_slice(ranks):
    settings, backends = ranks
    for s, b in zip(settings, backends):
        SHARED.acquire(s.backend_id(), lambda b=b: b)
    try:
        directory = KeyDirectory(settings[0], 100)
        keys = block_keys(settings[0].namespace, P1)
        _store(settings[0], backends[0], keys)
        assert directory.lookup(keys) == 0  # rank 1 holds nothing: no partial KV
        _store(settings[1], backends[1], keys[:2])
        assert directory.lookup(keys) == 2
        assert backends[1].lookup(keys) == 0  # a rank keeps its slices under its own keys only
    finally:
        for s in settings:
            SHARED.release(s.backend_id())
    assert all(s.config.tiers[1].path.is_dir() for s in settings)  # each rank's SSD files in its own directory


def test_the_scheduler_asks_worker_ranks_over_their_sockets(ranks):
    settings, backends = ranks
    servers = [LookupServer(s.lookup_socket(s.sharding.rank), b, s.sharding) for s, b in zip(settings, backends)]
    directory = KeyDirectory(settings[0], 100)  # nothing in SHARED: as in a scheduler process
    try:
        keys = block_keys(settings[0].namespace, P1)
        for s, b in zip(settings, backends):
            _store(s, b, keys[:3])
        _store(settings[0], backends[0], keys[3:])
        assert directory.lookup(keys) == 3
        directory.expect(keys[3:])  # a store planned on every rank: held until each rank reports it
        assert directory.lookup(keys) == 4
        directory.report(keys[3:], [], rank=0)
        assert directory.lookup(keys) == 4  # rank 1's copy still on its way
        directory.report([], keys[3:], rank=1)  # rank 1's store failed
        assert directory.lookup(keys) == 3
        servers[1].close()  # rank 1 unreachable and it reported nothing: a miss, never partial KV
        assert directory.lookup(keys) == 0
        directory.report(keys[:2], [], rank=1)  # then its reports stand in for it
        assert directory.lookup(keys) == 2
    finally:
        directory.close()
        for server in servers:
            server.close()


def test_a_broken_rank_backend_answers_a_miss_over_its_socket(ranks):
    settings, backends = ranks

    class Broken:
        def lookup(self, keys):
            raise ConnectionError("pool node down")

        loadable = lookup

    servers = [LookupServer(settings[0].lookup_socket(0), backends[0], settings[0].sharding),
               LookupServer(settings[1].lookup_socket(1), Broken(), settings[1].sharding)]
    directory = KeyDirectory(settings[0], 100)
    try:
        keys = block_keys(settings[0].namespace, P1)
        _store(settings[0], backends[0], keys)
        side = SchedulerSide(settings[0], directory)
        assert side.num_matched_tokens(FakeRequest("a", list(P1)), 0) == 0
    finally:
        directory.close()
        for server in servers:
            server.close()


# ---- the worker half across ranks --------------------------------------------------------------


def test_a_block_failed_on_another_rank_is_reported_and_taints_stores_here(ranks):
    settings, backends = ranks
    s, backend = settings[0], backends[0]
    layers = [torch.randn(12, 1, BLOCK, 2 * HEAD_DIM) for _ in range(NUM_LAYERS)]

    def agree(flags):  # the collective, as rank 1 would answer it: its row 1 failed
        return [f or i == 1 for i, f in enumerate(flags)]

    side = WorkerSide(backend, s.layout, layers, timeout_s=10, sharding=s.sharding, agree=agree)
    keys = tuple(block_keys(s.namespace, P1[:3 * BLOCK]))
    _store(s, backend, keys)
    side.start_loads([LoadSpec("a", keys, (6, 7, 8))])
    tainted = StoreSpec("a", tuple(block_keys(s.namespace, P1[:4 * BLOCK])[3:]), (9,), (6, 7, 8, 9))
    clean = StoreSpec("c", tuple(block_keys(s.namespace, _tokens(9, BLOCK))), (10,), (10,))
    for layer in range(NUM_LAYERS):
        side.wait_layer(layer)
        side.save_layer(layer, [tainted, clean])
    assert side.end_step([tainted, clean]) == {7}  # loaded fine here, failed on rank 1: recomputed everywhere
    side.close(10)
    assert side.take_reports() == (list(clean.keys), list(tainted.keys))  # this rank still holds keys[1]
    assert backend.lookup(s.sharding.keys(clean.keys)) == 1
    assert (side.stats.num_blocks_loaded, side.stats.num_blocks_failed) == (2, 1)


# ---- real tensor-parallel engines ----------------------------------------------------------------


def _spec(model: Path, kvtier: Path | None, phases: list[dict], tp: int = 2) -> dict:
    engine = {"enable_prefix_caching": False, "num_gpu_blocks_override": 40, "tensor_parallel_size": tp}
    if tp > 1:
        engine["distributed_executor_backend"] = "mp"
    return {"model": str(model), "kvtier": str(kvtier) if kvtier else None, "phases": phases, "engine": engine,
            "env": TP_ENV, "rank_stats": tp > 1 and kvtier is not None}


def _check_same(phase: dict, reference: dict) -> None:
    for prompt, out in zip(phase["prompts"], phase["outputs"]):
        want = reference[json.dumps(prompt)]
        assert out["tokens"] == want["tokens"], f"prompt of {len(prompt)} tokens"
        assert out["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)


def test_tp2_engines_hit_each_others_slices_and_tp1_does_not(tmp_path, tiny_model):
    # A (TP=2) computes P1 and P2 into a persistent SSD tier: each rank its slice, in its own
    # directory. C (TP=1, same config) must not hit them. B, a fresh TP=2 process, hits them on its
    # first request (its scheduler asks both ranks over their sockets); then rank 1's files are
    # overwritten, rank 1's loads fail their checksums, both ranks drop the blocks and vLLM
    # recomputes them: same tokens; the recomputed slices are stored again and hit.
    ssd = tmp_path / "ssd"
    kvtier = _yaml(tmp_path / "kvtier.yaml", tiny_model, {"ssd": {"capacity": "8MiB", "path": str(ssd),
                                                                  "persist": True}})
    (reference,) = run_engine(tmp_path, "reference", _spec(tiny_model, None, [{"prompts": [P1, P2]}]),
                              timeout_s=300)["phases"]
    reference = {json.dumps(p): o for p, o in zip(reference["prompts"], reference["outputs"])}
    (computed,) = run_engine(tmp_path, "a", _spec(tiny_model, kvtier, [{"prompts": [P1, P2]}]),
                             timeout_s=300)["phases"]
    assert [o["num_cached_tokens"] for o in computed["outputs"]] == [0, 2 * BLOCK]  # P2 shares P1's blocks
    assert [r["num_blocks_stored"] for r in computed["rank_stats"]] == [6, 6]
    (tp1,) = run_engine(tmp_path, "c", _spec(tiny_model, kvtier, [{"prompts": [P1]}], tp=1))["phases"]
    assert tp1["outputs"][0]["num_cached_tokens"] == 0
    assert tp1["stats"]["num_blocks_loaded"] == 0
    phases = [{"prompts": [P1]}, {"prompts": [P1], "overwrite_files": str(ssd / "rank1-of-2" / "*.slab")},
              {"prompts": [P1]}]
    hit, corrupted, again = run_engine(tmp_path, "b", _spec(tiny_model, kvtier, phases), timeout_s=300)["phases"]
    assert hit["outputs"][0]["num_cached_tokens"] == 4 * BLOCK
    assert [r["num_blocks_loaded"] for r in hit["rank_stats"]] == [4, 4]
    assert corrupted["corrupted_files"] > 0
    assert [r["num_blocks_failed"] for r in corrupted["rank_stats"]] == [4, 4]  # rank 0 drops what rank 1 lost
    assert again["outputs"][0]["num_cached_tokens"] == 4 * BLOCK
    assert [r["num_blocks_loaded"] - c["num_blocks_loaded"]
            for r, c in zip(again["rank_stats"], corrupted["rank_stats"])] == [4, 4]
    for phase in (computed, hit, corrupted, again):
        _check_same(phase, reference)
