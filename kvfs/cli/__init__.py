"""kvfs.cli: the console scripts. Each module has a ``main(argv=None) -> int``:
``kvfs-mount``, ``kvfs-fsck``, ``kvfs-dump``, ``kvfs-stat``, ``kvfs-doctor``."""
