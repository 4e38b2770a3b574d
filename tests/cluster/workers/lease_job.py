"""One rank of a slow Horovod Keras job for the lease across nodes (one rank per job).

    lease_job.py SCRATCH SHARED TAG first|resume [stop_after=N]

Name ``lease`` on persistent SHARED/persistent, scratch SCRATCH/lease, lease_timeout 4 s, a
checkpoint every 2 batches, 0.2 s per batch. It trains until SHARED/stop-TAG exists, or (with
``stop_after``) until it has checkpointed N versions past the one it resumed from. Then it writes
SHARED/TAG.json: its run id, the version it resumed from, its last version, and the DeepFreeze
error that stopped it (type and message), if any.
"""
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import horovod.tensorflow.keras as hvd  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "workers"))
from models import build  # noqa: E402
from deepfreeze import node  # noqa: E402
from deepfreeze.errors import DeepFreezeError  # noqa: E402
from deepfreeze.keras import DeepFreezeCheckpoint  # noqa: E402

scratch, shared, tag, phase = sys.argv[1:5]
opts = dict(a.split("=", 1) for a in sys.argv[5:])
stop_after = int(opts.get("stop_after", 0))
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
hvd.init()
model = build()
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)), loss="sparse_categorical_crossentropy")
rng = np.random.default_rng(5)
x, y = rng.random((96, 12, 12, 1), dtype=np.float32), rng.integers(0, 10, 96)
ckpt = DeepFreezeCheckpoint(name="lease", every_n_batches=2, mode="async", resume=phase == "resume",
                            scratch=f"{scratch}/lease", persistent=f"{shared}/persistent", lease_timeout=4)
out = {"tag": tag, "node": node.node_id(), "error": None}


class Pace(tf.keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        out["run"], out["resumed_from"] = ckpt.run_id, ckpt.resumed_from
        out["started"] = time.time()

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(0.2)
        v = ckpt.last_version
        if os.path.exists(f"{shared}/stop-{tag}") or (stop_after and v is not None
                                                       and v >= (ckpt.resumed_from or 0) + 2 * stop_after):
            self.model.stop_training = True


try:
    model.fit(x, y, batch_size=16, epochs=200, verbose=0, callbacks=[ckpt, Pace()])
    ckpt.wait()
except DeepFreezeError as e:
    out["error"] = [type(e).__name__, str(e)]
finally:
    try:
        ckpt.close()
    except DeepFreezeError as e:
        out["error"] = out["error"] or [type(e).__name__, str(e)]
out["last_version"] = ckpt.last_version
with open(f"{shared}/{tag}.json.tmp", "w") as f:
    json.dump(out, f)
os.replace(f"{shared}/{tag}.json.tmp", f"{shared}/{tag}.json")
