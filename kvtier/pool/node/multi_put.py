"""MULTI_PUT on the node: many blocks' PUTs in one frame, answered by one reply.

A frame carries parallel lists (keys, lengths, checksums) and, as its payload, the entries' bytes
one after another. The node:

1. checks that the lengths account for the payload exactly (else MALFORMED: the connection closes
   before a byte is read, nothing is reserved); the entry count is bounded by the header schema
   (`MAX_BATCH`) and the payload by the frame limit (a region), as every request is;
2. under the lock, reserves each entry as a single PUT does (`BlockStore.put_begin`, tenant's own
   key space, quota and lease bounds): a duplicate key in the same frame finds the first still
   WRITING and is answered BUSY;
3. outside the lock, receives each granted entry's bytes straight into its slot (the block is
   pinned, so never evicted or reused meanwhile) and drains the others, then hashes each received
   block with its key (`block_checksum`);
4. under the lock again, commits each entry whose bytes all came and match its checksum; the
   others are aborted (their slots freed now). A mismatch is answered CHECKSUM.

Why the node hashes here when a single PUT does not: a PUT's checksum is only stored (readers
check it), so a wrong one makes a block nobody can read, which costs one slot until eviction; in
a frame of many, one bad entry is worth telling its sender at once, and one pass of xxh3 over
bytes just received (~30 GB/s) is small beside receiving them. A connection that breaks mid-frame
commits nothing of the frame. The write leases have no owner: they end within this frame.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.pool import wire
from kvtier.pool.buffers import block_checksum
from kvtier.pool.node.arena import Arena
from kvtier.pool.node.blocks import Access, Grant
from kvtier.pool.node.store import BlockStore
from kvtier.pool.protocol import REPLY, GrantStatus, MsgType, check_multi_put


def serve_multi_put(store: BlockStore, arena: Arena, lock: Any, frames: wire.FrameSocket, tenant: str,
                    rid: int, header: dict, payload_len: int) -> None:
    """Serves one MULTI_PUT request (its header read, its payload not yet) and sends the reply.

    Args:
        lock: the node's store lock (held for the reservations and the commits, not the bytes).
    Raises:
        ProtocolError(MALFORMED): the lengths do not add up to the payload; nothing was reserved.
        OSError, ConnectionError: the connection broke; every reservation of the frame was undone.
    """
    check_multi_put(header, payload_len, rid)
    keys, lengths, checksums = header["keys"], header["lengths"], header["checksums"]
    with lock:
        grants, accesses = _reserve(store, tenant, keys, lengths, header["lease_s"])
    matched: list[bool] | None = None
    try:
        matched = [_receive(frames, arena, access, key, length, checksum)
                   for key, access, length, checksum in zip(keys, accesses, lengths, checksums)]
    finally:
        with lock:
            results = _finish(store, tenant, grants, accesses, checksums, matched)
    frames.send(REPLY | MsgType.MULTI_PUT, rid, {"results": results})


def _receive(frames: wire.FrameSocket, arena: Arena, access: Access | None, key: bytes, length: int,
             checksum: int) -> bool:
    """One entry's bytes: into its slot and hashed there at once (while the next entry's bytes
    arrive), or drained when it was not granted. Returns whether they match `checksum`."""
    if access is None:
        frames.drain(length)
        return False
    view = arena.view[access.arena_offset: access.arena_offset + length]
    frames.recv_into(view)
    return block_checksum(key, view) == checksum


def _reserve(store: BlockStore, tenant: str, keys: Sequence[bytes], lengths: Sequence[int],
             lease_s: float) -> tuple[list[Grant], list[Access | None]]:
    """`put_begin` of each entry (lock held), the granted ones pinned for their write; counts the
    bytes that will be drained for keys stored already."""
    grants = [store.put_begin(tenant, key, length, lease_s) for key, length in zip(keys, lengths)]
    accesses = [None if g.block is None else store.pin(g.block, write=True) for g in grants]
    duplicate = sum(n for g, n in zip(grants, lengths) if g.status is GrantStatus.EXISTS)
    if duplicate:
        store.count(tenant, "duplicate_put_bytes", duplicate)
    return grants, accesses


def _finish(store: BlockStore, tenant: str, grants: list[Grant], accesses: list[Access | None],
            checksums: Sequence[int], matched: list[bool] | None) -> list[tuple[int, bool]]:
    """Ends every pinned access (lock held) and commits the entries whose bytes came and match
    (`matched` None: the frame broke, nothing commits); returns (status, stored) per entry."""
    results = []
    for grant, access, checksum, ok in zip(grants, accesses, checksums, matched or [False] * len(grants)):
        if access is None:
            results.append((int(grant.status), False))
            continue
        block = access.block
        store.end_access(access, ok)
        if ok:
            store.count(tenant, "bytes_in", access.length)
            results.append((int(grant.status), store.commit(tenant, block.key, block.gen, checksum)))
            continue
        store.abort(tenant, block.key, block.gen)
        if matched is not None:
            store.count(tenant, "rejected_checksum")
        results.append((int(GrantStatus.CHECKSUM if matched is not None else grant.status), False))
    return results
