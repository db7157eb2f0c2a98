"""The runtime tests' shared pieces: a small layout, configs, a gated tier, store and load helpers."""

from __future__ import annotations

import threading

import pytest
import torch

from kvtier.config import CacheMode, KVTierConfig, PrefetchConfig, TierConfig, TransferConfig
from kvtier.errors import TierIOError
from kvtier.model.layout import BlockLayout
from kvtier.runtime import KVTier
from kvtier.tiers.base import Tier, TierKind
from kvtier.tiers.ssd import SSDTier


H, D, S = TierKind.HBM, TierKind.DRAM, TierKind.SSD
LAYOUT = BlockLayout.uniform(block_tokens=4, num_layers=4, layer_bytes=4096)
BLOCK = LAYOUT.block_bytes
WAIT_S = 30  # a safety net against hangs, never a measurement


class GatedTier(Tier):
    """Delegates to a real tier; can hold reads/writes from layer `gate_layer` on, count, or fail."""

    def __init__(self, inner: Tier, gate_layer: int = 1) -> None:
        self.inner, self.kind, self.medium = inner, inner.kind, inner.medium
        self.slot_bytes, self.num_slots = inner.slot_bytes, inner.num_slots
        self.gate_from = LAYOUT.offsets[gate_layer]
        self.read_gate, self.write_gate = threading.Event(), threading.Event()
        self.read_gate.set()
        self.write_gate.set()
        self.reads: list[tuple[int, int]] = []
        self.fail_writes: OSError | None = None
        self._lock = threading.Lock()

    def read(self, slot, dst, offset=0):
        with self._lock:
            self.reads.append((slot, offset))
        if offset >= self.gate_from:
            self.read_gate.wait(WAIT_S)
        self.inner.read(slot, dst, offset)

    def write(self, slot, src, offset=0):
        if self.fail_writes is not None:
            raise TierIOError(self.fail_writes.errno, f"injected: {self.fail_writes}")
        if offset >= self.gate_from:
            self.write_gate.wait(WAIT_S)
        self.inner.write(slot, src, offset)

    def view(self, slot, offset, length):
        return self.inner.view(slot, offset, length)

    def close(self):
        self.read_gate.set()
        self.write_gate.set()
        self.inner.close()


def config(tmp_path, hbm=2, dram=3, ssd=6, mode=CacheMode.EXCLUSIVE, promote_to=D, marks=(1.0, 1.0), chunk_bytes=0,
           inline_bytes=0):
    """Tiers of a few blocks each; watermarks off so placements are exact; per-layer copies; every
    batch on the engine's workers unless `inline_bytes` says otherwise."""
    tiers = [TierConfig(H, hbm * BLOCK, device="cpu", high_watermark=marks[0], low_watermark=marks[1]),
             TierConfig(D, dram * BLOCK, high_watermark=marks[0], low_watermark=marks[1]),
             TierConfig(S, ssd * BLOCK, path=tmp_path / "ssd", high_watermark=marks[0], low_watermark=marks[1])]
    return KVTierConfig(model="kvtier-tiny", tiers=tuple(t for t in tiers if t.capacity_bytes), mode=mode,
                        promote_to=promote_to, prefetch=PrefetchConfig(D, 64 * BLOCK),
                        transfer=TransferConfig(io_workers=2, chunk_bytes=chunk_bytes, inline_bytes=inline_bytes))


@pytest.fixture
def ssd(tmp_path):
    (tmp_path / "ssd-gated").mkdir()
    gated = GatedTier(SSDTier(tmp_path / "ssd-gated", 6 * BLOCK, BLOCK, num_files=2))
    yield gated
    gated.close()


def runtime(tmp_path, ssd_tier=None, **kw) -> KVTier:
    (tmp_path / "ssd").mkdir(exist_ok=True)
    return KVTier(config(tmp_path, **kw), layout=LAYOUT, tiers={S: ssd_tier} if ssd_tier else None)


def blocks(keys) -> torch.Tensor:
    """Deterministic, distinct bytes per key."""
    return torch.stack([torch.randint(0, 256, (BLOCK,), dtype=torch.uint8,
                                      generator=torch.Generator().manual_seed(k)) for k in keys])


def store(kv, keys, target=None):
    handle = kv.store(keys, blocks(keys), target)
    assert handle.wait(WAIT_S), handle.failed
    kv.quiesce(WAIT_S)


def load(kv, keys):
    out = torch.zeros(len(keys), BLOCK, dtype=torch.uint8)
    handle = kv.load(keys, out)
    handle.wait(WAIT_S)
    return out, handle
