"""Keras fit on Horovod ranks with the memory tier (``memtier = DEVICE``), a checkpoint every batch.

    python tests/workers/memtier_keras.py OUT DEVICE

Rank 0 saves the model weights of every checkpointed step to OUT/expected/v<V>.npz (RecordWeights);
every rank writes its engine's memory-tier counters to OUT/stats.r<rank>.json.
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import horovod.tensorflow.keras as hvd  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import RecordWeights, build  # noqa: E402
from deepfreeze.keras import DeepFreezeCheckpoint  # noqa: E402

out, device = sys.argv[1], sys.argv[2]
hvd.init()
rank = hvd.rank()
model = build()
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01, momentum=0.9)),
              loss="sparse_categorical_crossentropy")
rng = np.random.default_rng(100 + rank)
x, y = rng.random((96, 12, 12, 1), dtype=np.float32), rng.integers(0, 10, 96)  # 6 steps per epoch
ckpt = DeepFreezeCheckpoint(name="mt", every_n_batches=1, mode="async", memtier=device,
                            scratch=f"{out}/node{rank}/scratch", persistent=f"{out}/persistent",
                            failure_domain=f"node{rank}", lease_timeout=5)
model.fit(x, y, batch_size=16, epochs=2, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), ckpt,
                     RecordWeights(ckpt, rank, lambda v: f"{out}/expected/v{v}.npz")])
engine = ckpt.engine
ckpt.wait()
stats = {"memtier_stats": {str(v): s for v, s in engine.memtier_stats.items()}, "memtier_waits": engine.memtier_waits,
         "write_waits": engine.write_waits, "data_bytes": engine._mt_layout.data_bytes,
         "model_tensors": len(model.weights)}
ckpt.close()
with open(f"{out}/stats.r{rank}.json", "w") as f:
    json.dump(stats, f)
