"""The metrics port: Prometheus text over HTTP, with bounds a flood cannot pass.

One thread runs one ``selectors`` loop over the listening socket and at most ``max_conns``
connections, whatever arrives: no thread per connection, no work queued behind a slow
client. A connection must send its whole request (at most ``max_request`` bytes) and take
the whole answer within ``timeout_s`` of being accepted, else it is closed; at the cap the
held connections are read first (closed ones leave, complete requests are answered) and
then the oldest connection still sending its request is closed to make room, so idle
connections cost whoever opened them, and a scraper still gets through a flood. The body is
made at most once per ``cache_s`` (scrapes in between get the same bytes), so scrapes never
add up to work for the process that serves them (in the mount: the FUSE loop's GIL).

    srv = MetricsServer("127.0.0.1", 9108, metrics.text)   # binds now: OSError if it cannot
    srv.start(); ...; srv.close()

Answers ``GET /metrics`` (and ``GET /``) with ``200``, other paths ``404``, other methods
``405``, an oversized request ``431``; every answer closes the connection.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("kvfs.metrics")

MAX_CONNS = 64
TIMEOUT_S = 5.0
MAX_REQUEST = 8192
CACHE_S = 1.0
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


@dataclass
class _Conn:
    sock: socket.socket
    deadline: float
    inbuf: bytearray = field(default_factory=bytearray)
    out: memoryview | None = None  # the answer, once the request is complete


def _answer(status: str, body: bytes, ctype: bytes = b"text/plain; charset=utf-8") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
            .encode() + b"Content-Type: " + ctype + b"\r\n\r\n" + body)


class MetricsServer:
    """Serves ``body()`` on ``addr:port`` from one thread (see the module docstring)."""

    def __init__(self, addr: str, port: int, body: Callable[[], bytes], *,
                 max_conns: int = MAX_CONNS, timeout_s: float = TIMEOUT_S,
                 max_request: int = MAX_REQUEST, cache_s: float = CACHE_S) -> None:
        self.body, self.max_conns, self.timeout_s = body, max_conns, timeout_s
        self.max_request, self.cache_s = max_request, cache_s
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]
        self._lsock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._lsock.bind(sockaddr)
            self._lsock.listen(128)
            self._lsock.setblocking(False)
        except BaseException:
            self._lsock.close()
            raise
        self.port = self._lsock.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._conns: OrderedDict[int, _Conn] = OrderedDict()  # oldest first
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stop = False
        self._thread: threading.Thread | None = None
        self._cached: tuple[float, bytes] | None = None
        self.stats = {"accepted": 0, "answered": 0, "timed_out": 0, "evicted": 0, "refused": 0}

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> MetricsServer:
        self._sel.register(self._lsock, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._loop, name="kvfs-metrics", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop = True
        if self._thread is not None:
            self._wake_w.send(b"x")
            self._thread.join(timeout=5)
            self._thread = None
        for c in list(self._conns.values()):
            self._drop(c)
        for s in (self._lsock, self._wake_r, self._wake_w):
            s.close()
        self._sel.close()

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        while not self._stop:
            now = time.monotonic()
            wait = min((c.deadline for c in self._conns.values()), default=now + 1.0) - now
            for key, ev in self._sel.select(timeout=max(0.0, min(wait, 1.0))):
                try:
                    if key.fileobj is self._lsock:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._wake_r.recv(64)
                    elif ev & selectors.EVENT_READ:
                        self._read(key.data)
                    else:
                        self._write(key.data)
                except Exception:  # noqa: BLE001 - one bad connection never stops the port
                    log.exception("metrics port: a connection failed")
                    if key.data is not None:
                        self._drop(key.data)
            now = time.monotonic()
            while self._conns:
                c = next(iter(self._conns.values()))
                if c.deadline > now:
                    break
                self.stats["timed_out"] += 1
                self._drop(c)

    def _accept(self) -> None:
        for _ in range(self.max_conns):  # a bounded batch: the loop also serves the others
            try:
                sock, _ = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and the like: the flooder's problem, not ours
                log.warning("metrics port: accept failed: %s", e)
                return
            self.stats["accepted"] += 1
            if len(self._conns) >= self.max_conns:
                self._reap()
            if len(self._conns) >= self.max_conns and not self._evict():
                self.stats["refused"] += 1
                sock.close()
                continue
            sock.setblocking(False)
            c = _Conn(sock, time.monotonic() + self.timeout_s)
            self._conns[sock.fileno()] = c
            self._sel.register(sock, selectors.EVENT_READ, c)

    def _reap(self) -> None:
        """At the cap: read what the held connections sent meanwhile, so those that closed
        are dropped and those whose request is complete are answered before any is
        evicted (a scraper is never taken for a flooder because the loop was busy)."""
        for c in list(self._conns.values()):
            if c.out is None and c.sock.fileno() >= 0:
                self._read(c)

    def _evict(self) -> bool:
        """Close the oldest connection still sending its request; False if none is."""
        for c in self._conns.values():
            if c.out is None:
                self.stats["evicted"] += 1
                self._drop(c)
                return True
        return False

    def _read(self, c: _Conn) -> None:
        try:
            data = c.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(c)
            return
        c.inbuf += data
        end = c.inbuf.find(b"\r\n\r\n")
        if end < 0:
            if len(c.inbuf) > self.max_request:
                self._reply(c, _answer("431 Request Header Fields Too Large", b"too large\n"))
            return
        line = bytes(c.inbuf[:c.inbuf.find(b"\r\n")]).split()
        method, path = (line + [b"", b""])[:2]
        if method not in (b"GET", b"HEAD"):
            self._reply(c, _answer("405 Method Not Allowed", b"GET only\n"))
        elif path.split(b"?")[0] not in (b"/", b"/metrics"):
            self._reply(c, _answer("404 Not Found", b"try /metrics\n"))
        else:
            try:
                body = self._body()
            except Exception:  # noqa: BLE001 - the port answers, the log says why
                log.exception("metrics port: making the body failed")
                self._reply(c, _answer("500 Internal Server Error", b"see the log\n"))
                return
            ans = _answer("200 OK", body, CONTENT_TYPE)
            if method == b"HEAD":
                ans = ans[:ans.index(b"\r\n\r\n") + 4]
            self._reply(c, ans)

    def _body(self) -> bytes:
        now = time.monotonic()
        if self._cached is None or now - self._cached[0] >= self.cache_s:
            self._cached = (now, self.body())
        return self._cached[1]

    def _reply(self, c: _Conn, data: bytes) -> None:
        c.out = memoryview(data)
        self._sel.modify(c.sock, selectors.EVENT_WRITE, c)
        self._write(c)

    def _write(self, c: _Conn) -> None:
        assert c.out is not None
        try:
            n = c.sock.send(c.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(c)
            return
        c.out = c.out[n:]
        if not c.out:
            self.stats["answered"] += 1
            self._drop(c)

    def _drop(self, c: _Conn) -> None:
        fd = c.sock.fileno()
        if fd >= 0:
            self._conns.pop(fd, None)
            try:
                self._sel.unregister(c.sock)
            except (KeyError, ValueError):
                pass
        c.sock.close()
