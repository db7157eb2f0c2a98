"""Chain-aware ARC where it is used: the manager's `order_chain`, the runtime's YAML, `kvtier simulate`.

The policy's own contract and rules are in test_policy_contract.py. Here: the manager tells only
chain-aware tiers, and a tier told loses a chain's tail before its head (an LRU tier, told nothing,
its head); `policy: chain-arc` in a YAML file builds such a tier in `KVTier`, whose stores and loads
tell it; and on both Mooncake traces it hits more than ARC at 5 % and 10 % of the distinct blocks.
Cost: under a second without the traces; the trace replays (marked slow) take ~10 s on one core.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from kvtier.config import load_config
from kvtier.model.layout import BlockLayout
from kvtier.deciding.manager import TierManager
from kvtier.deciding.plans import TierSlots
from kvtier.policy import PolicyKind, make_policy
from kvtier.runtime import KVTier
from kvtier.simulate.replay import SimConfig, SimPolicy, VirtualTier, simulate
from kvtier.tiers.base import TierKind
from support.traces import mooncake, needs_traces

D, S = TierKind.DRAM, TierKind.SSD
WAIT_S = 30


def one_tier_manager(kind: PolicyKind, num_slots: int = 4) -> TierManager:
    return TierManager([TierSlots(D, num_slots, make_policy(kind, num_slots), high_watermark=1.0, low_watermark=1.0)])


@pytest.mark.parametrize("kind, survivors", [(PolicyKind.CHAIN_ARC, {"a", "b", "x", "y"}),
                                             (PolicyKind.LRU, {"b", "c", "x", "y"})])
def test_a_tier_told_the_chain_loses_its_tail_first_and_lru_is_not_told(kind, survivors):
    m = one_tier_manager(kind)
    m.store_now(["a", "b", "c"])
    m.order_chain(["a", "b", "c"])
    m.store_now(["x"])
    m.store_now(["y"])  # full: one victim
    assert {k for k in "abcxy" if m.where(k) is D} == survivors


def test_a_partial_tail_is_the_first_to_go():
    m = one_tier_manager(PolicyKind.CHAIN_ARC)
    m.store_now(["x"])
    m.store_now(["a", "b", "c"])
    m.order_chain(["a", "b", "c"], partial_tail=True)
    m.store_now(["y"])
    assert m.where("c") is None and all(m.where(k) is D for k in "abxy")


def test_order_chain_of_unknown_keys_changes_nothing():
    m = one_tier_manager(PolicyKind.CHAIN_ARC)
    m.store_now(["a", "b"])
    m.order_chain(["p", "q"], partial_tail=True)
    m.store_now(["c", "d", "e"])
    assert m.where("a") is None and all(m.where(k) is D for k in "bcde")


LAYOUT = BlockLayout.uniform(block_tokens=16, num_layers=2, layer_bytes=4096)


def runtime_from_yaml(tmp_path: Path, policy: str) -> KVTier:
    """A KVTier from YAML: DRAM of 3 blocks run by `policy`, demoting on demand to an SSD."""
    raw = {"model": "kvtier-tiny", "block_tokens": 16, "promote_to": "none", "tiers": {
        "dram": {"capacity": 3 * LAYOUT.block_bytes, "policy": policy, "high_watermark": 1.0, "low_watermark": 1.0},
        "ssd": {"capacity": 16 * LAYOUT.block_bytes, "path": str(tmp_path / "ssd"), "o_direct": False}}}
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump(raw))
    return KVTier(load_config(path), layout=LAYOUT)


def blocks(keys: list[int]) -> torch.Tensor:
    return torch.stack([torch.full((LAYOUT.block_bytes,), k, dtype=torch.uint8) for k in keys])


@pytest.mark.parametrize("policy, where", [("chain-arc", [D, D, S, S]), ("lru", [S, D, D, S])])
def test_yaml_selects_chain_arc_and_the_runtime_tells_it_each_store_and_load(tmp_path, policy, where):
    with runtime_from_yaml(tmp_path, policy) as kv:
        assert kv.store([1, 2, 3], blocks([1, 2, 3])).wait(WAIT_S)
        kv.quiesce(WAIT_S)
        # DRAM is full: the store evicts a victim, whose demotion is still in flight, so block 4
        # spills to the SSD too. chain-arc's victim is the chain's tail (3), LRU's its head (1).
        assert kv.store([4], blocks([4])).wait(WAIT_S)
        kv.quiesce(WAIT_S)
        assert kv.where([1, 2, 3, 4]) == where
        into = torch.zeros(2, LAYOUT.block_bytes, dtype=torch.uint8)
        handle = kv.load([1, 2], into)
        assert handle.wait(WAIT_S) and not handle.failed
        assert torch.equal(into, blocks([1, 2]))


@pytest.mark.slow
@needs_traces
@pytest.mark.parametrize("name", ["conversation", "synthetic"])
def test_chain_arc_hits_more_than_arc_and_saves_more_prefill_on_both_traces(name):
    trace = mooncake(name)
    for share in (0.05, 0.10):
        tier = (VirtualTier(TierKind.HBM, int(share * trace.num_unique_blocks), 1000.0),)
        arc, chain = (simulate(trace, SimConfig(tier, 1, policy=p)) for p in (SimPolicy.ARC, SimPolicy.CHAIN_ARC))
        assert chain["num_hits"] > arc["num_hits"], (name, share)
        assert chain["prefill"]["tokens_saved"] > arc["prefill"]["tokens_saved"], (name, share)
