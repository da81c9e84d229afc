"""Which ``ColdBackend`` serves a cold root: the one module that knows both backends."""

from __future__ import annotations

from kvfs.session.backend import ColdBackend

from .coldfiles import ColdStore
from .coldnative import NativeCold
from .ids import WarmError


def open_cold(root: str, native: bool | None = None) -> ColdBackend:
    """The cold tier at ``root``: through the mount's native channel when it serves one
    this process may use (``native`` None: when available; False: never; True: required,
    else WarmError), else plain files."""
    files = ColdStore(root)
    if native is False:
        return files
    cold = NativeCold.open(files)
    if cold is None:
        if native:
            raise WarmError(f"cold tier {root!r}: no native channel this process may use")
        return files
    return cold
