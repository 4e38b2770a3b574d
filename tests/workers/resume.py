"""Resume worker: train, optionally die by SIGKILL at a step, or resume; save the final state.

    python tests/workers/resume.py OUT [kill_at=N] [resume=1] [hvd=1] [lazy=1]

Deterministic (op determinism, fixed seeds, shuffle=False), so an uninterrupted run and a
killed-then-resumed run must end bit-identical. With hvd=1 it runs under mpirun (each rank its
own simulated node); rank 0 writes OUT/final.npz. lazy=1: the model has no Input layer (not built
when fit starts, as in Horovod's examples). Rank 0 saves the weights right after every
checkpointed step to OUT/expected/v<version>.npz.
"""
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import RecordWeights, build  # noqa: E402
from deepfreeze.keras import DeepFreezeCheckpoint  # noqa: E402

out = sys.argv[1]
opts = dict(a.split("=", 1) for a in sys.argv[2:])
tf.config.experimental.enable_op_determinism()
rank, size, callbacks = 0, 1, []
opt = tf.keras.optimizers.SGD(0.01, momentum=0.9)
if opts.get("hvd") == "1":
    import horovod.tensorflow.keras as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    opt = hvd.DistributedOptimizer(opt)
    callbacks.append(hvd.callbacks.BroadcastGlobalVariablesCallback(0))
model = build(lazy=opts.get("lazy") == "1")
model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
rng = np.random.default_rng(100 + rank)
x, y = rng.random((96, 12, 12, 1), dtype=np.float32), rng.integers(0, 10, 96)  # 6 steps per epoch
ckpt = DeepFreezeCheckpoint(name="r", every_n_batches=4, mode="async", resume=opts.get("resume") == "1",
                            scratch=f"{out}/node{rank}/scratch", persistent=f"{out}/persistent",
                            failure_domain=f"node{rank}")
callbacks.append(ckpt)


class Die(tf.keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == int(opts.get("kill_at", -1)):
            ckpt.engine.wait(persistent=True)  # this rank's part of the last checkpoint is flushed
            if size > 1:  # and every rank's, before any dies: a dead rank ends the job (mpirun kills the others,
                hvd.allreduce(0.0, name="flushed_before_kill")  # whose flush may still be running under load)
            os.kill(os.getpid(), signal.SIGKILL)  # then: kill -9


callbacks += [RecordWeights(ckpt, rank, lambda v: f"{out}/expected/v{v}.npz"), Die()]
model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
ckpt.wait()
if rank == 0:
    np.savez(f"{out}/final.npz", *model.get_weights(), *[v.numpy() for v in model.optimizer.variables()])
    print(f"resumed_from={ckpt.resumed_from} iterations={int(model.optimizer.iterations.numpy())}", flush=True)
ckpt.close()
