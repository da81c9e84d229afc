"""Connecting a mount to the shared tier (``--shared``): its settings, secret and password.

``open_shared`` builds the ``SharedTier`` from the command line and the profile, or says
why it cannot (``Refused``: a wrong setting, an unreachable cluster that is not optional).
No password ever reaches a message, a log line or the process title (``redact``,
``hide_credentials``); secrets are read only from files nobody else may read.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import logging
import os
import re
import socket
import sys
from typing import TYPE_CHECKING, Any

from kvfs.fuse.errnos import Refused
from kvfs.ops import profiles

if TYPE_CHECKING:
    from kvfs.shared import SharedTier

log = logging.getLogger("kvfs.mount")


def node_id(volume: str) -> str:
    """This mount's name in the cluster's leases: the host and its volume (stable across
    remounts, so a restarted mount finds its own leases)."""
    host = socket.gethostname().translate(str.maketrans("/{}|", "____")) or "host"
    return f"{host}-{hashlib.sha1(volume.encode()).hexdigest()[:8]}"


_CREDENTIALS = re.compile(r"(rediss?://[^:@/,\s]*):\S*@")  # to the last "@": a password may hold one


def redact(text: str) -> str:
    """``text`` with the password of every ``redis[s]://user:password@`` in it hidden."""
    return _CREDENTIALS.sub(r"\1:***@", text)


def hide_credentials(argv: list[str]) -> None:
    """A password given in a cluster URL on the command line is replaced by ``***`` in the
    process title (what ``ps`` and /proc/PID/cmdline show) as soon as the mount starts."""
    if any(redact(a) != a for a in argv):
        import setproctitle  # noqa: PLC0415 - only when there is something to hide

        setproctitle.setproctitle(" ".join(redact(a) for a in [sys.argv[0], *argv]))


def _read_private(path: str, what: str) -> str:
    """A one-line secret from a file nobody else may read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise Refused(e.errno or errno.EACCES, f"{what} {path}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        if os.fstat(f.fileno()).st_mode & 0o077:
            raise Refused(errno.EACCES, f"{what} {path} may be read by others: make it mode 0600")
        return f.read(4096).decode(errors="replace").rstrip("\r\n")


def shared_password(profile: profiles.Profile) -> str | None:
    """The Redis password: the environment's KVFS_SHARED_PASSWORD, else the password file,
    else None (the URL's, if it has one)."""
    env = os.environ.get("KVFS_SHARED_PASSWORD")
    if env:
        return env
    if profile.shared_password_file:
        return _read_private(profile.shared_password_file, "shared_password_file")
    return None


def open_shared(args: argparse.Namespace, profile: profiles.Profile) -> SharedTier | None:
    """The ``SharedTier`` of ``--shared`` (or the profile's ``shared``), None without one;
    ``Refused`` when it cannot be reached, unless it is optional (then a warning), and when
    its settings are wrong (optional or not). No password ever reaches a message."""
    urls = args.shared or profile.shared
    if not urls:
        return None
    from kvfs.shared import (  # noqa: PLC0415 - loaded only by mounts that use it
        SharedError,
        SharedTier,
        TLSFiles,
        parse_urls,
        read_secret,
    )

    try:
        url = parse_urls(urls, shared_password(profile))
    except ValueError as e:
        raise Refused(errno.EINVAL, f"--shared: {e}") from None
    if not profile.shared_secret_file:
        raise Refused(errno.EINVAL, "--shared needs the cluster's secret: -o shared_secret_file=PATH (32+ "
                      "random bytes, mode 0600, the same file on every node; e.g. head -c 48 "
                      "/dev/urandom | base64 > PATH)")
    try:
        secret = read_secret(profile.shared_secret_file)
    except ValueError as e:
        raise Refused(errno.EINVAL, str(e)) from None
    me = args.node_id or profile.shared_node_id or node_id(args.volume)
    tls = TLSFiles(profile.shared_tls_ca or None, profile.shared_tls_cert or None,
                   profile.shared_tls_key or None)
    optional = args.shared_optional or profile.shared_optional
    tier = None
    try:
        tier = SharedTier(url, node_id=me, secret=secret, encrypt=profile.shared_encrypt,
                          tls=tls, lease_ms=max(100, int(profile.shared_lease_s * 1000)),
                          retention_s=profile.shared_retention_s,
                          max_bytes=profile.shared_max_bytes or None)
        if not tier.healthy():
            raise SharedError("not every shard's master answers")
    except ValueError as e:  # a bad node id: a setting, not the cluster
        raise Refused(errno.EINVAL, f"--node-id / shared_node_id: {e}") from None
    except SharedError as e:
        if tier is not None:
            tier.close()
        if not optional:
            raise Refused(errno.EHOSTUNREACH, f"shared tier {url.redacted()} unreachable: {redact(str(e))} "
                          f"(--shared-optional mounts local-only)") from None
        log.warning("shared tier %s unreachable, running local-only: %s", url.redacted(),
                    redact(str(e)))
        return None
    log.info("shared tier %s, node %s%s", url.redacted(), tier.node_id,
             ", values encrypted" if profile.shared_encrypt else "")
    return tier


def published_profile(profile: profiles.Profile) -> dict[str, Any]:
    """The profile as /.kvfs/stats shows it (agents take their settings from it): the
    cluster URL without its password."""
    d = profile.as_dict()
    d["shared"] = redact(d.get("shared") or "")
    return d
