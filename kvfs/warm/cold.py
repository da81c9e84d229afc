"""The cold tier as the warm tier sees it: plain files under ``cold_root/sessions/<sid>/``.

``cold_root`` is normally a mounted KVFS volume; tests use any directory with the same
layout. Only ordinary file calls are used (open, os.pread/preadv, os.write, os.fsync,
os.ftruncate, os.listdir, os.stat), never engine internals, and the mount's rules are
kept everywhere: layer files and summaries.f32 are only appended to (a write at an offset
other than the current size fails with EPERM on the mount) or cut shorter; meta.json is
replaced by truncate(0) + one write.

A shared mount (``--allow-other``) has a world-writable, sticky ``sessions/``: anyone may
make a session directory there, also under a name this process will use. So a session
directory is made with ``mkdir`` 0700 and checked, and every access goes through its
checked descriptor: a directory or file that is not ours (another uid) or that group or
other may write to, or a symlink, is refused with a WarmError -- never read as our KV,
never written into. Files are created 0600 and opened with ``O_NOFOLLOW``.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import re
import stat
from collections.abc import Iterable

import numpy as np

from .ids import WarmError

log = logging.getLogger("kvfs.warm")

_LAYER_RE = re.compile(r"layer_(0|[1-9][0-9]{0,9})")
#: side streams: append-only byte files of a session beside its layers (the hot tier's
#: ``key_bounds``), kept exactly like a layer (checksummed extents, write-behind,
#: migration, promotion) under stream numbers above every layer number
SIDE_BASE = 1 << 31
SIDE_STREAMS = {"key_bounds": SIDE_BASE}
_SIDE_NAMES = {n: name for name, n in SIDE_STREAMS.items()}


def side_stream(name: object) -> int:
    """The stream number of side stream ``name`` (ValueError for any other name)."""
    if not isinstance(name, str) or name not in SIDE_STREAMS:
        raise ValueError(f"side stream must be one of {', '.join(SIDE_STREAMS)}, got {name!r}")
    return SIDE_STREAMS[name]
SUMMARIES = "summaries.f32"
META = "meta.json"
# the session's incarnation id, 16 hex digits and a newline, written by the warm tier with
# the first bytes of a session: a copy removed (or made anew) through the mount has none
# (or another one), so a RAM copy of the old session is never written back over it
INCARNATION = ".incarnation"
_CHUNK = 8 << 20  # bytes per os.write: bounded kernel/FUSE requests, no big copies
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def _errors(fn):
    """OSErrors of a cold call become WarmErrors naming the cold path (errno kept as the
    cause): the tier's callers see one kind of error."""
    @functools.wraps(fn)
    def run(self: ColdStore, *args, **kw):
        try:
            return fn(self, *args, **kw)
        except OSError as e:
            where = self.dir
            if args and isinstance(args[0], str):
                where = self.path(args[0], args[1] if len(args) > 1 and isinstance(args[1], str) else None)
            raise WarmError(f"cold {where!r}: {e.strerror or e}") from e
    return run


def layer_name(layer: int) -> str:
    """The cold file of a stream: ``layer_<n>``, or a side stream's own name."""
    return _SIDE_NAMES.get(layer) or f"layer_{layer}"


