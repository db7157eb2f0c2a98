"""An engine's pool tier names the blocks it writes with vLLM's hashes, so the pool node publishes them
(kvtier/integrations/vllm/pool_names.py), against a real `kvtier pool serve` on 127.0.0.1 with
tenants: the connector's own path (the scheduler's `SchedulerSide` keys a real vLLM `Request` and
plans its stores, the worker's `WorkerSide` saves them into a `KVTier` whose pool tier writes them
through, `PoolNames` announces each put) and a subscriber of the tenant that sees `BlockStored`
under the hashes of vLLM's own GPU events, then `BlockRemoved` as the node deletes and evicts them.
A second engine that adopts the blocks names none of them; a third that writes them again is
ignored by the node and counted. Failures and bounds are counted, never raised.
Cost: about 6 s on 2 cores (one node, vLLM's request and block pool classes).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from kvtier.integrations.vllm.backends import open_backend
from kvtier.integrations.vllm.events import ExtBlock
from kvtier.integrations.vllm.pool_names import AnnounceSettings, PoolNames, names_pool_blocks, pool_names
from kvtier.integrations.vllm.scheduler import KeyDirectory, ScheduledRequest, SchedulerSide, StoreSpec
from kvtier.integrations.vllm.settings import EngineFacts, read_settings
from kvtier.integrations.vllm.shards import Sharding
from kvtier.integrations.vllm.transfers import WorkerSide
from kvtier.kinds import TierKind
from kvtier.pool.client.api import PoolClient
from kvtier.pool.node.process import running_node

from support.vllm import BLOCK, HEAD_DIM, KV_HEADS, LAYER_NAMES, NUM_LAYERS, PAGE_BYTES, _tokens, _yaml
from test_vllm_events import _gpu_events, _vllm_request

pytest.importorskip("vllm")

SECRET = b"engine-secret-0123456789"
NUM_BLOCKS = 4
WAIT_S = 30.0  # a safety net for a loaded machine, never a measurement


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    path = tmp_path_factory.mktemp("names") / "tenants.yaml"
    path.write_text(f"tenants:\n  - {{name: eng, secret: {SECRET.decode()}, quota: 2MiB}}\n")
    with running_node(capacity="16MiB", region_size="256KiB", tenants=path, credentials=("eng", SECRET)) as n:
        yield n


@pytest.fixture
def settings(tmp_path, tiny_model, node):
    pool = {"capacity": "2MiB", "nodes": [node.address], "tenant": "eng", "secret": SECRET.decode()}
    path = _yaml(tmp_path / "pool.yaml", tiny_model, {"dram": {"capacity": "1MiB"}, "pool": pool})
    facts = EngineFacts(model_id="tiny", block_size=BLOCK, kv_dtype="float32", layer_names=LAYER_NAMES,
                        page_bytes=PAGE_BYTES, device_type="cpu", kv_role="kv_both", kv_events=True)
    return read_settings({"kvtier_config": str(path)}, facts)


def _scheduler(settings) -> SchedulerSide:
    """The scheduler half as the connector builds it with KV events on."""
    from kvtier.integrations.vllm.connector import _scheduler_events

    events = _scheduler_events(settings, SimpleNamespace(hash_block_size=BLOCK))
    return SchedulerSide(settings, KeyDirectory(settings, 64), events.hashes, names_pool_blocks(settings))


class Engine:
    """One engine's worker rank: its backend (DRAM, the pool written through) and `PoolNames`."""

    def __init__(self, settings) -> None:
        self.backend = open_backend(settings)
        self.names = pool_names(settings, self.backend)
        self.layers = [torch.randn(NUM_BLOCKS + 2, KV_HEADS, BLOCK, 2 * HEAD_DIM) for _ in range(NUM_LAYERS)]

    def step(self, stores: list[StoreSpec]) -> None:
        """One engine step as the connector drives it: names bound with the metadata, then the
        stores saved layer by layer and sent, then waited for (`WorkerSide.close`)."""
        side = WorkerSide(self.backend, self.backend.layout, self.layers, timeout_s=WAIT_S)
        self.names.name(stores)
        for layer in range(NUM_LAYERS):
            side.save_layer(layer, stores)
        assert side.end_step(stores) == set()
        side.close(WAIT_S)

    def close(self) -> None:
        self.names.close(WAIT_S)  # what is queued is announced first
        self.backend.close()


