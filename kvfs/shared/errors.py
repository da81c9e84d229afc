"""Errors of the shared tier.

Where the meaning is the engine's (not found, bad name, not an append, bad range, corrupt),
the class derives from the engine's exception too, so the filesystem layer maps it to the
same errno (ENOENT, EINVAL, EPERM, EIO) without knowing about the cluster. Bad input is
also a ``ValueError``.
"""

from __future__ import annotations

from kvfs.engine import errors as engine


class SharedError(Exception):
    """Base class of every error the shared tier raises on purpose."""


class SharedUnavailable(SharedError):
    """The cluster (or the shard of this session) cannot be reached within the timeout.
    Nothing is known to have changed; the caller keeps serving from its local tiers."""


class SharedCorrupt(SharedError, engine.Corrupt):
    """A chunk failed its checksum (or is missing) twice in a row; its bytes are never
    returned."""


class SharedLost(SharedError):
    """``sync`` found fewer bytes in the cluster than this node appended: writes the old
    master acknowledged were lost in a failover before they reached a replica.
    ``files`` maps file -> (bytes appended, bytes the cluster holds now); re-append from
    the local copy at the cluster's size."""

    def __init__(self, session: str, files: dict[str, tuple[int, int]]) -> None:
        lost = ", ".join(f"{f}: {have} of {want} bytes" for f, (want, have) in sorted(files.items()))
        super().__init__(f"session {session!r}: acknowledged writes lost in a failover ({lost})")
        self.session, self.files = session, files


class SessionBusy(SharedError):
    """Another node holds the session's lease."""

    def __init__(self, session: str, owner: str, expires_ms: int) -> None:
        super().__init__(f"session {session!r} is leased by node {owner!r} "
                         f"(lease expires in {expires_ms} ms unless renewed)")
        self.session, self.owner, self.expires_ms = session, owner, expires_ms


class LeaseLost(SharedError):
    """This node does not hold the session's lease (expired, taken over, or never taken);
    nothing was written. ``owner`` is the current holder or None."""

    def __init__(self, session: str, owner: str | None) -> None:
        who = f"node {owner!r} holds it now" if owner else "nobody holds it"
        super().__init__(f"session {session!r}: this node does not hold the lease ({who})")
        self.session, self.owner = session, owner


class NotFoundShared(SharedError, engine.NotFound):
    """The cluster has no such session or file (a miss: read the local tiers)."""


class BadName(SharedError, engine.BadName, ValueError):
    """A session or file name the shared tier refuses; nothing changed."""


class BadRange(SharedError, engine.BadRange, ValueError):
    """A negative or non-integer offset/length, or a truncate beyond the end; nothing changed."""


class NotAppend(SharedError, engine.NotAppend, ValueError):
    """An append whose offset is not the file's stored size; nothing changed. ``size`` is
    the size the cluster holds."""

    def __init__(self, session: str, file: str, offset: int, size: int) -> None:
        super().__init__(f"{session}/{file}: append at offset {offset}, but the shared "
                         f"tier holds {size} bytes (appends go at the end)")
        self.session, self.file, self.offset, self.size = session, file, offset, size
