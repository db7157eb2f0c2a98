"""`demo_report.tier_figures`: a tier's loaded bytes and load latency from the runtime's counters."""

from __future__ import annotations

import pytest

from kvtier.demo.report import tier_figures

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
