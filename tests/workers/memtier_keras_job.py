"""One Keras/Horovod job of the checkpoint name ``job`` on a shared memory-tier device
(tests/test_memtier_jobs.py).

    python tests/workers/memtier_keras_job.py OUT DEVICE ROOT EPOCHS first|resume

One rank (``hvd.init()`` without mpirun), scratch ROOT/scratch, persistent ROOT/pfs, memtier DEVICE
(shared with another job of the test), a checkpoint every 2 batches, 6 batches per epoch.
``first``: saves the weights of every checkpointed step to OUT/expected/<run>-v<V>.npz.
``resume``: ``resume=True``; saves the weights right after the resume (before any step) to
OUT/resumed.npz. Both write OUT/result.json: the run id, the job id, ``resumed_from``.
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import horovod.tensorflow.keras as hvd  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import RecordWeights, SaveAfterResume, build  # noqa: E402
from deepfreeze.keras import DeepFreezeCheckpoint  # noqa: E402
from deepfreeze.lease import read_job_id  # noqa: E402

out, device, root, epochs, phase = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
hvd.init()
model = build()
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01, momentum=0.9)),
              loss="sparse_categorical_crossentropy")
rng = np.random.default_rng(100)
x, y = rng.random((96, 12, 12, 1), dtype=np.float32), rng.integers(0, 10, 96)  # 6 steps per epoch
ckpt = DeepFreezeCheckpoint(name="job", every_n_batches=2, mode="async", resume=phase == "resume", memtier=device,
                            scratch=f"{root}/scratch", persistent=f"{root}/pfs", lease_timeout=5)


model.fit(x, y, batch_size=16, epochs=epochs, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), ckpt,
                     SaveAfterResume(f"{out}/resumed.npz", phase == "resume"),
                     RecordWeights(ckpt, 0, lambda v: f"{out}/expected/{ckpt.run_id}-v{v}.npz")])
ckpt.wait()
run_id = ckpt.run_id
ckpt.close()
with open(f"{out}/result.json", "w") as f:
    json.dump({"run": run_id, "job": read_job_id(f"{root}/pfs", "job"), "resumed_from": ckpt.resumed_from}, f)
