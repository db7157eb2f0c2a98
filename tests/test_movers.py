"""`kvtier.moving._movers`: batched host copies with checksums, and batched file I/O, against slow references.

Checksums must equal Python's xxhash (`xxh3_64_intdigest` with the same seed): the transfer engine
checks blocks written by either. Cost: under 2 s.
"""

from __future__ import annotations

import errno
import os
import socket

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.moving import _movers


def addresses(buf: np.ndarray, starts) -> np.ndarray:
    return np.array([buf.ctypes.data + s for s in starts], np.uint64)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 5000), min_size=1, max_size=12), threads=st.integers(1, 4),
       seed=st.integers(0, 2**64 - 1), summed=st.booleans())
def test_copy_moves_every_range_and_sums_as_xxhash(lengths, threads, seed, summed):
    src = np.random.default_rng(len(lengths)).integers(0, 256, sum(lengths) + 7, dtype=np.uint8)
    dst = np.zeros_like(src)
    starts = np.cumsum([0, *lengths[:-1]]).tolist()
    seeds = np.array([(seed + i) % 2**64 for i in range(len(lengths))], np.uint64)
    sums = np.zeros(len(lengths), np.uint64)
    kwargs = {"seeds": seeds, "sums": sums} if summed else {}
    assert _movers.copy(addresses(src, starts), addresses(dst, starts), np.array(lengths, np.uint64),
                        threads=threads, **kwargs) == 0
    assert np.array_equal(dst[:sum(lengths)], src[:sum(lengths)]) and not dst[sum(lengths):].any()
    if summed:
        assert sums.tolist() == [xxhash.xxh3_64_intdigest(src[s:s + n].tobytes(), seed=int(k))
                                 for s, n, k in zip(starts, lengths, seeds)]


# Lengths on each side of xxh3's own boundaries (16, 128, 240 bytes, a 1 KiB stripe block, a
# 64 KiB block) and odd tails, where a vector build could part from the portable one.
_XXH3_LENGTHS = [0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1023, 1024, 1025, 4096 + 5, 65536, 65536 + 63, 1 << 20]


@pytest.mark.parametrize("length", _XXH3_LENGTHS)
def test_both_xxh3_builds_give_pythons_digest(length):
    data = np.random.default_rng(length).integers(0, 256, length, dtype=np.uint8).tobytes()
    for seed in (0, 1, 2**63 + 12345, 2**64 - 1):
        want = xxhash.xxh3_64_intdigest(data, seed=seed)
        assert _movers.xxh3(data, seed) == want
        assert _movers.xxh3(data, seed, portable=True) == want


def test_the_hash_in_use_is_named_and_avx2_where_the_cpu_has_it():
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    assert _movers.XXH3_VECTOR == ("avx2" if "avx2" in flags else "portable")


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.sampled_from([0, 1, 4095, 512 << 10, (512 << 10) + 3, 3 << 20, (5 << 20) + 17]),
                        min_size=1, max_size=5), threads=st.integers(2, 4))
def test_threads_share_large_ranges_piece_by_piece_and_copy_every_byte(lengths, threads):
    """Plain copies on several threads are cut into pieces (one 5 MiB range is shared too): every
    byte lands where it belongs, whatever the cut, and nothing outside the ranges is touched."""
    gap = 13  # ranges apart in the destination, so that a piece written past its range shows
    src = np.random.default_rng(sum(lengths)).integers(0, 256, sum(lengths) + 1, dtype=np.uint8)
    dst = np.zeros(sum(lengths) + gap * len(lengths), np.uint8)
    starts = np.cumsum([0, *lengths[:-1]]).tolist()
    to = [s + gap * i for i, s in enumerate(starts)]
    assert _movers.copy(addresses(src, starts), addresses(dst, to), np.array(lengths, np.uint64), threads=threads) == 0
    for s, t, n in zip(starts, to, lengths):
        assert np.array_equal(dst[t:t + n], src[s:s + n])
        assert not dst[t + n:t + n + gap].any()


