"""Engine exceptions. Only ``kvfs.fs`` maps them to errno; the engine never knows errno."""


class KVFSError(Exception):
    """Base class of every error the storage engine raises on purpose."""


class NotFound(KVFSError):
    """Unknown session or file (ENOENT)."""


class Exists(KVFSError):
    """Session or file already exists (EEXIST)."""


class BadName(KVFSError):
    """Session or file name not allowed: '/', NUL, '.', '..', empty (EINVAL)."""


class NameTooLong(BadName):
    """Name over 255 bytes (ENAMETOOLONG)."""


class NotAppend(KVFSError):
    """A write that is not an append at the current end of file (EPERM); nothing changed."""


class BadRange(KVFSError):
    """Offset/length/size out of range, e.g. truncate beyond size (EINVAL)."""


class TimeRange(KVFSError):
    """A time outside what records hold: signed 64-bit nanoseconds since the epoch,
    1677-09-21 to 2262-04-11 (EOVERFLOW); nothing changed."""


class BadId(KVFSError):
    """A uid, gid or mode that does not fit its 32-bit field (EINVAL); nothing changed."""


class NotEmpty(KVFSError):
    """Directory not empty (ENOTEMPTY)."""


class NoSpace(KVFSError):
    """The ring is full of data that may not be dropped (ENOSPC); nothing else lost."""


class IndexFull(NoSpace):
    """The index would pass its budget in the tree region (ENOSPC): no new session, file or
    extent until some are deleted; reads, deletions and checkpoints still work."""


class RecordFull(NoSpace):
    """One session's checkpoint record would pass what its chunk keys number (ENOSPC):
    no more files or extents in that session; other sessions are not affected."""


class QuotaExceeded(KVFSError):
    """The caller's uid is at one of its quotas: sessions, bytes, index share (EDQUOT);
    nothing changed. Not a NoSpace: other users still have room."""


class Corrupt(KVFSError):
    """A checksum or structure check failed for the bytes asked for (EIO)."""


class IndexCorrupt(Corrupt):
    """The checkpoint (a B+ tree page or session record) is bad: rebuild from the ring."""


class FormatError(KVFSError):
    """The file is not a kvfs volume, or one of an unsupported version/size; refuse to open."""


class BadSuperblock(FormatError):
    """One superblock slot does not decode. ``kind`` says why: "magic" (not a kvfs
    superblock), "version" (``version`` is not one this kvfs reads), "checksum", "layout"
    (checksummed, but its geometry does not fit the file or its positions disagree)."""

    def __init__(self, kind: str, msg: str, version: int = 0) -> None:
        super().__init__(msg)
        self.kind, self.version = kind, version


class NeedsFsck(KVFSError):
    """The volume is marked as needing fsck (an error was seen while it was in use); a
    writable open refuses it unless forced. ``kvfs-fsck --repair`` clears the mark."""


class VolumeBusy(KVFSError):
    """The volume is already opened (mounted) by another process."""
