"""Samples and figures of an agent day: :class:`DaySamples`, a part of
``agent_day_sim.Day``.
"""

from __future__ import annotations

import math
import time
import tracemalloc
from typing import Any

import agentlib as lib

RSS_MARKS_MIN = (2, 5, 10)  # real minutes at which the agent's RSS is reported


def tensor_bytes() -> int:
    """Bytes of the distinct storages of every live CPU torch tensor (a gc walk)."""
    import gc

    import torch

    seen, total = set(), 0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type == "cpu":
            try:
                st = o.untyped_storage()
            except RuntimeError:
                continue
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def rss_parts() -> dict[str, int]:
    """This process's RSS split (``/proc/self/status``): ``anon`` (heap, torch, numpy),
    ``shmem`` (the RAM tier's mapped shard pages on tmpfs: bounded by its cap) and ``file``."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                for key, name in (("RssAnon:", "anon"), ("RssFile:", "file"), ("RssShmem:", "shmem")):
                    if line.startswith(key):
                        out[name] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


class DaySamples:
    """The time series and the day's results, mixed into ``Day``: its router, volume, counters,
    latencies and the marks of the previous sample. With ``--tracemalloc`` a snapshot of the
    Python heap is taken at each of ``RSS_MARKS_MIN`` and at the end, and the lines that grew
    most from the first to the last are reported (where a growing RSS comes from)."""

    def _heap_mark(self, t: float) -> None:
        """At each mark: the bytes of live torch tensor storages (native memory tracemalloc
        does not see) and, with ``--tracemalloc``, a heap snapshot."""
        seen = self.__dict__.setdefault("_marks", {})
        for m in RSS_MARKS_MIN:
            if t >= m * 60 and m not in seen:
                seen[m] = tensor_bytes()
                if getattr(self.args, "tracemalloc", False):
                    self.__dict__.setdefault("_snaps", {})[m] = tracemalloc.take_snapshot()

    def _sample(self, now: float) -> None:
        from kvfs.ops import metrics

        r, mk = self.router, self._mark
        wu = r.warm.usage()
        ev_sum, ev_n = metrics.histogram_totals(metrics.warm_evict_latency)
        mm = self._mount_metrics()
        st = lib.mount_stats(self.vol.mnt) if self.vol.use_mount else None
        cold_write = None
        if mm and "w_n" in mk and mm.get("kv_cold_write_ms_count", 0) > mk["w_n"]:
            cold_write = (mm["kv_cold_write_ms_sum"] - mk["w_sum"]) / (mm["kv_cold_write_ms_count"] - mk["w_n"])
        p50, p99 = self.cold_lat.quantiles(mk.get("reads", 0))
        steps = self.c["steps"] - mk.get("steps", 0)
        t = time.perf_counter() - self.clock.t0
        self._heap_mark(t)
        row = {
            "h": now / 3600, "t": t, "active": len(self.active), "interactions": self.c["interactions"],
            "hit_rate": (self.c["hits"] - mk.get("hits", 0)) / steps if steps else None,
            "hot_ratio": r.hot_total / r.budget, "warm_ratio": wu["ratio"],
            "cold_used": st["usage"]["used"] if st else None,
            "evict_ms": (ev_sum - mk["ev_sum"]) / (ev_n - mk["ev_n"]) if "ev_n" in mk and ev_n > mk["ev_n"] else None,
            "cold_p50": p50, "cold_p99": p99, "engine_p99": mm.get("kv_cold_read_p99_ms") if mm else None,
            "moves": r.watermark_moves + self.offs["moves"],
            "migrations": wu["migrations"] + self.offs["migrations"],
            "promotions": wu["promotions"] + self.offs["promotions"],
            "alerts": self.c["alerts_in_drill"] + self.c["alerts_outside"],
            "rss": lib.rss_bytes(), "rss_parts": rss_parts(), "mount_rss": lib.rss_bytes(self.vol.pid) if self.vol.pid else None,
        }
        self.rows.append(row)
        mk.update(steps=self.c["steps"], hits=self.c["hits"], reads=len(self.cold_lat), ev_sum=ev_sum, ev_n=ev_n)
        if mm:
            mk.update(w_sum=mm.get("kv_cold_write_ms_sum", 0.0), w_n=mm.get("kv_cold_write_ms_count", 0.0))
        if now > 0:
            self._tick_alerts(cold_write)

    # --- figures --------------------------------------------------------------------------
    def _results(self) -> dict[str, Any]:
        c, rows, MiB = self.c, self.rows, 1 << 20
        m1 = self._mount_metrics()
        eng: dict[str, Any] = {}
        if m1:  # the day's reads inside the mount (kv_cold_read_ms); exact at the 1 ms bound
            b0 = lib.histogram_buckets(self.m0, "kv_cold_read_ms")
            d = {k: v - b0.get(k, 0.0) for k, v in lib.histogram_buckets(m1, "kv_cold_read_ms").items()}
            n = d.get(math.inf, 0.0)
            gauge = [r["engine_p99"] for r in rows if r["engine_p99"]]
            eng = {"reads": n, "p50": lib.histogram_quantile(0.5, d), "p99": lib.histogram_quantile(0.99, d),
                   "within_1ms": d.get(1.0, 0.0) / n if n else None,
                   "gauge_end": m1.get("kv_cold_read_p99_ms"), "gauge_max": max(gauge, default=None)}
        ev: dict[str, Any] = dict.fromkeys(("n", "mean", "p99"))
        evb, ev_sum, ev_n = lib.local_histogram("warm_evict_latency")
        d = {k: v - self.ev0[0].get(k, 0.0) for k, v in evb.items()}
        n = ev_n - self.ev0[2]
        if n:
            ev = {"n": int(n), "mean": (ev_sum - self.ev0[1]) / n, "p99": lib.histogram_quantile(0.99, d)}
        base = rows[max(1, len(rows) // 10)]  # after the first ~2.4 simulated hours (warm-up)
        later = [r["rss"] for r in rows if r["h"] >= base["h"] and r["rss"]]
        rss = {"start": base["rss"], "end": rows[-1]["rss"], "max": max(later),
               "first": rows[0]["rss"], "at_h": base["h"]}
        rss["growth"] = rss["max"] - rss["start"]
        rss["flat"] = rss["growth"] <= max(0.05 * rss["start"], 16 * MiB)
        # by real time: RSS at 2, 5 and 10 minutes (those the run reached) and at the end
        at = {m: next((r["rss"] for r in rows if r.get("t", 0) >= m * 60 and r["rss"]), None)
              for m in RSS_MARKS_MIN}
        rss["at_min"] = {m: v for m, v in at.items() if v is not None}
        rss["parts_at_min"] = {m: next((r.get("rss_parts") for r in rows if r.get("t", 0) >= m * 60), None)
                               for m in rss["at_min"]}
        rss["parts_end"] = rows[-1].get("rss_parts")
        for m, n in self.__dict__.get("_marks", {}).items():
            if rss["parts_at_min"].get(m) is not None:
                rss["parts_at_min"][m]["tensors"] = n
        rss["end_min"] = rows[-1].get("t", 0) / 60
        rss["heap_trims"] = dict(self.trims)
        first = next(iter(rss["at_min"].values()), None)
        rss["growth_since_2min"] = rows[-1]["rss"] - first if first is not None else None
        snaps = self.__dict__.get("_snaps", {})
        if snaps:
            end = tracemalloc.take_snapshot()
            top = end.compare_to(snaps[min(snaps)], "lineno")[:12]
            rss["heap_growth"] = [f"{st.size_diff / MiB:+.2f} MiB in {st.count_diff:+d} blocks: "
                                  f"{st.traceback.format()[0].strip()}" for st in top]
        mrss = [r["mount_rss"] for r in rows if r["mount_rss"]]
        p50, p99 = self.cold_lat.quantiles()
        steps = c["steps"]
        res: dict[str, Any] = {
            "profile": self.w.name, "minutes": self.args.minutes, "speed": self.clock.speed,
            "real_s": time.perf_counter() - self.clock.t0, "peak_sessions": self.peak,
            "budget_bytes": self.budget, "warm_cap": self.w.warm_cap, "counts": c,
            "hit_rate": c["hits"] / steps if steps else None,
            "cold_reads": len(self.cold_lat), "cold_read_p50_ms": p50, "cold_read_p99_ms": p99,
            "cold_kind": getattr(self, "cold_kind", "files"),
            "engine_cold_read": eng, "warm_evict": ev,
            "hot_peak": max(r["hot_ratio"] for r in rows), "warm_peak": max(r["warm_ratio"] for r in rows),
            "cold_used_end": rows[-1]["cold_used"],
            "moves": rows[-1]["moves"], "migrations": rows[-1]["migrations"],
            "promotions": rows[-1]["promotions"], "rss": rss,
            "mount_rss": {"start": mrss[0], "end": mrss[-1], "max": max(mrss)} if mrss else None,
            "mismatches": sum(c[k] for k in ("bad_recall", "bad_window", "bad_stored", "bad_resume_gen")),
            "events": self.drill_log + [f"{rule} fired {len(hs)} times outside the drills ({hs[0]:05.2f} h to "
                                        f"{hs[-1]:05.2f} h)" for rule, hs in self.outside.items()],
            "drills": self.drills, "rows": rows,
        }
        res["goals"] = [
            ("OOMs", c["oom"] == 0), ("errors", c["errors"] == 0),
            ("byte mismatches", res["mismatches"] == 0),
            ("resumed sessions continue identically", c["check_resume_gen"] > 0 and c["bad_resume_gen"] == 0),
            ("hot hit rate >= 95 %", res["hit_rate"] is not None and res["hit_rate"] >= 0.95),
            # as the agent sees it; a day whose agent never waited on a cold read missed nothing
            ("cold read p99 < 1 ms", p99 is None or p99 < 1.0),
            ("flat RSS", rss["flat"]),
        ]
        return res

