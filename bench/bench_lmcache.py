"""kvtier against LMCache 0.5.6's `LocalCPUBackend`, in one process: DRAM puts and gets of a caller's host blocks.

Issue 30's goal: `KVTier.store`/`load` to completion >= 1.2x LMCache's put/get GB/s at 64 KiB,
256 KiB, 1 MiB and 4 MiB blocks. Both sides move the same bytes between the same caller buffers
(a host tensor of `[num_blocks, block_bytes]` uint8) and their own host memory:

- kvtier: a DRAM-only `KVTier` (default transfer settings); `store(keys, rows)` + `wait()`, then
  `load(keys, rows)` + `wait()`, one block per call or a batch per call.
- LMCache: `LocalCPUBackend` built the way LMCache's storage manager builds it (its own allocator
  from `max_local_cpu_size`). A put is what `LMCacheEngine.store` does on the host: `allocate` a
  memory object, copy the caller's bytes into it, `submit_put_task` (a batch:
  `batched_submit_put_task`), `ref_count_down`. A get: `get_blocking` (a batch:
  `batched_get_blocking`), copy out into the caller's buffer, `ref_count_down`.

Each (block size, batch) gets fresh instances with room for every round (no eviction in a timed
pass; both slabs pre-touched) and an untimed warm-up round; then each timed round stores fresh keys
and loads them back. The systems take turns slice by slice (about 8 MiB each, whole calls; who goes
first flips every slice and every round), each with its own copy of the caller's rows, so that the
load other processes put on a shared machine hits them alike. A third lane, plain `copy_` of the
same rows into and out of a slab, is the reference. Reported per round: GB/s, process CPU per block
(every thread of the process), the ratio kvtier/LMCache of the same round; min-max over rounds.

LMCache is installed into a venv of its own (`.venv-lmcache` at the repo root, never the project's):
the exact CPU torch wheel first, then lmcache with `--no-deps` plus the packages its
`LocalCPUBackend` imports, under constraints that keep torch at that wheel. kvtier is imported
from the checkout at run time (PYTHONPATH, with the compiled modules `make venv` built in place),
so a rerun measures the code as it is now. Not part of `make test`.

    python3 bench/bench_lmcache.py [--quick] [--json out.json] [--plot DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
VENV_DIR = REPO_ROOT / ".venv-lmcache"
TORCH = "torch==2.13.0"
LMCACHE = "lmcache==0.5.6"
# What `lmcache.v1.storage_backend.local_cpu_backend` imports (found by importing it in a bare venv),
# with the bounds lmcache 0.5.6 declares for them; its CUDA packages (cupy, cuda-python, cufile, nvtx)
# are left out: nothing on this path imports them.
LMCACHE_DEPS = ("numpy<=2.2.6", "numba", "pyyaml", "requests", "cachetools", "sortedcontainers",
                "prometheus_client>=0.18.0,<=0.24.1", "py-cpuinfo", "psutil", "aiohttp", "aiofile", "msgspec",
                "pyzmq>=25.0.0", "transformers>=5.4", "cryptography")
# Whatever else is installed, torch stays the CPU wheel (a CUDA build is gigabytes).
CONSTRAINTS = (TORCH, "numpy<=2.2.6", "prometheus_client<=0.24.1")
WHEELS = Path("/opt/wheels")
IN_VENV_ENV = "KVTIER_BENCH_LMCACHE_CHILD"

SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20)
GOAL_RATIO = 1.2
NUM_LAYERS = 32  # a block is 32 equal layers on both sides, as a 7-8B model's are
BLOCK_TOKENS = 16
UNITS = {"kib": 1 << 10, "k": 1 << 10, "mib": 1 << 20, "m": 1 << 20, "gib": 1 << 30, "g": 1 << 30, "b": 1, "": 1}


# ---- arguments ---------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """'64KiB', '1MiB', '4m' or '65536' -> bytes.

    Raises:
        argparse.ArgumentTypeError: not a positive size with a known unit.
    """
    s = text.strip().lower()
    digits = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(digits):]
    if not digits.isdigit() or unit not in UNITS or int(digits) <= 0:
        raise argparse.ArgumentTypeError(f"--sizes: {text!r} is not a size like 64KiB, 1MiB or 65536")
    return int(digits) * UNITS[unit]


def parse_sizes(text: str) -> tuple[int, ...]:
    return tuple(parse_size(part) for part in text.split(",") if part.strip())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line. `--quick` makes passes of 16 MiB instead of 64 MiB.

    Raises:
        SystemExit: bad arguments (argparse's message names the option).
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small rounds (16 MiB per pass)")
    p.add_argument("--sizes", type=parse_sizes, default=SIZES, help="block sizes (default 64KiB,256KiB,1MiB,4MiB)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per block size and batch (>= 3)")
    p.add_argument("--round-mib", type=int, default=None, help="bytes per timed pass (default 64, --quick 16)")
    p.add_argument("--batches", default="1,16", help="blocks per call, comma-separated (default 1,16)")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch's intra-op threads (default 1: its OpenMP workers stall copy_ on a loaded machine)")
    p.add_argument("--sync", action="store_true", help="kvtier store/load with sync=True (run in the caller)")
    p.add_argument("--json", type=Path, help="write the rows and every sample here")
    p.add_argument("--plot", type=Path, help="write PNG plots into this folder")
    p.add_argument("--kvtier-root", type=Path, default=REPO_ROOT, help="the kvtier checkout to import")
    p.add_argument("--reinstall", action="store_true", help="rebuild the LMCache venv first")
    p.add_argument("--no-venv", action="store_true", help="run in this interpreter (lmcache must import)")
    args = p.parse_args(argv)
    if args.rounds < 3:
        p.error(f"--rounds: need at least 3 rounds for a min-max, got {args.rounds}")
    if args.round_mib is None:
        args.round_mib = 16 if args.quick else 64
    if args.round_mib <= 0:
        p.error(f"--round-mib: expected a positive number of MiB, got {args.round_mib}")
    if args.torch_threads <= 0:
        p.error(f"--torch-threads: expected a positive number, got {args.torch_threads}")
    if not args.sizes:
        p.error("--sizes: no size given")
    try:
        args.batches = tuple(int(b) for b in args.batches.split(","))
    except ValueError:
        p.error(f"--batches: expected numbers like 1,16, got {args.batches!r}")
    if any(b <= 0 for b in args.batches):
        p.error(f"--batches: blocks per call must be positive, got {args.batches}")
    return args


def blocks_per_pass(block_bytes: int, batch: int, round_mib: int) -> int:
    """Blocks moved in one timed pass: `round_mib` worth, at least two batches, a whole number of batches."""
    wanted = max(1, (round_mib << 20) // block_bytes)
    return max(2 * batch, wanted // batch * batch)


# ---- results (pure: no torch, kvtier or lmcache) -----------------------------------------------

@dataclass(frozen=True)
class Sample:
    """One timed pass: `num_blocks` of `block_bytes` moved by `system` ("kvtier", "lmcache", "memcpy")."""

    system: str
    op: str  # "store" (LMCache: put) or "load" (LMCache: get)
    block_bytes: int
    batch: int
    round: int
    num_blocks: int
    seconds: float
    cpu_seconds: float

    @property
    def gbps(self) -> float:
        return self.num_blocks * self.block_bytes / self.seconds / 1e9

    @property
    def cpu_us_per_block(self) -> float:
        return self.cpu_seconds / self.num_blocks * 1e6


def _span(values: list[float]) -> tuple[float, float]:
    return (min(values), max(values)) if values else (float("nan"), float("nan"))


def summarize(samples: list[Sample]) -> list[dict]:
    """One row per (op, block size, batch): each system's GB/s and CPU per block, the per-round ratio
    kvtier/LMCache (rounds paired by number), memcpy of the same rows; each as [min, max] over rounds."""
    rows = []
    keys = sorted({(s.op, s.block_bytes, s.batch) for s in samples if s.system != "memcpy"},
                  key=lambda k: (k[0] != "store", k[1], k[2]))
    for op, size, batch in keys:
        by = {name: {s.round: s for s in samples if (s.system, s.op, s.block_bytes, s.batch) == (name, op, size, batch)}
              for name in ("kvtier", "lmcache")}
        copies = [s for s in samples if (s.system, s.op, s.block_bytes, s.batch) == ("memcpy", op, size, batch)]
        paired = sorted(set(by["kvtier"]) & set(by["lmcache"]))
        ratios = [by["kvtier"][r].gbps / by["lmcache"][r].gbps for r in paired]
        row = {"op": op, "block_bytes": size, "batch": batch, "num_rounds": len(paired),
               "ratio": _span(ratios), "memcpy_gbps": _span([s.gbps for s in copies])}
        for name in ("kvtier", "lmcache"):
            row[f"{name}_gbps"] = _span([s.gbps for s in by[name].values()])
            row[f"{name}_cpu_us_per_block"] = _span([s.cpu_us_per_block for s in by[name].values()])
        row["goal_met"] = bool(ratios) and min(ratios) >= GOAL_RATIO
        rows.append(row)
    return rows


def format_size(num_bytes: int) -> str:
    return f"{num_bytes >> 20} MiB" if num_bytes >= 1 << 20 else f"{num_bytes >> 10} KiB"


def _fmt(span: tuple[float, float], digits: int) -> str:
    lo, hi = span
    return f"{lo:.{digits}f}-{hi:.{digits}f}"


TABLE_HEADER = ("op", "block", "batch", "kvtier GB/s", "LMCache GB/s", "ratio", "goal", "kvtier CPU us/blk",
                "LMCache CPU us/blk", "memcpy GB/s")


def table_cells(row: dict) -> tuple[str, ...]:
    op = {"store": "store / put", "load": "load / get"}[row["op"]]
    return (op, format_size(row["block_bytes"]), str(row["batch"]), _fmt(row["kvtier_gbps"], 2),
            _fmt(row["lmcache_gbps"], 2), _fmt(row["ratio"], 2), "met" if row["goal_met"] else "below",
            _fmt(row["kvtier_cpu_us_per_block"], 0), _fmt(row["lmcache_cpu_us_per_block"], 0),
            _fmt(row["memcpy_gbps"], 2))


def table_markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
    lines += ["| " + " | ".join(table_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def print_table(rows: list[dict], title: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(table_markdown(rows))
        return
    table = Table(title=title)
    for name in TABLE_HEADER:
        table.add_column(name, justify="left" if name in ("op", "goal") else "right")
    for row in rows:
        table.add_row(*table_cells(row))
    Console(width=200).print(table)


def report(samples: list[Sample], facts: dict) -> dict:
    """The JSON document: what ran, the summary rows, the table, and every sample."""
    rows = summarize(samples)
    return {"facts": facts, "goal_ratio": GOAL_RATIO, "rows": rows, "table_markdown": table_markdown(rows),
            "samples": [asdict(s) | {"gbps": s.gbps, "cpu_us_per_block": s.cpu_us_per_block} for s in samples]}


def write_plots(rows: list[dict], folder: Path) -> list[Path]:
    """One PNG per (op, batch): GB/s of both systems and memcpy against block size, min-max bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for op, batch in sorted({(r["op"], r["batch"]) for r in rows}):
        chosen = sorted((r for r in rows if (r["op"], r["batch"]) == (op, batch)), key=lambda r: r["block_bytes"])
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = list(range(len(chosen)))
        for i, (name, label) in enumerate((("kvtier", "kvtier"), ("lmcache", "LMCache 0.5.6"), ("memcpy", "memcpy"))):
            spans = [r[f"{name}_gbps"] for r in chosen]
            mids = [(lo + hi) / 2 for lo, hi in spans]
            errs = [[m - lo for m, (lo, _) in zip(mids, spans)], [hi - m for m, (_, hi) in zip(mids, spans)]]
            ax.bar([x + (i - 1) * 0.27 for x in xs], mids, 0.27, yerr=errs, capsize=3, label=label)
        for x, r in zip(xs, chosen):  # the ratio kvtier/LMCache above each group
            top = max(r[f"{name}_gbps"][1] for name in ("kvtier", "lmcache", "memcpy"))
            ax.annotate(f"{r['ratio'][0]:.2f}-{r['ratio'][1]:.2f}x", (x, top), xytext=(0, 6),
                        textcoords="offset points", ha="center", fontsize=8)
        ax.margins(y=0.15)
        ax.set_xticks(xs, [format_size(r["block_bytes"]) for r in chosen])
        ax.set_ylabel("GB/s (min-max over rounds; labels: kvtier/LMCache)")
        ax.set_title(f"{'kvtier store vs LMCache put' if op == 'store' else 'kvtier load vs LMCache get'}, "
                     f"{batch} block{'s' if batch > 1 else ''} per call")
        ax.legend()
        path = folder / f"lmcache_{op}_batch{batch}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


