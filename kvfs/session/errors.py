"""The session layer's errors (the warm tier's ``WarmError`` is a ``SessionError``)."""

from __future__ import annotations


class SessionError(Exception):
    """A session's files cannot be read or written as asked (the message says why)."""


class SessionCorrupt(SessionError, ValueError):
    """A session file is not one kvfs writes (or claims what the other files do not hold):
    an error, never read as a shorter session."""
