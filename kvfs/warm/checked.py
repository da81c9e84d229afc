"""Checked access to ``sessions/`` of the cold tier: a directory or file that is not ours,
that group or other may write to, or a symlink, is refused with a WarmError -- never read
as our KV, never written into. Every access goes through a checked descriptor of the
session directory (``O_NOFOLLOW``; files made 0600 relative to it), so a name swapped
between the check and the use reaches nothing. Used by the plain-files cold tier
(``coldfiles.ColdStore``).
"""

from __future__ import annotations

import errno
import os

from .cold import refusal
from .ids import WarmError

NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class CheckedSessions:
    def __init__(self, sessions_dir: str, uid: int) -> None:
        self.dir, self.uid = sessions_dir, uid

    def path(self, sid: str, name: str | None = None) -> str:
        d = os.path.join(self.dir, sid)
        return d if name is None else os.path.join(d, name)

    def refuse(self, path: str, st: os.stat_result, want_dir: bool) -> None:
        why = refusal(path, st.st_mode, st.st_uid, want_dir, self.uid)
        if why is not None:
            raise WarmError(why)

    def sdir(self, sid: str, flags: int = os.O_PATH) -> int:
        """A checked descriptor of the session directory; FileNotFoundError if none."""
        d = self.path(sid)
        try:
            fd = os.open(d, flags | os.O_DIRECTORY | NOFOLLOW)
        except NotADirectoryError:
            st = os.lstat(d)
            self.refuse(d, st, True)
            raise
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise WarmError(f"cold {d!r} is a symbolic link: refused") from e
            raise
        try:
            self.refuse(d, os.fstat(fd), True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def open(self, sid: str, name: str, flags: int, create: bool = False) -> int:
        """A checked descriptor of a session's file (created 0600 with ``create``)."""
        return self.open_stat(sid, name, flags, create)[0]

    def open_stat(self, sid: str, name: str, flags: int,
                  create: bool = False) -> tuple[int, os.stat_result]:
        """``open`` and the descriptor's checked stat."""
        dfd = self.sdir(sid)
        try:
            fd = os.open(name, flags | NOFOLLOW | (os.O_CREAT if create else 0), 0o600,
                         dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise WarmError(f"cold {self.path(sid, name)!r} is a symbolic link: refused") from e
            raise
        finally:
            os.close(dfd)
        try:
            st = os.fstat(fd)
            self.refuse(self.path(sid, name), st, False)
        except BaseException:
            os.close(fd)
            raise
        return fd, st
