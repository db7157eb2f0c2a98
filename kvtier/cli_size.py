"""`kvtier size`: how much KV cache a model needs for given context lengths and concurrency.

The arithmetic is `size_report`, a pure function returning plain data, so a later planner (weights,
GPU HBM headroom, DRAM / pool / SSD tiers) can extend the same dict; this module only parses
arguments and prints it, as a `rich` table or as JSON.
"""

from __future__ import annotations

import argparse
import json
import numbers
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from kvtier.catalog import resolve_model
from kvtier.errors import ConfigError
from kvtier.geometry import ModelGeometry

DEFAULT_BLOCK_TOKENS = 16  # vLLM's default block size


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers `size` on the `kvtier` command's subparsers."""
    p = subparsers.add_parser(
        "size",
        help="KV-cache bytes per token, block, sequence and batch for a model",
        description="Size the KV cache of a catalog model or a Hugging Face config.json.",
    )
    p.add_argument("--model", required=True, metavar="NAME|config.json", help="catalog name, HF id or config path")
    p.add_argument("--context", dest="contexts", type=int, nargs="+", required=True, metavar="N",
                   help="context length(s) in tokens")  # fmt: skip
    p.add_argument("--concurrency", type=int, default=1, metavar="B", help="concurrent sequences per context length")
    p.add_argument("--kv-dtype", default=None, metavar="DTYPE",
                   help="fp16, bf16, fp8, int8 or fp32 (default: the model's torch_dtype)")  # fmt: skip
    p.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS, metavar="T",
                   help=f"tokens per kvtier block (default {DEFAULT_BLOCK_TOKENS})")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Prints the size report for parsed `args`.

    Returns:
        0.

    Raises:
        GeometryError: unknown model, unreadable config or unknown KV dtype.
        ConfigError: a context, the concurrency or the block size is not positive.
    """
    geometry = resolve_model(args.model, kv_dtype=args.kv_dtype)
    report = size_report(geometry, args.contexts, args.concurrency, args.block_tokens)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report, Console())
    return 0


def size_report(
    geometry: ModelGeometry, contexts_tokens: Sequence[int], concurrency: int, block_tokens: int
) -> dict[str, Any]:
    """KV-cache bytes for `concurrency` sequences at each context length.

    Args:
        geometry: the model.
        contexts_tokens: context lengths, in tokens; each is counted `concurrency` times.
        concurrency: concurrent sequences per context length.
        block_tokens: tokens per kvtier block.

    Returns:
        A JSON-ready dict: model facts, `kv_bytes_per_token` (every layer counting every token) and
        its split by layer kind, `block_bytes`, one entry per context under `contexts`
        (`kv_bytes_per_sequence` honours sliding windows; `block_bytes_per_sequence` is what the tiers
        store for the sequence's full blocks), and `kv_bytes_total` over all contexts × concurrency.

    Raises:
        ConfigError: no context is given, or a context, concurrency or block_tokens is not positive.
    """
    if not contexts_tokens:
        raise ConfigError("context: give at least one context length")
    for value in contexts_tokens:
        _check_positive("context", value)
    _check_positive("concurrency", concurrency)
    _check_positive("block_tokens", block_tokens)
    block_bytes = geometry.block_bytes(block_tokens)
    contexts = [_context_entry(geometry, n, concurrency, block_tokens, block_bytes) for n in contexts_tokens]
    return {
        **_model_facts(geometry),
        "kv_bytes_per_token": geometry.kv_bytes_per_token(),
        "kv_bytes_per_token_by_kind": {k.value: n for k, n in geometry.kv_bytes_per_token_by_kind().items()},
        "block_tokens": block_tokens,
        "block_bytes": block_bytes,
        "concurrency": concurrency,
        "contexts": contexts,
        "kv_bytes_total": sum(c["kv_bytes_total"] for c in contexts),
        "block_bytes_total": sum(c["block_bytes_total"] for c in contexts),
    }


def _model_facts(geometry: ModelGeometry) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "model": geometry.name,
        "kv_dtype": geometry.kv_dtype.value,
        "kv_dtype_bytes": geometry.kv_dtype.bytes,
        "num_layers": geometry.num_layers,
        "num_layers_by_kind": {k.value: n for k, n in geometry.num_layers_by_kind().items()},
        "num_attention_heads": geometry.num_attention_heads,
        "num_kv_heads": geometry.num_kv_heads,
        "head_dim": geometry.head_dim,
    }
    if geometry.kv_lora_rank:
        facts |= {"kv_lora_rank": geometry.kv_lora_rank, "qk_rope_head_dim": geometry.qk_rope_head_dim}
    windows = sorted({s.window_tokens for s in geometry.layers if s.window_tokens is not None})
    if windows:
        facts["sliding_window_tokens"] = windows
    return facts


def _context_entry(
    geometry: ModelGeometry, context_tokens: int, concurrency: int, block_tokens: int, block_bytes: int
) -> dict[str, int]:
    per_sequence_bytes = geometry.kv_bytes_for_tokens(context_tokens)
    num_blocks = context_tokens // block_tokens  # a partial last block is never cached
    return {
        "context_tokens": context_tokens,
        "kv_bytes_per_sequence": per_sequence_bytes,
        "kv_bytes_total": per_sequence_bytes * concurrency,
        "num_blocks_per_sequence": num_blocks,
        "block_bytes_per_sequence": num_blocks * block_bytes,
        "block_bytes_total": num_blocks * block_bytes * concurrency,
    }


def _check_positive(field: str, value: Any) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{field} must be a positive integer, got {value!r}")


# ---------------------------------------------------------------------------------------------
# rendering


def format_bytes(num_bytes: int) -> str:
    """`536870912` -> `512 MiB`; binary units, at most two decimals, trailing zeros dropped."""
    value, unit = float(num_bytes), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, bigger
    text = f"{value:,.2f}".rstrip("0").rstrip(".")
    return f"{text} {unit}"


def print_report(report: dict[str, Any], console: Console) -> None:
    """Renders a `size_report` dict as a summary and two tables."""
    console.print(_headline(report))
    console.print(_per_token_table(report))
    console.print(_context_table(report))


def _headline(report: dict[str, Any]) -> str:
    kinds = ", ".join(f"{n} {kind.removesuffix('_attention')}" for kind, n in report["num_layers_by_kind"].items())
    text = f"[bold]{report['model']}[/bold]: {report['num_layers']} layers ({kinds}), kv dtype {report['kv_dtype']}\n"
    if "kv_lora_rank" in report:
        return text + f"MLA latent {report['kv_lora_rank']} + rope {report['qk_rope_head_dim']} per token and layer"
    text += f"{report['num_kv_heads']} KV heads × {report['head_dim']} dims"
    if "sliding_window_tokens" in report:
        text += f", sliding window {', '.join(f'{w:,}' for w in report['sliding_window_tokens'])} tokens"
    return text


def _per_token_table(report: dict[str, Any]) -> Table:
    table = Table(title="KV cache per token and per block")
    table.add_column("unit")
    table.add_column("bytes", justify="right")
    table.add_column("size", justify="right")
    rows = [("per token (all layers)", report["kv_bytes_per_token"])]
    by_kind = report["kv_bytes_per_token_by_kind"]
    if len(by_kind) > 1:
        rows += [(f"  {kind} layers", n) for kind, n in by_kind.items()]
    rows.append((f"per block ({report['block_tokens']:,} tokens)", report["block_bytes"]))
    for label, n in rows:
        table.add_row(label, f"{n:,}", format_bytes(n))
    return table


def _context_table(report: dict[str, Any]) -> Table:
    concurrency = report["concurrency"]
    table = Table(title=f"KV cache per context, × {concurrency:,} concurrent sequences")
    for header in ("context", "KV / seq", f"KV × {concurrency:,}", "blocks / seq", f"blocks × {concurrency:,}"):
        table.add_column(header, justify="right")
    for c in report["contexts"]:
        table.add_row(
            f"{c['context_tokens']:,}",
            format_bytes(c["kv_bytes_per_sequence"]),
            format_bytes(c["kv_bytes_total"]),
            f"{c['num_blocks_per_sequence']:,}",
            format_bytes(c["block_bytes_total"]),
        )
    table.add_section()
    table.add_row("total", "", format_bytes(report["kv_bytes_total"]), "", format_bytes(report["block_bytes_total"]))
    if "sliding_window_tokens" in report:
        table.caption = "KV honours sliding windows; cached blocks hold every layer for all their tokens."
    return table
