"""SSDTier specifics beyond the Tier contract: bad directories, the O_DIRECT decision, a full disk,
a file-size limit, files truncated behind the tier's back, and file lifecycle.

Real parts only: a full disk is a 1 MiB tmpfs mounted for the test, an O_DIRECT-refusing filesystem
is a ramfs (both need root and `mount`; skipped with the reason otherwise), EFBIG comes from
RLIMIT_FSIZE in a subprocess. Cost: about a second.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.errors import TierIOError
from kvtier.moving import _movers
from kvtier.moving.copies import block_seed
from kvtier.tiers.base import LayerSums, SpanIO
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.ssd import ALIGN_BYTES, SSDTier

SLOT_BYTES = 64 * 1024


def random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def mount(fstype: str, options: str, where: Path) -> subprocess.CompletedProcess:
    """Mounts a fresh `fstype` at `where`; returns the finished `mount` command."""
    args = ["mount", "-t", fstype, *(["-o", options] if options else []), fstype, str(where)]
    return subprocess.run(args, capture_output=True, text=True, timeout=30)


def _mount_refusal() -> str | None:
    """Why this host cannot mount a small tmpfs for a test (None when it can), probed once."""
    if shutil.which("mount") is None:
        return "no `mount` command here"
    with tempfile.TemporaryDirectory() as where:
        result = mount("tmpfs", "size=64k", Path(where))
        if result.returncode != 0:
            return f"cannot mount a tmpfs here (needs root/CAP_SYS_ADMIN): {result.stderr.strip()}"
        subprocess.run(["umount", where], capture_output=True, timeout=30)
    return None


MOUNT_REFUSAL = _mount_refusal()
needs_mount = pytest.mark.skipif(MOUNT_REFUSAL is not None, reason=str(MOUNT_REFUSAL))


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a disk that really fills up."""
    where = tmp_path / "tmpfs"
    where.mkdir()
    assert mount("tmpfs", "size=1m", where).returncode == 0
    yield where
    subprocess.run(["umount", str(where)], check=True)


@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    """A ramfs: a filesystem that refuses O_DIRECT at open (EINVAL)."""
    where = tmp_path / "ramfs"
    where.mkdir()
    assert mount("ramfs", "", where).returncode == 0
    yield where
    subprocess.run(["umount", str(where)], check=True)


@pytest.fixture
def ssd(tmp_path: Path) -> Iterator[SSDTier]:
    tier = SSDTier(tmp_path, 8 * SLOT_BYTES, SLOT_BYTES, num_files=2)
    yield tier
    tier.close()


# -- bad directories -------------------------------------------------------------------------------


def test_missing_directory_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "dir"
    with pytest.raises(TierIOError, match=str(missing)) as info:
        SSDTier(missing, 4 * SLOT_BYTES, SLOT_BYTES)
    assert info.value.errno == errno.ENOENT


def test_directory_under_a_regular_file_names_the_path(tmp_path: Path) -> None:
    (tmp_path / "plain").write_bytes(b"x")
    bad = tmp_path / "plain" / "sub"
    with pytest.raises(TierIOError, match=str(bad)) as info:
        SSDTier(bad, 4 * SLOT_BYTES, SLOT_BYTES)
    assert info.value.errno == errno.ENOTDIR


def test_a_regular_file_is_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "plain").write_bytes(b"x")
    with pytest.raises(TierIOError, match="not a directory") as info:
        SSDTier(tmp_path / "plain", 4 * SLOT_BYTES, SLOT_BYTES)
    assert info.value.errno == errno.ENOTDIR


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="no procfs here")
def test_unwritable_directory_names_the_path() -> None:
    # Root ignores permission bits, but nobody can create a file in procfs.
    with pytest.raises(TierIOError, match="/proc/self"):
        SSDTier("/proc/self", 4 * SLOT_BYTES, SLOT_BYTES)


# -- the O_DIRECT decision ------------------------------------------------------------------------


def test_o_direct_decision_is_reported(ssd: SSDTier) -> None:
    facts = ssd.describe()
    assert isinstance(facts["o_direct"], bool) and facts["o_direct"] == ssd.o_direct
    assert isinstance(facts["reason"], str) and facts["reason"]


