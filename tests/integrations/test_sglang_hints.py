"""Retention hints through the SGLang storage backend (`KVTierHiCacheStorage.apply_hint`), against
the real ABC from the sglang 0.5.23 wheel and real tiers (DRAM last, where leases hold). Cost: ~2 s.
"""

from __future__ import annotations

import pytest

from kvtier.config import KVTierConfig, TierConfig, TransferConfig
from kvtier.integrations.hints import HintRefusal
from kvtier.model.layout import BlockLayout
from kvtier.runtime import KVTier
from kvtier.tiers.base import TierKind

from support.sglang import WHEEL_DIR, FakeHostPool, PAGE_BYTES, PAGE_TOKENS, find_wheel, keys, page, storage_config

pytestmark = pytest.mark.skipif(find_wheel() is None, reason=f"no sglang-0.5.23 wheel in {WHEEL_DIR}")

LAYOUT = BlockLayout(PAGE_TOKENS, (PAGE_BYTES,))
SLOTS = 16


@pytest.fixture
def store(sgl):
    dram = TierConfig(TierKind.DRAM, SLOTS * PAGE_BYTES, high_watermark=1.0, low_watermark=1.0)
    with KVTier(KVTierConfig(model="kvtier-tiny", tiers=(dram,), transfer=TransferConfig(io_workers=1)),
                layout=LAYOUT) as runtime:
        backend = sgl.adapter.KVTierHiCacheStorage(storage_config(sgl), {}, runtime=runtime)
        backend.register_mem_pool_host(FakeHostPool())
        yield backend


def test_a_hint_leases_the_pages_backed_up_and_a_close_ends_it(store):
    ks = keys(6)
    assert store.batch_set(ks, [page(i) for i in range(6)]) is True
    assert store.apply_hint(ks, {"kvtier": {"retain_s": 300, "session": "s-1"}}, tenant="acme")
    assert store.runtime.num_retained("acme") == SLOTS // 4, "a tenant's budget: a quarter of the last tier"
    assert store.runtime.snapshot()["hints"] == {"applied": 1, "over_budget": 2}
    assert store.apply_hint(ks, {"kvtier": {"session": "s-1", "closed": True}})
    assert store.runtime.num_retained() == 0


def test_a_malformed_hint_is_refused_and_counted_and_pages_are_served(store):
    ks = keys(2)
    assert store.batch_set(ks, [page(i) for i in range(2)]) is True
    assert store.apply_hint(ks, {"kvtier": {"session": "s", "pin": True}}) is False
    assert store.apply_hint(ks, "retain everything") is False
    assert store.hints.refused == {HintRefusal.UNKNOWN_FIELD: 1, HintRefusal.NOT_A_MAPPING: 1}
    assert not store.runtime.snapshot()["hints"] and store.batch_exists(ks) == 2


def test_a_hint_before_the_host_pool_is_registered_is_counted_not_raised(sgl):
    dram = TierConfig(TierKind.DRAM, SLOTS * PAGE_BYTES)
    with KVTier(KVTierConfig(model="kvtier-tiny", tiers=(dram,)), layout=LAYOUT) as runtime:
        backend = sgl.adapter.KVTierHiCacheStorage(storage_config(sgl), {}, runtime=runtime)
        assert backend.apply_hint(keys(1), {"kvtier": {"retain_s": 5}}) is False
        assert backend.errors["not_attached"] == 1
