"""`kvtier simulate --servers N`: N private DRAM tiers against one pool shared by N servers.

The trace's requests are spread over N GPU servers, each with a DRAM tier of D blocks, and three
things are replayed with the runtime's own manager (`replay.simulate`, one tier each):

    private   N managers, one per server, each with D DRAM slots, each replaying only the
              requests routed to its server, in trace order. Server s never sees server t's blocks.
    shared    one manager with one POOL tier of N x D slots, replaying the whole trace in order:
              a block stored for one server is hit by any other (that is the point of a pool).
    matching  the same pool at the smallest size S whose hits reach the private hits.

Only the DRAM level is modelled: per-server HBM in front of a shared pool (or SSD behind it) would
need each server's manager to adopt what other servers put in the pool (the runtime's
`adopt_shared` / `forget_shared`) in step with one pool node, which the replay does not have; so
`--capacity` must name exactly one tier, dram, and anything else is an error.

Routing (`Route`), fixed before any replay, so all three see the same servers:

    request        request i goes to server i mod N (round-robin, no affinity).
    conversation   session affinity. A block is *common* when at least
                   max(COMMON_MIN_FANOUT, COMMON_MIN_SHARE x number of requests) distinct blocks
                   follow it somewhere in the trace (a system prompt every conversation branches
                   off), and so is every block before a common block in a request (its prefix).
                   Request r reuses its first n blocks, those already listed by an earlier request
                   (ids are prefix-chained, so the reused blocks are a prefix). If n > 0 and block
                   n-1 is not common, r belongs to the conversation of the earlier request that
                   first listed block n-1; otherwise r starts a new conversation. A new conversation
                   goes to the server with the fewest block accesses routed so far (lowest index on
                   a tie), and every later request of it follows: no conversation is split. The
                   common blocks are found in a first pass over the whole trace (a real balancer
                   would be told its system prompts, or learn them).

Search for S: the pool is replayed at every one of GRID_SHARES of N x D (and, only if none of those
reaches the target, at EXTRA_SHARES beyond it); between the first grid size that reaches the target
and the grid size before it, a bisection on whole blocks ends with S reaching the private hits and
S - 1 not. Hit rate need not grow with capacity; every size replayed is reported, with whether
the grid was monotone, so a dip is visible.

Accounting is `replay.simulate`'s: hits count only inside the matched prefix. Bytes over the fabric
are the pool's blocks read (hits, to the engine) and written (stores) x block bytes; the private
figure is the same traffic to local DRAM, for comparison. With one tier every access moves one block
(a hit is read, a miss is written), so the totals match; where they go is what differs.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.kinds import TierKind
from kvtier.simulate.replay import SimConfig, VirtualTier, simulate
from kvtier.simulate.sweep import bisect_capacity, planned_bisections
from kvtier.simulate.trace import Trace

# A block is common when the distinct blocks that follow it number at least COMMON_MIN_FANOUT and
# at least COMMON_MIN_SHARE of the trace's requests (the conversation trace: 121, block 0 only).
COMMON_MIN_FANOUT = 4
COMMON_MIN_SHARE = 0.01
GRID_SHARES = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)  # of N x D
EXTRA_SHARES = (1.25, 1.5, 2.0, 3.0, 4.0)  # tried only when the grid never reaches the target


class Route(enum.Enum):
    """How requests are assigned to servers; see the module docstring for the exact rules."""

    CONVERSATION = "conversation"
    REQUEST = "request"


ROUTE_RULES = {
    Route.REQUEST: "request i goes to server i mod N (round-robin)",
    Route.CONVERSATION: (
        "a block is common if at least max({fanout}, {share:g} x requests) distinct blocks follow it in the trace, "
        "and so is every block before a common one; a request whose deepest reused block (the last of its prefix "
        "listed by earlier requests) is not common joins the conversation of the request that first listed that "
        "block, else it starts a new conversation; a new conversation goes to the server with the fewest block "
        "accesses so far (lowest index on ties) and all its requests follow it"
    ).format(fanout=COMMON_MIN_FANOUT, share=COMMON_MIN_SHARE),
}


@dataclasses.dataclass(frozen=True, slots=True)
class Routing:
    """Where each request of a trace goes.

    Attributes:
        route: the rule used.
        num_servers: N.
        servers: the server of each request, in trace order.
        conversations: the conversation of each request (by the conversation rule, whatever the route).
        num_common_blocks: blocks the conversation rule treats as shared by all conversations.
        common_min_fanout: the fan-out at and above which a block is common, for this trace.
    """

    route: Route
    num_servers: int
    servers: tuple[int, ...]
    conversations: tuple[int, ...]
    num_common_blocks: int
    common_min_fanout: int

    @property
    def num_split_conversations(self) -> int:
        """Conversations whose requests went to more than one server (always 0 for `Route.CONVERSATION`)."""
        seen: dict[int, set[int]] = defaultdict(set)
        for conversation, server in zip(self.conversations, self.servers):
            seen[conversation].add(server)
        return sum(len(s) > 1 for s in seen.values())


def check_num_servers(value: object) -> int:
    """`value` (an int or its text) as a server count.

    Raises:
        ConfigError: not an integer, or below 1; the message names --servers.
    """
    text = str(value).strip()
    if isinstance(value, bool) or not text.lstrip("+").isdigit() or int(text) < 1:
        raise ConfigError(f"servers: --servers must be an integer >= 1, got {value!r}")
    return int(text)


def common_blocks(trace: Trace) -> tuple[frozenset[int], int]:
    """The blocks shared by many conversations (see the module docstring).

    Returns:
        The common block ids, and the fan-out threshold used for this trace.
    """
    min_fanout = max(COMMON_MIN_FANOUT, math.ceil(COMMON_MIN_SHARE * len(trace.requests)))
    followers: dict[int, set[int]] = defaultdict(set)
    for request in trace.requests:
        ids = request.hash_ids
        for block, follower in zip(ids, ids[1:]):
            followers[block].add(follower)
    branching = {b for b, f in followers.items() if len(f) >= min_fanout}
    common: set[int] = set()
    for request in trace.requests:  # close upwards: the prefix of a common block is common too
        ids = request.hash_ids
        deepest = max((i for i, b in enumerate(ids) if b in branching), default=-1)
        common.update(ids[: deepest + 1])
    return frozenset(common), min_fanout


def assign_conversations(trace: Trace, common: frozenset[int]) -> list[int]:
    """The conversation of each request: 0, 1, ... in order of each conversation's first request."""
    owner: dict[int, int] = {}  # block -> conversation of the request that first listed it
    conversations: list[int] = []
    num_conversations = 0
    for request in trace.requests:
        ids = request.hash_ids
        n = 0
        while n < len(ids) and ids[n] in owner:
            n += 1
        if n and ids[n - 1] not in common:
            conversation = owner[ids[n - 1]]
        else:
            conversation, num_conversations = num_conversations, num_conversations + 1
        conversations.append(conversation)
        for block in ids[n:]:
            owner.setdefault(block, conversation)
    return conversations


