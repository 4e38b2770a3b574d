"""Tables, targets and the PNG of ``experiments/torch_dcp.py`` (issue 34), from its JSON.

Every figure is a ``{"mean", "se", "n"}`` over interleaved repetitions (see torch_dcp's
docstring); a comparison whose difference is within one standard error is printed "not
resolvable".
"""
from __future__ import annotations

import math

__all__ = ["DCP_ASYNC", "fmt", "table", "side_by_side", "verdict", "ratio", "targets", "profiles", "plot"]

DCP_ASYNC = ["dcp-async-thread", "dcp-async-process", "dcp-async-thread-staged", "dcp-async-process-staged"]


def fmt(s: "dict | float | None", scale: float = 1.0, digits: int = 3) -> str:
    if isinstance(s, dict):
        if s.get("mean") is None:
            return "–"
        e = f" ± {s['se'] * scale:.{digits}f}" if s.get("se") is not None else ""
        return f"{s['mean'] * scale:.{digits}f}{e}"
    return "–" if s is None else f"{s * scale:.{digits}f}"


def _cells(doc: dict) -> list[tuple[str, int, str]]:
    return list(dict.fromkeys((r["model"], r["ranks"], r.get("mode", "none")) for r in doc["runs"]))


def _rows(doc: dict, m: str, n: int, mode: str) -> dict[str, dict]:
    return {r["approach"]: r for r in doc["runs"]
            if r["model"] == m and r["ranks"] == n and r.get("mode", "none") == mode}


