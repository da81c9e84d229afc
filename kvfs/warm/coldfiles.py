"""The cold tier through plain files: ``ColdStore``, the ``ColdBackend`` of any mount.

Only ordinary file calls are used (open, os.pread/preadv, os.write, os.fsync,
os.ftruncate, os.listdir, os.stat), never engine internals, and the mount's rules are kept
everywhere (cold.py). ``write`` applies a session's changes with no fsync, keeping the
descriptors of the layer files it appended to (up to ``KEEP_FDS`` over all sessions), and
``sync`` fsyncs what a batch of writes touched on a few threads at once -- each layer file
on the descriptor that wrote it, the rest by name, then the session directories and
``sessions/`` when a session was made -- so the filesystem commits them together, as fast
as one big file (on the mount, one device flush).

On a mount with a shared tier (``--shared``) a session is served by one node at a time: the
mount holds the session's lease in the cluster while any of its files is open for writing.
``hold`` keeps one such descriptor (meta.json, opened for writing, never written through)
for as long as this process serves the session, so the lease stays with this node between
turns, and another node's agent is refused (``WarmBusy`` naming the owner, which the mount
tells through the session directory's ``user.kvfs.lease`` attribute).

A shared mount (``--allow-other``) has a world-writable, sticky ``sessions/``: anyone may
make a session directory there, also under a name this process will use. So a session
directory is made with ``mkdir`` 0700 and checked, and every access goes through its
checked descriptor: a directory or file that is not ours (another uid) or that group or
other may write to, or a symlink, is refused with a WarmError -- never read as our KV,
never written into. Files are created 0600 and opened with ``O_NOFOLLOW``.
"""

from __future__ import annotations

import builtins
import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from kvfs.session.backend import (
    APPEND,
    HOLD_WAIT_S,
    REPLACE,
    TRUNCATE,
    Changes,
    ColdState,
    Piece,
    Range,
    Written,
    byte_view,
)
from kvfs.session.formats import parse_incarnation
from kvfs.session.names import INCARNATION, META, layer_name, small_limit, stream_number

from .checked import CheckedSessions
from .cold import cold_errors, mount_info
from .ids import WarmBusy, WarmCorrupt, WarmError

log = logging.getLogger("kvfs.warm")

_CHUNK = 8 << 20  # bytes per os.write: bounded kernel/FUSE requests, no big copies
LEASE_XATTR = "user.kvfs.lease"
FSYNC_THREADS = 8
KEEP_FDS = 256  # layer-file descriptors kept open for their fsyncs, over all pending writes
_errors = cold_errors


def _replicated(root: str) -> bool:
    """Whether ``root`` is a kvfs mount with a shared tier (its /.kvfs/stats says so)."""
    try:
        stats = mount_info(root)
    except OSError:
        return False
    return stats is not None and stats.get("shared") is not None


