"""Store a small model with the DeepFreeze on PYTHONPATH (the test puts the code of commit f25fd75
there, which wrote layer ids of scheme 1) and record its weights.

    PYTHONPATH=<old tree> python tests/workers/repo_scheme1.py REPO EXPECTED.npz

The model (:func:`build`, also imported by the test): Input(6) -> Dense -> BatchNormalization ->
[two identical Dense branches] -> Concatenate -> Dense head, plus a Normalization layer (a 0-d
weight, which that code stored 1-d) and two inputs of one shape in a second model ("siamese").
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

L = tf.keras.layers


def build(head: int = 3, seed: int = 0):
    inp = tf.keras.Input(shape=(6,))
    norm = L.Normalization()
    norm.adapt(np.random.default_rng(seed).random((16, 6)).astype(np.float32))
    x = L.Dense(8, activation="relu")(norm(inp))
    x = L.BatchNormalization()(x)
    merged = L.Concatenate()([L.Dense(4)(x), L.Dense(4)(x)])
    model = tf.keras.Model(inp, L.Dense(head)(merged))
    rng = np.random.default_rng(seed)
    for v in model.weights:
        if v.dtype == tf.float32:
            v.assign(rng.uniform(0.1, 1.0, v.shape).astype(np.float32))
    return model


def build_siamese(head: int = 3):
    a, b = tf.keras.Input(shape=(5,)), tf.keras.Input(shape=(5,))
    shared = L.Dense(4)
    model = tf.keras.Model([a, b], L.Dense(head)(L.Subtract()([shared(a), shared(b)])))
    for v in model.weights:
        v.assign(np.random.default_rng(1).uniform(0.1, 1, v.shape).astype(np.float32))
    return model


def main() -> None:
    from deepfreeze.keras import store_model
    from deepfreeze.repo import Repository
    from deepfreeze.repo.ids import ID_SCHEME
    assert ID_SCHEME == 1, ID_SCHEME
    model, siamese = build(), build_siamese()
    with Repository(sys.argv[1]) as r:
        store_model(r, "old@1", model)
        store_model(r, "siamese@1", siamese)
    np.savez(sys.argv[2], *[v.numpy() for v in model.weights])


if __name__ == "__main__":
    main()
