"""The figures agent processes publish for the tiers a mount does not hold.

Each agent process rewrites ``<warm_root>/<volume uuid>/proc-<pid>/stats.json`` every
second (its RAM tier's bytes, sessions, cap, hits, misses, dirty bytes, and its router's
hot-tier bytes and sessions). ``kvfs-stat`` and the mount's ``/.kvfs/metrics`` sum the
fresh ones, so both show all three tiers. A file not rewritten for ``max_age_s`` belongs
to a process that is gone and is left out. A root with ``{uid}`` in its last component (the
per-user default) stands for every such directory owned by the uid its name says.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from typing import Any

_PROC = re.compile(r"proc-([0-9]+)(?:-[0-9]+)?")
_VOLUME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True


# kvfs.warm.rootdir.FALLBACK_TAG: a root squatted by another user in a shared directory
# moves to a private fallback beside it, ``<root>.private-<random>`` (open_root)
FALLBACK_TAG = ".private-"
_SUFFIX = r"(?:" + re.escape(FALLBACK_TAG) + r"[A-Za-z0-9_]{1,64})?"


def roots(warm_root: str) -> list[str]:
    """The RAM-tier roots ``warm_root`` names: itself, or with ``{uid}`` in its last
    component, each directory of that shape owned by the uid in its name; and the private
    fallbacks beside them (``open_root``'s, where another user squatted the name), each
    a directory nobody else may write (with ``{uid}``: owned by that uid)."""
    parent, last = os.path.split(warm_root)
    if "{uid}" in parent:
        return []
    if "{uid}" not in warm_root:
        shape, out = re.compile(re.escape(last) + _SUFFIX), [warm_root]
    else:
        shape = re.compile(re.escape(last).replace(re.escape("{uid}"), "([0-9]{1,10})") + _SUFFIX)
        out = []
    try:
        names = sorted(os.listdir(parent or "."))
    except OSError:
        return out
    for n in names:
        m = shape.fullmatch(n)
        if m is None or n == last:
            continue
        path = os.path.join(parent, n)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode):  # a symlink or a file: not a root
            continue
        if m.groups() and st.st_uid != int(m.group(1)):  # not someone's fake
            continue
        if FALLBACK_TAG in n and st.st_mode & 0o022:  # open_root never makes it so
            continue
        out.append(path)
    return out


def read(warm_root: str, volume_id: str | None = None,
         max_age_s: float = 10.0) -> list[dict[str, Any]]:
    """The ``stats.json`` documents of the live agents of one volume (the RAM tier's root
    itself when ``volume_id`` is None), each with its ``pid``; none when unreadable."""
    if volume_id is not None and not _VOLUME.fullmatch(volume_id):
        return []
    out: list[dict[str, Any]] = []
    for root in roots(warm_root):
        out += _read_root(root, volume_id, max_age_s)
    return out


def _read_root(warm_root: str, volume_id: str | None, max_age_s: float) -> list[dict[str, Any]]:
    base = os.path.join(warm_root, volume_id) if volume_id is not None else warm_root
    try:
        names = sorted(n for n in os.listdir(base) if _PROC.fullmatch(n))
    except OSError:
        return []
    out, now = [], time.time()
    for n in names:
        m = _PROC.fullmatch(n)
        if m is None:  # not listed: names were chosen by this pattern
            continue
        pid = int(m.group(1))
        if not _alive(pid):
            continue
        try:
            fd = os.open(os.path.join(base, n, "stats.json"), os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                doc = json.loads(f.read(1 << 20))
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and now - float(doc.get("time") or 0) <= max_age_s:
            doc["pid"], doc["dir"] = pid, os.path.join(base, n)
            out.append(doc)
    return out


def totals(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{"warm": {...}, "hot": {...}}`` summed over agents (empty dicts when none)."""
    if not docs:
        return {"warm": {}, "hot": {}}

    def total(key: str, d: list[dict[str, Any]]) -> float:
        return sum(x.get(key) or 0 for x in d)

    warm = {k: total(k, docs) for k in ("bytes", "sessions", "cap", "hits", "misses", "dirty_bytes")}
    warm["writebehind_lag_s"] = max((x.get("writebehind_lag_s") or 0) for x in docs)
    hots = [x["hot"] for x in docs if isinstance(x.get("hot"), dict)]
    hot: dict[str, Any] = {}
    if hots:
        budgets = [h.get("budget") for h in hots]
        hot = {"bytes": total("bytes", hots), "sessions": total("sessions", hots),
               "budget": sum(budgets) if all(budgets) else None}
    return {"warm": warm, "hot": hot}
