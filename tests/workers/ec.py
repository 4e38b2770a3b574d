"""numpy-only MPI worker for the redundancy tests (no TensorFlow: starts in a second).

    ec.py write ROOT SCHEME NODES V1,V2,...   every rank checkpoints synthetic tensors
    ec.py restore ROOT NODES [VERSION]        collective restore; rank 0 writes ROOT/restored.json

Rank r lives on simulated node r * NODES // size (scratch ROOT/node<k>/scratch,
failure domain node<k>); persistent is ROOT/persistent, off unless PERSISTENT_INTERVAL is set.
"""
import json
import logging
import os
import sys

import numpy as np

from deepfreeze import Config, load
from deepfreeze.engine import Engine
from deepfreeze.redundancy import MPIComm
from deepfreeze.shardplan import ShardPlan, TensorSpec

SHAPES = [(300, 257), (1000,), (64, 33, 7), (5,), (70000,)]


def tensors():
    dts = ["float32", "float32", "float64", "int64", "float16"]
    return [TensorSpec(i, f"t{i}", d, s) for i, (s, d) in enumerate(zip(SHAPES, dts))]


def arrays(version):
    out = []
    for t in tensors():
        rng = np.random.default_rng(version * 100 + t.id)
        out.append((rng.standard_normal(t.shape) * 100).astype(t.dtype))
    return out


def config(root, node, **kw):
    return Config.load(None, mode=os.environ.get("MODE", "async"), scratch=f"{root}/node{node}/scratch",
                       persistent=f"{root}/persistent", failure_domain=f"node{node}", ec_interval=0,
                       persistent_interval=float(os.environ.get("PERSISTENT_INTERVAL", -1)),
                       max_versions=0, scratch_versions=2, **kw)


def main():
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    cmd, root = sys.argv[1], sys.argv[2]
    comm = MPIComm()
    rank, size = comm.rank, comm.size
    if cmd == "write":
        scheme, nodes, versions = sys.argv[3], int(sys.argv[4]), [int(v) for v in sys.argv[5].split(",")]
        node = rank * nodes // size
        cfg = config(root, node, ec_scheme=scheme)
        plan = ShardPlan.build(tensors(), size, min_shard_bytes=1024)
        domains = [f"node{r * nodes // size}" for r in range(size)]
        eng = Engine(cfg, "ec", rank, plan, domains, comm=comm)
        for v in versions:
            full = [a.reshape(-1) for a in arrays(v)]
            eng.checkpoint(v, [full[p.tensor_id][p.start:p.stop] for p in plan.for_rank(rank)], step=v, epoch=0)
        eng.close()
    else:
        nodes = int(sys.argv[3])
        version = int(sys.argv[4]) if len(sys.argv) > 4 else None
        cfg = config(root, rank * nodes // size)
        ck = load(cfg, "ec", version, comm=comm)
        exp = arrays(ck.version)
        same = [ck.arrays[f"t{i}"].tobytes() == e.tobytes() for i, e in enumerate(exp)]
        if rank == 0:
            with open(f"{root}/restored.json", "w") as f:
                json.dump({"version": ck.version, "level": ck.level, "bit_exact": all(same), "size": size}, f)
        assert all(same), f"rank {rank}: restored v{ck.version} differs: {same}"
    comm.close()


if __name__ == "__main__":
    main()
