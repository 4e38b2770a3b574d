"""Markdown tables from a bench result: the metrics per app and rank count, the ratios of
``deepfreeze`` against ``keras-default`` and ``tf-async``, and the issue's targets.

    python -m experiments.report experiments/results/bench.json > /tmp/table.md
"""
from __future__ import annotations

import json
import sys

METRICS = [("preparation_s", "prep (s)"), ("blocking_s", "blocking (s)"), ("runtime_overhead_s", "overhead (s)"),
           ("extra_per_interval_s", "per interval (s)"), ("time_to_durable_s", "to durable (s)"),
           ("flush_GBps", "flush (GB/s)")]
#: the paper's ratios (DeepFreeze = "VELOC-Opt", section V): other approach / DeepFreeze
PAPER = {"nt3": {"blocking_s": {"keras-default": 11.1, "veloc-single": 10.6, "veloc-sharded": 3.8},
                 "runtime_overhead_s": {"keras-default": 6.5, "veloc-single": 6.2, "veloc-sharded": 2.5}},
         "resnet50": {"blocking_s": {"keras-default": 4.7, "veloc-single": 1.5, "veloc-sharded": 2.2},
                      "runtime_overhead_s": {"keras-default": 5.15, "veloc-single": 2.2, "veloc-sharded": 2.3}}}


