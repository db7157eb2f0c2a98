"""`kvtier doctor`: what someone bringing up RDMA (or any tier) needs to see in one command.

Each check is a `Check(name, status, detail, hint)` with status ok, warn or fail; `--json` prints
them as a list. The exit status is 1 when any check fails. torch and pyverbs are imported lazily,
inside their checks, and a missing one is itself a finding.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MEMLOCK_ADVICE_BYTES = 64 << 30  # below this a pool node's or client's registrations may fail


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: str  # "ok", "warn" or "fail"
    detail: str
    hint: str = ""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("doctor", help="check RDMA, memory locking, hugepages, O_DIRECT and CUDA",
                              description="Report what this host offers each kvtier tier, with hints.")
    p.add_argument("--json", action="store_true", help="print a JSON list of checks")
    p.add_argument("--verbs", metavar="MODULE", default="pyverbs",
                   help="verbs provider to check: pyverbs (default), or a stand-in's module such as "
                        "kvtier.testing.fake_verbs")
    p.add_argument("--ssd-dir", metavar="DIR",
                   help="directory whose O_DIRECT support to probe (default: the config's SSD path, else a temp dir)")
    p.add_argument("--config", metavar="FILE",
                   help="a kvtier config to check this host against: the locked memory its RDMA pool tier "
                        "needs for zero copy, its SSD path")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    need, ssd_dir = (None, None)
    if args.config:
        from kvtier.config import load_config
        from kvtier.errors import ConfigError

        try:
            config = load_config(args.config)
        except (ConfigError, OSError) as e:
            print(f"kvtier doctor: {args.config}: {e}")
            return 2
        need, ssd_dir = memlock_needed(config), _ssd_dir(config)
    checks = [*check_rdma(args.verbs), check_memlock(need), check_hugepages(), check_o_direct(args.ssd_dir or ssd_dir),
              check_cuda(), check_transport(args.verbs)]
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        for c in checks:
            print(f"[{c.status:>4}] {c.name}: {c.detail}" + (f"\n       hint: {c.hint}" if c.hint else ""))
    return 1 if any(c.status == "fail" for c in checks) else 0


def check_rdma(verbs: str = "pyverbs") -> list[Check]:
    from kvtier.pool.verbs import (
        NoRDMADevice,
        device_names,
        gid_table,
        load_verbs,
        select_gid,
    )

    try:
        v = load_verbs(verbs)
        names = device_names(v)
    except NoRDMADevice as e:
        from kvtier.pool.detect import rxe_setup_script

        return [Check("rdma", "warn", str(e),
                      f"pool traffic uses TCP; for soft-RoCE: sudo bash {rxe_setup_script()} up IFACE")]
    out = []
    for name in names:
        ctx = v.Context(name=name)
        try:
            table = gid_table(v, ctx)
            ports = [(p, ctx.query_port(p)) for p in range(1, ctx.query_device().phys_port_cnt + 1)]
        finally:
            ctx.close()
        for port, attr in ports:
            active = attr.state == v.e.IBV_PORT_ACTIVE
            v2 = [g for g in table if g.port == port and g.gid_type.value == "RoCE v2"]
            out.append(Check(f"rdma {name} port {port}", "ok" if active else "warn",
                             f"state {'ACTIVE' if active else attr.state}, active MTU enum {attr.active_mtu}, "
                             f"RoCE v2 GIDs: {', '.join(f'{g.index}={g.gid}' for g in v2) or 'none'}",
                             "" if active else "bring the port's netdev up (ip link set IFACE up)"))
        best = select_gid(table)
        out.append(Check(f"rdma {name} GID", "ok" if best else "fail",
                         f"index {best.index} on port {best.port} ({best.gid}, {best.gid_type.value})" if best
                         else "no usable GID", "" if best else "assign an IPv4 address to the RoCE netdev"))
    return out


def memlock_needed(config: Any) -> tuple[int, str] | None:
    """Bytes a client with `config` pins for its RDMA pool tier, and what for; None without one.

    Zero copy registers the whole DRAM slab once, and each node's connection a staging buffer.
    """
    from kvtier.config import PoolBackend
    from kvtier.pool.detect import TransportKind
    from kvtier.pool.client.rdma import STAGING_BYTES
    from kvtier.kinds import TierKind

    tiers = {t.kind: t for t in config.tiers}
    pool = tiers.get(TierKind.POOL)
    if pool is None or pool.backend is not PoolBackend.KVTIER or pool.transport is TransportKind.TCP:
        return None
    dram = tiers[TierKind.DRAM].capacity_bytes if TierKind.DRAM in tiers else 0
    staging = STAGING_BYTES * len(pool.nodes)
    return dram + staging, f"the DRAM tier ({dram >> 20} MiB, zero copy) and {len(pool.nodes)} staging buffer(s)"


def _ssd_dir(config: Any) -> str | None:
    from kvtier.kinds import TierKind

    return next((str(t.path) for t in config.tiers if t.kind is TierKind.SSD and t.path is not None), None)


def check_memlock(need: tuple[int, str] | None = None) -> Check:
    """`ulimit -l` against what the config pins (`need`), or against general advice without one."""
    name = "locked memory (ulimit -l)"
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return Check(name, "ok", "unlimited")
    hint = ("RDMA registration pins memory: raise it (ulimit -l unlimited, /etc/security/limits.conf, "
            "or LimitMEMLOCK=infinity under systemd)")
    if need is None:
        ok = soft >= MEMLOCK_ADVICE_BYTES
        return Check(name, "ok" if ok else "warn", f"{soft // 1024} KiB", "" if ok else hint)
    need_bytes, what = need
    detail = f"{soft // 1024} KiB; the config pins {need_bytes // 1024} KiB for {what}"
    if soft >= need_bytes:
        return Check(name, "ok", detail)
    return Check(name, "warn", detail + ": past the limit registration fails (unless the process has CAP_IPC_LOCK) "
                 "and blocks are staged through a copy", hint)


def check_hugepages(meminfo: Path = Path("/proc/meminfo"),
                    sysfs: Path = Path("/sys/kernel/mm/hugepages")) -> Check:
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        total, free = int(fields["HugePages_Total"].split()[0]), int(fields["HugePages_Free"].split()[0])
        size = fields["Hugepagesize"].strip()
    except (OSError, KeyError, ValueError):
        return Check("hugepages", "warn", f"{meminfo} has no hugepage counters", "")
    sizes = sorted(p.name.removeprefix("hugepages-") for p in sysfs.glob("hugepages-*")) if sysfs.is_dir() else []
    detail = f"{free} of {total} free ({size} default; sizes {', '.join(sizes) or 'unknown'})"
    return Check("hugepages", "ok" if total else "warn", detail,
                 "" if total else "for `kvtier pool serve --hugepages`: sysctl -w vm.nr_hugepages=N")


def check_o_direct(ssd_dir: str | None) -> Check:
    """O_DIRECT where the SSD tier would keep its slab files.

    A folder that does not exist yet is no failure: the tier creates it at start-up (as `kvtier info`
    says), so it is judged the way the tier makes it (`kvtier.tiers.build._make_ssd_directory`): its
    nearest existing ancestor must be a directory that is no device or kernel folder and takes a new
    folder, and O_DIRECT is probed in a scratch folder made there and removed. A folder it could not
    make (a file on the path, an unwritable ancestor) is a failure naming why.
    """
    from kvtier.errors import TierIOError
    from kvtier.tiers.build import nearest_existing, probe_o_direct_in
    from kvtier.tiers.ssd_files import open_directory

    directory = Path(ssd_dir) if ssd_dir else Path(tempfile.gettempdir())
    name, hint = f"O_DIRECT on {directory}", "give --ssd-dir (or tiers.ssd.path) a folder kvtier can write in"
    existing = nearest_existing(directory)
    if not existing.is_dir():
        why = "is not a directory" if existing == directory else f"is not a directory, so {directory} cannot be created"
        return Check(name, "fail", f"{existing} {why}", hint)
    try:
        os.close(open_directory(str(existing)))
        if existing == directory:
            refusal, where = probe_o_direct_in(directory, ".kvtier-doctor-"), ""
        else:
            with tempfile.TemporaryDirectory(dir=existing, prefix=".kvtier-doctor-") as scratch:
                refusal = probe_o_direct_in(Path(scratch), ".kvtier-doctor-")
            where = f" (probed in {existing}: the directory is created at start-up)"
    except (OSError, TierIOError) as e:
        why = "cannot probe" if existing == directory else f"cannot create the directory in {existing}"
        return Check(name, "fail", f"{why}: {e.strerror or e}", hint)
    if refusal:
        return Check(name, "warn", refusal + where, "the SSD tier falls back to the page cache here")
    return Check(name, "ok", "an aligned O_DIRECT write and read succeeded" + where)


def check_cuda() -> Check:
    try:
        import torch
    except ImportError:
        return Check("CUDA", "warn", "torch is not installed", "install torch with CUDA for the GPU tier")
    if not torch.cuda.is_available():
        return Check("CUDA", "warn", f"torch {torch.__version__}: no CUDA device", "GPU tiers need a CUDA device")
    try:
        pinned = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True).is_pinned()
    except RuntimeError as e:
        pinned, why = False, str(e)
    else:
        why = ""
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return Check("CUDA", "ok" if pinned else "warn", f"{names}; pinned host memory {'works' if pinned else 'fails'}"
                 + (f" ({why})" if why else ""), "" if pinned else "raise ulimit -l")


def check_transport(verbs: str = "pyverbs") -> Check:
    from kvtier.errors import ConfigError
    from kvtier.pool.detect import TransportKind, choose_transport

    try:
        kind, why = choose_transport(TransportKind.AUTO, verbs=verbs)
    except ConfigError as e:
        return Check("pool transport (auto)", "fail", str(e))
    return Check("pool transport (auto)", "ok", f"{kind.value} ({why})")
