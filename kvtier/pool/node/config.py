"""`NodeConfig`: how a pool node runs, as `kvtier pool serve` builds it from its flags."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvtier.pool.node.events import EventLimits
from kvtier.pool.node.store import MAX_LEASES_PER_OWNER, MAX_LEASES_PER_TENANT, MAX_RETAIN_S, RETAIN_FRACTION
from kvtier.pool.tenants import Tenant


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """How a node runs. Times in seconds. `max_connections` counts connections still in their
    handshake too, of which at most `max_handshakes` are kept (see `admission`)."""

    host: str
    port: int
    capacity_bytes: int
    tenants: dict[str, Tenant]
    region_bytes: int = 64 << 20
    transport: str = "tcp"
    transport_reason: str = "requested"
    verbs: str = "pyverbs"  # the verbs provider (`kvtier.pool.verbs.load_verbs`) under transport rdma
    hugepages: bool = False
    lease_s: float = 10.0  # read lease when a client asks for none longer
    max_lease_s: float = 60.0
    max_connections: int = 1024
    max_handshakes: int = 64
    handshake_timeout_s: float = 10.0  # for the whole handshake
    idle_timeout_s: float = 600.0
    max_leases_per_connection: int = MAX_LEASES_PER_OWNER
    max_leases_per_tenant: int = MAX_LEASES_PER_TENANT
    auth_free_failures: int = 5  # failed authentications a peer address may make before it is throttled
    auth_max_backoff_s: float = 60.0
    max_retain_s: float = MAX_RETAIN_S  # the longest soft lease (RETAIN) a tenant may set
    retain_fraction: float = RETAIN_FRACTION  # of each tenant's quota it may retain
    events: EventLimits = EventLimits()  # shared-tier KV events: subscribers, queues, replay ring
    node_id: str = field(default_factory=lambda: os.urandom(4).hex())
