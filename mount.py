#!/usr/bin/env python3
"""``python mount.py VOLUME MOUNTPOINT [options]``: the same command as ``kvfs-mount``."""

import sys

from kvfs.fuse.mount import main

if __name__ == "__main__":
    sys.exit(main())
