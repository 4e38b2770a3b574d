"""Peak host memory of one training process with and without DeepFreeze.

    python -m experiments.memory --app nt3 --steps 4 --out experiments/results/memory.json

Each case is a fresh process (one rank, no Horovod) that builds the app's model, trains
``--steps`` iterations and reports its peak resident set size (``ru_maxrss``): ``none``
(plain ``fit``), ``deepfreeze`` (the callback, a checkpoint every 2 iterations, async,
defaults otherwise), ``deepfreeze-inflight1`` (the same with ``max_inflight = 1``) and
``none-then-deepfreeze`` (a plain ``fit``, then one with the callback in the same process, as
the benchmark runs its approaches: the hook makes Keras trace the train step again).
The difference is what DeepFreeze adds: the hook's buffers (one shard), the queued shards
(up to ``max_inflight``), the retraced train function.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from experiments.bench import write_doc

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CASES = {"none": None, "deepfreeze": {}, "deepfreeze-inflight1": {"max_inflight": 1},
         "none-then-deepfreeze": {}}  # the benchmark's order: a plain fit first, then the hook (a retrace)


def child(app: str, steps: int, case: str, work: str) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import resource
    import tensorflow as tf
    from experiments import models
    from experiments.bench import APPS

    builder, batch = APPS[app]
    model = getattr(models, builder)()
    x, y = models.synthetic(model, batch * 2, seed=0)
    ds = tf.data.Dataset.from_tensor_slices((tuple(x) if isinstance(x, list) else x, y)).batch(batch).repeat()
    model.compile(optimizer=tf.keras.optimizers.SGD(1e-5), loss="sparse_categorical_crossentropy")
    cbs = []
    if case == "none-then-deepfreeze":
        model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0)
    if CASES[case] is not None:
        from deepfreeze.keras import DeepFreezeCheckpoint
        ck = DeepFreezeCheckpoint(None, name="mem", every_n_batches=2, at_epoch_end=False, save_optimizer=False,
                                  overwrite=True,
                                  mode="async", scratch=f"{work}/scratch", persistent=f"{work}/persistent",
                                  **CASES[case])
        cbs.append(ck)
    model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=cbs)
    for c in cbs:
        c.close()
    weights = sum(int(w.numpy().nbytes) for w in model.weights)
    print(json.dumps({"case": case, "peak_rss_GB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20,
                      "weights_GB": weights / 2 ** 30}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--app", default="nt3-weights")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--cases", default=",".join(CASES), help="comma list of cases (default: all)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "memory.json"))
    args = ap.parse_args()
    if args.child:
        return child(args.app, args.steps, args.child, args.work)
    rows = []
    for case in args.cases.split(","):
        if case not in CASES:
            raise SystemExit(f"unknown case {case!r}: use {', '.join(CASES)}")
        with tempfile.TemporaryDirectory(prefix="dfmem-") as work:
            out = subprocess.run([sys.executable, "-m", "experiments.memory", "--app", args.app, "--steps",
                                  str(args.steps), "--child", case, "--work", work], cwd=ROOT, check=True,
                                 capture_output=True, text=True).stdout
        row = json.loads(out.strip().splitlines()[-1])
        rows.append(dict(row, app=args.app, steps=args.steps))
        print(json.dumps(rows[-1]), flush=True)
    doc = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            doc = json.load(f)
    kept = [r for r in doc.get(args.app, []) if r["case"] not in {x["case"] for x in rows}]
    doc[args.app] = kept + rows
    write_doc(doc, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
