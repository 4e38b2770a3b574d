"""Small deterministic models shared by the test workers."""
import tensorflow as tf


def build(kind: str = "small") -> tf.keras.Model:
    tf.keras.utils.set_random_seed(7)
    if kind == "small":
        return tf.keras.Sequential([
            tf.keras.Input((12, 12, 1)),
            tf.keras.layers.Conv2D(8, 3, activation="relu"),
            tf.keras.layers.BatchNormalization(),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(37, activation="relu"),
            tf.keras.layers.Dense(10, activation="softmax"),
        ])
    if kind == "other":  # same layer kinds, other shapes: for mismatch tests
        return tf.keras.Sequential([
            tf.keras.Input((12, 12, 1)),
            tf.keras.layers.Conv2D(8, 3, activation="relu"),
            tf.keras.layers.BatchNormalization(),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(38, activation="relu"),
            tf.keras.layers.Dense(10, activation="softmax"),
        ])
    raise ValueError(kind)
