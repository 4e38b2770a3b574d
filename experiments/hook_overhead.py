"""Cost of the optimizer hook when no checkpoint is taken (flag off).

    python -m experiments.hook_overhead [--rounds 3] --out experiments/results/hook_overhead.json

One process, no Horovod. For each model, alternates rounds of ``fit`` without
DeepFreeze and with a ``DeepFreezeCheckpoint`` whose flag is never set (the
hook's ``tf.cond`` is in the graph but never copies), and reports the median
step time of each. Rounds alternate so drift on a shared machine hits both.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "hook_overhead.json"))
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf
    from deepfreeze.keras import DeepFreezeCheckpoint
    from experiments import models

    work = tempfile.mkdtemp(prefix="dfhook-")
    results = []
    for name, steps, batch in (("demo", 200, 32), ("nt3_weights", 12, 20)):
        model = getattr(models, name)()
        model.compile(optimizer=tf.keras.optimizers.SGD(1e-4), loss="sparse_categorical_crossentropy")
        x, y = models.synthetic(model, steps * batch, seed=0)
        times = {"plain": [], "hook_flag_off": []}

        class Timer(tf.keras.callbacks.Callback):
            def __init__(self, sink):
                super().__init__()
                self.sink = sink

            def on_train_batch_begin(self, batch, logs=None):
                self.t = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                if batch >= 2:  # skip tracing and warm-up
                    self.sink.append(time.perf_counter() - self.t)

        model.fit(x, y, batch_size=batch, epochs=1, verbose=0)  # warm-up
        for _ in range(args.rounds):
            for kind in times:
                cbs = [Timer(times[kind])]
                if kind == "hook_flag_off":
                    cbs.insert(0, DeepFreezeCheckpoint(name="h", every_n_batches=10 ** 9, at_epoch_end=False,
                                                       mode="sync", scratch=f"{work}/s", persistent=f"{work}/p",
                                                       overwrite=True))
                model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=cbs)
                for c in cbs[:-1]:
                    c.close()  # ends the run (and its lease on the name): the next round is a new run
        r = {"model": name, "steps_measured": {k: len(v) for k, v in times.items()},
             "step_ms_median": {k: 1e3 * float(np.median(v)) for k, v in times.items()},
             "step_ms_p10_p90": {k: [1e3 * float(np.percentile(v, 10)), 1e3 * float(np.percentile(v, 90))]
                                 for k, v in times.items()}}
        r["overhead_ms_median"] = r["step_ms_median"]["hook_flag_off"] - r["step_ms_median"]["plain"]
        print(json.dumps(r), flush=True)
        results.append(r)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rounds": args.rounds, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
