"""`kvtier simulate --servers N`: routing, private DRAM per server against one shared pool, the search.

Hand-made traces with answers worked out below; the Mooncake traces (in the shared directory, or
KVTIER_TRACE_DIR) for routing balance and one short CLI run. Counts are asserted, never time.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.errors import ConfigError
from kvtier.kinds import TierKind
from kvtier.simulate.replay import SimConfig, VirtualTier
from kvtier.simulate.servers import (GRID_SHARES, Route, common_blocks, compare, route_requests,
                                     smallest_matching_pool, split_trace)
from kvtier.simulate.trace import load_trace
from support.traces import TRACE_DIR, mooncake, needs_traces


# Block 0 is a system prompt four conversations branch off (fan-out 4: common). Conversation 0 is
# r0, r2, r6 and r7 (r7 branches off it at block 1, which is not common), 1 is r1 and r4, 2 is r3,
# 3 is r5.
CHAT = [[0, 1, 2], [0, 10, 11], [0, 1, 2, 3], [0, 20], [0, 10, 11, 12], [0, 30], [0, 1, 2, 3, 4], [0, 1, 5]]
CHAT_CONVERSATIONS = (0, 1, 0, 2, 1, 3, 0, 0)
# Two servers, round-robin: each server sees its own prefix twice, and the other server's once.
SHARED_PREFIX = [[1, 2], [1, 3], [1, 2], [1, 3]]


def write_trace(path: Path, hash_ids: list[list[int]]) -> Path:
    lines = [{"timestamp": i, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids}
             for i, ids in enumerate(hash_ids)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def dram(num_slots: int) -> SimConfig:
    return SimConfig((VirtualTier(TierKind.DRAM, num_slots, 25.0),), block_bytes=1_000_000)


@pytest.fixture
def chat(tmp_path):
    return load_trace(write_trace(tmp_path / "chat.jsonl", CHAT))


# ---- routing -------------------------------------------------------------------------------


def test_conversation_routing_follows_the_deepest_uncommon_block(chat):
    routing = route_requests(chat, 2, Route.CONVERSATION)
    assert routing.num_common_blocks == 1  # block 0 only
    assert routing.conversations == CHAT_CONVERSATIONS
    # New conversations go to the server with the fewest block accesses so far:
    # c0 -> 0 (tie), c1 -> 1, c2 -> 1 (3 < 7 accesses), c3 -> 0 (7 < 9).
    assert routing.servers == (0, 1, 0, 1, 1, 0, 0, 0)
    assert routing.num_split_conversations == 0


def test_request_routing_is_round_robin_and_splits_conversations(chat):
    routing = route_requests(chat, 3, Route.REQUEST)
    assert routing.servers == (0, 1, 2, 0, 1, 2, 0, 1)
    assert routing.conversations == CHAT_CONVERSATIONS  # the same conversations, whatever the route
    # Conversation 0 (r0, r2, r6, r7) lands on servers 0, 2, 0, 1; conversation 1 (r1, r4) on 1 and 1.
    assert routing.num_split_conversations == 1
    assert route_requests(chat, 2, Route.REQUEST).num_split_conversations == 2  # now r4 is on server 0


def test_the_prefix_of_a_common_block_is_common(tmp_path):
    """A two-block system prompt: only its second block branches, but both are common."""
    trace = load_trace(write_trace(tmp_path / "t.jsonl", [[7, 8, 1], [7, 8, 2], [7, 8, 3], [7, 8, 4], [7, 8, 1, 5]]))
    common, min_fanout = common_blocks(trace)
    assert common == {7, 8} and min_fanout == 4
    assert route_requests(trace, 4, Route.CONVERSATION).conversations == (0, 1, 2, 3, 0)


def test_split_trace_keeps_each_servers_requests_in_order(chat):
    routing = route_requests(chat, 2, Route.CONVERSATION)
    parts = split_trace(chat, routing)
    assert [[r.hash_ids for r in p.requests] for p in parts] == [
        [tuple(CHAT[i]) for i in (0, 2, 5, 6, 7)], [tuple(CHAT[i]) for i in (1, 3, 4)]]
    assert [p.num_accesses for p in parts] == [17, 9]
    assert [p.num_unique_blocks for p in parts] == [7, 5]


@needs_traces
@pytest.mark.parametrize("name", ["conversation", "synthetic"])
def test_conversation_routing_on_the_mooncake_traces(name):
    """No conversation split, every extension on its parent's server, and the load spread evenly."""
    trace = mooncake(name)
    routing = route_requests(trace, 4, Route.CONVERSATION)
    assert routing.num_split_conversations == 0
    common, _ = common_blocks(trace)
    assert len(common) == {"conversation": 1, "synthetic": 0}[name]  # block 0, the shared system prompt
    first_server: dict[int, int] = {}
    for request, server in zip(trace.requests, routing.servers):
        ids = request.hash_ids
        n = sum(1 for b in ids if b in first_server)  # reused blocks are a prefix (ids are prefix-chained)
        if n and ids[n - 1] not in common:
            assert server == first_server[ids[n - 1]]
        for b in ids[n:]:
            first_server[b] = server
    accesses = Counter()
    for request, server in zip(trace.requests, routing.servers):
        accesses[server] += len(request.hash_ids)
    mean = trace.num_accesses / 4
    assert all(abs(accesses[s] - mean) < 0.1 * mean for s in range(4))
    assert len(set(routing.conversations)) == {"conversation": 7373, "synthetic": 2211}[name]


