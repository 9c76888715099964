"""core.storage's backend for a local or shared POSIX filesystem (core/files.py has the interface).

Everything read is opened without following a symbolic link and without blocking (a FIFO would
block an open for good), and only a regular file whose real path lies inside the run's root is
read: a co-tenant's link to elsewhere, a named pipe or a device planted in the run is refused with
a NotARegularFile naming it (`follow_links=True` lifts the first and last rule for paths a user
names, such as a Hugging Face cache's links to its blobs). Everything written, renamed, made or
removed is done by name inside a folder descriptor (`openat`, `renameat`, `linkat`, `unlinkat`,
`mkdirat`) reached from the root one name at a time with O_NOFOLLOW (`open_folder`): a write by
path checks nothing a co-tenant cannot change between the check and the write (a link swapped in
for `final/` at that moment would receive the file), whereas a link on the way is refused here,
and one swapped in after the walk changes nothing, since the descriptor is the folder that was
reached. The root itself is the user's own path, links and all.
"""
from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import shutil
import stat
from collections.abc import Iterator
from typing import IO

from core.errors import NotARegularFile
from core.files import temp_name

PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600  # modes of what islands creates on a local/shared POSIX filesystem
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_KINDS = {stat.S_IFIFO: "a named pipe (FIFO)", stat.S_IFDIR: "a folder", stat.S_IFCHR: "a device",
          stat.S_IFBLK: "a device", stat.S_IFSOCK: "a socket"}


