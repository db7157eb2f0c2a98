"""`kvtier size`: the operator's planner, from model, contexts, concurrency and GPU to tiers and fabrics.

The arithmetic lives in `kvtier.sizing.planner` (pure functions returning plain data); this module reads
the arguments, resolves names against the catalogs (saying which entry a name matched when it is not
the entry's own), and prints the plan as `rich` tables, as JSON, or as a PNG chart.

Examples:
    kvtier size --model llama-2-7b --context 4096 --concurrency 8 --gpu RTX-4090-24
    kvtier size --model llama-3-70b --context-dist p50=4k,p90=32k,max=128k --concurrency 64 \\
        --gpu H100-80 --tp 4 --gpus-per-server 8 --servers 4 --dram 1TiB --ttft-target 0.5s --plot plan.png
"""

from __future__ import annotations

import argparse
import json
import sys
from fractions import Fraction
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvtier.sizing.capacity import PlanInputs, plan
from kvtier.model.catalog import count_weight_params, match_note, resolve_config, resolve_model
from kvtier.errors import ConfigError, GeometryError
from kvtier.model.geometry import ModelGeometry
from kvtier.sizing.hardware import GPU, resolve_gpu
from kvtier.units import GiB, format_bytes, format_decimal, format_params, format_rate, parse_count, parse_seconds, \
    parse_size, parse_tokens
from kvtier.sizing.planner import DEFAULT_RESERVE_FRACTION, WeightDtype, Workload, size_report

DEFAULT_BLOCK_TOKENS = 16  # vLLM's default block size

