"""A real local Redis Cluster for tests, benchmarks and tools (no pytest import).

``Cluster`` starts ``masters * (1 + replicas)`` ``redis-server`` processes on loopback ports
in a temporary directory (cluster mode, append-only file), joins them with
``redis-cli --cluster create``, waits until every node reports ``cluster_state:ok`` and each
replica is in sync, and always stops and removes everything. It can kill a node (``kill -9``),
pause one (SIGSTOP, a hung host), wait for a replica to be promoted, and restart a node.
Every wait is bounded; a failure raises ``ClusterFailed`` with the node logs' tails.

``password=`` runs it with an ACL user (``user``, default ``kvfs``) and the default user
off; ``tls=True`` serves TLS only (``tls-port``, TLS on the cluster bus and replication)
with certificates made here (``make_certs``). ``secret_file`` writes a cluster secret for
``SharedTier`` and the mount.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from .client import TLSFiles

log = logging.getLogger(__name__)

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
REDIS_BENCHMARK = shutil.which("redis-benchmark")
HAVE_REDIS = REDIS_SERVER is not None and REDIS_CLI is not None
HOST = "127.0.0.1"


class ClusterFailed(AssertionError):
    """The cluster did not reach the expected state in time (tests report it as a failure)."""


def free_ports(n: int) -> list[int]:
    """``n`` loopback ports p whose cluster-bus port p + 10000 is free too."""
    ports: list[int] = []
    socks: list[socket.socket] = []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind((HOST, 0))
            socks.append(s)
            p = s.getsockname()[1]
            if p + 10000 > 65535 or p in ports:
                continue
            try:
                b = socket.socket()
                b.bind((HOST, p + 10000))
                socks.append(b)
            except OSError:
                continue
            ports.append(p)
    finally:
        for s in socks:
            s.close()
    return ports


def secret_file(path: str | Path, secret: bytes | None = None) -> Path:
    """Write a cluster secret (48 random bytes unless given), mode 0600; returns the path."""
    p = Path(path)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret if secret is not None else os.urandom(48))
    return p


def make_certs(d: str | Path) -> dict[str, Path]:
    """A self-signed CA and, signed by it, a server and a client certificate for 127.0.0.1
    and localhost, as PEM files in ``d``: keys ca, server_cert, server_key, client_cert,
    client_key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
             signer: ec.EllipticCurvePrivateKey, ca: bool) -> x509.Certificate:
        b = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(issuer)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=2))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address(HOST))]),
                critical=False)
        return b.sign(signer, hashes.SHA256())

    def write(fname: str, data: bytes) -> Path:
        p = d / fname
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return p

    def pem_key(k: ec.EllipticCurvePrivateKey) -> bytes:
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = cert("kvfs test CA", ca_key, name("kvfs test CA"), ca_key, True)
    out = {"ca": write("ca.crt", ca.public_bytes(serialization.Encoding.PEM))}
    for who in ("server", "client"):
        k = ec.generate_private_key(ec.SECP256R1())
        c = cert(f"kvfs test {who}", k, ca.subject, ca_key, False)
        out[f"{who}_cert"] = write(f"{who}.crt", c.public_bytes(serialization.Encoding.PEM))
        out[f"{who}_key"] = write(f"{who}.key", pem_key(k))
    return out


