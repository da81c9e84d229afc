#!/usr/bin/env python3
"""Mount a kvfs volume as a filesystem.

    python mount.py VOLUME MOUNTPOINT [--size SIZE] [--profile gov|ecommerce|iot]
                    [--foreground] [--config FILE] [-o key=value ...] [--allow-other]
                    [--metrics-port N] [--metrics-addr ADDR] [--log FILE] [--debug]
                    [--page-cache] [--force] [--shared redis[s]://[USER@]HOST:PORT[,...]]
                    [--shared-optional] [--node-id ID]

The story, in order: parse the arguments, set up logging, load the profile, check the
paths, daemonize (the parent waits on a pipe and exits 0 only once the mount is live),
connect to the shared tier (``--shared``, ``shared_setup``), open or create the volume, mount
it, then run the FUSE loop with a periodic checkpoint
and the alert rules beside it until SIGINT/SIGTERM or ``umount``. On the way out, clean
or not, the same steps run: unmount, flush buffered writes, close the store (flush,
checkpoint, clean flag). Exit 0 after a clean unmount; a refusal is one line on stderr
and a non-zero exit, with nothing mounted.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import gc
import logging
import os
import re
import signal
import sys
from typing import Any

import pyfuse3
import trio

from kvfs.engine import errors
from kvfs.engine.store import Store
from kvfs.fuse.buffers import default_max_pending
from kvfs.fuse.channel import ChannelServer
from kvfs.fuse.errnos import Refused
from kvfs.fuse.files import refresh_cold_gauges
from kvfs.fuse.ops import Operations
from kvfs.fuse.shared_setup import hide_credentials, open_shared, published_profile
from kvfs.ops import alerts, metrics, profiles, units

log = logging.getLogger("kvfs.mount")

PROG = "kvfs mount"
CHECKPOINT_TICK_S = 5.0  # how often the store is asked whether a checkpoint is due
READ_AHEAD_KB = 4096  # kernel readahead of the mount with --page-cache (default 128 KiB)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mount.py", description="Mount a kvfs volume.")
    p.add_argument("volume", help="volume file or block device")
    p.add_argument("mountpoint", help="an existing directory")
    p.add_argument("--size", help="create VOLUME of this size when missing (e.g. 512M, 1.2T)")
    p.add_argument("--sparse", action="store_true",
                   help="with --size: create VOLUME without writing zeros over it first (quick "
                        "to create; until the ring's first lap ends, each fsync also commits "
                        "the filesystem's record of the space it wrote)")
    p.add_argument("--profile", default="gov", help="gov (default), ecommerce or iot")
    p.add_argument("--config", help="a .toml or .json file of profile overrides")
    p.add_argument("-o", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one profile value (repeatable)")
    p.add_argument("--foreground", action="store_true", help="do not daemonize")
    p.add_argument("--allow-other", action="store_true",
                   help="let other users reach the mount (permissions still apply)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics over HTTP on port N")
    p.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR",
                   help="address the metrics port listens on (default 127.0.0.1; 0.0.0.0 or :: "
                        "for every interface)")
    p.add_argument("--log", help="log to this file (default: stderr)")
    p.add_argument("--debug", action="store_true", help="log every detail")
    p.add_argument("--force", action="store_true",
                   help="mount a volume marked as needing fsck (the mark stays until kvfs-fsck --repair)")
    p.add_argument("--page-cache", action="store_true",
                   help="serve file data through the page cache instead of direct I/O")
    p.add_argument("--offload-reads", action="store_true",
                   help="run engine reads on the engine threads, not on the FUSE loop (for "
                        "many concurrent readers of a slow disk on a machine with spare cores)")
    p.add_argument("--offload-syncs", action="store_true",
                   help="run every fsync on the engine threads, small ones too (the FUSE loop "
                        "never waits for a device flush)")
    p.add_argument("--read-ahead-kb", type=int, default=READ_AHEAD_KB, metavar="KB",
                   help=f"with --page-cache: the kernel's readahead of the mount (default "
                        f"{READ_AHEAD_KB}; docs/mount.md has the measurements)")
    p.add_argument("--no-channel", action="store_true",
                   help="do not serve the native channel (kvfs's own clients then use the "
                        "files, like any program)")
    p.add_argument("--write-buffer-max", type=units.parse_size, metavar="SIZE",
                   help="bound on the mount's unflushed written bytes (default: 256M, at "
                        "most 1/8 of RAM)")
    p.add_argument("--shared", metavar="redis://HOST:PORT[,HOST:PORT...]",
                   help="replicate sessions to this Redis Cluster and read other nodes' "
                        "sessions through from it (also -o shared=...)")
    p.add_argument("--shared-optional", action="store_true",
                   help="if the cluster is unreachable at mount, run local-only with a "
                        "warning instead of refusing")
    p.add_argument("--node-id", help="this mount's name in the cluster's leases (also -o "
                   "shared_node_id=...; default: the host name and a hash of the volume's path)")
    args = p.parse_args(argv)
    # the daemon changes directory to /, so every path is made absolute now
    args.volume = os.path.abspath(args.volume)
    args.mountpoint = os.path.abspath(args.mountpoint)
    return args


def setup_logging(args: argparse.Namespace) -> None:
    handler: logging.Handler
    if args.log:  # created 0600: log lines name sessions and files
        os.close(os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600))
        handler = logging.FileHandler(args.log)
        level = logging.INFO
    else:
        handler = logging.StreamHandler(sys.stderr)
        level = logging.WARNING  # stderr stays quiet: a refusal is exactly one line
    handler.setFormatter(logging.Formatter(
        "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if args.debug else level)


def load_profile(args: argparse.Namespace) -> tuple[profiles.Profile, int | None]:
    try:
        overrides = profiles.parse_overrides(args.overrides)
        profiles.check_mount_keys(overrides, args.config)
        profile = profiles.load(args.profile, overrides,
                                args.config)
        size = units.parse_size(args.size) if args.size is not None else None
    except profiles.ProfileError as e:
        raise Refused(errno.EINVAL, str(e)) from None
    except ValueError as e:
        raise Refused(errno.EINVAL, f"--size: {e}") from None
    return profile, size


def check_paths(args: argparse.Namespace, size: int | None) -> None:
    if not os.path.isdir(args.mountpoint):
        raise Refused(errno.ENOTDIR, f"mountpoint {args.mountpoint} does not exist or is not a directory")
    if not os.path.exists(args.volume) and size is None:
        raise Refused(errno.ENOENT, f"volume {args.volume} does not exist; give --size to create it")


def daemonize() -> int:
    """Fork; the parent exits 0 once the child reports the mount live, else 1 with its
    reason. Returns, in the child, the pipe end to report on (see ``report``)."""
    r, w = os.pipe()
    if os.fork():
        os.close(w)
        with os.fdopen(r, "rb") as pipe:
            msg = pipe.read().decode(errors="replace").strip()
        if msg == "OK":
            os._exit(0)
        print(f"{PROG}: {msg or 'the mount process died before the mount was live'}",
              file=sys.stderr)
        os._exit(1)
    os.close(r)
    os.setsid()
    os.chdir("/")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.close(devnull)
    return w


def report(pipe: int | None, message: str) -> None:
    """Tell the waiting parent "OK" or why not, then detach from its stdout/stderr."""
    if pipe is None:
        return
    os.write(pipe, message.encode() + b"\n")
    os.close(pipe)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)


def fill_bar() -> Any:
    """A progress bar on the terminal for a volume filled with zeros (minutes for a large
    one); None when stderr is not a terminal (a log, a pipe, the daemon after start-up)."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    try:  # a terminal that does not say its size (0 x 0) still gets a bar
        size = os.get_terminal_size(sys.stderr.fileno())
        cols, rows = size.columns or 80, size.lines or 24
    except OSError:
        cols, rows = 80, 24
    return tqdm(desc="creating volume", unit="B", unit_scale=True, unit_divisor=1024,
                file=sys.stderr, ncols=cols, nrows=rows)


