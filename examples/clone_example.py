"""The docs/clone.md example: fork a 2-rank Horovod training at step 10 into a 1-rank clone
that trains on with another learning rate.

    mpirun -np 3 .venv/bin/python examples/clone_example.py

(add ``--oversubscribe`` on a machine with fewer than 3 cores, ``--allow-run-as-root`` as root).
Ranks 0-1 are the source group, rank 2 the clone group. The model is a ``Sequential`` without
``Input``, as in Horovod's Keras examples: the source's ``fit`` builds it, the clone builds it
from ``input_spec``. Each group prints one summary line from its rank 0.
"""
import os

import numpy as np
import tensorflow as tf

import deepfreeze.clone as dfc
from deepfreeze.errors import CloneError

group = dfc.split(sizes=(2, 1))  # collective over every rank: group 0 (the source) has 2 ranks, group 1 has 1

import horovod.tensorflow.keras as hvd  # noqa: E402

hvd.init(comm=group.comm)  # each group is its own Horovod world (forgetting it is a ConfigError, not a hang)
from deepfreeze.keras import CloneCallback, receive_clone  # noqa: E402

CLONE_STEP, BATCH = 10, 32


def build() -> tf.keras.Model:
    tf.keras.utils.set_random_seed(1)  # the same initial model in every group
    return tf.keras.Sequential([tf.keras.layers.Flatten(), tf.keras.layers.Dense(64, activation="relu"),
                                tf.keras.layers.Dense(10)])


def data(rank: int) -> tf.data.Dataset:
    """Each rank's own shard of a synthetic 28x28, 10-class data set."""
    rng = np.random.default_rng(100 + rank)
    x, y = rng.random((256, 28, 28), dtype=np.float32), rng.integers(0, 10, 256)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


model = build()
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.001)),
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
ds = data(hvd.rank() + 10 * group.index)
try:
    if group.is_source:
        clone = CloneCallback(group, at_step=CLONE_STEP)
        hist = model.fit(ds, epochs=2, verbose=0,
                         callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), clone])
        if group.rank == 0:
            print(f"source: cloned at step {clone.timings['step']} ({clone.timings['bytes_sent'] / 1e3:.0f} kB sent "
                  f"by rank 0), trained to step {int(model.optimizer.iterations.numpy())}, "
                  f"loss {hist.history['loss'][-1]:.4f}", flush=True)
    else:
        info = receive_clone(model, group, input_spec=ds)  # builds the unbuilt model, then waits for step 10
        model.optimizer.learning_rate.assign(0.0005)  # the clone explores another learning rate
        hist = model.fit(ds, epochs=2, initial_epoch=info.epoch, verbose=0)  # from step 10: epoch 1, batch 2
        if group.rank == 0:
            print(f"clone: received step {info.step} (epoch {info.epoch}, batch {info.epoch_step}) from run "
                  f"{info.source_run}, trained to step {int(model.optimizer.iterations.numpy())} with lr 0.0005, "
                  f"loss {hist.history['loss'][-1]:.4f}", flush=True)
except CloneError as e:
    # a peer may have died: MPI_Finalize (and Horovod's shutdown) would wait for it; exit now
    print(f"group {group.index} rank {group.rank}: {type(e).__name__}: {e}", flush=True)
    os._exit(1)