def test_a_range_that_fails_its_check_is_flagged_and_not_copied():
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros_like(src)
    starts, lengths = [0, 1024, 2048, 3072], np.full(4, 1024, np.uint64)
    seeds = np.arange(4, dtype=np.uint64)
    expect = np.array([xxhash.xxh3_64_intdigest(src[s:s + 1024].tobytes(), seed=i) for i, s in enumerate(starts)],
                      np.uint64)
    expect[2] ^= 1
    bad = np.zeros(4, np.uint8)
    assert _movers.copy(addresses(src, starts), addresses(dst, starts), lengths, seeds, None, expect, bad) == 1
    assert bad.tolist() == [0, 0, 1, 0]
    assert not dst[2048:3072].any() and np.array_equal(dst[:2048], src[:2048])


def test_copy_without_a_destination_only_checks():
    data = np.full(100, 9, np.uint8)
    expect = np.array([xxhash.xxh3_64_intdigest(data.tobytes(), seed=5)], np.uint64)
    bad = np.zeros(1, np.uint8)
    assert _movers.copy(addresses(data, [0]), None, np.array([100], np.uint64), np.array([5], np.uint64),
                        None, expect, bad) == 0


@settings(max_examples=40, deadline=None)
@given(layer_lengths=st.lists(st.integers(0, 3000), min_size=1, max_size=6), blocks=st.integers(0, 5),
       layer0=st.integers(0, 40), seed=st.integers(0, 2**64 - 1), copied=st.booleans(), threads=st.integers(1, 3))
def test_copy_layers_is_copy_over_every_layer_of_every_block(layer_lengths, blocks, layer0, seed, copied, threads):
    """`copy_layers` makes the k x L descriptors `copy` would be given: the same bytes moved, the
    same sums (seed: the block's plus layer0 plus the layer's index, wrapping at 2**64), the same
    mismatches flagged."""
    span = sum(layer_lengths) + 5  # blocks apart by more than their layers
    rng = np.random.default_rng(blocks * 31 + len(layer_lengths))
    src = rng.integers(0, 256, max(1, blocks) * span, dtype=np.uint8)
    dst, ref = np.zeros_like(src), np.zeros_like(src)
    rel = np.cumsum([0, *layer_lengths[:-1]]).astype(np.uint64)
    lengths = np.array(layer_lengths, np.uint64)
    bases = np.arange(blocks, dtype=np.uint64) * np.uint64(span)
    seeds = np.array([(seed + 977 * j) % 2**64 for j in range(blocks)], np.uint64)
    starts = [int(b + r) for b in bases for r in rel]
    flat_seeds = np.array([(int(s) + layer0 + l) % 2**64 for s in seeds for l in range(len(layer_lengths))], np.uint64)
    want = np.zeros(len(starts), np.uint64)
    _movers.copy(addresses(src, starts), addresses(ref, starts), np.tile(lengths, blocks), flat_seeds, want)
    expect = want.copy()
    if len(expect) > 1:
        expect[1] ^= 1
    sums, bad = np.zeros(len(starts), np.uint64), np.zeros(len(starts), np.uint8)
    got = _movers.copy_layers(bases + np.uint64(src.ctypes.data), bases + np.uint64(dst.ctypes.data) if copied else None,
                              rel, lengths, seeds, layer0, sums, expect, bad, threads=threads)
    assert sums.tolist() == want.tolist()
    assert got == int(bad.sum()) == (1 if len(expect) > 1 else 0) and (len(expect) < 2 or bad[1] == 1)
    if copied:
        if len(expect) > 1:  # the flagged layer is not copied
            a = starts[1]
            ref[a:a + int(lengths[1 % len(lengths)])] = 0
        assert np.array_equal(dst, ref)
    else:
        assert not dst.any()


