"""Every errno the FUSE layer answers, decided in one place.

Engine exceptions map through ``ERRNO``; the layer's own refusals are ``Refused`` (a name
the kernel passed that kvfs will not take, a channel request, a mount that cannot go ahead)
and ``Stale`` (a handle whose file was unlinked
or replaced). ``handler`` wraps each ``Operations`` handler: a ``FUSEError`` passes, the
exceptions above become their errno, and anything else is a bug -- logged with its
traceback, answered with EIO, the volume marked as needing fsck -- because an exception
other than ``FUSEError`` leaving a handler ends the whole mount.
"""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from pyfuse3 import FUSEError

from kvfs.engine import errors

log = logging.getLogger("kvfs.fs")

T = TypeVar("T")
P = ParamSpec("P")


class _Counts(Protocol):
    corrupt_reads: int


class Handlers(Protocol):
    """What ``handler`` needs of the ``Operations`` whose handler it wraps."""

    @property
    def counters(self) -> _Counts: ...

    def _internal_error(self, where: str, e: BaseException) -> None: ...


H = TypeVar("H", bound=Handlers)

#: engine exception -> errno; subclasses before their base (NameTooLong is a BadName)
ERRNO: list[tuple[type[errors.KVFSError], int]] = [
    (errors.NotFound, errno.ENOENT),
    (errors.Exists, errno.EEXIST),
    (errors.NameTooLong, errno.ENAMETOOLONG),
    (errors.BadName, errno.EINVAL),
    (errors.NotAppend, errno.EPERM),
    (errors.BadRange, errno.EINVAL),
    (errors.TimeRange, errno.EOVERFLOW),
    (errors.BadId, errno.EINVAL),
    (errors.NotEmpty, errno.ENOTEMPTY),
    (errors.QuotaExceeded, errno.EDQUOT),
    (errors.NoSpace, errno.ENOSPC),
    (errors.Corrupt, errno.EIO),
]


def errno_of(exc: BaseException) -> int:
    """The errno a client sees for an exception (EIO for anything unexpected)."""
    if isinstance(exc, FUSEError):
        return exc.errno
    if isinstance(exc, Refused):
        return exc.errno
    if isinstance(exc, Stale):
        return errno.ESTALE
    for cls, code in ERRNO:
        if isinstance(exc, cls):
            return code
    return errno.EIO


class Refused(Exception):
    """What the FUSE layer refuses before the engine sees it: a name the kernel passed, a
    channel request, a mount that cannot go ahead. ``errno`` says how (what a client is
    answered), ``str(e)`` why (the one line a log or the user sees)."""

    def __init__(self, code: int, why: str = "") -> None:
        super().__init__(why)
        self.errno = code


class Stale(Exception):
    """The file behind a handle was unlinked or replaced: ESTALE, never the new file."""


def handler(fn: Callable[Concatenate[H, P], Coroutine[Any, Any, T]]
            ) -> Callable[Concatenate[H, P], Coroutine[Any, Any, T]]:
    """Translate what escapes a handler: known exception -> errno, anything else -> EIO.

    ``self`` (the ``Operations``) provides ``counters`` and ``_internal_error``.
    """

    @functools.wraps(fn)
    async def wrapper(self: H, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await fn(self, *args, **kwargs)
        except FUSEError:
            raise
        except (Refused, Stale) as e:
            raise FUSEError(errno_of(e)) from None
        except errors.KVFSError as e:
            code = errno_of(e)
            if isinstance(e, errors.Corrupt):
                log.error("%s: corrupt data, answering EIO: %r", fn.__name__, e)
                self.counters.corrupt_reads += 1
            elif code == errno.EIO:
                self._internal_error(fn.__name__, e)
            raise FUSEError(code) from None
        except Exception as e:
            self._internal_error(fn.__name__, e)
            raise FUSEError(errno.EIO) from None

    return wrapper
