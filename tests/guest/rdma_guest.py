"""The `rdma`-marked tests against real kernel verbs: a soft-RoCE guest under QEMU (`make test-rdma`).

This host's kernel has no RDMA support, and its /dev/kvm cannot boot a stock kernel, so the tests
run in a guest under QEMU's software emulation (TCG): the host's own Debian kernel (the PVH entry
point of the vmlinux inside its bzImage needs no firmware), an initramfs of static busybox and the
modules a 9p root needs (built here, cached under /var/tmp/kvtier-guest), and the host's root
shared read-only over virtio-9p under a tmpfs overlay, so the guest runs this checkout and its
`.venv` as they are. In the guest (`guest_rdma.sh`): `rdma_rxe` on a dummy netdev with a TEST-NET
address (192.0.2.1/24, no route out), then pytest on the `rdma` tests. The guest has no network
(`-nic none`); its serial console streams here, prefixed `guest|`. The guest is killed on every
path (timeout, failure, Ctrl-C).

    python tests/guest/rdma_guest.py [--install] [--skip-unavailable] [--timeout S] [-- PYTEST ARGS]

Exit status: the guest's pytest status; 124 on timeout; 125 when the guest could not set up its
device; 2 when the guest cannot run here (0 with `--skip-unavailable`, after a SKIPPED line).
Under emulation everything is slow: this is for correctness, not speed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CACHE = Path("/var/tmp/kvtier-guest")
# What the guest needs from Debian (the kernel package adds files under /boot and /lib/modules only).
PACKAGES = ("qemu-system-x86", "linux-image-amd64", "busybox-static", "cpio", "rdma-core", "ibverbs-providers",
            "ibverbs-utils", "python3-pyverbs", "iproute2", "kmod")
INITRAMFS_MODULES = ("virtio_pci", "9pnet_virtio", "9p", "overlay")


def rdma_test_files() -> list[str]:
    """The test files that use the `rdma` mark: only these are collected in the guest (collecting
    all of tests/ under emulation would cost minutes)."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                  if "mark.rdma" in p.read_text(errors="replace"))
RC_LINE = re.compile(r"KVTIER-GUEST-RC=(\d+)")
SUMMARY = re.compile(r"^=*\s*((\d+ \w+(, )?)+ in [\d.]+s.*?|no tests ran.*?)\s*=*$")  # pytest's last line
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class Unavailable(Exception):
    """The guest cannot run on this machine; the message says why."""


def _version_key(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"[.-]", name))


def find_kernel() -> tuple[Path, str]:
    """The newest /boot/vmlinuz-VERSION whose modules include rdma_rxe and 9p."""
    for image in sorted(Path("/boot").glob("vmlinuz-*"), key=lambda p: _version_key(p.name), reverse=True):
        version = image.name.removeprefix("vmlinuz-")
        mods = Path("/lib/modules") / version / "kernel"
        if (mods / "drivers/infiniband/sw/rxe/rdma_rxe.ko").exists() and (mods / "fs/9p/9p.ko").exists():
            return image, version
    raise Unavailable("no kernel under /boot with rdma_rxe and 9p modules (install linux-image-amd64)")


def qemu_binary() -> str:
    path = shutil.which("qemu-system-x86_64")
    if path is None:
        raise Unavailable("qemu-system-x86_64 not found (install qemu-system-x86)")
    return path


def busybox() -> Path:
    for candidate in (Path("/bin/busybox"), Path("/usr/bin/busybox")):
        if candidate.exists() and b"ld-linux" not in candidate.read_bytes()[:65536]:
            return candidate
    raise Unavailable("no static busybox (install busybox-static)")


def check() -> tuple[str, Path, str]:
    """What the guest needs, or `Unavailable` naming what is missing."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        raise Unavailable(f"needs an x86_64 Linux host, not {sys.platform}/{os.uname().machine}")
    for tool in ("cpio", "modprobe"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            raise Unavailable(f"{tool} not found (install {'cpio' if tool == 'cpio' else 'kmod'})")
    if not (REPO / ".venv/bin/python").exists():
        raise Unavailable(f"no {REPO / '.venv'} (run make venv first)")
    busybox()
    kernel, version = find_kernel()
    return qemu_binary(), kernel, version


def install() -> None:
    """Installs the Debian packages the guest needs (as root, from the package registries)."""
    if os.geteuid() != 0:
        raise Unavailable("the guest's packages are missing and this is not root: " + " ".join(PACKAGES))
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    print("rdma guest: installing " + " ".join(PACKAGES), flush=True)
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    if subprocess.run(cmd, env=env).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env)
        if subprocess.run(cmd, env=env).returncode != 0:
            raise Unavailable("apt-get install of the guest's packages failed")


def module_files(version: str) -> list[Path]:
    """The .ko files of `INITRAMFS_MODULES` and their dependencies, in load order."""
    modprobe = shutil.which("modprobe") or "/usr/sbin/modprobe"
    out: list[Path] = []
    for name in INITRAMFS_MODULES:
        proc = subprocess.run([modprobe, "-S", version, "--show-depends", name], capture_output=True, text=True)
        if proc.returncode != 0:
            raise Unavailable(f"modprobe cannot resolve {name} for {version}: {proc.stderr.strip()}")
        for line in proc.stdout.splitlines():
            parts = line.split()
            if parts and parts[0] == "insmod" and Path(parts[1]) not in out:
                out.append(Path(parts[1]))
    return out


def initramfs(version: str) -> Path:
    """The guest's initramfs (busybox, `init.sh`, the modules), built once per kernel and init."""
    modules = module_files(version)
    init = (HERE / "init.sh").read_bytes()
    digest = hashlib.sha256(init + "\n".join(map(str, modules)).encode()).hexdigest()[:12]
    path = CACHE / f"initramfs-{version}-{digest}.cpio.gz"
    if path.exists():
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        root = Path(tmp) / "root"
        for d in ("bin", "dev", "proc", "sys", "modules"):
            (root / d).mkdir(parents=True)
        shutil.copy2(busybox(), root / "bin/busybox")
        (root / "init").write_bytes(init)
        (root / "init").chmod(0o755)
        for ko in modules:
            shutil.copy2(ko, root / "modules" / ko.name)
        (root / "modules.list").write_text("\n".join(ko.name for ko in modules) + "\n")
        names = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
        with open(Path(tmp) / "out.cpio.gz", "wb") as out:
            cpio = subprocess.Popen(["cpio", "-o", "-H", "newc", "--quiet"], cwd=root, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE)
            gz = subprocess.Popen(["gzip", "-1"], stdin=cpio.stdout, stdout=out)
            cpio.stdout.close()
            cpio.communicate(("\n".join(names) + "\n").encode())
            if cpio.wait() != 0 or gz.wait() != 0:
                raise Unavailable("building the initramfs failed (cpio/gzip)")
        os.replace(Path(tmp) / "out.cpio.gz", path)
    return path