def open_store(args: argparse.Namespace, size: int | None, profile: profiles.Profile) -> Store:
    # other users reach an --allow-other mount: "auto" quotas apply there
    config = profile.store_config(shared=args.allow_other)
    observer = metrics.EngineObserver()
    try:
        if os.path.exists(args.volume):
            store = Store.open(args.volume, config, observer=observer, force=args.force)
            if store.needs_fsck:
                log.warning("%s needs fsck; mounted anyway (--force)", args.volume)
            return store
        assert size is not None
        log.info("creating volume %s of %d bytes%s", args.volume, size,
                 "" if args.sparse else ", filled with zeros (--sparse skips it)")
        bar = None if args.sparse else fill_bar()

        def progress(done: int, total: int) -> None:
            assert bar is not None
            bar.total = total
            bar.update(done - bar.n)

        try:
            return Store.create(args.volume, size, config, observer=observer,
                                fill=not args.sparse, progress=None if bar is None else progress)
        finally:
            if bar is not None:
                bar.close()
    except errors.NeedsFsck:
        raise Refused(errno.EUCLEAN, f"{args.volume} needs fsck (an error was seen while it was mounted): "
                      f"run kvfs-fsck {args.volume}, or mount with --force") from None
    except errors.VolumeBusy:
        raise Refused(errno.EBUSY, f"volume {args.volume} is already mounted (locked by another process)") from None
    except errors.FormatError as e:
        raise Refused(errno.EINVAL, f"{args.volume} is not a usable kvfs volume: {e}") from None
    except OSError as e:
        raise Refused(e.errno or errno.EIO, f"cannot open volume {args.volume}: {e.strerror or e}") from None