def table(doc: dict) -> str:
    lines = []
    for m, n, mode in _cells(doc):
        rows = _rows(doc, m, n, mode)
        other = 2 if n == 1 else 1
        r0 = next(iter(rows.values()))
        lines += [f"#### {m}, {n} rank{'s' if n > 1 else ''}, {'idle' if mode == 'none' else 'busy: ' + mode} "
                  f"({r0.get('reps', 1)} repetitions x {r0.get('measured_per_rep', '?')} checkpoints, every "
                  f"{r0.get('every', '?')} iterations)", "",
                  "| approach | baseline iteration (s) | stall (s) | first ckpt stall (s) | slowdown / interval "
                  "| to durable (s) | CPU-s / ckpt | write waits | extra memory (GB) "
                  f"| restore x{n} (s) | restore x{other} (s) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for a, r in rows.items():
            rs = {x["restore_ranks"]: x for x in doc["restore"]
                  if x["model"] == m and x["ranks"] == n and x["approach"] == a and mode == "none"}

            def rst(k: int) -> str:
                x = rs.get(k)
                return "–" if x is None else f"{x['restore_s']:.3f}" + ("" if x["bit_exact"] else " (NOT exact)")
            waits = "–" if "write_waits" not in r else "+".join(str(w) for w in r["write_waits"])
            lines.append(f"| {a} | {fmt(r['baseline_iter_s'])} | {fmt(r['stall_s'])} | {fmt(r.get('first_stall_s'))} "
                         f"| {fmt(r['slowdown'], 100, 1)} % | {fmt(r['durable_s'])} | {fmt(r['cpu_s_per_ckpt'], 1, 2)} "
                         f"| {waits} | {fmt(r['mem_extra_GB'], 1, 2)} | {rst(n)} | {rst(other)} |")
        lines.append("")
    lines += side_by_side(doc) + targets(doc) + profiles(doc)
    return "\n".join(lines)


def profiles(doc: dict, n: int = 10) -> list[str]:
    """``--profile``: rank 0's top functions by own CPU time per DeepFreeze thread, and the
    backend's CPU per thread."""
    out = []
    for r in doc["runs"]:
        p = (r.get("profile") or {}).get("rank0")
        if not p:
            continue
        out += [f"#### Profile: {r['model']}, {r['ranks']} ranks, {r['mode']}, {r['approach']} (rank 0, one "
                f"repetition of {r.get('measured_per_rep')} checkpoints; CPU seconds)", "",
                "| thread | function | calls | own CPU (s) | cumulative (s) |", "|---|---|---|---|---|"]
        for th in ("training-hooks", "capture", "writer"):
            if th in p:
                out.append(f"| {th} (total {p[th]['total_s']:.3f}) | | | | |")
                out += [f"| | `{f}` | {c} | {t:.4f} | {cum:.4f} |" for f, c, t, cum in p[th]["top"][:n]]
        bt = p.get("backend_threads_cpu_s")
        if bt:
            out.append("| backend threads (tid: CPU s) | " + ", ".join(f"{k}: {v:.2f}" for k, v in bt.items())
                       + " | | | |")
        out.append("")
    return out


def side_by_side(doc: dict) -> list[str]:
    """Idle and busy modes next to each other, per model (largest world size)."""
    out = []
    for m in dict.fromkeys(r["model"] for r in doc["runs"]):
        n = max(r["ranks"] for r in doc["runs"] if r["model"] == m)
        modes = [c[2] for c in _cells(doc) if c[0] == m and c[1] == n]
        if len(modes) < 2:
            continue
        out += [f"#### {m}, {n} ranks: idle and busy side by side (mean ± SE over repetitions)", "",
                "| figure | approach | " + " | ".join("idle" if x == "none" else x for x in modes) + " |",
                "|---|---|" + "---|" * len(modes)]
        for key, label, scale, digits in [("cpu_s_per_ckpt", "CPU-s / ckpt", 1, 2), ("stall_s", "stall (s)", 1, 3),
                                          ("slowdown", "slowdown (%)", 100, 1), ("durable_s", "to durable (s)", 1, 3)]:
            for a in dict.fromkeys(a for x in modes for a in _rows(doc, m, n, x)):
                cells_ = [_rows(doc, m, n, x).get(a) for x in modes]
                out.append(f"| {label} | {a} | " + " | ".join("–" if c is None else fmt(c[key], scale, digits)
                                                               for c in cells_) + " |")
        out.append("")
    return out


def verdict(d: "dict | None", r: "dict | None", factor: float = 1.0) -> str:
    """``d <= factor * r`` for two ``{mean, se}``: met, missed, or not resolvable (the difference
    within one standard error of it)."""
    if not d or not r or d.get("mean") is None or r.get("mean") is None:
        return "–"
    diff = d["mean"] - factor * r["mean"]
    err = math.hypot(d.get("se") or 0.0, factor * (r.get("se") or 0.0))
    if abs(diff) < err:
        return "not resolvable"
    return "met" if diff <= 0 else "missed"


def ratio(d: dict, r: dict, limit: float) -> str:
    """``d / r`` ± its SE, and whether it is at most ``limit`` (within one SE: not resolvable)."""
    if not d or not r or not d.get("mean") or not r.get("mean"):
        return "–"
    q = d["mean"] / r["mean"]
    e = abs(q) * math.hypot((d.get("se") or 0) / d["mean"], (r.get("se") or 0) / r["mean"])
    v = "not resolvable" if abs(q - limit) < e else ("met" if q <= limit else "missed")
    return f"{q:.2f} ± {e:.2f}x: {v}"


def targets(doc: dict) -> list[str]:
    """Issue 34's targets at the largest world size, each on the per-repetition statistic."""
    out = ["#### Targets (issue 34; mean ± SE over repetitions; not resolvable: the difference is within one SE)",
           "", "| model | mode | target | DeepFreeze | reference | verdict |", "|---|---|---|---|---|---|"]

    def row(m, mode, what, d, r, factor=1.0, label=None):
        sc, dg = (100, 1) if what.startswith("slowdown") else (1, 3)
        out.append(f"| {m} | {'idle' if mode == 'none' else mode} | {what} | {fmt(d, sc, dg)} | {fmt(r, sc, dg)}"
                   f"{'' if label is None else ' (' + label + ')'} | {verdict(d, r, factor)} |")
    for m in dict.fromkeys(r["model"] for r in doc["runs"]):
        n = max(r["ranks"] for r in doc["runs"] if r["model"] == m)
        idle = _rows(doc, m, n, "none")
        for mode in [c[2] for c in _cells(doc) if c[0] == m and c[1] == n]:
            rows = _rows(doc, m, n, mode)
            df, ts = rows.get("deepfreeze"), rows.get("torch-save")
            if df is None:
                continue
            if ts:
                row(m, mode, "CPU-s / ckpt <= torch.save's", df["cpu_s_per_ckpt"], ts["cpu_s_per_ckpt"])
            if mode != "none" and idle.get("deepfreeze"):
                out.append(f"| {m} | {mode} | CPU-s / ckpt busy <= 1.2 x idle | {fmt(df['cpu_s_per_ckpt'])} "
                           f"| {fmt(idle['deepfreeze']['cpu_s_per_ckpt'])} (idle) "
                           f"| {ratio(df['cpu_s_per_ckpt'], idle['deepfreeze']['cpu_s_per_ckpt'], 1.2)} |")
            asyncs = [rows[a] for a in DCP_ASYNC if a in rows and rows[a]["stall_s"].get("mean") is not None]
            if mode != "none" or m == "mlp":
                for key, what in [("stall_s", "stall (s)"), ("slowdown", "slowdown (%)")]:
                    if mode != "none" and asyncs:
                        b = min(asyncs, key=lambda r: r[key]["mean"])
                        row(m, mode, f"{what} <= best DCP async's", df[key], b[key], label=b["approach"])
                    if ts:
                        row(m, mode, f"{what} <= torch.save's", df[key], ts[key])
            if m == "gpt2" and mode == "none":
                dcps = [r for a, r in rows.items() if a.startswith("dcp") and r["durable_s"].get("mean") is not None]
                if dcps:
                    b = min(dcps, key=lambda r: r["durable_s"]["mean"])
                    row(m, mode, "time to durable <= DCP's", df["durable_s"], b["durable_s"], label=b["approach"])
            if mode != "none":
                out.append(f"| {m} | {mode} | time to durable, write waits (reported) | {fmt(df['durable_s'])}, "
                           f"waits {'+'.join(str(w) for w in df.get('write_waits', []))} | – | – |")
    out += ["", "First checkpoint's stall (the warm-up, a new checkpointer each repetition; first repetition / "
            "mean ± SE):", "", "| model | ranks | mode | " + " | ".join(doc["settings"]["approaches"]) + " |",
            "|---|---|---|" + "---|" * len(doc["settings"]["approaches"])]
    for m, n, mode in _cells(doc):
        rows = _rows(doc, m, n, mode)
        out.append(f"| {m} | {n} | {mode} | " + " | ".join(
            "–" if a not in rows or "first_stall_s" not in rows[a] else
            f"{rows[a]['first_stall_first_rep_s']:.3f} / {fmt(rows[a]['first_stall_s'])}"
            for a in doc["settings"]["approaches"]) + " |")
    return out + [""]


def plot(doc: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(dict.fromkeys(r["model"] for r in doc["runs"]))
    metrics = [("stall_s", "stall (s)"), ("durable_s", "time to durable (s)"), ("cpu_s_per_ckpt", "CPU-s / ckpt")]
    if not models:
        return
    fig, axes = plt.subplots(len(models), len(metrics), figsize=(5.5 * len(metrics), 3.2 * len(models)), squeeze=False)
    approaches = list(dict.fromkeys(r["approach"] for r in doc["runs"]))
    for i, m in enumerate(models):
        groups = [(n, mode) for mm, n, mode in _cells(doc) if mm == m]
        for j, (key, label) in enumerate(metrics):
            ax = axes[i][j]
            w = 0.8 / max(1, len(approaches))
            for k, a in enumerate(approaches):
                ys, es = [], []
                for n, mode in groups:
                    r = _rows(doc, m, n, mode).get(a)
                    v = None if r is None else r[key]
                    ys.append(v["mean"] if isinstance(v, dict) else v)
                    es.append((v.get("se") or 0) if isinstance(v, dict) else 0)
                xs = [x + k * w for x in range(len(groups))]
                ax.bar(xs, [y or 0 for y in ys], w, yerr=es, label=a)
            ax.set_xticks([x + 0.4 - w / 2 for x in range(len(groups))],
                          [f"x{n} {'idle' if mode == 'none' else mode}" for n, mode in groups], fontsize=7)
            ax.set_title(f"{m}: {label} (mean ± SE over repetitions)", fontsize=9)
            if key != "cpu_s_per_ckpt":
                ax.set_yscale("symlog", linthresh=0.05)  # linear below 50 ms: values within noise of 0
                ax.set_ylim(bottom=0)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