def route_requests(trace: Trace, num_servers: int, route: Route) -> Routing:
    """Assigns every request of `trace` to one of `num_servers` servers.

    Args:
        trace: the requests, in order.
        num_servers: N >= 1.
        route: round-robin by request, or by conversation (see the module docstring).
    Returns:
        The routing, with each request's conversation.
    Raises:
        ConfigError: `num_servers` is not an integer >= 1.
    """
    num_servers = check_num_servers(num_servers)
    common, min_fanout = common_blocks(trace)
    conversations = assign_conversations(trace, common)
    if route is Route.REQUEST:
        servers = [i % num_servers for i in range(len(trace.requests))]
    else:
        server_of: dict[int, int] = {}
        accesses = [0] * num_servers
        servers = []
        for request, conversation in zip(trace.requests, conversations):
            if conversation not in server_of:
                server_of[conversation] = min(range(num_servers), key=accesses.__getitem__)
            server = server_of[conversation]
            accesses[server] += len(request.hash_ids)
            servers.append(server)
    return Routing(route, num_servers, tuple(servers), tuple(conversations), len(common), min_fanout)


def split_trace(trace: Trace, routing: Routing) -> list[Trace]:
    """One trace per server: its requests, in trace order."""
    mine: list[list] = [[] for _ in range(routing.num_servers)]
    for request, server in zip(trace.requests, routing.servers):
        mine[server].append(request)
    return [dataclasses.replace(trace, path=f"{trace.path}#server{s}", requests=tuple(reqs), skipped_lines=(),
                                num_accesses=sum(len(r.hash_ids) for r in reqs),
                                num_unique_blocks=len({b for r in reqs for b in r.hash_ids}), tail_counts=())
            for s, reqs in enumerate(mine)]


