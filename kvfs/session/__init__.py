"""kvfs.session: the one owner of a session's files on the mount.

A session is ``sessions/<sid>/`` on a kvfs volume (or in the shared tier): layer files,
side streams, token ids, round summaries, meta.json, the incarnation id and the record of
acknowledged tokens. This package alone knows their names (``names``), their formats and
how far each is trusted (``formats``, ``tokens``), the order in which a round is written so
that a crash leaves the last complete one (``commit``), and the typed operations on them
(``files``: read layers, record ids, write small files, fork, delete) over the seam to
where they are kept (``backend.ColdBackend``: plain files through a mount, the mount's
native channel). The warm tier, kvfs.torch, kvfs.vllm, FUSE's push to the shared tier and
the shared tier's chunks go through it; none of them spells a file name.

Imports nothing of kvfs but itself: every layer above may use it. Never imports torch.
"""

from . import files, formats, names, tokens
from .backend import Changes, ColdBackend, ColdState, Hold, Written
from .commit import RoundWrite, commit, cut_history, fork
from .errors import SessionCorrupt, SessionError

__all__ = ["Changes", "ColdBackend", "ColdState", "Hold", "RoundWrite", "SessionCorrupt",
           "SessionError", "Written", "commit", "cut_history", "files", "fork", "formats", "names",
           "tokens"]
