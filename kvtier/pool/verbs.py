"""Verbs plumbing shared by the node and the client: loading pyverbs (or the fake), enum names
across rdma-core versions, RoCEv2 GID selection, and one RC queue pair's state machine.

pyverbs is imported lazily, only here, only when RDMA is used. Another provider with pyverbs' class
and method names (the test double `kvtier.testing.fake_verbs`, an out-of-tree one) is passed in by
module name, as the `verbs` argument of the node, the client and the pool tier; nothing here
chooses one from the environment.

Enum layouts differ: rdma-core 44 exposes `pyverbs.enums` with module-level names
(`e.IBV_QPS_RTS`) besides enum classes; newer releases generate `pyverbs.libibverbs_enums`, where a
name may live only inside its enum class (`ibv_qp_state.IBV_QPS_RTS`). `Enums` resolves a name
in either place.
"""

from __future__ import annotations

import enum
import importlib
import ipaddress
import random
import types
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError, TransferError

PYVERBS = "pyverbs"  # the provider every production path uses


class NoRDMADevice(TransferError):
    """No RDMA device can be opened here (none exists, no kernel support, or pyverbs is missing)."""


class Enums:
    """`Enums(module).IBV_QPS_RTS` finds the name at module level or inside any enum class."""

    def __init__(self, module: types.ModuleType) -> None:
        self._module = module
        self._cache: dict[str, int] = {}

    def __getattr__(self, name: str) -> int:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._cache:
            self._cache[name] = self._find(name)
        return self._cache[name]

    def _find(self, name: str) -> int:
        value = getattr(self._module, name, None)
        if value is not None:
            return value
        for holder in vars(self._module).values():
            if isinstance(holder, type) and issubclass(holder, enum.Enum) and name in holder.__members__:
                return holder.__members__[name]
        raise AttributeError(f"{self._module.__name__} has no verbs constant {name}")


def load_verbs(provider: str = PYVERBS) -> types.SimpleNamespace:
    """The verbs classes of `provider`: "pyverbs" (rdma-core's), or the name of a module with the
    same class and method names in one namespace (`kvtier.testing.fake_verbs`).

    Raises:
        NoRDMADevice: pyverbs is not installed.
        ConfigError: `provider` is not importable or lacks a name the transports use.
    """
    if provider != PYVERBS:
        return _provider(provider)
    try:
        mods = {m: importlib.import_module(f"pyverbs.{m}") for m in ("device", "pd", "mr", "cq", "qp", "addr", "wr")}
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError as e:
        raise NoRDMADevice(f"no RDMA device: pyverbs is not importable ({e}); install python3-pyverbs") from None
    try:
        enums = importlib.import_module("pyverbs.enums")
    except ImportError:
        enums = importlib.import_module("pyverbs.libibverbs_enums")
    found = {n: getattr(mods[m], n) for m, names in _WHERE.items() for n in names}
    return types.SimpleNamespace(**found, e=Enums(enums), Error=PyverbsError, kind="pyverbs")


def _provider(name: str) -> types.SimpleNamespace:
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise ConfigError(f"verbs provider {name!r} cannot be imported: {e}") from None
    missing = [n for n in (*_NAMES, "PyverbsError") if not hasattr(module, n)]
    if missing:
        raise ConfigError(f"verbs provider {name!r} lacks {', '.join(missing)} (pyverbs' names are needed)")
    return types.SimpleNamespace(**{n: getattr(module, n) for n in _NAMES}, e=Enums(module),
                                 Error=module.PyverbsError, kind=name)


_WHERE = {"device": ("Context", "get_device_list"), "pd": ("PD",), "mr": ("MR",), "cq": ("CQ",),
          "qp": ("QP", "QPInitAttr", "QPAttr", "QPCap"), "addr": ("GID", "GlobalRoute", "AHAttr"),
          "wr": ("SGE", "SendWR")}
_NAMES = tuple(n for names in _WHERE.values() for n in names)


def device_names(v: types.SimpleNamespace) -> list[str]:
    """Names of the devices verbs can open.

    Raises:
        NoRDMADevice: none, with the reason (e.g. no kernel support: the device list call fails).
    """
    try:
        devices = v.get_device_list()
    except v.Error as e:
        raise NoRDMADevice(f"no RDMA device ({e}: no RDMA kernel support or no device)") from None
    names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]
    if not names:
        raise NoRDMADevice("no RDMA device (the device list is empty)")
    return names


