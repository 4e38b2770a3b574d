"""Crash-free resume from the memory tier on real Horovod ranks, one device per simulated node.

    python tests/workers/memtier_resume.py OUT first|resume

Rank r uses the device OUT/node<r>/tier (created by the test), scratch OUT/node<r>/scratch and the
shared persistent OUT/persistent; a checkpoint every 2 batches, 2 epochs of 6 steps. ``first``:
rank 0 saves the weights of every checkpointed step to OUT/expected/<run>-v<V>.npz. ``resume``:
``resume=True``; rank 0 saves the model's weights right after the resume (before any step) to
OUT/resumed.npz and prints ``resumed_from=V``.
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import horovod.tensorflow.keras as hvd  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import RecordWeights, SaveAfterResume, build  # noqa: E402
from deepfreeze.keras import DeepFreezeCheckpoint  # noqa: E402

out, phase = sys.argv[1], sys.argv[2]
hvd.init()
rank = hvd.rank()
model = build()
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01, momentum=0.9)),
              loss="sparse_categorical_crossentropy")
rng = np.random.default_rng(100 + rank)
x, y = rng.random((96, 12, 12, 1), dtype=np.float32), rng.integers(0, 10, 96)  # 6 steps per epoch
ckpt = DeepFreezeCheckpoint(name="mr", every_n_batches=2, mode="async", resume=phase == "resume",
                            memtier=f"{out}/node{rank}/tier", scratch=f"{out}/node{rank}/scratch",
                            persistent=f"{out}/persistent", failure_domain=f"node{rank}", lease_timeout=5)


model.fit(x, y, batch_size=16, epochs=2 if phase == "first" else 3, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), ckpt,
                     SaveAfterResume(f"{out}/resumed.npz", rank == 0 and phase == "resume"),
                     RecordWeights(ckpt, rank, lambda v: f"{out}/expected/{ckpt.run_id}-v{v}.npz")])
ckpt.wait()
ckpt.close()
if rank == 0:
    print(f"resumed_from={ckpt.resumed_from}", flush=True)
