"""Small deterministic models shared by the test workers, and the callback that records the
weights of every checkpointed step (what a restore must return, bit-exact)."""
import os

import numpy as np
import tensorflow as tf

DENSE_WIDTH = {"small": 37, "other": 38}  # "other": same layer kinds, other shapes (mismatch tests)


def build(kind: str = "small", lazy: bool = False) -> tf.keras.Model:
    """``lazy``: no Input layer (as most Horovod examples): Keras builds the model at the first step."""
    tf.keras.utils.set_random_seed(7)
    return tf.keras.Sequential(([] if lazy else [tf.keras.Input((12, 12, 1))]) + [
        tf.keras.layers.Conv2D(8, 3, activation="relu"),
        tf.keras.layers.BatchNormalization(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(DENSE_WIDTH[kind], activation="relu"),
        tf.keras.layers.Dense(10, activation="softmax"),
    ])


class RecordWeights(tf.keras.callbacks.Callback):
    """On rank 0, after every step that took a checkpoint (and at epoch ends), save the model's
    weights to ``path_of(version)`` (an .npz of ``get_weights()``, in order)."""

    def __init__(self, ckpt, rank, path_of, at_epoch_end=False):
        super().__init__()
        self.ckpt, self.rank, self.path_of, self.seen = ckpt, rank, path_of, None
        if at_epoch_end:
            self.on_epoch_end = self.on_train_batch_end

    def on_train_batch_end(self, batch, logs=None):
        v = self.ckpt.last_version
        if self.rank == 0 and v is not None and v != self.seen:
            self.seen = v
            path = self.path_of(v)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            np.savez(path, *self.model.get_weights())


class SaveAfterResume(tf.keras.callbacks.Callback):
    """Saves the weights at train begin, i.e. right after a resume and before any step, to
    ``path`` (``.npz``), when ``active`` (e.g. rank 0 of a resumed run)."""

    def __init__(self, path: str, active: bool) -> None:
        super().__init__()
        self.path, self.active = path, active

    def on_train_begin(self, logs=None):
        if self.active:
            np.savez(self.path, *self.model.get_weights())
