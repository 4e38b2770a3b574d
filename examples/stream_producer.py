"""Producer of the docs/stream.md example: trains and publishes every 20 steps on channel "mnistish".

    mpirun -np 2 python examples/stream_producer.py     # or: python examples/stream_producer.py
"""
import numpy as np
import tensorflow as tf

from deepfreeze.keras import PublishCallback

try:
    import horovod.tensorflow.keras as hvd
    hvd.init()
except ImportError:
    hvd = None


def build():
    tf.keras.utils.set_random_seed(1)
    return tf.keras.Sequential([tf.keras.Input((28, 28)), tf.keras.layers.Flatten(),
                                tf.keras.layers.Dense(256, activation="relu"), tf.keras.layers.Dense(10)])


if __name__ == "__main__":
    model = build()
    opt = tf.keras.optimizers.SGD(0.05)
    model.compile(optimizer=hvd.DistributedOptimizer(opt) if hvd else opt,
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x, y = rng.random((4096, 28, 28), dtype=np.float32), rng.integers(0, 10, 4096)
    pub = PublishCallback("mnistish", persistent="/tmp/deepfreeze/persistent", schedule=20, overwrite=True)
    callbacks = ([hvd.callbacks.BroadcastGlobalVariablesCallback(0)] if hvd else []) + [pub]
    model.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=callbacks)
    print("published", [str(v) for v in pub.published])
    pub.close()
