"""The pool node daemon: `server.PoolNode` and what it keeps.

`admission` (connection, handshake and authentication bounds), `store` (index, block states,
data-plane checks; no I/O), `slabs` (allocator, quotas, eviction, zeroing on hand-over), `leases`,
`blocks`, `arena` (the memory), `control` (control-plane handlers), `rdma` (the node's RDMA side),
`config`, and `process` (a node as a `kvtier pool serve` subprocess)."""
