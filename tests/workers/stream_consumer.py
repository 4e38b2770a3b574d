"""Consumer worker of the stream tests.

    python tests/workers/stream_consumer.py OUT [key=value ...]

A ModelSubscriber on channel ``name`` (persistent OUT/persistent); a thread predicts in a loop
on a fixed batch and records, per request, the version it ran on and a digest of the output.
After each swap the live weights are saved to OUT/<tag>/got/v<step>.npz. It stops when the
version reaches step ``until`` or after ``seconds``, or when OUT/<tag>/stop exists; then, once
OUT/producer0.json exists (the producer finished and its references are written), it recomputes
each version's output from OUT/expected/v<step>.npz in this process and writes OUT/<tag>/consumer.json.
"""
import hashlib
import json
import os
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import build  # noqa: E402
from deepfreeze.keras import ModelSubscriber  # noqa: E402


def digest(y):
    return hashlib.sha256(np.ascontiguousarray(y).tobytes()).hexdigest()


def main() -> None:
    out = sys.argv[1]
    opts = dict(a.split("=", 1) for a in sys.argv[2:])
    tag = opts.get("tag", "c0")
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    me = f"{out}/{tag}"
    os.makedirs(f"{me}/got", exist_ok=True)
    kind = opts.get("model", "small")
    sub = ModelSubscriber(opts.get("name", "chan"), build=lambda: build(kind), tier=opts.get("tier", "auto"),
                          mode="async", scratch=f"{me}/scratch", persistent=f"{out}/persistent")
    x = np.random.default_rng(5).random((4,) + tuple(build(kind).input_shape[1:]), dtype=np.float32)
    outputs: dict = {}  # step -> set of output digests
    counts: dict = {}
    stop = threading.Event()
    swaps = []

    def on_update(v):
        w, got = sub.get_weights()
        np.savez(f"{me}/got/v{got.step}.npz", *w)
        swaps.append([v.generation, v.step, time.time()])

    sub.on_update(on_update)
    first = sub.wait(0, timeout=float(opts.get("first_timeout", 120)))  # any version
    print(f"consumer {tag}: first version {first}", flush=True)
    if not os.path.exists(f"{me}/got/v{first.step}.npz"):  # swapped in before on_update was registered
        on_update(first)

    def loop():
        while not stop.is_set():
            y, v = sub.predict(x)
            key = f"{v.generation}:{v.step}"
            outputs.setdefault(key, set()).add(digest(y))
            counts[key] = counts.get(key, 0) + 1

    t = threading.Thread(target=loop)
    t.start()
    until = int(opts.get("until", 10 ** 9))
    deadline = time.monotonic() + float(opts.get("seconds", 120))
    err = None
    while time.monotonic() < deadline and not os.path.exists(f"{me}/stop"):
        v = sub.version
        if v is not None and v.step >= until:
            break
        try:
            sub.wait(None, timeout=0.5)
        except TimeoutError:
            pass
        except Exception as e:  # recorded: the test decides
            err = f"{type(e).__name__}: {e}"
    stop.set()
    t.join()
    # references: each version's output from the producer's recorded weights, computed here
    t0 = time.monotonic()
    while not os.path.exists(f"{out}/producer0.json") and time.monotonic() - t0 < float(opts.get("ref_wait", 300)):
        time.sleep(0.2)
    ref_model = build(kind)
    refs = {}
    for key in outputs:
        step = int(key.split(":")[1])
        path = f"{out}/expected/v{step}.npz"
        if os.path.exists(path):
            with np.load(path) as z:
                ref_model.set_weights([z[f"arr_{i}"] for i in range(len(z.files))])
            refs[key] = digest(ref_model(x, training=False).numpy())
    report = {"outputs": {k: sorted(v) for k, v in outputs.items()}, "counts": counts, "refs": refs,
              "live": [sub.version.generation, sub.version.step] if sub.version else None, "swaps": swaps,
              "updates": [dict(u, version=[u["version"].generation, u["version"].step]) for u in sub.updates],
              "error": err}
    sub.close()
    with open(f"{me}/consumer.json", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
