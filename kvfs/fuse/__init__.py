"""kvfs.fuse: KVFS, the filesystem over the storage engine (pyfuse3 + trio).

``ops.Operations`` holds the handlers: each validates, delegates to the engine on a worker
thread and translates errors (``errnos``); ``nodes`` owns inode numbers and names,
``files`` the per-handle write buffers and the generated ``/.kvfs`` files, ``mount`` the
``kvfs-mount`` command. Nothing here knows the on-disk format.
"""