def _fsync_fd(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as e:  # some FUSE filesystems do not implement fsyncdir
        if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise


class FdHold:
    """A session's hold: a descriptor of meta.json opened for writing (module doc)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def release(self) -> None:
        try:
            os.close(self.fd)
        except OSError as e:  # the mount went away: its lease ends with it
            log.warning("closing a session hold: %s", e)


class ColdStore:
    """File-level access to ``cold_root/sessions`` (module doc); a ``ColdBackend``."""

    kind = "files"

    def __init__(self, root: str) -> None:
        # A mounted volume always has sessions/; an empty mountpoint (volume not mounted)
        # does not, and writing into it would silently put "cold" data on the root disk.
        self.root = root
        self.dir = os.path.join(root, "sessions")
        self.uid = os.geteuid()
        if not os.path.isdir(self.dir):
            raise WarmError(f"cold tier {root!r} has no sessions/ directory: is the volume mounted?")
        self.shared = _replicated(root)
        self.checked = CheckedSessions(self.dir, self.uid)
        self._kept = 0  # layer-file descriptors held by ``Written``s not yet synced
        self._kept_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    # ---- the session's lease (a mount with a shared tier) ---------------------------
    def hold(self, sid: str, wait_s: float = HOLD_WAIT_S) -> FdHold | None:
        """Keep the session's lease for this process (see the module docstring) until
        its ``release``. None without a shared tier, or when the session
        has no directory yet (then ``hold`` once it is made). ``WarmBusy`` when another
        node holds the lease after ``wait_s`` (a node that just let it go hands it over
        within moments)."""
        if not self.shared:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return FdHold(self.checked.open(sid, META, os.O_WRONLY, create=True))
            except (FileNotFoundError, NotADirectoryError):
                return None
            except OSError as e:
                if e.errno != errno.EBUSY:
                    raise WarmError(f"cold {self.path(sid)!r}: cannot hold the session: "
                                    f"{e.strerror or e}") from e
                if time.monotonic() >= deadline:
                    raise WarmBusy(sid, self.lease_owner(sid)) from None
                time.sleep(0.05)

    def lease_owner(self, sid: str) -> str | None:
        """The node the mount says holds the session's lease (None: it cannot say)."""
        try:
            return os.getxattr(self.path(sid), LEASE_XATTR).decode(errors="replace")
        except OSError:
            return None

    def path(self, sid: str, name: str | None = None) -> str:
        return self.checked.path(sid, name)

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
            dfd = self.checked.sdir(sid, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            out = {}
            for n in os.listdir(dfd):
                num = stream_number(n)
                if num is not None:
                    st = os.stat(n, dir_fd=dfd, follow_symlinks=False)
                    self.checked.refuse(self.path(sid, n), st, False)
                    out[num] = st.st_size
            return out
        finally:
            os.close(dfd)

    @_errors
    def state(self, sid: str, incarnation: bool = True,
              streams: Sequence[int] | None = None) -> ColdState | None:
        """(layer sizes, incarnation id or None) of the cold copy; None when there is none.
        ``streams``: only those (a stat each, no listing; absent ones are left out)."""
        sizes = self.layer_sizes(sid) if streams is None else self._sizes_of(sid, streams)
        if sizes is None:
            self.reachable()  # an unmounted volume is an error, never "the session was removed"
            return None
        return sizes, parse_incarnation(self.read_small(sid, INCARNATION)) if incarnation else None

    @_errors
    def _sizes_of(self, sid: str, streams: Sequence[int]) -> dict[int, int] | None:
        try:
            dfd = self.checked.sdir(sid)
        except (FileNotFoundError, NotADirectoryError):
            return None
        out = {}
        try:
            for stream in streams:
                try:
                    st = os.stat(layer_name(stream), dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                self.checked.refuse(self.path(sid, layer_name(stream)), st, False)
                out[stream] = st.st_size
        finally:
            os.close(dfd)
        return out

    @_errors
    def read_into(self, sid: str, layer: int, off: int, out: np.ndarray,
                  missing_is_empty: bool = False) -> None:
        """Fill ``out`` (uint8, contiguous) from layer bytes at ``off``; ValueError when
        the file ends before, WarmError if it is missing (unless ``missing_is_empty``: then
        it holds 0 bytes) or a read comes back short."""
        try:
            fd, st = self.checked.open_stat(sid, layer_name(layer), os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError) as e:
            if missing_is_empty:
                raise ValueError(f"read [{off}, {off + len(out)}) past the end (0) of "
                                 f"{sid}/{layer_name(layer)}") from e
            raise WarmError(f"cold {sid}/{layer_name(layer)} is missing") from e
        try:
            if off + len(out) > st.st_size:
                raise ValueError(f"read [{off}, {off + len(out)}) past the end ({st.st_size}) "
                                 f"of {sid}/{layer_name(layer)}")
            view = out.data.cast("B")
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
        """A small file's bytes; meta.json (and the other small files but summaries.f32)
        only up to ``MAX_SMALL``: a larger one is none kvfs wrote (WarmCorrupt), and is
        never read whole into memory."""
        try:
            fd = self.checked.open(sid, name, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return None
        limit = small_limit(name)
        try:
            parts, n = [], 0
            while chunk := os.read(fd, 1 << 20):
                parts.append(chunk)
                n += len(chunk)
                if limit is not None and n > limit:
                    raise WarmCorrupt(f"cold {sid}/{name} is over {limit} bytes: not one kvfs "
                                      "writes; refused")
            return b"".join(parts)
        finally:
            os.close(fd)

    def read_ranges(self, sid: str, ranges: Sequence[Range],
                    missing_is_empty: bool = False) -> None:
        """``read_into`` of each (layer, offset, out), one file at a time."""
        for layer, off, out in ranges:
            self.read_into(sid, layer, off, out, missing_is_empty)

    def prefetch(self, sid: str, layers: Iterable[int], start: int, end: int) -> int:
        """Ask the kernel to read ``[start, end)`` of these layer files ahead, all at once
        (``posix_fadvise(WILLNEED)``), so reads that follow one layer at a time find the
        bytes cached rather than waiting for the disk layer by layer. Advisory: missing
        files and errors are ignored. Returns the files advised."""
        if end <= start or not hasattr(os, "posix_fadvise"):
            return 0
        n = 0
        for layer in layers:
            try:
                fd = self.checked.open(sid, layer_name(layer), os.O_RDONLY)
            except (OSError, WarmError):
                continue
            try:
                os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
                n += 1
            except OSError:
                pass
            finally:
                os.close(fd)
        return n

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
        os.close(self.checked.sdir(sid))
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
        fd = self.checked.sdir(sid, os.O_RDONLY)
        try:
            _fsync_fd(fd)
        finally:
            os.close(fd)

    @_errors
    def fsync_file(self, sid: str, name: str) -> None:
        """fsync a file written earlier through another descriptor (the data is the
        inode's, not the descriptor's; on the mount, close flushed it and fsync syncs)."""
        fd = self.checked.open(sid, name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @_errors
    def append(self, sid: str, name: str, expect: int, pieces: Iterable[Piece],
               sync: bool = True, keep: builtins.list[int] | None = None) -> int:
        """Append ``pieces`` to file ``name`` whose size must be ``expect`` (fsync unless
        ``sync`` is False: the caller then calls ``fsync_file``, or ``fsync_close`` on the
        descriptor left open in ``keep``). Writes go at the current end (the mount's
        append-only rule); returns the new size."""
        fd = self.checked.open(sid, name, os.O_WRONLY, create=True)
        if keep is not None:
            keep.append(fd)
        try:
            pos = os.lseek(fd, 0, os.SEEK_END)
            if pos != expect:
                raise WarmError(f"cold {sid}/{name}: size {pos}, expected {expect} (written "
                                "meanwhile by another process or node)")
            for piece in pieces:
                view = byte_view(piece)
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
        fd = self.checked.open(sid, name, os.O_WRONLY)
        try:
            os.ftruncate(fd, length)
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_meta(self, sid: str, raw: bytes, sync: bool = True, old: bytes | None = None,
                   name: str = META) -> bool:
        """Replace meta.json (or another small file ``name``) unless it already holds
        ``raw`` (``old``: what it holds, when the caller knows; else it is read); durable
        with ``sync``. True if it changed."""
        if (old if old is not None else self.read_small(sid, name)) == raw:
            return False
        self.replace(sid, name, raw, sync)
        return True

    @_errors
    def replace(self, sid: str, name: str, raw: bytes, sync: bool = True) -> None:
        """A small file's bytes replaced: truncate(0) + one write (+ fsync)."""
        fd = self.checked.open(sid, name, os.O_WRONLY, create=True)
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

    # ---- the protocol's batched writes ---------------------------------------------
    def write(self, sid: str, changes: Changes, w: Written | None = None,
              durable: bool = False) -> Written:
        """Apply ``changes`` in order (no fsync but a truncate's, unless ``durable``) into
        ``w`` (each name as it is tried, its size once done: a failure leaves what was
        done recorded); the descriptors of files appended to stay open for ``sync`` while
        fewer than ``KEEP_FDS`` are. A truncate is durable at once: its name is not one
        ``sync`` needs."""
        w = w if w is not None else Written(sid)
        w.release = self.forget
        if changes.make_dir:
            w.made_dir = self.ensure_dir(sid) or w.made_dir
        try:
            for c in changes.items:
                if c.kind != TRUNCATE and not durable:
                    w.names.add(c.name)
                if c.kind == APPEND and durable:
                    w.sizes[c.name] = self.append(sid, c.name, c.arg, c.pieces)
                elif c.kind == APPEND:
                    with self._kept_lock:
                        keep: list[int] | None = [] if self._kept < KEEP_FDS and c.name not in w.fds else None
                        if keep is not None:
                            self._kept += 1
                    try:
                        w.sizes[c.name] = self.append(sid, c.name, c.arg, c.pieces, sync=False, keep=keep)
                    finally:
                        if keep:
                            w.fds[c.name] = keep[0]
                        elif keep is not None:
                            with self._kept_lock:
                                self._kept -= 1
                elif c.kind == REPLACE:
                    self.replace(sid, c.name, b"".join(bytes(p) for p in c.pieces), sync=durable)
                    w.sizes[c.name] = sum(len(p) for p in c.pieces)
                else:
                    self.truncate(sid, c.name, c.arg)
                    w.sizes[c.name] = c.arg
        except BaseException:
            self.forget(w)
            raise
        return w

    def forget(self, written: Written) -> None:
        """Close the descriptors ``write`` kept (their files are then synced by name)."""
        fds, written.fds = written.fds, {}
        for fd in fds.values():
            os.close(fd)
        with self._kept_lock:
            self._kept -= len(fds)

    def _fsync_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(FSYNC_THREADS, thread_name_prefix="kvfs-warm-fsync")
        return self._pool

    def sync(self, written: Sequence[Written]) -> None:
        """Make what these writes touched durable: every file (layer files on the
        descriptor that wrote them), the session directories when names were added, and
        ``sessions/`` when a session was made, on a few threads at once. A session whose
        part fails gets its ``error``; the others are durable."""
        pool = self._fsync_pool()
        jobs: list[tuple[Written, Future]] = []
        for w in written:
            fds, w.fds = w.fds, {}
            with self._kept_lock:
                self._kept -= len(fds)
            jobs += [(w, pool.submit(self.fsync_close, w.sid, n, fd)) for n, fd in fds.items()]
            jobs += [(w, pool.submit(self.fsync_file, w.sid, n)) for n in sorted(w.names) if n not in fds]
            if w.made_dir or w.names:  # new names in it, maybe
                jobs.append((w, pool.submit(self.sync_dir, w.sid)))
        for w, fut in jobs:
            try:
                fut.result()
            except (OSError, WarmError) as e:
                w.error = w.error or e
        if any(w.made_dir for w in written):
            try:
                self.sync_sessions_dir()
            except (OSError, WarmError) as e:
                for w in written:
                    w.error = w.error or e

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    @_errors
    def delete(self, sid: str) -> bool:
        try:
            dfd = self.checked.sdir(sid, os.O_RDONLY)  # refuses a directory that is not ours
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
