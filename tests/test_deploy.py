"""deploy/: the systemd unit (verified, its command lines parsed and run for real), the
Prometheus rules (promtool, thresholds equal to the profiles, rule unit tests) and the
Grafana dashboard (every expression names real metrics and parses); --metrics-addr."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from kvfs.fuse.mount import parse_args
from kvfs.mount_runner import HAVE_FUSE, MOUNT_TIMEOUT, run_mount, wait_unmounted
from kvfs.ops import alerts, metrics, profiles, units

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "kvfs@.service"
CONF = DEPLOY / "kvfs.conf.example"
RULES = DEPLOY / "prometheus-rules.yml"
DASHBOARD = DEPLOY / "grafana-dashboard.json"
INSTALL_PREFIX = "/opt/kvfs"  # where the unit expects the checkout
# options that give the service its own mount namespace: its FUSE mount would be invisible
NAMESPACE_OPTIONS = {"ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices",
                     "PrivateMounts", "ReadOnlyPaths", "ReadWritePaths", "InaccessiblePaths",
                     "TemporaryFileSystem", "BindPaths", "BindReadOnlyPaths", "RootDirectory",
                     "RootImage", "ProtectKernelTunables", "ProtectKernelModules",
                     "ProtectKernelLogs", "ProtectControlGroups", "ProtectProc", "ProcSubset",
                     "DevicePolicy", "DeviceAllow"}


# --- systemd unit --------------------------------------------------------------------------

def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """systemd unit syntax: sections of ``Key=value`` (keys may repeat), ``#`` comments,
    backslash continuation lines."""
    sections: dict[str, dict[str, list[str]]] = {}
    cur: dict[str, list[str]] | None = None
    for line in re.sub(r"\\\n", " ", text).splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            cur = sections.setdefault(line.strip("[]"), {})
            continue
        assert cur is not None, f"key outside a section: {line}"
        key, sep, value = line.partition("=")
        assert sep, f"not key=value: {line}"
        cur.setdefault(key.strip(), []).append(value.strip())
    return sections


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


def expand(cmdline: str, env: dict[str, str]) -> tuple[bool, list[str]]:
    """systemd's Exec*= expansion: ``${X}`` is one word, ``$X`` splits on whitespace, an
    unset variable is dropped; a leading ``-`` means failure is ignored."""
    ignore = cmdline.startswith("-")
    argv: list[str] = []
    for word in shlex.split(cmdline.lstrip("-")):
        if m := re.fullmatch(r"\$\{(\w+)\}", word):
            argv.append(env.get(m.group(1), ""))
        elif m := re.fullmatch(r"\$(\w+)", word):
            argv += env.get(m.group(1), "").split()
        else:
            assert "$" not in word, f"unsupported expansion in {word!r}"
            argv.append(word)
    return ignore, argv


def unit() -> dict[str, dict[str, list[str]]]:
    return parse_unit(UNIT.read_text())


def test_unit_fields() -> None:
    u = unit()
    svc = u["Service"]
    assert svc["Type"] == ["simple"]
    assert svc["EnvironmentFile"] == ["/etc/kvfs/%i.conf"]
    assert svc["Restart"] == ["on-failure"]
    assert "/etc/kvfs/%i.conf" in u["Unit"]["AssertPathExists"]
    assert u["Install"]["WantedBy"] == ["multi-user.target"]
    _, start = expand(svc["ExecStart"][0], {})
    assert start[0] == f"{INSTALL_PREFIX}/.venv/bin/kvfs-mount" and "--foreground" in start
    for key in ("ExecStop", "ExecStartPre"):
        ignore, argv = expand(svc[key][0], {"MOUNTPOINT": "/mnt/kv"})
        assert ignore and argv == ["/usr/bin/fusermount3", "-u", "/mnt/kv"], key
    # hardening that still lets it open /dev/fuse, mount, and reach a block-device volume
    assert NAMESPACE_OPTIONS.isdisjoint(svc), NAMESPACE_OPTIONS & set(svc)
    assert "CAP_SYS_ADMIN" in svc["CapabilityBoundingSet"][0].split()
    assert svc["NoNewPrivileges"] == ["yes"] and svc["UMask"] == ["0077"]
    assert int(svc["TimeoutStopSec"][0]) >= 60  # room to flush and checkpoint


def test_exec_start_parses_with_the_mount_arguments() -> None:
    env = read_env_file(CONF)
    assert {"VOLUME", "MOUNTPOINT", "PROFILE", "KVFS_OPTS"} <= set(env)
    _, argv = expand(unit()["Service"]["ExecStart"][0], env)
    args = parse_args(argv[1:])
    assert (args.volume, args.mountpoint, args.profile) == (
        env["VOLUME"], env["MOUNTPOINT"], env["PROFILE"])
    assert args.foreground and args.metrics_port == 9477 and args.metrics_addr == "127.0.0.1"
    assert units.parse_size(args.size) == 512 << 30
    prof = profiles.load(args.profile, profiles.parse_overrides(args.overrides))
    assert prof.checkpoint_interval_s == 120.0
    # without KVFS_OPTS the command is still complete
    _, bare = expand(unit()["Service"]["ExecStart"][0], {k: env[k] for k in
                                                         ("VOLUME", "MOUNTPOINT", "PROFILE")})
    assert parse_args(bare[1:]).size is None


def _unit_for_this_checkout(tmp_path: Path) -> Path:
    d = tmp_path / "units"
    d.mkdir()
    (d / UNIT.name).write_text(UNIT.read_text().replace(INSTALL_PREFIX, str(ROOT)))
    return d


def test_systemd_analyze_verify(tmp_path) -> None:
    tool = shutil.which("systemd-analyze")
    if not tool:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    if not (ROOT / ".venv" / "bin" / "kvfs-mount").exists():
        pytest.skip("no .venv/bin/kvfs-mount in this checkout (make setup)")
    d = _unit_for_this_checkout(tmp_path)
    r = subprocess.run([tool, "verify", "--man=no", str(d / "kvfs@kv.service")],
                       capture_output=True, text=True, timeout=60)
    complaints = [ln for ln in (r.stdout + r.stderr).splitlines() if "kvfs" in ln]
    assert r.returncode == 0 and not complaints, r.stdout + r.stderr
    # the check is real: a broken copy is refused
    (d / UNIT.name).write_text(UNIT.read_text())  # ExecStart under /opt/kvfs: absent here
    if not Path(INSTALL_PREFIX, ".venv/bin/kvfs-mount").exists():
        r = subprocess.run([tool, "verify", "--man=no", str(d / "kvfs@kv.service")],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "kvfs-mount" in r.stderr


class Service:
    """Runs the unit's Exec* lines the way systemd would (environment file, expansion,
    capability bounding set, no new privileges, umask), without systemd."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.svc = parse_unit(UNIT.read_text().replace(INSTALL_PREFIX, str(ROOT)))["Service"]
        caps = [c.removeprefix("CAP_").lower() for c in self.svc["CapabilityBoundingSet"][0].split()]
        self.prefix = ["setpriv", "--no-new-privs", "--bounding-set",
                       ",".join(["-all", *(f"+{c}" for c in caps)])]
        self.umask = int(self.svc["UMask"][0], 8)
        self.proc: subprocess.Popen[str] | None = None

    def run(self, key: str) -> int:
        ignore, argv = expand(self.svc[key][0], self.env)
        r = subprocess.run([*self.prefix, *argv], capture_output=True, text=True, timeout=60)
        assert ignore or r.returncode == 0, f"{key}: {r.stderr}"
        return r.returncode

    def start(self) -> None:
        self.run("ExecStartPre")
        _, argv = expand(self.svc["ExecStart"][0], self.env)
        self.proc = subprocess.Popen([*self.prefix, *argv], stderr=subprocess.PIPE, text=True,
                                     preexec_fn=lambda: os.umask(self.umask))
        deadline = time.monotonic() + MOUNT_TIMEOUT
        while not os.path.ismount(self.env["MOUNTPOINT"]):
            assert self.proc.poll() is None, f"ExecStart exited: {self.proc.communicate()[1]}"
            assert time.monotonic() < deadline, "not mounted in time"
            time.sleep(0.02)

    def stop(self) -> int:
        assert self.proc is not None
        self.run("ExecStop")
        rc = self.proc.wait(timeout=int(self.svc["TimeoutStopSec"][0]))
        self.proc = None
        wait_unmounted(self.env["MOUNTPOINT"])
        return rc

    def crash(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=30)
        self.proc = None