class LocalFiles:
    atomic_put, exclusive = False, True

    def __init__(self, root: str, follow_links: bool = False) -> None:
        self.root, self.follow_links = root, follow_links
        self._real_root: str | None = None

    def open_folder(self, path: str, create: bool) -> int:
        """A descriptor of the folder `path` inside the run (`open_folder` below, from this root, links as set)."""
        return open_folder(self.root, path, create=create, follow_links=self.follow_links)

    @contextlib.contextmanager
    def folder(self, path: str, create: bool = False) -> Iterator[int]:
        fd = self.open_folder(path, create)
        try:
            yield fd
        finally:
            os.close(fd)

    def makedirs(self, path: str) -> None:
        """Each new folder private to the user (0700): a run directory holds what workers execute
        from (config, checkpoints), so nobody else may write into it."""
        with self.folder(path, create=True):
            pass

    def open_read(self, path: str) -> IO[bytes]:
        return os.fdopen(self.open_fd(path), "rb")

    def open_fd(self, path: str) -> int:
        """A read-only descriptor of the file at `path`, opened without blocking and (unless
        `follow_links`) without following a link; NotARegularFile unless it is a regular file whose
        real path is inside the root. FileNotFoundError when absent."""
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if self.follow_links else os.O_NOFOLLOW)
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise NotARegularFile(f"{path} is a symbolic link: islands reads only regular files inside the run "
                                      "directory; delete the link") from None
            raise
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
                raise NotARegularFile(f"{path} is {kind}, not a regular file: islands reads only regular files; delete it")
            if not self.follow_links:
                self._check_inside(fd, path)
            os.set_blocking(fd, True)  # a regular file: reads wait for the disk as usual
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _check_inside(self, fd: int, path: str) -> None:
        """The opened file's real path (a linked folder on the way resolves elsewhere) is in the root."""
        if self._real_root is None:
            self._real_root = os.path.realpath(self.root)
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # no /proc: resolve the name instead (a race away from exact)
            real = os.path.realpath(path)
        if not real.startswith(self._real_root.rstrip("/") + "/"):
            raise NotARegularFile(f"{path} resolves to {real}, outside the run directory {self._real_root} (a linked "
                                  "folder on the way): islands reads only files inside the run; remove the link")

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """A whole temporary file hard-linked to the name (link fails if the name exists, and readers
        never see a half-written file): atomic on local and NFS filesystems."""
        name = posixpath.basename(path)
        tmp = temp_name(name)
        with self.folder(posixpath.dirname(path), create=True) as d:
            try:
                with open(os.open(tmp, _NEW_FILE, PRIVATE_FILE, dir_fd=d), "wb") as f:
                    f.write(data)
                try:
                    os.link(tmp, name, src_dir_fd=d, dst_dir_fd=d, follow_symlinks=False)
                    return True
                except FileExistsError:
                    return False
                except OSError as exc:  # a filesystem without hard links: O_EXCL (atomic, not whole-at-once)
                    if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                        raise
                try:
                    fd = os.open(name, _NEW_FILE, PRIVATE_FILE, dir_fd=d)
                except FileExistsError:
                    return False
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                return True
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=d)

    def identity(self, path: str) -> tuple | None:
        """Its inode, size and mtime (the link itself if it is one)."""
        try:
            return identity_of(os.lstat(path))
        except (FileNotFoundError, NotADirectoryError):
            return None

    def unlink(self, path: str, recursive: bool = False) -> None:
        """Remove the file (or with `recursive` the folder) at `path`, a link itself, not its target."""
        with self.folder(posixpath.dirname(path)) as d:
            name = posixpath.basename(path)
            if recursive and stat.S_ISDIR(os.stat(name, dir_fd=d, follow_symlinks=False).st_mode):
                shutil.rmtree(name, dir_fd=d)  # by descriptors, never through a link (Linux)
            else:
                os.unlink(name, dir_fd=d)

    def move(self, src: str, dst: str) -> None:
        with self.folder(posixpath.dirname(src)) as sd, self.folder(posixpath.dirname(dst), create=True) as dd:
            os.replace(posixpath.basename(src), posixpath.basename(dst), src_dir_fd=sd, dst_dir_fd=dd)

    def move_if(self, src: str, dst: str, seen: tuple | None) -> bool:
        """The file is renamed first and checked after, and a wrong one is linked back under its
        name (never over a newer one): no window between the check and the move."""
        sname, dname = posixpath.basename(src), posixpath.basename(dst)
        with contextlib.ExitStack() as stack:
            try:
                sd = stack.enter_context(self.folder(posixpath.dirname(src)))
            except FileNotFoundError:
                return seen is None
            dd = stack.enter_context(self.folder(posixpath.dirname(dst), create=True))
            try:
                os.rename(sname, dname, src_dir_fd=sd, dst_dir_fd=dd)
            except FileNotFoundError:
                return seen is None
            if identity_of(os.stat(dname, dir_fd=dd, follow_symlinks=False)) == seen:
                return True
            try:
                os.link(dname, sname, src_dir_fd=dd, dst_dir_fd=sd, follow_symlinks=False)
            except FileExistsError:
                pass  # an even newer file is there: it stays
            except OSError:  # no hard links here: renamed back (over a newer one only if it landed just now)
                os.rename(dname, sname, src_dir_fd=dd, dst_dir_fd=sd)
                return False
            os.unlink(dname, dir_fd=dd)
            return False

    def writer(self, path: str) -> _LocalTemp:
        return _LocalTemp(self, path)


class _LocalTemp:
    """A hidden temporary name beside the key, created and renamed inside the folder reached."""

    def __init__(self, files: LocalFiles, path: str) -> None:
        self.name = posixpath.basename(path)
        self.tmp = temp_name(self.name)
        self.dir: int | None = files.open_folder(posixpath.dirname(path), create=True)
        try:
            self.file = os.fdopen(os.open(self.tmp, _NEW_FILE, PRIVATE_FILE, dir_fd=self.dir), "wb")
        except BaseException:
            self._close_dir()
            raise
        self.fd: int | None = self.file.fileno()

    def close(self) -> None:
        self.file.close()

    def commit(self) -> None:
        os.rename(self.tmp, self.name, src_dir_fd=self.dir, dst_dir_fd=self.dir)
        self._close_dir()

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self.file.close()
        with contextlib.suppress(Exception):
            if self.dir is not None:
                os.unlink(self.tmp, dir_fd=self.dir)
        self._close_dir()

    def _close_dir(self) -> None:
        if self.dir is not None:
            os.close(self.dir)
            self.dir = None


def identity_of(st: os.stat_result) -> tuple:
    return st.st_ino, st.st_size, st.st_mtime_ns


# -- folders reached without following a link ---------------------------------------------
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
