"""One rank of a Horovod Keras job on the test cluster (launched by a plain mpirun -H n1:1,...).

    keras_job.py SCRATCH SHARED first|resume [key=value ...]

Node-local scratch SCRATCH/keras (the failure domain is the default: the node's host name),
persistent SHARED/persistent; a checkpoint every 2 batches. ``first``: 2 epochs of 6 steps; rank
0 saves the weights of every checkpointed version to SHARED/expected/<run>-v<V>.npz. ``resume``:
``resume=True``; rank 0 saves the weights right after the resume (before any step) to
SHARED/resumed.npz and writes SHARED/resume.json (the version resumed from and its run).
Keys: Config keys (ec_interval, ec_scheme, persistent_interval, ...).
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import horovod.tensorflow.keras as hvd  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "workers"))
from models import RecordWeights, SaveAfterResume, build  # noqa: E402
from deepfreeze.keras import DeepFreezeCheckpoint  # noqa: E402

scratch, shared, phase = sys.argv[1], sys.argv[2], sys.argv[3]


def _value(v):
    try:
        return float(v)
    except ValueError:
        return v


opts = {k: _value(v) for k, v in (a.split("=", 1) for a in sys.argv[4:])}
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
hvd.init()
rank = hvd.rank()
model = build()
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01, momentum=0.9)),
              loss="sparse_categorical_crossentropy")
rng = np.random.default_rng(100 + rank)
x, y = rng.random((96, 12, 12, 1), dtype=np.float32), rng.integers(0, 10, 96)  # 6 steps per epoch
ckpt = DeepFreezeCheckpoint(name="keras", every_n_batches=2, mode="async", resume=phase == "resume",
                            scratch=f"{scratch}/keras", persistent=f"{shared}/persistent", lease_timeout=5, **opts)


model.fit(x, y, batch_size=16, epochs=2 if phase == "first" else 3, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), ckpt,
                     SaveAfterResume(f"{shared}/resumed.npz", rank == 0 and phase == "resume"),
                     RecordWeights(ckpt, rank, lambda v: f"{shared}/expected/{ckpt.run_id}-v{v}.npz")])
ckpt.wait()
ckpt.close()
if rank == 0 and phase == "resume":
    with open(f"{shared}/resume.json", "w") as f:
        json.dump({"resumed_from": ckpt.resumed_from}, f)
