"""kvtier's KV events, piece by piece (kvtier/integrations/vllm/events.py): the hash kvtier maps a key
to is vLLM's own GPU event hash (a real vLLM `Request` and `BlockPool`), the join across ranks
reporting out of step, coalescing, the bounds and their counters, the worker's residency in the
engine's keys (a real `KVTier`), and the worker metadata's merge of ranks. Cost: ~3 s.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvtier.deciding.residency import REMOVED, STORED
from kvtier.integrations.vllm.events import (
    BlockHashes,
    EventSettings,
    ExtBlock,
    KVEvents,
    ResidencyJoin,
    WorkerResidency,
)
from kvtier.kinds import TierKind
from kvtier.runtime import KVTier

from support.runtime import LAYOUT, WAIT_S, config
from support.vllm import BLOCK, LAYER_NAMES, PAGE_BYTES, _yaml

pytest.importorskip("vllm")

D, P, S = TierKind.DRAM, TierKind.POOL, TierKind.SSD
ST, RM, DR, SS = int(STORED), int(REMOVED), int(D), int(S)


def _vllm_request(tokens: list[int], hash_block_size: int):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(lambda data: hashlib.sha256(repr(data).encode()).digest())
    hasher = get_request_block_hasher(hash_block_size, lambda data: hashlib.sha256(repr(data).encode()).digest())
    return Request("r", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)


def _gpu_events(request, num_blocks: int, block_size: int, hash_block_size: int) -> list:
    """vLLM's own GPU `BlockStored` for the request's first `num_blocks` blocks."""
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_blocks + 1, enable_caching=True, hash_block_size=hash_block_size,
                     enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(num_blocks)
    pool.cache_full_blocks(request, blocks, 0, num_blocks, block_size, 0)
    return pool.take_events()


@pytest.mark.parametrize("int_hashes", ["1", "0"])
@pytest.mark.parametrize("hash_block_size", [16, 8])
def test_a_keys_hash_is_the_one_vllms_gpu_events_publish(monkeypatch, int_hashes, hash_block_size):
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", int_hashes)
    block_size, tokens = 16, list(range(100, 100 + 16 * 3 + 5))
    request = _vllm_request(tokens, hash_block_size)
    gpu = [e for e in _gpu_events(request, 3, block_size, hash_block_size)]
    gpu_hashes = [h for e in gpu for h in e.block_hashes]
    assert len(gpu_hashes) == 3 and all(isinstance(h, int if int_hashes == "1" else bytes) for h in gpu_hashes)
    hashes = BlockHashes(lambda group, keys: tuple(keys), [0], block_size, hash_block_size, 16)
    assert hashes.record(request, 0, [b"k0", b"k1"]) == 2  # two keys now, the third later
    assert hashes.record(request, 2, [b"k2", b"k3"]) == 1  # vLLM has hashed three full blocks
    mapped = [hashes.get(k) for k in (b"k0", b"k1", b"k2")]
    assert [m.hash for m in mapped] == gpu_hashes and hashes.get(b"k3") is None
    assert [m.parent for m in mapped] == [gpu[0].parent_block_hash, gpu_hashes[0], gpu_hashes[1]]
    assert [t for m in mapped for t in m.token_ids] == [t for e in gpu for t in e.token_ids] == tokens[:48]
    assert {m.block_size for m in mapped} == {block_size}


def test_the_hash_map_is_bounded_and_forgets_the_least_recently_keyed():
    request = _vllm_request(list(range(64)), 16)
    hashes = BlockHashes(lambda group, keys: tuple(keys), [0], 16, 16, 3)
    hashes.record(request, 0, [b"a", b"b", b"c", b"d"])
    assert len(hashes) == 3 and hashes.get(b"a") is None and hashes.get(b"d") is not None


def test_every_group_maps_its_own_keys_under_its_index():
    request = _vllm_request(list(range(32)), 16)
    hashes = BlockHashes(lambda group, keys: tuple(k + bytes([group]) for k in keys), [0, 1], 16, 16, 16)
    hashes.record(request, 0, [b"a", b"b"], plain=False)
    zero, one = hashes.get(b"a\x00"), hashes.get(b"a\x01")
    assert (zero.group_idx, one.group_idx) == (0, 1) and zero.hash == one.hash
    assert zero.token_ids == ()  # a block whose hash covers more than its tokens publishes none


# ---- the join across ranks -------------------------------------------------------------------

def test_one_rank_passes_every_entry_through():
    join = ResidencyJoin(1, 8)
    entries = [(ST, DR, b"a"), (RM, DR, b"a"), (ST, SS, b"a")]
    assert join.apply(0, entries) == entries


def test_a_block_is_stored_when_every_rank_holds_it_even_steps_apart():
    join = ResidencyJoin(2, 8)
    assert join.apply(0, [(ST, DR, b"a"), (ST, DR, b"b")]) == []  # rank 1 is a step behind
    assert join.apply(1, [(ST, DR, b"a")]) == [(ST, DR, b"a")]
    assert join.apply(1, [(ST, DR, b"b"), (ST, SS, b"a")]) == [(ST, DR, b"b")]
    # removed as soon as one rank lost its slice, once; the other rank's removal adds nothing
    assert join.apply(1, [(RM, DR, b"a")]) == [(RM, DR, b"a")]
    assert join.apply(0, [(RM, DR, b"a")]) == []
    # a partial mask never published its store, so its removal is not published either
    assert join.apply(1, [(RM, SS, b"a")]) == []
    # stored again by both: published again
    assert join.apply(0, [(ST, DR, b"a")]) + join.apply(1, [(ST, DR, b"a")]) == [(ST, DR, b"a")]


def test_the_join_forgets_its_oldest_pairs_and_counts_them():
    join = ResidencyJoin(2, 2)
    join.apply(0, [(ST, DR, b"a"), (ST, DR, b"b"), (ST, DR, b"c")])
    assert join.num_forgotten == 1
    assert join.apply(1, [(ST, DR, b"a"), (ST, DR, b"c")]) == [(ST, DR, b"c")]  # "a" was forgotten


# ---- events: mapping, coalescing, bounds -----------------------------------------------------

def _events(limit: int = 16, num_ranks: int = 1, blocks: int = 6) -> tuple[KVEvents, list[bytes]]:
    """KVEvents over a hand-made map of keys k0.. to a chain of hashes 1000.. (tokens 4 per block)."""
    hashes = BlockHashes(lambda group, keys: tuple(keys), [0], 4, 4, 64)
    keys = [f"k{i}".encode() for i in range(blocks)]
    for i, key in enumerate(keys):
        hashes.put(key, ExtBlock(1000 + i, 1000 + i - 1 if i else None, (i,) * 4, 4))
    return KVEvents(EventSettings(max_per_step=limit), num_ranks, hashes), keys


def test_a_chained_run_of_one_tier_and_op_is_one_event_with_its_tokens_and_parent():
    events, k = _events()
    events.add(0, [(ST, DR, k[1]), (ST, DR, k[2]), (ST, DR, k[4]), (ST, SS, k[5]), (RM, DR, k[1]), (RM, DR, k[4])])
    out = events.take()
    assert [type(e).__name__ for e in out] == ["BlockStored", "BlockStored", "BlockStored", "BlockRemoved"]
    first, gap, ssd, removed = out
    assert (first.block_hashes, first.parent_block_hash, first.token_ids) == ([1001, 1002], 1000, [1] * 4 + [2] * 4)
    assert (first.medium, first.locality, first.ownership, first.block_size) == ("CPU", "LOCAL", "kvtier", 4)
    assert (gap.block_hashes, gap.parent_block_hash) == ([1004], 1003)  # not the child of 1002: its own event
    assert (ssd.block_hashes, ssd.medium) == ([1005], "STORAGE")
    assert (removed.block_hashes, removed.medium) == ([1001, 1004], "CPU")  # removals need not chain
    assert events.counts.published == {("dram", "stored"): 3, ("ssd", "stored"): 1, ("dram", "removed"): 2}
    assert events.take() == []


def test_the_pool_is_named_shared_and_remote():
    events, k = _events()
    events.add(0, [(ST, int(P), k[0])])
    (e,) = events.take()
    assert (e.medium, e.locality, e.ownership) == ("SHARED", "REMOTE", "kvtier-pool")


def test_an_unmapped_key_is_dropped_and_counted():
    events, k = _events()
    events.add(0, [(ST, DR, b"adopted"), (ST, DR, k[0])], dropped={(DR, ST): 3})
    assert [e.block_hashes for e in events.take()] == [[1000]]
    assert events.counts.dropped == {("dram", "stored", "unmapped"): 1, ("dram", "stored", "worker"): 3}


def test_the_queue_keeps_removals_over_stores_and_hands_out_a_step_at_a_time():
    events, k = _events(limit=2)
    events.add(0, [(ST, DR, k[0]), (ST, SS, k[1]), (ST, DR, k[2])])  # the third store does not fit
    events.add(0, [(RM, DR, k[0]), (RM, SS, k[1]), (RM, DR, k[3])])  # removals fit up to twice the limit
    assert events.counts.dropped == {("dram", "stored", "queue"): 1, ("dram", "removed", "queue"): 1}
    assert len(events) == 4
    first = events.take()  # at most max_per_step blocks
    assert sum(len(e.block_hashes) for e in first) == 2 and first[0].block_hashes == [1000]
    second = events.take()
    assert [(type(e).__name__, e.block_hashes) for e in second] == [("BlockRemoved", [1000]),
                                                                    ("BlockRemoved", [1001])]
    assert events.take() == [] and len(events) == 0


def test_two_ranks_publish_a_store_once_both_hold_it():
    events, k = _events(num_ranks=2)
    events.add(0, [(ST, DR, k[0])])
    assert events.take() == []
    events.add(1, [(ST, DR, k[0])])
    assert [e.block_hashes for e in events.take()] == [[1000]]


# ---- the worker's side -----------------------------------------------------------------------

def test_the_worker_reports_residency_in_the_engines_keys(tmp_path):
    backend = KVTier(config(tmp_path, hbm=0, dram=2, ssd=3), layout=LAYOUT)
    try:
        residency = WorkerResidency(backend, 64, sharded=True, max_keys=16)
        engine, rank = [b"e0", b"e1", b"e2"], [b"r0", b"r1", b"r2"]
        residency.note(engine, rank)
        blocks = torch.zeros(3, LAYOUT.block_bytes, dtype=torch.uint8)
        backend.store(rank, blocks).wait(WAIT_S)
        backend.quiesce(WAIT_S)
        entries, dropped = residency.take()
        assert dropped == {}
        # DRAM holds two: the third store pushes the oldest down to SSD
        held: set = set()
        for op, tier, key in entries:
            assert key in engine
            (held.add if op == ST else held.remove)((key, tier))
        assert held == {(k, int(t)) for k, t in zip(engine, backend.where(rank))}
        assert {t for _, t in held} == {DR, SS}
        residency.close()
        backend.store([b"r3"], blocks[:1]).wait(WAIT_S)
        assert backend.take_residency().entries == ()  # closed: nothing logged
    finally:
        backend.close()


def test_the_worker_metadata_merges_ranks():
    from kvtier.integrations.vllm.connector import KVTierWorkerMetadata

    a = KVTierWorkerMetadata({0: [b"x"]}, {}, {0: [(ST, DR, b"x")]}, {0: {(DR, ST): 1}})
    b = KVTierWorkerMetadata({}, {}, {1: [(ST, DR, b"x")]}, {})
    merged = a.aggregate(b)
    assert merged.residency == {0: [(ST, DR, b"x")], 1: [(ST, DR, b"x")]}
    assert merged.dropped == {0: {(DR, ST): 1}} and merged.ranks() == [0, 1]


# ---- on only where vLLM publishes events, unless kvtier's setting turns them off ---------------

@pytest.mark.parametrize("vllm_on, extra, on", [(True, {}, True), (False, {}, False),
                                                 (True, {"kv_events": False}, False),
                                                 (False, {"kv_events": True}, False)])
def test_events_are_on_where_vllm_publishes_them_and_kvtier_is_not_told_otherwise(tmp_path, tiny_model, vllm_on,
                                                                                   extra, on):
    from kvtier.integrations.vllm.settings import EngineFacts, read_settings

    facts = EngineFacts(model_id="tiny", block_size=BLOCK, kv_dtype="float32", layer_names=LAYER_NAMES,
                        page_bytes=PAGE_BYTES, device_type="cpu", kv_role="kv_both", kv_events=vllm_on)
    config = _yaml(tmp_path / "kvtier.yaml", tiny_model, {"dram": {"capacity": "4MiB"}})
    assert read_settings({"kvtier_config": str(config), **extra}, facts).kv_events is on


def test_a_kv_events_setting_that_is_not_a_flag_is_a_clear_error(tmp_path, tiny_model):
    from kvtier.errors import ConfigError
    from kvtier.integrations.vllm.settings import EngineFacts, read_settings

    facts = EngineFacts(model_id="tiny", block_size=BLOCK, kv_dtype="float32", layer_names=LAYER_NAMES,
                        page_bytes=PAGE_BYTES, device_type="cpu", kv_role="kv_both", kv_events=True)
    config = _yaml(tmp_path / "kvtier.yaml", tiny_model, {"dram": {"capacity": "4MiB"}})
    with pytest.raises(ConfigError, match="kv_events: expected true or false"):
        read_settings({"kvtier_config": str(config), "kv_events": "yes"}, facts)


def test_the_metrics_endpoint_serves_the_event_counters():
    from kvtier.integrations.vllm.metrics import EngineCollector
    from kvtier.integrations.vllm.scheduler import PromptBlocks

    events, k = _events(limit=1)
    events.add(0, [(ST, DR, k[0]), (ST, DR, k[1])])
    events.take()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in EngineCollector(1, lambda rank: None, PromptBlocks(), events.counts).collect()
               for s in f.samples}
    assert samples["kvtier_kv_events_published_total", (("op", "stored"), ("tier", "dram"))] == 1
    assert samples["kvtier_kv_events_dropped_total", (("op", "stored"), ("tier", "dram"), ("where", "queue"))] == 1
