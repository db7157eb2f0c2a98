"""A persistent SSD tier: blocks outlive the process that stored them (cost: ~5 s).

The slabs keep stable names and a journal records (key, per-layer checksums) per slot; a later
process adopts those blocks. Reads are still verified, so a stale or corrupted record is a miss.
"""

from __future__ import annotations

import errno
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import torch

from kvtier.errors import TierIOError
from kvtier.model.layout import BlockLayout
from kvtier.runtime import KVTier
from kvtier.observing.stats import DropReason
from kvtier.tiers.base import TierKind
from support.runtime import BLOCK, LAYOUT, WAIT_S, config

from support.persistence import KEYS, S, data, fill, persistent










@pytest.mark.slow
def test_blocks_survive_a_restart_and_a_new_process(tmp_path):
    with persistent(tmp_path) as kv:
        fill(kv, KEYS[:2])
        assert kv.store(KEYS[2:], data(KEYS[2:]), target=S).wait(WAIT_S)
        kv.quiesce(WAIT_S)
        on_ssd = [k for k, t in zip(KEYS, kv.where(KEYS)) if t is S]
    assert len(on_ssd) >= 3
    with persistent(tmp_path) as kv:
        assert kv.where(on_ssd) == [S] * len(on_ssd), "adopted from the journal"
        out = torch.zeros(len(on_ssd), BLOCK, dtype=torch.uint8)
        handle = kv.load(on_ssd, out)
        assert handle.wait(WAIT_S) and torch.equal(out, data(on_ssd))
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
        from test_persistence import persistent, data, KEYS
        from pathlib import Path
        with persistent(Path({str(tmp_path)!r})) as kv:
            keys = [k for k in KEYS if kv.lookup([k])]
            out = torch.zeros(len(keys), kv.layout.block_bytes, dtype=torch.uint8)
            ok = kv.load(keys, out).wait(30) and torch.equal(out, data(keys))
            print(len(keys), ok)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    found, ok = result.stdout.split()
    assert int(found) >= 1 and ok == "True", "a fresh process serves what an earlier one stored"


def test_directory_in_use_by_another_runtime_is_refused(tmp_path):
    with persistent(tmp_path):
        with pytest.raises(TierIOError, match="in use by another kvtier process") as info:
            persistent(tmp_path)
        assert info.value.errno == errno.EBUSY


def test_another_layout_starts_empty(tmp_path):
    with persistent(tmp_path) as kv:
        assert kv.store(KEYS[:2], data(KEYS[:2]), target=S).wait(WAIT_S)
    other = BlockLayout.uniform(block_tokens=4, num_layers=2, layer_bytes=2 * 4096)  # same bytes, 2 layers
    with persistent(tmp_path, layout=other) as kv:
        assert kv.lookup(KEYS[:1]) == 0 and kv.usage()["ssd"]["used"] == 0


def test_block_corrupted_while_stopped_is_a_counted_miss(tmp_path):
    with persistent(tmp_path, promote_to=None) as kv:
        assert kv.store(KEYS[:1], data(KEYS[:1]), target=S).wait(WAIT_S)
        path, = {p for p in kv.tiers[S].paths if p.endswith("-0.slab")}
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 8)
    with persistent(tmp_path, promote_to=None) as kv:
        assert kv.lookup(KEYS[:1]) == 1
        out = torch.zeros(1, BLOCK, dtype=torch.uint8)
        handle = kv.load(KEYS[:1], out)
        assert handle.wait(WAIT_S) is False and handle.failed[KEYS[0]].stage == "verify"
        assert kv.stats.dropped[DropReason.CHECKSUM] == 1 and kv.lookup(KEYS[:1]) == 0
