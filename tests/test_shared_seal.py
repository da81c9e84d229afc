"""The shared tier's sealed values without a cluster: chunk pieces, meta, owner records and
lease values, MAC'd and encrypted; every flipped bit, every cut, every value moved to another
place or sealed with another secret is refused; the secret file and the cluster URL are
checked and the password never echoed."""

from __future__ import annotations

import os
import struct

import pytest

from kvfs.shared.chunks import HEADER_SIZE, ChunkError, Codec, Owner
from kvfs.shared.client import parse_urls
from kvfs.shared.seal import Sealer, SealError, read_secret

SECRET = b"unit test cluster secret of 32+ bytes"


@pytest.fixture(params=[False, True], ids=["mac", "aead"])
def codec(request: pytest.FixtureRequest) -> Codec:
    return Codec(Sealer.from_secret(SECRET, encrypt=request.param))


def two_pieces(codec: Codec) -> tuple[bytes, bytes]:
    data = os.urandom(300)
    value = (codec.encode_piece("s", "layer_0", 4096, data[:100])
             + codec.encode_piece("s", "layer_0", 4196, data[100:]))
    return value, data


def test_round_trip(codec: Codec) -> None:
    value, data = two_pieces(codec)
    assert codec.decode_pieces("s", "layer_0", value, 4096) == (data, 2)
    assert len(value) == 2 * codec.overhead + len(data)
    meta = codec.encode_meta("s", b'{"tokens": 3}')
    assert codec.decode_meta("s", meta) == b'{"tokens": 3}'
    rec = codec.encode_owner("s", Owner(1000, 100, 0o700))
    assert codec.decode_owner("s", rec) == Owner(1000, 100, 0o700)


def test_every_flipped_bit_is_caught(codec: Codec) -> None:
    value, _ = two_pieces(codec)
    for i in range(len(value)):
        for bit in (0, 5):
            bad = bytearray(value)
            bad[i] ^= 1 << bit
            with pytest.raises(ChunkError):
                codec.decode_pieces("s", "layer_0", bytes(bad), 4096)


def test_every_cut_is_caught(codec: Codec) -> None:
    value, data = two_pieces(codec)
    first = codec.overhead + 100
    for n in range(1, len(value)):
        cut = value[:n]
        if n == first:  # a cut between two pieces leaves a whole, shorter chunk
            assert codec.decode_pieces("s", "layer_0", cut, 4096) == (data[:100], 1)
            continue
        with pytest.raises(ChunkError):
            codec.decode_pieces("s", "layer_0", cut, 4096)


def test_a_piece_moved_elsewhere_is_caught(codec: Codec) -> None:
    piece = codec.encode_piece("s", "layer_0", 0, b"kv bytes")
    for session, file in (("t", "layer_0"), ("s", "layer_1"), ("s", "meta.json")):
        with pytest.raises(ChunkError):
            codec.decode_pieces(session, file, piece, 0)
    with pytest.raises(ChunkError, match="expected"):  # another offset: its header says where
        codec.decode_pieces("s", "layer_0", piece, 4096)
    meta = codec.encode_meta("s", b"{}")
    with pytest.raises(ChunkError):
        codec.decode_meta("t", meta)
    with pytest.raises(ChunkError):  # a meta is not an owner record
        codec.decode_owner("s", meta)


def test_other_secret_other_mode_old_format(codec: Codec) -> None:
    value, _ = two_pieces(codec)
    other = Codec(Sealer.from_secret(b"another cluster's secret, 32 bytes+", codec.sealer.encrypted))
    with pytest.raises(ChunkError):
        other.decode_pieces("s", "layer_0", value, 4096)
    flipped = Codec(Sealer.from_secret(SECRET, not codec.sealer.encrypted))
    with pytest.raises(ChunkError, match="encrypted"):
        flipped.decode_pieces("s", "layer_0", value, 4096)
    import crc32c  # the format before seals: a valid CRC32C is no longer enough

    head = struct.pack("<HHQI", 0x4B43, 1, 0, 5)
    v1 = head + struct.pack("<I", crc32c.crc32c(b"hello", crc32c.crc32c(head))) + b"hello"
    with pytest.raises(ChunkError, match="format"):
        codec.decode_pieces("s", "layer_0", v1, 0)


