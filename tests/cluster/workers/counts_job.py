"""One rank of the counted checkpoint job (tests/cluster/test_cluster_counts.py; numpy only).

    counts_job.py SCRATCH SHARED T ELEMS VERSIONS

Every rank checkpoints T float32 tensors of ELEMS elements each (rank-independent values, one
seed per version) as versions 1..VERSIONS through the builtin engine in async mode (one backend
per node), XOR parity across the nodes (ec_interval 0), every version flushed to
SHARED/persistent (persistent_interval 0), nothing retired (max_versions 0, scratch_versions 0).
DEEPFREEZE_COUNTERS (set by the test) makes the engine dump this rank's counters at close and
the node's backend its own at exit (:mod:`deepfreeze.counters`). Each rank writes
SHARED/counts.rank<r>.json with its rank, host and plan.
"""
import json
import logging
import os
import sys

import numpy as np

from deepfreeze import Config
from deepfreeze.run import make_engine
from deepfreeze.comm import MPIComm
from deepfreeze.shardplan import ShardPlan, TensorSpec


def main():
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    scratch, shared, t, elems, versions = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    comm = MPIComm()
    cfg = Config.load(None, mode="async", scratch=f"{scratch}/ckpt", persistent=f"{shared}/persistent",
                      ec_scheme="xor", ec_interval=0, persistent_interval=0, max_versions=0, scratch_versions=0)
    tensors = [TensorSpec(i, f"t{i}", "float32", (elems,)) for i in range(t)]
    plan = ShardPlan.build(tensors, comm.size, min_shard_bytes=1024)
    domains = [d.decode() for d in comm.allgather(cfg.failure_domain.encode())]
    eng = make_engine("builtin", cfg, "job", comm.rank, plan, domains, comm=comm, mpi_comm=comm.comm)
    for v in range(1, versions + 1):
        full = [np.random.default_rng(v * 100 + i).standard_normal(elems).astype(np.float32) for i in range(t)]
        eng.checkpoint(v, [full[p.tensor_id][p.start:p.stop] for p in plan.for_rank(comm.rank)], step=v, epoch=0)
    eng.close()
    path = f"{shared}/counts.rank{comm.rank}.json"
    with open(path + ".tmp", "w") as f:
        json.dump({"rank": comm.rank, "size": comm.size, "host": os.uname().nodename, "domains": domains,
                   "redundancy": eng.redundancy}, f)
    os.replace(path + ".tmp", path)
    comm.close()


if __name__ == "__main__":
    main()
