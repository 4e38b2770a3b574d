"""Blocking time per checkpoint: DeepFreeze vs rank 0 ``save_weights`` to HDF5.

    python -m experiments.blocking [--quick] --out experiments/results/blocking.json

For each model (the demo model and ``nt3-weights``, a model with CANDLE NT3's
~620 MB of weight tensors) it runs a real 2-rank Horovod job (mpirun) per
approach, checkpointing every ``--every`` steps:

* ``deepfreeze``: the callback (async mode, built-in engine, graph hook);
  blocking = time spent in the callback per checkpoint, per rank.
* ``none``: no checkpoints (the baseline for ``fit_overhead_ms_per_ckpt``);
* ``keras-default``: rank 0 calls ``model.save_weights(<persistent>/x.h5)``;
  blocking = that call's time.

It also records the mean step time with and without checkpoints. Results go to
JSON and a PNG bar chart beside it. The first checkpoint of each run is
excluded (warm-up).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    import horovod.tensorflow.keras as hvd
    sys.path.insert(0, ROOT)
    from experiments import models
    from deepfreeze.keras import DeepFreezeCheckpoint

    hvd.init()
    rank = hvd.rank()
    model = getattr(models, args.model.replace("-", "_"))()
    x, y = models.synthetic(model, args.batch * args.steps, seed=rank)
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(1e-4)),
                  loss="sparse_categorical_crossentropy")
    work = args.work
    step_times, ckpt_steps, blocking = [], [], []

    class Timer(tf.keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            step_times.append(time.perf_counter() - self.t)

    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), Timer()]
    ckpt = None
    if args.approach == "deepfreeze":
        ckpt = DeepFreezeCheckpoint(name="bench", every_n_batches=args.every, at_epoch_end=False, mode="async",
                                    overwrite=True,
                                    scratch=f"{args.scratch_base or work}/node{rank}/scratch",
                                    persistent=f"{work}/persistent",
                                    failure_domain=f"node{rank}", max_versions=2, scratch_versions=1)
        callbacks.insert(1, ckpt)
    elif args.approach == "keras-default":
        class SaveWeights(tf.keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if (batch + 1) % args.every == 0 and batch > 0:
                    ckpt_steps.append(batch)
                    if rank == 0:
                        t = time.perf_counter()
                        self.model.save_weights(f"{work}/persistent/weights.h5")
                        blocking.append(time.perf_counter() - t)
        os.makedirs(f"{work}/persistent", exist_ok=True)
        callbacks.insert(1, SaveWeights())
    t0 = time.perf_counter()
    model.fit(x, y, batch_size=args.batch, epochs=1, callbacks=callbacks, verbose=0)
    fit_s = time.perf_counter() - t0
    flush_s = None
    scratch_write = []
    if ckpt is not None:
        t = time.perf_counter()
        ckpt.wait()
        flush_s = time.perf_counter() - t
        blocking = [d["blocking_s"] for d in ckpt.timings]
        scratch_write = [ckpt.engine.write_times.get(d["version"]) for d in ckpt.timings]
        ckpt_steps = [d["version"] - 1 for d in ckpt.timings]
        ckpt.close()
    res = {"rank": rank, "blocking_s": blocking, "ckpt_steps": ckpt_steps, "step_times_s": step_times,
           "fit_s": fit_s, "wait_after_fit_s": flush_s, "scratch_write_s": scratch_write,
           "model_bytes": int(sum(w.numpy().nbytes for w in model.weights))}
    with open(f"{work}/result{rank}.json", "w") as f:
        json.dump(res, f)


def run(model: str, approach: str, ranks: int, steps: int, every: int, batch: int, base: str,
        scratch_base: str = "") -> dict:
    work = tempfile.mkdtemp(prefix=f"{model}-{approach}-", dir=base)
    cmd = ["mpirun", "--oversubscribe", "-np", str(ranks)]
    if os.getuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += [sys.executable, "-m", "experiments.blocking", "--worker", "--model", model, "--approach", approach,
            "--steps", str(steps), "--every", str(every), "--batch", str(batch), "--work", work,
            "--scratch-base", scratch_base]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    per_rank = [json.load(open(f"{work}/result{r}.json")) for r in range(ranks)]
    shutil.rmtree(work, ignore_errors=True)
    blocking = [b for r in per_rank for b in r["blocking_s"][1:]]  # first checkpoint = warm-up
    ck = set(per_rank[0]["ckpt_steps"])
    steps_t = per_rank[0]["step_times_s"]
    plain = [t for i, t in enumerate(steps_t[2:], 2) if i not in ck and i - 1 not in ck]
    around = [t for i, t in enumerate(steps_t) if (i in ck or i - 1 in ck) and i > min(ck, default=0) + 1]
    writes = [w for r in per_rank for w in r["scratch_write_s"][1:] if w is not None]
    return {"model": model, "approach": approach, "ranks": ranks, "checkpoints": len(per_rank[0]["blocking_s"]),
            "fit_s": max(r["fit_s"] for r in per_rank),
            "blocking_ms_mean": 1e3 * sum(blocking) / max(len(blocking), 1),
            "blocking_ms_max": 1e3 * max(blocking, default=0.0),
            "step_ms_without_ckpt": 1e3 * sum(plain) / max(len(plain), 1),
            "runtime_overhead_ms": 1e3 * (sum(around) / max(len(around), 1) - sum(plain) / max(len(plain), 1)),
            "scratch_write_ms_background": 1e3 * sum(writes) / len(writes) if writes else None,
            "wait_after_fit_s": per_rank[0]["wait_after_fit_s"], "model_MB": per_rank[0]["model_bytes"] / 1e6}


def plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = sorted({r["model"] for r in results})
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4))
    for ax, m in zip(axes if len(models) > 1 else [axes], models):
        rs = [r for r in results if r["model"] == m]
        ax.bar([r["approach"] for r in rs], [r["blocking_ms_mean"] for r in rs], color=["tab:blue", "tab:orange"])
        for i, r in enumerate(rs):
            ax.text(i, r["blocking_ms_mean"], f"{r['blocking_ms_mean']:.1f} ms", ha="center", va="bottom")
        ax.set_title(f"{m} ({rs[0]['model_MB']:.0f} MB), {rs[0]['ranks']} ranks")
        ax.set_ylabel("blocking time per checkpoint (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--approach", default="deepfreeze")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--batch", type=int, default=20)
    ap.add_argument("--work", default="")
    ap.add_argument("--scratch-base", default="", help="parent of the simulated nodes' scratch (default: work dir)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer steps, demo model only")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "blocking.json"))
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    base = tempfile.mkdtemp(prefix="dfbench-")
    plan = [("demo", 60, 5, 32)] if args.quick else [("demo", 120, 5, 32), ("nt3-weights", 31, 5, 20)]
    results = []
    for model, steps, every, batch in plan:
        base_fit = None
        for approach in ("none", "keras-default", "deepfreeze"):
            r = run(model, approach, args.ranks, steps, every, batch, base)
            if approach == "none":
                base_fit = r["fit_s"]
                continue
            # robust against step-time noise: whole-run time against a run without checkpoints
            r["fit_overhead_ms_per_ckpt"] = 1e3 * (r["fit_s"] - base_fit) / max(r["checkpoints"], 1)
            r["fit_s_without_ckpt"] = base_fit
            print(json.dumps(r), flush=True)
            results.append(r)
    shutil.rmtree(base, ignore_errors=True)
    doc = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
           "note": ("blocking = time a rank spends in the checkpoint callback per checkpoint (first excluded); "
             "runtime_overhead = mean step time of checkpoint steps and the steps right after them minus "
             "the mean of the other steps (rank 0's clock); fit_overhead_per_ckpt = (fit time - fit time "
             "of the same run without checkpoints) / checkpoints; scratch_write = the writer thread's time to "
             "commit a shard on scratch, overlapping the next steps"),
           "results": results}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    plot(results, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
