"""The SSD tier's journal: which block each slot holds, so blocks outlive the process.

One file beside the slabs, `kvtier-ssd.journal`: a 4 KiB header (magic, version, slot count,
slot size and a fingerprint of the block layout and namespace), then one fixed-size record per
slot — the block key and its per-layer checksums. A record is written after its block's bytes
have landed; it is never trusted blindly: every read below DRAM is checked against these
checksums, which are seeded with the block's key (`kvtier.moving.engine.block_seed`), so a record left
over from a crash, a slot rewritten since, or a record under another block's key is a counted
miss, never wrong data. An exclusive `flock` keeps two processes from sharing one directory.
The file is opened like the slabs (`kvtier.tiers.ssd_files`): never through a link, and only a
regular file of this user's with one link.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
from collections.abc import Iterator

from kvtier.errors import TierIOError
from kvtier.tiers.ssd_files import open_directory, open_file

JOURNAL_NAME = "kvtier-ssd.journal"
HEADER_BYTES = 4096
_MAGIC = b"KVTIERJ1"
_HEADER = struct.Struct("<8sIQQ16s")  # magic, version, num_slots, slot_bytes, fingerprint
_VERSION = 2  # 2: checksums seeded with the key and layer (kvtier.moving.engine.block_seed); 1's records are discarded
_VALID = 0x4B565442  # "KVTB": this record describes a block
_RECORD_HEAD = struct.Struct("<II16s")  # valid marker, number of layers, key

log = logging.getLogger(__name__)


class SlotJournal:
    """Per-slot records of (key, per-layer checksums) in one file.

    Args:
        directory: the SSD tier's directory.
        num_slots, slot_bytes: the tier's geometry.
        num_layers: checksums per record.
        fingerprint: 16 bytes naming the block layout and key namespace; records written under
            another fingerprint are discarded at open.
    Raises:
        TierIOError: the journal cannot be opened, is a symlink, not a regular file, a hard link
            or another user's file, the directory is a device or kernel folder, or another process
            holds it (EBUSY).
    """

    def __init__(self, directory: str, num_slots: int, slot_bytes: int, num_layers: int, fingerprint: bytes) -> None:
        self.path = os.path.join(directory, JOURNAL_NAME)
        self.num_slots, self.num_layers = num_slots, num_layers
        self.record_bytes = _RECORD_HEAD.size + 8 * num_layers
        self._header = _HEADER.pack(_MAGIC, _VERSION, num_slots, slot_bytes, fingerprint.ljust(16, b"\0")[:16])
        dir_fd = open_directory(directory)
        try:
            self._fd = open_file(dir_fd, self.path, os.O_RDWR | os.O_CREAT, 0o600)
        finally:
            os.close(dir_fd)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self._fd)
            raise TierIOError(errno.EBUSY, "SSD tier directory is in use by another kvtier process", self.path) from e
        self.reused = self._open_or_reset()

    def record(self, slot: int, key: bytes, checksums: tuple[int, ...]) -> None:
        """Notes that `slot` now holds block `key` with these per-layer checksums."""
        if len(key) != 16 or len(checksums) != self.num_layers:
            raise ValueError(f"journal record needs a 16-byte key and {self.num_layers} checksums")
        data = _RECORD_HEAD.pack(_VALID, self.num_layers, key) + struct.pack(f"<{self.num_layers}Q", *checksums)
        self._pwrite(data, self._offset(slot))

    def forget(self, slot: int) -> None:
        """Marks `slot` as holding nothing."""
        self._pwrite(bytes(_RECORD_HEAD.size), self._offset(slot))

    def entries(self) -> Iterator[tuple[int, bytes, tuple[int, ...]]]:
        """Every (slot, key, checksums) recorded, in slot order."""
        size = self.record_bytes * self.num_slots
        data = os.pread(self._fd, size, HEADER_BYTES)
        for slot in range(len(data) // self.record_bytes):
            at = slot * self.record_bytes
            valid, layers, key = _RECORD_HEAD.unpack_from(data, at)
            if valid == _VALID and layers == self.num_layers:
                yield slot, key, struct.unpack_from(f"<{layers}Q", data, at + _RECORD_HEAD.size)

    def close(self) -> None:
        if self._fd >= 0:
            try:
                os.fsync(self._fd)
            finally:
                os.close(self._fd)  # releases the lock
                self._fd = -1

    def _open_or_reset(self) -> bool:
        """True if the file matched this geometry and its records stand; else it is reset."""
        if os.pread(self._fd, _HEADER.size, 0) == self._header:
            return True
        if os.fstat(self._fd).st_size:
            log.warning("SSD journal %s was written for another layout or geometry: starting empty", self.path)
        os.ftruncate(self._fd, 0)
        self._pwrite(self._header.ljust(HEADER_BYTES, b"\0"), 0)
        os.ftruncate(self._fd, HEADER_BYTES + self.record_bytes * self.num_slots)
        return False

    def _offset(self, slot: int) -> int:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"journal slot {slot} out of range [0, {self.num_slots})")
        return HEADER_BYTES + slot * self.record_bytes

    def _pwrite(self, data: bytes, offset: int) -> None:
        try:
            os.pwrite(self._fd, data, offset)
        except OSError as e:
            raise TierIOError(e.errno, f"SSD journal: write failed ({e.strerror})", self.path) from e