def _fsync_fd(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as e:  # some FUSE filesystems do not implement fsyncdir
        if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise


class ColdStore:
    """File-level access to ``cold_root/sessions``. Stateless apart from the path."""

    def __init__(self, root: str) -> None:
        # A mounted volume always has sessions/; an empty mountpoint (volume not mounted)
        # does not, and writing into it would silently put "cold" data on the root disk.
        self.root = root
        self.dir = os.path.join(root, "sessions")
        self.uid = os.geteuid()
        if not os.path.isdir(self.dir):
            raise WarmError(f"cold tier {root!r} has no sessions/ directory: is the volume mounted?")

    def path(self, sid: str, name: str | None = None) -> str:
        d = os.path.join(self.dir, sid)
        return d if name is None else os.path.join(d, name)

    # ---- checked access -----------------------------------------------------------
    def _refuse(self, path: str, st: os.stat_result, want_dir: bool) -> None:
        kind = "directory" if want_dir else "file"
        if not (stat.S_ISDIR(st.st_mode) if want_dir else stat.S_ISREG(st.st_mode)):
            raise WarmError(f"cold {path!r} is not a {kind} (a symlink or other): refused")
        if st.st_uid != self.uid:
            raise WarmError(f"cold {kind} {path!r} is owned by uid {st.st_uid}, not by this "
                            f"process (uid {self.uid}): refused")
        if st.st_mode & 0o022:
            raise WarmError(f"cold {kind} {path!r} is writable by group/other "
                            f"(mode {stat.S_IMODE(st.st_mode):04o}): refused")

    def _sdir(self, sid: str, flags: int = os.O_PATH) -> int:
        """A checked descriptor of the session directory; FileNotFoundError if none."""
        d = self.path(sid)
        try:
            fd = os.open(d, flags | os.O_DIRECTORY | _NOFOLLOW)
        except NotADirectoryError:
            st = os.lstat(d)
            self._refuse(d, st, True)
            raise
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise WarmError(f"cold {d!r} is a symbolic link: refused") from e
            raise
        try:
            self._refuse(d, os.fstat(fd), True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open(self, sid: str, name: str, flags: int, create: bool = False) -> int:
        """A checked descriptor of a session's file (created 0600 with ``create``)."""
        return self._open_stat(sid, name, flags, create)[0]

    def _open_stat(self, sid: str, name: str, flags: int,
                   create: bool = False) -> tuple[int, os.stat_result]:
        """``_open`` and the descriptor's checked stat."""
        dfd = self._sdir(sid)
        try:
            fd = os.open(name, flags | _NOFOLLOW | (os.O_CREAT if create else 0), 0o600,
                         dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise WarmError(f"cold {self.path(sid, name)!r} is a symbolic link: refused") from e
            raise
        finally:
            os.close(dfd)
        try:
            st = os.fstat(fd)
            self._refuse(self.path(sid, name), st, False)
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    # ---- reads --------------------------------------------------------------------
    def reachable(self) -> None:
        """WarmError unless the volume is still there (an unmounted volume leaves an empty
        mountpoint: no sessions/)."""
        try:
            st = os.stat(self.dir)
        except OSError as e:
            raise WarmError(f"cold tier {self.root!r} cannot be reached ({e.strerror}): is "
                            f"the volume mounted?") from e
        if not stat.S_ISDIR(st.st_mode):
            raise WarmError(f"cold tier {self.root!r}: sessions is not a directory")

    def exists(self, sid: str) -> bool:
        """Whether the session's directory is on the mount; WarmError when the mount itself
        is gone (an unmounted volume is not a removed session)."""
        try:
            return stat.S_ISDIR(os.lstat(self.path(sid)).st_mode)
        except FileNotFoundError:
            self.reachable()
            return False

    @_errors
    def list(self) -> list[str]:
        try:
            return os.listdir(self.dir)
        except FileNotFoundError:
            return []

    @_errors
    def layer_sizes(self, sid: str) -> dict[int, int] | None:
        """{stream: size} of the cold copy (layers and side streams), None when there is
        no cold copy."""
        try:
            dfd = self._sdir(sid, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            out = {}
            for n in os.listdir(dfd):
                m = _LAYER_RE.fullmatch(n)
                num = int(m.group(1)) if m else SIDE_STREAMS.get(n)
                if num is not None:
                    st = os.stat(n, dir_fd=dfd, follow_symlinks=False)
                    self._refuse(self.path(sid, n), st, False)
                    out[num] = st.st_size
            return out
        finally:
            os.close(dfd)

    @_errors
    def state(self, sid: str) -> tuple[dict[int, int], int | None] | None:
        """(layer sizes, incarnation id or None) of the cold copy; None when there is none."""
        sizes = self.layer_sizes(sid)
        if sizes is None:
            self.reachable()  # an unmounted volume is an error, never "the session was removed"
            return None
        return sizes, self.read_incarnation(sid)

    def read_incarnation(self, sid: str) -> int | None:
        """The cold copy's incarnation id; None when it has none (or not one we can read)."""
        raw = self.read_small(sid, INCARNATION)
        try:
            return int(raw, 16) if raw and len(raw) == 17 and raw.endswith(b"\n") else None
        except ValueError:
            return None

    @_errors
    def size(self, sid: str, layer: int) -> int:
        try:
            dfd = self._sdir(sid)
        except (FileNotFoundError, NotADirectoryError):
            return 0
        try:
            st = os.stat(layer_name(layer), dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return 0
        finally:
            os.close(dfd)
        self._refuse(self.path(sid, layer_name(layer)), st, False)
        return st.st_size

    @_errors
    def read_into(self, sid: str, layer: int, off: int, out: np.ndarray,
                  missing_is_empty: bool = False) -> None:
        """Fill ``out`` (uint8, contiguous) from layer bytes at ``off``; ValueError when
        the file ends before, WarmError if it is missing (unless ``missing_is_empty``: then
        it holds 0 bytes) or a read comes back short."""
        try:
            fd, st = self._open_stat(sid, layer_name(layer), os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError) as e:
            if missing_is_empty:
                raise ValueError(f"read [{off}, {off + len(out)}) past the end (0) of "
                                 f"{sid}/{layer_name(layer)}") from e
            raise WarmError(f"cold {sid}/{layer_name(layer)} is missing") from e
        try:
            if off + len(out) > st.st_size:
                raise ValueError(f"read [{off}, {off + len(out)}) past the end ({st.st_size}) "
                                 f"of {sid}/{layer_name(layer)}")
            view = memoryview(out).cast("B")
            done = 0
            while done < len(view):
                n = os.preadv(fd, [view[done:]], off + done)
                if n <= 0:
                    raise WarmError(f"cold {sid}/{layer_name(layer)}: short read at {off + done}")
                done += n
        finally:
            os.close(fd)

    @_errors
    def read_small(self, sid: str, name: str) -> bytes | None:
        try:
            fd = self._open(sid, name, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            parts = []
            while chunk := os.read(fd, 1 << 20):
                parts.append(chunk)
            return b"".join(parts)
        finally:
            os.close(fd)

    def read_meta(self, sid: str) -> dict | None:
        raw = self.read_small(sid, META)
        if not raw:
            return None
        try:
            meta = json.loads(raw)
        except ValueError:
            log.warning("cold %s/meta.json is not JSON; ignored", sid)
            return None
        return meta if isinstance(meta, dict) else None

    # ---- writes -------------------------------------------------------------------
    @_errors
    def ensure_dir(self, sid: str) -> bool:
        """Make the session directory (0700) unless it exists; either way it must then be
        ours and private. True when made (then ``sync_sessions_dir``)."""
        try:
            os.mkdir(self.path(sid), 0o700)
            made = True
        except FileExistsError:
            made = False
        os.close(self._sdir(sid))
        return made

    @_errors
    def sync_sessions_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            _fsync_fd(fd)
        finally:
            os.close(fd)

    @_errors
    def sync_dir(self, sid: str) -> None:
        fd = self._sdir(sid, os.O_RDONLY)
        try:
            _fsync_fd(fd)
        finally:
            os.close(fd)

    @_errors
    def fsync_file(self, sid: str, name: str) -> None:
        """fsync a file written earlier through another descriptor (the data is the
        inode's, not the descriptor's; on the mount, close flushed it and fsync syncs)."""
        fd = self._open(sid, name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @_errors
    def append(self, sid: str, name: str, expect: int, pieces: Iterable[np.ndarray],
               sync: bool = True, keep: list[int] | None = None) -> int:
        """Append ``pieces`` to file ``name`` whose size must be ``expect`` (fsync unless
        ``sync`` is False: the caller then calls ``fsync_file``, or ``fsync_close`` on the
        descriptor left open in ``keep``). Writes go at the current end (the mount's
        append-only rule); returns the new size."""
        fd = self._open(sid, name, os.O_WRONLY, create=True)
        if keep is not None:
            keep.append(fd)
        try:
            pos = os.lseek(fd, 0, os.SEEK_END)
            if pos != expect:
                raise WarmError(f"cold {sid}/{name}: size {pos}, expected {expect}")
            for piece in pieces:
                view = memoryview(piece).cast("B")
                done = 0
                while done < len(view):
                    done += os.write(fd, view[done:done + _CHUNK])
                pos += len(view)
            if sync:
                os.fsync(fd)
            return pos
        finally:
            if keep is None:
                os.close(fd)

    def fsync_close(self, sid: str, name: str, fd: int) -> None:
        try:
            os.fsync(fd)
        except OSError as e:
            raise WarmError(f"cold {self.path(sid, name)!r}: {e.strerror or e}") from e
        finally:
            os.close(fd)

    @_errors
    def truncate(self, sid: str, name: str, length: int) -> None:
        """Cut a file shorter (allowed on the mount) and make it durable."""
        fd = self._open(sid, name, os.O_WRONLY)
        try:
            os.ftruncate(fd, length)
            os.fsync(fd)
        finally:
            os.close(fd)

    @_errors
    def sync_summaries(self, sid: str, data: bytes, sync: bool = True,
                       old: bytes | None = None) -> bool:
        """Make summaries.f32 equal ``data`` by cutting back to the common prefix and
        appending the rest (usually: append the new rounds only). True if it changed.
        ``old``: what the file holds, when the caller knows it (else it is read)."""
        if old is None:
            old = self.read_small(sid, SUMMARIES)
        if old == data:
            return False
        old = old or b""
        limit = min(len(old), len(data))
        diff = np.nonzero(np.frombuffer(old, np.uint8, limit) != np.frombuffer(data, np.uint8, limit))[0]
        p = int(diff[0]) if len(diff) else limit
        if old:
            self.truncate(sid, SUMMARIES, p)
        self.append(sid, SUMMARIES, p, [np.frombuffer(data[p:], np.uint8)], sync)
        return True

    @_errors
    def write_meta(self, sid: str, raw: bytes, sync: bool = True, old: bytes | None = None,
                   name: str = META) -> bool:
        """Replace meta.json (or another small file ``name``): truncate(0) + one write
        (+ fsync), the mount's rule for it. True if it changed. ``old``: what the file
        holds, when the caller knows it (else it is read)."""
        if (old if old is not None else self.read_small(sid, name)) == raw:
            return False
        fd = self._open(sid, name, os.O_WRONLY, create=True)
        try:
            os.ftruncate(fd, 0)
            view = memoryview(raw)
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def write_incarnation(self, sid: str, inc: int, sync: bool = True) -> None:
        self.write_meta(sid, f"{inc:016x}\n".encode(), sync, name=INCARNATION)

    @_errors
    def delete(self, sid: str) -> bool:
        try:
            dfd = self._sdir(sid, os.O_RDONLY)  # refuses a directory that is not ours
        except (FileNotFoundError, NotADirectoryError):
            return False
        try:
            for n in os.listdir(dfd):
                os.unlink(n, dir_fd=dfd)
        finally:
            os.close(dfd)
        os.rmdir(self.path(sid))
        self.sync_sessions_dir()
        return True