def compare(trace: Trace, config: SimConfig, num_servers: int, route: Route, pool_bandwidth_gbps: float, *,
            on_progress: Callable[[int], None] | None = None) -> dict:
    """Private DRAM per server against one shared pool, and the smallest pool matching private.

    Args:
        trace: the requests.
        config: one server's configuration: exactly one tier, DRAM, of D slots.
        num_servers: N >= 1.
        route: how requests reach servers.
        pool_bandwidth_gbps: the pool's bandwidth (fabric), for the TTFT estimate.
        on_progress: passed on to every replay.
    Returns:
        A JSON-ready dict: `num_servers`, `route`, `routing_rule`, `per_server` loads, `private`,
        `shared` and `matching` results (`matching` None if no size tried reaches the private
        hits, or if the private tiers hit nothing), `search` (every pool size replayed) and a
        one-line `message`.
    Raises:
        ConfigError: the configuration is not exactly one DRAM tier, or `num_servers` is bad.
    """
    if [t.kind for t in config.tiers] != [TierKind.DRAM]:
        names = ", ".join(t.kind.name.lower() for t in config.tiers)
        raise ConfigError(f"servers: --servers models one DRAM tier per server (--capacity dram=...) and no other "
                          f"tier; got {names}. Per-server HBM or SSD around a shared pool is not modelled")
    routing = route_requests(trace, num_servers, route)
    dram_blocks = config.tiers[0].num_slots
    total_blocks = num_servers * dram_blocks
    runs = [simulate(t, config, on_progress=on_progress) for t in split_trace(trace, routing)]
    private = _private_result(runs, total_blocks, config.block_bytes)

    pool = _PoolReplays(trace, config, pool_bandwidth_gbps, on_progress)
    shared = pool.result(total_blocks, total_blocks)
    # Nothing to match when the private tiers hit nothing (any pool, however small, "matches").
    size = smallest_matching_pool(pool.num_hits, private["num_hits"], total_blocks) if private["num_hits"] else None
    return {
        "num_servers": num_servers, "route": route.value, "routing_rule": ROUTE_RULES[route],
        "common_min_fanout": routing.common_min_fanout, "num_common_blocks": routing.num_common_blocks,
        "num_conversations": len(set(routing.conversations)),
        "num_split_conversations": routing.num_split_conversations,
        "dram_blocks_per_server": dram_blocks, "policy": config.label,
        "per_server": _loads(routing, runs),
        "private": private, "shared": shared,
        "matching": None if size is None else pool.result(size, total_blocks),
        "search": _search_report(pool.hits_by_size, trace.num_accesses, private["num_hits"]),
        "message": _message(private, shared, size, total_blocks, num_servers,
                            sum(1 for r in runs if not r["num_requests"])),
    }  # fmt: skip


def smallest_matching_pool(num_hits: Callable[[int], int], target_hits: int, total_blocks: int) -> int | None:
    """The smallest pool size (blocks) found whose hits reach `target_hits` (see the module docstring).

    Args:
        num_hits: hits of a pool of that many blocks (cached by the caller; called on whole blocks >= 1).
        target_hits: the hits to reach (the private total).
        total_blocks: N x D, the size the grid's shares are of.
    Returns:
        S such that S reaches the target and S - 1 does not (or S == 1), or None if no size tried reaches it.
    """
    below = 0  # a size known to fall short (0: no pool at all)
    for shares in (GRID_SHARES, EXTRA_SHARES):
        grid = sorted({max(1, round(share * total_blocks)) for share in shares} - set(range(below + 1)))
        hits = [num_hits(size) for size in grid]  # the whole grid, for the curve and to show any dip
        for size, size_hits in zip(grid, hits):
            if size_hits >= target_hits:
                return bisect_capacity(lambda blocks: num_hits(blocks) >= target_hits, below, size)
            below = size
    return None


