"""Retention hints through the vLLM connector, without an engine: `kv_transfer_params` read once per
request by the scheduler half, sent to the workers with the blocks each step stores or the request
hit (`HintSpec` in `KVTierConnectorMetadata`), applied by every rank to its own keys over a real
`KVTier`, and counted on the metrics endpoint. The real engine: `test_vllm_serve.py`. Cost: ~3 s.
"""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest
import torch

from kvtier.integrations.hints import HintRefusal
from kvtier.integrations.vllm.scheduler import HintSpec, KeyDirectory, ScheduledRequest, SchedulerSide, StoreSpec
from kvtier.integrations.vllm.settings import EngineFacts, KVGroup, read_settings
from kvtier.integrations.vllm.shards import Sharding
from kvtier.integrations.vllm.transfers import WorkerSide
from kvtier.model.keys import block_keys
from kvtier.runtime import KVTier

from support.vllm import FakeRequest, BLOCK, HEAD_DIM, KV_HEADS, LAYER_NAMES, NUM_LAYERS, P1, PAGE_BYTES, _tokens, _yaml

RETAIN = {"kvtier": {"retain_s": 300, "session": "s-42"}}
CLOSE = {"kvtier": {"session": "s-42", "closed": True}}




FACTS = EngineFacts(model_id="tiny", block_size=BLOCK, kv_dtype="float32", layer_names=LAYER_NAMES,
                    page_bytes=PAGE_BYTES, device_type="cpu", kv_role="kv_both")


def _settings(tmp_path, tiny_model, hints=None, **facts):
    top = {"hints": hints} if hints is not None else {}
    path = _yaml(tmp_path / "kvtier.yaml", tiny_model, {"dram": {"capacity": "4MiB"}}, **top)
    return read_settings({"kvtier_config": str(path)}, replace(FACTS, **facts))


@pytest.fixture
def settings(tmp_path, tiny_model):
    return _settings(tmp_path, tiny_model)


def _step(side, *items, tables=None):
    tables = tables or {}
    return side.plan_step(list(items), lambda r: tables.get(r, [list(range(100, 110))]))


# ---- the scheduler half ----------------------------------------------------------------------------


def test_nothing_is_sent_until_the_first_hint_then_every_requests_blocks_are(settings):
    side = SchedulerSide(settings, KeyDirectory(settings, 100))
    plain = FakeRequest("plain", list(P1))
    side.track(plain)
    assert _step(side, ScheduledRequest("plain", 100)).hints == [], "kvtier runs as without hints"
    plain.num_computed_tokens = 100
    side.track(FakeRequest("hinted", list(P1), RETAIN))
    other = FakeRequest("other", _tokens(9, 70))
    side.track(other)
    hints = _step(side, ScheduledRequest("plain", 50), ScheduledRequest("hinted", 150),
                  ScheduledRequest("other", 70)).hints
    keys = block_keys(settings.namespace, P1)
    assert hints == [HintSpec("plain", tuple(keys[:4]), tenant="default"),
                     HintSpec("hinted", tuple(keys[:4]), "s-42", 300.0, False, "default"),
                     HintSpec("other", tuple(block_keys(settings.namespace, other.all_token_ids)), tenant="default")]
    assert side.hint_reader.num_read == 1


def test_a_hint_goes_with_each_steps_new_blocks_once(settings):
    side = SchedulerSide(settings, KeyDirectory(settings, 100))
    request = FakeRequest("a", list(P1) + _tokens(5, 40), RETAIN)
    side.track(request)
    keys = block_keys(settings.namespace, request.all_token_ids)
    first = _step(side, ScheduledRequest("a", 100)).hints
    assert [h.keys for h in first] == [tuple(keys[:3])]
    request.num_computed_tokens = 100
    assert [h.keys for h in _step(side, ScheduledRequest("a", 20)).hints] == [], "no block completed"
    request.num_computed_tokens = 120
    then = _step(side, ScheduledRequest("a", 70, num_spec_tokens=2)).hints  # to 188: speculative left out
    assert [(h.keys, h.session, h.retain_s) for h in then] == [(tuple(keys[3:5]), "s-42", 300.0)]


def test_a_closing_hint_is_sent_once_even_with_no_new_block_and_the_rest_of_the_request_with_none(settings):
    side = SchedulerSide(settings, KeyDirectory(settings, 100))
    short = FakeRequest("short", list(P1[:20]), CLOSE)  # no full block: the close still goes
    side.track(short)
    assert _step(side, ScheduledRequest("short", 20)).hints == [HintSpec("short", (), "s-42", None, True, "default")]
    short.num_computed_tokens = 20
    assert _step(side, ScheduledRequest("short", 1)).hints == []
    hit_all = FakeRequest("hit", list(P1), CLOSE, num_computed_tokens=4 * BLOCK)  # every block a hit
    side.track(hit_all)
    keys = block_keys(settings.namespace, P1)
    assert _step(side, ScheduledRequest("hit", 150 - 4 * BLOCK)).hints == [
        HintSpec("hit", tuple(keys[:4]), "s-42", None, True, "default")]
    hit_all.all_token_ids += _tokens(6, 40)  # decoded on: its session is over, those blocks belong to none
    hit_all.num_computed_tokens = 150
    assert _step(side, ScheduledRequest("hit", 40)).hints == []


def test_the_engines_session_id_and_cache_salt_name_session_and_tenant(settings):
    side = SchedulerSide(settings, KeyDirectory(settings, 100))
    side.track(FakeRequest("a", list(P1), {"kvtier": {"retain_s": 60}}, session_id="chat-7", cache_salt="acme"))
    side.track(FakeRequest("b", list(P1), {"kvtier": {"retain_s": 60, "session": "own"}}, session_id="chat-7"))
    hints = _step(side, ScheduledRequest("a", 150), ScheduledRequest("b", 150)).hints
    assert [(h.session, h.tenant) for h in hints] == [("chat-7", "acme"), ("own", "default")]


