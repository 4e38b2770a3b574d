"""In-graph shard copy: flat contiguous split vs the paper's largest-dimension slicing.

    python -m experiments.shard_layout [--ranks 2] [--repeat 20] --out experiments/results/shard_layout.json

For each of NT3's weight tensors, time (in a ``tf.function``, as the hook runs
it) the copy of rank ``r``'s shard into a preallocated buffer, for every rank:

* ``flat``: ``buf.assign(DeepCopy(reshape(v, [-1])[start:stop]))`` (DeepFreeze's plan);
* ``largest_dim``: ``buf.assign(DeepCopy(v[..., a:b, ...]))`` along the largest dimension.

``DeepCopy`` as in the hook: without it an aligned slice is a view and the
copy would be deferred to a copy-on-write of the whole variable.

Reports the per-rank total over all tensors (the copy a rank runs in a
checkpoint step) and the load imbalance (largest / smallest rank bytes).
"""
from __future__ import annotations

import argparse
import json
import os
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _copies(tf, v, flat_buf, a, b, dim_buf, sl):
    @tf.function
    def flat():
        flat_buf.assign(tf.raw_ops.DeepCopy(x=tf.reshape(v, [-1])[a:b]), read_value=False)

    @tf.function
    def dim():
        dim_buf.assign(tf.raw_ops.DeepCopy(x=v[sl]), read_value=False)

    return flat, dim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "shard_layout.json"))
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf
    from experiments.models import nt3_weights

    model = nt3_weights()
    n = args.ranks
    rows = []
    totals = {"flat": [0.0] * n, "largest_dim": [0.0] * n}
    bytes_ = {"flat": [0] * n, "largest_dim": [0] * n}
    for v in model.weights:
        shape = v.shape.as_list()
        size = int(np.prod(shape))
        axis = int(np.argmax(shape))
        for r in range(n):
            a, b = size * r // n, size * (r + 1) // n
            lo, hi = shape[axis] * r // n, shape[axis] * (r + 1) // n
            sl = tuple(slice(lo, hi) if i == axis else slice(None) for i in range(len(shape)))
            flat_buf = tf.Variable(tf.zeros([b - a], v.dtype), trainable=False)
            dim_shape = list(shape)
            dim_shape[axis] = hi - lo
            dim_buf = tf.Variable(tf.zeros(dim_shape, v.dtype), trainable=False)

            flat, dim = _copies(tf, v, flat_buf, a, b, dim_buf, sl)

            for kind, fn, nbytes in (("flat", flat, (b - a) * 4), ("largest_dim", dim, int(np.prod(dim_shape)) * 4)):
                fn()  # trace + first touch
                ts = []
                for _ in range(args.repeat):
                    t = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t)
                med = float(np.median(ts))
                totals[kind][r] += med
                bytes_[kind][r] += nbytes
                rows.append({"tensor": v.name, "shape": shape, "rank": r, "layout": kind, "bytes": nbytes,
                             "copy_ms_median": 1e3 * med})
    summary = {k: {"per_rank_ms": [1e3 * t for t in totals[k]], "max_rank_ms": 1e3 * max(totals[k]),
                   "rank_bytes": bytes_[k], "imbalance": max(bytes_[k]) / max(min(bytes_[k]), 1)}
               for k in totals}
    doc = {"ranks": n, "repeat": args.repeat, "summary": summary, "tensors": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    w = 0.38
    for i, k in enumerate(totals):
        ax.bar(np.arange(n) + (i - 0.5) * w, summary[k]["per_rank_ms"], w, label=k)
    ax.set_xticks(range(n), [f"rank {r}" for r in range(n)])
    ax.set_ylabel("in-graph copy of the rank's NT3 shard (ms)")
    ax.set_title(f"shard layout, {n} ranks (median of {args.repeat})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.splitext(args.out)[0] + ".png", dpi=100)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
