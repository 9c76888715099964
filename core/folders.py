"""Folders of a local run directory reached without following a link, for core.storage's writes.

A write by path checks nothing a co-tenant cannot change between the check and the write: a link
swapped in for `final/` at that moment receives the file. So every write, rename, link, folder
creation and removal of a local run is done by name inside a folder descriptor (`openat`,
`renameat`, `linkat`, `unlinkat`, `mkdirat`) that was reached from the run root one name at a time
with O_NOFOLLOW: a link on the way is refused, and one swapped in after the walk changes nothing,
since the descriptor is the folder that was reached. The root itself is the user's own path, links
and all.
"""
from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import stat

from core.errors import NotARegularFile

PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600  # modes of what islands creates on a local/shared POSIX filesystem
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def open_folder(root: str, path: str, *, create: bool = False, follow_links: bool = False) -> int:
    """A descriptor of folder `path` (at or below `root`), reached from `root` one name at a time
    without following a link (unless `follow_links`: paths a user names). `create`: missing folders,
    the root's too, are made private (0700). NotARegularFile for a link on the way or a path that
    leaves the root; FileNotFoundError for a missing folder when not `create`."""
    rel = posixpath.relpath(path, root)
    names = [] if rel == "." else rel.split("/")
    if ".." in names:
        raise NotARegularFile(f"{path} is not inside the run directory {root}: islands writes only inside the run")
    if create:
        make_private_dirs(root)
    fd = os.open(root, _DIR)
    try:
        for i, name in enumerate(names):
            sub = _open_sub(fd, name, _DIR | (0 if follow_links else os.O_NOFOLLOW), create)
            if sub is None:
                where = posixpath.join(root, *names[:i + 1])
                raise NotARegularFile(f"{path}: {where} is a symbolic link, and islands writes inside the run directory "
                                      f"{root} through no link (it may lead outside the run directory): remove the link")
            os.close(fd)
            fd = sub
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_sub(fd: int, name: str, flags: int, create: bool) -> int | None:
    """The folder `name` in folder `fd`, made first if `create` and missing; None if it is a link."""
    try:
        return os.open(name, flags, dir_fd=fd)
    except FileNotFoundError:
        if not create:
            raise
    except OSError as exc:
        # O_NOFOLLOW | O_DIRECTORY on a link: ELOOP or ENOTDIR, whatever is at the name a moment later
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and not _plain_non_folder(fd, name)):
            return None
        raise
    with contextlib.suppress(FileExistsError):  # another writer made it first
        os.mkdir(name, PRIVATE_DIR, dir_fd=fd)
    return _open_sub(fd, name, flags, create=False)


def _plain_non_folder(fd: int, name: str) -> bool:
    """`name` in folder `fd` is there and neither a folder nor a link (a file where a folder is due)."""
    try:
        mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
    except OSError:
        return False
    return not (stat.S_ISDIR(mode) or stat.S_ISLNK(mode))


def make_private_dirs(path: str) -> None:
    """Folder `path` and its missing parents, each new one private (0700)."""
    missing, p = [], path
    while p and not os.path.isdir(p):
        missing.append(p)
        if posixpath.dirname(p) == p:
            break
        p = posixpath.dirname(p)
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another writer created it first
            os.mkdir(d, PRIVATE_DIR)