def _plan(settings, tokens: list[int]) -> tuple[list[StoreSpec], object]:
    """The stores the scheduler plans for a prompt's first step, and its vLLM request."""
    request = _vllm_request(tokens, BLOCK)
    scheduler = _scheduler(settings)
    scheduler.track(request)
    plan = scheduler.plan_step([ScheduledRequest(request.request_id, len(tokens))],
                               lambda _: [list(range(1, NUM_BLOCKS + 2))])  # block 0 is vLLM's null block
    scheduler.directory.close()
    return plan.stores, request


def _next_events(stream) -> list[dict]:
    frame = stream.next_frame(WAIT_S)
    assert frame is not None, "no event frame came"
    return frame.batch()[1]


def _stored_until(stream, n: int) -> list[dict]:
    events: list[dict] = []
    while sum(len(e["block_hashes"]) for e in events) < n:
        got = _next_events(stream)
        assert {e["type"] for e in got} == {"BlockStored"}, got
        events += got
    return events


def test_the_blocks_an_engine_writes_through_are_published_under_vllms_hashes_then_removed(settings, node):
    tokens = _tokens(7, NUM_BLOCKS * BLOCK + 5)
    stores, request = _plan(settings, tokens)
    assert [(len(s.keys), len(s.names)) for s in stores] == [(NUM_BLOCKS, NUM_BLOCKS)] and None not in stores[0].names
    gpu = _gpu_events(request, NUM_BLOCKS, BLOCK, BLOCK)
    want = [h for e in gpu for h in e.block_hashes]
    node_keys = [bytes(k) for k in stores[0].keys]  # no tensor parallelism: the node's keys are the engine's
    engines: list[Engine] = []

    def engine() -> Engine:
        engines.append(Engine(settings))
        return engines[-1]

    with PoolClient([node.address], tenant="eng", secret=SECRET, timeout_s=WAIT_S) as client, \
            client.subscribe() as stream:
        writer = engine()
        try:
            writer.step(stores)
            events = _stored_until(stream, NUM_BLOCKS)
            assert [h for e in events for h in e["block_hashes"]] == want, "vLLM's GPU hashes, in order"
            parent = None
            for e in events:
                assert (e["parent_block_hash"], e["block_size"], e["medium"], e["locality"]) == \
                    (parent, BLOCK, "SHARED", "REMOTE")
                assert e["token_ids"] == tokens[want.index(e["block_hashes"][0]) * BLOCK:][:BLOCK]
                parent = e["block_hashes"][-1]
            writer.close()
            assert vars(writer.names.counts) == {"announced": NUM_BLOCKS, "ignored": 0, "failed": 0,
                                                 "unnamed": 0, "dropped": 0}

            reader = engine()  # another engine adopts the blocks, then stores the same prefix
            assert reader.backend.lookup(list(stores[0].keys)) == NUM_BLOCKS
            reader.step(stores)
            reader.close()
            assert vars(reader.names.counts) == {"announced": 0, "ignored": 0, "failed": 0, "unnamed": 0,
                                                 "dropped": 0}, "nothing put from the adopting engine"

            again = engine()  # a third engine, never told: puts the same blocks, its names ignored
            again.step(stores)
            again.close()
            assert (again.names.counts.announced, again.names.counts.ignored) == (0, NUM_BLOCKS)

            assert client.delete(node_keys[:1]) == 1
            assert _next_events(stream) == [{"type": "BlockRemoved", "block_hashes": [want[0]], "medium": "SHARED",
                                             "locality": "REMOTE", "ownership": "kvtier-pool"}], \
                "the first event after the writer's: nothing was published for the other engines' blocks"
            size = writer.backend.tiers[TierKind.POOL].stored_bytes  # the engine's blocks' size on the node
            filler = [b"filler-%d" % i for i in range(2 * (2 << 20) // size)]  # unnamed, twice the 2 MiB quota
            for start in range(0, len(filler), 8):
                assert client.batch_put(filler[start:start + 8], [bytes(size)] * 8) == [True] * 8
            removed: list = []
            while len(removed) < NUM_BLOCKS - 1:
                got = _next_events(stream)
                assert {e["type"] for e in got} == {"BlockRemoved"}, got
                removed += [h for e in got for h in e["block_hashes"]]
            assert sorted(removed, key=want.index) == want[1:]
            assert client.stats()[0]["evictions"] >= NUM_BLOCKS - 1
        finally:
            for each in engines:
                each.close()


def test_only_rank_0_names_blocks_and_only_with_kv_events_and_a_shared_kvtier_pool(settings):
    rank1 = replace(settings, sharding=Sharding(1, 2, 2))
    assert names_pool_blocks(settings) and pool_names(rank1, SimpleNamespace(tiers={})) is None
    assert not names_pool_blocks(replace(settings, kv_events=False))
    private = replace(settings.config, tiers=tuple(replace(t, shared=False) for t in settings.config.tiers))
    assert not names_pool_blocks(replace(settings, config=private))
    stores, _ = _plan(replace(settings, kv_events=False), _tokens(8, 2 * BLOCK))
    assert stores and stores[0].names == (), "no names sent where the worker does not announce"


class _Tier:
    """A pool tier's put listener and announce, where announce fails as a node that breaks mid-call."""

    def __init__(self) -> None:
        self.listener = None

    def listen_puts(self, listener) -> None:
        self.listener = listener

    def announce(self, keys, hashes, *, block_size, parents, tokens):
        raise ConnectionResetError("node went away")


def test_failures_unnamed_blocks_and_a_full_queue_are_counted_never_raised():
    tier = _Tier()
    names = PoolNames(tier, Sharding(), AnnounceSettings(max_names=4, max_pending=2, max_batch=2))
    keys = [bytes([i]) * 16 for i in range(6)]
    names.name([StoreSpec("r", tuple(keys), tuple(range(6)), (), 0,
                          tuple(ExtBlock(i, None, (i,) * 4, 4) for i in range(6)))])
    with names._ready:  # hold the announcing thread off while the queue fills
        tier.listener(keys)  # keys 0 and 1 were forgotten for max_names; 2 and 3 queued; 4 and 5 over the bound
    names.close(WAIT_S)
    assert tier.listener is None
    assert vars(names.counts) == {"announced": 0, "ignored": 0, "failed": 2, "unnamed": 2, "dropped": 2}
    tier.listen_puts(names._on_put)
    tier.listener(keys[2:3])  # after close: ignored
    assert names.counts.failed == 2


def test_under_tensor_parallelism_names_are_kept_under_rank_0s_own_pool_keys():
    tier, sharding = _Tier(), Sharding(0, 2, 2)
    names = PoolNames(tier, sharding)
    engine_keys = (b"e" * 16, b"f" * 16)
    names.name([StoreSpec("r", engine_keys, (1, 2), (), 0, (ExtBlock(1, None, (), 4), None))])
    with names._ready:  # hold the announcing thread off: what is queued stays countable
        tier.listener(list(engine_keys))  # the engine's keys are not what rank 0 puts
        assert (names.counts.unnamed, len(names._pending)) == (2, 0)
        tier.listener([bytes(k) for k in sharding.keys(engine_keys)])  # its own: the named one is queued
        assert (names.counts.unnamed, list(names._pending)) == (3, [bytes(sharding.keys(engine_keys)[0])])
    names.close(WAIT_S)
    assert names.counts.failed == 1