def planned_replays(total_blocks: int) -> int:
    """An upper bound on `compare`'s whole-trace replays when the grid reaches the target (private counts as one)."""
    widest_gap = max(2, math.ceil(max(b - a for a, b in zip((0, *GRID_SHARES), GRID_SHARES)) * total_blocks))
    return 1 + len(GRID_SHARES) + planned_bisections(0, widest_gap)


class _PoolReplays:
    """Replays of the whole trace through one shared pool, by size, each size at most once."""

    def __init__(self, trace: Trace, config: SimConfig, bandwidth_gbps: float,
                 on_progress: Callable[[int], None] | None) -> None:
        self.trace, self.on_progress = trace, on_progress
        self.config = dataclasses.replace(config, tiers=(VirtualTier(TierKind.POOL, 1, bandwidth_gbps),))
        self.reports: dict[int, dict] = {}

    def report(self, size_blocks: int) -> dict:
        if size_blocks not in self.reports:
            tier = dataclasses.replace(self.config.tiers[0], num_slots=size_blocks)
            config = dataclasses.replace(self.config, tiers=(tier,))
            self.reports[size_blocks] = simulate(self.trace, config, on_progress=self.on_progress)
        return self.reports[size_blocks]

    def num_hits(self, size_blocks: int) -> int:
        return self.report(size_blocks)["num_hits"]

    @property
    def hits_by_size(self) -> dict[int, int]:
        return {size: r["num_hits"] for size, r in sorted(self.reports.items())}

    def result(self, size_blocks: int, total_blocks: int) -> dict:
        """The pool's figures at one size, with the capacity it saves against N x D."""
        r = self.report(size_blocks)
        tier, block_bytes = r["tiers"]["pool"], r["block_bytes"]
        saved = total_blocks - size_blocks
        return {
            "capacity_blocks": size_blocks, "capacity_bytes": size_blocks * block_bytes,
            **_headline(r["num_hits"], r["num_accesses"], r["prefill"]),
            "capacity_saved_blocks": saved, "capacity_saved_bytes": saved * block_bytes,
            "capacity_saved_share": saved / total_blocks,
            "fabric": _traffic(tier["blocks_read"], tier["blocks_written"], block_bytes),
            "ttft_mean_s": r["ttft_s"]["mean"], "bandwidth_gbps": tier["bandwidth_gbps"],
        }  # fmt: skip


def _private_result(runs: Sequence[dict], total_blocks: int, block_bytes: int) -> dict:
    hits, accesses = sum(r["num_hits"] for r in runs), sum(r["num_accesses"] for r in runs)
    prefill = {k: sum(r["prefill"][k] for r in runs) for k in ("input_tokens", "tokens_saved")}
    num_requests = sum(r["num_requests"] for r in runs)
    return {
        "capacity_blocks": total_blocks, "capacity_bytes": total_blocks * block_bytes,
        **_headline(hits, accesses, prefill),
        "capacity_saved_blocks": 0, "capacity_saved_bytes": 0, "capacity_saved_share": 0.0,
        "local_dram": _traffic(sum(r["tiers"]["dram"]["blocks_read"] for r in runs),
                               sum(r["tiers"]["dram"]["blocks_written"] for r in runs), block_bytes),
        "ttft_mean_s": sum(r["ttft_s"]["mean"] * r["num_requests"] for r in runs) / max(1, num_requests),
        "bandwidth_gbps": runs[0]["tiers"]["dram"]["bandwidth_gbps"],
    }  # fmt: skip


