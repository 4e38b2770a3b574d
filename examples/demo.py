"""DeepFreeze demo: a real 2-rank Horovod training with checkpoints, then a restore.

    mpirun -np 2 python examples/demo.py train OUT    # trains, checkpoints every 5 batches
    python examples/demo.py restore OUT               # fresh process, no MPI: restore + compare

Each rank simulates its own node: its own scratch directory and failure domain,
hence its own backend process. The persistent directory is shared.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import deepfreeze  # noqa: E402
from experiments import models  # noqa: E402
from deepfreeze.keras import DeepFreezeCheckpoint  # noqa: E402

NAME = "demo"
CFG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "veloc_cfg", "local.cfg")


def build_model() -> tf.keras.Model:
    """A small CNN (conv, batch norm, dense): the same model experiments/ measures as "demo"."""
    return models.demo()


ENGINE = os.environ.get("DEEPFREEZE_ENGINE", "builtin")


def dirs(out: str, rank: int) -> dict[str, str]:
    """Each rank simulates its own node (scratch directory, failure domain). With VeloC all
    ranks share one node: VeloC runs one backend per user and machine, with one configuration."""
    node = 0 if ENGINE == "veloc" else rank
    return {"scratch": os.path.join(out, f"node{node}", "scratch"),
            "persistent": os.path.join(out, "persistent"),
            "failure_domain": f"node{node}"}


class RecordWeights(tf.keras.callbacks.Callback):
    """Rank 0 keeps the weights the model had at the newest checkpoint (the reference)."""

    def __init__(self, ckpt: DeepFreezeCheckpoint, out: str) -> None:
        super().__init__()
        self.ckpt, self.out, self.seen = ckpt, out, None

    def on_train_batch_end(self, batch, logs=None):
        v = self.ckpt.last_version
        if v is not None and v != self.seen:
            self.seen = v
            np.savez(os.path.join(self.out, "expected.npz"), version=v, *self.model.get_weights())

    on_epoch_end = on_train_batch_end


def train(out: str) -> None:
    import horovod.tensorflow.keras as hvd
    hvd.init()
    rank = hvd.rank()
    rng = np.random.default_rng(rank)
    x = rng.random((640, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, 640)
    model = build_model()
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    ckpt = DeepFreezeCheckpoint(config=CFG, name=NAME, every_n_batches=5, engine=ENGINE, **dirs(out, rank))
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), ckpt]
    if rank == 0:
        callbacks.append(RecordWeights(ckpt, out))
    model.fit(x, y, batch_size=32, epochs=2, callbacks=callbacks, verbose=0)
    ckpt.wait()  # the backend's flush to persistent is done when this returns
    t = [d["blocking_s"] * 1e3 for d in ckpt.timings]
    quiet = 1e3 * float(np.median(ckpt.quiet_times)) if len(ckpt.quiet_times) else float("nan")
    print(f"demo: rank {rank} ({ckpt.engine.kind} engine): {len(t)} checkpoints, blocking {np.median(t):.2f} ms median, "
          f"{max(t):.2f} ms max; DeepFreeze's batch hooks without a checkpoint: {quiet:.3f} ms median; "
          f"{max(ckpt.plan.rank_bytes()) / 1e6:.2f} MB per rank", flush=True)
    if rank == 0:  # Keras times all callbacks together over batches 0-5
        print("demo: a Keras warning 'Callback method `on_train_batch_end` is slow' above comes from Horovod's "
              "BroadcastGlobalVariablesCallback (it broadcasts the weights at the end of batch 0); DeepFreeze's "
              "own hook times are the numbers above", flush=True)
    ckpt.close()


def restore(out: str) -> int:
    model = build_model()
    version, step = deepfreeze.restore(model, config=CFG, name=NAME, engine=ENGINE, **dirs(out, 0))
    with np.load(os.path.join(out, "expected.npz"), allow_pickle=False) as ref:
        expected_version = int(ref["version"])
        expected = [ref[f"arr_{i}"] for i in range(len(ref.files) - 1)]
    got = model.get_weights()
    if version != expected_version:
        print(f"demo: FAILED newest version is {version}, training's last checkpoint was {expected_version}")
        return 1
    bad = [w.name for w, a, b in zip(model.weights, got, expected) if a.tobytes() != b.tobytes()]
    if bad or len(got) != len(expected):
        print(f"demo: FAILED {len(bad)} tensors differ: {bad[:3]}")
        return 1
    print(f"demo: OK restored {len(got)} tensors bit-exact from version {version}")
    return 0


if __name__ == "__main__":
    cmd, out = sys.argv[1], os.path.abspath(sys.argv[2])
    if cmd == "train":
        train(out)
    else:
        sys.exit(restore(out))