def test_buffered_when_asked_says_so_without_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.ssd"):
        tier = SSDTier(tmp_path, 4 * SLOT_BYTES, SLOT_BYTES, direct=False)
    try:
        assert tier.describe()["o_direct"] is False
        assert "direct=False" in str(tier.describe()["reason"])
        assert not caplog.records
    finally:
        tier.close()


@needs_mount
def test_refused_o_direct_falls_back_with_one_warning(ramfs: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.ssd"):
        tier = SSDTier(ramfs, 4 * SLOT_BYTES, SLOT_BYTES)
    try:
        facts = tier.describe()
        assert facts["o_direct"] is False and "refused" in str(facts["reason"])
        assert len(caplog.records) == 1 and "O_DIRECT" in caplog.records[0].getMessage()
        block = random_bytes(SLOT_BYTES)
        tier.write(3, block)
        out = torch.empty_like(block)
        tier.read(3, out)
        assert torch.equal(out, block)
        assert len(caplog.records) == 1
    finally:
        tier.close()


@needs_mount
def test_required_o_direct_on_a_refusing_filesystem_raises(ramfs: Path) -> None:
    with pytest.raises(TierIOError, match="O_DIRECT") as info:
        SSDTier(ramfs, 4 * SLOT_BYTES, SLOT_BYTES, direct=True)
    assert info.value.errno == errno.EINVAL
    assert list(ramfs.iterdir()) == []


# -- full disk, size limit, truncation ------------------------------------------------------------


@needs_mount
def test_full_disk_at_creation_raises_enospc_and_leaves_nothing(small_tmpfs: Path) -> None:
    with pytest.raises(TierIOError, match=str(small_tmpfs)) as info:
        SSDTier(small_tmpfs, 4 << 20, SLOT_BYTES)
    assert info.value.errno == errno.ENOSPC
    assert list(small_tmpfs.iterdir()) == []


@needs_mount
@pytest.mark.parametrize("direct", [None, False])
def test_full_disk_at_write_raises_enospc_naming_slot(small_tmpfs: Path, direct: bool | None) -> None:
    tier = SSDTier(small_tmpfs, 2 * SLOT_BYTES, SLOT_BYTES, num_files=1, direct=direct)
    try:
        os.truncate(tier.paths[0], 0)  # give the reserved space back behind the tier's back ...
        _fill(small_tmpfs / "filler")  # ... and let someone else take it
        with pytest.raises(TierIOError, match=r"slot 1\b") as info:
            tier.write(1, random_bytes(SLOT_BYTES))
        assert info.value.errno == errno.ENOSPC
        assert info.value.filename == tier.paths[0]
    finally:
        tier.close()


def _fill(path: Path) -> None:
    """Writes to `path` until the filesystem is full."""
    chunk = b"\xff" * 4096
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as e:
            assert e.errno == errno.ENOSPC


EFBIG_SCRIPT = """
import json, resource, signal, sys, torch
from kvtier.errors import TierIOError
from kvtier.tiers.ssd import SSDTier
tier = SSDTier(sys.argv[1], 8 * 65536, 65536, num_files=2)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
tier.write(0, torch.ones(65536, dtype=torch.uint8))  # below the limit: fine
try:
    tier.write(4, torch.ones(65536, dtype=torch.uint8))  # file 0, bytes [131072, 196608)
except TierIOError as e:
    print(json.dumps({"errno": e.errno, "message": str(e)}))
tier.close()
"""


@pytest.mark.slow
def test_file_size_limit_raises_efbig_naming_slot(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", EFBIG_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    outcome = json.loads(result.stdout)
    assert outcome["errno"] == errno.EFBIG
    assert "slot 4" in outcome["message"] and str(tmp_path) in outcome["message"]


@pytest.mark.parametrize("direct", [None, False])
@pytest.mark.parametrize("keep_bytes", [0, 100, SLOT_BYTES + 5000])
def test_truncated_file_makes_reads_raise_not_zeros(
    tmp_path: Path, direct: bool | None, keep_bytes: int
) -> None:
    tier = SSDTier(tmp_path, 4 * SLOT_BYTES, SLOT_BYTES, num_files=1, direct=direct)
    try:
        block = random_bytes(SLOT_BYTES)
        for slot in range(2):
            tier.write(slot, block)
        os.truncate(tier.paths[0], keep_bytes)  # slots 0 and 1 are the file's first 128 KiB
        out = torch.empty(SLOT_BYTES, dtype=torch.uint8)
        with pytest.raises(TierIOError, match=r"slot 1\b.*short read") as info:
            tier.read(1, out)
        assert info.value.filename == tier.paths[0]
        with pytest.raises(TierIOError, match="short read"):
            tier.read(1, out[:1000], SLOT_BYTES - 1000)
        head = torch.empty(50, dtype=torch.uint8)
        if keep_bytes >= ALIGN_BYTES:
            # What is still there, whole 4 KiB pages of it, reads back fine. (With O_DIRECT a range
            # in a page the truncation cut also raises: it cannot be read whole.)
            tier.read(0, head)
            assert torch.equal(head, block[:50])
    finally:
        tier.close()


# -- batches (read_spans / write_spans: one native call) --------------------------------------------


def _spans(slots, length, buffers, offset=0) -> SpanIO:
    return SpanIO(slots, offset, length, [b.data_ptr() for b in buffers], [b"k%015d" % s for s in slots])


@pytest.mark.parametrize("direct", [None, False])
def test_a_truncated_file_fails_its_slots_alone_in_a_batch(tmp_path: Path, direct: bool | None) -> None:
    """Slots striped over two files; one file truncated: its slots fail (short read, naming the
    slot and file), the other file's slots are read whole in the same batch."""
    tier = SSDTier(tmp_path, 4 * SLOT_BYTES, SLOT_BYTES, num_files=2, direct=direct)
    try:
        blocks = [random_bytes(SLOT_BYTES, seed=s) for s in range(4)]
        assert tier.write_spans(_spans(range(4), SLOT_BYTES, blocks)) == {}
        os.truncate(tier.paths[1], 0)  # slots 1 and 3
        outs = [aligned(SLOT_BYTES) for _ in range(4)]
        failed = tier.read_spans(_spans(range(4), SLOT_BYTES, outs))
        assert set(failed) == {1, 3}
        assert all(isinstance(e, TierIOError) and "short read" in str(e) and e.filename == tier.paths[1]
                   for e in failed.values())
        assert "slot 3" in str(failed[3])
        assert torch.equal(outs[0], blocks[0]) and torch.equal(outs[2], blocks[2])
    finally:
        tier.close()


@needs_mount
@pytest.mark.parametrize("direct", [None, False])
def test_a_full_disk_fails_the_slots_it_cannot_write_in_a_batch(small_tmpfs: Path, direct: bool | None) -> None:
    tier = SSDTier(small_tmpfs, 2 * SLOT_BYTES, SLOT_BYTES, num_files=2, direct=direct)
    try:
        os.truncate(tier.paths[1], 0)  # slot 1's reserved space given back ...
        _fill(small_tmpfs / "filler")  # ... and taken by someone else
        failed = tier.write_spans(_spans([0, 1], SLOT_BYTES, [random_bytes(SLOT_BYTES)] * 2))
        assert set(failed) == {1} and failed[1].errno == errno.ENOSPC and "slot 1" in str(failed[1])
    finally:
        tier.close()


def test_a_batch_reads_unaligned_memory_through_the_bounce_buffer(tmp_path: Path) -> None:
    """Memory or ranges O_DIRECT cannot take as they are go one by one through the bounce buffer,
    in the same batch as the aligned ones; every byte lands."""
    tier = SSDTier(tmp_path, 4 * SLOT_BYTES, SLOT_BYTES, num_files=2)
    try:
        blocks = [random_bytes(SLOT_BYTES, seed=s) for s in range(4)]
        assert tier.write_spans(_spans(range(4), SLOT_BYTES, blocks)) == {}
        base = aligned(4 * SLOT_BYTES + 1)
        outs = [aligned(SLOT_BYTES), base[1:SLOT_BYTES + 1], aligned(SLOT_BYTES), base[SLOT_BYTES + 1:2 * SLOT_BYTES + 1]]
        assert tier.read_spans(_spans(range(4), SLOT_BYTES, outs)) == {}
        assert all(torch.equal(o, b) for o, b in zip(outs, blocks))
        parts = [aligned(1000) for _ in range(4)]
        assert tier.read_spans(_spans(range(4), 1000, parts, offset=100)) == {}
        assert all(torch.equal(p, b[100:1100]) for p, b in zip(parts, blocks))
    finally:
        tier.close()


def test_unaligned_memory_is_staged_in_batches_never_slot_by_slot(tmp_path: Path, monkeypatch) -> None:
    """Under O_DIRECT, slots whose memory is not page-aligned (a caller's tensor) but whose range
    is go through aligned staging memory, a few at a time (here 2 per pass), with no per-slot
    `write`/`read`; a staged read that fails leaves that slot's memory as it was."""
    import kvtier.tiers.ssd as ssd_module

    monkeypatch.setattr(ssd_module, "MAX_STAGING_BYTES", 2 * SLOT_BYTES)
    tier = SSDTier(tmp_path, 6 * SLOT_BYTES, SLOT_BYTES, num_files=2, direct=True)
    single: list[int] = []
    monkeypatch.setattr(tier, "write", lambda slot, *a: single.append(slot))
    monkeypatch.setattr(tier, "read", lambda slot, *a: single.append(slot))
    try:
        base = aligned(6 * SLOT_BYTES + 1)
        srcs = [base[1 + i * SLOT_BYTES:1 + (i + 1) * SLOT_BYTES] for i in range(6)]
        for i, src in enumerate(srcs):
            src.copy_(random_bytes(SLOT_BYTES, seed=10 + i))
        blocks = [src.clone() for src in srcs]
        assert tier.write_spans(_spans(range(6), SLOT_BYTES, srcs)) == {}
        os.truncate(tier.paths[1], 0)  # slots 1, 3, 5
        sentinel = torch.full((SLOT_BYTES,), 7, dtype=torch.uint8)
        outs = aligned(6 * SLOT_BYTES + 1)[1:].view(6, SLOT_BYTES)
        outs.copy_(sentinel.expand(6, SLOT_BYTES))
        failed = tier.read_spans(_spans(range(6), SLOT_BYTES, list(outs)))
        assert set(failed) == {1, 3, 5} and all("short read" in str(e) for e in failed.values())
        assert all(torch.equal(outs[i], blocks[i]) for i in (0, 2, 4))
        assert all(torch.equal(outs[i], sentinel) for i in (1, 3, 5))
        assert single == []
    finally:
        tier.close()


def layer_sums(key: bytes, num_layers: int = 4) -> LayerSums:
    size = SLOT_BYTES // num_layers
    return LayerSums(np.arange(0, SLOT_BYTES, size, dtype=np.uint64), np.full(num_layers, size, np.uint64),
                     block_seed(key), 2, np.zeros(num_layers, np.uint64))


@pytest.mark.parametrize("direct", [None, False])
def test_a_read_hashes_each_slots_layers_in_the_pass_that_brings_them(tmp_path: Path, direct: bool | None) -> None:
    """A read straight into the caller's memory computes the layer checksums its caller asked for
    (`SpanIO.sums`) in the reader thread, right after the read, or (memory O_DIRECT cannot take,
    staged) as it copies the bytes out: the bytes' seeded xxh3-64 per layer. A slot that fails is
    left to the caller."""
    tier = SSDTier(tmp_path, 4 * SLOT_BYTES, SLOT_BYTES, num_files=2, direct=direct, io_threads=2)
    try:
        blocks = [random_bytes(SLOT_BYTES, seed=60 + s) for s in range(4)]
        assert tier.write_spans(_spans(range(4), SLOT_BYTES, blocks)) == {}
        os.truncate(tier.paths[1], 0)  # slots 1 and 3
        outs = [aligned(SLOT_BYTES) for _ in range(4)]
        io = _spans(range(4), SLOT_BYTES, outs)
        sums = [layer_sums(k) for k in io.keys]
        failed = tier.read_spans(SpanIO(io.slots, io.offset, io.length, io.addresses, io.keys, sums))
        assert set(failed) == {1, 3} and [s.done for s in sums] == [True, False, True, False]
        for j in (0, 2):
            data = outs[j].numpy().tobytes()
            assert torch.equal(outs[j], blocks[j]) and sums[j].out.tolist() == [
                _movers.xxh3(data[l * (SLOT_BYTES // 4):(l + 1) * (SLOT_BYTES // 4)], (sums[j].seed + 2 + l) % 2**64)
                for l in range(4)]
        base = aligned(2 * SLOT_BYTES + 1)  # unaligned memory: staged under O_DIRECT, hashed as copied out
        outs = [base[1:SLOT_BYTES + 1], base[SLOT_BYTES + 1:]]
        io = _spans([2, 3], SLOT_BYTES, outs)
        sums = [layer_sums(k) for k in io.keys]
        failed = tier.read_spans(SpanIO(io.slots, io.offset, io.length, io.addresses, io.keys, sums))
        assert set(failed) == {1} and [s.done for s in sums] == [True, False]
        data = outs[0].numpy().tobytes()
        assert torch.equal(outs[0], blocks[2]) and sums[0].out.tolist() == [
            _movers.xxh3(data[l * (SLOT_BYTES // 4):(l + 1) * (SLOT_BYTES // 4)], (sums[0].seed + 2 + l) % 2**64)
            for l in range(4)]
        if tier.o_direct:  # layers that do not tile the range: every byte copied out, the hashing left to the caller
            outs[0].zero_()
            gappy = LayerSums(np.array([0, 4096], np.uint64), np.array([1024, 1024], np.uint64), 1, 0, np.zeros(2, np.uint64))
            io = _spans([2], SLOT_BYTES, outs[:1])
            assert tier.read_spans(SpanIO(io.slots, io.offset, io.length, io.addresses, io.keys, [gappy])) == {}
            assert torch.equal(outs[0], blocks[2]) and not gappy.done
    finally:
        tier.close()


def test_host_rows_go_to_disk_and_back_without_staging(tmp_path: Path, monkeypatch) -> None:
    """`kvtier.host_rows` (what the integrations stage blocks in) starts every row on a page, so
    O_DIRECT reads and writes them straight: no staging memory is ever asked for."""
    from kvtier import host_rows

    tier = SSDTier(tmp_path, 4 * SLOT_BYTES, SLOT_BYTES, num_files=2, direct=True)

    def no_staging(num_bytes: int):
        raise AssertionError(f"staged {num_bytes} bytes")

    monkeypatch.setattr(tier, "_staging", no_staging)
    try:
        rows = host_rows(4, SLOT_BYTES)
        assert all(rows[i].data_ptr() % ALIGN_BYTES == 0 for i in range(4))
        rows.copy_(torch.stack([random_bytes(SLOT_BYTES, seed=40 + i) for i in range(4)]))
        assert tier.write_spans(_spans(range(4), SLOT_BYTES, list(rows))) == {}
        back = host_rows(4, SLOT_BYTES, zeroed=True)
        assert int(back.sum()) == 0
        assert tier.read_spans(_spans(range(4), SLOT_BYTES, list(back))) == {}
        assert torch.equal(back, rows)
    finally:
        tier.close()


def test_staged_io_from_several_threads_keeps_each_threads_bytes(tmp_path: Path) -> None:
    """Each thread stages through its own memory: four threads writing and reading their own
    slots from unaligned memory at once each get back exactly what they wrote."""
    import threading

    tier = SSDTier(tmp_path, 16 * SLOT_BYTES, SLOT_BYTES, num_files=2, direct=True, io_threads=2)
    errors: list[str] = []

    def work(t: int) -> None:
        slots = [t * 4 + i for i in range(4)]
        for round_ in range(10):
            base = aligned(4 * SLOT_BYTES + 1)[1:].view(4, SLOT_BYTES)
            for i in range(4):
                base[i].copy_(random_bytes(SLOT_BYTES, seed=1000 * t + 10 * round_ + i))
            if tier.write_spans(_spans(slots, SLOT_BYTES, list(base))):
                errors.append(f"thread {t}: a write failed")
            out = aligned(4 * SLOT_BYTES + 3)[3:].view(4, SLOT_BYTES)
            if tier.read_spans(_spans(slots, SLOT_BYTES, list(out))) or not torch.equal(out, base):
                errors.append(f"thread {t} round {round_}: read back other bytes")

    try:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert errors == []
    finally:
        tier.close()


def aligned(n: int) -> torch.Tensor:
    """A page-aligned CPU buffer of `n` bytes (what O_DIRECT reads straight into)."""
    from kvtier.tiers.dram import aligned_host_memory

    return aligned_host_memory(n, pinned=False)


# -- layout, alignment and lifecycle --------------------------------------------------------------


def test_slots_are_4k_aligned_and_striped(tmp_path: Path) -> None:
    tier = SSDTier(tmp_path, 7 * 10_000, 10_000, num_files=3)
    try:
        facts = tier.describe()
        assert facts["slot_stride_bytes"] == 12288 and facts["slot_stride_bytes"] % ALIGN_BYTES == 0
        assert facts["num_files"] == 3 and len(tier.paths) == 3
        sizes = [os.path.getsize(p) for p in tier.paths]
        assert sizes == [3 * 12288, 2 * 12288, 2 * 12288] and sum(sizes) == facts["disk_bytes"]
    finally:
        tier.close()


def test_fewer_slots_than_files_uses_one_file_per_slot(tmp_path: Path) -> None:
    tier = SSDTier(tmp_path, 2 * SLOT_BYTES, SLOT_BYTES, num_files=8)
    try:
        assert len(tier.paths) == 2
    finally:
        tier.close()


def test_aligned_io_straight_from_dram_slots(ssd: SSDTier) -> None:
    dram = DRAMTier(4 * SLOT_BYTES, SLOT_BYTES, pin=False)
    try:
        assert dram.view(1, 0, SLOT_BYTES).data_ptr() % ALIGN_BYTES == 0
        dram.write(1, random_bytes(SLOT_BYTES, seed=1))
        ssd.write(5, dram.view(1, 0, SLOT_BYTES))
        ssd.read(5, dram.view(2, 0, SLOT_BYTES))
        assert torch.equal(dram.view(2, 0, SLOT_BYTES), dram.view(1, 0, SLOT_BYTES))
        ssd.read(5, dram.view(3, 4096, 8192), 8192)  # aligned sub-range straight into a slot
        assert torch.equal(dram.view(3, 4096, 8192), dram.view(1, 8192, 8192))
    finally:
        dram.close()


def test_unaligned_buffer_of_aligned_length_goes_through_bounce(ssd: SSDTier) -> None:
    backing = random_bytes(2 * SLOT_BYTES + 1, seed=2)
    src = backing[1 : 1 + SLOT_BYTES]
    assert src.data_ptr() % ALIGN_BYTES != 0
    ssd.write(2, src)
    out = torch.zeros(2 * SLOT_BYTES + 3, dtype=torch.uint8)[3 : 3 + SLOT_BYTES]
    ssd.read(2, out)
    assert torch.equal(out, src)


def test_non_cpu_buffer_raises_type_error(ssd: SSDTier) -> None:
    meta = torch.empty(16, dtype=torch.uint8, device="meta")
    with pytest.raises(TypeError, match="CPU"):
        ssd.write(0, meta)
    with pytest.raises(TypeError, match="CPU"):
        ssd.read(0, meta)


def test_files_removed_on_close(tmp_path: Path) -> None:
    tier = SSDTier(tmp_path, 4 * SLOT_BYTES, SLOT_BYTES)
    paths = tier.paths
    assert all(os.path.exists(p) for p in paths)
    tier.close()
    tier.close()
    assert not any(os.path.exists(p) for p in paths)
    assert list(tmp_path.iterdir()) == []


def test_keep_files_keeps_the_bytes(tmp_path: Path) -> None:
    tier = SSDTier(tmp_path, 4 * SLOT_BYTES, SLOT_BYTES, num_files=1, keep_files=True)
    block = random_bytes(SLOT_BYTES, seed=9)
    tier.write(2, block)
    tier.close()
    with open(_only_file(tmp_path), "rb") as f:
        f.seek(2 * SLOT_BYTES)
        assert f.read(SLOT_BYTES) == block.numpy().tobytes()


def _only_file(directory: Path) -> Path:
    (only,) = directory.iterdir()
    return only
