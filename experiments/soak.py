"""Soak: 1000 checkpoints at every-batch frequency, 2 ranks; memory and file descriptors must stay flat.

    python -m experiments.soak [--checkpoints 1000] --out experiments/results/soak.json

Each rank (and the node's backend process) is sampled every 50 checkpoints:
resident memory (VmRSS) and open file descriptors. Results as JSON and a PNG.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _sample(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"rss_MB": rss / 1024, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    import horovod.tensorflow.keras as hvd
    sys.path.insert(0, ROOT)
    from experiments import models
    from deepfreeze.keras import DeepFreezeCheckpoint

    hvd.init()
    rank = hvd.rank()
    model = models.demo()
    x, y = models.synthetic(model, 32 * 100, seed=rank)
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)),
                  loss="sparse_categorical_crossentropy")
    ckpt = DeepFreezeCheckpoint(name="soak", every_n_batches=1, at_epoch_end=False, mode="async", overwrite=True,
                                scratch=f"{args.work}/node{rank}/scratch", persistent=f"{args.work}/persistent",
                                failure_domain=f"node{rank}", max_versions=3, scratch_versions=2)
    samples = []

    class Sampler(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            n = len(ckpt.timings)
            if n % 50 == 0 and (not samples or samples[-1]["checkpoints"] != n):
                s = {"checkpoints": n, "rank": _sample(os.getpid())}
                if ckpt.engine is not None and ckpt.engine._backend is not None:
                    s["backend"] = _sample(ckpt.engine._backend.pid)
                samples.append(s)
            if n >= args.checkpoints:
                self.model.stop_training = True

    epochs = args.checkpoints // 100 + 2
    model.fit(x, y, batch_size=32, epochs=epochs, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                                             ckpt, Sampler()], verbose=0)
    ckpt.wait()
    committed = sorted(os.listdir(f"{args.work}/persistent/soak"))
    with open(f"{args.work}/soak{rank}.json", "w") as f:
        json.dump({"rank": rank, "checkpoints": len(ckpt.timings), "samples": samples,
                   "blocking_ms_mean": 1e3 * sum(t["blocking_s"] for t in ckpt.timings) / len(ckpt.timings),
                   "persistent_dirs_at_end": committed}, f)
    ckpt.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", default="")
    ap.add_argument("--checkpoints", type=int, default=1000)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "soak.json"))
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    work = tempfile.mkdtemp(prefix="dfsoak-")
    cmd = ["mpirun", "--oversubscribe", "-np", "2"] + (["--allow-run-as-root"] if os.getuid() == 0 else [])
    cmd += [sys.executable, "-m", "experiments.soak", "--worker", "--work", work,
            "--checkpoints", str(args.checkpoints)]
    subprocess.run(cmd, cwd=ROOT, check=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    ranks = [json.load(open(f"{work}/soak{r}.json")) for r in range(2)]
    doc = {"checkpoints_per_rank": [r["checkpoints"] for r in ranks], "ranks": ranks}
    for r in ranks:
        s = r["samples"]
        first, last = s[1] if len(s) > 1 else s[0], s[-1]  # after warm-up
        r["rss_growth_MB"] = last["rank"]["rss_MB"] - first["rank"]["rss_MB"]
        r["fd_growth"] = last["rank"]["fds"] - first["rank"]["fds"]
        if "backend" in last and "backend" in first:
            r["backend_rss_growth_MB"] = last["backend"]["rss_MB"] - first["backend"]["rss_MB"]
            r["backend_fd_growth"] = last["backend"]["fds"] - first["backend"]["fds"]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in ranks:
        xs = [s["checkpoints"] for s in r["samples"]]
        a1.plot(xs, [s["rank"]["rss_MB"] for s in r["samples"]], label=f"rank {r['rank']}")
        a2.plot(xs, [s["rank"]["fds"] for s in r["samples"]], label=f"rank {r['rank']}")
        if all("backend" in s for s in r["samples"]):
            a1.plot(xs, [s["backend"]["rss_MB"] for s in r["samples"]], "--", label=f"backend of node {r['rank']}")
            a2.plot(xs, [s["backend"]["fds"] for s in r["samples"]], "--", label=f"backend of node {r['rank']}")
    a1.set_xlabel("checkpoints")
    a1.set_ylabel("resident memory (MB)")
    a2.set_xlabel("checkpoints")
    a2.set_ylabel("open file descriptors")
    a1.legend()
    a2.legend()
    a1.set_ylim(bottom=0)
    a2.set_ylim(bottom=0)
    fig.suptitle("soak: a checkpoint every batch, 2 ranks, async")
    fig.tight_layout()
    fig.savefig(os.path.splitext(args.out)[0] + ".png", dpi=100)
    print(json.dumps({k: [r.get(k) for r in ranks] for k in ("checkpoints", "rss_growth_MB", "fd_growth",
                                                               "backend_rss_growth_MB", "backend_fd_growth")}))


if __name__ == "__main__":
    main()
