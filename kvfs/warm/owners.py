"""Who owns what under a warm root: one directory per volume, one per process, one lock
per session, and the figures each agent process publishes.

Layout (``volume_id=None`` leaves out the volume level)::

    <root>/<volume_id>/
        locks/<md5(sid)>.lock    flock'ed by the process that has the session open (its pid inside)
        proc-<pid>[-<k>]/        one per WarmTier: its .kvmap shards and stats.json;
                                 the directory itself is flock'ed while the tier lives

Shards are per process, so two processes never write one file, whatever their sessions'
md5 prefixes. flock locks die with their process (kill -9 included), so "a directory
whose lock nobody holds" is "a directory of a dead process": a starting tier moves its
shard files into its own directory (``adopt_dead``) and writes their dirty tails to the
mount within the write-behind lag. The lock of a session is taken on first use and held
while the session is open in the process; a second process gets a WarmError naming the
owner's pid.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import os
import re

from .ids import WarmError
from .rootdir import RootDir

log = logging.getLogger("kvfs.warm")
PROC_RE = re.compile(r"proc-([0-9]+)(?:-[0-9]+)?")
_VOLUME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
LEGACY_LOCK = ".lock"  # the whole-root lock of the layout before per-process directories
STATS = "stats.json"


def check_volume_id(volume_id: object) -> str:
    if (not isinstance(volume_id, str) or not _VOLUME_RE.fullmatch(volume_id)
            or volume_id == "locks" or PROC_RE.fullmatch(volume_id)):
        raise WarmError(f"volume_id must be 1-128 of [A-Za-z0-9._-] (not 'locks' or "
                        f"'proc-N'), got {volume_id!r}")
    return volume_id


def _try_flock(fd: int, how: int = fcntl.LOCK_EX) -> bool:
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class SessionLocks:
    """Per-session flock files in ``locks/``."""

    def __init__(self, d: RootDir) -> None:
        self.d = d

    @staticmethod
    def name(sid: str) -> str:
        return hashlib.md5(sid.encode("utf-8")).hexdigest() + ".lock"

    def holder(self, sid: str) -> str:
        """The pid written in a held lock (as text; 'unknown' if unreadable)."""
        try:
            fd = self.d.open(self.name(sid), os.O_RDONLY)
        except WarmError:
            return "unknown"
        try:
            return os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        finally:
            os.close(fd)

    def try_take(self, sid: str) -> int | None:
        """The locked descriptor, or None when another holder has it."""
        name = self.name(sid)
        while True:
            fd = self.d.open_or_create(name)
            if not _try_flock(fd):
                os.close(fd)
                return None
            # the last holder unlinks the name before it unlocks: a lock on an inode the
            # name no longer points to is no lock; take the new file
            try:
                same = self.d.lstat(name).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                return fd
            os.close(fd)

    def take(self, sid: str, where: str) -> int:
        fd = self.try_take(sid)
        if fd is None:
            raise WarmError(f"session {sid!r} is in use by process {self.holder(sid)} "
                            f"(warm tier {where}); one process at a time may have it open")
        return fd

    def drop(self, sid: str, fd: int) -> None:
        with contextlib.suppress(WarmError):
            self.d.unlink(self.name(sid))
        os.close(fd)  # closing releases the flock


def claim_dir(base: RootDir) -> RootDir:
    """This tier's own ``proc-<pid>`` directory, made or taken over (a dead process with
    our pid) and flock'ed; ``proc-<pid>-<k>`` for a second tier in one process."""
    pid = os.getpid()
    for k in itertools.count():
        name = f"proc-{pid}" if k == 0 else f"proc-{pid}-{k}"
        d = base.sub(name)
        if _try_flock(d.fd):
            return d
        d.close()
    raise AssertionError("unreachable")


def _move_shards(src: RootDir, mine: RootDir, names: list[str]) -> int:
    """Move a dead directory's shard files into ours; returns how many stayed (a name we
    have already: taken by a later start-up)."""
    left = 0
    for n in names:
        if ".kvmap.tmp." in n or ".kvmap.drop." in n or n in (STATS, STATS + ".tmp"):
            src.unlink(n)
        elif n.endswith(".kvmap") or ".kvmap.corrupt." in n:
            try:
                src.move(n, mine, n)
            except WarmError as e:
                log.warning("warm: %s; left for a later start-up", e)
                left += 1
        elif n != LEGACY_LOCK:
            left += 1
    return left


def adopt_dead(base: RootDir, mine: RootDir, legacy: bool) -> list[str]:
    """Take over the shard files of every dead process's directory under ``base`` (and,
    with ``legacy``, those of the old one-process-per-root layout in ``base`` itself);
    empty dead directories are removed. Returns the directories taken over."""
    took = []
    own = os.path.basename(mine.path)
    for name in sorted(base.listdir()):
        if name == own or not PROC_RE.fullmatch(name):
            continue
        try:
            d = base.sub(name, create=False)
        except WarmError as e:
            log.error("warm: %s; skipped", e)
            continue
        try:
            if not _try_flock(d.fd):
                continue  # a live process
            left = _move_shards(d, mine, d.listdir())
            took.append(name)
            if not left:
                base.rmdir(name)
        finally:
            d.close()
    if legacy:
        names = base.listdir()
        if any(n.endswith(".kvmap") for n in names):
            fd = base.open_or_create(LEGACY_LOCK)
            try:
                if _try_flock(fd):
                    _move_shards(base, mine, names)
                    base.unlink(LEGACY_LOCK)
                    took.append(base.path)
                else:
                    log.warning("warm root %s is in use by a process of an older kvfs; its "
                                "sessions stay there", base.path)
            finally:
                os.close(fd)
        elif LEGACY_LOCK in names:
            base.unlink(LEGACY_LOCK)
    if took:
        log.info("warm: took over the RAM copies of %d stopped process(es): %s", len(took),
                 ", ".join(took))
    return took


def write_stats(mine: RootDir, doc: dict) -> None:
    mine.write_atomic(STATS, (json.dumps(doc, sort_keys=True) + "\n").encode())
