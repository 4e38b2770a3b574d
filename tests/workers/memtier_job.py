"""One job of a checkpoint name on a shared memory-tier device (tests/test_memtier_jobs.py).

    python tests/workers/memtier_job.py RESULT DEVICE ROOT SEED train|resume|restore [V1,V2,...]

Under ``mpirun -np N`` every rank takes part (an mpi4py communicator), else one rank. The job's
levels are ROOT/scratch-r<rank> (one scratch per simulated node) and ROOT/pfs (persistent);
the device DEVICE is shared with the other jobs of the test, the checkpoint name is always
``job``. Sync mode: the rank copies into the slot itself and flushes to persistent in the call.

* ``train``: a fresh run (``deepfreeze.run.Run``), checkpoints V1, V2, ... of ``state(SEED, V)``;
* ``resume``: a run with ``resume=True``: restores (collective ``load``), records what it got,
  then checkpoints V1, V2, ... (above the resumed version) as ``train`` does;
* ``train-anon``: as ``train`` but with an engine built without a run (no job id is made), so
  its regions carry no job id, exactly as DeepFreeze wrote them before job ids;
* ``restore``: ``deepfreeze.loader.load`` only (no run: nothing is created).

Each rank writes RESULT.r<rank>.json: the job id, the run id, the SHA-256 of every tensor of every
version it wrote (as it handed them to the engine), and what it restored (version, level, SHA-256
per tensor), or the error.
"""
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import numpy as np  # noqa: E402

from deepfreeze import Config  # noqa: E402
from deepfreeze.engine import Engine  # noqa: E402
from deepfreeze.errors import CheckpointNotFoundError  # noqa: E402
from deepfreeze.loader import load  # noqa: E402
from deepfreeze.run import Run  # noqa: E402
from deepfreeze.lease import read_job_id  # noqa: E402
from deepfreeze.shardplan import ShardPlan, TensorSpec  # noqa: E402

NAME = "job"


def state(seed: int, v: int) -> list:
    """The whole model state of version ``v`` of the job seeded ``seed`` (~200 kB, 3 tensors)."""
    r = np.random.default_rng(seed * 100_003 + v)
    return [r.standard_normal((120, 100)).astype(np.float32), r.standard_normal(7_000),
            r.integers(0, 1 << 30, 333, dtype=np.int32)]


def digests(arrays) -> list:
    return [hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() for a in arrays]


def main() -> None:
    result, device, root, seed, role = sys.argv[1:6]
    versions = [int(v) for v in sys.argv[6].split(",")] if len(sys.argv) > 6 and sys.argv[6] else []
    seed = int(seed)
    if int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        from deepfreeze.comm import MPIComm
        comm = MPIComm()
    else:
        from deepfreeze.comm import LocalComm
        comm = LocalComm()
    rank, size = comm.rank, comm.size
    cfg = Config.load(None, mode="sync", scratch=f"{root}/scratch-r{rank}", persistent=f"{root}/pfs",
                      memtier=device, lease_timeout=5)
    out: dict = {"rank": rank, "size": size, "written": {}, "restored": None, "error": None}
    try:
        if role == "restore":
            try:
                ck = load(cfg, NAME, comm=comm)
                out["restored"] = {"version": ck.version, "level": ck.level,
                                   "sha": digests(ck.arrays[f"t{i}"] for i in range(3))}
            except CheckpointNotFoundError as e:
                out["restored"] = {"none": str(e)}
            out["job"] = read_job_id(cfg.persistent, NAME)
        else:
            run = Run(cfg, NAME, rank, size, comm, resume=role == "resume") if role != "train-anon" else None
            info = run.begin() if run is not None else None
            out["job"], out["run"] = (info.job, info.id) if info is not None else (None, None)
            if role == "resume":
                try:
                    ck = load(cfg, NAME, comm=comm)
                    run.resumed(ck.version)
                    out["restored"] = {"version": ck.version, "level": ck.level,
                                       "sha": digests(ck.arrays[f"t{i}"] for i in range(3))}
                except CheckpointNotFoundError as e:
                    out["restored"] = {"none": str(e)}
            specs = [TensorSpec(i, f"t{i}", a.dtype.name, a.shape) for i, a in enumerate(state(seed, 0))]
            plan = ShardPlan.build(specs, size, min_shard_bytes=1024)
            engine = Engine(cfg, NAME, rank, plan, run=run.info if run is not None else None)
            for v in versions:
                arrays = state(seed, v)
                engine.checkpoint(v, [arrays[p.tensor_id].reshape(-1)[p.start:p.stop].copy()
                                      for p in plan.for_rank(rank)], step=v, epoch=0)
                out["written"][str(v)] = digests(arrays)
            engine.close()
            if run is not None:
                run.close()
            else:
                out["run"] = engine.run.id
    except Exception as e:  # reported to the test through the result file
        out["error"] = f"{type(e).__name__}: {e}"
    with open(f"{result}.r{rank}.json", "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