def test_aead_hides_the_bytes() -> None:
    c = Codec(Sealer.from_secret(SECRET, encrypt=True))
    data = b"the user's pass key is 48213. " * 20
    piece = c.encode_piece("s", "layer_0", 0, data)
    assert b"pass key" not in piece and data[:32] not in piece
    assert piece != c.encode_piece("s", "layer_0", 0, data)  # a fresh nonce each time
    assert c.decode_pieces("s", "layer_0", piece, 0)[0] == data
    assert len(piece) == HEADER_SIZE + c.sealer.overhead + len(data)


def test_owner_records_are_checked() -> None:
    c = Codec(Sealer.from_secret(SECRET))
    for body in (b"not json", b'{"uid": 1}', b'{"uid": -1, "gid": 0, "mode": 448}',
                 b'{"uid": 1, "gid": 1, "mode": 99999}'):
        with pytest.raises(ChunkError, match="owner"):
            c.decode_owner("s", c.encode_piece("s", "\0owner", 0, body))


def test_lease_values() -> None:
    s = Sealer.from_secret(SECRET)
    v = s.lease("sess", "node-a", 15000)
    assert v.startswith("node-a|15000|") and s.check_lease("sess", v) == ("node-a", 15000)
    assert s.check_lease("sess", v.encode()) == ("node-a", 15000)
    node, ms, mac = v.split("|")
    for bad in (f"node-b|{ms}|{mac}", f"{node}|99999|{mac}", f"{node}|{ms}|{'0' * 32}",
                "node-a", "", "a|b|c", v[:-1]):
        with pytest.raises(SealError):
            s.check_lease("sess", bad)
    with pytest.raises(SealError):
        s.check_lease("other-session", v)
    with pytest.raises(SealError):
        Sealer.from_secret(b"another cluster's secret, 32 bytes+").check_lease("sess", v)
    with pytest.raises(ValueError):
        Sealer.from_secret(b"too short")


def test_secret_file(tmp_path) -> None:
    good = tmp_path / "k"
    good.write_bytes(os.urandom(48))
    good.chmod(0o600)
    assert len(read_secret(str(good))) >= 32
    loose = tmp_path / "loose"
    loose.write_bytes(os.urandom(48))
    loose.chmod(0o640)
    short = tmp_path / "short"
    short.write_bytes(b"x" * 10)
    short.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(good)
    for path, why in ((loose, "0600"), (short, "want"), (link, "link"),
                      (tmp_path / "none", "No such file"), (tmp_path, "not a regular file")):
        with pytest.raises(ValueError, match=why):
            read_secret(str(path))


def test_cluster_urls() -> None:
    u = parse_urls("redis://kvfs:p%40ss:w0rd@10.0.0.1:7000,10.0.0.2:7001")
    assert (u.username, u.password, u.tls) == ("kvfs", "p@ss:w0rd", False)
    assert u.addresses == (("10.0.0.1", 7000), ("10.0.0.2", 7001))
    assert "p@ss" not in str(u) and "p@ss" not in repr(u) and ":***@" in u.redacted()
    assert parse_urls("redis://:pw@h:1").password == "pw"
    assert parse_urls("redis://user@h:1", password="from-file").password == "from-file"
    t = parse_urls("rediss://[::1]:7000,rediss://h:7001")
    assert t.tls and t.addresses == (("::1", 7000), ("h", 7001))
    assert parse_urls(["h:1", "redis://h2:2"]).addresses == (("h", 1), ("h2", 2))
    for bad in ("http://h:1", "redis://h", "redis://h:0", "redis://h:1,rediss://h:2",
                "redis://h:1,u:p@h:2", ""):
        with pytest.raises(ValueError):
            parse_urls(bad)
    with pytest.raises(ValueError) as e:
        parse_urls("redis://kvfs:s3cret@nohostport")
    assert "s3cret" not in str(e.value)
