"""Tier benchmark: the DRAM and SSD tiers against the machine's own limits, measured in one run.

A thin wrapper over `kvtier bench` (the measurement code lives in `kvtier/bench/`), run on the
paths it always covered, with their goals at 1-4 MiB blocks:

(a) hbm-dram: HBM tier read/write to and from DRAM tier slots, as a ratio to a plain copy of the
    same bytes (memcpy; pinned cudaMemcpy on a GPU) — goal >= 0.9.
(b) dram-ssd: SSD tier write/read from DRAM tier slots, as a ratio to raw `pwrite`/`preadv` of the
    same block size, queue depth and file striping, O_DIRECT exactly when the tier has it — goal >= 0.85.

Every `kvtier bench` option works here too (`--tiers`, `--sizes`, `--json`, `--plot`, ...).

    python bench/bench_tiers.py [--ssd-dir /var/tmp] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.cli.bench import add_arguments, execute
from kvtier.errors import KVTierError

GOALS = {"hbm-dram": 0.9, "dram-ssd": 0.85}
GOAL_FROM_BYTES = 1 << 20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(tiers="hbm-dram,dram-ssd", sizes="1MiB,2MiB,4MiB")
    args = p.parse_args(argv)
    try:
        result = execute(args)
    except KVTierError as e:
        print(f"bench_tiers: error: {e}", file=sys.stderr)
        return 2
    goal_rows = [m.row for m in result.measured if m.row.path in GOALS and m.row.block_bytes >= GOAL_FROM_BYTES]
    below = [r for r in goal_rows if r.ratio < GOALS[r.path]]
    for r in below:
        print(f"below goal: {r.path} {r.op} {r.block_bytes >> 20} MiB qd {r.queue_depth}: ratio {r.ratio:.2f} "
              f"< {GOALS[r.path]}")
    print(f"goals ({', '.join(f'{k} >= {v}' for k, v in GOALS.items())} at >= 1 MiB): "
          f"{len(goal_rows) - len(below)}/{len(goal_rows)} rows met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
