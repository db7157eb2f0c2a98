"""`kvtier.demo.report`: a tier's loaded bytes and load latency from the runtime's counters, the
report's tables and notes, and the plot's panels (checked through matplotlib's objects).

Cost: about a second (one small figure drawn; no model).
"""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from kvtier.demo.report import plot, print_report, tier_figures
from kvtier.demo.run import workload_summary

BLOCK = 1 << 16


def _snapshot(bytes_moved: dict[str, int], latency: dict[str, tuple[list[int], float]]) -> dict:
    usage = {t: {"used": 1, "slots": 4} for t in ("hbm", "dram", "pool", "ssd")}
    return {"usage": usage, "hits": {"hbm": 1, "dram": 2, "pool": 3, "ssd": 1},
            "bytes_moved": bytes_moved, "transfer_latency": latency}


def test_a_tier_read_on_its_way_up_counts_as_loaded_and_a_demotion_does_not():
    # pool's hits were all promoted into DRAM first (pool->dram), then read from there (dram->buffer);
    # ssd gave one block straight to a buffer; dram->pool is a demotion, not a load out of DRAM.
    snap = _snapshot({"hbm->buffer:cuda": BLOCK, "dram->buffer:cpu": 5 * BLOCK, "pool->dram": 3 * BLOCK,
                      "ssd->buffer:cpu": BLOCK, "dram->pool": 7 * BLOCK, "buffer:cpu->hbm": 9 * BLOCK},
                     {"pool->dram": ([3], 0.003), "ssd->buffer:cpu": ([1], 0.004), "dram->buffer:cpu": ([5], 0.005),
                      "dram->pool": ([7], 0.7)})
    figures = tier_figures(snap, BLOCK)
    assert {t: f["bytes_loaded"] for t, f in figures.items()} == {
        "hbm": BLOCK, "dram": 5 * BLOCK, "pool": 3 * BLOCK, "ssd": BLOCK}
    assert figures["pool"]["mean_load_ms_per_block"] == pytest.approx(1.0)
    assert figures["dram"]["mean_load_ms_per_block"] == pytest.approx(1.0)  # the demotion's 0.7 s left out
    assert figures["hbm"]["mean_load_ms_per_block"] is None  # bytes, but no latency recorded
    assert figures["pool"]["hits"] == 3 and figures["pool"]["bytes_held"] == BLOCK


def _result() -> dict:
    """A demo result with made-up figures: two prompt lengths in the workload, one inverted tier."""
    usage = {t: {"used": 1, "slots": 4} for t in ("hbm", "dram", "pool", "ssd")}
    turns = [{"round": 0, "user": u, "turn": 2, "prompt_tokens": n, "cached_tokens": n - 52, "prepare_ms": 3.0,
              "recompute_ms": 130.0 + u, "kvtier_ms": 25.0 + u} for u, n in enumerate((3124, 3124, 3176))]
    ttft = [{"prefix_tokens": n, "tier": t, "num_blocks": n // 64, "hits_from_tier": n // 64, "identical": True,
             "recompute_ms": 65.0, "kvtier_ms": ms, "ratio": ms / 65.0, "speedup": 65.0 / ms}
            for n in (512, 2048) for t, ms in zip(("dram", "pool", "ssd"), (9.0, 12.0, 15.0) if n == 512
                                                   else (116.0, 26.5, 15.6))]
    memory = [{"phase": "model loaded", "framework": "cpu", "allocated_bytes": None, "reserved_bytes": None,
               "rss_bytes": 1 << 20, "peak_rss_bytes": 1 << 20, "pool_node_rss_bytes": None,
               "tier_share": {t: 0.0 for t in usage}}]
    return {"workload": {"turns": turns, "ttft": workload_summary(turns)}, "ttft": ttft, "memory": memory,
            "final": {"usage": usage}, "load": {"start": 0.5, "end": 3.5, "num_cores": 2}}


def test_the_report_leaves_the_per_tier_table_to_the_workload_and_notes_an_inverted_tier():
    out = io.StringIO()
    print_report(Console(file=out, width=200), _result())
    text = out.getvalue()
    assert "Per tier" not in text  # printed once, with the workload's last round
    notes = [line for line in text.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "at 2,048 tokens dram (116.0 ms) read slower than pool" in notes[0]
    assert "load average 0.5 -> 3.5 on 2 cores" in text


def test_the_plot_has_one_panel_per_measurement_with_each_prompt_length_on_its_own(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to inspect it
    path = plot(_result(), tmp_path)
    assert path.name == "kvtier-demo-ttft.png" and path.stat().st_size > 0
    left, right = figures[0].axes
    assert left.get_title().startswith("Multi-turn workload") and right.get_title().startswith("Prefix placed")
    assert left.get_xlabel() == "prompt length (tokens)" and "(ms)" in left.get_ylabel()
    assert [t.get_text() for t in left.get_xticklabels()] == ["3,124\n(2 turns)", "3,176\n(1 turn)"]
    assert right.get_xlabel().startswith("stored prefix length (tokens") and "ms, log scale" in right.get_ylabel()
    assert [t.get_text() for t in right.get_xticklabels()] == ["512", "2,048"]
    assert [t.get_text() for t in right.get_legend().get_texts()] == [
        "recompute (median)", "kvtier, prefix in dram", "kvtier, prefix in pool", "kvtier, prefix in ssd"]
    monkeypatch.undo()
    plt.close(figures[0])
