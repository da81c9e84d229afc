"""Smoke test of the benchmark command: ``tools/bench.py --quick`` on the engine and codec figures.

Checks that the run completes and that ``results.json`` carries every engine figure with
numeric samples and ratios, plus the plots and the page. No timing assertions: the numbers
of a quick run on a shared CI machine mean nothing.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENGINE_FIGURES = {"1", "2", "7", "8"}


@pytest.mark.timeout(180)
def test_bench_quick_engine(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    env = dict(os.environ, KVFS_BENCH_CACHE=str(tmp_path / "cache"), MPLBACKEND="Agg")
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), "--quick", "--only", "engine,codec",
                        "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    assert doc["quick"] is True
    assert doc["machine"]["cores"] >= 1
    assert ENGINE_FIGURES <= set(doc["figures"])
    for fid in ENGINE_FIGURES:
        fig = doc["figures"][fid]
        assert all(p["status"] == "ok" for p in fig["providers"]), fig["providers"]
        assert fig["results"], f"figure {fid} has no results"
        for r in fig["results"]:
            for who in ("subject", "peer"):
                vals = r["values"][who]
                assert vals and all(isinstance(v, (int, float)) and math.isfinite(v) for v in vals), r["name"]
            assert isinstance(r["ratio"], float) and r["ratio"] > 0, r["name"]
            assert r["goal_met"] in (True, False, None)
        assert (out / fig["image"]).stat().st_size > 0
    assert "## Figure 8" in (out / "benchmarks.md").read_text()
    assert not (out / "work").exists()  # scratch files are cleaned up


def test_missing_module_is_reported_not_crashed(tmp_path: Path) -> None:
    import bench
    planned = [("nosuchmodule", "figure_fn", "3")]
    runs = [bench.run_one(m, f, True, str(tmp_path)) for m, f, _ in planned]
    assert runs[0]["status"] == "not available"
    figs = bench.group(runs, planned)
    doc = {"command": "python tools/bench.py", "started": "-", "finished": "-", "quick": True, "git": "-",
           "machine": {}, "figures": figs}
    page = bench.render(doc, "img")
    assert "bench_nosuchmodule.figure_fn`: **not available**" in page
    assert "## Figure 9" in page  # every figure has a place, measured or not


@pytest.mark.mount
@pytest.mark.timeout(240)
def test_migration_floors_run_through_the_passthrough(tmp_path: Path) -> None:
    """Figure 3's bounds: a real group migration through tools/fuse_floor.py (mkdir, create,
    write, rename, fsyncdir, rmdir through the kernel) and into a plain directory, each
    paired with dd on the same filesystem; every sample a real, finite rate."""
    if not Path("/dev/fuse").exists():
        pytest.skip("/dev/fuse is absent")
    import bench_warm
    out = bench_warm.migration_floors(quick=True, workdir=str(tmp_path))
    names = [r["name"] for r in out["results"]]
    assert [n.rsplit("[", 1)[1] for n in names] == ["FUSE floor]", "ext4 directory]"]
    for r in out["results"]:
        for who in ("subject", "peer"):
            vals = r["values"][who]
            assert len(vals) == 2 and all(math.isfinite(v) and v > 0 for v in vals), r["name"]
        assert r["goal"] is None  # a bound, not a goal
    assert not (tmp_path / "work" / "migration_floors").exists()  # the passthrough is gone too