def fmt(x, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def ratio(a, b, b_se=None) -> str:
    """``a / b``; when ``b`` (deepfreeze's overhead) is within one standard error of 0, a lower
    bound ``a / (b + se)`` marked ``>=``."""
    if a is None or b is None or a <= 0:
        return "–"
    if b_se is not None and b < b_se:
        return f">={a / (max(b, 0) + b_se):.1f}x"
    if b <= 0:
        return "–"
    return f"{a / b:.1f}x"


#: the issue's target columns (app, ranks)
TARGET_COLUMNS = [("nt3-weights", 2), ("nt3-weights", 3), ("resnet50", 2), ("resnet50", 4), ("nt3", 2), ("nt3", 3)]


def _within(x, se) -> bool:
    return x is not None and se is not None and x < se


def targets(doc: dict, write_GBps: float | None) -> str:
    """The issue's targets per (app, ranks), held or missed, from the rows of the run."""
    runs = {(r["app"], r["ranks"], r["approach"]): r for r in doc["runs"] if not r.get("error")}
    cols = [c for c in TARGET_COLUMNS if (c[0], c[1], "deepfreeze") in runs]
    if not cols:
        return ""
    out = ["| target | " + " | ".join(f"{a} {n} ranks" for a, n in cols) + " |", "|---" * (len(cols) + 1) + "|"]

    def cell(ok: bool, text: str) -> str:
        return ("holds: " if ok else "missed: ") + text

    rows = {"blocking >= 20x below keras-default": [], "runtime overhead >= 5x below keras-default": [],
            "runtime overhead below tf-async": [], "runtime overhead <= 2x memcpy of a shard": [],
            "flush >= 80 % of raw write": [], "training time per checkpoint interval (background work included) "
            "vs keras-default": []}
    for app, n in cols:
        df, kd, ta = (runs.get((app, n, a), {}) for a in ("deepfreeze", "keras-default", "tf-async"))
        b, kb = df.get("blocking_s"), kd.get("blocking_s")
        rows["blocking >= 20x below keras-default"].append(
            cell(kb >= 20 * b, f"{ratio(kb, b)} ({fmt(b)} vs {fmt(kb)} s)") if b is not None and kb is not None
            else "–")
        o, se = df.get("runtime_overhead_s"), df.get("runtime_overhead_se_s")
        ko, to, tse = kd.get("runtime_overhead_s"), ta.get("runtime_overhead_s"), ta.get("runtime_overhead_se_s")
        hi = None if o is None else max(o, 0) + (se or 0)  # deepfreeze's overhead, upper end of 1 s.e.
        ose = f"{fmt(o)} ± {fmt(se, 2)} s" if se is not None else f"{fmt(o)} s"
        rows["runtime overhead >= 5x below keras-default"].append(
            "–" if o is None or ko is None else
            cell(ko >= 5 * max(o, 0) and (not _within(o, se) or ko >= 5 * hi),
                 f"{ratio(ko, o, se)} ({ose} vs {fmt(ko)} s)") if ko > 0 else "–")
        rows["runtime overhead below tf-async"].append(
            "–" if o is None or to is None else
            cell(o < to, f"{ose} vs {fmt(to)}" + (f" ± {fmt(tse, 2)}" if tse is not None else "") + " s" +
                 (" (within the standard errors)" if se is not None and tse is not None and abs(o - to) < se + tse
                  else "")))
        m = df.get("memcpy_shard_s")
        rows["runtime overhead <= 2x memcpy of a shard"].append(
            "–" if o is None or not m else
            cell(hi <= 2 * m, f"{ose} vs memcpy {1e3 * m:.0f} ms" +
                 (" (overhead not resolvable: within one standard error of 0)" if _within(o, se) else
                  f" ({o / m:.1f}x)")))
        f = df.get("flush_GBps")
        rows["flush >= 80 % of raw write"].append(
            "–" if not f or not write_GBps else cell(f >= 0.8 * write_GBps, f"{100 * f / write_GBps:.0f} % "
                                                     f"({fmt(f, 2)} GB/s; durable after {fmt(df.get('time_to_durable_s'), 1)} s)"))
        ei, ke = df.get("extra_per_interval_s"), kd.get("extra_per_interval_s")
        rows["training time per checkpoint interval (background work included) vs keras-default"].append(
            "–" if ei is None or ke is None else f"{fmt(ei, 2)} vs {fmt(ke, 2)} s ({ratio(ke, ei)})")
    for name, cells in rows.items():
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def report(doc: dict) -> str:
    out = []
    lim = dict(doc.get("limits", {}))
    samples = [x for inv in doc.get("settings", {}).get("invocations", [])
               for x in inv.get("limits", {}).get("write_samples_GBps", [])] + lim.get("write_samples_GBps", [])
    if samples:  # the best write seen in any invocation of the run: the disk's raw capability
        lim["write_GBps"] = max(samples)
    out.append(f"Limits measured in the run: memcpy {fmt(lim.get('memcpy_GBps'), 2)} GB/s "
               f"({fmt(lim.get('memcpy_alloc_GBps'), 2)} GB/s into fresh memory), sequential write with fsync "
               f"{fmt(lim.get('write_GBps'), 2)} GB/s (best of {len(samples) or 1} samples, "
               f"{fmt(min(samples) if samples else None, 2)} GB/s worst).\n")
    runs = [r for r in doc["runs"] if not r.get("error")]
    for app in sorted({r["app"] for r in runs}):
        for n in sorted({r["ranks"] for r in runs if r["app"] == app}):
            rows = {r["approach"]: r for r in runs if r["app"] == app and r["ranks"] == n}
            base = rows.get("none", {}).get("baseline_iter_s")
            out.append(f"#### {app}, {n} rank{'s' if n > 1 else ''} (baseline iteration {fmt(base, 2)} s)\n")
            out.append("| approach | " + " | ".join(h for _, h in METRICS) + " | bytes/rank (MB) |")
            out.append("|---" * (len(METRICS) + 2) + "|")
            for name, r in rows.items():
                if name == "none":
                    continue
                se = r.get("runtime_overhead_se_s")
                cells = [fmt(r.get(k)) + (f" ± {se:.2f}" if k == "runtime_overhead_s" and se is not None else "")
                         for k, _ in METRICS]
                out.append(f"| {name} | " + " | ".join(cells) + f" | {fmt((r.get('bytes_per_rank') or 0) / 1e6, 0)} |")
            df = rows.get("deepfreeze", {})
            lines = []
            for key, label in (("blocking_s", "blocking"), ("runtime_overhead_s", "runtime overhead"),
                               ("extra_per_interval_s", "training time per checkpoint interval")):
                se = df.get("runtime_overhead_se_s") if key == "runtime_overhead_s" else None
                parts = [f"{other}/deepfreeze {ratio(rows.get(other, {}).get(key), df.get(key), se)}"
                         for other in ("keras-default", "tf-async", "veloc-single", "veloc-sharded") if other in rows]
                paper = PAPER.get("nt3" if app.startswith("nt3") else app, {}).get(key)
                if paper:
                    parts.append("paper (8 nodes; ResNet-50 blocking: 1 node): " +
                                 ", ".join(f"{k} {v}x" for k, v in paper.items()))
                lines.append(f"- {label}: " + "; ".join(parts))
            memcpy, o, se = df.get("memcpy_shard_s"), df.get("runtime_overhead_s"), df.get("runtime_overhead_se_s")
            if memcpy and o is not None:
                lines.append(f"- deepfreeze overhead / memcpy of one shard ({memcpy * 1e3:.0f} ms): " +
                             (f"not resolvable (overhead {o:.3f} ± {se:.3f} s, within one standard error of 0)"
                              if _within(o, se) else f"{o / memcpy:.1f}x") + " (target <= 2x)")
            if df.get("flush_GBps") and lim.get("write_GBps"):
                lines.append(f"- deepfreeze flush / raw write: {100 * df['flush_GBps'] / lim['write_GBps']:.0f} % "
                             "(target >= 80 %)")
            out.append("\n" + "\n".join(lines) + "\n")
    table = targets(doc, lim.get("write_GBps"))
    if table:
        out.append("### The issue's targets\n\n" + table + "\n")
    errors = [r for r in doc["runs"] if r.get("error")]
    if errors:
        out.append("Failed runs: " + "; ".join(f"{r['app']} x{r['ranks']} {r['approach']}: {r['error'][:120]}"
                                               for r in errors))
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(report(json.load(f)))
