"""The memory pool: a node daemon holding KV blocks for many servers, and the client that reaches it.

Split by process role:
- shared by both ends: `protocol` (frames, sans-I/O), `wire` (frames on a socket), `tenants`,
  `base` (locations and the `Transport` interface), `verbs` and `detect` (the RDMA device layer),
  `buffers`;
- `node/`: the daemon (`node.server.PoolNode` over `node.store.BlockStore`, ...);
- `client/`: `client.api.PoolClient`, its transports, and `client.tier.PoolTier`;
- `mooncake`: a second pool backend, Mooncake Store.
Nothing here imports torch except `client.tier`, so a node starts in a fraction of a second.
"""
