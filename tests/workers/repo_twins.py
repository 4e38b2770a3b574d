"""Build one of the twin models with a chosen head and (``load``) load a stored one into it.

    python tests/workers/repo_twins.py KINDS HEAD store REPO
    python tests/workers/repo_twins.py KINDS HEAD load REPO RESULT.json

KINDS: comma-separated, each stored as the repository model of that name; a kind is ``concat`` (a trunk, two identical 2-layer branches into a Concatenate), ``siamese`` (two
inputs of one shape, a shared tower and one identical tower per input, merged), ``qkv``
(hand-written q/k/v projections of one tensor, attention by Dot layers). HEAD: units of the new
head (a Dense on the merge). ``store``: store the model (its weights random). ``load``: throwaway
layers first (other auto-names), record the head's initial weights, ``load_into``, write to
RESULT.json, per kind: the report, and per weight (by layer role) the loaded bytes' hex digest and whether the
head's weights are still their initial bytes. The test compares the digests with the stored tensors.
"""
import hashlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)

from deepfreeze.keras import load_into, store_model  # noqa: E402
from deepfreeze.keras.repo import model_graph  # noqa: E402
from deepfreeze.repo import Repository  # noqa: E402

L = tf.keras.layers


def build(kind: str, head: int):
    """(model, head layer)."""
    if kind == "concat":
        inp = tf.keras.Input(shape=(6,))
        x = L.Dense(8, activation="relu")(inp)
        branches = [L.Dense(4)(L.Dense(5, activation="relu")(x)) for _ in range(2)]
        merged = L.Concatenate()(branches)
        inputs = inp
    elif kind == "siamese":
        a, b = tf.keras.Input(shape=(6,)), tf.keras.Input(shape=(6,))
        shared = L.Dense(5, activation="relu")
        towers = [L.Dense(4)(L.Dense(5)(shared(t))) for t in (a, b)]   # one identical tower per input
        merged = L.Concatenate()([L.Subtract()(towers), towers[0]])
        inputs = [a, b]
    elif kind == "qkv":
        inp = tf.keras.Input(shape=(3, 6))
        q, k, v = (L.Dense(4, use_bias=False)(inp) for _ in range(3))
        scores = L.Softmax()(L.Dot(axes=(2, 2))([q, k]))
        merged = L.Flatten()(L.Dot(axes=(2, 1))([scores, v]))
        inputs = inp
    else:
        raise SystemExit(f"unknown kind {kind}")
    head = L.Dense(head)
    return tf.keras.Model(inputs, head(merged)), head


def main() -> None:
    kinds, head_units, action, repo = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    if action == "load":
        for _ in range(3):
            L.Dense(1)   # other auto-names than the storing process
    results = {}
    with Repository(repo) as r:
        for kind in kinds:
            model, head = build(kind, head_units)
            if action == "store":
                rng = np.random.default_rng(0)
                for w in model.weights:
                    w.assign(rng.standard_normal(w.shape).astype(np.float32))
                store_model(r, kind, model)
                continue
            mg = model_graph(model)
            before = {id(w): w.numpy().tobytes() for w in head.weights}
            report = load_into(r, kind, model)
            out = {"loaded": report.loaded, "missing": report.missing, "mapped": report.mapped,
                   "bytes": report.bytes, "head": head.name,
                   "head_untouched": all(w.numpy().tobytes() == before[id(w)] for w in head.weights),
                   "weights": {}}
            for k, layer in enumerate(mg.layers):
                for j, w in enumerate(layer.weights):
                    out["weights"][f"{mg.ids[k]}/{j}"] = hashlib.sha256(w.numpy().tobytes()).hexdigest()
            results[kind] = out
    if action == "load":
        with open(sys.argv[5], "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
