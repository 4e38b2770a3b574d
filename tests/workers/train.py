"""Multi-rank training worker for the tests (run under mpirun).

    python tests/workers/train.py OUT MODE [key=value ...] [+ OUT2 MODE2 [key=value ...] ...]

Each ``+`` starts another job of the same ranks, run after the one before it in the same processes
(a fresh model and checkpoint, Keras' session cleared: the layer names of a fresh process; one
TensorFlow and Horovod start-up for several jobs); ``env.KEY=VALUE`` sets ``KEY`` in the environment
for that job only (as if the job had been started with it, e.g. ``env.VELOC_WRITE_ONCE=off``). Each rank simulates its own node: scratch OUT/node<rank>/scratch, failure domain
node<rank>; persistent is OUT/persistent. Rank 0 saves the weights the model has
right after every checkpointed step to OUT/expected/v<version>.npz, the reference
the tests compare the checkpoints with.
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import horovod.tensorflow.keras as hvd  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jobargs  # noqa: E402
from models import RecordWeights, build  # noqa: E402
from deepfreeze.keras import DeepFreezeCheckpoint  # noqa: E402
from deepfreeze.tiers.scratch import ScratchLevel  # noqa: E402


def killing_level(rank: int, version: int) -> type:
    """Fault injection: rank ``rank`` dies by SIGKILL halfway through writing ``version``."""

    class KillMidWrite(ScratchLevel):
        def write_shard(self, name, v, r, plan, arrays, **kw):
            if (r, v) == (rank, version):
                import signal
                vdir = self.version_dir(name, v)
                os.makedirs(vdir, exist_ok=True)
                with open(os.path.join(vdir, f".r{r:06d}.dfs.tmp-dying"), "wb") as f:
                    f.write(b"DEEPFRZ\0" + b"\1" * 1000)  # a partial write
                    f.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
            return super().write_shard(name, v, r, plan, arrays, **kw)

    return KillMidWrite


def main() -> None:
    import deepfreeze.keras.callback as cb
    hvd.init()
    layer_record = cb._layer_record
    environ, job_env = dict(os.environ), []
    for i, job in enumerate(jobargs.split(sys.argv[1:], "+")):
        if i:
            tf.keras.backend.clear_session()  # the next job's layers are named as in a fresh process
            cb._layer_record = layer_record  # no_layers=1 is one job's
        for k in job_env:  # the job before's env.KEY=VALUE undone (only those keys: other threads read the environment)
            if k in environ:
                os.environ[k] = environ[k]
            else:
                os.environ.pop(k, None)
        job_env = [a[4:].split("=", 1)[0] for a in job[2:] if a.startswith("env.")]
        os.environ.update(dict(a[4:].split("=", 1) for a in job[2:] if a.startswith("env.")))
        run_job(job)


def run_job(argv: list[str]) -> None:
    out, mode = argv[0], argv[1]
    opts = dict(a.split("=", 1) for a in argv[2:])
    rank = hvd.rank()
    if opts.get("no_layers") == "1":  # a checkpoint as DeepFreeze wrote them before manifests recorded the graph
        import deepfreeze.keras.callback as cb
        cb._layer_record = lambda model: None
    model = build(opts.get("model", "small"))
    rng = np.random.default_rng(100 + rank)
    x = rng.random((int(opts.get("samples", 256)),) + tuple(model.input_shape[1:]), dtype=np.float32)
    y = rng.integers(0, 10, len(x))
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01, momentum=0.9))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    node = 0 if opts.get("engine") == "veloc" else rank  # VeloC: one backend per machine, one scratch
    ckpt = DeepFreezeCheckpoint(
        name=opts.get("name", "job"), every_n_batches=int(opts.get("every", 3)), mode=mode,
        engine=opts.get("engine", "builtin"),
        scratch=f"{out}/node{node}/scratch", persistent=f"{out}/persistent", failure_domain=f"node{node}",
        max_versions=int(opts.get("max_versions", 0)), scratch_versions=int(opts.get("scratch_versions", 0)),
        min_shard_bytes=int(opts.get("min_shard_bytes", 4096)), on_error=opts.get("on_error", "raise"),
        ec_interval=float(opts.get("ec_interval", -1)), persistent_interval=float(opts.get("persistent_interval", 0)),
        scratch_cls=killing_level(*map(int, opts["kill"].split(":"))) if "kill" in opts else ScratchLevel)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), ckpt,
                 RecordWeights(ckpt, rank, lambda v: f"{out}/expected/v{v}.npz", at_epoch_end=True)]
    second = None
    if "second" in opts:  # a second checkpoint sink on the same hook: other name, schedule and capture
        second = DeepFreezeCheckpoint(
            name=opts["second"], every_n_batches=int(opts.get("every2", 4)), at_epoch_end=False, mode=mode,
            capture=opts.get("capture2", "graph"), scratch=f"{out}/node{node}/scratch",
            persistent=f"{out}/persistent", failure_domain=f"node{node}", min_shard_bytes=0)
        callbacks += [second, RecordWeights(second, rank, lambda v: f"{out}/expected2/v{v}.npz")]
    model.fit(x, y, batch_size=16, epochs=int(opts.get("epochs", 2)), verbose=0, callbacks=callbacks)
    if second is not None:
        second.wait()
        with open(f"{out}/second{rank}.json", "w") as f:
            json.dump({"versions": [t["version"] for t in second.timings]}, f)
        second.close()
    ckpt.wait()
    info = {"rank": rank, "versions": [t["version"] for t in ckpt.timings],
            "blocking_ms": [1e3 * t["blocking_s"] for t in ckpt.timings],
            "optimizer_class": type(model.optimizer).__name__, "rank_bytes": ckpt.plan.rank_bytes()}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(info, f)
    ckpt.close()


if __name__ == "__main__":
    main()
