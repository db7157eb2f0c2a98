"""The persistence tests' shared pieces: keys, a persistent runtime, filling it."""

from __future__ import annotations

from dataclasses import replace

import torch

from kvtier.runtime import KVTier
from support.runtime import BLOCK, LAYOUT, WAIT_S, S, config


KEYS = [bytes([i]) * 16 for i in range(1, 6)]  # 16-byte keys, as kvtier.model.keys.block_keys makes


def persistent(tmp_path, layout=LAYOUT, **kw) -> KVTier:
    cfg = config(tmp_path, **kw)
    tiers = tuple(replace(t, persist=True) if t.kind is S else t for t in cfg.tiers)
    (tmp_path / "ssd").mkdir(exist_ok=True)
    return KVTier(replace(cfg, tiers=tiers), layout=layout)


def data(keys) -> torch.Tensor:
    return torch.stack([torch.randint(0, 256, (BLOCK,), dtype=torch.uint8,
                                      generator=torch.Generator().manual_seed(k[0])) for k in keys])


def fill(kv, keys) -> None:
    for key in keys:  # one at a time: the first ones are demoted down into the SSD tier
        assert kv.store([key], data([key])).wait(WAIT_S)
        kv.quiesce(WAIT_S)
