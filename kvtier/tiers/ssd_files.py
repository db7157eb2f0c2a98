"""Opening the SSD tier's folder and files without being led elsewhere.

The persistent tier's files have fixed names (`kvtier-ssd-<i>.slab`, `kvtier-ssd.journal`) and
kvtier often runs as root in a container, so whoever can write into the folder could plant, under
those names, a symlink or hard link to another user's file, a FIFO, a device node, or a file of
their own that they can read back — and kvtier would resize it and write KV into it. So:

- **The folder** is opened once (`O_DIRECTORY`) and every file is opened relative to that
  descriptor, so the folder that was checked is the one used. Symlinks in the configured path
  itself are followed: it is the operator's choice (`/data -> /mnt/nvme0` is common) and whoever
  can change a component of it above the folder could as well point the config elsewhere. The
  resolved folder is refused when it is a device or kernel tree (`/dev`, `/proc`, `/sys` and
  what lies under them, `/dev/shm` excepted: it is ordinary shared memory) or sits on a
  pseudo filesystem wherever mounted (procfs, sysfs, devtmpfs, devpts, cgroup, ...).
- **Each file** is opened with `O_NOFOLLOW | O_CLOEXEC` and must be a regular file with one link,
  owned by this process's user; a file reopened later (the O_DIRECT descriptor) must be the same
  inode as the one checked.

Every refusal is a TierIOError naming the path and what is wrong with it.
"""

from __future__ import annotations

import errno
import os
import stat

from kvtier.errors import TierIOError

# Filesystems that hold kernel objects, not data (the `fstype` field of /proc/self/mountinfo).
PSEUDO_FILESYSTEMS = frozenset({
    "autofs", "binfmt_misc", "bpf", "cgroup", "cgroup2", "configfs", "debugfs", "devpts", "devtmpfs",
    "efivarfs", "fusectl", "hugetlbfs", "mqueue", "nsfs", "proc", "pstore", "rpc_pipefs", "securityfs",
    "selinuxfs", "sysfs", "tracefs",
})
KERNEL_TREES = ("/dev", "/proc", "/sys")
SHARED_MEMORY = "/dev/shm"
MOUNTINFO = "/proc/self/mountinfo"


def open_directory(directory: str) -> int:
    """Opens the SSD tier's folder, following symlinks in the given path, and checks it.

    Args:
        directory: the configured folder.
    Returns:
        A descriptor of the folder (O_DIRECTORY, O_CLOEXEC) to open its files against; the caller closes it.
    Raises:
        TierIOError: the folder is missing (ENOENT), not a directory (ENOTDIR), cannot be opened,
            or is a device or kernel folder (EINVAL), naming it.
    """
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ENOTDIR:
            raise TierIOError(errno.ENOTDIR, "SSD tier: not a directory", directory) from e
        raise TierIOError(e.errno, f"SSD tier: cannot use the directory ({e.strerror})", directory) from e
    try:
        why = special_folder(fd)
    except BaseException:
        os.close(fd)
        raise
    if why:
        os.close(fd)
        raise TierIOError(errno.EINVAL, f"SSD tier: refusing a device or kernel folder ({why}); "
                                        "give a directory on a disk", directory)
    return fd


def special_folder(dir_fd: int) -> str:
    """Why the folder open at `dir_fd` is no place for slab files, or "" when it is fine.

    Args:
        dir_fd: a descriptor of the folder (symlinks already resolved by opening it).
    Returns:
        e.g. "it resolves to /dev", "it is on a devtmpfs filesystem", or "".
    """
    real = _resolved(dir_fd)
    shm = real == SHARED_MEMORY or real.startswith(SHARED_MEMORY + "/")
    for tree in KERNEL_TREES:
        if not shm and (real == tree or real.startswith(tree + "/")):
            return f"it resolves to {real}, under {tree}"
    fstype = _filesystem_type(os.fstat(dir_fd).st_dev)
    if fstype in PSEUDO_FILESYSTEMS:
        return f"it resolves to {real}, on a {fstype} filesystem"
    return ""


