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


def ratio(a, b) -> str:
    if a is None or b is None or b <= 0 or a <= 0:
        return "–"  # a negative overhead is below the noise: no ratio
    return f"{a / b:.1f}x"


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
            out.append(f"### {app}, {n} rank{'s' if n > 1 else ''} (baseline iteration {fmt(base, 2)} s)\n")
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
                parts = [f"{other}/deepfreeze {ratio(rows.get(other, {}).get(key), df.get(key))}"
                         for other in ("keras-default", "tf-async", "veloc-single", "veloc-sharded") if other in rows]
                paper = PAPER.get("nt3" if app.startswith("nt3") else app, {}).get(key)
                if paper:
                    parts.append("paper (8 nodes; ResNet-50 blocking: 1 node): " +
                                 ", ".join(f"{k} {v}x" for k, v in paper.items()))
                lines.append(f"- {label}: " + "; ".join(parts))
            memcpy = df.get("memcpy_shard_s")
            if memcpy and df.get("runtime_overhead_s") is not None:
                lines.append(f"- deepfreeze overhead / memcpy of one shard ({memcpy * 1e3:.0f} ms): "
                             f"{df['runtime_overhead_s'] / memcpy:.1f}x (target <= 2x)")
            if df.get("flush_GBps") and lim.get("write_GBps"):
                lines.append(f"- deepfreeze flush / raw write: {100 * df['flush_GBps'] / lim['write_GBps']:.0f} % "
                             "(target >= 80 %)")
            out.append("\n" + "\n".join(lines) + "\n")
    errors = [r for r in doc["runs"] if r.get("error")]
    if errors:
        out.append("Failed runs: " + "; ".join(f"{r['app']} x{r['ranks']} {r['approach']}: {r['error'][:120]}"
                                               for r in errors))
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(report(json.load(f)))