# ---- the LMCache venv --------------------------------------------------------------------------

def venv_python(venv: Path = VENV_DIR) -> Path:
    return venv / "bin" / "python"


def _pip(venv: Path, *args: str) -> None:
    find_links = ("--find-links", str(WHEELS)) if WHEELS.is_dir() else ()
    cmd = [str(venv_python(venv)), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *find_links, *args]
    print("bench_lmcache: " + " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True)


def kvtier_requirements(root: Path) -> list[str]:
    """kvtier's own dependencies from its pyproject.toml (read each run: the lead may add one), less torch."""
    import tomllib

    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    return [d for d in deps if not d.replace(" ", "").lower().startswith("torch")]


def ensure_venv(root: Path, reinstall: bool) -> Path:
    """Creates and fills the LMCache venv unless its stamp says it holds exactly these requirements."""
    wanted = [TORCH, LMCACHE, *LMCACHE_DEPS, *kvtier_requirements(root)]
    digest = hashlib.sha256("\n".join(wanted).encode()).hexdigest()
    stamp = VENV_DIR / ".installed"
    if not reinstall and stamp.is_file() and stamp.read_text() == digest:
        return venv_python()
    if reinstall or not venv_python().exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV_DIR)], check=True)
    constraints = VENV_DIR / "constraints.txt"
    constraints.write_text("\n".join(CONSTRAINTS) + "\n")
    _pip(VENV_DIR, TORCH)  # first, so nothing later can resolve to a CUDA build
    _pip(VENV_DIR, "--no-deps", LMCACHE)  # its declared deps include cupy-cuda13x and cuda-python
    _pip(VENV_DIR, "-c", str(constraints), *LMCACHE_DEPS, *kvtier_requirements(root))
    stamp.write_text(digest)
    return venv_python()