def open_file(dir_fd: int, path: str, flags: int, mode: int = 0o600) -> int:
    """Opens file `path` (whose folder is open at `dir_fd`) without following a link, and checks it.

    Args:
        dir_fd: the folder's descriptor (from `open_directory`).
        path: the file's full path: its base name is opened relative to `dir_fd`, the whole is
            named in errors.
        flags: os.open flags; O_NOFOLLOW and O_CLOEXEC are added.
        mode: permissions of a file O_CREAT makes.
    Returns:
        The open descriptor of a regular file with one link, owned by this process's user.
    Raises:
        TierIOError: the name is a symbolic link (ELOOP), not a regular file, a hard link, another
            user's file, or cannot be opened, naming the path.
    """
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a planted FIFO must not block the open
    try:
        fd = os.open(os.path.basename(path), flags, mode, dir_fd=dir_fd)
    except OSError as e:
        raise TierIOError(e.errno, f"SSD tier: cannot open a file ({_open_failure(e, dir_fd, path)})", path) from e
    try:
        check_file(os.fstat(fd), path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_file(st: os.stat_result, path: str) -> None:
    """Raises TierIOError naming `path` unless `st` is a regular file with one link owned by this user."""
    if not stat.S_ISREG(st.st_mode):
        raise TierIOError(errno.EINVAL, f"SSD tier: refusing a file that is not a regular file "
                                        f"({_file_kind(st.st_mode)}); remove it or use another directory", path)
    if st.st_nlink != 1:
        raise TierIOError(errno.EMLINK, f"SSD tier: refusing a hard link ({st.st_nlink} names share this file); "
                                        "remove it or use another directory", path)
    if st.st_uid != os.geteuid():
        raise TierIOError(errno.EPERM, f"SSD tier: refusing a file owned by uid {st.st_uid}, not by this "
                                       f"process's uid {os.geteuid()}; remove it or use another directory", path)


def check_reopened(fd: int, path: str, expected: os.stat_result | None) -> None:
    """Raises TierIOError naming `path` unless `fd` is the file `expected` describes (None: no check).

    A file reopened by name (for O_DIRECT) must be the inode that was created and checked, not one
    renamed into its place since.
    """
    if expected is None:
        return
    st = os.fstat(fd)
    check_file(st, path)
    if (st.st_dev, st.st_ino) != (expected.st_dev, expected.st_ino):
        raise TierIOError(errno.ESTALE, "SSD tier: the file was replaced after it was created; refusing it", path)


def remove_files(paths: list[str], dir_fd: int) -> None:
    """Unlinks the tier's files from its folder (by base name against `dir_fd` when it is open, >= 0)."""
    for path in paths:
        try:
            if dir_fd >= 0:
                os.unlink(os.path.basename(path), dir_fd=dir_fd)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass


def _open_failure(e: OSError, dir_fd: int, path: str) -> str:
    """What an os.open of `path` failing with `e` means: a link refused by O_NOFOLLOW says so."""
    if e.errno in (errno.ELOOP, errno.EMLINK):
        try:
            if stat.S_ISLNK(os.lstat(os.path.basename(path), dir_fd=dir_fd).st_mode):
                return "it is a symbolic link, which the SSD tier never follows; remove it or use another directory"
        except OSError:
            pass
    if e.errno == errno.EISDIR:
        return "it is not a regular file but a directory; remove it or use another directory"
    return str(e.strerror)


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))
    return next((name for test, name in kinds if test(mode)), f"mode {oct(mode)}")


def _resolved(dir_fd: int) -> str:
    """The real path of the folder open at `dir_fd` (Linux: /proc/self/fd; else unknown, "")."""
    try:
        return os.readlink(f"/proc/self/fd/{dir_fd}")
    except OSError:
        return ""


def _filesystem_type(st_dev: int) -> str:
    """The fstype of the mount whose device number is `st_dev`, from /proc/self/mountinfo ("" if unknown)."""
    want = f"{os.major(st_dev)}:{os.minor(st_dev)}"
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and fields[2] == want and " - " in line:
                    return line.split(" - ", 1)[1].split()[0]
    except OSError:
        pass
    return ""
