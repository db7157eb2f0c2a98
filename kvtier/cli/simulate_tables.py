"""How `kvtier simulate` prints a report: a headline, then rich tables (runs, tiers, sweep, servers)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kvtier.cli.size import format_bytes


def print_report(report: dict, console: Console) -> None:
    """Renders a report as a headline and tables."""
    t, m = report["trace"], report["model"]
    console.print(f"[bold]{t['path']}[/bold]: {t['num_requests']:,} requests, {t['num_accesses']:,} block "
                  f"accesses, {t['num_unique_blocks']:,} distinct blocks (best possible hit rate "
                  f"{t['max_block_hit_rate']:.1%})")
    if t.get("num_reordered"):
        console.print(f"{t['num_reordered']:,} requests came after a later timestamp in the file: replayed in "
                      "timestamp order")
    tails = t["hash_ids_per_request"]
    if tails.get("tail_absent"):
        console.print(f"hash_ids per request: {tails['tail_listed']:,} list the partial tail block (ceil), "
                      f"{tails['tail_absent']:,} leave it out (floor: its tokens are always computed), "
                      f"{tails['whole']:,} are whole blocks")
    console.print(f"{m['name']} {m['kv_dtype']}: {m['block_tokens']} tokens x {m['kv_bytes_per_token']:,} B "
                  f"= {_bytes(m['block_bytes'])} per block")
    if report["runs"]:
        console.print(_runs_table(report["runs"]))
        console.print(_tiers_table(report["runs"]))
    if "servers" in report:
        console.print(_servers_table(report["servers"]))
        console.print(_loads_table(report["servers"]))
        console.print(f"[bold]pooling:[/bold] {report['servers']['message']}")
    if "sweep" in report:
        console.print(_sweep_table(report["sweep"]))
        console.print(f"[bold]recommendation:[/bold] {report['sweep']['recommendation']['message']}")
    for note in report["notes"]:
        console.print(f"[yellow]note:[/yellow] {note}")
    for path in report.get("plots", []):
        console.print(f"plot: {path}")


def _runs_table(runs: list[dict]) -> Table:
    tiers = list(dict.fromkeys(name for r in runs for name in r["tiers"]))
    table = Table(title="block hit rate and estimated TTFT")
    for header in ("run", "block hit", *[f"{n} hit" for n in tiers], "tokens saved", "TTFT p50", "p90", "p99",
                   "no cache p50"):
        table.add_column(header, justify="left" if header == "run" else "right")
    for r in runs:
        ttft = r["ttft_s"]
        table.add_row(r["label"], f"{r['block_hit_rate']:.1%}",
                      *[f"{r['tiers'][n]['hit_rate']:.1%}" if n in r["tiers"] else "" for n in tiers],
                      f"{r['prefill']['token_hit_rate']:.1%}", *[f"{ttft[p]:.3f} s" for p in ("p50", "p90", "p99")],
                      f"{r['ttft_no_cache_s']['p50']:.3f} s")
    return table


def _tiers_table(runs: list[dict]) -> Table:
    table = Table(title="per tier")
    for header in ("run", "tier", "slots", "capacity", "hits", "stored", "evicted", "read", "written"):
        table.add_column(header, justify="left" if header in ("run", "tier") else "right")
    for r in runs:
        for name, t in r["tiers"].items():
            table.add_row(r["label"], name, f"{t['num_slots']:,}", _bytes(t["capacity_bytes"]), f"{t['hits']:,}",
                          f"{t['stores']:,}", f"{t['evictions']:,}", _bytes(t["bytes_read"]),
                          _bytes(t["bytes_written"]))
        table.add_section()
    return table


def _sweep_table(sweep_report: dict) -> Table:
    rows = sweep_report["rows"]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    table = Table(title=f"block hit rate vs {sweep_report['tier']} capacity")
    table.add_column("blocks", justify="right")
    table.add_column("bytes", justify="right")
    for label in labels:
        table.add_column(label, justify="right")
    by_point = {(r["capacity_blocks"], r["label"]): r for r in rows}
    for point in sweep_report["points"]:
        some = next(r for r in rows if r["capacity_blocks"] == point)
        table.add_row(f"{point:,}", _bytes(some["capacity_bytes"]),
                      *[f"{by_point[point, label]['block_hit_rate']:.1%}" for label in labels])
    return table


def _servers_table(result: dict) -> Table:
    n, d = result["num_servers"], result["dram_blocks_per_server"]
    table = Table(title=f"{n} servers ({result['route']} routing, {result['policy']}): private DRAM vs one shared pool")
    for header in ("memory", "blocks", "capacity", "block hit", "tokens saved", "capacity saved", "read", "written",
                   "traffic over"):
        table.add_column(header, justify="left" if header in ("memory", "traffic over") else "right")
    rows = [(f"private: {n} x {d:,}", result["private"], "local DRAM"),
            ("shared pool, N x D", result["shared"], "fabric")]
    if result["matching"] is not None:
        rows.append(("smallest matching pool", result["matching"], "fabric"))
    for name, r, where in rows:
        traffic = r.get("local_dram") or r["fabric"]
        table.add_row(name, f"{r['capacity_blocks']:,}", _bytes(r["capacity_bytes"]), f"{r['block_hit_rate']:.2%}",
                      f"{r['tokens_saved']:,} ({r['token_hit_rate']:.1%})",
                      f"{r['capacity_saved_blocks']:,} ({r['capacity_saved_share']:.1%})",
                      _bytes(traffic["bytes_read"]), _bytes(traffic["bytes_written"]), where)
    return table


MAX_SERVER_ROWS = 16  # the load table shows the first and last 8 servers beyond this (the JSON lists all)


def _loads_table(result: dict) -> Table:
    table = Table(title=f"load per server ({result['num_conversations']:,} conversations, "
                        f"{result['num_split_conversations']:,} split across servers)")
    for header in ("server", "requests", "block accesses", "conversations", "private hit"):
        table.add_column(header, justify="right")
    servers = result["per_server"]
    shown = servers if len(servers) <= MAX_SERVER_ROWS else [*servers[:MAX_SERVER_ROWS // 2], None,
                                                              *servers[-(MAX_SERVER_ROWS // 2):]]
    for s in shown:
        if s is None:
            table.add_row(f"({len(servers) - MAX_SERVER_ROWS:,} more)", "...", "...", "...", "...")
            continue
        table.add_row(str(s["server"]), f"{s['num_requests']:,}", f"{s['num_accesses']:,}",
                      f"{s['num_conversations']:,}", f"{s['private_block_hit_rate']:.1%}")
    return table


def _bytes(num_bytes: int) -> str:
    return format_bytes(num_bytes)
