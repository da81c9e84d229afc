"""``kvfs-mount VOLUME MOUNTPOINT [options]``: see :mod:`kvfs.fuse.mount`."""

import sys

from kvfs.fuse.mount import main

if __name__ == "__main__":
    sys.exit(main())
