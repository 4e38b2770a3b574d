"""Statistics, tables and the PNGs of ``experiments/torch_stream_bench.py`` and
``experiments/torch_repo_bench.py`` (issue 35), from their JSON.

Every figure is a ``{"mean", "se", "n"}`` over interleaved repetitions (:func:`experiments.torch_dcp.stat`);
a ratio is the ratio of two such means, its standard error propagated from theirs
(:func:`speedup`), and a target whose distance to the ratio is within one standard error is
"not resolvable".
"""
from __future__ import annotations

import math

from experiments.torch_dcp import stat
from experiments.torch_dcp_report import fmt

__all__ = ["stat", "speedup", "at_most", "stream_table", "repo_table", "plot_bars", "MINE"]

#: the DeepFreeze approaches of the repository comparison: a load by id (traced) and by name (not traced)
MINE = ("deepfreeze", "deepfreeze-name")


def speedup(base: dict, mine: dict, target: "float | None") -> dict:
    """``base / mine`` (how many times ``mine`` is faster) ± its SE (first-order propagation of
    both means' SEs), and whether it is at least ``target`` (None: no target, verdict "–")."""
    if not base or not mine or not base.get("mean") or not mine.get("mean"):
        return {"mean": None, "se": None, "target": target, "verdict": "–"}
    q = base["mean"] / mine["mean"]
    e = abs(q) * math.hypot((base.get("se") or 0.0) / base["mean"], (mine.get("se") or 0.0) / mine["mean"])
    v = ("–" if target is None else "not resolvable" if abs(q - target) < e else
         "met" if q >= target else "missed")
    return {"mean": q, "se": e, "target": target, "verdict": v}


def at_most(s: dict, limit: float) -> str:
    """``s`` (a ``{mean, se}``) at most ``limit``: met, missed or not resolvable (within one SE)."""
    if not s or s.get("mean") is None:
        return "–"
    if abs(s["mean"] - limit) < (s.get("se") or 0.0):
        return "not resolvable"
    return "met" if s["mean"] <= limit else "missed"


def _x(r: dict) -> str:
    return "–" if r.get("mean") is None else f"{r['mean']:.2f} ± {r['se']:.2f}x"


