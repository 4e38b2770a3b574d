"""One rank of a checkpoint job on the test cluster (numpy only, starts in a second).

    ckpt_job.py write SCRATCH SHARED V1,V2,... [key=value ...]   every rank checkpoints synthetic tensors
    ckpt_job.py restore SCRATCH SHARED [VERSION] [key=value ...] collective restore (MPIComm); every rank
                                                                 writes SHARED/restored.rank<r>.json

SCRATCH is the node-local scratch (the same path on every node, other contents); persistent is
SHARED/persistent (the parallel file system). The failure domain is the default: the host name,
that is the node. The tensors and their values are tests/workers/numpy_job.py's (one seed per
version), so a restore is compared bit for bit with what was written. Keys: mode, ec_scheme and
the INI keys persistent_interval, ec_interval, max_versions, scratch_versions, memtier.
"""
import faulthandler
import json
import logging
import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "workers"))

from numpy_job import arrays, tensors  # noqa: E402

from deepfreeze import Config, load, node  # noqa: E402
from deepfreeze.run import make_engine  # noqa: E402
from deepfreeze.comm import MPIComm  # noqa: E402
from deepfreeze.shardplan import ShardPlan  # noqa: E402

DEFAULTS = {"mode": "async", "ec_scheme": "xor", "persistent_interval": "0", "ec_interval": "-1",
            "max_versions": "0", "scratch_versions": "0"}


def main():
    faulthandler.register(signal.SIGUSR1)  # a test that times out can ask where each rank is
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    cmd, scratch, shared = sys.argv[1], sys.argv[2], sys.argv[3]
    rest = sys.argv[4:]
    positional = [a for a in rest if "=" not in a]
    opts = dict(DEFAULTS, **dict(a.split("=", 1) for a in rest if "=" in a))
    comm = MPIComm()
    rank, size = comm.rank, comm.size
    cfg = Config.load(None, scratch=f"{scratch}/ckpt", persistent=f"{shared}/persistent", **opts)
    out = {"rank": rank, "size": size, "node": node.node_id(), "host": node.host_name(),
           "domain": cfg.failure_domain}
    if cmd == "write":
        versions = [int(v) for v in positional[0].split(",")]
        plan = ShardPlan.build(tensors(), size, min_shard_bytes=1024)
        domains = [d.decode() for d in comm.allgather(cfg.failure_domain.encode())]
        eng = make_engine("builtin", cfg, "job", rank, plan, domains, comm=comm, mpi_comm=comm.comm)
        for v in versions:
            full = [a.reshape(-1) for a in arrays(v)]
            eng.checkpoint(v, [full[p.tensor_id][p.start:p.stop] for p in plan.for_rank(rank)], step=v, epoch=0)
        eng.close()
        out["written"] = versions
    else:
        version = int(positional[0]) if positional else None
        ck = load(cfg, "job", version, comm=comm)
        same = {f"t{i}": ck.arrays[f"t{i}"].tobytes() == e.tobytes() for i, e in enumerate(arrays(ck.version))}
        out.update(version=ck.version, level=ck.level, bit_exact=all(same.values()), same=same)
    path = f"{shared}/{cmd}.rank{rank}.json"
    with open(path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(path + ".tmp", path)
    comm.close()


if __name__ == "__main__":
    main()
