"""The client's side of the pool node's soft leases (issue 32): RETAIN and RELEASE_HINT.

`hint_by_home` sends one of them for each key's home node, cut at MAX_BATCH keys a frame. Both
came after the protocol's version 1: a node that predates them is found once per node by a probe
that changes nothing (`NodeLink.serves`, as ANNOUNCE is) and its keys are counted `not_served`;
a node that does not answer counts its keys `failed`. Nothing here raises but `AuthFailed`: a hint
is advice, never worth failing the caller.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvtier.errors import TransferError
from kvtier.pool.client.connection import AuthFailed, NodeLink
from kvtier.pool.protocol import MAX_BATCH, REPLIES, MsgType

log = logging.getLogger(__name__)
_PROBES = {MsgType.RETAIN: {"keys": [], "ttl_s": 0}, MsgType.RELEASE_HINT: {"keys": []}}


def hint_by_home(links: Sequence[NodeLink], home: Callable[[bytes], int], msg: MsgType, keys: Sequence[bytes],
                 fields: dict) -> dict[str, int]:
    """`msg` (RETAIN or RELEASE_HINT, with `fields` beside the keys) for each key at its home node.

    Returns:
        The reply's counts summed over nodes and frames, plus `not_served` (keys whose node predates
        the message) and `failed` (keys whose node was not reached or broke off).
    Raises:
        AuthFailed: a node refused the credentials.
    """
    out = dict.fromkeys((*REPLIES[msg], "not_served", "failed"), 0)
    groups: dict[int, list[bytes]] = {}
    for key in keys:
        groups.setdefault(home(key), []).append(key)
    for node, ks in groups.items():
        link, sent = links[node], 0
        try:
            if not link.serves(msg, _PROBES[msg]):
                out["not_served"] += len(ks)
                continue
            for lo in range(0, len(ks), MAX_BATCH):
                reply = link.call(msg, {"keys": ks[lo: lo + MAX_BATCH], **fields})
                for name, n in reply.items():
                    out[name] += n
                sent = min(lo + MAX_BATCH, len(ks))
        except AuthFailed:
            raise
        except TransferError as e:  # NodeUnavailable, RemoteError: this node's keys not yet answered
            log.debug("pool node %s: %s: %s", link.name, msg.name, e)
            out["failed"] += len(ks) - sent
    return out
