"""The names of a session's files on the mount (``sessions/<sid>/``), and nothing else.

One place spells them; every other module imports them from here (a test checks that no
file name of a session is spelled anywhere else in kvfs/). docs/format.md describes the
bytes of each; ``kvfs.session`` says which are trusted and how each is checked.
"""

from __future__ import annotations

import re

#: the session's claim: model fingerprint, geometry, ``tokens``, ``rounds`` (JSON)
META = "meta.json"
#: tokens a flush acknowledged as durable (JSON ``{"tokens": N}``), a lower bound on META
ACKED = ".acked"
#: the token ids of the layer files' tokens (CRC'd records, ``kvfs.session.tokens``)
TOKENS = "tokens"
#: one float32 vector per round (``summary_dim`` floats each), for recall
SUMMARIES = "summaries.f32"
#: the session's incarnation id, 16 hex digits and a newline (``kvfs.session.formats``)
INCARNATION = ".incarnation"
#: the hot tier's per-block key centroids, a side stream kept exactly like a layer
KEY_CENTROIDS = "key_centroids"
LAYER_PREFIX = "layer_"
LAYER_RE = re.compile(LAYER_PREFIX + r"(0|[1-9][0-9]{0,9})")

#: side streams: append-only byte files beside the layers, under stream numbers above
#: every layer number (checksummed extents, write-behind, migration, promotion as a layer)
SIDE_BASE = 1 << 31
SIDE_STREAMS = {KEY_CENTROIDS: SIDE_BASE}
_SIDE_NAMES = {n: name for name, n in SIDE_STREAMS.items()}

#: small files are read whole, at most this many bytes (far more than 100,000 rounds take);
#: a larger one is none kvfs wrote. SUMMARIES grows with the rounds and has no bound.
MAX_SMALL = 1 << 20


def layer_name(layer: int) -> str:
    """The file of a stream: ``layer_<n>``, or a side stream's own name."""
    return _SIDE_NAMES.get(layer) or f"{LAYER_PREFIX}{layer}"


def stream_number(name: str) -> int | None:
    """The stream a file holds (a layer's number or a side stream's); None for others."""
    m = LAYER_RE.fullmatch(name)
    return int(m.group(1)) if m else SIDE_STREAMS.get(name)


def side_stream(name: object) -> int:
    """The stream number of side stream ``name`` (ValueError for any other name)."""
    if not isinstance(name, str) or name not in SIDE_STREAMS:
        raise ValueError(f"side stream must be one of {', '.join(SIDE_STREAMS)}, got {name!r}")
    return SIDE_STREAMS[name]


def small_limit(name: str) -> int | None:
    """The most bytes a small file ``name`` may hold (None: no bound)."""
    return None if name == SUMMARIES else MAX_SMALL


def is_claim(name: str) -> bool:
    """Whether ``name`` is the file that claims a session's bytes (written last, pushed
    to the shared tier apart from the others, with the session's owner)."""
    return name == META