# ---- private against shared ----------------------------------------------------------------


def test_one_server_private_equals_shared(chat):
    result = compare(chat, dram(3), 1, Route.CONVERSATION, 12.5)
    private, shared = result["private"], result["shared"]
    for key in ("capacity_blocks", "num_hits", "num_accesses", "block_hit_rate", "tokens_saved"):
        assert private[key] == shared[key], key
    assert private["local_dram"] == shared["fabric"]
    assert result["matching"]["capacity_blocks"] <= 3


def test_shared_pool_hits_the_other_servers_prefix(tmp_path):
    """SHARED_PREFIX, two servers of 2 blocks, LRU.

    Private: each server misses its first request (2 blocks) and hits both blocks of its second:
    4 hits of 8 accesses. Shared pool of 4: r0 stores 1, 2; r1 hits 1 and stores 3; r2 hits 1, 2;
    r3 hits 1, 3: 5 hits. A pool of 2 holds 1 and the last branch: hits 1 in r1, r2, r3 (3 < 4);
    a pool of 3 holds all three blocks: 5 hits. So the smallest matching pool is 3 of 4 blocks.
    """
    trace = load_trace(write_trace(tmp_path / "t.jsonl", SHARED_PREFIX))
    result = compare(trace, dram(2), 2, Route.REQUEST, 12.5)
    private, shared, match = result["private"], result["shared"], result["matching"]
    assert (private["num_hits"], private["num_accesses"]) == (4, 8)
    assert private["local_dram"]["blocks_read"] == 4 and private["local_dram"]["blocks_written"] == 4
    assert shared["num_hits"] == 5 and shared["block_hit_rate"] >= private["block_hit_rate"]
    assert shared["fabric"]["blocks_read"] == 5 and shared["fabric"]["blocks_written"] == 3
    assert shared["fabric"]["bytes_moved"] == 8 * 1_000_000
    assert match["capacity_blocks"] == 3 and match["num_hits"] == 5
    assert (match["capacity_saved_blocks"], match["capacity_saved_share"]) == (1, 0.25)
    assert match["capacity_saved_bytes"] == 1_000_000
    hits = {p["capacity_blocks"]: p["num_hits"] for p in result["search"]["points"]}
    assert {s: hits[s] for s in (2, 3, 4)} == {2: 3, 3: 5, 4: 5} and hits[1] <= 3  # 1 slot: the manager's own rules
    assert result["search"]["monotone"]
    # Block 1 is followed by two blocks only, so not common: one conversation, split by round-robin.
    assert result["num_conversations"] == 1 and result["num_split_conversations"] == 1


def test_only_a_dram_tier_is_modelled(chat):
    config = SimConfig((VirtualTier(TierKind.HBM, 2, 1000.0), VirtualTier(TierKind.DRAM, 2, 25.0)), 1_000_000)
    with pytest.raises(ConfigError, match="one DRAM tier per server"):
        compare(chat, config, 2, Route.CONVERSATION, 12.5)
    with pytest.raises(ConfigError, match="integer >= 1"):
        compare(chat, dram(2), 0, Route.CONVERSATION, 12.5)


# ---- the search ----------------------------------------------------------------------------


def test_search_bisects_between_grid_points_and_records_every_size():
    asked = []

    def hits(size):  # reaches 50 at 37 blocks, of N x D = 100
        asked.append(size)
        return 50 if size >= 37 else size

    assert smallest_matching_pool(hits, 50, 100) == 37
    grid = sorted({max(1, round(s * 100)) for s in GRID_SHARES})
    assert asked[: len(grid)] == grid  # the whole grid first, then the bisection between 30 and 40
    assert asked[len(grid):] == [35, 37, 36]


def test_search_is_not_fooled_by_a_dip_between_grid_points():
    """Hits dip at 38 (not monotone): the bisection still returns a size that reaches, one above one that does not."""
    def hits(size):
        return 0 if size == 38 else (50 if size >= 35 else 0)

    found = smallest_matching_pool(hits, 50, 100)
    assert hits(found) >= 50 and hits(found - 1) < 50 and 30 < found <= 40


def test_search_goes_beyond_n_x_d_only_when_needed_and_may_find_nothing():
    assert smallest_matching_pool(lambda size: size, 130, 100) == 130  # past N x D: 100 < 130 <= 150
    assert smallest_matching_pool(lambda size: 0, 1, 100) is None
    assert smallest_matching_pool(lambda size: 1, 1, 100) == 1


