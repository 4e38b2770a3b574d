"""A job split into groups, each group its own Horovod world with its own DeepFreezeCheckpoint
(run under mpirun; tests/test_clone_groups.py).

    python tests/workers/split_checkpoint.py OUT train      # 4 ranks: deepfreeze.clone.split(groups=2)
    python tests/workers/split_checkpoint.py OUT ranklist   # 4 ranks: hvd.init(comm=[0, 1]) / ([2, 3])

``train``: group g trains its own model (learning rate 0.01 * (g + 1), its own data) under the
name ``g<g>``, with partner redundancy (ec_interval=0, ec_scheme=partner); each world rank
simulates its own node (scratch OUT/node<world rank>/scratch, failure domain node<world rank>),
persistent OUT/persistent is shared. Group 1's model carries a clone parent record
(``model._deepfreeze_parent``, as ``receive_clone`` sets it). One epoch (v4, v6), then every
rank lists its scratch version directories, group rank 1 loses its scratch of the name (its
"node" is replaced), the group loads the newest version collectively (DeepFreeze's
communicator: a duplicate of the group's), with ``deepfreeze.load`` and with
``deepfreeze.restore`` into a fresh model, and a second fit with ``resume=True`` continues from
it (v8, v12). Group rank 0 saves the weights after every checkpointed step to
OUT/g<g>/expected/v<version>.npz; every rank writes OUT/g<g>/rank<group rank>.json.

``ranklist``: Horovod initialized with lists of ranks (no mpi4py communicator): fit must fail
with DeepFreeze's ConfigError on every rank before anything is written; each rank writes
OUT/ranklist_w<world rank>.json (``refused``: the message, or ``accepted``).
"""
import json
import os
import shutil
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import horovod.tensorflow.keras as hvd  # noqa: E402
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import RecordWeights, build  # noqa: E402
import deepfreeze  # noqa: E402
import deepfreeze.clone as dfc  # noqa: E402
from deepfreeze.errors import ConfigError  # noqa: E402
from deepfreeze.keras import DeepFreezeCheckpoint  # noqa: E402
from deepfreeze.keras._dist import mpi_comm  # noqa: E402

PARENT = {"name": "g0", "run": "0123456789abcdef", "step": 3}


def expected(path):
    with np.load(path, allow_pickle=False) as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


class WeightsAtTrainBegin(tf.keras.callbacks.Callback):
    """The weights and step counter right after the callbacks before it ran on_train_begin."""

    def on_train_begin(self, logs=None):
        self.weights = [w.copy() for w in self.model.get_weights()]
        self.iterations = int(self.model.optimizer.iterations.numpy())


def compiled(g):
    model = build()
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01 * (g + 1), momentum=0.9)),
                  loss="sparse_categorical_crossentropy")
    return model


def train(out):
    group = dfc.split(groups=2)
    hvd.init(comm=group.comm)
    assert (hvd.rank(), hvd.size()) == (group.rank, group.size) == (group.rank, 2)
    g, w, rank = group.index, group.world_rank, group.rank
    name = f"g{g}"
    kw = dict(scratch=f"{out}/node{w}/scratch", persistent=f"{out}/persistent", failure_domain=f"node{w}",
              mode="async", ec_interval=0, ec_scheme="partner")
    rng = np.random.default_rng(100 + w)
    x, y = rng.random((96, 12, 12, 1), dtype=np.float32), rng.integers(0, 10, 96)  # 6 steps of 16 per epoch
    record = lambda v: f"{out}/{name}/expected/v{v}.npz"  # noqa: E731

    model = compiled(g)
    if g == 1:
        model._deepfreeze_parent = dict(PARENT)
    ckpt = DeepFreezeCheckpoint(name=name, every_n_batches=4, min_shard_bytes=0, **kw)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), ckpt,
                         RecordWeights(ckpt, rank, record, at_epoch_end=True)])
    ckpt.wait()
    first = [t["version"] for t in ckpt.timings]
    ckpt.close()
    scratch = f"{out}/node{w}/scratch/{name}"
    listing = {d: sorted(os.listdir(os.path.join(scratch, d))) for d in sorted(os.listdir(scratch))}

    group.comm.Barrier()
    if rank == 1:  # this rank's node is replaced: its scratch of the name is gone
        shutil.rmtree(scratch)
    group.comm.Barrier()
    comm = mpi_comm()
    ck = deepfreeze.load(deepfreeze.Config.load(None, **kw), name, comm=comm)  # collective, over the group
    want = expected(record(ck.version))
    load_exact = [a.tobytes() for a in ck.model_arrays().values()] == [e.tobytes() for e in want]
    fresh = build()  # deepfreeze.restore into a Keras model: collective over the group too
    restored = deepfreeze.restore(fresh, name=name, **kw)
    restore_exact = [a.tobytes() for a in fresh.get_weights()] == [e.tobytes() for e in want]

    model = compiled(g)
    if g == 1:
        model._deepfreeze_parent = dict(PARENT)
    ckpt = DeepFreezeCheckpoint(name=name, every_n_batches=4, resume=True, min_shard_bytes=0, **kw)
    begin = WeightsAtTrainBegin()
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), ckpt, begin,
                         RecordWeights(ckpt, rank, record, at_epoch_end=True)])
    ckpt.wait()
    info = {"group": g, "world_rank": w, "rank": rank, "hvd_size": hvd.size(),
            "comm_size": comm.size, "comm_rank": comm.rank, "world_size": MPI.COMM_WORLD.Get_size(),
            "first": first, "listing": listing,
            "load": {"version": ck.version, "level": ck.level, "bit_exact": load_exact},
            "restore": {"version_step": list(restored), "bit_exact": restore_exact},
            "resumed_from": ckpt.resumed_from, "second": [t["version"] for t in ckpt.timings],
            "restored_iterations": begin.iterations,
            "restored_exact": [a.tobytes() for a in begin.weights] == [e.tobytes() for e in want]}
    ckpt.close()
    os.makedirs(f"{out}/{name}", exist_ok=True)
    with open(f"{out}/{name}/rank{rank}.json", "w") as f:
        json.dump(info, f)


def ranklist(out):
    w = MPI.COMM_WORLD.Get_rank()
    hvd.init(comm=[0, 1] if w < 2 else [2, 3])
    model = compiled(0)
    ckpt = DeepFreezeCheckpoint(name=f"l{w // 2}", every_n_batches=2, mode="sync", scratch=f"{out}/node{w}/scratch",
                                persistent=f"{out}/persistent", failure_domain=f"node{w}", ec_interval=0)
    x, y = np.zeros((32, 12, 12, 1), np.float32), np.zeros(32, np.int64)
    try:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[ckpt])
    except ConfigError as e:
        result = {"refused": str(e)}
    else:
        result = {"accepted": True}
    with open(f"{out}/ranklist_w{w}.json", "w") as f:  # one file per rank: tests never parse mpirun's stdout
        json.dump(result, f)


if __name__ == "__main__":
    {"train": train, "ranklist": ranklist}[sys.argv[2]](sys.argv[1])
