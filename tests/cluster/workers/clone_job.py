"""DeepClone across nodes (numpy + mpi4py, no TensorFlow; starts in a second).

    clone_job.py OUT SIZES [late=SECONDS]

Run by ``mpirun -H n1:1,n2:1,n3:1 -np 3`` with SIZES ``2,1``: the source group (ranks on n1 and
n2) trains a few numpy steps on state seeded from ``os.urandom`` (so no run can guess another's
bytes), records the state it clones (every source rank: ``OUT/source.r<rank>.npz``), and sends it
with :func:`deepfreeze.clone.send`; the clone group (n3) receives it with
:func:`deepfreeze.clone.receive` and records what it got (``OUT/clone.r<rank>.npz``). The
tensor ``bn_mean`` differs per source rank (sent whole from source rank 0). Every rank writes
``OUT/g<group>r<rank>.json``: host, node id, bytes sent or received, errors.

``late=S``: every clone rank writes ``OUT/clone-waiting`` and sleeps S seconds before receiving
(the test loses the clone's node meanwhile: the job must end, never wait).
"""
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import deepfreeze.clone as dfc
from deepfreeze import node
from deepfreeze.errors import CloneError, ModelMismatchError
from deepfreeze.shardplan import TensorSpec

out, sizes = sys.argv[1], tuple(int(s) for s in sys.argv[2].split(","))
opts = dict(a.split("=", 1) for a in sys.argv[3:])
group = dfc.split(sizes=sizes)
SHAPES = [("dense/kernel", "float32", (512, 1001)), ("dense/bias", "float64", (100003,)), ("step", "int64", ()),
          ("small", "int32", (7,)), ("empty", "float32", (0, 3)), ("bn_mean", "float32", (50000,))]
WHOLE = [5]
specs = [TensorSpec(i, n, d, s) for i, (n, d, s) in enumerate(SHAPES)]
result = {"group": group.index, "rank": group.rank, "host": node.host_name(), "node": node.node_id(), "errors": []}
t0 = time.monotonic()


def save_json() -> None:
    path = f"{out}/g{group.index}r{group.rank}.json"
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def save_npz(path: str, arrays) -> None:
    with open(path + ".tmp", "wb") as f:
        np.savez(f, *arrays)
    os.replace(path + ".tmp", path)


def train(seed: int, rank: int, steps: int = 3):
    """A few deterministic 'optimizer steps' on state seeded by ``seed`` (identical on every source
    rank but ``bn_mean``, which each rank updates with its own 'batch statistics')."""
    rng = np.random.default_rng(seed)
    state = [rng.standard_normal(s).astype(d) if d.startswith("float") else rng.integers(-9, 9, s).astype(d)
             for _, d, s in SHAPES]
    state[2][...] = 0  # the step counter
    for k in range(steps):
        g = np.random.default_rng([seed, k])
        state[0] -= np.float32(0.01) * g.standard_normal(state[0].shape).astype(np.float32)
        state[1] -= 0.01 * g.standard_normal(state[1].shape)
        state[2] += 1
        own = np.random.default_rng([seed, k, rank]).standard_normal(state[5].shape).astype(np.float32)
        state[5] = np.float32(0.9) * state[5] + np.float32(0.1) * own
    return state


try:
    if group.is_source:
        seed = group.comm.bcast(int.from_bytes(os.urandom(8), "little") if group.rank == 0 else None, root=0)
        state = train(seed, group.rank)
        save_npz(f"{out}/source.r{group.rank}.npz", state)  # the state recorded in the source run
        snd = dfc.send(group, specs, state, dfc.CloneInfo(int(state[2]), 0, 3, False, "cafe" * 4), whole=WHOLE,
                       timeout=120)
        result["sent"] = snd.bytes_sent
    else:
        if "late" in opts:
            with open(f"{out}/clone-waiting", "w") as f:
                f.write(node.host_name())
            time.sleep(float(opts["late"]))
        got, info = dfc.receive(group, specs, whole=WHOLE, timeout=120)
        save_npz(f"{out}/clone.r{group.rank}.npz", got)
        result["received"] = sum(a.nbytes for a in got)
        result["info"] = {"step": info.step, "run": info.source_run}
except (ModelMismatchError, CloneError) as e:
    result["errors"].append([type(e).__name__, str(e)])
result["seconds"] = time.monotonic() - t0
save_json()
MPI.COMM_WORLD.Barrier()
