"""How `kvtier simulate` prints a report: a headline, then rich tables (runs, tiers, sweep, servers).

Every table fits the console's width without cutting a number: `_fit` drops the columns marked
droppable (saying which, under the table; `--json` has them all), then splits the rest across
several tables that each repeat the key columns, and gives every column the width of its widest
cell. Headers are written over two lines where that makes a column narrower.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from rich.cells import cell_len
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
    width = console.width
    if report["runs"]:
        console.print(*_runs_tables(report["runs"], width))
        console.print(*_tiers_tables(report["runs"], width))
    if "servers" in report:
        console.print(*_servers_tables(report["servers"], width))
        console.print(*_loads_tables(report["servers"], width))
        console.print(f"[bold]pooling:[/bold] {report['servers']['message']}")
    if "hints" in report:
        console.print(*_hints_tables(report["hints"], width))
    if "sweep" in report:
        console.print(*_sweep_tables(report["sweep"], width))
        console.print(f"[bold]recommendation:[/bold] {report['sweep']['recommendation']['message']}")
    for note in report["notes"]:
        console.print(f"[yellow]note:[/yellow] {note}")
    for path in report.get("plots", []):
        console.print(f"plot: {path}")


@dataclass(frozen=True, slots=True)
class _Column:
    """One column: its header (a newline splits it over lines), its cells, and whether it may be dropped."""

    header: str
    cells: list[str]
    justify: str = "right"
    drop_rank: int = 0  # 0: always shown; when too wide, the highest rank goes first

    @property
    def width(self) -> int:
        return max(cell_len(text) for text in (*self.header.split("\n"), *self.cells))


def _fit(title: str, columns: list[_Column], width: int, *, num_keys: int = 1,
         sections: Sequence[int] = ()) -> list[Table]:
    """Tables showing `columns` within `width` cells, numbers whole (see the module docstring).

    Args:
        title: the table's title (numbered when the columns are split over several tables).
        columns: all columns, the first `num_keys` of them identify a row and are repeated in each table.
        width: the console's width.
        sections: row indices after which a table draws a line.
    Returns:
        One table, or several side by side in meaning (same rows, other columns).
    """
    kept = list(columns)
    dropped = []
    while _table_width(kept) > width and any(c.drop_rank for c in kept):
        victim = max((c for c in kept if c.drop_rank), key=lambda c: c.drop_rank)
        kept.remove(victim)
        dropped.append(victim.header.replace("\n", " "))
    keys, groups = kept[:num_keys], [[]]
    for column in kept[num_keys:]:
        if groups[-1] and _table_width([*keys, *groups[-1], column]) > width:
            groups.append([])
        groups[-1].append(column)
    titles = [title] if len(groups) == 1 else [f"{title} ({i}/{len(groups)})" for i in range(1, len(groups) + 1)]
    tables = [_table(name, [*keys, *group], sections, width) for name, group in zip(titles, groups)]
    if dropped:
        tables[-1].caption = f"not shown, too wide for {width} columns: {', '.join(dropped)} (--json has every figure)"
    return tables


def _table(title: str, columns: list[_Column], sections: Sequence[int], width: int) -> Table:
    table = Table(title=title, min_width=min(width, cell_len(title)))  # as wide as its title, so it stays on one line
    for c in columns:  # no_wrap and the widest cell's width: rich never cuts a number ("fold" if all else fails)
        table.add_column(c.header, justify=c.justify, no_wrap=True, min_width=c.width, overflow="fold")
    for i, row in enumerate(zip(*(c.cells for c in columns))):
        table.add_row(*row, end_section=i in sections)
    return table


def _table_width(columns: list[_Column]) -> int:
    """Cells a rich table of these columns takes: each column, its two padding cells, and the rules between."""
    return sum(c.width for c in columns) + 3 * len(columns) + 1


def _runs_tables(runs: list[dict], width: int) -> list[Table]:
    tiers = list(dict.fromkeys(name for r in runs for name in r["tiers"]))
    ttft = [[f"{r['ttft_s'][p]:.3f} s" for r in runs] for p in ("p50", "p90", "p99")]
    return _fit("block hit rate and estimated TTFT", [
        _Column("run", [r["label"] for r in runs], "left"),
        _Column("block\nhit", [f"{r['block_hit_rate']:.1%}" for r in runs]),
        *[_Column(f"{n}\nhit", [f"{r['tiers'][n]['hit_rate']:.1%}" if n in r["tiers"] else "" for r in runs])
          for n in tiers],
        _Column("tokens\nsaved", [f"{r['prefill']['token_hit_rate']:.1%}" for r in runs]),
        _Column("TTFT\np50", ttft[0]), _Column("TTFT\np90", ttft[1], drop_rank=1), _Column("TTFT\np99", ttft[2]),
        _Column("no cache\nTTFT p50", [f"{r['ttft_no_cache_s']['p50']:.3f} s" for r in runs], drop_rank=2),
    ], width)


def _tiers_tables(runs: list[dict], width: int) -> list[Table]:
    rows = [(r["label"], name, t) for r in runs for name, t in r["tiers"].items()]
    ends = [n - 1 for n in accumulate(len(r["tiers"]) for r in runs)]  # a line after each run's tiers

    def column(header: str, cell, drop_rank: int = 0) -> _Column:
        return _Column(header, [cell(t) for _, _, t in rows], drop_rank=drop_rank)

    return _fit("per tier", [
        _Column("run", [label for label, _, _ in rows], "left"), _Column("tier", [name for _, name, _ in rows], "left"),
        column("slots", lambda t: f"{t['num_slots']:,}"), column("capacity", lambda t: _bytes(t["capacity_bytes"]), 1),
        column("hits", lambda t: f"{t['hits']:,}"), column("stored", lambda t: f"{t['stores']:,}"),
        column("evicted", lambda t: f"{t['evictions']:,}"), column("read", lambda t: _bytes(t["bytes_read"])),
        column("written", lambda t: _bytes(t["bytes_written"])),
    ], width, num_keys=2, sections=ends)


def _sweep_tables(sweep_report: dict, width: int) -> list[Table]:
    rows, points = sweep_report["rows"], sweep_report["points"]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    by_point = {(r["capacity_blocks"], r["label"]): r for r in rows}
    some = {r["capacity_blocks"]: r for r in rows}
    return _fit(f"block hit rate vs {sweep_report['tier']} capacity", [
        _Column("blocks", [f"{p:,}" for p in points]),
        _Column("bytes", [_bytes(some[p]["capacity_bytes"]) for p in points], drop_rank=1),
        *[_Column(label.replace("+", "\n+"), [f"{by_point[p, label]['block_hit_rate']:.1%}" for p in points])
          for label in labels],
    ], width)


def _servers_tables(result: dict, width: int) -> list[Table]:
    n, d = result["num_servers"], result["dram_blocks_per_server"]
    rows = [(f"private: {n} x {d:,}", result["private"], "local DRAM"),
            ("shared pool, N x D", result["shared"], "fabric")]
    if result["matching"] is not None:
        rows.append(("smallest matching pool", result["matching"], "fabric"))
    traffic = [r.get("local_dram") or r["fabric"] for _, r, _ in rows]
    return _fit(f"{n} servers ({result['route']} routing, {result['policy']}): private DRAM vs one shared pool", [
        _Column("memory", [name for name, _, _ in rows], "left"),
        _Column("blocks", [f"{r['capacity_blocks']:,}" for _, r, _ in rows]),
        _Column("capacity", [_bytes(r["capacity_bytes"]) for _, r, _ in rows], drop_rank=1),
        _Column("block\nhit", [f"{r['block_hit_rate']:.2%}" for _, r, _ in rows]),
        _Column("tokens\nsaved", [f"{r['tokens_saved']:,} ({r['token_hit_rate']:.1%})" for _, r, _ in rows]),
        _Column("capacity\nsaved",
                [f"{r['capacity_saved_blocks']:,} ({r['capacity_saved_share']:.1%})" for _, r, _ in rows]),
        _Column("read", [_bytes(t["bytes_read"]) for t in traffic]),
        _Column("written", [_bytes(t["bytes_written"]) for t in traffic]),
        _Column("traffic\nover", [where for _, _, where in rows], "left"),
    ], width)


def _hints_tables(result: dict, width: int) -> list[Table]:
    rows = result["rows"]

    def share(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    return _fit(f"retention hints ({result['spec']}): share of the LRU -> Belady gap closed", [
        _Column("run", [r["label"] for r in rows], "left"),
        _Column("tiers", [", ".join(f"{k}={n:,}" for k, n in r["tiers"].items()) for r in rows], "left"),
        _Column("LRU", [f"{r['lru']:.2%}" for r in rows], drop_rank=1),
        _Column("Belady", [f"{r['belady']:.2%}" for r in rows], drop_rank=1),
        _Column("hit\nno hints", [f"{r['block_hit_rate']:.2%}" for r in rows]),
        _Column("hit\nhints", [f"{r['block_hit_rate_hinted']:.2%}" for r in rows]),
        _Column("gap closed\nno hints", [share(r["gap_closed"]) for r in rows]),
        _Column("gap closed\nhints", [share(r["gap_closed_hinted"]) for r in rows]),
    ], width)


MAX_SERVER_ROWS = 16  # the load table shows the first and last 8 servers beyond this (the JSON lists all)


def _loads_tables(result: dict, width: int) -> list[Table]:
    servers = result["per_server"]
    shown = servers if len(servers) <= MAX_SERVER_ROWS else [*servers[:MAX_SERVER_ROWS // 2], None,
                                                              *servers[-(MAX_SERVER_ROWS // 2):]]
    more = f"({len(servers) - MAX_SERVER_ROWS:,} more)"

    def column(header: str, cell) -> _Column:
        return _Column(header, ["..." if s is None else cell(s) for s in shown])

    return _fit(f"load per server ({result['num_conversations']:,} conversations, "
                f"{result['num_split_conversations']:,} split across servers)", [
        _Column("server", [more if s is None else str(s["server"]) for s in shown]),
        column("requests", lambda s: f"{s['num_requests']:,}"),
        column("block\naccesses", lambda s: f"{s['num_accesses']:,}"),
        column("conversations", lambda s: f"{s['num_conversations']:,}"),
        column("private\nhit", lambda s: f"{s['private_block_hit_rate']:.1%}"),
    ], width)


def _bytes(num_bytes: int) -> str:
    return format_bytes(num_bytes)
