"""The machine's own limits, and where the bench may write.

A limit moves the same bytes as the kvtier op it is paired with, at the same block size and queue
depth, with the least software a program can put in the way:

- `CopyLimit`: device <-> host copies. On a GPU, pinned `cudaMemcpy` (torch `copy_` between a pinned
  host tensor and a device tensor, then a stream synchronize); without one, memcpy (one thread: `tiers.base.copy_bytes`
  between two host tensors), since a CPU tensor stands in for HBM.
- `DirectIOLimit`: raw `pwrite`/`preadv` of each block, O_DIRECT exactly when the SSD tier has it,
  files striped like the tier's, from 4 KiB-aligned host memory.
- `SocketLimit`: a raw TCP transfer of each block to and from another process on loopback
  (`rawsock`), one connection per caller thread.

Each owns `num_blocks` blocks of host memory (and device memory for `CopyLimit`): its side never
finds the kvtier side's bytes in a cache. `spill(t, b)` moves block `b` down (toward the slower
medium) from caller thread `t`; `fill(t, b)` moves it back.
"""

from __future__ import annotations

import os
import tempfile

import torch

from kvtier.errors import TierIOError
from kvtier.pool.buffers import byte_view
from kvtier.tiers.base import copy_bytes
from kvtier.tiers.dram import aligned_host_memory



def host_buffer(num_blocks: int, block_bytes: int, pinned: bool) -> torch.Tensor:
    """A zeroed, page-aligned `[num_blocks, block_bytes]` uint8 host tensor (pinned when asked)."""
    return aligned_host_memory(num_blocks * block_bytes, pinned).view(num_blocks, block_bytes)


def random_fill(t: torch.Tensor) -> torch.Tensor:
    """Fills `t` with random bytes (touching every page, so no first-touch fault is ever timed)."""
    t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=t.device))
    return t


class CopyLimit:
    """Device <-> host block copies with nothing in between (see the module docstring)."""

    def __init__(self, num_blocks: int, block_bytes: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.spill_name = "pinned cudaMemcpy D2H" if self.cuda else "memcpy (one thread)"
        self.fill_name = "pinned cudaMemcpy H2D" if self.cuda else "memcpy (one thread)"
        self.host = host_buffer(num_blocks, block_bytes, pinned=self.cuda)
        self.device = random_fill(torch.empty((num_blocks, block_bytes), dtype=torch.uint8, device=device))

    def spill(self, t: int, block: int) -> None:
        self._copy(self.host[block], self.device[block])

    def fill(self, t: int, block: int) -> None:
        self._copy(self.device[block], self.host[block])

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.cuda:
            dst.copy_(src, non_blocking=True)
            torch.cuda.current_stream().synchronize()
        else:
            copy_bytes(dst, src)  # the fastest host copy here, as the runtime's own (see copy_bytes)

    def close(self) -> None:
        self.host = self.device = None


class DirectIOLimit:
    """Raw pwrite/preadv of whole blocks on preallocated files striped like the SSD tier's."""

    def __init__(self, directory: str, num_blocks: int, block_bytes: int, direct: bool, num_files: int = 4) -> None:
        kind = "O_DIRECT" if direct else "buffered"
        self.spill_name, self.fill_name = f"raw {kind} pwrite", f"raw {kind} pread"
        self.block_bytes, self.num_files = block_bytes, min(num_files, num_blocks)
        self.host = random_fill(host_buffer(num_blocks, block_bytes, pinned=torch.cuda.is_available()))
        self._views = [byte_view(self.host[b], writable=True, what="raw I/O buffer") for b in range(num_blocks)]
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)  # as the SSD tier opens its files
        self.paths: list[str] = []
        self.fds: list[int] = []
        try:
            for i in range(self.num_files):
                fd, path = tempfile.mkstemp(prefix=f"raw-{i}-", suffix=".bin", dir=directory)
                os.close(fd)
                self.paths.append(path)
                self.fds.append(os.open(path, flags))
                os.posix_fallocate(self.fds[-1], 0, -(-num_blocks // self.num_files) * block_bytes)
        except OSError as e:
            self.close()
            raise TierIOError(f"raw I/O files in {directory}: {e.strerror}") from None

    def spill(self, t: int, block: int) -> None:
        fd, offset = self._place(block)
        if os.pwrite(fd, self._views[block], offset) != self.block_bytes:
            raise TierIOError(f"raw pwrite of block {block}: short write")

    def fill(self, t: int, block: int) -> None:
        fd, offset = self._place(block)
        if os.preadv(fd, [self._views[block]], offset) != self.block_bytes:
            raise TierIOError(f"raw pread of block {block}: short read")

    def _place(self, block: int) -> tuple[int, int]:
        return self.fds[block % self.num_files], (block // self.num_files) * self.block_bytes

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        for path in self.paths:
            os.unlink(path)
        self.fds, self.paths, self._views, self.host = [], [], [], None


class SocketLimit:
    """Raw TCP puts and gets of whole blocks, one connection per caller thread."""

    spill_name, fill_name = "raw TCP send (loopback)", "raw TCP recv (loopback)"

    def __init__(self, server, num_blocks: int, block_bytes: int, num_threads: int) -> None:
        self.host = random_fill(host_buffer(num_blocks, block_bytes, pinned=torch.cuda.is_available()))
        self._views = [byte_view(self.host[b], writable=True, what="raw socket buffer") for b in range(num_blocks)]
        self._clients = [server.connect() for _ in range(num_threads)]

    def spill(self, t: int, block: int) -> None:
        self._clients[t].put(self._views[block])

    def fill(self, t: int, block: int) -> None:
        self._clients[t].get(self._views[block])

    def close(self) -> None:
        for c in self._clients:
            c.close()
        self._clients, self._views, self.host = [], [], None


# ---- where the bench may write ----------------------------------------------------------------


def check_ssd_dir(path: str | os.PathLike[str], need_bytes: int) -> None:
    """Refuses an SSD directory the bench should not write to, before anything is written.

    Raises:
        TierIOError: `path` is not an existing directory, sits on a read-only filesystem, refuses a
            new file, or its filesystem has fewer than `need_bytes` free for an unprivileged user.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise TierIOError(f"--ssd-dir {path}: no such directory")
    stat = os.statvfs(path)
    if stat.f_flag & os.ST_RDONLY:
        raise TierIOError(f"--ssd-dir {path}: the filesystem is mounted read-only; "
                          "give a directory on the SSD to test, on a writable filesystem")
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvtier-bench-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise TierIOError(f"--ssd-dir {path}: cannot create a file there: {e.strerror}") from None
    free = stat.f_bavail * stat.f_frsize
    if free < need_bytes:
        raise TierIOError(f"--ssd-dir {path}: the bench needs {_mib(need_bytes)} MiB there but the filesystem "
                          f"has {_mib(free)} MiB free; free some space, pick another directory, or pass "
                          "smaller --sizes")


def filesystem_of(path: str) -> str:
    """The filesystem type of the mount holding `path`, from /proc/mounts ("unknown" elsewhere)."""
    real, best, fstype = os.path.realpath(path), "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mount_point, kind, *_ = line.split()
                inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) > len(best):
                    best, fstype = mount_point, kind
    except OSError:
        pass
    return fstype


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"
