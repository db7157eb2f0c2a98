"""A shared pool block laid out to be used as it arrives: per-chunk checksums first, then the bytes.

    [ "KVTC" | version u16 | 0 u16 | chunk_bytes u32 | num_chunks u32 ][ num_chunks x u64 ][ block ]

The bytes of one get arrive in order (an inline TCP reply streams off the socket; one-sided reads
of the parts land in turn), and a block is layer-major, so its first layers are in before the rest.
`StreamedRead` checks each chunk against the header as it lands and lets a reader take a byte
range as soon as every chunk under it is verified: a load can place layer 0 while layer 31 is
still on the wire, and no byte is delivered before it is checked. A chunk's checksum is xxh3-64
seeded with the key's digest plus the chunk's index, so a chunk moved within the block, or bytes
that landed under another key, fail. As for every keyed block, the node commits the whole object
only against its checksum, and the client checks it again once the get is done.

Chunks are about 1/16 of a block (at least 4 KiB): the header is 16 + 8 x 16 bytes, and a layer
is usable at most one chunk after its last byte arrived. The node keeps blocks in 4 KiB size
classes, so a header costs a 4 KiB page per block: a block is stored framed only where that is at
most 1/64 of its space (blocks of 256 KiB and more), plain otherwise (read whole, as it arrives in
one piece quickly anyway). A reader tells the two apart by the stored length.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable

import numpy as np
import torch
import xxhash

from kvtier.errors import TierIOError
from kvtier.moving import _movers

MAGIC, VERSION = b"KVTC", 1
_HEAD = struct.Struct("<4sHHII")
_U64 = (1 << 64) - 1
_MIN_CHUNK, _CHUNKS = 4096, 16
_PAGE = 4096  # the node's size classes (`pool.node.slabs.CLASS_ALIGN_BYTES`)


class BlockFrame:
    """The stored layout of a shared block of `slot_bytes` (see the module docstring)."""

    def __init__(self, slot_bytes: int) -> None:
        per = -(-slot_bytes // _CHUNKS)
        self.slot_bytes = slot_bytes
        self.chunk_bytes = min(slot_bytes, max(_MIN_CHUNK, -(-per // _MIN_CHUNK) * _MIN_CHUNK))
        self.num_chunks = -(-slot_bytes // self.chunk_bytes)
        self.header_bytes = _HEAD.size + 8 * self.num_chunks
        self.bounds = [(i * self.chunk_bytes, min((i + 1) * self.chunk_bytes, slot_bytes))
                       for i in range(self.num_chunks)]
        self._starts = np.array([a for a, _ in self.bounds], np.uint64)
        self._lengths = np.array([b - a for a, b in self.bounds], np.uint64)
        self._chunk_seeds = np.arange(self.num_chunks, dtype=np.uint64)
        pages = -(-slot_bytes // _PAGE)
        extra = -(-(slot_bytes + self.header_bytes) // _PAGE) - pages
        self.framed = extra * 64 <= pages  # what a writer stores (see the module docstring)
        self.stored_bytes = slot_bytes + (self.header_bytes if self.framed else 0)
        self._head = _HEAD.pack(MAGIC, VERSION, 0, self.chunk_bytes, self.num_chunks)

    def header(self, key: bytes, block: torch.Tensor) -> bytes:
        """The header of `block` (a contiguous CPU uint8 tensor of `slot_bytes`) stored under
        `key`: every chunk's checksum in one native pass (as `_sum` computes each)."""
        if block.numel() != self.slot_bytes or not block.is_contiguous() or not block.is_cpu or block.element_size() != 1:
            raise ValueError(f"a block frame needs {self.slot_bytes} contiguous bytes in host memory, got "
                             f"{block.dtype} {tuple(block.shape)} on {block.device}")
        seeds = self._chunk_seeds + np.uint64(_seed(key, 0))  # chunk i: _seed(key, i), wrapping mod 2**64
        sums = np.zeros(self.num_chunks, np.uint64)
        _movers.copy(self._starts + np.uint64(block.data_ptr()), None, self._lengths, seeds, sums)
        return self._head + sums.astype("<u8").tobytes()

    def is_header(self, header: memoryview) -> bool:
        """Whether `header` (a buffer) is this layout's header: its magic, version, chunk size and
        count (not the reserved field), without reading the sums out (a reader of the whole block
        checks the block, not its chunks)."""
        return (len(header) == self.header_bytes and header[:6] == self._head[:6]  # magic, version
                and header[8:_HEAD.size] == self._head[8:])  # chunk bytes, chunks (not the reserved u16)

    def checksums(self, header: torch.Tensor) -> list[int] | None:
        """The chunk checksums a header holds; None where it is not this layout's (another format,
        version or block size: a miss, never bytes taken as good)."""
        raw = header.numpy().tobytes()
        if not self.is_header(memoryview(raw)):
            return None
        return list(struct.unpack_from(f"<{self.num_chunks}Q", raw, _HEAD.size))

    def verify(self, key: bytes, sums: list[int], chunk: int, block: torch.Tensor) -> bool:
        a, b = self.bounds[chunk]
        return self._sum(key, chunk, memoryview(block.numpy())[a:b]) == sums[chunk]

    def parts(self, header: torch.Tensor | memoryview, block: torch.Tensor, length: int,
              chunked: bool = True) -> list[torch.Tensor] | None:
        """Where a get puts a stored object of `length` bytes: framed, the header then each chunk
        of `block` (`chunked`, for a reader that checks each as it lands) or `block` whole; plain,
        `block` whole; None for any other length (not this block size)."""
        if length == self.slot_bytes + self.header_bytes:
            return [header] + ([block[a:b] for a, b in self.bounds] if chunked else [block])
        return [block] if length == self.slot_bytes else None

    @staticmethod
    def _sum(key: bytes, chunk: int, data) -> int:
        return xxhash.xxh3_64_intdigest(data, seed=_seed(key, chunk))


