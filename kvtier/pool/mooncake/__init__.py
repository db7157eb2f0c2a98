"""The pool tier on Mooncake Store: `MooncakeClient` (keyed, checked blocks; the store's facts it
relies on are in `client`) and `MooncakeTier` (the slot adapter, shared by key as `PoolTier` is;
where shared blocks live and when they go is in `tier`)."""

from kvtier.pool.mooncake.client import BUFFER_TOO_SMALL, OBJECT_NOT_FOUND, TRAILER_BYTES, MooncakeClient, Outcome
from kvtier.pool.mooncake.tier import MooncakeTier, build_mooncake_tier

__all__ = ["BUFFER_TOO_SMALL", "OBJECT_NOT_FOUND", "TRAILER_BYTES", "MooncakeClient", "MooncakeTier", "Outcome",
           "build_mooncake_tier"]