class Cluster:
    """``masters`` shards with ``replicas`` replicas each, on 127.0.0.1; a context manager."""

    def __init__(self, ports: list[int] | None = None, masters: int = 3, replicas: int = 1,
                 appendfsync: str = "everysec", node_timeout_ms: int = 1000,
                 base_dir: str | Path | None = None, start_timeout: float = 30.0,
                 password: str | None = None, user: str = "kvfs", tls: bool = False,
                 include: str | Path | None = None) -> None:
        if not HAVE_REDIS:
            raise ClusterFailed("redis-server / redis-cli not found on PATH")
        n = masters * (1 + replicas)
        self.ports = list(ports) if ports else free_ports(n)
        if len(self.ports) != n:
            raise ValueError(f"need {n} ports for {masters} masters x {1 + replicas}, got {len(self.ports)}")
        self.masters, self.replicas = masters, replicas
        self.appendfsync, self.node_timeout_ms = appendfsync, node_timeout_ms
        self.start_timeout = start_timeout
        self.password, self.user, self.tls = password, user, tls
        self.include = include  # a config each node's own includes first (deploy/'s)
        self.certs: dict[str, Path] = {}
        self.secret_path: Path | None = None  # the cluster secret (made at start)
        self._base_dir = base_dir
        self.dir: Path | None = None
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.paused: set[int] = set()

    # -- life cycle --------------------------------------------------------------
    @property
    def urls(self) -> str:
        """The cluster's addresses (no credentials: give the password apart)."""
        scheme = "rediss" if self.tls else "redis"
        who = f"{self.user}@" if self.password else ""
        return f"{scheme}://{who}" + ",".join(f"{HOST}:{p}" for p in self.ports)

    @property
    def tls_files(self) -> TLSFiles | None:
        """What a client needs for a TLS cluster (None without TLS)."""
        if not self.tls:
            return None
        return TLSFiles(str(self.certs["ca"]), str(self.certs["client_cert"]),
                        str(self.certs["client_key"]))

    @property
    def secret(self) -> bytes:
        assert self.secret_path is not None, "the cluster is not started"
        return self.secret_path.read_bytes()

    def mount_args(self, *, url: str | None = None) -> list[str]:
        """kvfs-mount's arguments for this cluster: ``--shared`` and the secret, password
        (as files, 0600) and TLS options."""
        assert self.dir is not None, "the cluster is not started"
        args = ["--shared", url or self.urls, "-o", f"shared_secret_file={self.secret_path}"]
        if self.password:
            pw = secret_file(self.dir / "password", self.password.encode())
            args += ["-o", f"shared_password_file={pw}"]
        if self.tls:
            c = self.certs
            args += ["-o", f"shared_tls_ca={c['ca']}", "-o", f"shared_tls_cert={c['client_cert']}",
                     "-o", f"shared_tls_key={c['client_key']}"]
        return args

    def _cli_args(self) -> list[str]:
        args = []
        if self.password:
            args += ["--user", self.user, "--pass", self.password, "--no-auth-warning"]
        if self.tls:
            args += ["--tls", "--cacert", str(self.certs["ca"]), "--cert",
                     str(self.certs["client_cert"]), "--key", str(self.certs["client_key"])]
        return args

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Cluster:
        self.dir = Path(tempfile.mkdtemp(prefix="kvfs-redis-", dir=self._base_dir))
        try:
            self.secret_path = secret_file(self.dir / "secret")
            if self.tls:
                self.certs = make_certs(self.dir / "tls")
            for p in self.ports:
                self._spawn(p)
            for p in self.ports:
                self._wait_ping(p)
            assert REDIS_CLI is not None and REDIS_SERVER is not None  # HAVE_REDIS, checked above
            cmd = [REDIS_CLI, *self._cli_args(), "--cluster", "create",
                   *(f"{HOST}:{p}" for p in self.ports),
                   "--cluster-replicas", str(self.replicas), "--cluster-yes"]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=self.start_timeout)
            if r.returncode != 0:
                raise ClusterFailed(f"redis-cli --cluster create failed ({r.returncode}):\n"
                                    f"{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def _conf(self, port: int) -> Path:
        assert self.dir is not None
        d = self.dir / str(port)
        d.mkdir(exist_ok=True)
        conf = d / "redis.conf"
        lines = [f"include {os.path.abspath(self.include)}"] if self.include else []
        if self.tls:
            c = self.certs
            lines += ["port 0", f"tls-port {port}", f"tls-cert-file {c['server_cert']}",
                      f"tls-key-file {c['server_key']}", f"tls-ca-cert-file {c['ca']}",
                      "tls-cluster yes", "tls-replication yes", "tls-auth-clients optional"]
        else:
            lines.append(f"port {port}")
        if self.password:
            pw = self.password.replace("\\", "\\\\").replace('"', '\\"')
            lines += ["user default off", f'user {self.user} on ">{pw}" ~kvfs:* +@all',
                      f"masteruser {self.user}", f'masterauth "{pw}"']
        conf.write_text("\n".join([
            *lines, f"bind {HOST}", "protected-mode yes", f"dir {d}",
            "daemonize no", "logfile redis.log", 'save ""',
            "cluster-enabled yes", "cluster-config-file nodes.conf",
            f"cluster-node-timeout {self.node_timeout_ms}",
            # other shards keep serving while one fails over; a replica that lagged may
            # still be promoted (the test of lost, unsynced writes needs exactly that)
            "cluster-require-full-coverage no", "cluster-replica-validity-factor 0",
            "appendonly yes", f"appendfsync {self.appendfsync}",
            "repl-diskless-sync-delay 0", "",
        ]))
        return conf

    def _spawn(self, port: int) -> None:
        conf = self._conf(port)
        assert REDIS_SERVER is not None
        self.procs[port] = subprocess.Popen([REDIS_SERVER, str(conf)], cwd=conf.parent,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        """Stop every node (SIGCONT first for paused ones) and remove the directory."""
        for p in list(self.paused):
            self.resume(p)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self.procs.clear()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    # -- inspection --------------------------------------------------------------
    def client(self, port: int, timeout: float = 2.0) -> redis.Redis:
        kw: dict = {}
        if self.password:
            kw.update(username=self.user, password=self.password)
        if self.tls:
            kw.update(ssl=True, ssl_ca_certs=str(self.certs["ca"]),
                      ssl_certfile=str(self.certs["client_cert"]),
                      ssl_keyfile=str(self.certs["client_key"]))
        return redis.Redis(host=HOST, port=port, socket_timeout=timeout,
                           socket_connect_timeout=timeout, **kw)

    def alive(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.poll() is None and p not in self.paused]

    def log_tail(self, port: int, n: int = 20) -> str:
        if self.dir is None:
            return ""
        f = self.dir / str(port) / "redis.log"
        return "\n".join(f.read_text(errors="replace").splitlines()[-n:]) if f.exists() else ""

    def _fail(self, msg: str) -> ClusterFailed:
        tails = "\n".join(f"--- {p} ---\n{self.log_tail(p, 8)}" for p in self.procs)
        return ClusterFailed(f"{msg}\n{tails}")

    def _wait_ping(self, port: int) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.procs[port].poll() is not None:
                raise self._fail(f"redis-server on {port} exited ({self.procs[port].returncode})")
            try:
                with self.client(port, 0.5) as c:
                    c.ping()
                return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise self._fail(f"redis-server on {port} does not answer") from None
                time.sleep(0.05)

    def role(self, port: int) -> str:
        with self.client(port) as c:
            return c.execute_command("ROLE")[0].decode()

    def master_of_key(self, key: str) -> int:
        """Port of the master that serves ``key``'s slot now (asks a live node)."""
        for p in self.alive():
            try:
                with self.client(p) as c:
                    slot = int(c.execute_command("CLUSTER", "KEYSLOT", key))
                    for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                        if start <= slot <= end:
                            return int(master[1])
            except redis.RedisError:
                continue
        raise self._fail(f"no live node knows the master of {key!r}")

    def replica_of(self, master: int) -> int | None:
        for p in self.alive():
            if p == master:
                continue
            try:
                with self.client(p) as c:
                    info = c.info("replication")
            except redis.RedisError:
                continue
            if info.get("role") == "slave" and int(info.get("master_port", 0)) == master:
                return p
        return None

    def _state_ok(self) -> bool:
        for p in self.alive():
            try:
                with self.client(p, 1.0) as c:
                    info = c.execute_command("CLUSTER", "INFO").decode()
                    fields = dict(line.split(":", 1) for line in info.split() if ":" in line)
                    if fields.get("cluster_state") != "ok" or fields.get("cluster_slots_ok") != "16384":
                        return False
                    repl = c.info("replication")
                    if repl.get("role") == "slave" and repl.get("master_link_status") != "up":
                        return False
            except redis.RedisError:
                return False
        return True

    def wait_ok(self, timeout: float | None = None) -> None:
        """Until every live node sees cluster_state:ok, all slots served, replicas linked."""
        deadline = time.monotonic() + (timeout or self.start_timeout)
        while not self._state_ok():
            if time.monotonic() > deadline:
                raise self._fail("cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    # -- faults ------------------------------------------------------------------
    def kill(self, port: int) -> None:
        """``kill -9`` one node."""
        proc = self.procs[port]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=5)
        self.paused.discard(port)
        log.info("killed redis node %d", port)

    def pause(self, port: int) -> None:
        os.kill(self.procs[port].pid, signal.SIGSTOP)
        self.paused.add(port)

    def resume(self, port: int) -> None:
        if self.procs[port].poll() is None:
            os.kill(self.procs[port].pid, signal.SIGCONT)
        self.paused.discard(port)

    def wait_promoted(self, replica: int, timeout: float = 20.0) -> None:
        """Until ``replica`` is a master and the surviving cluster reports ok."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.role(replica) == "master" and self._state_ok():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise self._fail(f"replica {replica} was not promoted within {timeout} s")
            time.sleep(0.1)

    def restart(self, port: int) -> None:
        """Start a stopped node again on its own data; it rejoins (as a replica if its shard
        failed over meanwhile)."""
        if self.procs[port].poll() is None:
            raise ValueError(f"node {port} is running")
        self._spawn(port)
        self._wait_ping(port)
        self.wait_ok()
