"""Wrong KV is never served as good: what a read below DRAM verifies binds the key to the bytes.

Attacks: the persistent SSD journal's records with their keys swapped (what a misdirected write or
an offset bug leaves behind), and a slot's bytes copied under another block's slot. Before the
checksums were seeded with the key, a record whose key was moved still verified and the load
returned another block's KV as good. Cost: about 2 s.
"""

from __future__ import annotations

import os
import struct

import torch

from kvtier.observing.stats import DropReason
from kvtier.tiers.base import TierKind
from kvtier.tiers.ssd_journal import HEADER_BYTES, JOURNAL_NAME
from support.persistence import KEYS, data, persistent
from support.runtime import BLOCK, LAYOUT, WAIT_S

S = TierKind.SSD
RECORD_BYTES = 24 + 8 * LAYOUT.num_layers  # valid marker, layers, key, then one checksum per layer


def _stored_on_ssd(tmp_path) -> dict[bytes, int]:
    """Stores KEYS straight into the persistent SSD tier; returns key -> journal slot."""
    with persistent(tmp_path) as kv:
        assert kv.store(KEYS, data(KEYS), target=S).wait(WAIT_S)
        kv.quiesce(WAIT_S)
        assert kv.where(KEYS) == [S] * len(KEYS)
    path = tmp_path / "ssd" / JOURNAL_NAME
    raw = path.read_bytes()
    slots = {}
    for slot in range((len(raw) - HEADER_BYTES) // RECORD_BYTES):
        at = HEADER_BYTES + slot * RECORD_BYTES
        key = raw[at + 8: at + 24]
        if key in KEYS:
            slots[key] = slot
    assert set(slots) == set(KEYS)
    return slots


def _load(kv, keys) -> tuple[torch.Tensor, object]:
    out = torch.zeros(len(keys), BLOCK, dtype=torch.uint8)
    handle = kv.load(keys, out)
    handle.wait(WAIT_S)
    # The promotions into DRAM the load read through have handles of their own: a failed one counts
    # its checksum error when it is applied, which may come just after the load's handle is done.
    kv.quiesce(WAIT_S)
    return out, handle


def test_swapped_journal_keys_are_misses_not_another_blocks_kv(tmp_path):
    slots = _stored_on_ssd(tmp_path)
    a, b = KEYS[0], KEYS[1]
    path = tmp_path / "ssd" / JOURNAL_NAME
    fd = os.open(path, os.O_RDWR)
    try:  # swap the keys of two records, leave their checksums where they were
        for key, other in ((a, b), (b, a)):
            os.pwrite(fd, other, HEADER_BYTES + slots[key] * RECORD_BYTES + 8)
    finally:
        os.close(fd)
    with persistent(tmp_path) as kv:
        assert kv.lookup([a]) == 1, "the swapped records are adopted: only a read can tell"
        out, handle = _load(kv, KEYS)
        assert set(handle.failed) == {a, b}, "both swapped blocks are misses"
        good = [i for i, k in enumerate(KEYS) if k not in (a, b)]
        assert torch.equal(out[good], data(KEYS)[good]), "the untouched blocks still load"
        for i in (0, 1):
            assert not torch.equal(out[i], data([KEYS[1 - i]])[0]) or i in handle.failed
        assert kv.stats.checksum_errors == 2
        assert kv.stats.dropped[DropReason.CHECKSUM] == 2, "each bad copy is discarded and counted"
        assert kv.lookup([a]) == 0 and kv.lookup([b]) == 0


def test_a_block_copied_into_another_blocks_slot_is_a_miss(tmp_path):
    """A misdirected write: block A's slot holds block B's bytes *and* B's layer checksums."""
    slots = _stored_on_ssd(tmp_path)
    a, b = KEYS[0], KEYS[1]
    path = tmp_path / "ssd" / JOURNAL_NAME
    fd = os.open(path, os.O_RDWR)
    try:  # A's record gets B's checksums: the bytes in A's slot are made to match "their" record
        b_sums = os.pread(fd, 8 * LAYOUT.num_layers, HEADER_BYTES + slots[b] * RECORD_BYTES + 24)
        os.pwrite(fd, b_sums, HEADER_BYTES + slots[a] * RECORD_BYTES + 24)
    finally:
        os.close(fd)
    with persistent(tmp_path) as kv:
        ssd = kv.tiers[S]
        block = torch.zeros(BLOCK, dtype=torch.uint8)
        ssd.read(slots[b], block)
        ssd.write(slots[a], block)  # A's slot now holds B's bytes, and A's record B's checksums
        out, handle = _load(kv, [a, b])
        assert a in handle.failed and b not in handle.failed
        assert torch.equal(out[1], data([b])[0])
        assert kv.stats.checksum_errors == 1


def test_layers_read_from_each_others_offsets_fail(tmp_path):
    """Two layers of one block swapped on disk (an offset bug) fail too: the seed names the layer."""
    slots = _stored_on_ssd(tmp_path)
    a = KEYS[2]
    with persistent(tmp_path) as kv:
        ssd = kv.tiers[S]
        n = LAYOUT.offsets[1]
        block = torch.zeros(BLOCK, dtype=torch.uint8)
        ssd.read(slots[a], block)
        layer0, layer1 = block[:n].clone(), block[n: 2 * n].clone()
        if torch.equal(layer0, layer1):
            raise AssertionError("test data: two layers must differ")
        block[:n], block[n: 2 * n] = layer1, layer0
        ssd.write(slots[a], block)
        # Make the record's checksums follow the swapped layers, as an offset bug in both would.
        path = tmp_path / "ssd" / JOURNAL_NAME
        at = HEADER_BYTES + slots[a] * RECORD_BYTES + 24
        raw = path.read_bytes()
        s0, s1 = struct.unpack_from("<2Q", raw, at)
        fd = os.open(path, os.O_RDWR)
        try:
            os.pwrite(fd, struct.pack("<2Q", s1, s0), at)
        finally:
            os.close(fd)
    with persistent(tmp_path) as kv:
        _, handle = _load(kv, [a])
        assert a in handle.failed