# ---- GID selection --------------------------------------------------------------------------

class GidType(enum.Enum):
    IB = "IB"
    ROCE_V1 = "RoCE v1"
    ROCE_V2 = "RoCE v2"


@dataclass(frozen=True, slots=True)
class GidEntry:
    """One row of a port's GID table."""

    port: int
    index: int
    gid: str  # eight colon-separated groups, as pyverbs prints it
    gid_type: GidType
    port_active: bool


def _rank(entry: GidEntry) -> tuple[int, ...] | None:
    try:
        addr = ipaddress.IPv6Address(entry.gid)
    except ValueError:
        return None
    if addr.is_unspecified or not entry.port_active:
        return None
    v2 = entry.gid_type is GidType.ROCE_V2
    return (v2, v2 and addr.ipv4_mapped is not None, not addr.is_link_local, entry.gid_type is GidType.IB,
            -entry.port, -entry.index)


def select_gid(table: list[GidEntry]) -> GidEntry | None:
    """The GID to address a peer from: on an active port, RoCE v2 before v1, IPv4-mapped (routable
    over an IPv4 network, as RoCEv2 deployments are) before other global, global before link-local;
    among equals the lowest port and index. None when the table has no usable entry.

    Why: index 0 is a RoCE v1 / link-local GID on Ethernet ports; a QP addressed from it does not
    reach a peer across an IP router, the usual first failure in RoCE bring-up.
    """
    ranked = [(r, e) for e in table if (r := _rank(e)) is not None]
    return max(ranked, key=lambda pair: pair[0])[1] if ranked else None


def gid_table(v: types.SimpleNamespace, ctx: Any) -> list[GidEntry]:
    """Every non-empty GID of every port of an open device context."""
    out = []
    for port in range(1, ctx.query_device().phys_port_cnt + 1):
        attr = ctx.query_port(port)
        active = attr.state == v.e.IBV_PORT_ACTIVE
        for index in range(attr.gid_tbl_len):
            try:
                gid = str(ctx.query_gid(port, index))
                kind = ctx.query_gid_type(port, index)
            except v.Error:
                continue
            out.append(GidEntry(port, index, gid, _gid_type(v, kind, attr), active))
    return out


def _gid_type(v: types.SimpleNamespace, kind: int, port_attr: Any) -> GidType:
    if port_attr.link_layer == v.e.IBV_LINK_LAYER_INFINIBAND:
        return GidType.IB
    # `ibv_query_gid_type` answers in `ibv_gid_type_sysfs` (0: IB or RoCE v1, 1: RoCE v2), not in
    # `ibv_gid_type` (where RoCE v2 is 2): seen on rxe, where every GID read as RoCE v1 before.
    return GidType.ROCE_V2 if kind == v.e.IBV_GID_TYPE_SYSFS_ROCE_V2 else GidType.ROCE_V1


# ---- one RC queue pair ----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PeerInfo:
    """What each end tells the other over the control plane to connect RC queue pairs."""

    qpn: int
    psn: int
    gid: str
    lid: int
    mtu: int  # the port's active MTU enum value

    def to_wire(self) -> dict[str, Any]:
        return {"qpn": self.qpn, "psn": self.psn, "gid": self.gid, "lid": self.lid, "mtu": self.mtu}

    @classmethod
    def from_wire(cls, h: dict[str, Any]) -> PeerInfo:
        return cls(h["qpn"], h["psn"], h["gid"], h["lid"], h["mtu"])