@pytest.mark.mount
def test_unit_commands_run_a_real_mount(tmp_path) -> None:
    if not HAVE_FUSE:
        pytest.skip("/dev/fuse is absent")
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to apply the unit's capability bounding set")
    if not (ROOT / ".venv" / "bin" / "kvfs-mount").exists():
        pytest.skip("no .venv/bin/kvfs-mount in this checkout (make setup)")
    mnt, vol = tmp_path / "mnt", tmp_path / "kv.vol"
    mnt.mkdir()
    env = {"VOLUME": str(vol), "MOUNTPOINT": str(mnt), "PROFILE": "ecommerce",
           "KVFS_OPTS": f"--size 32M --log {tmp_path / 'kvfs.log'} -o hot_sessions=50"}
    s = Service(env)
    s.start()
    try:
        (mnt / "sessions" / "s1").mkdir()
        (mnt / "sessions" / "s1" / "layer_0").write_bytes(b"kv" * 5000)
        assert json.loads((mnt / ".kvfs" / "stats").read_text())
    finally:
        rc = s.stop()
    assert rc == 0, (tmp_path / "kvfs.log").read_text()
    assert vol.stat().st_mode & 0o077 == 0  # UMask=0077: the volume is private
    # after a crash the dead mount point is cleared by ExecStartPre, and the data is there
    s.start()
    s.crash()
    s.start()
    try:
        assert (mnt / "sessions" / "s1" / "layer_0").read_bytes() == b"kv" * 5000
    finally:
        assert s.stop() == 0, (tmp_path / "kvfs.log").read_text()


