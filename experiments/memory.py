"""What DeepFreeze adds to a training process's peak memory.

    python -m experiments.memory --app nt3-weights --ranks 1 --runs 3 --out experiments/results/memory.json

Target (issue 12): peak RSS of (plain fit; fit with DeepFreeze) minus (plain fit; plain fit), in
the same processes, <= (max_inflight + 1) x shard bytes + 100 MB. The callback is added to a
model that a plain ``fit`` already trained in the same process (the benchmark's order: the hook
makes Keras trace the train step again). Each case is a fresh job of ``--ranks`` processes
(``mpirun`` and Horovod when ranks > 1), run ``--runs`` times, the two cases alternating; each
process reports its peak resident set size (``ru_maxrss``). Per run and rank: the difference of
the two cases; reported: the mean over runs of the largest difference over ranks, its standard
error, and the bound with the busiest rank's shard bytes. DeepFreeze runs with its defaults
(async, ``max_inflight = 2``, checksums on, weights and optimizer state), a checkpoint every 2
iterations.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

from experiments.bench import write_doc

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CASES = ("none-then-none", "none-then-deepfreeze")


def child(app: str, steps: int, case: str, work: str, ranks: int) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import resource
    import tensorflow as tf
    from experiments import models
    from experiments.bench import APPS

    rank, opt_wrap = 0, (lambda o: o)
    if ranks > 1:
        import horovod.tensorflow.keras as hvd
        hvd.init()
        rank, opt_wrap = hvd.rank(), hvd.DistributedOptimizer
    builder, batch = APPS[app]
    model = getattr(models, builder)()
    x, y = models.synthetic(model, batch * 2, seed=rank)
    ds = tf.data.Dataset.from_tensor_slices((tuple(x) if isinstance(x, list) else x, y)).batch(batch).repeat()
    model.compile(optimizer=opt_wrap(tf.keras.optimizers.SGD(1e-5)), loss="sparse_categorical_crossentropy")

    def bcast() -> list:
        if ranks > 1:
            import horovod.tensorflow.keras as hvd
            return [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
        return []

    model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=bcast())
    cbs, shard = bcast(), None
    if case == "none-then-deepfreeze":
        from deepfreeze.keras import DeepFreezeCheckpoint
        ck = DeepFreezeCheckpoint(None, name="mem", every_n_batches=2, at_epoch_end=False, overwrite=True, mode="async",
                                  scratch=f"{work}/node{rank}/scratch", persistent=f"{work}/persistent",
                                  failure_domain=f"node{rank}")
        cbs.append(ck)
    model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=cbs)
    for c in cbs:
        if hasattr(c, "close"):
            shard = int(max(c.plan.rank_bytes())) if c.plan is not None else None
            max_inflight = c.config.max_inflight
            c.close()
    print("MEM " + json.dumps({"case": case, "rank": rank, "peak_rss_B": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss * 1024, "shard_B": shard,
        "max_inflight": max_inflight if shard is not None else None}), flush=True)


def run_case(app: str, steps: int, case: str, ranks: int) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="dfmem-") as work:
        cmd = [sys.executable, "-m", "experiments.memory", "--app", app, "--steps", str(steps), "--child", case,
               "--work", work, "--ranks", str(ranks)]
        if ranks > 1:
            cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(ranks)] + (
                ["--allow-run-as-root"] if os.getuid() == 0 else []) + cmd
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                           env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    rows = [json.loads(line[4:]) for line in p.stdout.splitlines() if line.startswith("MEM ")]
    if p.returncode != 0 or len(rows) != ranks:
        return [{"case": case, "error": f"exit {p.returncode}, {len(rows)} of {ranks} ranks reported: "
                                         f"{p.stderr[-1500:]}"}]
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--app", default="nt3-weights")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "memory.json"))
    args = ap.parse_args()
    if args.child:
        return child(args.app, args.steps, args.child, args.work, args.ranks)
    runs, diffs, bound, errors = [], [], None, []
    for i in range(args.runs):
        pair = {c: run_case(args.app, args.steps, c, args.ranks) for c in CASES}
        runs.append(pair)
        bad = [r["error"] for rs in pair.values() for r in rs if "error" in r]
        if bad:
            errors += bad
            print(f"run {i}: {bad}", flush=True)
            continue
        d = [b["peak_rss_B"] - a["peak_rss_B"] for a, b in zip(pair["none-then-none"], pair["none-then-deepfreeze"])]
        diffs.append(max(d))
        df = pair["none-then-deepfreeze"][0]
        bound = (df["max_inflight"] + 1) * max(r["shard_B"] for r in pair["none-then-deepfreeze"]) + 100e6
        print(json.dumps({"run": i, "added_B_per_rank": d, "bound_B": bound}), flush=True)
    mean = sum(diffs) / len(diffs) if diffs else None
    se = (math.sqrt(sum((x - mean) ** 2 for x in diffs) / (len(diffs) - 1) / len(diffs))
          if len(diffs) > 1 else None)
    key = f"{args.app}x{args.ranks}"
    doc = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            doc = json.load(f)
    doc[key] = {"app": args.app, "ranks": args.ranks, "steps": args.steps, "runs": runs, "added_B": diffs,
                "added_mean_B": mean, "added_se_B": se, "bound_B": bound, "errors": errors,
                "holds": (mean + (se or 0) <= bound) if mean is not None and bound is not None else None}
    write_doc(doc, args.out)
    plot(doc, args.out.rsplit(".", 1)[0] + ".png")
    print(f"{key}: DeepFreeze adds {mean / 1e6 if mean is not None else float('nan'):.0f} MB "
          f"(bound {bound / 1e6 if bound else float('nan'):.0f} MB); wrote {args.out}")


def plot(doc: dict, path: str) -> None:
    """Memory added per (app, ranks): each run, the mean, and the bound."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = [k for k, v in sorted(doc.items()) if isinstance(v, dict) and v.get("added_B")]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, k in enumerate(keys):
        r = doc[k]
        ax.plot([i] * len(r["added_B"]), [x / 1e6 for x in r["added_B"]], "o", color="C0")
        ax.plot([i - 0.3, i + 0.3], [r["bound_B"] / 1e6] * 2, "k--")
    ax.set_xticks(range(len(keys)), keys)
    ax.set_ylabel("peak RSS added (MB); dashed: bound")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
