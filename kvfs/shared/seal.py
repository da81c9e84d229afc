"""Proof that a value in the cluster was written by a kvfs node holding the cluster's secret.

Anyone who can reach Redis can write to it, so nothing kvfs reads back from the cluster is
taken on trust. Every value it stores -- chunk pieces, meta.json, a session's owner record,
a lease -- is sealed with keys derived from one per-cluster secret (a file of at least 32
random bytes, mode 0600, the same on every node; ``read_secret``):

- **MAC** (default): keyed BLAKE2b-128 over the value's *place* (session and file name),
  its header (which holds the file offset and length) and its bytes. A value made up by
  someone without the secret, or moved from another session, file or offset, fails its
  check: the read is EIO (``ChunkError`` -> ``SharedCorrupt``), never KV.
- **AEAD** (``encrypt=True``): ChaCha20-Poly1305 with a random 96-bit nonce per value and the
  same place and header as associated data, so a Redis operator reads no conversation.

A MAC proves who wrote a value for a place, not that it is the newest one: a Redis writer
who kept an older value of a chunk can put it back after the file was cut and written again
(a replay). Redis ACLs that let only kvfs nodes write close that; docs/scale-out.md says so.

Leases are strings the Lua scripts compare byte for byte, so their seal is deterministic:
``<node>|<lease ms>|<MAC of session, node and lease ms>``. A lease that does not verify, or
whose time to live exceeds the lease time it names, was not set by a node: the tier reports
it and replaces it (``tier.SharedTier.acquire``) instead of obeying it for as long as its
forger asked.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

MIN_SECRET = 32
MAX_SECRET_FILE = 4096
TAG = 16
NONCE = 12
_PERSON = b"kvfs-shared-v2"


class SealError(Exception):
    """A sealed value does not verify (reason in the message)."""


def read_secret(path: str) -> bytes:
    """The cluster secret from ``path``: a regular file of 32..4096 bytes, owned by this
    user (or root) and readable by nobody else. ``ValueError`` says what is wrong."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"shared secret file {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"shared secret file {path} is not a regular file")
        if st.st_uid not in (0, os.geteuid()):
            raise ValueError(f"shared secret file {path} is owned by uid {st.st_uid}")
        if st.st_mode & 0o077:
            raise ValueError(f"shared secret file {path} has mode "
                             f"{stat.S_IMODE(st.st_mode):04o}: make it 0600")
        data = os.read(fd, MAX_SECRET_FILE + 1)
    finally:
        os.close(fd)
    secret = data.strip()
    if len(secret) < MIN_SECRET or len(data) > MAX_SECRET_FILE:
        raise ValueError(f"shared secret file {path} holds {len(secret)} bytes; want "
                         f"{MIN_SECRET}..{MAX_SECRET_FILE} random bytes (e.g. "
                         f"head -c 48 /dev/urandom | base64 > {path})")
    return secret


def _derive(secret: bytes, label: bytes) -> bytes:
    root = hashlib.blake2b(secret, digest_size=64, person=_PERSON).digest()
    return hashlib.blake2b(label, key=root, digest_size=32, person=_PERSON).digest()


def _place(session: str, file: str) -> bytes:
    s, f = session.encode(), file.encode()
    return len(s).to_bytes(2, "little") + s + len(f).to_bytes(2, "little") + f


@dataclass(frozen=True)
class Sealer:
    """Seals and opens values for one cluster secret (see the module docstring)."""

    mac_key: bytes
    aead: ChaCha20Poly1305 | None

    @classmethod
    def from_secret(cls, secret: bytes, encrypt: bool = False) -> Sealer:
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET:
            raise ValueError(f"the cluster secret must be at least {MIN_SECRET} bytes")
        aead = ChaCha20Poly1305(_derive(secret, b"aead")) if encrypt else None
        return cls(_derive(secret, b"mac"), aead)

    @property
    def encrypted(self) -> bool:
        return self.aead is not None

    @property
    def overhead(self) -> int:
        """Bytes a sealed value adds to its payload, its header aside."""
        return TAG + (NONCE if self.aead is not None else 0)

    def _mac(self, place: bytes, head: bytes, payload: bytes | memoryview) -> bytes:
        h = hashlib.blake2b(key=self.mac_key, digest_size=TAG, person=_PERSON)
        h.update(place)
        h.update(head)
        h.update(payload)
        return h.digest()

    def seal(self, session: str, file: str, head: bytes, payload: bytes | memoryview) -> bytes:
        """The sealed body that follows ``head``: MAC + payload, or nonce + ciphertext + tag."""
        place = _place(session, file)
        if self.aead is None:
            return self._mac(place, head, payload) + bytes(payload)
        nonce = os.urandom(NONCE)
        return nonce + self.aead.encrypt(nonce, bytes(payload), place + head)

    def open(self, session: str, file: str, head: bytes, body: memoryview) -> bytes:
        """The payload of a sealed ``body`` (``SealError`` if it does not verify)."""
        place = _place(session, file)
        if self.aead is None:
            if len(body) < TAG:
                raise SealError("value shorter than its MAC")
            payload = body[TAG:]
            if not hmac.compare_digest(self._mac(place, head, payload), body[:TAG]):
                raise SealError("MAC mismatch (not written by a node of this cluster, or "
                                "moved from another place)")
            return bytes(payload)
        if len(body) < NONCE + TAG:
            raise SealError("value shorter than its nonce and tag")
        try:
            return self.aead.decrypt(bytes(body[:NONCE]), bytes(body[NONCE:]), place + head)
        except InvalidTag:
            raise SealError("authentication tag mismatch (not written by a node of this "
                            "cluster, moved from another place, or encrypted with another "
                            "secret)") from None

    # -- leases --------------------------------------------------------------------------
    def lease(self, session: str, node: str, lease_ms: int) -> str:
        """The lease value of ``node`` for ``session``."""
        mac = self._mac(_place(session, "\0lease"), f"{node}|{lease_ms}".encode(), b"")
        return f"{node}|{lease_ms}|{mac.hex()}"

    def check_lease(self, session: str, value: str | bytes) -> tuple[str, int]:
        """(node, lease ms) of a lease value; ``SealError`` if it was not sealed here."""
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        node, sep, rest = text.partition("|")
        ms, sep2, _ = rest.partition("|")
        if not (sep and sep2 and ms.isdigit()):
            raise SealError(f"lease value {text[:80]!r} is not a kvfs lease")
        if not hmac.compare_digest(self.lease(session, node, int(ms)), text):
            raise SealError(f"lease of node {node[:80]!r} does not verify")
        return node, int(ms)