# --- Prometheus rules ------------------------------------------------------------------------

def registry_names() -> set[str]:
    """Every series name the registry can expose (labelled metrics have no samples yet)."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count",
                                                                 "_created"), "gauge": ("",)}
    names = set()
    for fam in metrics.REGISTRY.collect():
        names |= {fam.name + s for s in suffixes.get(fam.type, ("",))}
        names |= {s.name for s in fam.samples}
    return names


KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
            "or", "unless", "offset", "inf", "nan"}


def promql_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (functions, labels, windows dropped)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    return {m.group() for m in re.finditer(r"(?<![\w.])[A-Za-z_:][\w:]*", e)
            if m.group().lower() not in KEYWORDS and not e[m.end():].lstrip().startswith("(")}


def test_promql_metrics_extraction() -> None:
    assert promql_metrics('histogram_quantile(0.99, sum by (le) (rate(kv_a_bucket{x=~"$i"}[5m])))'
                          ) == {"kv_a_bucket"}
    assert promql_metrics("kv_a / on (instance) kv_b > bool 0.5") == {"kv_a", "kv_b"}


def promtool() -> str:
    tool = shutil.which("promtool")
    if not tool:
        pytest.skip("promtool is missing: apt-get install prometheus (tools/setup_env.sh "
                    "installs it when run as root)")
    return tool


def rules_doc() -> dict:
    return yaml.safe_load(RULES.read_text())


def test_rules_file_is_generated_from_the_profiles() -> None:
    want = alerts.prometheus_rules([profiles.load(n) for n in profiles.PROFILE_NAMES])
    assert RULES.read_text() == want, "regenerate: python -m kvfs.ops.alerts > " + str(RULES)


def test_rule_thresholds_equal_the_profiles() -> None:
    fields = {"device_memory_high": ("alert_device_pct", "alert_device_for_s"),
              "warm_usage_high": ("alert_warm_pct", "alert_warm_for_s"),
              "cold_write_slow": ("alert_cold_write_ms", "alert_cold_write_for_s")}
    groups = {g["name"]: g["rules"] for g in rules_doc()["groups"]}
    assert set(groups) == {f"kvfs-{n}" for n in profiles.PROFILE_NAMES}
    known = registry_names()
    for name in profiles.PROFILE_NAMES:
        p = profiles.load(name)
        by_alert = {r["alert"]: r for r in groups[f"kvfs-{name}"]}
        assert set(by_alert) == set(fields)
        for alert, (pct, for_s) in fields.items():
            r = by_alert[alert]
            m = re.fullmatch(r"(.*\S)\s*>\s*([0-9.eE+-]+)", r["expr"])
            assert m, r["expr"]
            assert float(m.group(2)) == getattr(p, pct), (name, alert)
            assert units.parse_duration(r["for"]) == getattr(p, for_s), (name, alert)
            assert r["labels"]["profile"] == name
            used = promql_metrics(m.group(1))
            assert used and used <= known, used - known
    iot = {r["alert"]: r for r in groups["kvfs-iot"]}
    assert float(iot["warm_usage_high"]["expr"].split(">")[-1]) == 0.95  # not the default 0.88


def test_promtool_check_rules() -> None:
    r = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS: 9 rules" in r.stdout, r.stdout + r.stderr


def _alert(name: str, instance: str, profile: str, severity: str, value: str) -> dict:
    rule = next(r for r in alerts.default_rules(profiles.load(profile)) if r.name == name)
    what, _, action = rule.description.partition(" -> ")
    return {"exp_labels": {"instance": instance, "profile": profile, "severity": severity},
            "exp_annotations": {"summary": f"{what} on {instance}",
                                "description": f"now {value}; what kvfs does: {action}"}}


def test_promtool_rule_unit_tests(tmp_path) -> None:
    """The rules fire on the profile's thresholds after the profile's durations: iot's
    warm threshold is its own, a target without a profile label gets gov's."""
    tests = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "15s",
        "tests": [{
            "interval": "15s",
            "input_series": [
                {"series": 'kv_hot_device_usage_ratio{instance="a",profile="iot"}',
                 "values": "0.95x20"},
                {"series": 'kv_warm_usage_ratio{instance="a",profile="iot"}', "values": "0.9x20"},
                {"series": 'kv_warm_usage_ratio{instance="b"}', "values": "0.9x20"},
                {"series": 'kv_cold_write_ms_sum{instance="c",profile="ecommerce"}',
                 "values": "0+150x20"},  # 10 writes of 15 ms every 15 s
                {"series": 'kv_cold_write_ms_count{instance="c",profile="ecommerce"}',
                 "values": "0+10x20"},
            ],
            "alert_rule_test": [
                {"eval_time": "15s", "alertname": "device_memory_high", "exp_alerts": []},
                {"eval_time": "45s", "alertname": "device_memory_high",
                 "exp_alerts": [_alert("device_memory_high", "a", "iot", "warning", "0.95")]},
                {"eval_time": "90s", "alertname": "warm_usage_high", "exp_alerts": []},
                {"eval_time": "3m", "alertname": "warm_usage_high",
                 "exp_alerts": [_alert("warm_usage_high", "b", "gov", "warning", "0.9")]},
                {"eval_time": "45s", "alertname": "cold_write_slow", "exp_alerts": []},
                {"eval_time": "3m", "alertname": "cold_write_slow",
                 "exp_alerts": [_alert("cold_write_slow", "c", "ecommerce", "critical", "15")]},
            ],
        }],
    }
    path = tmp_path / "rules_test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    r = subprocess.run([promtool(), "test", "rules", str(path)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


