"""A fake verbs module for tests: pyverbs' class and method names, a NIC emulated in software.

It exists because no RDMA device is here (STYLE rule 9: a fake only for what cannot run). It is
passed in by name (`verbs: kvtier.testing.fake_verbs`, `--verbs ...`) and needs `KVTIER_FAKE_FABRIC=DIR`, a directory shared by the
processes on the "fabric"; without it there is no device, as on a host without RDMA.

What it emulates, because the transport depends on it:
- one device `fake0`, one active Ethernet port, a GID table with a RoCE v1 link-local and a RoCE v2
  IPv4-mapped entry;
- the RC state machine RESET → INIT → RTR → RTS: an illegal transition raises and changes nothing,
  posting on a QP that is not RTS (or whose peer is not connected back) fails;
- one-sided RDMA READ/WRITE against a *remote process's* memory named by (addr, rkey): the memory
  region's owner writes `mr-<rkey>` into the fabric directory, the initiator checks bounds and access
  flags there and moves the bytes with process_vm_readv/writev, so the target's CPU does nothing;
- memory registration fails with ENOMEM past `KVTIER_FAKE_MEMLOCK` bytes per process, as past
  `ulimit -l` on a real host; an access through a deregistered MR's rkey completes with
  REM_ACCESS_ERR, as on hardware;
- completions: only signalled work requests complete, except errors, which always do; after an
  error the QP enters ERR and the rest of the chain completes with WR_FLUSH_ERR.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

ENV_FABRIC = "KVTIER_FAKE_FABRIC"
ENV_MEMLOCK = "KVTIER_FAKE_MEMLOCK"  # bytes this process may register, as RLIMIT_MEMLOCK caps a real one

# Values as in <infiniband/verbs.h>.
IBV_QPT_RC = 2
IBV_QPS_RESET, IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS, IBV_QPS_SQD, IBV_QPS_SQE, IBV_QPS_ERR = range(7)
IBV_QP_STATE, IBV_QP_ACCESS_FLAGS, IBV_QP_PKEY_INDEX, IBV_QP_PORT = 1, 8, 16, 32
IBV_QP_AV, IBV_QP_PATH_MTU, IBV_QP_TIMEOUT, IBV_QP_RETRY_CNT, IBV_QP_RNR_RETRY = 128, 256, 512, 1024, 2048
IBV_QP_RQ_PSN, IBV_QP_MAX_QP_RD_ATOMIC, IBV_QP_MIN_RNR_TIMER, IBV_QP_SQ_PSN = 4096, 8192, 32768, 65536
IBV_QP_MAX_DEST_RD_ATOMIC, IBV_QP_DEST_QPN = 131072, 1048576
IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_WRITE, IBV_ACCESS_REMOTE_READ = 1, 2, 4
IBV_WR_RDMA_WRITE, IBV_WR_RDMA_READ = 0, 4
IBV_SEND_SIGNALED = 2
IBV_WC_SUCCESS, IBV_WC_LOC_PROT_ERR, IBV_WC_WR_FLUSH_ERR, IBV_WC_REM_ACCESS_ERR = 0, 4, 5, 10
IBV_PORT_DOWN, IBV_PORT_ACTIVE = 1, 4
IBV_MTU_1024, IBV_MTU_4096 = 3, 5
IBV_LINK_LAYER_INFINIBAND, IBV_LINK_LAYER_ETHERNET = 1, 2
IBV_GID_TYPE_IB, IBV_GID_TYPE_ROCE_V1, IBV_GID_TYPE_ROCE_V2 = 0, 1, 2
# What `query_gid_type` answers, as rdma-core's does: `ibv_gid_type_sysfs`, not `ibv_gid_type`.
IBV_GID_TYPE_SYSFS_IB_ROCE_V1, IBV_GID_TYPE_SYSFS_ROCE_V2 = 0, 1

_TRANSITIONS = {(IBV_QPS_RESET, IBV_QPS_INIT), (IBV_QPS_INIT, IBV_QPS_INIT), (IBV_QPS_INIT, IBV_QPS_RTR),
                (IBV_QPS_RTR, IBV_QPS_RTS), (IBV_QPS_RTS, IBV_QPS_RTS)}
_GIDS = [("fe80:0000:0000:0000:0000:0000:0000:0001", IBV_GID_TYPE_SYSFS_IB_ROCE_V1),
         ("0000:0000:0000:0000:0000:ffff:7f00:0001", IBV_GID_TYPE_SYSFS_ROCE_V2)]
_ids = itertools.count(1)


class PyverbsError(Exception):
    pass


class PyverbsRDMAError(PyverbsError):
    pass


def _fabric() -> Path:
    path = os.environ.get(ENV_FABRIC)
    if not path or not Path(path).is_dir():
        raise PyverbsRDMAError("Failed to get devices list")
    return Path(path)


def _next_id() -> int:
    # Unique across the fabric's processes, and not reused soon within one: a node registers a
    # region anew on each hand-over to another tenant, and the old rkey must stay dead (hardware
    # varies an rkey's key byte for the same reason).
    return (os.getpid() & 0xFFFF) << 16 | next(_ids) & 0xFFFF


def get_device_list() -> list[SimpleNamespace]:
    _fabric()
    return [SimpleNamespace(name=b"fake0")]


class Context:
    def __init__(self, name: str = "fake0") -> None:
        self.fabric, self.name = _fabric(), name

    def query_device(self) -> SimpleNamespace:
        return SimpleNamespace(phys_port_cnt=1, max_qp_wr=4096, max_mr_size=1 << 40)

    def query_port(self, port: int) -> SimpleNamespace:
        return SimpleNamespace(state=IBV_PORT_ACTIVE, active_mtu=IBV_MTU_1024, max_mtu=IBV_MTU_4096, lid=0,
                               link_layer=IBV_LINK_LAYER_ETHERNET, gid_tbl_len=len(_GIDS))

    def query_gid(self, port: int, index: int) -> GID:
        return GID(_GIDS[index][0])

    def query_gid_type(self, port: int, index: int) -> int:
        return _GIDS[index][1]

    def close(self) -> None:
        pass


class PD:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def close(self) -> None:
        pass


class MR:
    """Registers `length` bytes at `address` (or fresh zeroed memory) on the fabric."""

    _local: ClassVar[dict[int, MR]] = {}  # lkey -> MR of this process

    def __init__(self, pd: PD, length: int, access: int, address: int | None = None) -> None:
        limit = os.environ.get(ENV_MEMLOCK)
        pinned = sum(mr.length for mr in MR._local.values())
        if limit is not None and pinned + length > int(limit):
            raise PyverbsRDMAError(f"Failed to register a MR. Errno: 12, Cannot allocate memory "
                                   f"({pinned + length} bytes pinned > {ENV_MEMLOCK}={limit})")
        self._mem = None if address is not None else ctypes.create_string_buffer(length)
        self.buf = address if address is not None else ctypes.addressof(self._mem)
        self.length, self.access = length, access
        self.lkey = self.rkey = _next_id()
        self._file = pd.ctx.fabric / f"mr-{self.rkey}"
        self._file.write_text(json.dumps({"pid": os.getpid(), "addr": self.buf, "length": length, "access": access}))
        MR._local[self.lkey] = self

    def close(self) -> None:
        MR._local.pop(self.lkey, None)
        self._file.unlink(missing_ok=True)


class CQ:
    def __init__(self, ctx: Context, cqe: int, cq_context: Any = None, channel: Any = None, comp_vector: int = 0) -> None:
        self._wcs: deque[WC] = deque()

    def poll(self, num_entries: int = 1) -> tuple[int, list[WC]]:
        out = [self._wcs.popleft() for _ in range(min(num_entries, len(self._wcs)))]
        return len(out), out

    def close(self) -> None:
        pass


class WC:
    def __init__(self, wr_id: int, status: int, opcode: int, qp_num: int) -> None:
        self.wr_id, self.status, self.opcode, self.qp_num = wr_id, status, opcode, qp_num


class GID:
    def __init__(self, val: str) -> None:
        self.gid = val

    def __str__(self) -> str:
        return self.gid


class GlobalRoute:
    def __init__(self, dgid: GID | None = None, sgid_index: int = 0, hop_limit: int = 1, **_: Any) -> None:
        self.dgid, self.sgid_index, self.hop_limit = dgid, sgid_index, hop_limit


class AHAttr:
    def __init__(self, gr: GlobalRoute | None = None, is_global: int = 0, port_num: int = 1, dlid: int = 0, **_: Any) -> None:
        self.gr, self.is_global, self.port_num, self.dlid = gr, is_global, port_num, dlid


class QPCap:
    def __init__(self, max_send_wr: int = 1, max_recv_wr: int = 1, max_send_sge: int = 1, max_recv_sge: int = 1) -> None:
        self.max_send_wr, self.max_recv_wr = max_send_wr, max_recv_wr
        self.max_send_sge, self.max_recv_sge = max_send_sge, max_recv_sge


class QPInitAttr:
    def __init__(self, qp_type: int = IBV_QPT_RC, scq: CQ | None = None, rcq: CQ | None = None,
                 cap: QPCap | None = None, sq_sig_all: int = 0, **_: Any) -> None:
        self.qp_type, self.scq, self.rcq, self.cap, self.sq_sig_all = qp_type, scq, rcq, cap or QPCap(), sq_sig_all


class QPAttr:
    def __init__(self, qp_state: int = IBV_QPS_RESET, **kwargs: Any) -> None:
        self.qp_state, self.dest_qp_num, self.ah_attr = qp_state, 0, None
        self.__dict__.update(kwargs)


class SGE:
    def __init__(self, addr: int, length: int, lkey: int) -> None:
        self.addr, self.length, self.lkey = addr, length, lkey


class SendWR:
    def __init__(self, wr_id: int = 0, opcode: int = IBV_WR_RDMA_WRITE, num_sge: int = 1,
                 sg: list[SGE] | None = None, send_flags: int = 0) -> None:
        if not sg:
            raise PyverbsError("A WR needs at least one SGE")
        self.wr_id, self.opcode, self.sg, self.send_flags = wr_id, opcode, sg, send_flags
        self.next_wr: SendWR | None = None
        self.rkey = self.remote_addr = 0

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        self.rkey, self.remote_addr = rkey, addr


class QP:
    def __init__(self, pd: PD, init_attr: QPInitAttr) -> None:
        self.fabric, self.cq = pd.ctx.fabric, init_attr.scq
        self.sig_all, self.max_send_wr = init_attr.sq_sig_all, init_attr.cap.max_send_wr
        self.qp_num, self.qp_state, self.dest_qp_num = _next_id(), IBV_QPS_RESET, 0
        self._publish()

    def modify(self, attr: QPAttr, attr_mask: int) -> None:
        if (self.qp_state, attr.qp_state) not in _TRANSITIONS and attr.qp_state not in (IBV_QPS_RESET, IBV_QPS_ERR):
            raise PyverbsRDMAError(f"Failed to modify QP state {self.qp_state} -> {attr.qp_state}")
        if attr.qp_state == IBV_QPS_RTR and not attr_mask & IBV_QP_DEST_QPN:
            raise PyverbsRDMAError("Failed to modify QP: RTR needs dest_qp_num")
        if attr.qp_state == IBV_QPS_RTR:
            self.dest_qp_num = attr.dest_qp_num
        self.qp_state = attr.qp_state
        self._publish()

    def post_send(self, wr: SendWR, bad_wr: Any = None) -> None:
        chain = []
        while wr is not None:
            chain.append(wr)
            wr = wr.next_wr
        if self.qp_state != IBV_QPS_RTS or len(chain) > self.max_send_wr:
            raise PyverbsRDMAError(f"Failed to post send (QP state {self.qp_state}, {len(chain)} WRs)")
        for w in chain:
            status = self._execute(w) if self.qp_state == IBV_QPS_RTS else IBV_WC_WR_FLUSH_ERR
            if status != IBV_WC_SUCCESS:
                self.qp_state = IBV_QPS_ERR
                self._publish()
            if status != IBV_WC_SUCCESS or self.sig_all or w.send_flags & IBV_SEND_SIGNALED:
                self.cq._wcs.append(WC(w.wr_id, status, w.opcode, self.qp_num))

    def close(self) -> None:
        (self.fabric / f"qp-{self.qp_num}").unlink(missing_ok=True)

    def _publish(self) -> None:
        (self.fabric / f"qp-{self.qp_num}").write_text(json.dumps([self.qp_state, self.dest_qp_num]))

    def _execute(self, w: SendWR) -> int:
        try:
            state, back = json.loads((self.fabric / f"qp-{self.dest_qp_num}").read_text())
            remote = json.loads((self.fabric / f"mr-{w.rkey}").read_text())
        except (OSError, ValueError):
            return IBV_WC_REM_ACCESS_ERR
        if state not in (IBV_QPS_RTR, IBV_QPS_RTS) or back != self.qp_num:
            return IBV_WC_REM_ACCESS_ERR
        sge = w.sg[0]
        local = MR._local.get(sge.lkey)
        if local is None or not local.buf <= sge.addr <= sge.addr + sge.length <= local.buf + local.length:
            return IBV_WC_LOC_PROT_ERR
        if w.opcode == IBV_WR_RDMA_READ and not local.access & IBV_ACCESS_LOCAL_WRITE:
            return IBV_WC_LOC_PROT_ERR  # a READ lands in local memory: the MR must allow local writes
        need = IBV_ACCESS_REMOTE_WRITE if w.opcode == IBV_WR_RDMA_WRITE else IBV_ACCESS_REMOTE_READ
        start = remote["addr"]
        if not remote["access"] & need or not start <= w.remote_addr <= w.remote_addr + sge.length <= start + remote["length"]:
            return IBV_WC_REM_ACCESS_ERR
        moved = _move(remote["pid"], sge.addr, w.remote_addr, sge.length, write=w.opcode == IBV_WR_RDMA_WRITE)
        return IBV_WC_SUCCESS if moved else IBV_WC_REM_ACCESS_ERR


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)


def _move(pid: int, local: int, remote: int, length: int, write: bool) -> bool:
    """Copies between this process and `pid`'s memory, as the NIC's DMA would."""
    if length == 0:
        return True
    if pid == os.getpid():
        src, dst = (local, remote) if write else (remote, local)
        ctypes.memmove(dst, src, length)
        return True
    liov, riov = _IOVec(local, length), _IOVec(remote, length)
    call = _libc.process_vm_writev if write else _libc.process_vm_readv
    return call(pid, ctypes.byref(liov), 1, ctypes.byref(riov), 1, 0) == length