def reexec_in_venv(args: argparse.Namespace, argv: list[str]) -> int:
    python = ensure_venv(args.kvtier_root, args.reinstall)
    env = dict(os.environ, PYTHONPATH=str(args.kvtier_root.resolve()), LMCACHE_LOG_LEVEL="WARNING")
    env[IN_VENV_ENV] = "1"
    argv = [a for a in argv if a != "--reinstall"]
    return subprocess.run([str(python), str(Path(__file__).resolve()), *argv], env=env).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not args.no_venv and os.environ.get(IN_VENV_ENV) != "1":
        return reexec_in_venv(args, argv)
    if args.no_venv:
        sys.path.insert(0, str(args.kvtier_root.resolve()))
    from bench_lmcache_run import run_all  # the measuring half, beside this file

    samples, facts = run_all(args)
    doc = report(samples, facts)
    print_table(doc["rows"], f"kvtier vs LMCache {facts['lmcache_version']} LocalCPUBackend (GB/s, min-max over "
                             f"{args.rounds} rounds; goal ratio >= {GOAL_RATIO})")
    met = sum(r["goal_met"] for r in doc["rows"])
    print(f"goal (ratio >= {GOAL_RATIO} in every round): {met}/{len(doc['rows'])} rows met")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        for path in write_plots(doc["rows"], args.plot):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