# --- Grafana dashboard -----------------------------------------------------------------------

def dashboard_exprs() -> list[tuple[str, str]]:
    doc = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in doc["panels"] for t in p["targets"]]


def test_dashboard_names_only_real_metrics() -> None:
    doc = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids)) and doc["uid"] == "kvfs"
    known = registry_names()
    used: set[str] = set()
    for title, expr in dashboard_exprs():
        names = promql_metrics(expr)
        assert names, (title, expr)
        assert names <= known, (title, names - known)
        used |= names
    for var in doc["templating"]["list"]:
        if var["type"] == "query":
            assert promql_metrics(re.sub(r"label_values\((\w+),.*", r"\1", var["query"])) <= known
    # what an operator looks at first: hit rate, warm eviction, cold p99, bytes per tier
    assert {"kv_hot_hit_rate", "kv_warm_evict_latency_ms_bucket", "kv_cold_read_p99_ms",
            "kv_hot_bytes", "kv_warm_bytes", "kv_cold_bytes"} <= used


def test_dashboard_expressions_parse(tmp_path) -> None:
    """promtool parses every panel's PromQL (as recording rules)."""
    rules = [{"record": f"kvfs:panel_{i}", "expr": expr.replace("$instance", ".*")}
             for i, (_, expr) in enumerate(dashboard_exprs())]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