def test_copy_layers_refuses_arrays_that_do_not_fit():
    k2, l3 = np.zeros(2, np.uint64), np.zeros(3, np.uint64)
    with pytest.raises(ValueError, match="sums has 5 items for 2 blocks of 3 layers"):
        _movers.copy_layers(k2, None, l3, l3, k2, 0, np.zeros(5, np.uint64))
    with pytest.raises(ValueError, match="seeds: 3 items where the batch has 2"):
        _movers.copy_layers(k2, None, l3, l3, l3, 0, np.zeros(6, np.uint64))
    with pytest.raises(ValueError, match="lengths: 2 items where the batch has 3"):
        _movers.copy_layers(k2, None, l3, k2, k2, 0, np.zeros(6, np.uint64))
    with pytest.raises(TypeError, match="required arrays"):
        _movers.copy_layers(k2, None, l3, l3, None, 0, np.zeros(6, np.uint64))
    with pytest.raises(ValueError, match="expect and bad go together"):
        _movers.copy_layers(k2, None, l3, l3, k2, 0, np.zeros(6, np.uint64), np.zeros(6, np.uint64))


def test_recv_layers_refuses_layers_outside_its_buffer_before_reading():
    """A layer table that does not fit the buffer, or runs backwards, is refused naming the
    layer, and `have` must lie within the buffer: nothing is read from the socket then."""
    ours, theirs = socket.socketpair()
    try:
        theirs.sendall(b"x" * 8)
        buf, out = bytearray(100), np.zeros(2, np.uint64)
        args = (ours.fileno(), buf, 0)
        with pytest.raises(ValueError, match="layer 1 .* outside the buffer's 100 bytes or out of order"):
            _movers.recv_layers(*args, np.array([0, 60], np.uint64), np.array([60, 41], np.uint64), 0, 0, out, 1e18)
        with pytest.raises(ValueError, match="layer 1 .* out of order"):
            _movers.recv_layers(*args, np.array([50, 0], np.uint64), np.array([10, 10], np.uint64), 0, 0, out, 1e18)
        with pytest.raises(ValueError, match="have=101 outside"):
            _movers.recv_layers(ours.fileno(), buf, 101, np.zeros(2, np.uint64), np.zeros(2, np.uint64), 0, 0, out, 1e18)
        with pytest.raises(ValueError, match="sums: 3 items where the batch has 2"):
            _movers.recv_layers(*args, np.zeros(2, np.uint64), np.zeros(2, np.uint64), 0, 0, np.zeros(3, np.uint64), 1e18)
        with pytest.raises(TypeError, match="required arrays"):
            _movers.recv_layers(*args, None, np.zeros(2, np.uint64), 0, 0, out, 1e18)
        assert ours.recv(100) == b"x" * 8, "nothing was read by a refused call"
    finally:
        ours.close()
        theirs.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_pwrite_then_pread_round_trips_and_fails_per_descriptor(tmp_path, threads):
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        n, size = 8, 4096
        data = np.random.default_rng(1).integers(0, 256, n * size, dtype=np.uint8)
        fds = np.full(n, fd, np.uint64)
        offsets = np.arange(n, dtype=np.uint64) * size
        errors = np.zeros(n, np.int32)
        lengths = np.full(n, size, np.uint64)
        assert _movers.pwrite(fds, offsets, addresses(data, offsets.tolist()), lengths, errors, threads) == 0
        out = np.zeros_like(data)
        offsets[3] = n * size  # past the end of the file: no bytes, never zeros served
        fds[5] = 2**31 - 1  # not an open descriptor
        assert _movers.pread(fds, offsets, addresses(out, (np.arange(n) * size).tolist()), lengths, errors, threads) == 2
        assert errors.tolist() == [0, 0, 0, errno.ENODATA, 0, errno.EBADF, 0, 0]
        for i in (0, 1, 2, 4, 6, 7):
            assert np.array_equal(out[i * size:(i + 1) * size], data[i * size:(i + 1) * size])
    finally:
        os.close(fd)


