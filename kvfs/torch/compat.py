"""Which transformers the hot tier runs with.

Models take their cache as ``cache=`` from transformers 5.24 on (``past_key_values`` is the
deprecated spelling until 5.40). Older 5.x releases accept ``cache=`` without a word and
ignore it: every step then attends nothing of the session, and ``generate`` refuses the
keyword. So a cache refuses to be built over an older transformers, with the fix. Only the
cache does: the package cannot require 5.24, since vLLM's CPU build pins transformers below
5.20, and kvfs's vLLM side (fingerprints, geometry, stored sessions) runs under that pin.
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

MIN_TRANSFORMERS = "5.24"


def check_transformers(version: str) -> None:
    """Raise RuntimeError unless ``version`` (transformers') is one the hot tier runs with."""
    try:
        v = Version(version)
    except InvalidVersion:
        raise RuntimeError(f"kvfs.torch: cannot read transformers' version {version!r}") from None
    if v.major != 5 or v < Version(MIN_TRANSFORMERS):
        raise RuntimeError(
            f"kvfs.torch needs transformers>={MIN_TRANSFORMERS},<6 (models take the cache as "
            f"cache=...); this is {version}: pip install 'transformers>={MIN_TRANSFORMERS},<6'")


def installed_transformers() -> str:
    import transformers

    return str(transformers.__version__)


def require_cache_keyword() -> None:
    """:func:`check_transformers` for the installed transformers (a cache calls it when built)."""
    check_transformers(installed_transformers())
