"""Two SGLang storage backends in two processes on one pool node (SGLang's real `HiCacheStorage`
ABC from its wheel, as in test_sglang_storage.py): pages the first backs up, the second finds
(`batch_exists`) and loads into its own host pool byte for byte, through `KVTier`'s shared pool
tier alone. Cost: a few seconds (a node subprocess and one writer subprocess).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.config import CacheMode, KVTierConfig, TierConfig, TransferConfig
from kvtier.model.layout import BlockLayout
from kvtier.pool.node.process import running_node
from kvtier.runtime import KVTier
from kvtier.tiers.base import TierKind
from support.runtime import WAIT_S
from support.sglang import PAGE_BYTES, PAGE_TOKENS, FakeHostPool, find_wheel, keys, same_bytes, storage_config

pytestmark = [pytest.mark.slow,  # seconds per test: kept out of `make test-fast`
              pytest.mark.skipif(find_wheel() is None, reason="no sglang-0.5.23 wheel: run `make venv`")]

D, P = TierKind.DRAM, TierKind.POOL
LAYOUT = BlockLayout(PAGE_TOKENS, (PAGE_BYTES,))

# The first SGLang process: extracts the ABC's modules as the `sgl` fixture does, backs up pages
# 0..3 of its host pool (seed 0) under keys(4) and exits. argv: tests dir, node address, scratch dir.
FIRST = r"""
import importlib, json, sys, zipfile
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/integrations")
from support.sglang import SGLANG_FILES, MODULE, FakeHostPool, find_wheel, keys, storage_config
with zipfile.ZipFile(find_wheel()) as wheel:
    for name in SGLANG_FILES:
        wheel.extract(name, sys.argv[3])
sys.path.insert(0, sys.argv[3])
sgl = type("SGLang", (), {"storage": importlib.import_module("sglang.srt.mem_cache.hicache_storage"),
                          "adapter": importlib.import_module(MODULE)})
from test_sglang_shared_pool import runtime
host = FakeHostPool(seed=0)
with runtime(sys.argv[2]) as kv:
    store = sgl.adapter.KVTierHiCacheStorage(storage_config(sgl), {}, runtime=kv)
    store.register_mem_pool_host(host)
    ok = store.batch_set_v1(keys(4), host.indices(range(4)))
    kv.quiesce(30)
    print(json.dumps({"ok": ok, **kv.snapshot()}, default=str))
"""


def runtime(address: str) -> KVTier:
    """DRAM for 2 pages, a pool share of 16, inclusive: every page backed up is on the pool too."""
    marks = {"high_watermark": 1.0, "low_watermark": 1.0}
    return KVTier(KVTierConfig(model="kvtier-tiny", mode=CacheMode.INCLUSIVE, tiers=(
        TierConfig(D, 2 * PAGE_BYTES, **marks),
        TierConfig(P, 16 * PAGE_BYTES, nodes=(address,), timeout_s=WAIT_S, reconnect_s=0, **marks)),
        transfer=TransferConfig(io_workers=2, chunk_bytes=0)), layout=LAYOUT)


def test_a_second_sglang_process_loads_the_pages_the_first_backed_up(sgl, tmp_path):
    tests = Path(__file__).resolve().parents[1]
    with running_node(capacity="4MiB") as node:
        done = subprocess.run([sys.executable, "-c", FIRST, str(tests), node.address, str(tmp_path / "sgl")],
                              capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(tests)})
        assert done.returncode == 0, done.stderr[-4000:]
        assert json.loads(done.stdout.splitlines()[-1])["ok"] == [True] * 4

        theirs = FakeHostPool(seed=0)  # what the first process backed up
        mine = FakeHostPool(seed=1)  # this process's host pool: other bytes until loaded
        with runtime(node.address) as kv:
            store = sgl.adapter.KVTierHiCacheStorage(storage_config(sgl), {}, runtime=kv)
            store.register_mem_pool_host(mine)
            assert store.batch_exists(keys(6)) == 4  # the fifth and sixth were never stored
            targets = [8, 9, 10, 11]
            assert store.batch_get_v1(keys(4), mine.indices(targets)) == [True] * 4
            for src, dst in zip(range(4), targets):
                assert same_bytes(mine.get_data_page(dst * PAGE_TOKENS), theirs.get_data_page(src * PAGE_TOKENS))
            assert kv.snapshot()["shared"]["adopted"] == 4
