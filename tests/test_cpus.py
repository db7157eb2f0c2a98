"""Where kvtier's threads run: `kvtier.moving.cpus`, `transfer.cpus`, and the vLLM worker's default.

vLLM's CPU worker binds its compute threads, and every thread started after them, to the cores it
computes on. kvtier's transfer threads then took those cores from the forward pass (seen under
`vllm serve`: every kvtier thread of the worker on CPU 0 with the OpenMP thread, CPU 1 idle).
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from kvtier.config import KVTierConfig, TierConfig, TransferConfig, config_from_dict
from kvtier.moving.cpus import allowed_cpus, pin_thread, spare_cpus
from kvtier.errors import ConfigError
from kvtier.model.layout import BlockLayout
from kvtier.runtime import KVTier
from kvtier.tiers.base import TierKind

CPUS = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to bind a thread to one of them")
LAYOUT = BlockLayout.uniform(16, 2, 2048)


def in_thread(fn):
    """Runs `fn` in a new thread (binding it leaves this one alone); returns its result."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("v", fn()))
    t.start()
    t.join(30)
    return out["v"]


def test_an_unbound_thread_has_no_spare_cpus() -> None:
    assert in_thread(spare_cpus) is None  # the test process is not bound: nothing to keep off


@needs_two
def test_a_thread_bound_to_one_core_is_told_the_others() -> None:
    def bound():
        os.sched_setaffinity(0, {CPUS[0]})
        return spare_cpus()

    assert in_thread(bound) == tuple(c for c in sorted(allowed_cpus()) if c != CPUS[0])


def test_pin_thread_binds_and_a_refusal_is_only_logged(caplog) -> None:
    def pinned():
        pin_thread([CPUS[-1]])
        return os.sched_getaffinity(0)

    assert in_thread(pinned) == {CPUS[-1]}
    assert in_thread(lambda: (pin_thread([10_000]), os.sched_getaffinity(0))[1]) == set(CPUS)
    assert "cannot bind it to [10000]" in caplog.text


@needs_two
def test_transfer_threads_run_on_transfer_cpus_whatever_the_caller_is_bound_to(tmp_path) -> None:
    tiers = (TierConfig(TierKind.DRAM, 4 * LAYOUT.block_bytes, high_watermark=1.0, low_watermark=1.0),
             TierConfig(TierKind.SSD, 8 * LAYOUT.block_bytes, path=tmp_path, high_watermark=1.0, low_watermark=1.0))
    config = KVTierConfig(model="kvtier-tiny", tiers=tiers,
                          transfer=TransferConfig(io_workers=2, inline_bytes=0, cpus=(CPUS[1],)))

    def run():
        os.sched_setaffinity(0, {CPUS[0]})  # as vLLM binds its worker's main thread
        with KVTier(config, layout=LAYOUT) as kv:
            keys = [b"k%d" % i for i in range(6)]  # more than DRAM holds: demotions to SSD as well
            assert kv.store(keys, torch.ones(6, LAYOUT.block_bytes, dtype=torch.uint8), background=True).wait(30)
            kv.quiesce(30)
            return {t.name: os.sched_getaffinity(t.native_id) for t in threading.enumerate()
                    if t.name.startswith("kvtier")}

    seen = in_thread(run)
    assert seen and any(name.startswith("kvtier-bg") for name in seen)
    assert all(cpus == {CPUS[1]} for cpus in seen.values()), seen


@pytest.mark.parametrize("value,accepted", [([0], (0,)), ([1, 0], (1, 0)), (None, None)])
def test_transfer_cpus_in_yaml(value, accepted) -> None:
    raw = {"model": "kvtier-tiny", "tiers": {"dram": {"capacity": "1MiB"}}, "transfer": {"cpus": value}}
    assert config_from_dict(raw).transfer.cpus == accepted


@pytest.mark.parametrize("value", ["0,1", 1, [], [-1], [True], ["a"]])
def test_bad_transfer_cpus_are_refused_naming_the_field(value) -> None:
    raw = {"model": "kvtier-tiny", "tiers": {"dram": {"capacity": "1MiB"}}, "transfer": {"cpus": value}}
    with pytest.raises(ConfigError, match=r"transfer\.cpus"):
        config_from_dict(raw)


@needs_two
def test_the_vllm_worker_moves_transfer_threads_off_the_cores_it_is_bound_to() -> None:
    from kvtier.integrations.vllm.backends import with_transfer_cpus

    config = config_from_dict({"model": "kvtier-tiny", "tiers": {"dram": {"capacity": "1MiB"}}})
    chosen = config_from_dict({"model": "kvtier-tiny", "tiers": {"dram": {"capacity": "1MiB"}},
                               "transfer": {"cpus": [CPUS[0]]}})

    def bound():
        os.sched_setaffinity(0, {CPUS[0]})
        return with_transfer_cpus(config).transfer.cpus, with_transfer_cpus(chosen).transfer.cpus

    assert in_thread(bound) == (tuple(c for c in sorted(allowed_cpus()) if c != CPUS[0]), (CPUS[0],))
    assert in_thread(lambda: with_transfer_cpus(config)) is config  # unbound (a GPU worker): as it was
