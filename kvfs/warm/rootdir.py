"""The warm root directory, opened once and checked, and file calls relative to it.

The root holds every session's KV bytes, on a RAM filesystem whose parent (``/dev/shm``)
anyone may write to and which is emptied at boot. Its default is per user
(``DEFAULT_ROOT``, ``/dev/shm/kvfs-warm-<uid>``; ``{uid}`` in any root path stands for the
effective uid), so one user creating it first never locks the others out. The root is
created by one ``mkdir`` with mode 0700 (never a wider mode changed afterwards), must be a
real directory (not a symlink) owned by this process's uid without group/other write
bits, and everything inside is reached relative to its checked descriptor
(``dir_fd``, ``O_NOFOLLOW``): a name planted as a symlink, or a file owned by someone
else, is refused and never followed. Files are created 0600 with ``O_EXCL``. Every
failure is a WarmError naming the path and the reason.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import tempfile

from kvfs.ops.profiles import user_path

from .ids import WarmError

log = logging.getLogger("kvfs.warm")
_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC
DEFAULT_ROOT = "/dev/shm/kvfs-warm-{uid}"


def _reason(e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return "is a symbolic link (refused)"
    return e.strerror or str(e)


def _owner_error(path: str, st: os.stat_result, uid: int, what: str) -> WarmError | None:
    if st.st_uid != uid:
        return WarmError(f"{what} {path!r} is owned by uid {st.st_uid}, not by this process "
                         f"(uid {uid}): refused")
    if st.st_mode & 0o022:
        return WarmError(f"{what} {path!r} is writable by group/other "
                         f"(mode {stat.S_IMODE(st.st_mode):04o}): refused")
    return None


class RootDir:
    """A checked warm root. ``open``/``create`` return descriptors of checked files;
    ``sub`` gives a checked directory inside it (the same rules)."""

    def __init__(self, path: str, fd: int | None = None) -> None:
        self.uid = os.geteuid()
        self.path = os.path.abspath(user_path(path, self.uid))
        if fd is not None:  # made by ``sub``: already checked
            self.fd = fd
            return
        parent = os.path.dirname(self.path)
        try:
            os.makedirs(parent, exist_ok=True)
            os.mkdir(self.path, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise WarmError(f"warm root {self.path!r}: cannot create it: {_reason(e)}") from e
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | _OPEN)
        except OSError as e:
            reason = _reason(e)
            try:  # say whose it is when we may not enter it
                st = os.lstat(self.path)
                if stat.S_ISLNK(st.st_mode):
                    reason = "is a symbolic link"
                elif not stat.S_ISDIR(st.st_mode):
                    reason = "is not a directory"
                elif st.st_uid != self.uid:
                    reason = f"is owned by uid {st.st_uid}, not by this process (uid {self.uid})"
            except OSError:
                pass
            raise WarmError(f"warm root {self.path!r} {reason}: refused") from e
        st = os.fstat(fd)
        err = _owner_error(self.path, st, self.uid, "warm root")
        if err is not None:
            os.close(fd)
            raise err
        if st.st_mode & 0o077:  # made by an older version: readable by others
            os.fchmod(fd, 0o700)
            log.warning("warm root %s was mode %04o; made private (0700)", self.path,
                        stat.S_IMODE(st.st_mode))
        self.fd = fd

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _checked(self, fd: int, name: str) -> int:
        """Keep ``fd`` if it is a regular file of ours; make it private if it was not."""
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise WarmError(f"warm file {self.join(name)!r} is not a regular file: refused")
            err = _owner_error(self.join(name), st, self.uid, "warm file")
            if err is not None:
                raise err
            if st.st_mode & 0o077:
                os.fchmod(fd, 0o600)
            return fd
        except BaseException:
            os.close(fd)
            raise

    def open(self, name: str, flags: int = os.O_RDWR) -> int:
        """Open an existing file of the root (never through a symlink)."""
        try:
            fd = os.open(name, flags | _OPEN, dir_fd=self.fd)
        except OSError as e:
            raise WarmError(f"warm file {self.join(name)!r}: {_reason(e)}") from e
        return self._checked(fd, name)

    def create(self, name: str, flags: int = os.O_RDWR) -> int:
        """Create a new file, 0600; an existing name (or a planted symlink) is an error."""
        try:
            fd = os.open(name, flags | os.O_CREAT | os.O_EXCL | _OPEN, 0o600, dir_fd=self.fd)
        except OSError as e:
            raise WarmError(f"warm file {self.join(name)!r}: cannot create: {_reason(e)}") from e
        return self._checked(fd, name)

    def open_or_create(self, name: str, flags: int = os.O_RDWR) -> int:
        try:
            fd = os.open(name, flags | os.O_CREAT | _OPEN, 0o600, dir_fd=self.fd)
        except OSError as e:
            raise WarmError(f"warm file {self.join(name)!r}: {_reason(e)}") from e
        return self._checked(fd, name)

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def listdir(self) -> list[str]:
        try:
            return os.listdir(self.fd)
        except OSError as e:
            raise WarmError(f"warm root {self.path!r}: {_reason(e)}") from e

    def unlink(self, name: str) -> None:
        """Remove a name (a symlink itself, never its target); gone already is fine."""
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise WarmError(f"warm file {self.join(name)!r}: cannot remove: {_reason(e)}") from e

    def rename(self, src: str, dst: str) -> None:
        try:
            os.rename(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except OSError as e:
            raise WarmError(f"warm file {self.join(src)!r}: cannot rename: {_reason(e)}") from e

    def sub(self, name: str, create: bool = True) -> RootDir:
        """The directory ``name`` inside this one (made 0700 with ``create``), checked like
        the root: ours, not writable by others, not a symlink."""
        where = self.join(name)
        if create:
            try:
                os.mkdir(name, 0o700, dir_fd=self.fd)
            except FileExistsError:
                pass
            except OSError as e:
                raise WarmError(f"warm directory {where!r}: cannot create it: {_reason(e)}") from e
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _OPEN, dir_fd=self.fd)
        except OSError as e:
            reason = _reason(e)
            try:
                if stat.S_ISLNK(self.lstat(name).st_mode):
                    reason = "is a symbolic link (refused)"
            except OSError:
                pass
            raise WarmError(f"warm directory {where!r}: {reason}") from e
        err = _owner_error(where, os.fstat(fd), self.uid, "warm directory")
        if err is not None:
            os.close(fd)
            raise err
        return RootDir(where, fd)

    def move(self, name: str, dst: RootDir, new: str) -> None:
        """Rename ``name`` into directory ``dst`` as ``new`` (refused if ``new`` exists)."""
        try:
            os.stat(new, dir_fd=dst.fd, follow_symlinks=False)
            raise WarmError(f"warm file {dst.join(new)!r} exists")
        except FileNotFoundError:
            pass
        try:
            os.rename(name, new, src_dir_fd=self.fd, dst_dir_fd=dst.fd)
        except OSError as e:
            raise WarmError(f"warm file {self.join(name)!r}: cannot move: {_reason(e)}") from e

    def rmdir(self, name: str) -> None:
        try:
            os.rmdir(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise WarmError(f"warm directory {self.join(name)!r}: cannot remove: {_reason(e)}") from e

    def write_atomic(self, name: str, data: bytes) -> None:
        """Replace ``name`` with ``data`` (a temporary file renamed over it)."""
        tmp = f"{name}.tmp"
        self.unlink(tmp)
        fd = self.create(tmp, os.O_WRONLY)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError as e:
            os.close(fd)
            self.unlink(tmp)
            raise WarmError(f"warm file {self.join(tmp)!r}: {_reason(e)}") from e
        os.close(fd)
        self.rename(tmp, name)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


FALLBACK_TAG = ".private-"


def _shared_parent(parent: str) -> bool:
    """Whether any user may create names in ``parent`` (sticky, world-writable)."""
    try:
        st = os.stat(parent)
    except OSError:
        return False
    return bool(st.st_mode & stat.S_ISVTX and st.st_mode & 0o002)


def _fallbacks(parent: str, base: str) -> list[RootDir]:
    """Our checked fallback roots beside ``base``, oldest name order; names another user
    planted (or symlinks) fail ``RootDir``'s checks and are skipped."""
    try:
        names = sorted(n for n in os.listdir(parent) if n.startswith(base + FALLBACK_TAG))
    except OSError:
        return []
    out = []
    for n in names:
        try:
            out.append(RootDir(os.path.join(parent, n)))
        except WarmError:
            continue
    return out


def open_root(path: str) -> RootDir:
    """The checked warm root ``path`` (``{uid}`` expanded), or, when another user
    squatted that name in a shared directory, this uid's private fallback beside it."""
    try:
        return RootDir(path)
    except WarmError as e:
        full = os.path.abspath(user_path(path, os.geteuid()))
        parent, base = os.path.split(full)
        if not _shared_parent(parent):
            raise
        refusal = str(e)
    found = _fallbacks(parent, base)
    if not found:
        try:
            made = tempfile.mkdtemp(prefix=base + FALLBACK_TAG, dir=parent)  # 0700, new
        except OSError as err:
            raise WarmError(f"{refusal}; and no private fallback could be made in "
                            f"{parent!r}: {_reason(err)}") from err
        found = _fallbacks(parent, base)  # another process may have made one first
        for extra in found[1:]:
            if extra.path == made:
                extra.close()
                os.rmdir(made)  # empty: ours, never used
        found = found[:1]
    if not found:
        raise WarmError(f"{refusal}; and no private fallback is usable in {parent!r}")
    for extra in found[1:]:
        extra.close()
    log.error("%s; using the private warm root %s instead", refusal, found[0].path)
    return found[0]