def test_hints_off_in_the_config_are_not_read(tmp_path, tiny_model):
    settings = _settings(tmp_path, tiny_model, {"enabled": False})
    side = SchedulerSide(settings, KeyDirectory(settings, 100))
    side.track(FakeRequest("a", list(P1), RETAIN))
    assert side.hint_reader is None and _step(side, ScheduledRequest("a", 150)).hints == []


def test_a_lease_longer_than_the_configs_is_refused_and_counted(tmp_path, tiny_model):
    settings = _settings(tmp_path, tiny_model, {"max_retain_s": 60})
    side = SchedulerSide(settings, KeyDirectory(settings, 100))
    side.track(FakeRequest("a", list(P1), RETAIN))
    assert side.hint_reader.refused == {HintRefusal.BAD_RETAIN_S: 1}
    assert _step(side, ScheduledRequest("a", 150)).hints == []


def test_a_hybrid_engines_hint_names_every_groups_keys(tmp_path, tiny_model):
    groups = (KVGroup(0, LAYER_NAMES[0::2]), KVGroup(1, LAYER_NAMES[1::2], window_tokens=48))
    settings = _settings(tmp_path, tiny_model, groups=groups)
    side = SchedulerSide(settings, KeyDirectory(settings, 100))
    side.track(FakeRequest("a", list(P1), RETAIN))
    keys = block_keys(settings.namespace, P1)
    (hint,) = _step(side, ScheduledRequest("a", 150), tables={"a": [list(range(10, 15)), list(range(20, 25))]}).hints
    assert hint.keys == settings.group_keys(0, keys) + settings.group_keys(1, keys)


# ---- the worker half: every rank applies the hint to its own keys -----------------------------------


@pytest.mark.parametrize("sharding", [Sharding(), Sharding(1, 2, 2)], ids=["tp1", "tp2-rank1"])
def test_each_rank_applies_the_hint_to_its_own_keys_after_the_steps_stores(settings, sharding):
    kvtier = KVTier(settings.config, layout=settings.layout)
    layers = [torch.randn(12, KV_HEADS, BLOCK, 2 * HEAD_DIM) for _ in range(NUM_LAYERS)]
    side = WorkerSide(kvtier, settings.layout, layers, timeout_s=10, sharding=sharding)
    try:
        keys = tuple(block_keys(settings.namespace, P1))
        store = StoreSpec("a", keys, (1, 2, 3, 4), (1, 2, 3, 4))
        assert side.end_step([store]) == set()
        side.apply_hints([HintSpec("a", keys, "s-42", 300.0, False, "acme")])
        assert kvtier.num_retained("acme") == 4, "the rank's own keys (kvtier holds no engine-level key under TP)"
        side.apply_hints([HintSpec("b", keys, "s-42", None, True, "acme")])
        assert kvtier.num_retained() == 0, "a closed session's blocks lose their lease"
        assert kvtier.snapshot()["hints"] == {"applied": 2, "closed": 1}
        side.close(10)
    finally:
        kvtier.close()


def test_a_backend_that_fails_a_hint_never_fails_the_step(settings, caplog):
    class Broken:
        layout = settings.layout

        def apply_hint(self, *args, **kwargs):
            raise RuntimeError("backend gone")

    side = WorkerSide(Broken(), settings.layout, [torch.zeros(2, KV_HEADS, BLOCK, 2 * HEAD_DIM)] * NUM_LAYERS, 1)
    side.apply_hints([HintSpec("a", (b"k" * 16,), "s", 5.0)])
    assert "the hint of request a was not applied" in caplog.text


def test_the_connectors_metadata_carries_the_hints_to_worker_processes():
    pytest.importorskip("vllm")
    from kvtier.integrations.vllm.connector import KVTierConnectorMetadata

    meta = KVTierConnectorMetadata(hints=[HintSpec("a", (b"k" * 16,), "s-42", 300.0, True, "acme")])
    assert pickle.loads(pickle.dumps(meta)).hints == meta.hints


# ---- counters on the metrics endpoint --------------------------------------------------------------


def test_the_metrics_count_hints_read_refused_by_reason_and_what_each_rank_did(settings):
    from kvtier.integrations.vllm.metrics import EngineCollector, rank_report
    from kvtier.integrations.vllm.scheduler import PromptBlocks
    from kvtier.integrations.vllm.transfers import WorkerStats

    side = SchedulerSide(settings, KeyDirectory(settings, 100))
    for i, params in enumerate([RETAIN, {"kvtier": {"retain_s": "long"}}, {"kvtier": {"closed": True}}, None]):
        side.track(FakeRequest(f"r{i}", list(P1), params))
    with KVTier(settings.config, layout=settings.layout) as kvtier:
        kvtier.apply_hint([b"k" * 16], session="s", retain_s=1e9)
        report = rank_report(0, kvtier, WorkerStats(), 0)
        collector = EngineCollector(1, lambda rank: report, PromptBlocks(), None, side.hint_reader)
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for m in collector.collect() for s in m.samples}
    assert samples[("kvtier_hints_read_total", ())] == 1
    assert samples[("kvtier_hints_refused_total", (("reason", "bad_retain_s"),))] == 1
    assert samples[("kvtier_hints_refused_total", (("reason", "closed_without_session"),))] == 1
    assert samples[("kvtier_hints_refused_total", (("reason", "bad_session"),))] == 0
    assert samples[("kvtier_hints_total", (("outcome", "refused:bad_retain_s"), ("rank", "0")))] == 1
