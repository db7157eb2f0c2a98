"""The RDMA data plane: one-sided RDMA READ/WRITE on an RC queue pair into a node's regions.

The queue pair is set up over a control connection this transport owns (RDMA_CONNECT trades QP
number, PSN, GID; the reply carries `(addr, rkey, length)` of the tenant's regions). A batch
becomes chains of work requests, signalled every `signal_every`-th and last (selective
signalling: fewer completions to poll, and the send queue is freed in order); completions are
polled until a deadline.

Zero copy: host memory declared with `register_memory` (the runtime declares its DRAM tier's slab)
is registered once per connection, and a buffer inside it is the work request's own scatter/gather
entry, so the NIC reads a demoted block straight out of its DRAM slot and writes a loaded one
straight into it. Any other buffer (a caller's scratch tensor, pageable memory the runtime does not
own) goes through a registered staging buffer: one memcpy each way. `zero_copy_bytes` and
`staged_bytes` count which path each byte took.

What the node's CPU does not see it cannot check: a stale slot reads as True (callers verify the
checksum carried with every block); a region the tenant no longer holds reads as a miss; bounds
are checked here against the region, and the NIC enforces them against the MR.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtier.errors import TransferError
from kvtier.pool.base import Location, RemoteIO, Transport
from kvtier.pool.client.connection import NodeConnection, NodeLink, RemoteError
from kvtier.pool.protocol import MsgType
from kvtier.pool.verbs import Device, PeerInfo, QueuePair, load_verbs

STAGING_BYTES = 16 << 20
log = logging.getLogger(__name__)


class RDMATransport(Transport):
    """One RC queue pair to one node, connected lazily on first use; calls are serialized."""

    name = "rdma"
    inline = False
    detects_stale = False  # one-sided: the node's CPU never sees the access

    def __init__(self, link: NodeLink, *, signal_every: int = 16, max_batch_wr: int = 256,
                 staging_bytes: int = STAGING_BYTES, device: str | None = None, verbs: str = "pyverbs") -> None:
        self._link, self._device_name, self._verbs = link, device, verbs
        self.signal_every, self.max_batch_wr, self._staging_bytes = signal_every, max_batch_wr, staging_bytes
        self._lock = threading.Lock()
        self._closed = False
        self._conn: NodeConnection | None = None
        self._device: Device | None = None
        self._qp: QueuePair | None = None
        self._staging: Any = None
        self._regions: dict[int, tuple[int, int, int]] = {}  # id -> (addr, rkey, length)
        self._host_memory: list[tuple[int, int, object]] = []  # (address, length, owner) to register
        self._host_mrs: list[Any] = []  # their MRs on the current connection
        self.zero_copy_bytes = 0  # moved straight from/into registered host memory
        self.staged_bytes = 0  # copied through the staging buffer
        self.zero_copy_error: str | None = None  # why some declared memory could not be registered

    def read(self, location: Location, dst: memoryview) -> bool:
        return self.read_many([RemoteIO(location, dst)])[0]

    def write(self, location: Location, src: memoryview) -> bool:
        return self.write_many([RemoteIO(location, src)])[0]

    def read_many(self, ios: Sequence[RemoteIO], landed: Callable[[int], None] | None = None) -> list[bool]:
        """One-sided READs in chains of work requests; `landed(i)` once io i's chain completed (a
        chain completes as a whole: the ranges of one block in one chain land together)."""
        return self._run(ios, write=False, landed=landed)

    def write_many(self, ios: Sequence[RemoteIO]) -> list[bool]:
        return self._run(ios, write=True)

    def register_memory(self, address: int, length: int, owner: object) -> None:
        """Registers `[address, address + length)` for zero-copy I/O from the next batch on (now when
        connected, else at connect). Overlapping or repeated declarations are registered once.
        A registration the device refuses (most often `ulimit -l` below the slab's size) is logged
        and kept in `zero_copy_error`; buffers in that memory are then staged, which is slower but
        correct."""
        if length <= 0:
            raise ValueError(f"register_memory: length must be positive, got {length}")
        with self._lock:
            if any(a <= address and address + length <= a + n for a, n, _ in self._host_memory):
                return
            if self._qp is not None:
                self._register_host(address, length)
            self._host_memory.append((address, length, owner))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._teardown()
            self._host_memory = []

    # ---- connection -------------------------------------------------------------------------

    def _connect(self) -> None:
        v = load_verbs(self._verbs)
        self._device = Device(v, self._device_name)
        try:
            self._qp = QueuePair(self._device, max_send_wr=self.max_batch_wr)
            self._staging = self._device.register(self._staging_bytes)
            for address, length, _ in self._host_memory:
                self._register_host(address, length)
            self._conn = self._link.dedicated()
            reply = self._conn.call(MsgType.RDMA_CONNECT, self._qp.local_info().to_wire())
            self._qp.connect(PeerInfo.from_wire(reply))
        except RemoteError as e:
            self._teardown()
            raise TransferError(f"pool node {self._link.name}: refused RDMA: {e}") from None
        except v.Error as e:
            self._teardown()
            raise TransferError(f"pool node {self._link.name}: RDMA setup failed: {e}") from None
        except BaseException:
            self._teardown()
            raise
        self._set_regions(reply["regions"])

    def _register_host(self, address: int, length: int) -> None:
        try:
            self._host_mrs.append(self._device.register_local(length, address))
        except self._device.v.Error as e:
            self.zero_copy_error = (f"cannot register {length} bytes of host memory ({e}); its buffers are "
                                    "staged; check `ulimit -l` with `kvtier doctor`")
            log.warning("pool node %s: RDMA zero copy off: %s", self._link.name, self.zero_copy_error)

    def _teardown(self) -> None:
        for part in (self._qp, *self._host_mrs, self._staging, self._conn, self._device):
            if part is not None:
                part.close()
        self._qp = self._staging = self._conn = self._device = None
        self._host_mrs = []
        self._regions = {}

    def _lkey_of(self, address: int, length: int) -> int | None:
        """The lkey of a registered host MR holding `[address, address + length)`; None: stage it."""
        for mr in self._host_mrs:
            if mr.buf <= address and address + length <= mr.buf + mr.length:
                return mr.lkey
        return None

    def _set_regions(self, rows: list) -> None:
        self._regions = {r[0]: (r[1], r[2], r[3]) for r in rows}

    def _region(self, region_id: int) -> tuple[int, int, int] | None:
        if region_id not in self._regions:
            try:
                self._set_regions(self._conn.call(MsgType.RDMA_REGIONS, {})["regions"])
            except (RemoteError, TransferError) as e:
                self._teardown()
                raise TransferError(f"pool node {self._link.name}: {e}") from None
        return self._regions.get(region_id)

    # ---- batches ----------------------------------------------------------------------------

    def _run(self, ios: Sequence[RemoteIO], write: bool, landed: Callable[[int], None] | None = None) -> list[bool]:
        for io in ios:
            if len(io.buffer) != io.location.length:
                raise ValueError(f"buffer of {len(io.buffer)} bytes for a location of {io.location.length}")
        with self._lock:
            if self._closed:
                raise TransferError(f"pool node {self._link.name}: transport is closed")
            if not ios:
                return []
            if self._qp is None:
                self._connect()
            targets = [self._target(io.location) for io in ios]
            out = [False] * len(ios)
            todo = [i for i, t in enumerate(targets) if t is not None]
            for chunk in self._chunks(todo, ios):
                if self._qp is None:  # torn down after an error completion in the last chunk
                    self._connect()
                ok = self._post(chunk, ios, targets, write)
                for (i, _), good in zip(chunk, ok):
                    out[i] = good
                    if good and landed is not None:
                        landed(i)
            return out

    def _target(self, loc: Location) -> tuple[int, int] | None:
        """(remote address, rkey) of `loc`; None when the region is not the tenant's (a miss).

        Raises:
            TransferError: BOUNDS, the range is outside the region.
        """
        region = self._region(loc.region)
        if region is None:
            return None
        addr, rkey, length = region
        if loc.offset < 0 or loc.length < 0 or loc.offset + loc.length > length:
            raise TransferError(f"pool node {self._link.name}: BOUNDS: [{loc.offset}, {loc.offset + loc.length}) "
                                f"is outside region {loc.region} of {length} bytes")
        return addr + loc.offset, rkey

    def _chunks(self, todo: list[int], ios: Sequence[RemoteIO]) -> list[list[tuple[int, int | None]]]:
        """Runs of (io, lkey of its registered host memory or None) that fit the send queue, and
        the staging buffer together for those that need it."""
        chunks, current, staged = [], [], 0
        for i in todo:
            n = ios[i].location.length
            lkey = self._lkey_of(_address(ios[i].buffer), n) if self._host_mrs and n else None
            need = 0 if lkey is not None else n
            if need > self._staging.length:
                raise TransferError(f"a block of {n} bytes exceeds the RDMA staging buffer of {self._staging.length}")
            if current and (staged + need > self._staging.length or len(current) == self.max_batch_wr):
                chunks.append(current)
                current, staged = [], 0
            current.append((i, lkey))
            staged += need
        return chunks + [current] if current else chunks

    def _post(self, chunk: list[tuple[int, int | None]], ios: Sequence[RemoteIO], targets: list,
              write: bool) -> list[bool]:
        """One chain of work requests; per io whether it completed successfully."""
        v, staging = self._device.v, self._staging
        view = memoryview((ctypes.c_char * staging.length).from_address(staging.buf)).cast("B")
        opcode = v.e.IBV_WR_RDMA_WRITE if write else v.e.IBV_WR_RDMA_READ
        wrs, offsets, used = [], [], 0
        for k, (i, lkey) in enumerate(chunk):
            buf = ios[i].buffer
            n = len(buf)
            if lkey is not None:
                sge = v.SGE(_address(buf), n, lkey)
                offsets.append(None)
            else:
                if write:
                    view[used: used + n] = buf
                sge = v.SGE(staging.buf + used, n, staging.lkey)
                offsets.append(used)
                used += n
            last = k == len(chunk) - 1
            flags = v.e.IBV_SEND_SIGNALED if last or (k + 1) % self.signal_every == 0 else 0
            wr = v.SendWR(wr_id=k, opcode=opcode, num_sge=1, sg=[sge], send_flags=flags)
            wr.set_wr_rdma(targets[i][1], targets[i][0])
            if wrs:
                wrs[-1].next_wr = wr
            wrs.append(wr)
        try:
            self._qp.qp.post_send(wrs[0])
        except v.Error as e:
            self._teardown()
            raise TransferError(f"pool node {self._link.name}: RDMA post failed: {e}") from None
        first_bad = self._wait(len(chunk))
        for k, (i, _) in enumerate(chunk[:first_bad]):
            n = len(ios[i].buffer)
            if offsets[k] is None:
                self.zero_copy_bytes += n
            else:
                self.staged_bytes += n
                if not write:
                    ios[i].buffer[:] = view[offsets[k]: offsets[k] + n]
        return [k < first_bad for k in range(len(chunk))]

    def _wait(self, num_wrs: int) -> int:
        """Polls until the last work request completes; returns the index of the first that failed
        (`num_wrs` when none did). After an error the queue pair is torn down (it is in ERR and
        every later request would be flushed) and the next call reconnects; the failed and flushed
        requests are misses.

        Raises:
            TransferError: no completion within the link's timeout.
        """
        v, cq = self._device.v, self._device.cq
        deadline = time.monotonic() + self._link.timeout_s
        first_bad = num_wrs
        while True:
            n, wcs = cq.poll(num_entries=16)
            for wc in wcs[:n]:
                if wc.status != v.e.IBV_WC_SUCCESS:
                    first_bad = min(first_bad, wc.wr_id)
                if wc.wr_id == num_wrs - 1:
                    if first_bad < num_wrs:
                        self._teardown()
                    return first_bad
            if time.monotonic() > deadline:
                self._teardown()
                raise TransferError(f"pool node {self._link.name}: no RDMA completion within {self._link.timeout_s} s")


def _address(buffer: memoryview) -> int:
    """The address of a contiguous buffer's first byte (read-only buffers too)."""
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data) if len(buffer) else 0
