"""The `kvtier` command line: a thin layer that parses arguments and calls the library.

Each subcommand lives in its own module exposing `add_parser(subparsers)` and `run(args) -> int`;
modules are imported lazily so `kvtier size` never pays for torch-heavy imports it does not need.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvtier.errors import KVTierError

# subcommand -> module implementing it
COMMANDS: dict[str, str] = {
    "info": "kvtier.cli.info",
    "size": "kvtier.cli.size",
    "run": "kvtier.cli.run",
    "simulate": "kvtier.cli.simulate",
    "pool": "kvtier.cli.pool",
    "doctor": "kvtier.cli.doctor",
    "bench": "kvtier.cli.bench",
    "demo": "kvtier.cli.demo",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; with `only`, just that subcommand's module is imported (a fast start)."""
    parser = argparse.ArgumentParser(prog="kvtier", description="A four-tier KV-cache runtime for LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        if only is None or name == only:
            importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(command).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KVTierError as e:
        print(f"kvtier {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