def _headline(num_hits: int, num_accesses: int, prefill: dict) -> dict:
    return {"num_hits": num_hits, "num_accesses": num_accesses,
            "block_hit_rate": num_hits / num_accesses if num_accesses else 0.0,
            "tokens_saved": prefill["tokens_saved"],
            "token_hit_rate": prefill["tokens_saved"] / prefill["input_tokens"] if prefill["input_tokens"] else 0.0}


def _traffic(blocks_read: int, blocks_written: int, block_bytes: int) -> dict:
    return {"blocks_read": blocks_read, "blocks_written": blocks_written, "bytes_read": blocks_read * block_bytes,
            "bytes_written": blocks_written * block_bytes, "bytes_moved": (blocks_read + blocks_written) * block_bytes}


def _loads(routing: Routing, runs: Sequence[dict]) -> list[dict]:
    conversations: list[set[int]] = [set() for _ in range(routing.num_servers)]
    for conversation, server in zip(routing.conversations, routing.servers):
        conversations[server].add(conversation)
    return [{"server": s, "num_requests": r["num_requests"], "num_accesses": r["num_accesses"],
             "num_conversations": len(conversations[s]), "private_block_hit_rate": r["block_hit_rate"]}
            for s, r in enumerate(runs)]


def _search_report(hits_by_size: dict[int, int], num_accesses: int, target_hits: int) -> dict:
    hits = list(hits_by_size.values())
    return {"target_hits": target_hits,
            "target_block_hit_rate": target_hits / num_accesses if num_accesses else 0.0,
            "monotone": all(a <= b for a, b in zip(hits, hits[1:])),
            "points": [{"capacity_blocks": size, "num_hits": h, "block_hit_rate": h / num_accesses if num_accesses
                        else 0.0} for size, h in hits_by_size.items()]}


def _message(private: dict, shared: dict, size: int | None, total_blocks: int, num_servers: int,
             num_idle: int = 0) -> str:
    idle = f"; {num_idle:,} server{'s' * (num_idle != 1)} given no request" if num_idle else ""
    head = (f"{num_servers} private DRAM tiers ({total_blocks:,} blocks in all{idle}) hit "
            f"{private['block_hit_rate']:.1%}; one shared pool of the same {total_blocks:,} blocks hits "
            f"{shared['block_hit_rate']:.1%}")
    if not private["num_hits"]:
        return head + "; the private tiers hit nothing, so there is no hit rate for a pool to match"
    if size is None:
        return head + "; no pool size tried matches the private hit rate"
    blocks = f"{size:,} block{'s' * (size != 1)}"
    if size > total_blocks:  # pooling costs capacity here: the servers' hit sets overlap little
        return (head + f"; a pool needs {blocks} to match the private hit rate, "
                f"{(size - total_blocks) / total_blocks:.1%} more capacity than the private tiers")
    return (head + f"; a pool of {blocks} already matches the private hit rate, "
            f"{(total_blocks - size) / total_blocks:.1%} less capacity")


def plot_servers(result: dict, path: Path) -> Path:
    """Writes a PNG of the pool's hit rate against its size, the private hit rate and the matching size."""
    from kvtier.simulate.sweep import _pyplot, _save

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    points = result["search"]["points"]
    ax.plot([p["capacity_blocks"] for p in points], [100 * p["block_hit_rate"] for p in points], marker="o",
            label="one shared pool")
    ax.axhline(100 * result["private"]["block_hit_rate"], color="red", linestyle=":",
               label=f"{result['num_servers']} private DRAM tiers of {result['dram_blocks_per_server']:,} blocks")
    ax.axvline(result["private"]["capacity_blocks"], color="grey", linewidth=0.8, label="N x D")
    match = result["matching"]
    if match is not None:
        ax.plot([match["capacity_blocks"]], [100 * match["block_hit_rate"]], marker="*", markersize=16,
                color="green", linestyle="none", label=f"smallest matching pool: {match['capacity_blocks']:,} blocks")
    ax.set_xlabel("shared pool capacity (blocks)")
    ax.set_ylabel("block hit rate (%)")
    ax.set_title(f"kvtier simulate --servers {result['num_servers']} (route by {result['route']})")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, path)
