"""Figures in the style of the paper's Fig. 5/6 from ``experiments.bench`` results.

    python -m experiments.plot experiments/results/bench.json   # writes bench-<app>.png beside it

One figure per app, one panel per metric, ranks on x, one line per approach.
"""
from __future__ import annotations

import json
import os
import sys

METRICS = [("preparation_s", "preparation phase (s)"), ("blocking_s", "blocking phase (s)"),
           ("runtime_overhead_s", "runtime overhead (s)"), ("time_to_durable_s", "time to durable (s)")]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m experiments.plot RESULTS.json", file=sys.stderr)
        return 2
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    doc = json.load(open(argv[0]))
    runs = doc["runs"]
    for app in sorted({r["app"] for r in runs}):
        fig, axes = plt.subplots(1, len(METRICS), figsize=(4.2 * len(METRICS), 3.6))
        for ax, (key, label) in zip(axes, METRICS):
            for approach in dict.fromkeys(r["approach"] for r in runs if r["approach"] != "none"):
                pts = sorted((r["ranks"], r[key]) for r in runs
                             if r["app"] == app and r["approach"] == approach and r.get(key) is not None)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=approach)
            ax.set_xlabel("ranks")
            ax.set_title(label)
            ax.set_xticks(sorted({r["ranks"] for r in runs if r["app"] == app}))
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{app} (memcpy {doc['limits']['memcpy_GBps']:.1f} GB/s, "
                     f"write {doc['limits']['write_GBps']:.2f} GB/s)")
        fig.tight_layout()
        out = os.path.join(os.path.dirname(os.path.abspath(argv[0])),
                           f"{os.path.splitext(os.path.basename(argv[0]))[0]}-{app}.png")
        fig.savefig(out, dpi=90)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
