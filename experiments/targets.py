"""The targets table of issue 12 ("checkpoints at the hardware limit"), from the result files.

    python -m experiments.targets [--results experiments/results] > /tmp/targets.md

Reads ``bench.json`` (blocking, training time per checkpoint interval, quiet hooks, CPU per
checkpoint), ``hooks.json`` (blocking against the tensor count), ``capture.json`` (capture vs
memcpy), ``flush.json`` (flush vs raw write) and ``memory.json`` (peak memory added). A ratio
"holds" only beyond one standard error; within it the row says "not resolvable".
"""
from __future__ import annotations

import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(results: str, name: str) -> dict | None:
    path = os.path.join(results, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def ms(x: float | None) -> str:
    return "–" if x is None else f"{1e3 * x:.2f} ms"


def verdict(ok: bool | None) -> str:
    return {True: "holds", False: "missed", None: "not resolvable"}[ok]


def blocking_rows(bench: dict) -> list[str]:
    runs = {(r["app"], r["ranks"], r["approach"]): r for r in bench.get("runs", []) if not r.get("error")}
    out = []
    for app in ("nt3-weights", "resnet50", "nt3"):
        for (a, n, ap), r in sorted(runs.items()):
            if a != app or ap != "deepfreeze" or r.get("blocking_median_s") is None:
                continue
            med, p90 = r["blocking_median_s"], r.get("blocking_p90_s")
            if app == "nt3":
                target, ok = "(reported only)", None
            elif n <= 2:
                target, ok = "median <= 1 ms, p90 <= 3 ms", med <= 1e-3 and (p90 is not None and p90 <= 3e-3)
            else:
                target, ok = "median <= 1 ms", med <= 1e-3
            out.append(f"| blocking, {app} x{n} | {target} | median {ms(med)}, p90 {ms(p90)} "
                       f"({r.get('checkpoint_samples')} samples) | {verdict(ok) if app != 'nt3' else 'reported'} |")
    return out


def interval_rows(bench: dict) -> list[str]:
    runs = {(r["app"], r["ranks"], r["approach"]): r for r in bench.get("runs", []) if not r.get("error")}
    out = []
    for app in ("nt3-weights", "resnet50"):
        for n in sorted({k[1] for k in runs if k[0] == app}):
            d = runs.get((app, n, "deepfreeze"))
            if d is None or d.get("extra_per_interval_s") is None:
                continue
            x, se = d["extra_per_interval_s"], d.get("extra_per_interval_se_s") or 0.0
            cells = []
            oks = []
            for other, factor in (("keras-default", 3.0), ("tf-async", 1.0)):
                o = runs.get((app, n, other))
                if o is None or o.get("extra_per_interval_s") is None:
                    continue
                y, yse = o["extra_per_interval_s"], o.get("extra_per_interval_se_s") or 0.0
                # holds if y - yse >= factor * (x + se); missed if y + yse < factor * (x - se); else not resolvable
                if y - yse >= factor * (x + se):
                    ok = True
                elif y + yse < factor * (x - se):
                    ok = False
                else:
                    ok = None
                oks.append(ok)
                ratio = f"{y / x:.1f}x" if x > 0 else "–"
                cells.append(f"{other} {y:.3f} ± {yse:.3f} s ({ratio}, target {'>= 3x' if factor > 1 else 'below'}: "
                             f"{verdict(ok)})")
            cpu = []
            for key, label in (("writer_cpu_per_ckpt_s", "writer"), ("backend_cpu_per_ckpt_s", "backend")):
                if d.get(key) is not None:
                    cpu.append(f"{label} {d[key]:.2f}")
            none = runs.get((app, n, "none"))
            if d.get("machine_kernel_per_iter_s") is not None and none and none.get("machine_kernel_per_iter_s"):
                every = bench.get("settings", {}).get("schedule", {}).get(app, {}).get("every", 5)
                k = (d["machine_kernel_per_iter_s"] - none["machine_kernel_per_iter_s"]) * every
                cpu.append(f"kernel (machine) {k:.2f}")
            total = "; ".join(cells)
            overall = None if None in oks else all(oks) if oks else None
            out.append(f"| per checkpoint interval, {app} x{n} | >= 3x below keras-default and below tf-async | "
                       f"deepfreeze {x:.3f} ± {se:.3f} s; {total}; CPU s per checkpoint: {', '.join(cpu) or '–'} | "
                       f"{verdict(overall) if n == 2 else 'reported'} |")
    return out


def quiet_rows(bench: dict, hooks: dict | None) -> list[str]:
    out = []
    for r in bench.get("runs", []):
        if r.get("approach") == "deepfreeze" and r.get("quiet_median_s") is not None:
            out.append(f"| quiet batch hooks, {r['app']} x{r['ranks']} | median <= 0.5 ms | "
                       f"{ms(r['quiet_median_s'])} ({r.get('quiet_samples')} batches) | "
                       f"{verdict(r['quiet_median_s'] <= 0.5e-3)} |")
    if hooks:
        for r in hooks["runs"]:
            out.append(f"| quiet batch hooks, synthetic {r['model_tensors']} tensors x1 | median <= 0.5 ms | "
                       f"{ms(r['quiet_median_s'])} ({r['quiet_batches']} batches) | "
                       f"{verdict(r['quiet_median_s'] <= 0.5e-3)} |")
    return out


def slope_rows(hooks: dict | None) -> list[str]:
    if not hooks or hooks.get("slope_s_per_tensor") is None:
        return []
    pts = ", ".join(f"{r['model_tensors']}: {ms(r['blocking_median_s'])}" for r in hooks["runs"])
    s = hooks["slope_s_per_tensor"]
    return [f"| blocking vs tensor count (synthetic, 1 rank) | slope <= 1 us per tensor | {s * 1e6:.3f} us per "
            f"tensor (medians: {pts}) | {verdict(s <= 1e-6)} |"]


def capture_rows(cap: dict | None) -> list[str]:
    out = []
    for r in (cap or {}).get("runs", []):
        ok = True if r["ratio"] + r.get("ratio_se", 0) <= 1.5 else (False if r["ratio"] - r.get("ratio_se", 0) > 1.5
                                                                     else None)
        out.append(f"| capture ({r['kind']}), {r['app']} x{r['ranks']} ({r['pieces']} pieces, "
                   f"{r['bytes'] / 1e6:.0f} MB) | <= 1.5x memcpy | {ms(r['capture_s'])} vs {ms(r['memcpy_s'])}: "
                   f"{r['ratio']:.2f}x ± {r.get('ratio_se', 0):.2f}"
                   + (f"; into {cap.get('max_inflight', 2) + 1} buffers in turn {ms(r['memcpy_rotating_s'])}: "
                      f"{r['ratio_rotating']:.2f}x ± {r['ratio_rotating_se']:.2f}" if "ratio_rotating" in r else "")
                   + " | "
                   f"{verdict(ok) if r['kind'] == 'native' or len(cap['runs']) == 1 else 'reported (fallback)'} |")
    return out


def flush_rows(flush: dict | None) -> list[str]:
    """From experiments/flush.py's pooled "after" runs: efficiency against the raw write
    (``write_rates``' way: one write + fsync, the target's reference) and against the fastest
    raw write measured (1 MiB writes with early write-back + fsync)."""
    out = []
    sizes = ((flush or {}).get("pooled", {}).get("after") or {}).get("sizes", [])
    for r in sizes:
        mib = r["mib"]
        big = mib >= 256
        cells, oks = [], []
        for key, label in (("flush_efficiency", "raw"), ("flush_efficiency_vs_best", "best raw")):
            e, se = r[key], r.get(key + "_stderr") or 0.0
            ok = True if e - se >= 0.9 else False if e + se < 0.9 else None
            oks.append(ok)
            cells.append(f"{100 * e:.0f} ± {100 * se:.0f} % of {label} ({verdict(ok)})" if big else
                         f"{100 * e:.0f} ± {100 * se:.0f} % of {label}")
        out.append(f"| flush, {mib:.0f} MiB shard (n={r['n']}) | {'>= 90 % of raw write' if big else 'report'} | "
                   f"{r['flush_GBps']:.2f} GB/s: {'; '.join(cells)} | "
                   f"{f'{verdict(oks[0])} vs raw, {verdict(oks[1])} vs best raw' if big else 'reported'} |")
    fixed = ((flush or {}).get("pooled", {}).get("after") or {}).get("fixed_cost", {})
    if fixed.get("flush_ms"):
        f, raw = fixed["flush_ms"], fixed.get("raw_ms", {})
        out.append(f"| flush, fixed cost per version (intercept over 1-64 MiB) | report | {f['intercept']:.1f} ± "
                   f"{f['stderr']:.1f} ms (raw write {raw.get('intercept', float('nan')):.1f} ± "
                   f"{raw.get('stderr', float('nan')):.1f} ms) | reported |")
    return out


def memory_rows(mem: dict | None) -> list[str]:
    out = []
    for key, r in sorted((mem or {}).items()):
        if not isinstance(r, dict) or "added_mean_B" not in r:
            continue
        if r["added_mean_B"] is None:
            out.append(f"| memory added, {key} | <= (max_inflight+1) x shard + 100 MB | failed: {r.get('errors')} | "
                       "missed |")
            continue
        se = r.get("added_se_B") or 0.0
        ok = r["added_mean_B"] + se <= r["bound_B"]
        out.append(f"| memory added, {r['app']} x{r['ranks']} | <= (max_inflight+1) x shard + 100 MB = "
                   f"{r['bound_B'] / 1e6:.0f} MB | {r['added_mean_B'] / 1e6:.0f} ± {se / 1e6:.0f} MB "
                   f"({len(r['added_B'])} runs) | {verdict(ok)} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    bench = _load(args.results, "bench.json") or {}
    hooks = _load(args.results, "hooks.json")
    rows = (blocking_rows(bench) + slope_rows(hooks) + capture_rows(_load(args.results, "capture.json"))
            + interval_rows(bench) + flush_rows(_load(args.results, "flush.json"))
            + memory_rows(_load(args.results, "memory.json")) + quiet_rows(bench, hooks))
    print("| target | goal | measured | verdict |\n|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
