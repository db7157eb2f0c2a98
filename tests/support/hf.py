"""The Hugging Face tests' shared pieces: a runtime for a model, prompts, generation and comparison."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from kvtier.config import KVTierConfig, PrefetchConfig, TierConfig, TransferConfig
from kvtier.integrations.hf.tiny_model import build_tiny_llama
from kvtier.model.layout import BlockLayout
from kvtier.runtime import KVTier
from kvtier.tiers.base import Tier
from kvtier.tiers.ssd import SSDTier
from support.runtime import D, H, S, WAIT_S


BLOCK_TOKENS = 4
NEW_TOKENS = 8
GEN = {"do_sample": False, "max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS,
       "return_dict_in_generate": True, "output_logits": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


class ProbeTier(Tier):
    """Delegates to a real SSD tier; can hold reads from a byte offset on, and corrupt reads."""

    def __init__(self, inner: Tier) -> None:
        self.inner, self.kind, self.medium = inner, inner.kind, inner.medium
        self.slot_bytes, self.num_slots = inner.slot_bytes, inner.num_slots
        self.gate, self.held = threading.Event(), threading.Event()
        self.gate.set()
        self.gate_from: int | None = None
        self.corrupt_next = 0  # the next n reads come back with a flipped byte
        self._lock = threading.Lock()

    def read(self, slot, dst, offset=0):
        if self.gate_from is not None and offset >= self.gate_from:
            self.held.set()
            self.gate.wait(WAIT_S)
        self.inner.read(slot, dst, offset)
        with self._lock:
            corrupt, self.corrupt_next = self.corrupt_next > 0, max(0, self.corrupt_next - 1)
        if corrupt:
            dst.bitwise_not_()  # every byte: undetected, it would change the tokens

    def write(self, slot, src, offset=0):
        self.inner.write(slot, src, offset)

    def close(self):
        self.gate.set()
        self.inner.close()


def kvtier(model_dir: Path, tmp_path: Path, hbm: int = 2, dram: int = 4, ssd: int = 64, kv_dtype: str = "fp32",
           probe: bool = False) -> KVTier:
    """Tiers of a few blocks each (watermarks off so placements are exact), copied layer by layer."""
    layout = _layout(model_dir, kv_dtype)
    block = layout.block_bytes
    marks = {"high_watermark": 1.0, "low_watermark": 1.0}
    config = KVTierConfig(
        model=str(model_dir), kv_dtype=kv_dtype, block_tokens=BLOCK_TOKENS, promote_to=D,
        tiers=(TierConfig(H, hbm * block, device="cpu", **marks), TierConfig(D, dram * block, **marks),
               TierConfig(S, ssd * block, path=tmp_path / "ssd", o_direct=False, **marks)),
        transfer=TransferConfig(io_workers=2, chunk_bytes=0), prefetch=PrefetchConfig(D, 8 * block))
    tiers = None
    if probe:
        (tmp_path / "ssd").mkdir(exist_ok=True)
        tiers = {S: ProbeTier(SSDTier(tmp_path / "ssd", ssd * block, block, num_files=2, direct=False))}
    return KVTier(config, tiers=tiers)


def _layout(model_dir: Path, kv_dtype: str) -> BlockLayout:
    from kvtier.model.catalog import resolve_model

    return resolve_model(str(model_dir), kv_dtype=kv_dtype).block_layout(BLOCK_TOKENS)


def prompts(prefix_tokens: int = 90) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts `[1, T]` sharing `prefix_tokens` tokens (22 full blocks for 90), then differing."""
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(3, 500, (prefix_tokens,), generator=g)
    a = torch.cat([prefix, torch.randint(3, 500, (7,), generator=g)])
    b = torch.cat([prefix, torch.randint(3, 500, (5,), generator=g)])
    return a[None], b[None]


def assert_same(out, ref, exact_logits: bool = False) -> None:
    """Same greedy tokens; logits equal (exact) or within float32 reordering noise."""
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.logits) == len(ref.logits) == NEW_TOKENS
    for got, want in zip(out.logits, ref.logits):
        if exact_logits:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def default_generate(model, ids):
    return model.generate(ids, **GEN)