def stream_table(doc: dict) -> str:
    lat, ref = doc["latency"], doc["reference"]
    lines = [f"Model {doc['model']} ({doc['model_MB']:.1f} MB of weights), {doc['reps']} interleaved repetitions x "
             f"{doc['updates']} measured updates (the first published version of each pair not measured), a "
             f"version every {min(doc['every'])}-{max(doc['every'])} steps (producer step "
             f"{min(doc['step_s']) * 1e3:.0f}-{max(doc['step_s']) * 1e3:.0f} ms); statistic: per repetition the mean latency of its updates, "
             "then mean ± SE over the repetitions.", "",
             f"| approach | latency (ms) | median of all updates (ms) | updates | {ref} faster by | target | "
             "producer's stall per publish (ms) |",
             "|---|---|---|---|---|---|---|"]
    for a, r in lat.items():
        sp = doc["ratios"].get(a)
        cell = "–" if a == ref or sp is None else _x(sp)
        tgt = "–" if sp is None or sp["target"] is None else f">= {sp['target']:g}x: **{sp['verdict']}**"
        allv = sorted(x for rep in r["samples_s"] for x in rep)
        med = allv[len(allv) // 2] * 1e3 if allv else None
        stall = fmt(r.get("stall_s"), 1e3, 1) if r.get("stall_s") else "–"
        lines.append(f"| {a} | {fmt(r['mean_s'], 1e3, 1)} | {fmt(med, 1, 1)} | {len(allv)} | {cell} | {tgt} | {stall} |")
    parts = {a: r for a, r in lat.items() if r.get("parts_mean_s")}
    if parts:
        lines += ["", "Where DeepFreeze's latency goes (ms; mean over every measured version; producer: from t0 "
                      "until the last rank's notification was sent: the copy from the live tensors into the slot "
                      "with its CRC; then the notification, the consumer's fetch (through shared memory: straight "
                      "into the idle replica, CRC checked in the same pass; over TCP: into its receive buffer), its "
                      "copy into the idle replica (TCP only), and the swap until `current()` gave it; the "
                      "training thread's part: the post-hook and the next step's wait for the copy):", "",
                  "| approach | producer | notify | fetch | copy into replica | to served | producer's post-hook "
                  "| next step's wait |", "|---|---|---|---|---|---|---|---|"]
        for a, r in parts.items():
            m, t = r["parts_mean_s"], r.get("producer_timings_mean_s", {})
            lines.append(f"| {a} | " + " | ".join(fmt(m.get(k), 1e3, 1) for k in ("to_notified_s", "notify_s", "fetch_s",
                                                                                  "load_s", "to_served_s"))
                         + f" | {fmt(t.get('hook_s'), 1e3, 1)} | {fmt(t.get('wait_s'), 1e3, 1)} |")
    if doc.get("copy_s"):
        lines += ["", f"One `Tensor.copy_` of the model's bytes on this machine (one thread): "
                      f"{doc['copy_s'] * 1e3:.1f} ms."]
    slows = [s for s in (doc.get("slowdown"), doc.get("slowdown_every10"), doc.get("slowdown_one_core")) if s]
    if slows:
        s0 = slows[0]
        lines += ["", f"Training slowdown ({s0['reps']} interleaved pairs of blocks of {s0['steps']} steps, plain "
                      "and publishing, order alternating; slowdown = plain steps/s / publishing steps/s - 1, mean ± "
                      "SE over the pairs; per publish: the post-hook and the next step's wait for the copy, means "
                      "over the publishes):", "",
                  "| pinning | publish every | plain steps/s | publishing steps/s | slowdown | target | post-hook (ms) "
                  "| next step's wait (ms) |", "|---|---|---|---|---|---|---|---|"]
        for s in slows:
            t = s.get("timings_mean_s") or {}
            tgt = "–" if s.get("target") is None else f"<= {s['target'] * 100:g} %: **{s['verdict']}**"
            lines.append(f"| {s.get('pinning', 'free')} | {s.get('every', 1)} step(s) | "
                         f"{fmt(stat(s['plain_steps_per_s']), 1, 2)} | {fmt(stat(s['pub_steps_per_s']), 1, 2)} | "
                         f"{fmt(s['slowdown'], 100, 1)} % | {tgt} | {fmt(t.get('hook_s'), 1e3, 1)} | "
                         f"{fmt(t.get('wait_s'), 1e3, 1)} |")
    return "\n".join(lines)


def repo_table(doc: dict) -> str:
    """The markdown table: per operation and approach the fresh-process time, the warm-process time,
    MB read, and how many times faster each DeepFreeze approach is than it, with the targets."""
    lines = [f"Model {doc['model']} ({doc['model_MB']:.1f} MB), partial module: {doc['partial']['what']} "
             f"({doc['partial']['fraction'] * 100:.1f} % of the bytes); {doc['reps']} interleaved repetitions; "
             f"cold = {doc['cold']}; every load in a fresh process (its second load, cold again, is the warm-process "
             f"figure); statistic: mean ± SE over the repetitions; load average at the start "
             f"{doc.get('load_avg_start', ['?'])[0]}.", "",
             "| operation | approach | time (ms), fresh process | warm process (ms) | read (MB) | "
             "deepfreeze (by id) faster by | deepfreeze-name faster by | target |",
             "|---|---|---|---|---|---|---|---|"]
    for op, rows in doc["ops"].items():
        for x, r in rows.items():
            cells, tgts = [], []
            for m in MINE:
                sp = doc["ratios"].get(op, {}).get(m, {}).get(x)
                cells.append("–" if sp is None or sp["mean"] is None else f"{sp['mean']:.2f} ± {sp['se']:.2f}x")
                if sp is not None and sp["target"] is not None:
                    tgts.append(f"{m} >= {sp['target']:g}x: **{sp['verdict']}**")
            lines.append(f"| {op} | {x} | {fmt(r['time_s'], 1e3, 1)} | {fmt(r.get('warm_s'), 1e3, 1)} | "
                         f"{fmt(r['read_MB'], 1, 1)} | {cells[0]} | {cells[1]} | {'; '.join(tgts) or '–'} |")
    return "\n".join(lines)


def plot_bars(groups: "dict[str, dict[str, dict]]", ylabel: str, title: str, path: str, scale: float = 1e3) -> None:
    """One panel per group (name -> approach -> ``{mean, se}``), a bar per approach with its SE."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 3.6), squeeze=False)
    for ax, (g, rows) in zip(axes[0], groups.items()):
        names = [a for a, s in rows.items() if s and s.get("mean") is not None]
        ax.bar(range(len(names)), [rows[a]["mean"] * scale for a in names],
               yerr=[(rows[a].get("se") or 0) * scale for a in names], capsize=3, color="#4c72b0")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.set_title(g, fontsize=9)
        ax.set_ylabel(ylabel)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