def bind_metrics(args: argparse.Namespace) -> Any:
    """The metrics port, bound but not serving yet (None without ``--metrics-port``);
    ``Refused`` when it cannot be bound."""
    if not args.metrics_port:
        return None
    try:
        return metrics.serve(args.metrics_port, args.metrics_addr, start=False)
    except OSError as e:
        raise Refused(e.errno or errno.EADDRINUSE, f"--metrics-addr {args.metrics_addr} --metrics-port {args.metrics_port}: "
                      f"{e.strerror or e}") from None


def fuse_options(args: argparse.Namespace) -> set[str]:
    options = {"fsname=kvfs", "subtype=kvfs", "default_permissions"}
    if args.allow_other:
        options.add("allow_other")
    return options


async def checkpointer(ops: Operations, store: Store) -> None:
    """Ask the store every few seconds whether a checkpoint is due; refresh the gauges."""
    while True:
        await trio.sleep(CHECKPOINT_TICK_S)
        try:
            await ops.call(store.maybe_checkpoint)
            refresh_cold_gauges(await ops.call(store.usage, changes=False))
            ops.shared.refresh_metrics()
        except Exception:
            log.exception("periodic checkpoint failed")


async def alert_loop(engine: alerts.AlertEngine, interval_s: float) -> None:
    sampler = alerts.MetricsSampler()
    while True:
        await trio.sleep(interval_s)
        try:
            engine.tick(sampler())
        except Exception:
            log.exception("alert evaluation failed")