__all__ = ["add_parser", "format_bytes", "print_report", "run", "size_report"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers `size` on the `kvtier` command's subparsers."""
    p = subparsers.add_parser(
        "size",
        help="plan KV cache, weights, HBM, DRAM / pool / SSD tiers and reload fabrics for a model",
        description="Size the KV cache of a catalog model or a Hugging Face config.json; with a GPU, plan "
        "HBM headroom, what overflows to DRAM, pool and SSD, and the bandwidth a reload needs.",
    )
    p.add_argument("--model", required=True, metavar="NAME|config.json", help="catalog name, HF id or config path")
    ctx = p.add_mutually_exclusive_group(required=True)
    ctx.add_argument("--context", dest="contexts", nargs="+", metavar="N",
                     help="context length(s) in tokens (32k = 32,768); each counted --concurrency times")  # fmt: skip
    ctx.add_argument("--context-dist", metavar="SPEC",
                     help="a distribution of context lengths, e.g. p50=4k,p90=32k,max=128k (min defaults to 0)")
    ctx.add_argument("--context-trace", metavar="FILE",
                     help="a Mooncake trace (or its name: conversation, synthetic) whose input lengths to draw from")
    p.add_argument("--concurrency", type=int, default=1, metavar="B",
                   help="concurrent sequences per model replica (per context length with --context)")  # fmt: skip
    p.add_argument("--kv-dtype", default=None, metavar="DTYPE",
                   help="fp16, bf16, fp8, int8 or fp32 (default: the model's torch_dtype)")  # fmt: skip
    p.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS, metavar="T",
                   help=f"tokens per kvtier block (default {DEFAULT_BLOCK_TOKENS})")  # fmt: skip
    gpu = p.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", metavar="NAME", help="a catalog GPU: A100-40, A100-80, H100-80, H200-141, B200-192, "
                     "L4-24, A10-24, L40S-48, RTX-4090-24, ...")  # fmt: skip
    gpu.add_argument("--hbm", metavar="SIZE", help="GPU memory instead of a GPU name, e.g. 80GiB or 24GB")
    p.add_argument("--weight-dtype", metavar="DTYPE", help="fp32, fp16, bf16, fp8, int8, int4, fp4 "
                   "(default: the checkpoint's quantization or torch_dtype)")  # fmt: skip
    p.add_argument("--params", metavar="N",
                   help="parameter count, e.g. 6.74e9 or 7B (default: counted from the config)")  # fmt: skip
    p.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel degree (default 1)")
    p.add_argument("--gpus-per-server", type=int, default=None, metavar="G", help="GPUs per server (default: --tp)")
    p.add_argument("--servers", type=int, default=1, metavar="N", help="GPU servers sharing the pool (default 1)")
    p.add_argument("--reserve", default=str(float(DEFAULT_RESERVE_FRACTION)), metavar="FRACTION",
                   help="share of HBM kept for activations and fragmentation (default 0.1, as vLLM's 0.9 utilization)")
    p.add_argument("--dram", metavar="SIZE", help="KV capacity of pinned DRAM per server (default: sized for you)")
    p.add_argument("--pool", metavar="SIZE", help="KV capacity of the memory pool, whole cluster (default: sized)")
    p.add_argument("--ssd", metavar="SIZE", help="KV capacity of SSD per server (default: sized)")
    p.add_argument("--ttft-target", default="1s", metavar="DURATION",
                   help="time a context's KV may take to reload, e.g. 0.5s or 500ms (default 1s)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print a JSON object instead of tables")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the plan as a PNG chart")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Prints the plan for parsed `args`.

    Returns:
        0.

    Raises:
        GeometryError: unknown model, unreadable config, unknown KV dtype, TP that does not fit the heads.
        HardwareError: unknown GPU (with close matches). ConfigError: an unreadable size, duration or length.
        ConfigError: a count, fraction or capacity out of range. TraceError: an unreadable trace.
    """
    geometry = resolve_model(args.model, kv_dtype=args.kv_dtype)
    workload = _workload(args)
    gpu = _gpu(args)
    name, cfg = resolve_config(args.model)
    inputs = PlanInputs(
        weight_params=_weight_params(args, name, cfg, need=gpu is not None),
        weight_dtype=WeightDtype.parse(args.weight_dtype) if args.weight_dtype else WeightDtype.of_config(cfg),
        gpu=gpu,
        tensor_parallel=args.tp,
        gpus_per_server=args.gpus_per_server or args.tp,
        num_servers=args.servers,
        reserve_fraction=_fraction("reserve", args.reserve),
        dram_bytes_per_server=_optional_bytes("dram", args.dram),
        pool_bytes=_optional_bytes("pool", args.pool),
        ssd_bytes_per_server=_optional_bytes("ssd", args.ssd),
        ttft_target_s=parse_seconds(args.ttft_target, "ttft_target"),
    )
    report = plan(geometry, workload, args.block_tokens, inputs)
    if args.plot:
        plot_report(report, geometry, args.plot)
    _emit(report, args.model, as_json=args.json)
    return 0


def _emit(report: dict[str, Any], model: str, as_json: bool) -> None:
    """Prints the plan, after `model: X matched as Y` when the name typed is not the catalog's own
    (on stderr with --json, which also records the name typed as `model_requested`)."""
    note = match_note(model)
    if as_json:
        if note:
            report["model_requested"] = model
            print(note, file=sys.stderr)  # stdout stays one JSON object
        print(json.dumps(report, indent=2))
        return
    console = Console()
    if note:
        console.print(note, markup=False, highlight=False)
    print_report(report, console)


def _workload(args: argparse.Namespace) -> Workload:
    if args.contexts:
        return Workload.from_contexts([parse_tokens(n, "context") for n in args.contexts], args.concurrency)
    if args.context_dist:
        return Workload.from_quantiles(parse_context_dist(args.context_dist), args.concurrency)
    from kvtier.simulate.trace import load_trace, resolve_trace_path

    trace = load_trace(resolve_trace_path(args.context_trace))
    return Workload.from_lengths((r.input_tokens for r in trace.requests), args.concurrency)


def parse_context_dist(spec: str) -> dict[str, int]:
    """`p50=4k,p90=32k,max=128k` -> `{"p50": 4096, "p90": 32768, "max": 131072}`.

    Raises:
        ConfigError: an item is not `key=length` or a key repeats. ConfigError: a length is unreadable.
    """
    quantiles: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or not key:
            raise ConfigError(f"context_dist: {item!r} is not key=length; write e.g. p50=4k,p90=32k,max=128k")
        if key in quantiles:
            raise ConfigError(f"context_dist: {key} is given twice")
        quantiles[key] = parse_tokens(value, f"context_dist {key}")
    return quantiles


def _gpu(args: argparse.Namespace) -> GPU | None:
    if args.gpu:
        return resolve_gpu(args.gpu)
    if args.hbm:
        hbm = parse_size(args.hbm, "hbm")
        return GPU(f"a {format_bytes(hbm)} GPU", hbm, host_link="")
    return None


def _weight_params(args: argparse.Namespace, name: str, cfg: dict[str, Any], need: bool) -> int | None:
    """The parameter count: given, or counted; None when it cannot be counted and no GPU needs it."""
    if args.params:
        return parse_count(args.params, "params")
    try:
        return sum(count_weight_params(cfg, name).values())
    except GeometryError as e:
        if need:
            raise GeometryError(f"{e}; or pass --params N") from None
        return None


def _fraction(field: str, text: str) -> Fraction:
    try:
        return Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        raise ConfigError(f"{field}: cannot read {text!r} as a fraction, e.g. 0.1") from None


def _optional_bytes(field: str, text: str | None) -> int | None:
    return None if text is None else parse_size(text, field)


# ---------------------------------------------------------------------------------------------
# rendering


def print_report(report: dict[str, Any], console: Console) -> None:
    """Renders a `plan` (or `size_report`) dict as a summary, tables and a verdict."""
    console.print(_headline(report))
    console.print(_per_token_table(report))
    console.print(_context_table(report))
    if "hbm" in report:
        console.print(_hbm_table(report))
        console.print(_tier_table(report))
    if "reload" in report:
        console.print(_reload_table(report))
    console.rule("verdict")
    for line in report.get("verdict", []):
        style = "bold red" if line.startswith("DOES NOT FIT") else "bold green" if line.startswith("fits") else ""
        console.print(Text(line, style=style))
    if "hbm" not in report:
        console.print("give --gpu NAME or --hbm SIZE to plan HBM headroom and the DRAM / pool / SSD tiers")


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
    table.add_column("KV of")
    table.add_column("bytes", justify="right")
    table.add_column("size (binary units)", justify="right")
    rows = [("per token (all layers)", report["kv_bytes_per_token"])]
    by_kind = report["kv_bytes_per_token_by_kind"]
    if len(by_kind) > 1:
        rows += [(f"  {kind} layers", n) for kind, n in by_kind.items()]
    rows.append((f"per block ({report['block_tokens']:,} tokens)", report["block_bytes"]))
    for label, n in rows:
        table.add_row(label, f"{n:,}", format_bytes(n))
    return table


def _context_table(report: dict[str, Any]) -> Table:
    concurrency, block_tokens = report["concurrency"], report["block_tokens"]
    table = Table(title=f"KV cache per context, × {concurrency:,} concurrent sequences")
    headers = ("context (tokens)", "KV / sequence", f"KV, {concurrency:,} sequences",
               f"{block_tokens:,}-token blocks / sequence", f"bytes in blocks, {concurrency:,} sequences")
    for header in headers:
        table.add_column(header, justify="right")
    for c in report["contexts"]:
        label = f"{c['label']} {c['context_tokens']:,}" if "label" in c else f"{c['context_tokens']:,}"
        table.add_row(label, format_bytes(c["kv_bytes_per_sequence"]), format_bytes(c["kv_bytes_total"]),
                      f"{c['num_blocks_per_sequence']:,}", format_bytes(c["block_bytes_total"]))  # fmt: skip
    table.add_section()
    source = report.get("workload", {}).get("source", "contexts")
    total = "total" if source == "contexts" else f"expected ({source})"
    table.add_row(total, "", format_bytes(report["kv_bytes_total"]), "", format_bytes(report["block_bytes_total"]))
    if "sliding_window_tokens" in report:
        table.caption = "KV honours sliding windows; cached blocks hold every layer for all their tokens."
    elif source != "contexts":
        table.caption = (f"{report['workload']['num_sequences_per_replica']:g} sequences per replica, "
                         f"mean {report['workload']['mean_context_tokens']:,.0f} tokens")  # fmt: skip
    return table


def _hbm_table(report: dict[str, Any]) -> Table:
    h, w = report["hbm"], report["weights"]
    tp = report["parallel"]["tensor_parallel"]
    table = Table(title=f"HBM per GPU: {h['gpu']}, tensor-parallel {tp}")
    table.add_column("per GPU")
    table.add_column("bytes (binary units)", justify="right")
    table.add_column("note")
    rows = [
        ("HBM", h["hbm_bytes"], ""),
        ("− weights", h["weights_bytes"], f"{format_params(w['num_params'])} in {w['dtype']} = "
                                          f"{format_decimal(w['bytes'], 'B')}" + (f", ÷ {tp} GPUs" if tp > 1 else "")),
        ("− runtime reserve", h["reserve_bytes"], f"{h['reserve_fraction']:.0%} of HBM (--reserve)"),
        ("= room for KV", h["kv_room_bytes"], "negative: the weights do not fit" if not h["weights_fit"] else ""),
        ("KV wanted", h["kv_demand_bytes"], f"{report['workload']['num_sequences_per_replica']:g} sequences"),
        ("KV in HBM", h["kv_bytes"],
         f"{h['max_sequences_at_longest_context']:,} sequence(s) of the longest context fit"),
        ("KV overflowing", h["overflow_bytes"], "to DRAM, pool, SSD" if h["overflow_bytes"] else ""),
    ]  # fmt: skip
    for label, n, note in rows:
        table.add_row(label, ("−" if n < 0 else "") + format_bytes(abs(n)), note)
    return table


def _tier_table(report: dict[str, Any]) -> Table:
    t = report["tiers"]
    servers = report["parallel"]["num_servers"]
    table = Table(title="Where the KV lives", caption=f"{servers:,} server(s); {t['placement']}: one copy per block")
    for header in ("tier", "KV per server", "KV in the cluster", "capacity given"):
        table.add_column(header, justify="right" if header != "tier" else "left")
    caps = t["capacities"]
    given = {"dram": caps["dram_bytes_per_server"], "pool": caps["pool_bytes"], "ssd": caps["ssd_bytes_per_server"]}
    for tier in ("hbm", "dram", "pool", "ssd", "unplaced"):
        cap = given.get(tier)
        note = "—" if tier in ("hbm", "unplaced") else "sized for you" if cap is None else format_bytes(cap)
        if tier == "pool" and cap is not None:
            note += " (cluster)"
        table.add_row(tier.upper() if tier != "unplaced" else "recomputed",
                      format_bytes(t["per_server"][f"{tier}_bytes"]), format_bytes(t["cluster"][f"{tier}_bytes"]), note)
    return table


def _reload_table(report: dict[str, Any]) -> Table:
    r = report["reload"]
    table = Table(title=f"Reload one context within {r['ttft_target_s']:g} s (per GPU, over one link)")
    table.add_column("fabric", no_wrap=True)
    table.add_column("tier")
    table.add_column("link GB/s", justify="right")
    for c in r["contexts"]:
        label = f"{c['label']} " if c["label"] else ""
        size = format_bytes(c["bytes_per_gpu"])
        table.add_column(f"time for {label}{c['context_tokens']:,} tokens\n({size} per GPU)", justify="right")
    for f in r["fabrics"]:
        cells = [_duration(c["seconds"]) + (" ✓" if c["meets_target"] else f" ✗×{c['links_needed']}")
                 for c in f["contexts"]]  # fmt: skip
        name = f["name"] + ("*" if f["gpu_host_link"] else "")
        table.add_row(name, f["tier"], format_rate(f["bytes_per_s"]).removesuffix(" GB/s"), *cells)
    needed = ", ".join(format_rate(c["required_bytes_per_s"]) for c in r["contexts"])
    host = "; * the GPU's host link" if any(f["gpu_host_link"] for f in r["fabrics"]) else ""
    table.caption = f"needed per GPU: {needed}; ✗×N: N links (drives) per GPU meet the target{host}"
    return table


def _duration(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1000:.3g} ms"


# ---------------------------------------------------------------------------------------------
# chart


def plot_report(report: dict[str, Any], geometry: ModelGeometry, path: str) -> None:
    """Writes a PNG: where memory goes (HBM per GPU, KV per tier per server), and memory per GPU vs context.

    Raises:
        ConfigError: the file cannot be written.
    """
    import matplotlib  # imported only when a chart is asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, curve) = plt.subplots(1, 2, figsize=(13, 5), width_ratios=(1, 1.2))
    _plot_bars(bars, report)
    _plot_curve(curve, report, geometry)
    fig.suptitle(f"{report['model']} — {report['kv_dtype']} KV", fontweight="bold")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise ConfigError(f"plot: cannot write {path!r}: {e.strerror or e}") from None
    finally:
        plt.close(fig)


_COLORS = {"weights": "#7f7f7f", "reserve": "#c7c7c7", "hbm": "#2ca02c", "free": "#e8f5e9", "overflow": "#fdd0a2",
           "dram": "#1f77b4", "pool": "#9467bd", "ssd": "#ff7f0e", "unplaced": "#d62728"}  # fmt: skip
_LABELS = {"hbm": "KV in HBM", "free": "free HBM", "overflow": "KV that overflows HBM", "dram": "KV in DRAM",
           "pool": "KV in the pool (server's share)", "ssd": "KV on SSD", "unplaced": "KV recomputed (no room)"}


def _plot_bars(ax: Any, report: dict[str, Any]) -> None:
    """Stacked bars in GiB: one GPU's HBM, and one server's KV by tier."""
    if "hbm" not in report:
        ax.text(0.5, 0.5, "no GPU given:\nrun with --gpu or --hbm", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    h, per_server = report["hbm"], report["tiers"]["per_server"]
    gpu_parts = [("weights", h["weights_bytes"]), ("reserve", h["reserve_bytes"]), ("hbm", h["kv_bytes"]),
                 ("free", h["free_bytes"]), ("overflow", h["overflow_bytes"])]  # fmt: skip
    tier_parts = [(t, per_server[f"{t}_bytes"]) for t in ("hbm", "dram", "pool", "ssd", "unplaced")]
    seen = set()
    for x, parts in ((0, gpu_parts), (1, tier_parts)):
        bottom = 0.0
        for name, n in parts:
            if n <= 0:
                continue
            label = None if name in seen else _LABELS.get(name, name)
            seen.add(name)
            hatch = "//" if name == "overflow" else None
            ax.bar(x, n / GiB, bottom=bottom, color=_COLORS[name], label=label, edgecolor="white", hatch=hatch)
            bottom += n / GiB
    ax.axhline(h["hbm_bytes"] / GiB, xmin=0.05, xmax=0.45, color="black", linestyle="--", linewidth=1)
    ax.set_xticks([0, 1], [f"one GPU ({h['gpu']})", "KV of one server, by tier"])
    ax.set_ylabel("GiB")
    ax.set_title("does not fit in HBM: KV overflows" if not h["fits"] else "fits in HBM")
    ax.legend(fontsize=8)


def _plot_curve(ax: Any, report: dict[str, Any], geometry: ModelGeometry) -> None:
    """Memory per GPU against the context length of all `concurrency` sequences."""
    from matplotlib.ticker import MultipleLocator

    share = report["parallel"]["kv_share_per_gpu"]
    concurrency = report["concurrency"]
    longest = report["workload"]["max_context_tokens"]
    xs = sorted({longest * k // 64 for k in range(129)} | {c["context_tokens"] for c in report["contexts"]})
    base = (report["hbm"]["weights_bytes"] + report["hbm"]["reserve_bytes"]) if "hbm" in report else 0
    ys = [(base + share * concurrency * geometry.kv_bytes_for_tokens(n)) / GiB for n in xs]
    ax.plot(xs, ys, label=f"{'weights + reserve + ' if base else ''}KV of {concurrency:,} sequences")
    if "hbm" in report:
        ax.axhline(report["hbm"]["hbm_bytes"] / GiB, color="black", linestyle="--", label="HBM")
        ax.axhline(base / GiB, color=_COLORS["weights"], linestyle=":", label="weights + reserve")
    for c in report["contexts"]:
        ax.axvline(c["context_tokens"], color=_COLORS["dram"], alpha=0.3)
        ax.annotate(c.get("label") or f"{c['context_tokens']:,}", (c["context_tokens"], 0),
                    xycoords=("data", "axes fraction"), xytext=(2, 4), textcoords="offset points", fontsize=8,
                    color=_COLORS["dram"])  # fmt: skip
    ax.xaxis.set_major_locator(MultipleLocator(1 << max(0, (longest // 4).bit_length() - 1)))
    ax.xaxis.set_major_formatter(lambda x, _: f"{x / 1024:g}k" if x >= 1024 and x % 1024 == 0 else f"{x:,.0f}")
    ax.set_xlabel("context length of every sequence (tokens)")
    ax.set_ylabel("GiB per GPU")
    ax.set_title("memory per GPU vs context length")
    ax.legend(fontsize=8)
