"""Crash-then-resume with non-determinism (issue 11, case 1) on real Horovod ranks.

    python tests/workers/crash_resume.py OUT first|resume [kill_at=V]

``first``: rank 1 is killed (SIGKILL) half-way through writing its shard of version V, while
rank 0 has written (and its backend may be flushing) its own. ``resume``: the relaunched job
resumes with Keras' default ``shuffle=True`` (its data order differs from the first run's).
Rank 0 saves the model weights of every checkpointed step to OUT/expected/<run id>-v<V>.npz.
"""
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import horovod.tensorflow.keras as hvd  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import RecordWeights, build  # noqa: E402
from deepfreeze.keras import DeepFreezeCheckpoint  # noqa: E402
from deepfreeze.tiers.scratch import ScratchLevel  # noqa: E402

out, phase = sys.argv[1], sys.argv[2]
opts = dict(a.split("=", 1) for a in sys.argv[3:])
kill_at = int(opts.get("kill_at", -1)) if phase == "first" else -1
hvd.init()
rank = hvd.rank()


class KilledWhileWriting(ScratchLevel):
    def write_shard(self, name, version, rank_, plan, arrays, **kw):
        if rank_ == 1 and version == kill_at:
            # as write_shard does: the version directory first (it may not exist yet on this node)
            self.makedirs(self.version_dir(name, version))
            with open(os.path.join(self.version_dir(name, version), ".r000001.dfs.tmp-half"), "wb") as f:
                f.write(b"\0" * 1000)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().write_shard(name, version, rank_, plan, arrays, **kw)


model = build()
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01, momentum=0.9)),
              loss="sparse_categorical_crossentropy")
rng = np.random.default_rng(100 + rank)
x, y = rng.random((96, 12, 12, 1), dtype=np.float32), rng.integers(0, 10, 96)  # 6 steps per epoch
ckpt = DeepFreezeCheckpoint(name="r", every_n_batches=2, mode="async", resume=phase == "resume",
                            scratch=f"{out}/node{rank}/scratch", persistent=f"{out}/persistent",
                            failure_domain=f"node{rank}", scratch_cls=KilledWhileWriting, lease_timeout=5)


model.fit(x, y, batch_size=16, epochs=2, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), ckpt,
                   RecordWeights(ckpt, rank, lambda v: f"{out}/expected/{ckpt.run_id}-v{v}.npz")])
ckpt.close()
if rank == 0:
    print(f"run={ckpt.run_id} resumed_from={ckpt.resumed_from}", flush=True)
