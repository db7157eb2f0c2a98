"""The pool client: `api.PoolClient` (keyed blocks, placement over nodes) and its transports.

`connection` (pooled control connections to a node), `tcp` and `rdma` (the data planes), `tier`
(`PoolTier`, the manager's `Tier` view of the pool)."""
