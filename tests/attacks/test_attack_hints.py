"""Hostile retention hints: a tenant that asks to keep everything, and hints that are not hints.

Attacks: one tenant (a `cache_salt` in vLLM) marks every block it stores `retain_s` and then
floods the cache; many tenants (salts rotated per request) each spend a budget; requests whose
`kv_transfer_params` carry malformed `kvtier` hints (wrong types, unknown fields, NaN, a session of
a megabyte, a close without a session). Outcome: a tenant's retained blocks stop at its budget
(`hints.retain_fraction_per_tenant` of the last tier's slots) and all tenants' at
`hints.retain_fraction`, past which blocks are counted `over_budget` and left to the policy;
another tenant's retained blocks survive the flood; a malformed hint is refused with a counted
reason and the request is served (keyed, its stores planned) as without it. Real `KVTier` (a DRAM
tier as the last tier) and the vLLM connector's real scheduler half. Cost: about 5 s.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvtier.config import HintsConfig, KVTierConfig, TierConfig, TransferConfig
from kvtier.deciding.retention import HintLimits
from kvtier.integrations.hints import HintRefusal
from kvtier.kinds import TierKind
from kvtier.model.layout import BlockLayout
from kvtier.runtime import KVTier

LAYOUT = BlockLayout.uniform(block_tokens=4, num_layers=2, layer_bytes=1024)
SLOTS = 64
WAIT_S = 30  # a safety net against hangs, never a measurement


def runtime(per_tenant: float = 0.25, total: float = 0.5) -> KVTier:
    dram = TierConfig(TierKind.DRAM, SLOTS * LAYOUT.block_bytes, high_watermark=1.0, low_watermark=1.0)
    hints = HintsConfig(limits=HintLimits(retain_fraction_per_tenant=per_tenant, retain_fraction=total))
    config = KVTierConfig(model="kvtier-tiny", tiers=(dram,), promote_to=None,
                          transfer=TransferConfig(io_workers=1, skip_slow_loads=False), hints=hints)
    return KVTier(config, layout=LAYOUT)


def store(kv: KVTier, keys: list) -> None:
    data = torch.zeros(len(keys), LAYOUT.block_bytes, dtype=torch.uint8)
    handle = kv.store(keys, data)
    assert handle.wait(WAIT_S) and not handle.failed
    kv.quiesce(WAIT_S)


def test_a_tenant_retaining_everything_gets_its_budget_and_another_tenants_blocks_survive_its_flood():
    with runtime() as kv:
        cap = math.floor(0.25 * SLOTS)
        victim = [("victim", i) for i in range(8)]
        store(kv, victim)
        assert kv.apply_hint(victim, session="v-1", retain_s=300, tenant="victim")
        assert kv.num_retained("victim") == 8
        greedy = [("greedy", i) for i in range(SLOTS)]
        for start in range(0, SLOTS, 8):  # the greedy tenant pins everything it stores, then floods
            batch = greedy[start:start + 8]
            store(kv, batch)
            kv.apply_hint(batch, retain_s=3600, tenant="greedy")
        assert kv.num_retained("greedy") == cap, "a tenant's retained blocks stop at its budget"
        hints = kv.snapshot()["hints"]
        assert hints["over_budget"] >= SLOTS - cap
        flood = [("flood", i) for i in range(4 * SLOTS)]
        for start in range(0, len(flood), 16):
            store(kv, flood[start:start + 16])
        assert all(tier is TierKind.DRAM for tier in kv.where(victim)), "the victim's retained blocks survive"
        assert kv.num_retained("victim") == 8
        assert kv.usage()["dram"]["used"] <= SLOTS
        kept = [k for k, tier in zip(greedy, kv.where(greedy)) if tier is not None]
        assert len(kept) == cap, "the greedy tenant kept its budget; its other blocks were left to the policy"


def test_rotating_tenants_cannot_retain_more_than_the_total_budget():
    with runtime(per_tenant=0.25, total=0.5) as kv:
        for salt in range(8):  # a new cache_salt per request: a new tenant each time
            keys = [("salt", salt, i) for i in range(8)]
            store(kv, keys)
            kv.apply_hint(keys, retain_s=600, tenant=f"salt-{salt}")
        assert kv.num_retained() == math.floor(0.5 * SLOTS)
        assert kv.snapshot()["hints"]["over_budget"] == 8 * 8 - math.floor(0.5 * SLOTS)
        for start in range(0, 2 * SLOTS, 8):  # the last tier still has victims: stores keep landing
            store(kv, [("after", i) for i in range(start, start + 8)])
        assert kv.num_retained() == math.floor(0.5 * SLOTS)
        assert kv.usage()["dram"]["used"] <= SLOTS


@pytest.mark.parametrize("fields, reason", [
    ({"session": 42}, "bad_session"),
    ({"session": "x" * 1_000_000}, "bad_session"),
    ({"session": "tab\there"}, "bad_session"),
    ({"retain_s": float("nan")}, "bad_retain_s"),
    ({"retain_s": -1}, "bad_retain_s"),
    ({"retain_s": 10 ** 9}, "bad_retain_s"),
    ({"retain_s": True}, "bad_retain_s"),
    ({"closed": "yes", "session": "s"}, "bad_closed"),
    ({"closed": True}, "closed_without_session"),
])
def test_a_bad_hint_reaching_the_runtime_is_refused_and_counted_and_changes_nothing(fields, reason):
    with runtime() as kv:
        keys = [("k", i) for i in range(4)]
        store(kv, keys)
        assert kv.apply_hint(keys, **fields) is False
        assert kv.snapshot()["hints"] == {f"refused:{reason}": 1}
        assert kv.num_retained() == 0
        store(kv, [("next", 0)])  # the runtime goes on serving
        assert kv.where(keys + [("next", 0)]) == [TierKind.DRAM] * 5


def test_hints_off_in_the_config_are_ignored_and_counted():
    dram = TierConfig(TierKind.DRAM, SLOTS * LAYOUT.block_bytes)
    config = KVTierConfig(model="kvtier-tiny", tiers=(dram,), hints=HintsConfig(enabled=False))
    with KVTier(config, layout=LAYOUT) as kv:
        store(kv, [("k", 0)])
        assert kv.apply_hint([("k", 0)], session="s", retain_s=60) is False
        assert kv.num_retained() == 0 and kv.snapshot()["hints"] == {"disabled": 1}


# ---- the vLLM connector's scheduler half: malformed kv_transfer_params ----------------------------



MALFORMED = [
    (["kvtier", "retain_s"], HintRefusal.NOT_A_MAPPING),
    ({"kvtier": "keep it"}, HintRefusal.NOT_A_MAPPING),
    ({"kvtier": {"retain_s": 300, "pin": True}}, HintRefusal.UNKNOWN_FIELD),
    ({"kvtier": {}}, HintRefusal.EMPTY),
    ({"kvtier": {"retain_s": "forever"}}, HintRefusal.BAD_RETAIN_S),
    ({"kvtier": {"retain_s": float("inf")}}, HintRefusal.BAD_RETAIN_S),
    ({"kvtier": {"session": "é" * 3}}, HintRefusal.BAD_SESSION),
    ({"kvtier": {"session": None, "retain_s": 5}}, HintRefusal.BAD_SESSION),
    ({"kvtier": {"closed": 1, "session": "s"}}, HintRefusal.BAD_CLOSED),
    ({"kvtier": {"closed": True}}, HintRefusal.CLOSED_WITHOUT_SESSION),
]


def test_malformed_hints_are_refused_by_reason_and_the_requests_are_served_as_without_them(tmp_path, tiny_model):
    from kvtier.integrations.vllm.scheduler import KeyDirectory, ScheduledRequest, SchedulerSide
    from kvtier.integrations.vllm.settings import EngineFacts, read_settings
    from support.vllm import FakeRequest, BLOCK, LAYER_NAMES, PAGE_BYTES, _yaml

    facts = EngineFacts(model_id="tiny", block_size=BLOCK, kv_dtype="float32", layer_names=LAYER_NAMES,
                        page_bytes=PAGE_BYTES, device_type="cpu", kv_role="kv_both")
    settings = read_settings({"kvtier_config": str(_yaml(tmp_path / "kv.yaml", tiny_model,
                                                          {"dram": {"capacity": "4MiB"}}))}, facts)
    side = SchedulerSide(settings, KeyDirectory(settings, 100))
    tokens = list(range(3 * BLOCK + 5))
    for i, (params, _) in enumerate(MALFORMED):
        side.track(FakeRequest(f"r{i}", tokens, params))
    assert side.hint_reader.refused == {r: sum(1 for _, why in MALFORMED if why is r) for _, r in MALFORMED}
    assert side.hint_reader.num_read == 0
    tables = {f"r{i}": list(range(100 + 10 * i, 104 + 10 * i)) for i in range(len(MALFORMED))}
    plan = side.plan_step([ScheduledRequest(r, len(tokens)) for r in tables], tables.__getitem__)
    assert [s.req_id for s in plan.stores] == ["r0"], "keyed and stored as without a hint (once: same tokens)"
    assert plan.hints == [], "no hint reached a worker"
