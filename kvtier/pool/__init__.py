"""The memory pool: a node daemon holding KV blocks for many servers, and the client that reaches it.

Node side: `server.PoolNode` (sockets, threads; `admission` its front door: connection, handshake
and authentication bounds) over `store.BlockStore` (index, states, data-plane checks; no I/O),
which keeps `slabs.Slabs` (allocator, quotas, eviction, zeroing on hand-over) and
`leases.LeaseTable` (bounded leases), and `arena.Arena` (the memory). Client side: `client.PoolClient` (keyed
blocks, placement over several nodes) over one `base.Transport` per node, and `tier.PoolTier`, the
manager's `Tier` view of it. Both speak `protocol` (frames, sans-I/O). Nothing here imports torch
except `tier`, so a node starts in a fraction of a second.
"""
