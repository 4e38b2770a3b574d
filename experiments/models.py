"""Models used by the benchmarks."""
from __future__ import annotations

import tensorflow as tf

NT3_FLAT = 6045 * 128  # NT3's Flatten width: (60483 - 19 - 9) // 10 steps x 128 channels


def nt3_weights() -> tf.keras.Model:
    """Exactly CANDLE NT3's 10 weight tensors (about 620 MB), with little compute.

    A short sequence goes through NT3's two Conv1D layers; a vector of NT3's
    Flatten width goes through its dense stack. The conv path's mean is added
    to the first dense layer's output so every tensor gets a gradient.
    """
    tf.keras.utils.set_random_seed(1)
    seq = tf.keras.Input((32, 1), name="seq")
    flat = tf.keras.Input((NT3_FLAT,), name="flat")
    c = tf.keras.layers.Conv1D(128, 20, activation="relu")(seq)
    c = tf.keras.layers.Conv1D(128, 10, activation="relu")(c)
    c = tf.keras.layers.Lambda(lambda t: tf.reduce_mean(t, axis=[1, 2], keepdims=False)[:, None])(c)
    d = tf.keras.layers.Dense(200, activation="relu")(flat)
    d = tf.keras.layers.Add()([d, c * tf.ones_like(d)])
    d = tf.keras.layers.Dropout(0.1)(d)
    d = tf.keras.layers.Dense(20, activation="relu")(d)
    d = tf.keras.layers.Dropout(0.1)(d)
    out = tf.keras.layers.Dense(2, activation="softmax")(d)
    return tf.keras.Model([seq, flat], out)


def nt3() -> tf.keras.Model:
    """CANDLE NT3 (input (60483, 1); about 620 MB of weights in 10 tensors)."""
    tf.keras.utils.set_random_seed(1)
    return tf.keras.Sequential([
        tf.keras.Input((60483, 1)),
        tf.keras.layers.Conv1D(128, 20, activation="relu"),
        tf.keras.layers.MaxPooling1D(1),
        tf.keras.layers.Conv1D(128, 10, activation="relu"),
        tf.keras.layers.MaxPooling1D(10),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(200, activation="relu"),
        tf.keras.layers.Dropout(0.1),
        tf.keras.layers.Dense(20, activation="relu"),
        tf.keras.layers.Dropout(0.1),
        tf.keras.layers.Dense(2, activation="softmax"),
    ])


def resnet50(image: int = 64) -> tf.keras.Model:
    """ResNet-50 from tf.keras.applications (weights=None, 1000 classes: the same 25.6 M
    parameters as at 224x224); smaller images keep a CPU step affordable."""
    tf.keras.utils.set_random_seed(1)
    return tf.keras.applications.ResNet50(weights=None, input_shape=(image, image, 3), classes=1000)


def demo() -> tf.keras.Model:
    """The model of ``make demo`` (examples/demo.py)."""
    tf.keras.utils.set_random_seed(42)
    return tf.keras.Sequential([
        tf.keras.Input((28, 28, 1)),
        tf.keras.layers.Conv2D(16, 3, activation="relu"),
        tf.keras.layers.BatchNormalization(),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dense(10, activation="softmax"),
    ])


def synthetic(model: tf.keras.Model, n: int, seed: int):
    import numpy as np
    rng = np.random.default_rng(seed)
    xs = [rng.random((n,) + tuple(i.shape[1:]), dtype=np.float32) for i in model.inputs]
    y = rng.integers(0, model.output_shape[-1], n)
    return (xs if len(xs) > 1 else xs[0]), y
