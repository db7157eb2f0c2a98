"""The SSD tier: a few preallocated files of 4 KiB-aligned slots, read and written with O_DIRECT.

Slots are striped over `num_files` files (slot `s` lives in file `s % num_files`) so that worker
threads spread over several inodes. Each slot takes a stride of `slot_bytes` rounded up to 4096, so
every slot starts on a 4 KiB boundary and the aligned range enclosing any byte range of a slot stays
inside that slot: a read-modify-write never touches a neighbour, and threads working on different
slots never share a byte, a file offset (pread/pwrite only) or a bounce buffer (one per thread).

O_DIRECT bypasses the page cache, so a tier of many GB does not evict the host's working set and
bandwidth is the device's. It needs the buffer address, file offset and length 4096-aligned: an
aligned request goes straight from/to the caller's memory (e.g. a DRAM-tier slot), anything else
through the calling thread's aligned bounce buffer. Filesystems that refuse O_DIRECT get buffered
I/O, said in `describe()` and in one warning, never silently.

The folder is opened once and the files relative to it, never through a link, and only regular
files of this user's with one link are used (`kvtier.tiers.ssd_files` says why and how).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
import threading
from collections.abc import Hashable

import numpy as np
import torch

from kvtier.errors import ConfigError, TierIOError, TierUnavailable
from kvtier.moving import _movers
from kvtier.tiers.base import Medium, SpanIO, Tier, TierKind, as_byte_buffer, host_tensor, slots_needed
from kvtier.tiers.ssd_files import check_reopened, open_directory, open_file, remove_files

ALIGN_BYTES = 4096
MAX_BOUNCE_BYTES = 4 << 20
# The most host memory a batch of slots whose memory O_DIRECT cannot take (a caller's tensor, not
# page-aligned) is staged through at once: copied there in one native pass and written in one
# native batch (or read, then copied out), instead of one Python bounce per slot.
MAX_STAGING_BYTES = 4 << 20
_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)
# What the kernel says when the device itself is gone or failing, not one range of it: the tier
# leaves the cascade (TierUnavailable) until `probe` reads every file again.
_DEVICE_GONE = frozenset({errno.EIO, errno.ENXIO, errno.ENODEV, errno.EROFS, errno.ESHUTDOWN})

log = logging.getLogger(__name__)


class SSDTier(Tier):
    """Slots in preallocated files under one directory; see the module docstring."""

    kind = TierKind.SSD
    medium = Medium.DISK

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        slot_bytes: int,
        num_files: int = 4,
        direct: bool | None = None,
        keep_files: bool = False,
        persist: bool = False,
        io_threads: int = 4,
    ) -> None:
        """Creates and preallocates the slot files, then decides on O_DIRECT.

        Args:
            path: an existing, writable directory on the disk to use.
            capacity_bytes: bytes of block data to hold; rounded down to whole slots. The files take
                `num_slots * slot_stride_bytes` on disk.
            slot_bytes: bytes per slot (one block).
            num_files: files to stripe slots over (fewer if there are fewer slots).
            direct: None tries O_DIRECT and falls back to buffered I/O with a warning; True requires
                it; False uses buffered I/O.
            keep_files: leave the files on disk at `close()` (they are removed by default).
            io_threads: the threads one batch (`read_spans`/`write_spans`) spreads its I/O over:
                the queue depth a batch keeps the disk at.
            persist: use stable file names (`kvtier-ssd-<i>.slab`), reuse the files found there and
                keep them at close, so a later process can serve the blocks; the runtime pairs this
                with a `SlotJournal` that records what each slot holds.
        Raises:
            CapacityError: capacity is below one slot.
            ConfigError: slot_bytes or num_files is not positive.
            TierIOError: the directory is missing, unwritable or a device or kernel folder (/dev,
                /proc, /sys), a file under the tier's names is a symlink, not a regular file, a
                hard link or another user's, the space cannot be reserved (errno ENOSPC), or
                direct=True and the filesystem refuses O_DIRECT.
        """
        if slot_bytes <= 0 or num_files <= 0:
            raise ConfigError(
                f"SSD tier: slot_bytes and num_files must be positive, got {slot_bytes}, {num_files}"
            )
        if not 1 <= io_threads <= _movers.MAX_THREADS:
            raise ConfigError(f"SSD tier: io_threads must be 1..{_movers.MAX_THREADS}, got {io_threads}")
        self.io_threads = io_threads
        self.slot_bytes = slot_bytes
        self.num_slots = slots_needed(capacity_bytes, slot_bytes, "ssd")
        self.slot_stride_bytes = _round_up(slot_bytes, ALIGN_BYTES)
        self.directory = os.fspath(path)
        self._num_files = min(num_files, self.num_slots)
        self.persist = persist
        self._keep_files = keep_files or persist
        self._bounce_bytes = min(self.slot_stride_bytes, MAX_BOUNCE_BYTES)
        self._local = threading.local()
        self._journal = None  # a persistent tier's SlotJournal, opened by `recall`
        self._paths: list[str] = []
        self._files: list[os.stat_result] = []  # what each path was when created: reopens must match
        self._fds: list[int] = []
        self._dir_fd = -1
        self._ready = False
        try:
            self._dir_fd = open_directory(self.directory)
            self._create_files()
            self._direct, self._direct_reason = _decide_direct(self._paths[0], direct, self._dir_fd, self._files[0])
            for file_path, created in zip(self._paths, self._files):
                self._fds.append(_open(self._dir_fd, file_path, self._direct, created))
        except BaseException:
            self._release()
            raise
        self._ready = True
        if direct is None and not self._direct:
            log.warning("SSD tier in %s: O_DIRECT unavailable (%s); using buffered I/O via the page cache",
                        self.directory, self._direct_reason)

    @property
    def o_direct(self) -> bool:
        return self._direct

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(self._paths)

    def write(self, slot: int, src: torch.Tensor, offset: int = 0) -> None:
        """Writes all of CPU tensor `src` into `slot` at `offset` (see `Tier.write`).

        Raises:
            TypeError: src is not a 1-D contiguous uint8 CPU tensor.
            IndexError: slot or range out of bounds.
            TierIOError: the tier is closed or the disk failed, with errno, path and slot.
        """
        data = _host_bytes(src, "SSD write source")
        self._check_range(slot, offset, len(data))
        if len(data) == 0:
            return
        fd, path, start = self._locate(slot)
        try:
            if self._direct and not _aligned(src, offset):
                self._write_bounced(fd, start, offset, data)
            else:
                _pwrite_all(fd, memoryview(data), start + offset)
        except OSError as e:
            raise _io_error(e, "write", path, slot, start + offset, len(data)) from e

    def read(self, slot: int, dst: torch.Tensor, offset: int = 0) -> None:
        """Reads `dst.numel()` bytes of `slot` at `offset` into CPU tensor `dst` (see `Tier.read`).

        Raises:
            TypeError: dst is not a 1-D contiguous uint8 CPU tensor.
            IndexError: slot or range out of bounds.
            TierIOError: the tier is closed, the disk failed, or the file is shorter than the slot
                (never zeros in place of missing bytes).
        """
        data = _host_bytes(dst, "SSD read destination")
        self._check_range(slot, offset, len(data))
        if len(data) == 0:
            return
        fd, path, start = self._locate(slot)
        try:
            if self._direct and not _aligned(dst, offset):
                self._read_bounced(fd, start, offset, data)
            else:
                _pread_all(fd, memoryview(data), start + offset, self._direct)
        except OSError as e:
            raise _io_error(e, "read", path, slot, start + offset, len(data)) from e

    def write_spans(self, io: SpanIO) -> dict[int, Exception]:
        """Batched `write` (see `Tier.write_spans`): one native call for the whole batch, its
        writes spread over `io_threads` threads (the queue depth) outside the GIL."""
        return self._spans(io, writing=True)

    def read_spans(self, io: SpanIO) -> dict[int, Exception]:
        """Batched `read` (see `Tier.read_spans`), as `write_spans`; a slot whose file ends
        before the range fails alone (never zeros)."""
        return self._spans(io, writing=False)

    def _spans(self, io: SpanIO, writing: bool) -> dict[int, Exception]:
        """Every slot of `io` whose range O_DIRECT can take in one native call: straight from (into)
        its memory where O_DIRECT can take that too, else staged through aligned memory in
        batches (`_staged`); a range O_DIRECT cannot take one by one through the bounce buffer."""
        failed: dict[int, Exception] = {}
        if len(io) == 0:
            return failed
        single = self.write if writing else self.read
        aligned = not self._direct or (io.offset | io.length) % ALIGN_BYTES == 0
        in_range = 0 <= io.offset and 0 <= io.length and io.offset + io.length <= self.slot_bytes and self._fds
        native: list[int] = []
        staged: list[int] = []
        for i, (slot, address) in enumerate(zip(io.slots, io.addresses)):
            if in_range and 0 <= slot < self.num_slots and aligned:
                (native if not self._direct or int(address) % ALIGN_BYTES == 0 else staged).append(i)
                continue
            try:  # through the bounce buffer; or the single path raises the error that names the slot
                single(slot, host_tensor(int(address), io.length), io.offset)
            except (OSError, IndexError) as e:
                failed[i] = e
        if native and io.length:
            failed.update(self._native(io, native, writing))
        if staged and io.length:
            failed.update(self._staged(io, staged, writing))
        return failed

    def _staged(self, io: SpanIO, chosen: list[int], writing: bool) -> dict[int, Exception]:
        """`_native` of the `chosen` slots through the calling thread's page-aligned staging memory
        (their own memory is not aligned for O_DIRECT), at most `MAX_STAGING_BYTES` at a time:
        a write copies the batch's ranges there in one native pass first; a read copies out, in
        one pass, the ranges of the slots that were read whole (a failed one's memory is left)."""
        per_pass = max(1, MAX_STAGING_BYTES // io.length)
        length = io.length
        failed: dict[int, Exception] = {}
        for start in range(0, len(chosen), per_pass):
            part = chosen[start:start + per_pass]
            staging = self._staging(len(part) * length)
            rows = np.arange(len(part), dtype=np.uint64) * np.uint64(length) + np.uint64(staging.ctypes.data)
            theirs = np.array([int(io.addresses[i]) for i in part], np.uint64)
            lengths = np.full(len(part), length, np.uint64)
            if writing:
                _movers.copy(theirs, rows, lengths)
            done = self._native(io, part, writing, rows)
            if not writing:
                ok = [j for j, i in enumerate(part) if i not in done]
                sums = _layer_sums(io, [part[j] for j in ok])
                if sums and _covers(sums[0], length):  # each layer hashed as it is copied out: one pass
                    out = np.zeros((len(ok), len(sums[0].rel)), np.uint64)
                    _movers.copy_layers(rows[ok], theirs[ok], sums[0].rel, sums[0].lengths, _seeds(sums), sums[0].layer0,
                                        out.ravel())
                    _deliver(sums, out, range(len(ok)))
                elif ok:
                    _movers.copy(rows[ok], theirs[ok], lengths[ok])
            failed.update(done)
        return failed

    def _staging(self, num_bytes: int) -> np.ndarray:
        """The calling thread's page-aligned staging memory, at least `num_bytes` (made on first use,
        grown on demand); the bounce buffer is its start (the two are never in use at once)."""
        buf = getattr(self._local, "staging", None)
        if buf is None or len(buf) < num_bytes:
            buf = np.frombuffer(mmap.mmap(-1, num_bytes), dtype=np.uint8)
            self._local.staging = buf
        return buf

    def _native(self, io: SpanIO, chosen: list[int], writing: bool,
                addresses: np.ndarray | None = None) -> dict[int, Exception]:
        """`pread`/`pwrite` of the `chosen` slots of `io` in one `kvtier.moving._movers` call, from
        (into) `io`'s addresses or, where given, `addresses` (one per chosen slot)."""
        fds, stride, per_file = self._fds, self.slot_stride_bytes, self._num_files
        slots = [io.slots[i] for i in chosen]
        fd_of = np.array([fds[slot % per_file] for slot in slots], np.uint64)
        offsets = np.array([(slot // per_file) * stride + io.offset for slot in slots], np.uint64)
        # Read straight into the caller's memory, a slot's `LayerSums` are computed by its reader.
        sums = _layer_sums(io, chosen) if not writing and addresses is None else None
        if addresses is None:
            addresses = np.array([int(io.addresses[i]) for i in chosen], np.uint64)
        errors = np.zeros(len(chosen), np.int32)
        lengths = np.full(len(chosen), io.length, np.uint64)
        if sums:
            out = np.zeros((len(chosen), len(sums[0].rel)), np.uint64)
            failures = _movers.pread(fd_of, offsets, addresses, lengths, errors, self.io_threads, rel=sums[0].rel,
                                     layer_lengths=sums[0].lengths, seeds=_seeds(sums), layer0=sums[0].layer0,
                                     sums=out.ravel())
            _deliver(sums, out, np.flatnonzero(errors == 0))
        else:
            move = _movers.pwrite if writing else _movers.pread
            failures = move(fd_of, offsets, addresses, lengths, errors, self.io_threads)
        if not failures:
            return {}
        verb = "write" if writing else "read"
        failed: dict[int, Exception] = {}
        for j in np.flatnonzero(errors):
            code, slot = int(errors[j]), slots[j]
            cause = _ShortRead(errno.EIO, "short read: the file ends before the slot (truncated?)") \
                if code == errno.ENODATA else OSError(code, os.strerror(code))
            failed[chosen[j]] = _io_error(cause, verb, self._paths[slot % per_file], slot, int(offsets[j]), io.length)
        return failed

    def recall(self, fingerprint: bytes, num_layers: int) -> list[tuple[int, bytes, tuple[int, ...]]]:
        """A persistent tier's journal (`kvtier.tiers.ssd_journal`), opened once, beside the slot
        files: the blocks it records under `fingerprint`, which `remember` then keeps current
        (see `Tier.recall`). Empty where the tier is not persistent or the journal is new.

        Raises:
            TierIOError: the journal cannot be opened (a link or special file planted under its
                name, another user's, held by another process).
        """
        if not self.persist:
            return []
        if self._journal is None:
            from kvtier.tiers.ssd_journal import SlotJournal

            self._journal = SlotJournal(self.directory, self.num_slots, self.slot_bytes, num_layers, fingerprint)
        return list(self._journal.entries()) if self._journal.reused else []

    def remember(self, slot: int, key: Hashable, checksums: tuple[int, ...]) -> None:
        """Records `slot`'s block in the journal (a 16-byte key; others cannot outlive the process)."""
        if self._journal is not None and isinstance(key, bytes) and len(key) == 16:
            self._journal.record(slot, key, checksums)

    def probe(self) -> None:
        """Reads the first 4 KiB of every slot file (O_DIRECT when the tier uses it).

        Raises:
            TierUnavailable: a file cannot be read, naming it.
        """
        bounce = self._bounce()[:ALIGN_BYTES]
        for fd, path in zip(list(self._fds), list(self._paths)):
            try:
                _pread_all(fd, memoryview(bounce), 0, self._direct)
            except OSError as e:
                raise TierUnavailable(e.errno, f"SSD tier: probe read failed ({e.strerror})", path) from e
        if not self._fds:
            raise TierUnavailable(errno.EBADF, "SSD tier is closed", self.directory)

    def describe(self) -> dict[str, object]:
        """Base facts plus directory, files, stride, disk use and the O_DIRECT decision with its reason."""
        facts = super().describe()
        facts.update(
            directory=self.directory,
            files=list(self._paths),
            num_files=self._num_files,
            slot_stride_bytes=self.slot_stride_bytes,
            disk_bytes=self.num_slots * self.slot_stride_bytes,
            o_direct=self._direct,
            reason=self._direct_reason,
            bounce_bytes=self._bounce_bytes,
            keep_files=self._keep_files,
            persist=self.persist,
        )
        return facts

    def close(self) -> None:
        """Closes the journal and the files, and removes the files unless `keep_files`. Idempotent.

        Raises:
            TierIOError: closing the journal or a file reported an error (e.g. EIO), naming which;
                everything is still released.
        """
        journal, self._journal = self._journal, None
        failed: TierIOError | None = None
        if journal is not None:
            try:
                journal.close()
            except OSError as e:  # its disk gone: fsync or close failed
                failed = TierIOError(e.errno, f"SSD journal: close failed ({e.strerror})", journal.path)
        try:
            self._release()
        except TierIOError as e:
            if failed is None:
                raise
            raise TierIOError(failed.errno, f"{failed.strerror}; {e.strerror}", failed.filename) from e
        if failed is not None:
            raise failed

    # -- internals -------------------------------------------------------------------------------

    def _create_files(self) -> None:
        """Creates `_num_files` files and reserves their space; appends each to `_paths` as it goes.

        A persistent tier's names are fixed, so a name already taken by a link, a special file or
        another user's file is refused (`open_file`) and left alone.
        """
        stem = "kvtier-ssd" if self.persist else f"kvtier-ssd-{os.getpid()}-{secrets.token_hex(4)}"
        flags = os.O_RDWR | os.O_CREAT | (0 if self.persist else os.O_EXCL)
        for i in range(self._num_files):
            path = os.path.join(self.directory, f"{stem}-{i}.slab")
            num_bytes = self._slots_in_file(i) * self.slot_stride_bytes
            fd = open_file(self._dir_fd, path, flags, 0o600)
            self._paths.append(path)
            try:
                self._files.append(os.fstat(fd))
                os.posix_fallocate(fd, 0, num_bytes)
            except OSError as e:
                message = f"SSD tier: cannot reserve {num_bytes} bytes ({e.strerror})"
                raise TierIOError(e.errno, message, path) from e
            finally:
                os.close(fd)

    def _slots_in_file(self, index: int) -> int:
        return (self.num_slots - index + self._num_files - 1) // self._num_files

    def _locate(self, slot: int) -> tuple[int, str, int]:
        """Returns (fd, path, byte offset of the slot's start) for a slot already bounds-checked."""
        fds = self._fds
        if not fds:
            raise TierIOError(errno.EBADF, "SSD tier is closed", self.directory)
        index = slot % self._num_files
        return fds[index], self._paths[index], (slot // self._num_files) * self.slot_stride_bytes

    def _bounce(self) -> np.ndarray:
        """The calling thread's page-aligned bounce buffer: `_bounce_bytes` of its staging memory."""
        return self._staging(self._bounce_bytes)[:self._bounce_bytes]

    def _write_bounced(self, fd: int, start: int, offset: int, data: np.ndarray) -> None:
        """Writes `data` at slot byte `offset` through the bounce buffer, one aligned chunk at a time.

        A chunk that `data` covers only in part is read first (read-modify-write), so the bytes
        around the range keep their value.
        """
        end = offset + len(data)
        bounce = self._bounce()
        for lo, hi in _aligned_chunks(offset, end, len(bounce)):
            chunk = bounce[: hi - lo]
            a, b = max(lo, offset), min(hi, end)
            if a != lo or b != hi:
                _pread_all(fd, memoryview(chunk), start + lo, True)
            chunk[a - lo : b - lo] = data[a - offset : b - offset]
            _pwrite_all(fd, memoryview(chunk), start + lo)

    def _read_bounced(self, fd: int, start: int, offset: int, data: np.ndarray) -> None:
        """Reads slot bytes `[offset, offset + len(data))` into `data` through the bounce buffer."""
        end = offset + len(data)
        bounce = self._bounce()
        for lo, hi in _aligned_chunks(offset, end, len(bounce)):
            chunk = bounce[: hi - lo]
            _pread_all(fd, memoryview(chunk), start + lo, True)
            a, b = max(lo, offset), min(hi, end)
            data[a - offset : b - offset] = chunk[a - lo : b - lo]

    def _release(self) -> None:
        """Closes fds and removes files (unless kept); raises the first close error at the end."""
        fds, paths, dir_fd = self._fds, self._paths, self._dir_fd
        self._fds, self._paths, self._dir_fd = [], [], -1
        self._local = threading.local()
        first_error: OSError | None = None
        for fd, path in zip(fds, paths):
            try:
                os.close(fd)
            except OSError as e:
                error = TierIOError(e.errno, f"SSD tier: close failed ({e.strerror})", path)
                first_error = first_error or error
        if not (self._keep_files and self._ready):
            remove_files(paths, dir_fd)
        if dir_fd >= 0:
            os.close(dir_fd)
        if first_error is not None:
            raise first_error


def _decide_direct(path: str, direct: bool | None, dir_fd: int | None = None,
                   expected: os.stat_result | None = None) -> tuple[bool, str]:
    """Returns (use O_DIRECT, why) for the filesystem holding `path` (see `_probe_direct`).

    Raises:
        TierIOError: direct=True and O_DIRECT is refused, or the probe hit a real I/O error.
    """
    if direct is False:
        return False, "disabled by the caller (direct=False)"
    refusal = _probe_direct(path, dir_fd, expected)
    if refusal is None:
        return True, "an aligned O_DIRECT write and read succeeded"
    if direct:
        raise TierIOError(errno.EINVAL, f"SSD tier: O_DIRECT required but {refusal}", path)
    return False, refusal


def _probe_direct(path: str, dir_fd: int | None = None, expected: os.stat_result | None = None) -> str | None:
    """Opens `path` with O_DIRECT (never through a link), reads its first 4 KiB and writes the same bytes back.

    Reading first keeps the content: a persistent tier's slot 0 may hold a block from an earlier run.

    Args:
        path: the file to probe.
        dir_fd: its folder's descriptor, to open the base name against (None: open `path` itself).
        expected: the file as created; the probe refuses another one found under its name.
    Returns:
        None when O_DIRECT works, else why not.
    Raises:
        TierIOError: an error other than the filesystem refusing O_DIRECT (a link under the name included).
    """
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return "os.O_DIRECT does not exist on this platform"
    name = path if dir_fd is None else os.path.basename(path)
    try:
        fd = os.open(name, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | flag, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in _REFUSED:
            return f"the filesystem refused to open a file with O_DIRECT ({e.strerror})"
        raise TierIOError(e.errno, f"SSD tier: O_DIRECT probe failed to open ({e.strerror})", path) from e
    try:
        check_reopened(fd, path, expected)
    except BaseException:
        os.close(fd)
        raise
    buf = mmap.mmap(-1, ALIGN_BYTES)
    try:
        _pread_all(fd, memoryview(buf), 0, True)
        _pwrite_all(fd, memoryview(buf), 0)
    except OSError as e:
        if e.errno in _REFUSED:
            return f"the filesystem refused an aligned O_DIRECT write/read ({e.strerror})"
        raise TierIOError(e.errno, f"SSD tier: O_DIRECT probe I/O failed ({e.strerror})", path) from e
    finally:
        os.close(fd)
        buf.close()
    return None


def _open(dir_fd: int, path: str, direct: bool, expected: os.stat_result) -> int:
    """Opens a slot file read-write (O_NOFOLLOW, O_CLOEXEC), with O_DIRECT when `direct`.

    Args:
        dir_fd: the tier folder's descriptor.
        path: the file's path.
        direct: add O_DIRECT.
        expected: the file as created: the one opened must be the same inode.
    Raises:
        TierIOError: the file cannot be opened, or another file took its name since it was created.
    """
    fd = open_file(dir_fd, path, os.O_RDWR | (os.O_DIRECT if direct else 0))
    try:
        check_reopened(fd, path, expected)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _pwrite_all(fd: int, buf: memoryview, file_offset: int) -> None:
    """pwrite all of `buf` at `file_offset`, looping on short writes.

    Raises:
        OSError: from the system call, or EIO if a write makes no progress.
    """
    done = 0
    while done < len(buf):
        n = os.pwrite(fd, buf[done:], file_offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"write made no progress after {done} of {len(buf)} bytes")
        done += n


def _pread_all(fd: int, buf: memoryview, file_offset: int, direct: bool) -> None:
    """Fills `buf` from `file_offset`, looping on short reads.

    A read that returns 0 is the end of the file; so is, with O_DIRECT, one that stops off a 4 KiB
    boundary (a retry from there would fail with EINVAL and hide the real cause).

    Raises:
        OSError: from the system call, or EIO when the file ends before `buf` is full.
    """
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], file_offset + done)
        done += n
        if n == 0 or (direct and done < len(buf) and done % ALIGN_BYTES):
            raise _ShortRead(
                errno.EIO,
                f"short read: the file ends after {done} of {len(buf)} bytes at offset {file_offset}"
                " (truncated?)",
            )


class _ShortRead(OSError):
    """A file shorter than the slot (truncated): that slot's failure, not the device's."""


def _layer_sums(io: SpanIO, chosen: list[int]) -> list | None:
    """The `LayerSums` of the `chosen` slots of a read, where every one has them over one layer
    table (a route's batch: one span); else None (the route hashes what it read itself)."""
    if not io.sums or not chosen:
        return None
    sums = [io.sums[i] for i in chosen]
    if None in sums:
        return None
    first = sums[0]
    same = all(s.layer0 == first.layer0 and (s.rel is first.rel or np.array_equal(s.rel, first.rel))
               and (s.lengths is first.lengths or np.array_equal(s.lengths, first.lengths)) for s in sums)
    return sums if same else None


def _covers(sums, length: int) -> bool:
    """Whether the layers of `sums` tile `[0, length)` (then copying them copies every byte);
    in plain Python: a dozen layers cost less so than NumPy calls do."""
    at = 0
    for start, size in zip(sums.rel.tolist(), sums.lengths.tolist()):
        if start != at:
            return False
        at += size
    return at == length


def _seeds(sums: list) -> np.ndarray:
    return np.fromiter((s.seed for s in sums), np.uint64, len(sums))


def _deliver(sums: list, out: np.ndarray, rows) -> None:
    """Hands row j of `out` to `sums[j]`, for each j in `rows` (its bytes in and hashed)."""
    for j in rows:
        sums[j].out[:], sums[j].done = out[j], True


def _io_error(e: OSError, op: str, path: str, slot: int, file_offset: int, num_bytes: int) -> TierIOError:
    """A TierIOError with the errno of `e`, naming the slot, the range and the file;
    `TierUnavailable` when the errno says the device itself failed."""
    if isinstance(e, TierIOError):
        return e
    message = f"SSD tier slot {slot}: {op} of {num_bytes} bytes at file offset {file_offset} failed: "
    message += str(e.strerror)
    gone = e.errno in _DEVICE_GONE and not isinstance(e, _ShortRead)
    err = (TierUnavailable if gone else TierIOError)(e.errno, message, path)
    err.slot = slot  # type: ignore[attr-defined]
    return err


def _host_bytes(t: torch.Tensor, what: str) -> np.ndarray:
    """A writable numpy view of a 1-D contiguous uint8 CPU tensor.

    Raises:
        TypeError: wrong dtype, shape, layout or device.
    """
    as_byte_buffer(t, what)
    if t.device.type != "cpu":
        raise TypeError(f"{what} must be a CPU tensor for the SSD tier, got one on {t.device}")
    return t.detach().numpy()


def _aligned(t: torch.Tensor, offset: int) -> bool:
    """Whether an O_DIRECT request for `t` at slot byte `offset` can use `t`'s memory directly."""
    return (t.data_ptr() | offset | t.numel()) % ALIGN_BYTES == 0


def _aligned_chunks(offset: int, end: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """The 4 KiB-aligned range enclosing `[offset, end)`, cut into pieces of at most `chunk_bytes`."""
    lo = offset - offset % ALIGN_BYTES
    hi = _round_up(end, ALIGN_BYTES)
    return [(p, min(p + chunk_bytes, hi)) for p in range(lo, hi, chunk_bytes)]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


__all__ = ("ALIGN_BYTES", "SSDTier")
