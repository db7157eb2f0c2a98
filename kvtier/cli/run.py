"""`kvtier run` (`make run`): store and reload a few hundred blocks of a real model's geometry
through every configured local tier, check every byte, and report per-tier counts and bandwidth.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

BATCH_BLOCKS = 8


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("run", help="store and reload blocks through every tier; report counts and bandwidth",
                              description="The main job on a configuration (default: the embedded default.yaml).")
    p.add_argument("--config", metavar="FILE", help="YAML configuration (default: the embedded default.yaml)")
    p.add_argument("--blocks", type=int, default=300, help="blocks to store and reload (default 300)")
    p.add_argument("--json", metavar="FILE", default="out/kvtier-run.json", help="where to write the results")
    p.add_argument("--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics on 127.0.0.1:PORT")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import torch
    import xxhash

    from kvtier.model.catalog import match_note, resolve_model
    from kvtier.config import load_config
    from kvtier.model.keys import Namespace, block_keys
    from kvtier.runtime import KVTier

    if args.blocks < 1:
        raise SystemExit("kvtier run: --blocks must be at least 1")
    console = Console()
    cfg = load_config(args.config)
    geometry = resolve_model(cfg.model, kv_dtype=cfg.kv_dtype)
    note = match_note(cfg.model)
    if note:
        console.print(note)
    layout = geometry.block_layout(cfg.block_tokens)
    ns = Namespace(geometry.name, geometry.kv_dtype.value, cfg.block_tokens, cfg.tenant)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 32000, (args.blocks * cfg.block_tokens,), generator=gen)
    keys = block_keys(ns, tokens)
    console.print(f"[bold]kvtier run[/]: {len(keys)} blocks of {geometry.name} ({geometry.kv_dtype.value}), "
                  f"{layout.block_bytes / 2**20:.1f} MiB each = {len(keys) * layout.block_bytes / 2**30:.2f} GiB")
    with KVTier(cfg, layout=layout) as kv:
        if args.metrics_port is not None:
            console.print(f"metrics: http://127.0.0.1:{kv.serve_metrics(args.metrics_port)}/metrics")
        digests, store_s = _store_all(kv, keys, layout.block_bytes, gen, console)
        kv.quiesce(60)
        placed = dict(zip(keys, kv.where(keys)))
        loads, mismatches = _load_by_tier(kv, keys, placed, digests, layout.block_bytes, console, xxhash)
        kv.quiesce(60)
        result = {"model": geometry.name, "block_bytes": layout.block_bytes, "num_blocks": len(keys),
                  "store": {"seconds": store_s, "gb_per_s": len(keys) * layout.block_bytes / store_s / 1e9},
                  "load_by_source_tier": loads, "mismatched_blocks": mismatches,
                  "tiers": kv.describe()["tiers"], **kv.snapshot()}
    _print(console, result)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    console.print(f"results: {out}")
    if mismatches:
        console.print(f"[red]{mismatches} blocks came back different from what was stored[/]")
        return 1
    return 0


def _store_all(kv, keys, block_bytes, gen, console) -> tuple[dict, float]:
    import torch
    import xxhash

    digests, seconds = {}, 0.0
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("store", total=len(keys))
        for i in range(0, len(keys), BATCH_BLOCKS):
            batch = keys[i:i + BATCH_BLOCKS]
            data = torch.randint(0, 256, (len(batch), block_bytes), dtype=torch.uint8, generator=gen)
            digests.update({k: xxhash.xxh3_64_intdigest(data[j].numpy()) for j, k in enumerate(batch)})
            start = time.perf_counter()
            handle = kv.store(batch, data)
            handle.wait(120)
            seconds += time.perf_counter() - start
            progress.advance(task, len(batch))
    return digests, seconds


def _load_by_tier(kv, keys, placed, digests, block_bytes, console, xxhash) -> tuple[dict, int]:
    import torch

    results, mismatches = {}, 0
    out = torch.empty(BATCH_BLOCKS, block_bytes, dtype=torch.uint8)
    groups: dict[str, list] = {}
    # Fastest tier first: a load from below promotes into DRAM and would push DRAM's blocks down.
    for key, tier in sorted(placed.items(), key=lambda kv_: 99 if kv_[1] is None else int(kv_[1])):
        groups.setdefault(tier.name.lower() if tier is not None else "dropped", []).append(key)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("load", total=len(keys))
        for tier, group in groups.items():
            if tier == "dropped":
                results[tier] = {"blocks": len(group)}
                progress.advance(task, len(group))
                continue
            seconds, ok = 0.0, 0
            for i in range(0, len(group), BATCH_BLOCKS):
                batch = group[i:i + BATCH_BLOCKS]
                start = time.perf_counter()
                handle = kv.load(batch, out[:len(batch)])
                handle.wait(120)
                seconds += time.perf_counter() - start
                for j, key in enumerate(batch):
                    if key in handle.failed:
                        continue
                    ok += 1
                    mismatches += xxhash.xxh3_64_intdigest(out[j].numpy()) != digests[key]
                progress.advance(task, len(batch))
            results[tier] = {"blocks": len(group), "loaded": ok, "seconds": seconds,
                             "gb_per_s": ok * block_bytes / seconds / 1e9 if seconds else 0.0}
    return results, mismatches


def _print(console: Console, r: dict) -> None:
    table = Table("tier", "slots used", "stores", "hits", "evictions", "loaded from", "load GB/s")
    for tier in r["usage"]:
        load = r["load_by_source_tier"].get(tier, {})
        used = r["usage"][tier]
        table.add_row(tier, f"{used['used']}/{used['slots']}", str(r["stores"].get(tier, 0)),
                      str(r["hits"].get(tier, 0)), str(r["evictions"].get(tier, 0)),
                      str(load.get("blocks", 0)), f"{load.get('gb_per_s', 0):.2f}")
    console.print(table)
    moves = Table("route", "GiB moved")
    for route, n in r["bytes_moved"].items():
        moves.add_row(route, f"{n / 2**30:.2f}")
    console.print(moves)
    console.print(f"store: {r['store']['gb_per_s']:.2f} GB/s; demotions {r['demotions']}; "
                  f"promotions {r['promotions']}; dropped {r['dropped'] or 0}; checksum errors "
                  f"{r['checksum_errors']}; blocks that came back different: {r['mismatched_blocks']}")
