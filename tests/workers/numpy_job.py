"""numpy-only MPI worker for the engine and redundancy suites (no TensorFlow: starts in a second).

    numpy_job.py write ROOT NODES V1,V2,... [key=value ...]   every rank checkpoints synthetic tensors
    numpy_job.py restore ROOT NODES [VERSION] [key=value ...] collective restore; rank 0 writes
                                                              ROOT/restored.json

Rank r lives on simulated node r * NODES // size (scratch ROOT/node<k>/scratch, failure
domain node<k>); persistent is ROOT/persistent. Keys: engine (builtin|veloc), mode,
ec_scheme, and the INI keys persistent_interval, ec_interval, max_versions,
scratch_versions (defaults below).
"""
import json
import logging
import sys

import numpy as np

from deepfreeze import Config, load
from deepfreeze.run import make_engine
from deepfreeze.comm import MPIComm
from deepfreeze.shardplan import ShardPlan, TensorSpec

SHAPES = [(300, 257), (1000,), (64, 33, 7), (5,), (70000,)]
DEFAULTS = {"engine": "builtin", "mode": "async", "ec_scheme": "xor", "persistent_interval": "-1",
            "ec_interval": "0", "max_versions": "0", "scratch_versions": "2"}


def tensors():
    dts = ["float32", "float32", "float64", "int64", "float16"]
    return [TensorSpec(i, f"t{i}", d, s) for i, (s, d) in enumerate(zip(SHAPES, dts))]


def arrays(version):
    out = []
    for t in tensors():
        rng = np.random.default_rng(version * 100 + t.id)
        out.append((rng.standard_normal(t.shape) * 100).astype(t.dtype))
    return out


def config(root, node, opts):
    keys = {k: v for k, v in opts.items() if k not in ("engine",)}
    return Config.load(None, scratch=f"{root}/node{node}/scratch", persistent=f"{root}/persistent",
                       failure_domain=f"node{node}", **keys)


def main():
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    cmd, root, nodes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rest = sys.argv[4:]
    positional = [a for a in rest if "=" not in a]
    opts = dict(DEFAULTS, **dict(a.split("=", 1) for a in rest if "=" in a))
    comm = MPIComm()
    rank, size = comm.rank, comm.size
    node = rank * nodes // size
    cfg = config(root, node, opts)
    if cmd == "write":
        versions = [int(v) for v in positional[0].split(",")]
        plan = ShardPlan.build(tensors(), size, min_shard_bytes=1024)
        domains = [f"node{r * nodes // size}" for r in range(size)]
        eng = make_engine(opts["engine"], cfg, "job", rank, plan, domains, comm=comm, mpi_comm=comm.comm)
        for v in versions:
            full = [a.reshape(-1) for a in arrays(v)]
            eng.checkpoint(v, [full[p.tensor_id][p.start:p.stop] for p in plan.for_rank(rank)], step=v, epoch=0)
        eng.close()
    else:
        version = int(positional[0]) if positional else None
        ck = load(cfg, "job", version, comm=comm)
        same = [ck.arrays[f"t{i}"].tobytes() == e.tobytes() for i, e in enumerate(arrays(ck.version))]
        if rank == 0:
            with open(f"{root}/restored.json", "w") as f:
                json.dump({"version": ck.version, "level": ck.level, "bit_exact": all(same), "size": size}, f)
        assert all(same), f"rank {rank}: restored v{ck.version} differs: {same}"
    comm.close()


if __name__ == "__main__":
    main()
