"""The paper's evaluation (DeepFreeze, section V, Fig. 5/6) side by side, in one run.

    python -m experiments.bench [--quick] --out experiments/results/bench.json
    python -m experiments.plot experiments/results/bench.json

Apps: ``nt3`` (CANDLE NT3, batch 20), ``nt3-weights`` (NT3's weight tensors, little compute),
``resnet50`` (tf.keras.applications, 64x64 images, batch 32). Approaches (section V-B):

* ``keras-default``: rank 0 ``model.save_weights`` to HDF5 on the persistent directory;
* ``veloc-single``: rank 0 ``get_weights`` then the engine (a one-rank plan);
* ``veloc-sharded``: every rank ``get_weights``, numpy slices of the shard plan, the engine;
* ``deepfreeze``: the graph hook (:class:`deepfreeze.keras.DeepFreezeCheckpoint`);
* ``tf-async``: rank 0 ``tf.train.Checkpoint.write`` with
  ``CheckpointOptions(experimental_enable_async_checkpoint=True)``;
* ``none``: no checkpoint (the baseline iteration time).

The engine approaches run the built-in engine in async mode, each rank its own
simulated node (scratch directory, backend); weights only (``save_optimizer=False``)
as in the paper. Metrics, averaged over checkpoints and ranks, first checkpoint
excluded (warm-up): preparation (``get_weights`` + slicing), blocking (time in the
callback), runtime overhead (mean of each checkpoint iteration and the one after,
minus the mean of iterations away from checkpoints), time until the version is
durable on persistent, flush bandwidth (bytes of the version / (commit time -
checkpoint time)). Limits measured in the same run: memcpy of one rank's shard,
sequential write bandwidth of the persistent directory (with fsync).
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
APPS = {"nt3": ("nt3", 20), "nt3-weights": ("nt3_weights", 20), "resnet50": ("resnet50", 32)}
APPROACHES = ["none", "keras-default", "veloc-single", "veloc-sharded", "deepfreeze", "tf-async"]


def worker(args: argparse.Namespace) -> None:  # one rank of one run
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf
    import horovod.tensorflow.keras as hvd
    sys.path.insert(0, ROOT)
    from deepfreeze import Config
    from deepfreeze.engine import Engine
    from deepfreeze.keras import DeepFreezeCheckpoint
    from deepfreeze.keras.restore import model_tensors
    from deepfreeze.shardplan import ShardPlan, TensorSpec
    from experiments import models

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    builder, batch = APPS[args.app]
    model = getattr(models, builder)()
    x, y = models.synthetic(model, batch * 2, seed=rank)  # two batches, repeated: content does not matter
    ds = tf.data.Dataset.from_tensor_slices((tuple(x) if isinstance(x, list) else x, y)).batch(batch).repeat()
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(1e-5)),
                  loss="sparse_categorical_crossentropy")
    work, approach, every = args.work, args.approach, args.every
    cfg = Config.load(None, mode="async", scratch=f"{work}/node{rank}/scratch", persistent=f"{work}/persistent",
                      failure_domain=f"node{rank}", max_versions=2, scratch_versions=2)
    os.makedirs(f"{work}/persistent", exist_ok=True)
    iters, ckpts = [], []  # per-iteration seconds; per-checkpoint dicts

    def due(batch_index: int) -> bool:
        return (batch_index + 1) % every == 0 and batch_index > 0

    class Timer(tf.keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            iters.append(time.perf_counter() - self.t)

    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    engine = None
    tensors = [TensorSpec(i, n, d, s) for i, (n, d, s) in enumerate(model_tensors(model))]
    if approach in ("veloc-single", "veloc-sharded"):
        world = 1 if approach == "veloc-single" else size
        plan = ShardPlan.build(tensors, world)
        engine = Engine(cfg, "bench", rank if world > 1 else 0, plan) if (world > 1 or rank == 0) else None

        class Manual(tf.keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if not due(batch) or engine is None:
                    return
                t0 = time.perf_counter()
                weights = self.model.get_weights()
                pieces = [weights[p.tensor_id].reshape(-1)[p.start:p.stop] for p in plan.for_rank(engine.rank)]
                t1 = time.perf_counter()
                engine.checkpoint(batch + 1, pieces, step=batch + 1, epoch=0)
                t2 = time.perf_counter()
                ckpts.append({"version": batch + 1, "t": time.time() - (t2 - t0), "prep": t1 - t0, "block": t2 - t0})
        callbacks.append(Manual())
    elif approach == "deepfreeze":
        df = DeepFreezeCheckpoint(cfg, name="bench", every_n_batches=every, at_epoch_end=False,
                                  save_optimizer=False)
        callbacks.append(df)
    elif approach in ("keras-default", "tf-async"):
        tfck = tf.train.Checkpoint(model=model)
        opts = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)

        class RankZero(tf.keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if not due(batch) or rank != 0:
                    return
                t0 = time.perf_counter()
                if approach == "keras-default":
                    self.model.save_weights(f"{work}/persistent/weights.h5")
                else:
                    tfck.write(f"{work}/persistent/tfck", options=opts)
                t2 = time.perf_counter()
                ckpts.append({"version": batch + 1, "t": time.time() - (t2 - t0), "prep": None, "block": t2 - t0})
        callbacks.append(RankZero())
    callbacks.append(Timer())
    model.fit(ds, steps_per_epoch=args.steps, epochs=1, verbose=0, callbacks=callbacks)
    if approach == "deepfreeze":
        df.wait()
        ckpts = [{"version": d["version"], "t": d["time"], "prep": None, "block": d["blocking_s"]}
                 for d in df.timings]
        df.close()
    elif engine is not None:
        engine.close()
    elif approach == "tf-async":
        tfck.sync()
    res = {"rank": rank, "iters": iters, "ckpts": ckpts, "bytes_total": int(sum(t.nbytes for t in tensors)),
           "ckpt_times": df_times(work) if approach in ("deepfreeze", "veloc-single", "veloc-sharded") else {}}
    with open(f"{work}/r{rank}.json", "w") as f:
        json.dump(res, f)


def df_times(work: str) -> dict[str, float]:
    """version -> commit time on persistent (from the committed manifests still there)."""
    out = {}
    root = f"{work}/persistent/bench"
    for d in os.listdir(root) if os.path.isdir(root) else []:
        try:
            m = json.load(open(f"{root}/{d}/manifest.json"))
            out[str(m["version"])] = m["committed"]
        except (OSError, ValueError, KeyError):
            pass
    return out


def limits(shard_bytes: int, persistent_dir: str) -> dict[str, float]:
    import numpy as np
    n = max(shard_bytes, 1 << 20)
    src, dst = np.ones(n, np.uint8), np.zeros(n, np.uint8)
    t = time.perf_counter()
    for _ in range(3):
        np.copyto(dst, src)
    memcpy = 3 * n / (time.perf_counter() - t) / 1e9
    os.makedirs(persistent_dir, exist_ok=True)
    path = os.path.join(persistent_dir, "bw.tmp")
    buf = np.ones(min(n, 1 << 30), np.uint8)
    t = time.perf_counter()
    with open(path, "wb") as f:
        f.write(memoryview(buf))
        f.flush()
        os.fsync(f.fileno())
    write = buf.nbytes / (time.perf_counter() - t) / 1e9
    os.unlink(path)
    return {"memcpy_GBps": memcpy, "write_GBps": write, "shard_bytes": n}


def run(app: str, approach: str, ranks: int, steps: int, every: int, base: str) -> dict:
    work = tempfile.mkdtemp(prefix=f"{app}-{approach}-{ranks}-", dir=base)
    cmd = ["mpirun", "--oversubscribe", "-np", str(ranks)] + (["--allow-run-as-root"] if os.getuid() == 0 else [])
    cmd += [sys.executable, "-m", "experiments.bench", "--worker", "--app", app, "--approach", approach,
            "--steps", str(steps), "--every", str(every), "--work", work]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    rs = [json.load(open(f"{work}/r{r}.json")) for r in range(ranks)]
    shutil.rmtree(work, ignore_errors=True)
    iters = rs[0]["iters"]
    ck_steps = {c["version"] - 1 for r in rs for c in r["ckpts"]} or {s for s in range(steps) if (s + 1) % every == 0 and s}
    warm = min(ck_steps) if ck_steps else 0
    around = [t for i, t in enumerate(iters) if i > warm + 1 and (i in ck_steps or i - 1 in ck_steps)]
    away = [t for i, t in enumerate(iters) if i > 1 and i not in ck_steps and i - 1 not in ck_steps]
    mean = lambda v: sum(v) / len(v) if v else None  # noqa: E731
    cks = [c for r in rs for c in r["ckpts"] if c["version"] - 1 > warm]
    commit = {k: v for r in rs for k, v in r["ckpt_times"].items()}
    durable = [commit[str(c["version"])] - c["t"] for c in cks if c.get("t") and str(c["version"]) in commit]
    nbytes = rs[0]["bytes_total"]
    ranks_writing = ranks if approach in ("deepfreeze", "veloc-sharded") else 1
    out = {"app": app, "ranks": ranks, "approach": approach,
           "preparation_s": mean([c["prep"] for c in cks if c["prep"] is not None]),
           "blocking_s": mean([c["block"] for c in cks]),
           "runtime_overhead_s": (mean(around) - mean(away)) if around and away and approach != "none" else None,
           "time_to_durable_s": mean(durable) if durable else (mean([c["block"] for c in cks])
                                                                  if approach == "keras-default" else None),
           "flush_GBps": (nbytes / mean(durable) / 1e9) if durable else None,
           "baseline_iter_s": mean(away), "bytes_per_rank": nbytes // ranks_writing,
           "checkpoints": len({c["version"] for c in cks}), "iterations": len(iters)}
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--app", default="nt3-weights", choices=sorted(APPS))
    ap.add_argument("--approach", default="deepfreeze", choices=APPROACHES)
    ap.add_argument("--steps", type=int, default=46)
    ap.add_argument("--every", type=int, default=15)
    ap.add_argument("--work", default="")
    ap.add_argument("--quick", action="store_true", help="smoke check (< 3 min): nt3-weights at 2 ranks, 6 steps, a checkpoint every 2")
    ap.add_argument("--apps", default="nt3,nt3-weights,resnet50")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench.json"))
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    base = tempfile.mkdtemp(prefix="dfbench-")
    if args.quick:
        grid = [("nt3-weights", 2, 6, 2)]
    else:
        ranks = {"nt3": (1, 2, 3), "nt3-weights": (1, 2, 3), "resnet50": (1, 2, 4)}
        grid = [(a, r, args.steps, args.every) for a in args.apps.split(",") for r in ranks[a]]
    runs = []
    shard = 0
    for app, r, steps, every in grid:
        for approach in APPROACHES:
            res = run(app, approach, r, steps, every, base)
            runs.append(res)
            shard = max(shard, res["bytes_per_rank"] if approach == "deepfreeze" else 0)
    doc = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                       "quick": args.quick},
           "limits": limits(shard, os.path.join(base, "persistent-bw")), "runs": runs}
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