class Device:
    """One opened device: context, protection domain, completion queue, the chosen port and GID.
    Owns them; `close()` releases them (queue pairs and MRs made on it first)."""

    def __init__(self, v: types.SimpleNamespace, name: str | None = None, cqe: int = 4096) -> None:
        names = device_names(v)
        self.v, self.name = v, name or names[0]
        self.ctx = v.Context(name=self.name)
        try:
            gid = select_gid(gid_table(v, self.ctx))
            if gid is None:
                raise NoRDMADevice(f"RDMA device {self.name}: no active port with a usable GID")
            self.gid = gid
            port = self.ctx.query_port(gid.port)
            self.lid, self.mtu = port.lid, port.active_mtu
            self.pd = v.PD(self.ctx)
            self.cq = v.CQ(self.ctx, cqe, None, None, 0)
        except BaseException:
            self.ctx.close()
            raise

    def register(self, length: int, address: int | None = None) -> Any:
        """An MR over `length` bytes at `address` (or fresh memory), remotely readable and writable."""
        e = self.v.e
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        if address is None:
            return self.v.MR(self.pd, length, access)
        return self.v.MR(self.pd, length, access, address=address)

    def register_local(self, length: int, address: int) -> Any:
        """An MR over caller-owned memory that only this side's NIC touches: the source of RDMA
        WRITEs and the destination of READs (local write access only, no rkey worth sharing)."""
        return self.v.MR(self.pd, length, self.v.e.IBV_ACCESS_LOCAL_WRITE, address=address)

    def close(self) -> None:
        self.ctx.close()  # pyverbs closes what was created on the context with it


class QueuePair:
    """An RC queue pair on `device`, moved RESET → INIT → RTR → RTS by `connect(peer)`."""

    def __init__(self, device: Device, max_send_wr: int = 1024) -> None:
        v, self.device = device.v, device
        cap = v.QPCap(max_send_wr=max_send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = v.QPInitAttr(qp_type=v.e.IBV_QPT_RC, scq=device.cq, rcq=device.cq, cap=cap, sq_sig_all=0)
        self.qp = v.QP(device.pd, init)
        self.max_send_wr = max_send_wr
        self.psn = random.getrandbits(24)

    def local_info(self) -> PeerInfo:
        d = self.device
        return PeerInfo(self.qp.qp_num, self.psn, d.gid.gid, d.lid, int(d.mtu))

    def connect(self, peer: PeerInfo) -> None:
        """RESET → INIT → RTR → RTS towards `peer`. Raises the verbs error of a refused step."""
        v, e, d = self.device.v, self.device.v.e, self.device
        for attr, mask in (init_attr(v, d.gid.port), rtr_attr(v, d.gid, peer, min(int(d.mtu), peer.mtu)),
                           rts_attr(v, self.psn)):
            self.qp.modify(attr, mask)
        if self.qp.qp_state != e.IBV_QPS_RTS:
            raise TransferError(f"queue pair {self.qp.qp_num} is in state {self.qp.qp_state}, not RTS")

    def close(self) -> None:
        self.qp.close()


def init_attr(v: types.SimpleNamespace, port: int) -> tuple[Any, int]:
    e = v.e
    attr = v.QPAttr(qp_state=e.IBV_QPS_INIT)
    attr.pkey_index, attr.port_num = 0, port
    attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
    return attr, e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS


def rtr_attr(v: types.SimpleNamespace, local: GidEntry, peer: PeerInfo, mtu: int) -> tuple[Any, int]:
    e = v.e
    attr = v.QPAttr(qp_state=e.IBV_QPS_RTR)
    attr.path_mtu, attr.dest_qp_num, attr.rq_psn = mtu, peer.qpn, peer.psn
    attr.max_dest_rd_atomic, attr.min_rnr_timer = 16, 12
    route = v.GlobalRoute(dgid=v.GID(peer.gid), sgid_index=local.index, hop_limit=64)
    attr.ah_attr = v.AHAttr(gr=route, is_global=1, port_num=local.port, dlid=peer.lid)
    return attr, (e.IBV_QP_STATE | e.IBV_QP_AV | e.IBV_QP_PATH_MTU | e.IBV_QP_DEST_QPN | e.IBV_QP_RQ_PSN
                  | e.IBV_QP_MAX_DEST_RD_ATOMIC | e.IBV_QP_MIN_RNR_TIMER)


def rts_attr(v: types.SimpleNamespace, psn: int) -> tuple[Any, int]:
    e = v.e
    attr = v.QPAttr(qp_state=e.IBV_QPS_RTS)
    attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.sq_psn, attr.max_rd_atomic = 14, 7, 7, psn, 16
    return attr, (e.IBV_QP_STATE | e.IBV_QP_TIMEOUT | e.IBV_QP_RETRY_CNT | e.IBV_QP_RNR_RETRY | e.IBV_QP_SQ_PSN
                  | e.IBV_QP_MAX_QP_RD_ATOMIC)
