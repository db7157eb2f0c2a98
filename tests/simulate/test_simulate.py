"""`kvtier simulate`: trace replay through the real manager, checked against known answers.

Cost: ~20 s on two CPU cores, most of it full replays of the Mooncake traces (the 27.8 % reference on
the 288,500 accesses of conversation_trace.jsonl, and policy comparisons on synthetic_trace.jsonl).
Hand-made traces live in tmp_path. Counts are asserted, never wall-clock time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.errors import CapacityError, ConfigError, KVTierError
from kvtier.simulate.replay import SimConfig, SimPolicy, VirtualTier, parse_capacity, simulate
from kvtier.simulate.belady import BeladyPolicy, FutureAccesses
from kvtier.simulate.sweep import recommend, sweep
from kvtier.simulate.trace import OnError, TraceError, load_trace
from kvtier.tiers.base import TierKind
from support.traces import TINY_TRACE as TINY, needs_traces

REPO_ROOT = Path(__file__).resolve().parents[2]
HBM, DRAM, SSD = TierKind.HBM, TierKind.DRAM, TierKind.SSD
MiB = 1 << 20


# TINY (support.traces): five requests over 512-token blocks, with partial tails; answers worked out by hand below.
def write_trace(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def one_tier(num_slots: int, policy: SimPolicy = SimPolicy.LRU, **kw) -> SimConfig:
    return SimConfig((VirtualTier(HBM, num_slots, 1.0),), block_bytes=1_000_000, policy=policy, **kw)


@pytest.fixture
def tiny(tmp_path):
    return load_trace(write_trace(tmp_path / "tiny.jsonl", TINY))


# ---- the independent reference -------------------------------------------------------------


@pytest.mark.slow
@needs_traces
def test_lru_reference_conversation_trace(conversation):
    """One LRU tier of 10 % of the distinct blocks hits 27.8 % of block accesses (partial tails counted)."""
    assert (conversation.num_accesses, conversation.num_unique_blocks) == (288_500, 182_790)
    report = simulate(conversation, one_tier(18_279))
    assert (report["num_hits"], report["num_accesses"]) == (80_323, 288_500)
    assert round(report["block_hit_rate"], 3) == 0.278
    assert report["tiers"]["hbm"]["hits"] == 80_323
    assert report["tiers"]["hbm"]["used_slots"] == 18_279


# ---- known answers on a hand-made trace ----------------------------------------------------


def test_tiny_trace_lru_known_answer(tiny):
    # LRU, 3 slots. r1 stores 1,2,3. r2 hits 1,2. r3 hits 1,2, stores 4 evicting 3. r4 stores 5,6
    # evicting 1,2. r5 misses 1 (so nothing after it counts) and stores 1,2,3 evicting 4,5,6.
    report = simulate(tiny, one_tier(3, prefill_tokens_per_s=1000.0))
    assert (report["num_hits"], report["num_accesses"]) == (4, 13)
    assert report["block_hit_rate"] == pytest.approx(4 / 13)
    hbm = report["tiers"]["hbm"]
    assert (hbm["stores"], hbm["evictions"], hbm["blocks_read"], hbm["blocks_written"]) == (9, 6, 4, 9)
    assert hbm["bytes_read"] == 4 * 1_000_000
    assert report["prefill"] == {"input_tokens": 5408, "tokens_saved": 2048,
                                 "token_hit_rate": pytest.approx(2048 / 5408), "prefill_tokens_per_s": 1000.0}
    # TTFT: 1 ms per computed token (at least one) + 1 ms per block loaded (1 MB at 1 GB/s):
    # 1.124 s, 0.001 + 0.002 s, 0.512 + 0.002 s, 0.600 s, 1.124 s.
    assert report["ttft_s"]["p50"] == pytest.approx(0.600)
    assert report["ttft_s"]["mean"] == pytest.approx((1.124 + 0.003 + 0.514 + 0.600 + 1.124) / 5)
    assert report["ttft_no_cache_s"]["p50"] == pytest.approx(1.124)


def test_tiny_trace_belady_known_answer(tiny):
    # As LRU until r3, which evicts 3 (used last, at r5) rather than 1 or 2. r4 evicts 4 (never used
    # again), then 2 (used after 1 in r5), so r5 still hits 1: 5 hits.
    report = simulate(tiny, one_tier(3, SimPolicy.BELADY))
    assert (report["num_hits"], report["num_accesses"]) == (5, 13)


def test_tiny_trace_full_blocks_only(tiny):
    # Tails dropped: r1 [1,2], r2 [1,2], r3 [1,2,4], r4 [5], r5 [1,2]. r4 evicts 1; r5 misses 1.
    report = simulate(tiny, one_tier(3, full_blocks_only=True))
    assert (report["num_hits"], report["num_accesses"]) == (4, 10)
    assert report["partial_blocks"] == "excluded"


# ---- policies and capacities ---------------------------------------------------------------


@pytest.mark.slow
@needs_traces
@pytest.mark.parametrize("name, share", [("synthetic", 0.01), ("synthetic", 0.1), ("conversation", 0.1)])
def test_belady_bounds_every_policy(request, name, share):
    trace = request.getfixturevalue(name)
    num_slots = round(share * trace.num_unique_blocks)
    rates = {p: simulate(trace, one_tier(num_slots, p))["block_hit_rate"] for p in SimPolicy}
    assert all(rates[SimPolicy.BELADY] >= rate for rate in rates.values()), rates
    assert rates[SimPolicy.BELADY] <= trace.max_block_hit_rate


@pytest.mark.slow
@needs_traces
def test_lru_non_decreasing_in_capacity_and_recommendation(synthetic):
    trace = load_trace(synthetic.path, limit=1500)
    points = [50, 200, 800, 3200, trace.num_unique_blocks]
    configs = [one_tier(1), one_tier(1, SimPolicy.BELADY)]
    rows = sweep(trace, configs, HBM, points, 1.0)
    lru = [r["block_hit_rate"] for r in rows if r["label"] == "lru"]
    assert lru == sorted(lru)
    assert lru[-1] == pytest.approx(trace.max_block_hit_rate)  # every distinct block fits: no eviction
    target = (lru[2] + lru[3]) / 2
    choice = recommend(rows, target, trace.max_block_hit_rate)
    assert choice["recommended"]["capacity_blocks"] == 3200
    assert choice["recommended"]["label"] == "lru"  # Belady is never recommended
    assert choice["belady"]["capacity_blocks"] <= 3200
    assert recommend(rows, 0.999, trace.max_block_hit_rate)["recommended"] is None


@needs_traces
def test_multi_tier_accounting(synthetic):
    trace = load_trace(synthetic.path, limit=800)
    tiers = (VirtualTier(HBM, 100, 1000.0), VirtualTier(DRAM, 400, 25.0), VirtualTier(SSD, 1600, 6.0))
    for admission in (False, True):
        report = simulate(trace, SimConfig(tiers, block_bytes=MiB, admission=admission))
        by_tier = report["tiers"]
        assert sum(t["hits"] for t in by_tier.values()) == report["num_hits"] > 0
        assert report["num_hits"] <= report["num_accesses"]
        for t in by_tier.values():
            assert t["used_slots"] <= t["num_slots"]
            assert t["bytes_read"] == t["blocks_read"] * MiB and t["bytes_written"] == t["blocks_written"] * MiB
        moved_in = sum(t["blocks_moved_in"] for t in by_tier.values())
        assert moved_in == sum(t["blocks_moved_out"] for t in by_tier.values()) > 0
        assert by_tier["ssd"]["hits"] > 0 or admission


# ---- Belady's policy contract --------------------------------------------------------------


def test_belady_policy_contract():
    future = FutureAccesses([["a", "b", "c"], ["c"], ["b"], ["a"]])
    policy = BeladyPolicy(future)
    future.begin_request(0)
    for key in "abc":
        policy.insert(key)
    with pytest.raises(KeyError):
        policy.insert("a")
    assert policy.evict(4, lambda k: False) is None and len(policy) == 3
    assert policy.evict(3, lambda k: k == "a") is None and len(policy) == 3  # nothing changed
    with pytest.raises(RuntimeError):
        policy.evict(1, lambda k: (_ for _ in ()).throw(RuntimeError("boom")))
    assert len(policy) == 3 and "a" in policy
    assert policy.evict(1, lambda k: k == "a") == ["b"]  # a is farthest (request 3) but protected
    assert policy.evict(2, lambda k: False) == ["a", "c"]
    with pytest.raises(ValueError):
        policy.evict(-1, lambda k: False)


# ---- trace input ---------------------------------------------------------------------------


def test_malformed_lines_stop_or_skip(tmp_path):
    lines = [TINY[0], "{not json", TINY[1], {"timestamp": 1, "input_length": 600, "output_length": 1,
                                             "hash_ids": [7, 8, 9]}, "", TINY[2]]
    path = write_trace(tmp_path / "bad.jsonl", lines)
    with pytest.raises(TraceError, match=r"line 2: not valid JSON"):
        load_trace(path)
    trace = load_trace(path, on_error=OnError.SKIP)
    assert [n for n, _ in trace.skipped_lines] == [2, 4]
    assert "3 hash_ids for input_length 600: expected ceil(600 / 512) = 2 or floor = 1" in trace.skipped_lines[1][1]
    assert len(trace.requests) == 3


@pytest.mark.parametrize("line, message", [
    ([1, 2], "expected a JSON object"),
    ({"timestamp": 0, "input_length": 10, "output_length": 1}, "missing field 'hash_ids'"),
    ({"timestamp": "x", "input_length": 10, "output_length": 1, "hash_ids": [1]}, "timestamp"),
    ({"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}, "input_length"),
    ({"timestamp": 0, "input_length": 10, "output_length": -1, "hash_ids": [1]}, "output_length"),
    ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}, "list of integers"),
])  # fmt: skip
def test_malformed_line_reasons(tmp_path, line, message):
    with pytest.raises(TraceError, match=message):
        load_trace(write_trace(tmp_path / "t.jsonl", [TINY[0], line]))


def test_missing_or_empty_trace(tmp_path):
    with pytest.raises(TraceError, match="no valid request"):
        load_trace(write_trace(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "absent.jsonl")


def test_capacities():
    assert parse_capacity("18279", block_bytes=MiB, num_unique_blocks=10, where="c") == 18279
    assert parse_capacity("64GiB", block_bytes=160 * MiB, num_unique_blocks=10, where="c") == 409
    assert parse_capacity("10%", block_bytes=MiB, num_unique_blocks=182_790, where="c") == 18_279
    for bad in ("0", "-5", "1MiB", "0%"):
        with pytest.raises(CapacityError):
            parse_capacity(bad, block_bytes=160 * MiB, num_unique_blocks=10, where="c")
    with pytest.raises(ConfigError):
        parse_capacity("lots", block_bytes=MiB, num_unique_blocks=10, where="c")
    with pytest.raises(CapacityError):
        VirtualTier(DRAM, 0, 25.0)
    with pytest.raises(ConfigError):
        VirtualTier(DRAM, 10, 0.0)
    with pytest.raises(ConfigError):
        SimConfig((VirtualTier(DRAM, 1, 1.0), VirtualTier(DRAM, 2, 1.0)), block_bytes=1)


# ---- the command line ----------------------------------------------------------------------


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["simulate", "--no-progress", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_json_with_bytes_capacity(capsys, tmp_path):
    trace = write_trace(tmp_path / "tiny.jsonl", TINY)
    code, out, _ = run_cli(capsys, "--trace", str(trace), "--model", "llama-2-7b", "--capacity", "hbm=768MiB",
                           "--capacity", "dram=3", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["model"]["block_bytes"] == 256 * MiB  # 512 tokens x 512 KiB
    assert report["tiers"]["hbm"]["num_slots"] == 3 and report["tiers"]["dram"]["num_slots"] == 3
    assert report["block_hit_rate"] == report["runs"][0]["block_hit_rate"]
    assert set(report["tiers"]["dram"]) >= {"hits", "hit_rate", "bytes_read", "bytes_written", "bytes_moved"}


def test_cli_compare_sweep_and_plot(capsys, tmp_path):
    trace = write_trace(tmp_path / "tiny.jsonl", TINY)
    code, out, _ = run_cli(capsys, "--trace", str(trace), "--capacity", "hbm=3", "--policy", "lru,belady",
                           "--admission", "both", "--sweep", "--sweep-points", "2,3,6", "--target-hit-rate", "30%",
                           "--plot", str(tmp_path / "plots"), "--json")
    assert code == 0
    report = json.loads(out)
    assert [r["label"] for r in report["runs"]] == ["lru", "lru+admission", "belady", "belady+admission"]
    assert report["sweep"]["points"] == [2, 3, 6]
    # Two slots are enough for LRU's 4 hits in 13 (1 and 2 are the only blocks ever hit): 30.8 % >= 30 %.
    assert report["sweep"]["recommendation"]["recommended"]["capacity_blocks"] == 2
    for name in ("simulate_hit_rate_vs_capacity.png", "simulate_hit_rate_by_tier.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, out, _ = run_cli(capsys, "--trace", str(trace), "--capacity", "hbm=3")
    assert code == 0 and "lru" in out and "30.8%" in out


def test_cli_refuses_a_plot_folder_it_cannot_make_before_replaying(capsys, tmp_path):
    trace = write_trace(tmp_path / "tiny.jsonl", TINY)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    for args in (["--capacity", "hbm=3", "--plot", str(blocker)],
                 ["--servers", "2", "--capacity", "dram=3", "--plot", str(blocker / "plots")]):
        code, out, err = run_cli(capsys, "--trace", str(trace), *args)
        assert code == 2 and "--plot: cannot create" in err and out == ""


def test_a_plot_that_cannot_be_written_is_a_config_error_naming_it(tmp_path):
    from kvtier.simulate.sweep import plot_runs

    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    runs = [{"label": "lru", "tiers": {"hbm": {"hit_rate": 0.3}}, "block_hit_rate": 0.3}]
    with pytest.raises(ConfigError, match="plot: cannot write .*a_file/hit.png"):
        plot_runs(runs, blocker / "hit.png")


def test_cli_sweep_of_a_trace_without_reuse_says_there_is_nothing_to_size(capsys, tmp_path):
    trace = write_trace(tmp_path / "once.jsonl", [{"timestamp": 0, "input_length": 1000, "output_length": 1,
                                                   "hash_ids": [1, 2]}])
    for policy in ("lru", "chain-arc"):
        code, out, err = run_cli(capsys, "--trace", str(trace), "--capacity", "dram=10", "--policy", policy,
                                 "--sweep", "--json", "--plot", str(tmp_path / "plots"))
        assert code == 0, err
        recommendation = json.loads(out)["sweep"]["recommendation"]
        assert recommendation["recommended"] is None and "nothing to size" in recommendation["message"]
    code, _, err = run_cli(capsys, "--trace", str(trace), "--capacity", "dram=10", "--sweep", "--target-hit-rate", "0")
    assert code == 2 and "target-hit-rate must be in (0, 1]" in err


@pytest.mark.parametrize("args, message", [
    (["--capacity", "hbm=0"], "at least one"),
    (["--capacity", "hbm=-3"], "positive"),
    (["--capacity", "l4=10"], "unknown tier 'l4'"),
    (["--capacity", "hbm"], "TIER=VALUE"),
    (["--capacity", "dram=1KiB"], "need at least one"),
    (["--capacity", "hbm=3", "--model", "gpt-17"], "unknown model"),
    (["--capacity", "hbm=3", "--bandwidth", "hbm=0"], "bandwidth of tier hbm"),
    (["--capacity", "hbm=3", "--policy", "fifo"], "unknown policy 'fifo'"),
    ([], "give at least one --capacity"),
])  # fmt: skip
def test_cli_bad_input_exits_2(capsys, tmp_path, args, message):
    trace = write_trace(tmp_path / "tiny.jsonl", TINY)
    code, _, err = run_cli(capsys, "--trace", str(trace), *args)
    assert code == 2
    assert message in err


def test_cli_malformed_trace_stop_and_skip(capsys, tmp_path):
    trace = write_trace(tmp_path / "bad.jsonl", [TINY[0], TINY[1], '{"timestamp": 3}', TINY[2]])
    code, _, err = run_cli(capsys, "--trace", str(trace), "--capacity", "hbm=3")
    assert code == 2 and "line 3: missing field 'input_length'" in err
    code, out, err = run_cli(capsys, "--trace", str(trace), "--capacity", "hbm=3", "--on-error", "skip", "--json")
    assert code == 0 and "skipped 1 malformed line(s)" in err and "line 3" in err
    assert json.loads(out)["trace"]["skipped_lines"][0]["line"] == 3


def test_cli_subprocess_error_exit_code(tmp_path):
    """The real entry point: a KVTierError is a clear one-line error and exit status 2."""
    out = subprocess.run([sys.executable, "-m", "kvtier", "simulate", "--trace", str(tmp_path / "nope.jsonl"),
                          "--capacity", "hbm=3"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "kvtier simulate: error: trace file not found" in out.stderr


def test_errors_are_kvtier_errors():
    assert issubclass(TraceError, KVTierError)