# --- --metrics-addr ----------------------------------------------------------------------------

def test_metrics_addr_argument() -> None:
    assert parse_args(["v", "m"]).metrics_addr == "127.0.0.1"
    assert parse_args(["v", "m", "--metrics-addr", "::"]).metrics_addr == "::"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


@pytest.mark.mount
def test_metrics_addr_is_where_the_mount_listens(make_mount) -> None:
    port = _free_port()
    # 127.0.0.2 is loopback too, but a different address than the default
    m = make_mount(extra=("--metrics-port", str(port), "--metrics-addr", "127.0.0.2"))
    (m.sessions / "s").mkdir()
    assert "kv_cold_read_ms" in _get(f"http://127.0.0.2:{port}/metrics")
    with pytest.raises(urllib.error.URLError):
        _get(f"http://127.0.0.1:{port}/metrics")


@pytest.mark.mount
def test_metrics_addr_that_cannot_bind_is_refused(tmp_path) -> None:
    if not HAVE_FUSE:
        pytest.skip("/dev/fuse is absent")
    (tmp_path / "mnt").mkdir()
    r = run_mount(str(tmp_path / "vol"), str(tmp_path / "mnt"), "--size", "16M", "--foreground",
                  "--metrics-port", str(_free_port()), "--metrics-addr", "192.0.2.1")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert "--metrics-addr 192.0.2.1" in lines[0]
    assert not os.path.ismount(tmp_path / "mnt")


def test_helper_passes_metrics_addr(tmp_path) -> None:
    fake = tmp_path / "fake_mount.py"
    fake.write_text("import json, sys\njson.dump(sys.argv[1:], open(sys.argv[0] + '.json', 'w'))\n")
    (tmp_path / "m").mkdir()
    env = dict(os.environ, KVFS_PYTHON=sys.executable, KVFS_MOUNT_PY=str(fake))
    r = subprocess.run(["bash", str(DEPLOY / "mount.fuse.kvfs"), "v", "m", "-o",
                        "metrics_port=9477,metrics_addr=0.0.0.0"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    argv = json.loads(Path(str(fake) + ".json").read_text())
    assert argv[2:] == ["--metrics-port", "9477", "--metrics-addr", "0.0.0.0"]
    assert parse_args(argv).metrics_addr == "0.0.0.0"
