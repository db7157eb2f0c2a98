"""`kvtier bench`: spill/fill latency (p50/p99/p999) and GB/s per tier path, block size and queue
depth, each against the machine's own limit measured in the same run (`kvtier.bench`).

Prints a Markdown table and the facts needed to read it (HBM stand-in, pool transport, O_DIRECT);
`--json FILE` writes everything, `--plot DIR` the PNG plots. The default run takes under 2 minutes on
a 2-core machine, `--quick` about 20 s. A bad --ssd-dir (missing, read-only, full) exits 2 before
anything is written.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError

DEFAULT_SSD_DIR = "/var/tmp"


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--quick", action="store_true",
                   help="a ~20 s run: 64KiB and 1MiB blocks, short rows (explicit --sizes/--depths still win)")
    p.add_argument("--tiers", metavar="LIST", help="comma-separated paths: hbm-dram, dram-pool, dram-ssd, e2e "
                   "(= e2e-hbm-dram, e2e-hbm-pool, e2e-hbm-ssd, e2e-pool-shared: blocks another process stored); default all")
    p.add_argument("--sizes", metavar="LIST", help="block sizes, multiples of 4KiB (default 64KiB,256KiB,1MiB,4MiB)")
    p.add_argument("--depths", metavar="LIST", help="queue depths (default 1,4)")
    p.add_argument("--ssd-dir", metavar="DIR", default=DEFAULT_SSD_DIR,
                   help=f"an existing directory on the SSD to test (default {DEFAULT_SSD_DIR}); the bench writes "
                        "only in a scratch directory inside it, removed afterwards")
    p.add_argument("--pool", metavar="HOST:PORT", help="a running pool node (default: start one on 127.0.0.1)")
    p.add_argument("--row-seconds", type=float, metavar="S", help="time spent timing each row (default 0.35)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots: latency CDF per path, bandwidth vs block size")
    return p


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="spill/fill latency and bandwidth per tier, against the machine's limits",
                              description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def options_from_args(args: argparse.Namespace):
    """The `BenchOptions` the arguments describe. Raises ConfigError naming the option at fault."""
    from kvtier.bench.runner import BenchOptions, expand_paths, quick
    from kvtier.units import parse_size

    explicit: dict[str, Any] = {}
    if args.tiers:
        explicit["paths"] = expand_paths(_items(args.tiers, "--tiers"))
    if args.sizes:
        explicit["sizes_bytes"] = tuple(parse_size(s, "--sizes") for s in _items(args.sizes, "--sizes"))
    if args.depths:
        explicit["depths"] = tuple(_int(d, "--depths") for d in _items(args.depths, "--depths"))
    if args.row_seconds is not None:
        if not 0 < args.row_seconds <= 60:
            raise ConfigError(f"--row-seconds: must be in (0, 60], got {args.row_seconds}")
        explicit["row_seconds"] = args.row_seconds
    base = BenchOptions(ssd_dir=args.ssd_dir, pool=args.pool)
    return quick(base, **explicit) if args.quick else replace(base, **explicit)


def execute(args: argparse.Namespace):
    """Runs the bench the arguments describe, prints and writes its report; returns the `BenchResult`."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from kvtier.bench import report
    from kvtier.bench.runner import plan, run_bench

    options = options_from_args(args)
    _check_outputs(args)
    steps = plan(options)
    console = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("starting", total=2 * len(steps))
        result = run_bench(
            options, on_row=lambda m: progress.advance(task),
            on_step=lambda s: progress.update(task, description=f"{s.path} {report.size_label(s.block_bytes)} "
                                                                f"qd {s.depth}"))
    rows = [m.row for m in result.measured]
    print(report.markdown_table(rows))
    print()
    for line in report.notes(result):
        print(f"- {line}")
    if args.json:
        report.write_json(result, Path(args.json))
        print(f"results: {args.json}")
    if args.plot:
        written = report.write_plots(result, Path(args.plot))
        print(f"plots: {', '.join(str(p) for p in written)}")
    sys.stdout.flush()
    return result


def run(args: argparse.Namespace) -> int:
    execute(args)
    return 0


def _check_outputs(args: argparse.Namespace) -> None:
    """Creates the --json file's folder and the --plot folder now, not after a 2-minute run."""
    for option, folder in (("--json", Path(args.json).parent if args.json else None),
                           ("--plot", Path(args.plot) if args.plot else None)):
        if folder is not None:
            create_folder(folder, option)


def create_folder(folder: Path, option: str) -> None:
    """Creates an output folder (and its parents) before a long run, not after it.

    Raises:
        ConfigError: it cannot be made (a file of that name, no permission, a full disk); names `option`.
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{option}: cannot create {folder}: {e.strerror}") from None


def _items(value: str, option: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise ConfigError(f"{option}: expected a comma-separated list, got {value!r}")
    return items


def _int(value: str, option: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{option}: expected whole numbers, got {value!r}") from None
