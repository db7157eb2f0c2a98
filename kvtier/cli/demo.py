"""`kvtier demo` (`make run`): a tiny model serving a multi-turn workload on every tier, checked
against recomputation, ending with time-to-first-token and memory tables (see `kvtier.demo.run`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DEFAULT_JSON = "out/kvtier-demo.json"
DEFAULT_PLOT_DIR = "out"
DEFAULT_WORK_DIR = "/var/tmp/kvtier/demo"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("demo", help="a tiny model serving conversations on every tier; TTFT vs recompute",
                              description="Serve a multi-turn workload through HBM, DRAM, a local pool node and "
                                          "SSD; check outputs against recomputation; report TTFT and memory.")
    p.add_argument("--quick", action="store_true", help="a smaller workload and 0.5k-2k prefixes (~30 s)")
    p.add_argument("--json", metavar="FILE", default=DEFAULT_JSON, help=f"results file (default {DEFAULT_JSON})")
    p.add_argument("--plot", metavar="DIR", default=DEFAULT_PLOT_DIR,
                   help=f"directory for kvtier-demo-ttft.png (default {DEFAULT_PLOT_DIR})")
    p.add_argument("--work-dir", metavar="DIR", default=DEFAULT_WORK_DIR,
                   help=f"where the tiny model is built and kept (default {DEFAULT_WORK_DIR})")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvtier.demo.run import FULL, QUICK, run_demo
    from kvtier.demo.report import plot

    console = Console(width=None if sys.stdout.isatty() else 120)  # logs and pipes: tables unwrapped
    _quiet_transformers()
    result = run_demo(QUICK if args.quick else FULL, console, Path(args.work_dir))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    console.print(f"results: {out}; plot: {plot(result, Path(args.plot))}")
    if not result["outputs_identical"]:
        console.print("[red]kvtier's outputs differ from recomputation[/]")
        return 1
    console.print("[green]every output is token-identical to recomputation without kvtier[/]")
    return 0


def _quiet_transformers() -> None:
    """Turns off transformers' own progress bars (writing and loading the model): the demo shows its own."""
    try:
        from transformers.utils import logging
    except ImportError:
        return  # the demo says what is missing when it needs it
    logging.disable_progress_bar()
