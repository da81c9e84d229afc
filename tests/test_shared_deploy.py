"""deploy/redis-cluster.conf is the configuration a real 3 + 3 cluster runs with: six nodes
that include it (and add a port, a directory and an ACL user, as its header says) form a
cluster kvfs uses, with the settings the shared tier relies on."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfs.shared import SharedTier
from kvfs.shared.local_cluster import HAVE_REDIS, Cluster

CONF = Path(__file__).resolve().parent.parent / "deploy" / "redis-cluster.conf"


@pytest.mark.skipif(not HAVE_REDIS, reason="redis-server/redis-cli not installed")
def test_deploy_config_runs_a_cluster() -> None:
    with Cluster(masters=3, replicas=1, include=CONF, password="deploy-test-pw") as c:
        for p in c.ports:
            with c.client(p) as r:
                got = {k: r.config_get(k)[k] for k in (
                    "maxmemory-policy", "appendonly", "appendfsync",
                    "cluster-require-full-coverage", "repl-backlog-size")}
                assert got == {"maxmemory-policy": "noeviction", "appendonly": "yes",
                               "appendfsync": "everysec", "cluster-require-full-coverage": "no",
                               "repl-backlog-size": str(256 << 20)}, got
        with SharedTier(c.urls, node_id="deploy", secret=c.secret, password=c.password) as t:
            t.acquire("s")
            t.append("s", "layer_0", 0, b"kv" * 1000)
            t.put_meta("s", b"{}")
            t.sync("s")
            assert t.read("s", "layer_0", 0, 2000) == b"kv" * 1000
