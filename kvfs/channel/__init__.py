"""kvfs.channel: the native channel between a mount and its own clients.

``protocol`` is the wire format both sides share; ``client.Channel`` is the client
(importable without pyfuse3 or trio); the server is ``kvfs.fuse.channel``. Reads go to
the volume directly (``kvfs.engine.direct``) with extents the mount serves; appends go to
the mount, one request per round for every file. ``kept.kept`` is the one client a process
keeps per mount, shared by its callers. Uses the engine's read-side code only.
"""

from kvfs.engine.direct import FileExtents

from .client import Channel, channel_of
from .kept import KeptChannel, kept
from .protocol import APPEND, REPLACE, TRUNCATE, Item, SessionInfo

__all__ = ["APPEND", "REPLACE", "TRUNCATE", "Channel", "FileExtents", "Item", "KeptChannel",
           "SessionInfo", "channel_of", "kept"]
