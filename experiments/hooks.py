"""Blocking time against the tensor count, and the callback's quiet batch hooks.

    python -m experiments.hooks --out experiments/results/hooks.json

Targets (issue 12): blocking flat in the tensor count (synthetic models of 10 -> 1000 tensors:
slope <= 1 us per tensor); DeepFreeze's own batch-hook time on batches without a checkpoint,
median <= 0.5 ms. One process, one rank, the real callback in a real ``fit`` (async mode, the
built-in engine, checksums on, weights and optimizer state): a model of ``n / 2`` small Dense
layers (kernel + bias: ``n`` tensors), a checkpoint every ``--every`` steps. Blocking is what the
callback records per checkpoint (the writer and the flush of each version are waited for at
the end of the following batch, outside the callback, so that the interval between checkpoints
is longer than their background work, as in a real application: blocking here is the hand-off,
not backpressure from a writer that a 10 ms interval would never let finish) (``timings[i]["blocking_s"]``: all checkpoint-related time in its
batch hooks, begin and end); quiet hook time is its ``quiet_times`` (begin + end of every batch
without a checkpoint). Statistic: median over the checkpoints (first one excluded, warm-up) and
over the quiet batches; the slope is the least-squares fit of the medians against n.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

from experiments.bench import write_doc

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", default="10,100,300,1000")
    ap.add_argument("--checkpoints", type=int, default=12)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--capture", default="auto")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "hooks.json"))
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf
    from deepfreeze.keras import DeepFreezeCheckpoint

    rows = []
    for n in [int(v) for v in args.tensors.split(",")]:
        tf.keras.utils.set_random_seed(0)
        layers = [tf.keras.Input((16,))] + [tf.keras.layers.Dense(16) for _ in range(n // 2)]
        model = tf.keras.Sequential(layers)
        model.compile(optimizer=tf.keras.optimizers.SGD(1e-3, momentum=0.9), loss="mse")
        steps = (args.checkpoints + 1) * args.every
        x = np.random.default_rng(0).random((steps * 8, 16), dtype=np.float32)
        work = tempfile.mkdtemp(prefix="dfhooks-")
        try:
            ckpt = DeepFreezeCheckpoint(name="h", every_n_batches=args.every, at_epoch_end=False,
                                        capture=args.capture, mode="async", scratch=os.path.join(work, "s"),
                                        persistent=os.path.join(work, "p"), max_versions=2, scratch_versions=2)
            class Pace(tf.keras.callbacks.Callback):  # waits for the background work, outside DeepFreeze
                def on_train_batch_end(self, batch, logs=None):
                    if ckpt.engine is not None and ckpt.timings and ckpt.timings[-1]["version"] == batch:
                        ckpt.engine.wait(persistent=True)

            model.fit(x, x, batch_size=8, epochs=1, callbacks=[ckpt, Pace()], verbose=0)
            ckpt.close()
        finally:
            shutil.rmtree(work, ignore_errors=True)
        blocking = [t["blocking_s"] for t in ckpt.timings[1:]]
        quiet = list(ckpt.quiet_times)[2:]  # the first batches run the trace
        row = {"tensors": len(model.weights) + len(model.optimizer.variables()), "model_tensors": len(model.weights),
               "checkpoints": len(blocking), "blocking_median_s": float(np.median(blocking)),
               "blocking_p90_s": float(np.percentile(blocking, 90)), "quiet_median_s": float(np.median(quiet)),
               "quiet_p90_s": float(np.percentile(quiet, 90)), "quiet_batches": len(quiet),
               "capture": ckpt.sink_kind if hasattr(ckpt, "sink_kind") else args.capture,
               "blocking_samples_s": blocking}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "blocking_samples_s"}), flush=True)
    xs = np.array([r["model_tensors"] for r in rows], float)
    ys = np.array([r["blocking_median_s"] for r in rows], float)
    slope = float(np.polyfit(xs, ys, 1)[0]) if len(rows) > 1 else None
    doc = {"runs": rows, "slope_s_per_tensor": slope, "every": args.every, "capture": args.capture,
           "statistic": "median over checkpoints (first excluded) and over quiet batches (first 2 excluded); "
                        "slope: least squares of the medians against the model's tensor count"}
    write_doc(doc, args.out)
    plot(rows, slope, args.out.rsplit(".", 1)[0] + ".png")
    print(f"slope {slope * 1e6 if slope is not None else float('nan'):.3f} us per tensor; wrote {args.out}")


def plot(rows: list[dict], slope: float | None, path: str) -> None:
    """Blocking (median, p90) and quiet hook time (median) against the model's tensor count."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    xs = [r["model_tensors"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(xs, [1e3 * r["blocking_median_s"] for r in rows], "o-", label="blocking, median")
    ax.plot(xs, [1e3 * r["blocking_p90_s"] for r in rows], "s--", label="blocking, p90")
    ax.plot(xs, [1e3 * r["quiet_median_s"] for r in rows], "^-", label="quiet batch hooks, median")
    ax.axhline(1.0, color="k", ls=":", lw=1, label="1 ms")
    ax.set_xscale("log")
    ax.set_xlabel("model tensors")
    ax.set_ylabel("ms")
    ax.set_title(f"slope {slope * 1e6:.2f} us per tensor" if slope is not None else "")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
