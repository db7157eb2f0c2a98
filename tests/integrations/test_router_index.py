"""What a router learns from KV events (kvtier.integrations.router): batches encoded by vLLM's own
event classes, then a real pool node's stream. Cost: ~3 s (vLLM's event module, one node process)."""

from __future__ import annotations

import msgpack
import pytest

from kvtier.integrations.router import DEFAULT_WEIGHTS, EventError, PrefixIndex, decode_batch

BS = 4
PROMPT = list(range(100, 100 + 4 * BS))  # four blocks


def blocks_of(tokens, n):
    return [tokens[i * BS:(i + 1) * BS] for i in range(n)]


@pytest.fixture(scope="module")
def vllm_events():
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    import msgspec

    encoder = msgspec.msgpack.Encoder()

    def stored(hashes, parent, tokens, medium="GPU"):
        return kv_events.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS,
                                     lora_id=None, medium=medium, lora_name=None)

    def removed(hashes, medium):
        return kv_events.BlockRemoved(block_hashes=hashes, medium=medium)

    def batch(*events):
        return encoder.encode(kv_events.KVEventBatch(ts=1.0, events=list(events)))

    return stored, removed, batch, kv_events.AllBlocksCleared


def test_the_server_holding_the_longer_prefix_wins_and_tiers_weigh_as_llm_d(vllm_events):
    stored, removed, batch, _ = vllm_events
    index = PrefixIndex()
    # server a: the first three blocks on its GPU, in one coalesced event; b: the first two, then the
    # GPU lets them go while kvtier keeps them in DRAM
    index.apply("a", batch(stored([1, 2, 3], None, PROMPT[:3 * BS])))
    index.apply("b", batch(stored([1, 2], None, PROMPT[:2 * BS]), stored([1, 2], None, PROMPT[:2 * BS], "CPU"),
                           removed([1, 2], "GPU")))
    assert index.prefix_hashes("a", PROMPT, BS) == [1, 2, 3]
    assert index.score("a", PROMPT, BS) == pytest.approx(3 * DEFAULT_WEIGHTS["GPU"])
    assert index.score("b", PROMPT, BS) == pytest.approx(2 * DEFAULT_WEIGHTS["CPU"])
    assert index.best(PROMPT, BS) == ("a", pytest.approx(3.0))
    assert index.media("b", 1) == {"CPU"}
    # a prompt that departs after one block: only that block counts, wherever it is held
    other = PROMPT[:BS] + [7] * (3 * BS)
    assert index.score("a", other, BS) == 1.0 and index.score("b", other, BS) == pytest.approx(0.8)


def test_a_block_in_several_tiers_counts_once_at_its_best_and_leaves_with_its_last_copy(vllm_events):
    stored, removed, batch, cleared = vllm_events
    index = PrefixIndex()
    index.apply("s", batch(stored([1, 2], None, PROMPT[:2 * BS]), stored([1, 2], None, PROMPT[:2 * BS], "STORAGE")))
    assert index.score("s", PROMPT, BS) == 2.0
    index.apply("s", batch(cleared()))  # vLLM reset its GPU cache: the SSD copies remain
    assert index.score("s", PROMPT, BS) == pytest.approx(2 * DEFAULT_WEIGHTS["STORAGE"])
    index.apply("s", batch(removed([1], "STORAGE")))
    assert index.prefix_hashes("s", PROMPT, BS) == [] and index.score("s", PROMPT, BS) == 0
    assert index.best(PROMPT, BS) == (None, 0.0)


def test_a_child_is_matched_through_its_parent_not_its_tokens_alone(vllm_events):
    stored, _, batch, _ = vllm_events
    index = PrefixIndex()
    # block 2's tokens stored under another parent: not the prompt's second block
    index.apply("s", batch(stored([1], None, PROMPT[:BS]), stored([9], 77, PROMPT[BS:2 * BS])))
    assert index.prefix_hashes("s", PROMPT, BS) == [1]


def test_blocks_without_tokens_are_scored_by_hash_and_a_later_event_can_name_their_tokens(vllm_events):
    stored, _, batch, _ = vllm_events
    index = PrefixIndex()
    index.apply("s", batch(stored([1, 2], None, [], "CPU")))  # e.g. a LoRA request's blocks
    assert index.score("s", PROMPT, BS) == 0 and index.score_hashes("s", [1, 2, 3]) == pytest.approx(1.6)
    index.apply("s", batch(stored([1, 2], None, PROMPT[:2 * BS])))
    assert index.prefix_hashes("s", PROMPT, BS) == [1, 2]


def test_unknown_media_weigh_nothing_and_are_counted(vllm_events):
    stored, _, batch, _ = vllm_events
    index = PrefixIndex({"GPU": 1.0})
    index.apply("s", batch(stored([1], None, PROMPT[:BS], "TAPE")))
    assert index.score("s", PROMPT, BS) == 0 and index.unknown_media == {"TAPE": 1}


@pytest.mark.parametrize("payload, names", [
    (b"\xc1", "msgpack"),
    (msgpack.packb({"ts": 1}), "dict"),
    (msgpack.packb([1.0, [["BlockStored", [1]]], None]), "'type'"),
])
def test_bad_payloads_are_refused_by_name(payload, names):
    with pytest.raises(EventError, match=names):
        decode_batch(payload)


def test_a_bad_block_size_is_refused():
    with pytest.raises(ValueError, match="block_size"):
        PrefixIndex().prefix_hashes("s", PROMPT, 0)


def test_a_pool_nodes_stream_tells_a_router_which_node_holds_a_prefix(tmp_path):
    from kvtier.pool.client.api import PoolClient
    from kvtier.pool.node.process import running_node

    secret = b"router-test-secret-0123456789"
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"tenants:\n  - {{name: t, secret: {secret.decode()}, quota: 4MiB}}\n")
    index = PrefixIndex()
    with running_node(tenants=tenants, credentials=("t", secret)) as a, \
            running_node(tenants=tenants, credentials=("t", secret)) as b:
        clients = {name: PoolClient([n.address], tenant="t", secret=secret, reconnect_s=0) for name, n in
                   (("a", a), ("b", b))}
        try:
            streams = {name: c.subscribe() for name, c in clients.items()}
            for name, n in (("a", 3), ("b", 1)):
                keys = [f"{name}-{i}".encode() for i in range(n)]
                assert clients[name].batch_put(keys, [bytes(4096)] * n) == [True] * n
                reply = clients[name].announce(keys, [11, 12, 13][:n], block_size=BS, parents=[None, 11, 12][:n],
                                               tokens=blocks_of(PROMPT, n))
                assert reply["announced"] == n
                frame = streams[name].next_frame(30)
                assert frame is not None and index.apply(name, frame.payload) == n
            assert index.best(PROMPT, BS) == ("a", pytest.approx(3 * DEFAULT_WEIGHTS["SHARED"]))
            assert clients["a"].delete([b"a-0"]) == 1
            frame = streams["a"].next_frame(30)
            index.apply("a", frame.payload)
            assert index.best(PROMPT, BS) == ("b", pytest.approx(DEFAULT_WEIGHTS["SHARED"])), \
                "a lost the prefix's first block: its later blocks no longer count"
        finally:
            for c in clients.values():
                c.close()
