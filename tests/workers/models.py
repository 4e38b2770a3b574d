"""Small deterministic models shared by the test workers."""
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