# ---- the command line ----------------------------------------------------------------------


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["simulate", "--no-progress", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@needs_traces
def test_cli_json_and_plot_on_the_conversation_trace(capsys, tmp_path):
    from PIL import Image

    code, out, _ = run_cli(capsys, "--trace", str(TRACE_DIR / "conversation_trace.jsonl"), "--limit", "600",
                           "--servers", "3", "--capacity", "dram=5%", "--json", "--plot", str(tmp_path / "plots"))
    assert code == 0
    report = json.loads(out)
    assert report["trace"]["num_requests"] == 600 and report["model"]["block_bytes"] == 160 << 20
    servers = report["servers"]
    assert servers["num_servers"] == 3 and servers["route"] == "conversation"
    assert "fewest block accesses" in servers["routing_rule"] and servers["num_split_conversations"] == 0
    assert sum(s["num_requests"] for s in servers["per_server"]) == 600
    assert sum(s["num_accesses"] for s in servers["per_server"]) == report["trace"]["num_accesses"]
    d = servers["dram_blocks_per_server"]
    assert d == round(0.05 * report["trace"]["num_unique_blocks"]) and servers["private"]["capacity_blocks"] == 3 * d
    for key in ("block_hit_rate", "num_hits", "tokens_saved", "capacity_saved_blocks", "capacity_saved_bytes",
                "capacity_saved_share"):
        assert key in servers["private"] and key in servers["shared"] and key in servers["matching"]
    assert set(servers["private"]["local_dram"]) == set(servers["shared"]["fabric"]) >= {"bytes_read", "bytes_written"}
    match = servers["matching"]
    assert match["num_hits"] >= servers["private"]["num_hits"]
    assert match["capacity_saved_blocks"] == 3 * d - match["capacity_blocks"]
    assert any(p["capacity_blocks"] == match["capacity_blocks"] for p in servers["search"]["points"])
    (png,) = report["plots"]
    assert png.endswith("simulate_servers_hit_rate_vs_pool.png")
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size[0] > 100
        image.verify()
    code, out, _ = run_cli(capsys, "--trace", str(TRACE_DIR / "conversation_trace.jsonl"), "--limit", "200",
                           "--servers", "2", "--route", "request", "--capacity", "dram=200")
    assert code == 0 and "private DRAM vs one shared pool" in out and "split across servers" in out


@pytest.mark.parametrize("args, message", [
    (["--servers", "0", "--capacity", "dram=2"], "--servers must be an integer >= 1, got '0'"),
    (["--servers", "two", "--capacity", "dram=2"], "--servers must be an integer >= 1, got 'two'"),
    (["--servers", "1.5", "--capacity", "dram=2"], "--servers must be an integer >= 1"),
    (["--servers", "2", "--capacity", "dram=2", "--sweep"], "cannot be combined with --sweep"),
    (["--servers", "2", "--capacity", "dram=2", "--policy", "lru,arc"], "one policy, got lru, arc"),
    (["--servers", "2", "--capacity", "dram=2", "--admission", "on"], "--admission does not apply"),
    (["--servers", "2", "--capacity", "hbm=2"], "exactly one --capacity, dram=D"),
    (["--servers", "2", "--capacity", "dram=2", "--capacity", "ssd=9"], "got dram, ssd"),
    (["--servers", "2"], "got none"),
    (["--route", "request", "--capacity", "dram=2"], "--route applies only with --servers"),
])  # fmt: skip
def test_cli_bad_servers_input_exits_2(capsys, chat, args, message):
    code, _, err = run_cli(capsys, "--trace", chat.path, *args)
    assert code == 2 and message in err


def test_the_message_says_when_a_pool_needs_more_capacity_than_the_private_tiers():
    from kvtier.simulate.servers import _message

    private, shared = {"block_hit_rate": 0.0786, "num_hits": 786}, {"block_hit_rate": 0.0776}
    assert _message(private, shared, 2806, 2764, 2).endswith(
        "a pool needs 2,806 blocks to match the private hit rate, 1.5% more capacity than the private tiers")
    assert _message(private, shared, 2756, 2764, 2).endswith("0.3% less capacity")


def test_more_servers_than_requests_and_no_private_hit_are_said_not_matched(capsys, tmp_path):
    # Three requests that share nothing, over 40 servers: 37 servers idle, no hit anywhere.
    trace = write_trace(tmp_path / "once.jsonl", [[1, 2], [3], [4, 5]])
    result = compare(load_trace(trace), dram(2), 40, Route.REQUEST, 10.0)
    assert result["private"]["num_hits"] == 0 and result["matching"] is None
    assert "37 servers given no request" in result["message"]
    assert result["message"].endswith("the private tiers hit nothing, so there is no hit rate for a pool to match")
    code, out, err = run_cli(capsys, "--trace", str(trace), "--capacity", "dram=2", "--servers", "40",
                             "--route", "request")
    assert code == 0, err
    rows = [line for line in out.splitlines() if line.startswith("│") and "load per server" not in line]
    assert any("(24 more)" in line for line in rows)  # 40 servers, 16 rows shown
    assert not any(line.split("│")[1].strip() == "20" for line in rows)  # server 20 is among those elided
