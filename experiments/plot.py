"""Figures in the style of the paper's Fig. 5/6 from ``experiments.bench`` results.

    python -m experiments.plot experiments/results/bench.json   # writes bench-<app>.png beside it

One figure per app; one panel per metric (preparation, blocking, runtime overhead, time to
durable, flush bandwidth); rank counts on x, one bar per approach (grouped as in the paper).
Runtime overhead bars carry their standard error; the dashed steps there are the memcpy time of
one rank's shard (the capture limit, from ``deepfreeze``'s shard size); the dashed line in the
flush panel is the raw write bandwidth. Blocking and time to durable use a log scale when their
bars span more than a factor 20.
"""
from __future__ import annotations

import json
import os
import sys

METRICS = [("preparation_s", "preparation phase (s)", False), ("blocking_s", "blocking phase (s)", True),
           ("runtime_overhead_s", "runtime overhead (s)", False), ("time_to_durable_s", "time to durable (s)", True),
           ("flush_GBps", "flush bandwidth (GB/s)", False)]
ORDER = ["keras-default", "veloc-single", "veloc-sharded", "deepfreeze", "deepfreeze-veloc", "tf-async"]
COLORS = {"keras-default": "#4c72b0", "veloc-single": "#dd8452", "veloc-sharded": "#55a868",
          "deepfreeze": "#c44e52", "deepfreeze-veloc": "#8172b3", "tf-async": "#937860"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m experiments.plot RESULTS.json", file=sys.stderr)
        return 2
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(argv[0]) as f:
        doc = json.load(f)
    runs, lim = doc["runs"], doc.get("limits", {})
    for app in [a for a in ("nt3", "nt3-weights", "resnet50") if any(r["app"] == a for r in runs)]:
        mine = [r for r in runs if r["app"] == app]
        ranks = sorted({r["ranks"] for r in mine})
        present = {r["approach"] for r in mine}
        approaches = [a for a in ORDER if a in present] + sorted(present - set(ORDER) - {"none"})
        width = 0.8 / max(len(approaches), 1)
        fig, axes = plt.subplots(1, len(METRICS), figsize=(3.9 * len(METRICS), 3.8))
        for ax, (key, label, log) in zip(axes, METRICS):
            for i, approach in enumerate(approaches):
                xs, ys, es = [], [], []
                for j, n in enumerate(ranks):
                    row = next((r for r in mine if r["ranks"] == n and r["approach"] == approach), None)
                    if row is None or row.get(key) is None:
                        continue
                    xs.append(j - 0.4 + width * (i + 0.5))
                    ys.append(row[key])
                    es.append((row.get("runtime_overhead_se_s") or 0) if key == "runtime_overhead_s" else 0)
                if xs:
                    ax.bar(xs, ys, width, yerr=es if any(es) else None, capsize=2, label=approach,
                           color=COLORS.get(approach))
            if key == "runtime_overhead_s":
                ax.axhline(0, color="black", lw=0.6)
                for j, n in enumerate(ranks):
                    row = next((r for r in mine if r["ranks"] == n and r["approach"] == "deepfreeze"), None)
                    if row and row.get("memcpy_shard_s"):
                        ax.hlines(row["memcpy_shard_s"], j - 0.45, j + 0.45, colors="black", linestyles="dashed",
                                  lw=0.9, label="memcpy of a shard" if j == 0 else None)
            if key == "flush_GBps" and lim.get("write_GBps"):
                ax.axhline(lim["write_GBps"], color="black", ls="dashed", lw=0.9, label="raw write")
            vals = [r[key] for r in mine if r["approach"] != "none" and (r.get(key) or 0) > 0]
            if log and vals and max(vals) / min(vals) > 20:  # log only where the bars span decades
                ax.set_yscale("log")
            ax.set_xticks(range(len(ranks)), [str(n) for n in ranks])
            ax.set_xlabel("ranks")
            ax.set_title(label, fontsize=10)
            ax.grid(axis="y", alpha=0.3)
        found = {}
        for ax in axes:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                found.setdefault(lab, h)
        handles = {lab: found[lab] for lab in approaches + ["memcpy of a shard", "raw write"] if lab in found}
        fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=len(handles), fontsize=8,
                   frameon=False)
        base = ", ".join(f"{r['ranks']}r {r['baseline_iter_s']:.2f}s" for r in sorted(mine, key=lambda r: r["ranks"])
                         if r["approach"] == "none" and r.get("baseline_iter_s") is not None)
        fig.suptitle(f"{app}: baseline iteration {base or 'n/a'}; limits memcpy "
                     f"{lim.get('memcpy_GBps', float('nan')):.1f} GB/s, write {lim.get('write_GBps', float('nan')):.2f} GB/s",
                     fontsize=10)
        fig.tight_layout(rect=(0, 0.07, 1, 0.95))
        out = os.path.join(os.path.dirname(os.path.abspath(argv[0])),
                           f"{os.path.splitext(os.path.basename(argv[0]))[0]}-{app}.png")
        fig.savefig(out, dpi=90)
        plt.close(fig)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
