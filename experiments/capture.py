"""The capture limit, measured directly: DeepFreeze's in-graph shard copy vs a memcpy of the shard.

    python -m experiments.capture --out experiments/results/capture.json

The issue's target "runtime overhead <= 2x the memcpy time of one rank's shard" asks how close the
capture gets to copying the shard's bytes. Differencing iteration times cannot resolve a few tens
of milliseconds on this 2-core VM (an iteration's standard error is 40-300 ms), so this measures
the capture alone, on an idle machine, in one process:

* ``capture``: one ``tf.function`` holding, for every piece of one rank's shard (the real
  :class:`deepfreeze.shardplan.ShardPlan` of the app's weights at N ranks), the op the hook puts
  after each variable's update (:mod:`deepfreeze.keras.hook`):
  ``buf.assign(DeepCopy(reshape(var, [-1])[start:stop]))``, into preallocated buffers; plus the
  callback's hand-off (numpy views of the buffers);
* ``memcpy``: ``np.copyto`` of the same number of bytes between preallocated arrays.

Both are medians of ``--repeat`` runs after a warm-up, for the busiest rank of each rank count.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from experiments.bench import write_doc

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = {"nt3-weights": [2, 3], "resnet50": [2, 4]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "capture.json"))
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf
    from deepfreeze.keras.restore import model_tensors
    from deepfreeze.shardplan import ShardPlan, TensorSpec
    from experiments import models

    def median_time(fn) -> float:
        fn()
        ts = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return float(np.median(ts))

    rows = []
    for app, rank_counts in CASES.items():
        model = models.nt3_weights() if app == "nt3-weights" else models.resnet50()
        variables = model.weights
        tensors = [TensorSpec(i, n, d, s) for i, (n, d, s) in enumerate(model_tensors(model))]
        for n in rank_counts:
            plan = ShardPlan.build(tensors, n)
            rank = int(np.argmax(plan.rank_bytes()))
            pieces = plan.for_rank(rank)
            bufs = [tf.Variable(tf.zeros([p.stop - p.start], variables[p.tensor_id].dtype), trainable=False)
                    for p in pieces]

            @tf.function
            def copy():
                for p, buf in zip(pieces, bufs):  # the hook's op (deepfreeze/keras/hook.py)
                    flat = tf.reshape(variables[p.tensor_id].read_value(), [-1])
                    buf.assign(tf.raw_ops.DeepCopy(x=flat[p.start:p.stop]), read_value=False)

            def capture():
                copy()
                return [np.asarray(b.read_value()) for b in bufs]  # the callback's hand-off

            nbytes = int(plan.rank_bytes()[rank])
            src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
            t_cap = median_time(capture)
            t_mem = median_time(lambda: np.copyto(dst, src))
            del src, dst
            row = {"app": app, "ranks": n, "rank": rank, "bytes": nbytes, "pieces": len(pieces),
                   "capture_s": t_cap, "memcpy_s": t_mem, "ratio": t_cap / t_mem}
            rows.append(row)
            print(json.dumps(row), flush=True)
    doc = {"repeat": args.repeat, "cpus": os.cpu_count(), "runs": rows}
    write_doc(doc, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
