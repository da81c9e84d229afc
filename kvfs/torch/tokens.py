"""The token ids of a stored session, as the hot tier records them (``KVRouter``).

The ``tokens`` file, its format and its checks are ``kvfs.session``'s (``session.tokens``
for the records, ``session.files`` for reading and recording them); this module only
gives the hot tier their names.
"""

from __future__ import annotations

from kvfs.session.files import read_ids, record_ids
from kvfs.session.tokens import common_prefix, decode, encode

__all__ = ["common_prefix", "decode", "encode", "read_ids", "record_ids"]
