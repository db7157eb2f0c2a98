"""bench_serve.py's chat-hints workload (issue 32, part 4): the rolling population's arithmetic,
which turns carry which hints, that `complete` sends them (to a real HTTP server on a real socket),
and how the figures are summarized. Cost: under a second; no vLLM server (the bench's slow
end-to-end test in test_bench_serve.py covers those)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import bench_serve  # noqa: E402
import serve_report  # noqa: E402
import serve_rolling as rolling  # noqa: E402
import serve_workloads as wl  # noqa: E402

SPEC = rolling.RollingSpec(num_live=6, num_turns=4, num_steps=10, context_tokens=768, user_tokens=64,
                           output_tokens=16, concurrency=2)


# ---- the rolling population ---------------------------------------------------------------------


def test_every_step_has_one_turn_of_every_live_slot_and_conversations_end_at_every_step():
    steps = rolling.schedule(SPEC, seed=1)
    assert [sorted(t.slot for t in turns) for turns in steps] == [list(range(6))] * 10
    closing = [sum(t.last for t in turns) for turns in steps]
    # slots' offsets 0,1,2,3,0,1: a slot of offset o closes at the steps where (step + o) % 4 == 3
    assert closing == [1, 1, 2, 2, 1, 1, 2, 2, 1, 1]


def test_a_conversation_runs_its_turns_in_order_then_its_slot_starts_a_new_one():
    for slot in range(SPEC.num_live):
        turns = [rolling.turn_at(SPEC, slot, step) for step in range(SPEC.num_steps)]
        by_session: dict[str, list[int]] = {}
        for t in turns:
            by_session.setdefault(t.session, []).append(t.turn)
        for session, numbers in by_session.items():
            assert numbers == list(range(len(numbers))), session  # starts at 0, one turn per step
        first = turns[0]
        assert first.generation == 0 and first.turn == 0
        # slot i's first conversation is i % 4 turns short; later ones run all 4
        assert len(by_session[f"s{slot}g0"]) == SPEC.num_turns - slot % SPEC.num_turns
        assert all(len(n) == SPEC.num_turns for s, n in by_session.items()
                   if s != f"s{slot}g0" and s != turns[-1].session)
        assert [t.turn for t in turns if t.last] == [len(by_session[t.session]) - 1 for t in turns if t.last]


def test_hints_name_the_session_on_every_turn_and_close_it_on_the_last_only():
    turns = [rolling.turn_at(SPEC, 1, step) for step in range(5)]
    hints = [rolling.session_hint(t) for t in turns]
    assert hints == [{"kvtier": {"session": "s1g0"}}, {"kvtier": {"session": "s1g0"}},
                     {"kvtier": {"session": "s1g0", "closed": True}},
                     {"kvtier": {"session": "s1g1"}}, {"kvtier": {"session": "s1g1"}}]
    assert [t.key for t in turns] == ["s1g0t0", "s1g0t1", "s1g0t2", "s1g1t0", "s1g1t1"]


def test_the_send_order_is_shuffled_per_step_but_fixed_by_the_seed():
    assert rolling.schedule(SPEC, 7) == rolling.schedule(SPEC, 7)
    orders = {tuple(t.slot for t in turns) for turns in rolling.schedule(SPEC, 7)}
    assert len(orders) > 1


def test_the_footprint_counts_live_prompts_at_their_peak_and_every_conversation_once():
    blocks = rolling.footprint_blocks(SPEC, 32)
    assert rolling.prompt_tokens(SPEC, 0) == 768 + 64 and rolling.prompt_tokens(SPEC, 3) == 768 + 4 * 64 + 3 * 16
    per_turn = [rolling.prompt_tokens(SPEC, t) // 32 for t in range(4)]
    assert per_turn == [26, 28, 31, 33]
    # 14 closed, and 5 still live at the end (slot 2's closes at the last step)
    assert blocks["num_conversations"] == 14 + 5 and blocks["num_closed"] == 14
    reached: dict[str, int] = {}
    for step in range(SPEC.num_steps):
        for slot in range(SPEC.num_live):
            t = rolling.turn_at(SPEC, slot, step)
            reached[t.session] = max(reached.get(t.session, 0), t.turn)
    assert blocks["seen_blocks"] == sum(per_turn[t] for t in reached.values())
    held = [sum(per_turn[rolling.turn_at(SPEC, slot, step).turn] for slot in range(6)) for step in range(10)]
    assert blocks["live_peak_blocks"] == max(held)
    assert blocks["seen_blocks"] > 2 * blocks["live_peak_blocks"]  # finished contexts outnumber live ones


def test_a_bad_spec_names_the_field():
    with pytest.raises(ValueError, match="num_turns"):
        rolling.RollingSpec(num_live=2, num_turns=0, num_steps=1, context_tokens=1, user_tokens=1,
                            output_tokens=1, concurrency=1)


# ---- what goes over the wire --------------------------------------------------------------------


class FakeCompletions(BaseHTTPRequestHandler):
    """A real HTTP server that answers /v1/completions as vLLM streams, and keeps each body."""

    bodies: list[dict] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        last = len(body["prompt"]) % 500  # an "answer" that depends on the prompt
        for token in range(body["max_tokens"]):
            chunk = {"choices": [{"token_ids": [last + token]}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server():
    FakeCompletions.bodies = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeCompletions)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1], FakeCompletions.bodies
    httpd.shutdown()
    httpd.server_close()


def test_complete_sends_kv_transfer_params_only_when_given(server):
    port, bodies = server
    got = wl.complete("127.0.0.1", port, "m", [5, 6, 7], 3, kv_transfer_params={"kvtier": {"session": "s-42"}})
    wl.complete("127.0.0.1", port, "m", [5, 6, 7], 3)
    assert got.token_ids == (3, 4, 5)
    assert bodies[0]["kv_transfer_params"] == {"kvtier": {"session": "s-42"}}
    assert "kv_transfer_params" not in bodies[1]


@pytest.mark.parametrize("hints", [True, False])
def test_the_rolling_chat_sends_each_turns_history_and_its_hint(server, hints):
    port, bodies = server
    spec = rolling.RollingSpec(num_live=3, num_turns=2, num_steps=4, context_tokens=40, user_tokens=8,
                               output_tokens=2, concurrency=2)
    result = rolling.run_rolling_chat("127.0.0.1", port, "m", spec, seed=3, vocab_size=100, hints=hints)
    assert len(result.completions) == len(bodies) == 3 * 4
    assert sorted(len(b["prompt"]) for b in bodies) == sorted(
        rolling.prompt_tokens(spec, t.turn) for turns in rolling.schedule(spec, 3) for t in turns)
    sent = [b.get("kv_transfer_params") for b in bodies]
    if not hints:
        assert sent == [None] * 12
        return
    sessions = Counter(h["kvtier"]["session"] for h in sent)
    closed = sorted(h["kvtier"]["session"] for h in sent if h["kvtier"].get("closed"))
    expected = [t for turns in rolling.schedule(spec, 3) for t in turns]
    assert sessions == Counter(t.session for t in expected)
    assert closed == sorted(t.session for t in expected if t.last)
    assert len(result.ttfts_ms(first_turn=False)) == sum(t.turn > 0 for t in expected)


# ---- the report ---------------------------------------------------------------------------------


def hints_run(config: str, round_index: int, req_per_s: float, later_ms: float, counters: dict) -> dict:
    return {"config": config, "round": round_index,
            "hints_chat": {"hints": config.endswith("+hints"), "duration_s": 12 / req_per_s, "num_requests": 12,
                           "ttfts_ms": [later_ms * 2] * 6 + [later_ms] * 6, "later_turn_ttfts_ms": [later_ms] * 6,
                           "counters": counters},
            "hints_chat_tokens": {"s0g0t0": [1, 2], "s0g0t1": [3, 4]}}


def test_the_summary_gives_ratios_to_plain_and_to_the_same_tiers_without_hints():
    runs = [hints_run("plain", 0, 1.0, 400.0, {}),
            hints_run("dram", 0, 1.5, 200.0, {"kvtier_hits_total[dram]": 30.0, "kvtier_evictions_total[dram]": 9.0}),
            hints_run("dram+hints", 0, 2.0, 100.0, {"kvtier_hits_total[dram]": 50.0,
                                                     "kvtier_hints_total[applied]": 12.0,
                                                     "kvtier_hints_total[closed]": 4.0,
                                                     "kvtier_hints_total[doomed_evicted]": 20.0,
                                                     "kvtier_hints_refused_total[malformed]": 1.0})]
    out = serve_report.summarize_all(runs, ("plain", "dram", "dram+hints"))
    hinted = out["dram+hints"]
    assert hinted["hints_req_per_s_ratio"] == pytest.approx(2.0)
    assert hinted["hints_later_ttft_p50_ms_ratio"] == pytest.approx(0.25)
    assert hinted["hints_later_ttft_p50_ms_ratio_to_dram"] == pytest.approx(0.5)
    assert hinted["hints_req_per_s_ratio_to_dram"] == pytest.approx(2.0 / 1.5)
    assert hinted["hints_counts"] == {"hit_blocks": 50.0, "applied": 12.0, "closed": 4.0, "doomed_evicted": 20.0,
                                      "read": 0.0, "refused": 1.0, "evicted_blocks": 0.0, "stored_blocks": 0.0,
                                      "load_skipped_blocks": 0.0}
    assert out["dram"]["hints_counts"]["evicted_blocks"] == 9.0 and "hints_req_per_s_ratio_to_dram" not in out["dram"]
    assert hinted["outputs_identical"] is True and hinted["outputs_compared"] == 2


def test_different_chat_hints_answers_are_reported_as_not_identical():
    runs = [hints_run("plain", 0, 1.0, 400.0, {}), hints_run("dram+hints", 0, 1.0, 400.0, {})]
    runs[1]["hints_chat_tokens"]["s0g0t1"] = [9, 9]
    out = serve_report.summarize_all(runs, ("plain", "dram+hints"))
    assert out["dram+hints"]["outputs_identical"] is False
    assert out["dram+hints"]["outputs_first_different"] == ["chat-hints-s0g0t1"]


def test_a_chat_hints_only_run_prints_its_table_and_plots(tmp_path, capsys):
    runs = [hints_run("plain", 0, 1.0, 400.0, {}),
            hints_run("dram+hints", 0, 2.0, 100.0, {"kvtier_hints_total[doomed_evicted]": 20.0})]
    result = {"configs": serve_report.summarize_all(runs, ("plain", "dram+hints")),
              "machine": {"vllm": "0.32.0", "kvtier_commit": "abc", "num_cpus": 2}}
    serve_report.print_table(result, bench_serve.CONFIGS)
    table = capsys.readouterr().out
    assert "chat-hints" in table and "kvtier DRAM, session hints" in table and "0.25" in table
    assert "prefix" not in table.lower().split("chat-hints")[0]  # no empty main table above it
    png = tmp_path / "hints.png"
    serve_report.write_png(result, bench_serve.CONFIGS, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_arguments_pick_workloads_and_the_rolling_spec():
    args = bench_serve.parse_args(["--configs", "dram,dram+hints", "--workloads", "chat-hints", "--hints-live", "5"])
    params = bench_serve.params_from(args)
    assert params.configs == ("plain", "dram", "dram+hints") and params.workloads == ("chat-hints",)
    assert params.rolling.num_live == 5 and params.rolling.output_tokens == params.output_tokens
    assert bench_serve.params_from(bench_serve.parse_args([])).rolling is None
    with pytest.raises(SystemExit):
        bench_serve.parse_args(["--workloads", "chat,bogus"])



def test_skip_slow_loads_off_reaches_the_config_kvtier_loads(tmp_path):
    """The switch that tells the load-cost estimate's skipped loads from the hints' effect."""
    import serve_procs
    from kvtier.config import load_config

    for flag, expected in (("on", True), ("off", False)):
        params = bench_serve.params_from(bench_serve.parse_args(["--skip-slow-loads", flag]))
        path = serve_procs.write_kvtier_config(tmp_path / f"{flag}.yaml", tmp_path / "model", 32,
                                               {"dram": {"capacity": "128MiB"}},
                                               transfer=None if params.skip_slow_loads else {"skip_slow_loads": False})
        assert load_config(path).transfer.skip_slow_loads is expected

# ---- end to end ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tiny_chat_hints_run_end_to_end(tmp_path, request):
    """plain vLLM and kvtier DRAM with a hinting client, real servers (~1 min on 2 cores): kvtier
    took every hint, closed every finished conversation, hit, and answered as plain vLLM did."""
    tmp = Path(tempfile.mkdtemp(prefix="kvh-"))  # short: vLLM's IPC socket paths live under TMPDIR
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    out = tmp_path / "hints.json"
    cmd = [sys.executable, str(BENCH / "bench_serve.py"), "--configs", "dram+hints", "--workloads", "chat-hints",
           "--rounds", "1", "--hints-live", "3", "--hints-turns", "2", "--hints-steps", "3",
           "--hints-context-tokens", "300", "--output-tokens", "4", "--gpu-blocks", "40", "--max-model-len", "1024",
           "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=540, env={**os.environ, "TMPDIR": str(tmp)})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    hinted = result["configs"]["dram+hints"]
    spec = rolling.RollingSpec(num_live=3, num_turns=2, num_steps=3, context_tokens=300, user_tokens=64,
                               output_tokens=4, concurrency=2)
    turns = [t for step in rolling.schedule(spec, 1000) for t in step]
    assert hinted["hints_counts"]["refused"] == 0
    assert hinted["hints_counts"]["read"] == len(turns)  # every request's hint was taken
    assert hinted["hints_counts"]["closed"] == sum(t.last for t in turns)
    assert hinted["hints_counts"]["hit_blocks"] > 0 and hinted["outputs_identical"] is True
    assert result["configs"]["plain"]["hints_counts"]["read"] == 0  # plain's client sent none
