"""`kvtier pool serve` runs a memory pool node; `kvtier pool stats` asks one what it holds;
`kvtier pool events` republishes a tenant's KV events from a node on ZMQ (`pool_events`).

`serve` prints one JSON line `{"event": "ready", "listen": "HOST:PORT", "transport": ...}` on stdout
once it accepts connections (tools and tests wait for it; with port 0 it carries the port chosen),
logs to stderr, and on SIGTERM or SIGINT stops accepting, finishes the requests in flight, prints
`{"event": "stopped"}` and exits 0. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import signal
import sys
import threading
from typing import Any

from kvtier.errors import ConfigError
from kvtier.tiers.host_memory import allocation_failed, check_fits
from kvtier.pool.node.store import MAX_LEASES_PER_OWNER, MAX_LEASES_PER_TENANT, MAX_RETAIN_S, RETAIN_FRACTION


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("pool", help="run or query a memory pool node",
                              description="The memory pool tier's node daemon and its tools.")
    sub = p.add_subparsers(dest="pool_command", required=True, metavar="ACTION")
    serve = sub.add_parser("serve", help="run a pool node in the foreground",
                           description="Hold KV blocks in memory for the servers of one or more tenants.")
    serve.add_argument("--listen", required=True, metavar="HOST:PORT", help="address to listen on (port 0: any)")
    serve.add_argument("--capacity", required=True, metavar="SIZE", help="memory to hold blocks in, e.g. 64GiB")
    serve.add_argument("--region-size", metavar="SIZE",
                       help="allocation unit per tenant and block size; also the largest block "
                            "(default 64MiB, or the capacity when smaller)")
    serve.add_argument("--transport", choices=("auto", "tcp", "rdma"), default="auto",
                       help="data plane: auto picks RDMA only when a device exists (default auto)")
    serve.add_argument("--verbs", metavar="MODULE", default="pyverbs",
                       help="verbs provider under RDMA: pyverbs (default), or the module of a stand-in with "
                            "pyverbs' names, such as kvtier.testing.fake_verbs")
    serve.add_argument("--tenants", metavar="FILE", help="YAML tenants file (name, secret/secret_file, quota); "
                       "without it every client is tenant 'default' with no secret")
    serve.add_argument("--hugepages", action="store_true", help="map the memory on 2 MiB hugepages (MAP_HUGETLB)")
    serve.add_argument("--lease-s", type=float, default=10.0, help="read lease granted per hit (default 10)")
    serve.add_argument("--max-lease-s", type=float, default=60.0, help="longest lease a client may ask for")
    serve.add_argument("--max-retain-s", type=float, default=MAX_RETAIN_S,
                       help=f"longest soft lease (RETAIN) a tenant may set on its blocks (default {MAX_RETAIN_S:g})")
    serve.add_argument("--retain-fraction", type=float, default=RETAIN_FRACTION,
                       help=f"share of its quota a tenant may retain, 0-1 (default {RETAIN_FRACTION:g})")
    serve.add_argument("--max-connections", type=int, default=1024,
                       help="connections at once, those still authenticating included (default 1024)")
    serve.add_argument("--max-handshakes", type=int, default=64,
                       help="connections still authenticating at once; past it the oldest is closed (default 64)")
    serve.add_argument("--handshake-timeout-s", type=float, default=10.0,
                       help="time a connection has to authenticate, all of its handshake (default 10)")
    serve.add_argument("--max-leases-per-connection", type=int, default=MAX_LEASES_PER_OWNER,
                       help=f"read and write leases one connection may hold (default {MAX_LEASES_PER_OWNER})")
    serve.add_argument("--max-leases-per-tenant", type=int, default=MAX_LEASES_PER_TENANT,
                       help=f"leases one tenant may hold over all its connections (default {MAX_LEASES_PER_TENANT})")
    serve.add_argument("--metrics-port", type=int, metavar="PORT",
                       help="serve Prometheus metrics on http://METRICS_HOST:PORT/metrics (0: any free port); "
                            "no credential is asked, so keep it on a trusted address")
    serve.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                       help="address the metrics are served on (default 127.0.0.1, whatever --listen says)")
    serve.add_argument("--max-subscribers-per-tenant", type=int, default=4,
                       help="KV event subscribers (SUBSCRIBE) one tenant may have at once (default 4)")
    serve.add_argument("--event-queue-batches", type=int, default=256,
                       help="event batches queued per subscriber; past it the oldest are dropped and counted "
                            "(default 256)")
    serve.add_argument("--event-ring-batches", type=int, default=4096,
                       help="event batches kept per tenant for replay (SUBSCRIBE from a seq; default 4096)")
    serve.set_defaults(func=run_serve)
    stats = sub.add_parser("stats", help="show a node's capacity, use, hits, evictions and transport",
                           description="What the credential may see: a tenant's own use and counters and the "
                                       "node's static facts, or node-wide figures for an operator (tenants file: "
                                       "`operator: true`; without a tenants file the default tenant is one).")
    stats.add_argument("address", metavar="HOST:PORT")
    stats.add_argument("--tenant", default="default", help="tenant to authenticate as (default: default)")
    stats.add_argument("--secret-file", metavar="FILE", help="file holding the tenant's secret")
    stats.add_argument("--timeout-s", type=float, default=5.0)
    stats.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    stats.set_defaults(func=run_stats)
    from kvtier.cli.pool_events import add_events_parser  # no pyzmq import until it runs

    add_events_parser(sub)
    return p


def node_config(args: argparse.Namespace):
    """The `NodeConfig` the arguments describe.

    Raises:
        ConfigError: naming the option at fault.
        CapacityError: --capacity is more than this machine's (or cgroup's) memory.
    """
    from kvtier.pool.detect import TransportKind, choose_transport
    from kvtier.pool.node.events import EventLimits
    from kvtier.pool.node.server import NodeConfig
    from kvtier.pool.tenants import load_tenants, open_tenants
    from kvtier.units import parse_address, parse_size

    host, port = parse_address(args.listen, "--listen")
    capacity = parse_size(args.capacity, "--capacity")
    if capacity < 4096:  # checked first: the default region size derives from it
        raise ConfigError(f"--capacity: {args.capacity} is not a positive size" if capacity == 0 else
                          f"--capacity: {args.capacity} is below the smallest region, 4 KiB")
    region = parse_size(args.region_size, "--region-size") if args.region_size else min(64 << 20, capacity // 4096 * 4096)
    if region < 4096 or region % 4096:
        raise ConfigError(f"--region-size: must be a positive multiple of 4 KiB, got {region}")
    if capacity < region:
        raise ConfigError(f"--capacity: {capacity} bytes is below one region of {region} bytes (--region-size)")
    check_fits(capacity, "--capacity")
    if not 0 <= args.retain_fraction <= 1:
        raise ConfigError(f"--retain-fraction: must be in [0, 1], got {args.retain_fraction}")
    for name in ("lease_s", "max_lease_s", "max_retain_s"):
        if not 0 <= getattr(args, name) < 1e6:
            raise ConfigError(f"--{name.replace('_', '-')}: must be in [0, 1e6), got {getattr(args, name)}")
    if not 0 < args.handshake_timeout_s < 1e6:
        raise ConfigError(f"--handshake-timeout-s: must be in (0, 1e6), got {args.handshake_timeout_s}")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise ConfigError(f"--metrics-port: expected a port number 0-65535 (0: any free port), got {args.metrics_port}")
    for name in ("max_connections", "max_handshakes", "max_leases_per_connection", "max_leases_per_tenant",
                 "max_subscribers_per_tenant", "event_queue_batches", "event_ring_batches"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    transport, reason = choose_transport(TransportKind(args.transport), verbs=args.verbs)
    tenants = load_tenants(args.tenants, capacity) if args.tenants else open_tenants(capacity)
    return NodeConfig(host, port, capacity, tenants, region_bytes=region, transport=transport.value, verbs=args.verbs,
                      transport_reason=reason, hugepages=args.hugepages, lease_s=args.lease_s,
                      max_lease_s=args.max_lease_s, max_retain_s=args.max_retain_s,
                      retain_fraction=args.retain_fraction, max_connections=args.max_connections,
                      max_handshakes=args.max_handshakes, handshake_timeout_s=args.handshake_timeout_s,
                      max_leases_per_connection=args.max_leases_per_connection,
                      max_leases_per_tenant=args.max_leases_per_tenant,
                      events=EventLimits(max_subscribers_per_tenant=args.max_subscribers_per_tenant,
                                         queue_batches=args.event_queue_batches,
                                         ring_batches=args.event_ring_batches))


def run_serve(args: argparse.Namespace) -> int:
    from kvtier.pool.node.server import PoolNode

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    config = node_config(args)
    try:
        node = PoolNode(config)
    except OSError as e:
        if e.errno != errno.ENOMEM:
            raise
        # the memory is not there after all (overcommit off, a limit not seen in /proc or the cgroup)
        raise allocation_failed(e, config.capacity_bytes, "--capacity") from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        host, port = node.start()
    except OSError as e:
        node.stop()
        raise ConfigError(f"--listen {args.listen}: cannot listen: {e.strerror}") from None
    if not args.tenants:
        print("kvtier pool: no --tenants file: every client is tenant 'default' without a secret; "
              "serve only a trusted network", file=sys.stderr)
    metrics = _serve_metrics(args, node) if args.metrics_port is not None else None
    facts = node.stats()
    _emit({"event": "ready", "listen": f"{host}:{port}", "transport": config.transport,
           "transport_reason": config.transport_reason, "capacity_bytes": facts["capacity_bytes"],
           "region_bytes": config.region_bytes, "memory": facts["memory"], "hugepages": facts["hugepages"],
           "tenants": sorted(config.tenants)})
    while not stop.wait(3600):
        pass
    if metrics is not None:
        metrics.shutdown()
    node.stop()
    _emit({"event": "stopped", "listen": f"{host}:{port}"})
    return 0


def _serve_metrics(args: argparse.Namespace, node: Any) -> Any:
    """Starts the node's metrics endpoint on --metrics-host:--metrics-port and says where.

    Raises:
        ConfigError: the port cannot be bound on that host (the node is stopped first).
    """
    from kvtier.observing.metrics import NodeCollector, serve_metrics

    host, port = args.metrics_host, args.metrics_port
    try:
        metrics, bound = serve_metrics(NodeCollector(node.stats), port, host)
    except OSError as e:
        node.stop()
        raise ConfigError(f"--metrics-host/--metrics-port: cannot serve metrics on {host}:{port}: "
                          f"{e.strerror or e}") from None
    shown = f"[{host}]" if ":" in host else host
    _emit({"event": "metrics", "url": f"http://{shown}:{bound}/metrics"})
    return metrics


def run_stats(args: argparse.Namespace) -> int:
    from kvtier.pool.client.api import PoolClient
    from kvtier.pool.tenants import read_secret_file

    secret = read_secret_file(args.secret_file, "--secret-file") if args.secret_file is not None else b""
    with PoolClient([args.address], tenant=args.tenant, secret=secret, timeout_s=args.timeout_s,
                    reconnect_s=0.0) as client:
        facts = client.stats()[0]
    if "error" in facts:  # the node is unreachable, timed out or broke the protocol: a connection error
        print(f"kvtier pool stats: {facts['error']}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(facts, indent=2))
        return 0
    _print_table(facts)
    return 0


def _print_table(f: dict[str, Any]) -> None:
    """A node's stats as a table: node-wide rows for an operator's credential, the tenant's own
    figures otherwise (the node decides which it sends)."""
    from rich.console import Console
    from rich.table import Table

    from kvtier.units import format_bytes as format_size

    node_wide = f.get("scope", "node") == "node"
    lookups = f["hits"] + f["misses"]
    rows = [
        ("node", f"{f['address']} (id {f['node']}, up {f['uptime_s']:.0f} s)"),
        ("transport", f"{f['transport']} ({f['transport_reason']})"),
        ("memory", f["memory"]),
        ("capacity", (f"{format_size(f['capacity_bytes'])} in {f['num_regions']} regions of "
                      f"{format_size(f['region_bytes'])}")),
        ("used" if node_wide else "used by this tenant",
         f"{format_size(f['used_bytes'])} ({100 * f['used_bytes'] / f['capacity_bytes']:.1f}%), "
         f"{f['num_blocks']:,} blocks" + (f", {f['free_regions']} free regions" if node_wide else "")),
        ("hits / misses", f"{f['hits']:,} / {f['misses']:,}"
                          + (f" ({100 * f['hits'] / lookups:.1f}% hit)" if lookups else "")),
        ("puts / evictions", f"{f['puts']:,} / {f['evictions']:,}"),
        ("rejected puts", (f"full {f['rejected_full']:,}, quota {f['rejected_quota']:,}, busy {f['rejected_busy']:,}, "
                           f"lease limit {f.get('rejected_limit', 0):,}")),
        ("duplicate puts", (f"{format_size(f.get('duplicate_put_bytes', 0))} sent for keys already stored "
                            f"(and dropped); {format_size(f.get('bytes_in', 0))} written")),
        ("leases", f"{f['active_leases']:,} active, {f['leases_expired']:,} expired"),
        ("retention", (f"{f.get('retained_blocks', 0):,} blocks retained now; {f.get('retained', 0):,} retained, "
                       f"{f.get('retain_ignored_over_budget', 0):,} over budget, {f.get('released', 0):,} released, "
                       f"{f.get('retained_evicted', 0):,} evicted while retained")),
        ("KV events", (f"{f.get('events_published', 0):,} batches published, {f.get('events_dropped', 0):,} dropped "
                       f"for slow subscribers, {f.get('event_subscribers', 0):,} subscribers, "
                       f"{f.get('blocks_announced', 0):,} blocks announced ({f.get('announce_ignored', 0):,} ignored)")),
    ]
    if node_wide:
        rows.append(("connections", (
            f"{f['active_connections']:,} open, {f['connections']:,} since start, {f['refused_busy']:,} refused busy, "
            f"{f['auth_failures']:,} auth failures ({f.get('auth_throttled', 0):,} refused after), "
            f"{f['protocol_errors']:,} protocol errors")))
        rows.append(("handshakes", (f"{f.get('handshakes_pending', 0):,} pending, "
                                    f"{f.get('handshake_timeouts', 0):,} timed out, "
                                    f"{f.get('handshakes_evicted', 0):,} closed for newer ones")))
    if "tenant" in f:
        t = f["tenant"]
        rows.append(("this tenant", (f"{t['name']}: {format_size(t['used_bytes'])} of "
                                     f"{format_size(t['quota_bytes'])} quota, {t['num_blocks']:,} blocks")))
    title = "kvtier pool node" + ("" if node_wide else " (as this tenant sees it)")
    table = Table("", "", show_header=False, title=title)
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


def _emit(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)
