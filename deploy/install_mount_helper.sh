#!/bin/bash
# Install the kvfs mount(8) helper: /sbin/mount.fuse.kvfs -> deploy/mount.fuse.kvfs
# (mount -t fuse.kvfs looks for /sbin/mount.fuse.kvfs). Needs root.
#   deploy/install_mount_helper.sh              install (refuses to replace another helper)
#   deploy/install_mount_helper.sh --force      install, replacing whatever is there
#   deploy/install_mount_helper.sh --uninstall  remove it (only if it points here)
# SBIN=/other/dir overrides the target directory.
set -euo pipefail
src=$(readlink -f -- "$(dirname -- "$0")/mount.fuse.kvfs")
dest=${SBIN:-/sbin}/mount.fuse.kvfs
chmod +x "$src"
case "${1:-}" in
  --uninstall)
    if [ -L "$dest" ] && [ "$(readlink -f -- "$dest")" = "$src" ]; then
      rm -f -- "$dest" && echo "removed $dest"
    elif [ -e "$dest" ] || [ -L "$dest" ]; then
      echo "install_mount_helper: $dest is not ours (-> $(readlink -f -- "$dest")); left alone" >&2
      exit 1
    fi ;;
  ""|--force)
    if [ "${1:-}" != --force ] && { [ -e "$dest" ] || [ -L "$dest" ]; } \
        && [ "$(readlink -f -- "$dest")" != "$src" ]; then
      echo "install_mount_helper: $dest exists (-> $(readlink -f -- "$dest")); use --force to replace it" >&2
      exit 1
    fi
    ln -sfn -- "$src" "$dest"
    echo "installed $dest -> $src" ;;
  *) echo "usage: $0 [--force|--uninstall]" >&2; exit 2 ;;
esac
