"""`kvtier info`: the tiers, their capacities and media, the block geometry, and what is active."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from kvtier.units import format_bytes


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("info", help="show tiers, capacities, media, block geometry and active devices",
                              description="Describe the configured tiers without building them: nothing is created "
                                          "(no slab file, no memory, no connection).")
    p.add_argument("--config", metavar="FILE", help="YAML configuration (default: the embedded default.yaml)")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of tables")
    p.set_defaults(func=run)
    return p


def environment() -> dict[str, Any]:
    """Which device and transports this process would use."""
    import torch

    from kvtier.pool.detect import TransportKind, choose_transport, rdma_devices

    cuda = torch.cuda.is_available()
    transport, why = choose_transport(TransportKind.AUTO)
    return {
        "torch": torch.__version__,
        "cuda": cuda,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (CPU tensor stands in for HBM)",
        "device_host_copy": "CUDA streams + events" if cuda else "thread copies (no CUDA)",
        "ssd_io": "worker threads, pread/pwrite",
        "rdma_devices": rdma_devices(),
        "pool_transport": f"{transport.value} ({why})",  # what a pool tier's `transport: auto` takes here
    }


def collect(config_path: str | None) -> dict[str, Any]:
    """What `kvtier info` prints, from the config alone (`planned_facts`: nothing is built)."""
    from kvtier.model.catalog import match_note, resolve_model
    from kvtier.config import load_config
    from kvtier.tiers.build import planned_facts

    cfg = load_config(config_path)
    geometry = resolve_model(cfg.model, kv_dtype=cfg.kv_dtype)
    layout = geometry.block_layout(cfg.block_tokens)
    return {
        "config": config_path or "embedded default.yaml",
        "model": geometry.name,
        "model_note": match_note(cfg.model),  # the config's name when it is not the catalog's own
        "kv_dtype": geometry.kv_dtype.value,
        "kv_bytes_per_token": geometry.kv_bytes_per_token(),
        "block_bytes": layout.block_bytes, "block_tokens": layout.block_tokens, "num_layers": layout.num_layers,
        "mode": cfg.mode.value,
        "tiers": [planned_facts(t, layout.block_bytes) for t in cfg.tiers],
        "environment": environment(),
    }


def run(args: argparse.Namespace) -> int:
    info = collect(args.config)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    console = Console()
    if info["model_note"]:
        console.print(info["model_note"])
    console.print(f"[bold]kvtier[/] — {info['config']}: model {info['model']} ({info['kv_dtype']}), "
                  f"{info['kv_bytes_per_token']:,} B/token, block = {info['block_tokens']} tokens × "
                  f"{info['num_layers']} layers = {info['block_bytes']:,} B, mode {info['mode']}")
    table = Table("tier", "medium", "capacity", "blocks", "details")
    for t in info["tiers"]:
        details = {k: v for k, v in t.items() if k not in ("tier", "medium", "capacity_bytes", "num_slots",
                                                            "slot_bytes", "files")}
        table.add_row(t["tier"], t["medium"], format_bytes(t["capacity_bytes"]), f"{t['num_slots']:,}",
                      ", ".join(f"{k}={v}" for k, v in details.items()))
    console.print(table)
    env = info["environment"]
    console.print(f"device: {env['device']}; device↔host: {env['device_host_copy']}; SSD: {env['ssd_io']}")
    console.print(f"RDMA devices: {', '.join(env['rdma_devices']) or 'none'}; pool transport (auto): "
                  f"{env['pool_transport']}")
    return 0
