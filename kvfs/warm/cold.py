"""What the cold tier's two backends share: the mount's published info, the ownership
rule, and the translation of their OSErrors.

The seam itself, ``ColdBackend``, is ``kvfs.session.backend``'s (it names no
implementation); ``coldopen.open_cold`` picks one at start-up:

- ``coldfiles.ColdStore``: plain file calls through any mount (open, preadv, write,
  fsync), each checked (a file or directory that is not ours, or that others may write,
  is refused);
- ``coldnative.NativeCold``: the mount's native channel (``kvfs.channel``) when the mount
  serves one this process may use -- reads straight from the volume with extents the
  mount hands out, a pass's changes of a session as one request, one durability point
  for all of them; names (make, list, remove a session) and the shared tier's hold still
  through the files. Anything else (another uid, a remote mount, ``--no-channel``, a
  shared mount) gets the plain files, without being told.

Which files a session has, and in which order a round writes them, is ``kvfs.session``'s.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import stat
from collections.abc import Callable
from typing import Any, TypeVar

from .ids import WarmBusy, WarmError

log = logging.getLogger("kvfs.warm")


MOUNT_XATTR = "user.kvfs.mount"


def mount_info(root: str | None) -> dict[str, Any] | None:
    """What a kvfs mount publishes for the agents that open it: its profile, the volume's
    identity, direct I/O, its shared tier (``/.kvfs/stats``'s shape). From the root's
    ``user.kvfs.mount`` (one small answer), else ``/.kvfs/stats`` (a kvfs before it;
    rendering every counter costs the mount milliseconds); None for a plain directory or
    no mount."""
    if root is None:
        return None
    try:
        facts = json.loads(os.getxattr(root, MOUNT_XATTR))
        if isinstance(facts, dict):
            return facts
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, ".kvfs", "stats"), "rb") as f:
            stats = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise OSError(f"{root}: cannot read .kvfs/stats of the mount: {e}") from e
    return stats if isinstance(stats, dict) else None


def refusal(path: str, mode: int, uid: int, want_dir: bool, me: int) -> str | None:
    """Why a cold file or directory may not be used as ours (None: it may): not of the
    kind wanted (a symlink or other), another uid's, or writable by group or other."""
    kind = "directory" if want_dir else "file"
    if not (stat.S_ISDIR(mode) if want_dir else stat.S_ISREG(mode)):
        return f"cold {path!r} is not a {kind} (a symlink or other): refused"
    if uid != me:
        return f"cold {kind} {path!r} is owned by uid {uid}, not by this process (uid {me}): refused"
    if mode & 0o022:
        return (f"cold {kind} {path!r} is writable by group/other (mode "
                f"{stat.S_IMODE(mode):04o}): refused")
    return None


F = TypeVar("F", bound=Callable[..., Any])


def cold_errors(fn: F) -> F:
    """OSErrors of a cold call become WarmErrors naming the cold path (errno kept as the
    cause): the tier's callers see one kind of error; EBUSY is another node's lease."""
    @functools.wraps(fn)
    def run(self: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(self, *args, **kw)
        except OSError as e:
            if e.errno == errno.EBUSY and args and isinstance(args[0], str):
                raise WarmBusy(args[0], self.lease_owner(args[0])) from e  # another node's now
            where = self.dir
            if args and isinstance(args[0], str):
                where = self.path(args[0], args[1] if len(args) > 1 and isinstance(args[1], str) else None)
            raise WarmError(f"cold {where!r}: {e.strerror or e}") from e
    return run  # type: ignore[return-value]