def pvh_kernel(image: Path, version: str) -> Path:
    """The vmlinux inside `image` (a bzImage), which QEMU boots through its PVH note, no firmware
    or decompression; falls back to the bzImage itself where it cannot be unpacked."""
    out = CACHE / f"vmlinux-{version}"
    if out.exists():
        return out
    data = image.read_bytes()
    import gzip
    import lzma
    import zlib

    for magic, unpack in ((b"\xfd7zXZ\x00", lambda d: lzma.LZMADecompressor().decompress(d)),
                          (b"\x1f\x8b\x08", lambda d: zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(d))):
        at = data.find(magic)
        while at != -1:
            try:
                elf = unpack(data[at:])
            except (lzma.LZMAError, zlib.error, EOFError, gzip.BadGzipFile):
                elf = b""
            if elf[:4] == b"\x7fELF":
                CACHE.mkdir(parents=True, exist_ok=True)
                tmp = out.with_suffix(".tmp")
                tmp.write_bytes(elf)
                os.replace(tmp, out)
                return out
            at = data.find(magic, at + 1)
    return image


def run_script(pytest_args: list[str], rundir: Path) -> Path:
    """The script the guest runs after switch_root (its path is the same on both sides)."""
    script = rundir / "run.sh"
    args = " ".join(_quote(a) for a in pytest_args)
    script.write_text(f""". {_quote(str(HERE / 'guest_rdma.sh'))}
cd {_quote(str(REPO))}
export KVTIER_GUEST=1 PYTHONDONTWRITEBYTECODE=1
guest_say "running: pytest {args}"
{_quote(str(REPO / '.venv/bin/python'))} -m pytest -p no:cacheprovider --color=no {args}
guest_end $?
""")
    return script


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def boot(qemu: str, kernel: Path, initrd: Path, script: Path, timeout_s: float) -> tuple[int, list[str]]:
    """Boots the guest, streams its console, returns (status, console lines). Kills it on every path."""
    smp = min(2, os.cpu_count() or 1)
    cmd = [qemu, "-machine", "q35", "-accel", "tcg,thread=multi", "-cpu", "max", "-m", "2048", "-smp", str(smp),
           "-nic", "none", "-display", "none", "-vga", "none", "-monitor", "none", "-serial", "stdio", "-no-reboot",
           "-kernel", str(kernel), "-initrd", str(initrd),
           "-append", f"console=ttyS0 panic=-1 quiet loglevel=3 rdinit=/init kvtier_run={script}",
           "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap"]
    lines: list[str] = []
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)

    def pump() -> None:
        for raw in proc.stdout:
            line = ANSI.sub("", raw.decode(errors="replace")).rstrip("\r\n")
            lines.append(line)
            print("guest| " + line, flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    status = None
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        print(f"rdma guest: no result after {timeout_s:.0f} s: stopping it", flush=True)
        status = 124
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(5)
    if status is None:
        found = [RC_LINE.search(line) for line in lines]
        codes = [int(m.group(1)) for m in found if m]
        status = codes[-1] if codes else 125
    return status, lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--install", action="store_true", help="apt-get install what the guest needs if missing")
    parser.add_argument("--skip-unavailable", action="store_true",
                        help="exit 0 with a SKIPPED line where the guest cannot run here")
    parser.add_argument("--timeout", type=float, default=900, help="seconds from boot to result (default 900)")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest arguments (default: the rdma test files)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        try:
            qemu, image, version = check()
        except Unavailable:
            if not args.install:
                raise
            install()
            qemu, image, version = check()
        kernel = pvh_kernel(image, version)
        initrd = initramfs(version)
    except Unavailable as e:
        print(f"SKIPPED rdma guest: {e}" if args.skip_unavailable else f"rdma guest: cannot run here: {e}",
              flush=True)
        return 0 if args.skip_unavailable else 2
    pytest_args = args.pytest_args or ["-q", "-rs", "-m", "rdma", *rdma_test_files()]
    print(f"rdma guest: booting {kernel.name} ({version}) under QEMU TCG; tests: {' '.join(pytest_args)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvtier-guest-", dir="/var/tmp") as tmp:
        script = run_script(pytest_args, Path(tmp))
        status, lines = boot(qemu, kernel, initrd, script, args.timeout)
    summary = next((m.group(1) for m in map(SUMMARY.search, reversed(lines)) if m), "no pytest summary")
    print(f"rdma guest: {summary}; status {status}; boot to result {time.monotonic() - started:.0f} s", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
