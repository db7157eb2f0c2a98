"""The guest runner of `make test-rdma` (rdma_guest.py), on this host: what it builds and what it
says where it cannot run. The guest itself boots in `make test` (after pytest), not here.
Cost: about 3 s (an initramfs, the kernel unpacked once into /var/tmp/kvtier-guest)."""

from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import rdma_guest  # noqa: E402

try:
    _, IMAGE, VERSION = rdma_guest.check()
    UNAVAILABLE = ""
except rdma_guest.Unavailable as e:  # e.g. before `make test` has installed QEMU and the kernel
    IMAGE, VERSION, UNAVAILABLE = None, None, str(e)
# Only the tests that build the guest's kernel and initramfs need them; the rest run everywhere.
needs_guest = pytest.mark.skipif(bool(UNAVAILABLE), reason=f"the guest cannot run here: {UNAVAILABLE}")


@needs_guest
def test_the_initramfs_holds_busybox_the_init_and_every_module_a_9p_root_needs_in_order() -> None:
    cpio = subprocess.run(["cpio", "-i", "--list", "--quiet"], input=gzip.decompress(
        rdma_guest.initramfs(VERSION).read_bytes()), capture_output=True, check=True).stdout.decode().split()
    assert {"init", "bin/busybox", "modules.list"} <= set(cpio)
    order = [p.name for p in rdma_guest.module_files(VERSION)]
    assert {"9p.ko", "9pnet_virtio.ko", "overlay.ko", "virtio_pci.ko"} <= set(order)
    assert order.index("9pnet.ko") < order.index("9pnet_virtio.ko") < order.index("9p.ko"), "dependencies first"
    assert {f"modules/{name}" for name in order} <= set(cpio)


@needs_guest
def test_the_kernel_booted_is_the_vmlinux_inside_the_image() -> None:
    kernel = rdma_guest.pvh_kernel(IMAGE, VERSION)
    assert kernel != IMAGE and kernel.read_bytes()[:4] == b"\x7fELF"


def test_the_guest_runs_every_file_that_uses_the_rdma_mark() -> None:
    files = rdma_guest.rdma_test_files()
    assert "tests/pool/test_pool_rdma_guest.py" in files and "tests/pool/test_pool_rdma.py" in files
    assert all("mark.rdma" in (rdma_guest.REPO / f).read_text() for f in files)


def test_where_qemu_is_missing_it_says_so_and_skips_only_when_asked(tmp_path) -> None:
    import shutil

    present = True
    for tool in ("cpio", "modprobe", "gzip"):  # everything the runner looks for but QEMU
        found = shutil.which(tool) or (f"/usr/sbin/{tool}" if Path(f"/usr/sbin/{tool}").exists() else None)
        present = present and found is not None
        if found:
            (tmp_path / tool).symlink_to(found)
    env = {"PATH": str(tmp_path), "HOME": str(tmp_path)}
    script = str(Path(rdma_guest.__file__))
    skip = subprocess.run([sys.executable, script, "--skip-unavailable"], capture_output=True, text=True, env=env)
    assert skip.returncode == 0 and skip.stdout.startswith("SKIPPED rdma guest: "), skip
    # With the host's cpio and modprobe linked in, QEMU is what is missing; without them, they are.
    assert ("qemu-system-x86_64 not found" if present else " not found (install ") in skip.stdout, skip.stdout
    fail = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env)
    assert fail.returncode == 2 and "cannot run here" in fail.stdout, fail
