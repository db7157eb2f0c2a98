"""The SSD tier's folder as an attack surface: planted links and special files, and device folders.

Attacks: someone who can write into the SSD folder plants, under the persistent tier's fixed
names (`kvtier-ssd-<i>.slab`, `kvtier-ssd.journal`), a symlink to a user's file, a hard link to
it, a FIFO, a device node or a file of their own; or the tier is pointed at `/dev`, `/proc` or
`/sys`. Before the fix, kvtier (often root in a container) followed the symlink and resized the
user's 7-byte file to a slab, and later stores would have written KV into it; `/dev` was
accepted. Now each is refused with a TierIOError naming the file or folder and what is wrong, and
the planted target is untouched. Every planted target lives in tmp_path. Cost: about a second.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import replace
from pathlib import Path

import pytest

from kvtier.errors import TierIOError
from kvtier.tiers.ssd import SSDTier
from kvtier.tiers.ssd_journal import JOURNAL_NAME, SlotJournal

SLOT_BYTES = 64 * 1024
VICTIM_BYTES = b"secret\n"  # a user's 7-byte file
SLAB_0 = "kvtier-ssd-0.slab"
is_root = os.geteuid() == 0


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    where = tmp_path / "ssd"
    where.mkdir()
    return where


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_bytes(VICTIM_BYTES)
    return path


def _persistent(folder: Path) -> SSDTier:
    return SSDTier(folder, 4 * SLOT_BYTES, SLOT_BYTES, num_files=2, persist=True)


def _refused(folder: Path, name: str, why: str) -> TierIOError:
    """Opens a persistent tier in `folder`, expecting a refusal naming `name` and `why`."""
    with pytest.raises(TierIOError) as info:
        tier = _persistent(folder)
        tier.close()  # the old code opened it: release what it made before failing the test
    assert str(folder / name) in str(info.value) and why in str(info.value)
    return info.value


def _unchanged(victim: Path) -> None:
    assert victim.read_bytes() == VICTIM_BYTES
    assert victim.stat().st_size == len(VICTIM_BYTES)


def test_a_symlink_planted_as_a_slab_is_refused_and_its_target_untouched(folder: Path, victim: Path) -> None:
    (folder / SLAB_0).symlink_to(victim)
    assert _refused(folder, SLAB_0, "symbolic link").errno == errno.ELOOP
    _unchanged(victim)
    assert (folder / SLAB_0).is_symlink()  # not removed either: it is not the tier's file


def test_a_dangling_symlink_planted_as_a_slab_creates_nothing(folder: Path, tmp_path: Path) -> None:
    target = tmp_path / "would-be-created"
    (folder / SLAB_0).symlink_to(target)
    _refused(folder, SLAB_0, "symbolic link")
    assert not target.exists()


def test_a_temporary_tier_opens_its_files_without_following_links(folder: Path, victim: Path) -> None:
    # Unique names with O_EXCL already refuse a link; the files are still opened O_NOFOLLOW/O_CLOEXEC.
    tier = SSDTier(folder, 4 * SLOT_BYTES, SLOT_BYTES, num_files=2)
    try:
        for path in tier.paths:
            assert stat.S_ISREG(os.lstat(path).st_mode)
        fd_flags = [os.get_inheritable(fd) for fd in tier._fds]
        assert fd_flags == [False] * len(fd_flags)
    finally:
        tier.close()
    _unchanged(victim)


def test_a_hard_link_planted_as_a_slab_is_refused(folder: Path, victim: Path) -> None:
    os.link(victim, folder / SLAB_0)
    _refused(folder, SLAB_0, "hard link")
    _unchanged(victim)


def test_a_fifo_planted_as_a_slab_is_refused(folder: Path) -> None:
    os.mkfifo(folder / SLAB_0)
    _refused(folder, SLAB_0, "not a regular file")


def test_a_folder_planted_as_a_slab_is_refused(folder: Path) -> None:
    (folder / SLAB_0).mkdir()
    _refused(folder, SLAB_0, "not a regular file")


@pytest.mark.skipif(not is_root, reason="making a device node needs root")
def test_a_device_node_planted_as_a_slab_is_refused(folder: Path) -> None:
    os.mknod(folder / SLAB_0, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # a private /dev/null
    _refused(folder, SLAB_0, "not a regular file")


@pytest.mark.skipif(not is_root, reason="giving a file to another user needs root")
def test_a_slab_owned_by_another_user_is_refused(folder: Path) -> None:
    planted = folder / SLAB_0
    planted.write_bytes(b"")
    planted.chmod(0o666)
    os.chown(planted, 65534, 65534)  # nobody's file: KV written there would be theirs to read
    _refused(folder, SLAB_0, "owned by uid 65534")
    assert planted.stat().st_size == 0


def test_a_symlink_planted_as_the_journal_is_refused_and_its_target_untouched(folder: Path, victim: Path) -> None:
    (folder / JOURNAL_NAME).symlink_to(victim)
    with pytest.raises(TierIOError, match="symbolic link") as info:
        SlotJournal(str(folder), 4, SLOT_BYTES, 2, b"f" * 16).close()
    assert str(folder / JOURNAL_NAME) in str(info.value)
    _unchanged(victim)


def test_a_fifo_planted_as_the_journal_is_refused(folder: Path) -> None:
    os.mkfifo(folder / JOURNAL_NAME)
    with pytest.raises(TierIOError, match="not a regular file"):
        SlotJournal(str(folder), 4, SLOT_BYTES, 2, b"f" * 16).close()


def test_the_persistent_runtime_refuses_a_planted_journal_link(tmp_path: Path, victim: Path) -> None:
    from support.persistence import persistent

    (tmp_path / "ssd").mkdir()
    (tmp_path / "ssd" / JOURNAL_NAME).symlink_to(victim)
    with pytest.raises(TierIOError, match="symbolic link"):
        persistent(tmp_path).close()
    _unchanged(victim)


def test_a_persistent_tier_still_reopens_its_own_files(folder: Path) -> None:
    _persistent(folder).close()
    tier = _persistent(folder)  # its own regular files, owned by this user, one link each
    tier.close()


def _folder(path: str):
    """`path` as a parameter, skipped (with the reason) on a machine that lacks it."""
    return pytest.param(path, marks=pytest.mark.skipif(not os.path.isdir(path), reason=f"{path} does not exist here"))


@pytest.mark.parametrize("special", [_folder(p) for p in ("/dev", "/proc", "/sys", "/dev/pts", "/sys/fs/cgroup")])
def test_a_device_or_kernel_folder_is_refused(special: str) -> None:
    before = set(os.listdir(special))
    with pytest.raises(TierIOError, match=f"'{special}'") as info:
        SSDTier(special, SLOT_BYTES, SLOT_BYTES).close()  # one 64 KiB slot if the old code opens it
    assert "device or kernel" in str(info.value)
    assert set(os.listdir(special)) <= before


def test_a_symlink_to_a_device_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "dev-link").symlink_to("/dev")
    with pytest.raises(TierIOError, match="device or kernel"):
        SSDTier(tmp_path / "dev-link", SLOT_BYTES, SLOT_BYTES).close()


def test_a_folder_given_through_a_symlink_is_the_users_choice(tmp_path: Path) -> None:
    # Symlinks in the configured path itself are followed (e.g. /data -> /mnt/nvme0); only the
    # files *in* the folder must not be links.
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    tier = SSDTier(tmp_path / "link", 4 * SLOT_BYTES, SLOT_BYTES, num_files=2, persist=True)
    tier.close()
    assert sorted(p.name for p in real.iterdir()) == ["kvtier-ssd-0.slab", "kvtier-ssd-1.slab"]


def test_a_device_as_the_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TierIOError, match="/dev/null") as info:
        SSDTier("/dev/null", SLOT_BYTES, SLOT_BYTES).close()
    assert info.value.errno == errno.ENOTDIR


def test_a_configured_folder_under_dev_is_refused_before_anything_is_made_there(tmp_path: Path) -> None:
    from support.runtime import LAYOUT, config

    from kvtier.runtime import KVTier

    name = f"kvtier-attack-test-{os.getpid()}"
    (tmp_path / "dev-link").symlink_to("/dev")
    cfg = config(tmp_path)
    tiers = tuple(replace(t, path=tmp_path / "dev-link" / name) if t.path else t for t in cfg.tiers)
    try:
        with pytest.raises(TierIOError, match="tiers.ssd.path .*device or kernel folder"):
            KVTier(replace(cfg, tiers=tiers), layout=LAYOUT).close()
        assert not os.path.lexists(f"/dev/{name}")
    finally:  # the old code made the folder (and, until closed, slabs) in /dev: leave /dev as found
        for leftover in Path(f"/dev/{name}").glob("*") if os.path.isdir(f"/dev/{name}") else ():
            leftover.unlink()
        if os.path.isdir(f"/dev/{name}"):
            os.rmdir(f"/dev/{name}")
