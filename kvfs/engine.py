"""The storage engine's public face: ``Store``.

Owns one volume: sessions (directories) holding files (``layer_<n>``, ``meta.json``...).
Never imports pyfuse3 or torch. Not thread-safe: callers serialise (the FUSE layer runs
it on one worker thread at a time; tools call it directly).

Contract (the FUSE layer, tools and tests rely on it):
  Store.create(path, size, config=None) -> Store     # FormatError if too small / exists as other
  Store.open(path, config=None, clock=time.time) -> Store   # FormatError / VolumeBusy
  close()                                  # flush, checkpoint, clean flag, release lock
  list_sessions() -> list[str]             # sorted names
  create_session(name, mode=0o700, uid=0, gid=0)      # Exists / BadName / NameTooLong
  delete_session(name)                     # whole session, durable after sync()
  session_stat(name) -> SessionStat        # NotFound
  set_session_attrs(name, mode=None, uid=None, gid=None, atime=None, mtime=None)
  list_files(session) -> list[str]
  create_file(session, name, mode=0o600, uid=0, gid=0)  # Exists / BadName / NotFound
  delete_file(session, name)
  file_stat(session, name) -> FileStat
  set_file_attrs(session, name, mode=None, uid=None, gid=None, atime=None, mtime=None)
  append(session, name, offset, data)      # offset must equal size else NotAppend
  read(session, name, offset, length) -> bytes   # short at EOF; Corrupt on checksum failure
  truncate(session, name, length)          # shorter or equal only, else BadRange
  flush()                                  # write buffered entries to the volume (no fsync)
  sync()                                   # flush + fsync: durability point
  checkpoint()                             # write the B+ tree checkpoint + superblock
  maybe_checkpoint()                       # checkpoint if interval elapsed or replay is long
  cleanup() -> int                         # drop sessions idle > retention; returns count
  usage() -> Usage
  stats() -> dict                          # JSON-able counters for /.kvfs/stats
"""

from __future__ import annotations