def _seed(key: bytes, chunk: int) -> int:
    """The seed of chunk `chunk`'s checksum: the key's digest plus the chunk's place plus one."""
    return (xxhash.xxh3_64_intdigest(key) + chunk + 1) & _U64


_GONE = "not on the pool any more (evicted, node down or restarted) or failed its checksum"


def run_many(reads: list[StreamedRead], get_many: Callable[..., list[bool]]) -> None:
    """Fetches several blocks with one `get_many(keys, parts, landed, checks_parts)`
    (`PoolClient.get_streamed_many`: one GET per node), each checked and delivered as in `run`."""
    try:
        done = get_many([r.key for r in reads], lambda j, n: reads[j]._parts(n), lambda j, i: reads[j]._landed(i),
                        lambda j, n: reads[j]._checks_chunks(n))
    except Exception as e:  # a broken call: every block is a miss, their waiters are told
        for read in reads:
            read.finish(False, f"the read failed: {e!r}")
        return
    for read, ok in zip(reads, done):
        read.finish(ok)


class StreamedRead:
    """One shared block being fetched (`run`, on a fetch thread) and checked chunk by chunk; readers
    `wait` for the byte range they need and copy it out of `block`.

    Args:
        frame: the block's stored layout.
        key: the block's key.
    """

    def __init__(self, frame: BlockFrame, key: bytes) -> None:
        self.frame, self.key = frame, key
        buffer = torch.empty(frame.header_bytes + frame.slot_bytes, dtype=torch.uint8)
        self.header, self.block = buffer[: frame.header_bytes], buffer[frame.header_bytes:]
        self._sums: list[int] | None = None
        self._plain = False  # stored without a header: usable once the whole get is checked
        self._verified = 0  # bytes of the block, from its start, that are in and checked
        self._failed: str | None = None
        self._done = False
        self._cond = threading.Condition()

    def run(self, get: Callable[..., bool]) -> None:
        """Fetches the block with `get(key, parts, landed, checks_parts)` (`PoolClient.get_streamed`)."""
        try:
            self.finish(get(self.key, self._parts, self._landed, self._checks_chunks))
        except Exception as e:  # a broken call: the block is a miss, its waiters are told
            self.finish(False, f"the read failed: {e!r}")

    def finish(self, ok: bool, why: str = _GONE) -> None:
        """The get is over: `ok` (every part in and checked) or not, and why not."""
        why = None if ok else why
        with self._cond:
            self._done = True
            if why is not None and self._failed is None:
                self._failed = why
            if why is None and self._plain:  # the whole block is in and matched its checksum
                self._verified = self.frame.slot_bytes
            if self._verified < self.frame.slot_bytes and self._failed is None:
                self._failed = "the pool sent less than the whole block"
            self._cond.notify_all()

    def wait(self, end: int, timeout_s: float) -> None:
        """Returns once bytes `[0, end)` of the block are in and checked.

        Raises:
            TierIOError: the block is not on the pool, failed a check, or took over `timeout_s`.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._verified >= end or self._failed is not None, timeout_s):
                raise TierIOError(f"pool block {self.key.hex()[:16]}: not in after {timeout_s} s")
            if self._verified < end:
                raise TierIOError(f"pool block {self.key.hex()[:16]}: {self._failed}")

    @property
    def failed(self) -> bool:
        with self._cond:
            return self._failed is not None

    def _checks_chunks(self, length: int) -> bool:
        """Framed: every chunk is checked as it lands (`_landed`), the whole object need not be."""
        return length == self.frame.slot_bytes + self.frame.header_bytes

    def _parts(self, length: int) -> list[torch.Tensor] | None:
        parts = self.frame.parts(self.header, self.block, length)
        self._plain = parts is not None and len(parts) == 1
        return parts

    def _landed(self, part: int) -> None:
        """Part `part` of the get is in: the header (0), or chunk `part - 1` (framed only)."""
        if self._plain:
            return
        if part == 0:
            self._sums = self.frame.checksums(self.header)
            if self._sums is None:
                self._fail("its header is not a kvtier block of this size (another format or version)")
            return
        chunk = part - 1
        if self._sums is None:
            return
        if not self.frame.verify(self.key, self._sums, chunk, self.block):
            self._sums = None
            return self._fail(f"chunk {chunk} failed its checksum")
        with self._cond:
            self._verified = self.frame.bounds[chunk][1]
            self._cond.notify_all()

    def _fail(self, why: str) -> None:
        with self._cond:
            self._failed = self._failed or why
            self._cond.notify_all()