@pytest.mark.parametrize("threads", [1, 3])
def test_pread_hashes_each_read_ranges_layers_and_nothing_of_a_failed_one(tmp_path, threads):
    """pread given layers: each range read whole gets its layers' seeded xxh3-64 (seed: the
    range's plus layer0 plus the layer), computed by the thread that read it; a range that failed
    gets none (its sums stay as they were)."""
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        n, size = 6, 8192
        data = np.random.default_rng(2).integers(0, 256, n * size, dtype=np.uint8)
        os.pwrite(fd, data.tobytes(), 0)
        rel, layer_lengths = np.array([0, 1000, 5000], np.uint64), np.array([1000, 4000, 3192], np.uint64)
        seeds = np.array([(2**64 - 2 + 7 * i) % 2**64 for i in range(n)], np.uint64)
        offsets = np.arange(n, dtype=np.uint64) * size
        offsets[4] = n * size  # past the end: fails, hashes nothing
        out, errors = np.zeros_like(data), np.zeros(n, np.int32)
        sums = np.full(n * 3, 7, np.uint64)
        failures = _movers.pread(np.full(n, fd, np.uint64), offsets, addresses(out, (np.arange(n) * size).tolist()),
                                 np.full(n, size, np.uint64), errors, threads, rel=rel, layer_lengths=layer_lengths,
                                 seeds=seeds, layer0=30, sums=sums)
        assert failures == 1 and errors.tolist() == [0, 0, 0, 0, errno.ENODATA, 0]
        for i in range(n):
            block = data[i * size:(i + 1) * size].tobytes()
            want = [xxhash.xxh3_64_intdigest(block[r:r + k], seed=(int(seeds[i]) + 30 + l) % 2**64)
                    for l, (r, k) in enumerate(zip(rel.tolist(), layer_lengths.tolist()))]
            assert sums[3 * i:3 * i + 3].tolist() == ([7, 7, 7] if i == 4 else want)
    finally:
        os.close(fd)


def test_pread_refuses_layers_that_do_not_fit_and_pwrite_hashes_nothing(tmp_path):
    one = np.zeros(1, np.uint64)
    base = (one, one, one, np.full(1, 100, np.uint64), np.zeros(1, np.int32))
    with pytest.raises(ValueError, match=r"layer 1 \(60 bytes at 50\) outside read 0's 100 bytes"):
        _movers.pread(*base, rel=np.array([0, 50], np.uint64), layer_lengths=np.array([50, 60], np.uint64),
                      seeds=one, sums=np.zeros(2, np.uint64))
    with pytest.raises(ValueError, match="sums has 3 items for 1 reads of 2 layers"):
        _movers.pread(*base, rel=np.zeros(2, np.uint64), layer_lengths=np.zeros(2, np.uint64), seeds=one,
                      sums=np.zeros(3, np.uint64))
    with pytest.raises(TypeError, match="go together"):
        _movers.pread(*base, rel=np.zeros(2, np.uint64), sums=np.zeros(2, np.uint64))
    with pytest.raises(TypeError, match="pwrite hashes nothing"):
        _movers.pwrite(*base, rel=np.zeros(1, np.uint64), layer_lengths=one, seeds=one, sums=one)


def test_bad_arrays_are_refused_naming_them():
    a = np.zeros(4, np.uint64)
    with pytest.raises(TypeError, match="src: expected a 1-D array of 8-byte integers"):
        _movers.copy(a.astype(np.float64), a, a)
    with pytest.raises(ValueError, match="dst: 3 items where the batch has 4"):
        _movers.copy(a, a[:3], a)
    with pytest.raises(TypeError, match="lengths"):
        _movers.copy(a, a, np.zeros((2, 2), np.uint64))
    with pytest.raises(ValueError, match="threads: expected 1..64"):
        _movers.copy(a, a, a, threads=0)
    with pytest.raises(ValueError, match="sums and expect need seeds"):
        _movers.copy(a, a, a, sums=np.zeros(4, np.uint64))
    with pytest.raises(ValueError, match="expect and bad go together"):
        _movers.copy(a, a, a, seeds=a, expect=a)
    with pytest.raises(TypeError, match="errors"):
        _movers.pread(a, a, a, a, np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="descriptor 0"):
        _movers.pread(np.full(4, 2**40, np.uint64), a, a, a, np.zeros(4, np.int32))
    read_only = np.zeros(4, np.uint64)
    read_only.setflags(write=False)
    with pytest.raises((BufferError, ValueError), match="read-only"):
        _movers.copy(a, a, a, seeds=a, sums=read_only)
