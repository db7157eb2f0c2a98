"""Two transformers processes on one pool node: the second hits the prefix the first computed,
through `KVTier`'s shared pool tier alone (no engine-specific pool code), and its output is the
default cache's. Cost: a few seconds (a tiny Llama, a node subprocess, one writer subprocess).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from kvtier.config import CacheMode, KVTierConfig, TierConfig, TransferConfig
from kvtier.integrations.hf.adapter import HFKVTier
from kvtier.model.keys import Namespace, block_keys
from kvtier.pool.node.process import running_node
from kvtier.runtime import KVTier
from kvtier.tiers.base import TierKind
from support.hf import BLOCK_TOKENS, GEN, NEW_TOKENS, _layout, assert_same, default_generate, prompts
from support.runtime import WAIT_S

D, P = TierKind.DRAM, TierKind.POOL
pytestmark = pytest.mark.slow  # seconds per test (node and writer subprocesses): kept out of `make test-fast`
NS = Namespace(model="kvtier-test/tiny-llama", kv_dtype="fp32", block_tokens=BLOCK_TOKENS)

# The first engine: its own process, its own KVTier over DRAM and the pool (stores written through
# to the pool); generates prompt A and exits. argv: model dir, node address.
FIRST_ENGINE = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM
sys.path.insert(0, sys.argv[3])
from test_hf_shared_pool import GEN, NS, a_runtime, prompts
from kvtier.integrations.hf.adapter import HFKVTier
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
with a_runtime(sys.argv[1], sys.argv[2]) as kv:
    run = HFKVTier(model, kv, NS).generate(prompts()[0], **GEN)
    kv.quiesce(30)
    print(json.dumps({"stored": run.num_stored_blocks, "cached": run.num_cached_tokens, **kv.snapshot()}, default=str))
"""


def a_runtime(model_dir, address: str) -> KVTier:
    """DRAM for 8 blocks and a pool share of 64, inclusive: every stored block is on the pool too."""
    layout = _layout(model_dir, "fp32")
    block = layout.block_bytes
    marks = {"high_watermark": 1.0, "low_watermark": 1.0}
    return KVTier(KVTierConfig(model=str(model_dir), kv_dtype="fp32", block_tokens=BLOCK_TOKENS,
                               mode=CacheMode.INCLUSIVE, promote_to=D,
                               tiers=(TierConfig(D, 8 * block, **marks),
                                      TierConfig(P, 64 * block, nodes=(address,), timeout_s=WAIT_S, reconnect_s=0,
                                                 **marks)),
                               transfer=TransferConfig(io_workers=2, chunk_bytes=0)), layout=layout)


def test_a_second_process_hits_the_prefix_the_first_computed(model, model_dir):
    from pathlib import Path

    with running_node(capacity="16MiB") as node:
        here = str(Path(__file__).parent)
        env_path = f"{Path(__file__).parents[1]}"
        done = subprocess.run([sys.executable, "-c", FIRST_ENGINE, str(model_dir), node.address, here],
                              capture_output=True, text=True, timeout=300,
                              env={**__import__("os").environ, "PYTHONPATH": env_path})
        assert done.returncode == 0, done.stderr[-4000:]
        first = json.loads(done.stdout.splitlines()[-1])
        a, b = prompts()
        assert first["cached"] == 0 and first["stored"] == (a.shape[1] + NEW_TOKENS - 1) // BLOCK_TOKENS

        with a_runtime(model_dir, node.address) as kv:
            hf = HFKVTier(model, kv, NS)
            prefix = block_keys(hf.namespace, b[0])[:22]  # the 22 full blocks of the shared 90 tokens
            assert kv.where(prefix) == [None] * 22  # nothing of it in this process before the lookup
            second = hf.generate(b, **GEN)
            assert second.num_cached_tokens == 88
            assert_same(second.output, default_generate(model, b))
            snap = kv.snapshot()
            assert snap["shared"]["adopted"] >= 22 and snap["hits"].get("pool", 0) >= 22
            assert torch.equal(second.output.sequences[0, :b.shape[1]], b[0])

        # The same model with one weight changed (a fine-tune under the same name): its keys name
        # other weights, so the pool's blocks are never taken for its KV.
        changed = copy.deepcopy(model)
        with torch.no_grad():
            next(changed.parameters()).add_(1e-3)
        with a_runtime(model_dir, node.address) as kv:
            third = HFKVTier(changed, kv, NS).generate(b, **GEN)
            assert third.num_cached_tokens == 0 and "adopted" not in kv.snapshot()["shared"]
            assert_same(third.output, default_generate(changed, b))
