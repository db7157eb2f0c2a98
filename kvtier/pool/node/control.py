"""The pool node's control-plane requests that move no block bytes: each a function of the store,
the connection's `Session` and the request's checked header, returning the reply header. The node
runs them under its lock (`PoolNode._dispatch`); requests that move bytes (PUT, GET, READ,
WRITE) and those that need the node itself (STATS, RDMA_*) stay in `server`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvtier.pool.protocol import MsgType
from kvtier.pool.node.store import BlockStore, Grant


@dataclass(frozen=True, slots=True)
class Session:
    """One authenticated connection: its tenant, the id its leases are held under, and whether its
    credential is the operator's (who sees node-wide STATS)."""

    tenant: str
    owner: int
    operator: bool


def put_begin(store: BlockStore, s: Session, h: dict) -> dict:
    return {"grants": [_grant(store.put_begin(s.tenant, k, n, h["lease_s"], s.owner))
                       for k, n in zip(h["keys"], h["lengths"])]}


def alloc(store: BlockStore, s: Session, h: dict) -> dict:
    return {"grants": [_grant(store.alloc(s.tenant, k, n)) for k, n in zip(h["keys"], h["lengths"])]}


def commit(store: BlockStore, s: Session, h: dict, holds: Callable | None = None) -> dict:
    """PUT_COMMIT; `holds` checks blocks written one-sided (see `BlockStore.commit`)."""
    return {"ok": [store.commit(s.tenant, k, g, c, holds) for k, g, c in zip(h["keys"], h["gens"], h["checksums"])]}


def abort(store: BlockStore, s: Session, h: dict) -> dict:
    for k, g in zip(h["keys"], h["gens"]):
        store.abort(s.tenant, k, g)
    return {}


def release(store: BlockStore, s: Session, h: dict) -> dict:
    store.release(s.tenant, h["leases"])
    return {}


def contains(store: BlockStore, s: Session, h: dict) -> dict:
    return {"found": store.contains(s.tenant, h["keys"], touch=True)}


def delete(store: BlockStore, s: Session, h: dict) -> dict:
    return {"deleted": store.delete(s.tenant, h["keys"])}


def retain(store: BlockStore, s: Session, h: dict) -> dict:
    out = store.retain(s.tenant, h["keys"], h["ttl_s"])
    return {"retained": out.retained, "over_budget": out.over_budget, "missing": out.missing}


def release_hint(store: BlockStore, s: Session, h: dict) -> dict:
    return {"released": store.release_hint(s.tenant, h["keys"])}


CONTROL: dict[MsgType, Callable[[BlockStore, Session, dict], dict]] = {
    MsgType.PUT_BEGIN: put_begin, MsgType.ALLOC: alloc, MsgType.PUT_COMMIT: commit, MsgType.PUT_ABORT: abort,
    MsgType.RELEASE: release, MsgType.CONTAINS: contains, MsgType.DELETE: delete,
    MsgType.RETAIN: retain, MsgType.RELEASE_HINT: release_hint}


def _grant(g: Grant) -> list[int]:
    b = g.block
    return [int(g.status), b.region.id, b.offset, b.gen, g.lease] if b is not None else [int(g.status), 0, 0, 0, 0]