async def unmount_on_signal() -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("%s received: unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()
            return


async def tune_readahead(mountpoint: str, kb: int = READ_AHEAD_KB) -> None:
    """Raise the kernel's readahead of this mount (its bdi), so page-cache reads reach the
    mount as 1 MiB requests, several in flight, not 128 KiB ones. Needs root; without it
    the kernel default stays (logged).

    Only once the kernel's INIT is answered (its reply sets the readahead to the 128 KiB
    the kernel offered): a stat of the mountpoint returns only then, and is answered by
    this loop, so it runs on a thread."""
    await trio.to_thread.run_sync(os.stat, mountpoint)
    try:
        with open("/proc/self/mountinfo") as f:  # the last entry there: stacked mounts
            dev = [line.split()[2] for line in f if _unescape(line.split()[4]) == mountpoint][-1]
        with open(f"/sys/class/bdi/{dev}/read_ahead_kb", "w") as f:
            f.write(f"{kb}\n")
        log.info("readahead of %s set to %d KiB", mountpoint, kb)
    except (OSError, IndexError) as e:
        log.info("readahead of %s left at the kernel default: %r", mountpoint, e)


def _unescape(field: str) -> str:
    """A mountinfo path: space, tab, newline and backslash are written as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


async def serve(ops: Operations, store: Store, profile: profiles.Profile,
                alert_engine: alerts.AlertEngine | None, mountpoint: str | None = None,
                read_ahead_kb: int = READ_AHEAD_KB) -> None:
    """The FUSE loop and its companions; returns after ``umount`` or a signal."""
    # what start-up built (the index, modules) is never garbage: keep the collector's full
    # passes, which would stall requests, from walking it again and again
    gc.collect()
    gc.freeze()
    if ops.channel is not None:  # its clients' threads call back into this loop
        ops.channel.start(trio.lowlevel.current_trio_token())
    async with trio.open_nursery() as nursery:
        ops.reader.nursery = nursery
        nursery.start_soon(unmount_on_signal)
        nursery.start_soon(checkpointer, ops, store)
        if mountpoint is not None and not ops.direct_io:
            nursery.start_soon(tune_readahead, mountpoint, read_ahead_kb)
        if alert_engine is not None:
            nursery.start_soon(alert_loop, alert_engine, profile.alert_interval_s)
        try:
            await pyfuse3.main()
        except* ConnectionAbortedError as eg:
            # the kernel ended the connection (an abort, or seen once at the end of an
            # unmount after heavy load): nothing more can be answered, the volume is
            # still closed the usual way
            log.warning("the kernel aborted the FUSE connection (%s); closing the volume",
                        eg.exceptions[0])
        ops.reader.nursery = None
        nursery.cancel_scope.cancel()
    if ops.channel is not None:
        await trio.to_thread.run_sync(ops.channel.close)
    await ops.buffers.flush_all()
    await ops.shared.close()  # pushes what is queued (bounded), hands the leases back
    ops.worker.close()
    if ops.pages is not None:
        ops.pages.close()


def main(argv: list[str] | None = None) -> int:
    hide_credentials(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    setup_logging(args)
    pipe: int | None = None
    try:
        profile, size = load_profile(args)
        check_paths(args, size)
        if not args.foreground:
            pipe = daemonize()
        server = bind_metrics(args)  # before the volume: a busy port must not create it
        tier = open_shared(args, profile)
        try:
            store = open_store(args, size, profile)
        except Refused:
            if tier is not None:
                tier.close()
            if server is not None:
                server.close()
            raise
    except Refused as e:
        return refuse(args, pipe, str(e))

    with contextlib.ExitStack() as stack:
        stack.callback(close_store, store)  # runs last: flush, checkpoint, clean flag
        alert_engine = alerts.for_profile(profile)
        ops = Operations(store, direct_io=not args.page_cache, allow_other=args.allow_other,
                         max_pending=args.write_buffer_max or default_max_pending(),
                         alerts_state=alert_engine.state if alert_engine else None,
                         profile=published_profile(profile), inline_reads=not args.offload_reads,
                         inline_syncs=not args.offload_syncs)
        if tier is not None:
            from kvfs.fuse.remote import Remote

            ops.use_shared(Remote(tier, store, ops.call, ops.worker.engine_lock,
                                  profile.shared_queue_bytes, profile.shared_fsync_wait_s,
                                  ops.buffers.entry_max))
        elif not args.no_channel:  # a shared mount's clients use the files (channel.py)
            ops.channel = ChannelServer(ops, store, args.volume, allow_other=args.allow_other,
                                        idle_s=profile.channel_idle_s)
            try:  # before the kernel mount: one that cannot serve its clients is refused
                ops.channel.bind()
            except OSError as e:
                return refuse(args, pipe, e.strerror or str(e))
        if server is not None:
            metrics.on_scrape(ops.refresh_gauges)  # agents that exited drop out of a scrape
            stack.callback(server.close)
            server.start()
        try:
            pyfuse3.init(ops, args.mountpoint, fuse_options(args))
        except RuntimeError as e:
            return refuse(args, pipe, f"cannot mount on {args.mountpoint}: {e}")
        stack.callback(pyfuse3.close, unmount=True)  # runs first, also after a crash
        ops.notify_kernel = True
        log.info("mounted %s on %s (profile %s)", args.volume, args.mountpoint, profile.name)
        report(pipe, "OK")
        try:
            trio.run(serve, ops, store, profile, alert_engine, args.mountpoint, args.read_ahead_kb)
        except Exception:  # a bug: still unmount and close the volume on the way out
            log.exception("the mount loop failed; unmounting")
            return 1
    log.info("unmounted %s cleanly", args.mountpoint)
    return 0


def close_store(store: Store) -> None:
    try:
        store.close()
    except Exception:
        log.exception("closing the volume failed; run kvfs-fsck %s", store.vol.path)
        raise
    log.info("volume closed cleanly")


def refuse(args: argparse.Namespace, pipe: int | None, reason: str) -> int:
    if args.log:
        log.error("refusing to mount: %s", reason)
    if pipe is not None:
        report(pipe, reason)
    else:
        print(f"{PROG}: {reason}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
