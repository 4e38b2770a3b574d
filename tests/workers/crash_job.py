"""A framework-neutral 2-rank job in one process (two engines, sync mode) for the crash-point
suite: ``crash_job.py <dir> first|recover|overwrite [n_versions]``.

Environment knobs of a scenario: ``JOB_MODE=async`` (flushes in the backend process),
``JOB_SLEEP=<s>`` (between versions, so the lease heartbeat runs), ``JOB_FAIL_AT=<v>`` (rank
1's shard write of version v fails half-way, injected by subclassing ScratchLevel),
``JOB_WRITE_ONCE=on|off|auto`` (INI ``write_once``; default off: the scratch path).

Before each checkpoint the full state is recorded in ``<dir>/rec/<run>-<version>.npz`` (the
weights the restore must return bit-exact); after both ranks' calls returned (sync mode: the
version is committed on persistent) ``<run> <version>`` is appended to ``<dir>/committed.log``.
``recover`` is a relaunch: a new run with resume, from the newest version any level holds.
With ``DEEPFREEZE_CRASH_AT`` set the process kills itself at that point (deepfreeze.crashpoints).
"""
import errno
import os
import sys
import time

import numpy as np

from deepfreeze.config import Config
from deepfreeze.engine import Engine
from deepfreeze.errors import CheckpointNotFoundError, CheckpointWriteError
from deepfreeze.fsafe import replacing_path
from deepfreeze.tiers.scratch import ScratchLevel
from deepfreeze.loader import load
from deepfreeze.run import Run
from deepfreeze.shardplan import ShardPlan, TensorSpec

NAME = "job"
TENSORS = [TensorSpec(0, "dense/kernel", "float32", (64, 48)), TensorSpec(1, "dense/bias", "float64", (48,)),
           TensorSpec(2, "counter", "int64", ())]


def config(d: str) -> Config:
    return Config.load(None, mode=os.environ.get("JOB_MODE", "sync"), scratch=f"{d}/scratch",
                       persistent=f"{d}/persistent", persistent_interval=0, max_versions=3, scratch_versions=2,
                       lease_timeout=1.5, write_once=os.environ.get("JOB_WRITE_ONCE", "off"))


class FailingScratch(ScratchLevel):
    """Rank 1's shard write of version JOB_FAIL_AT fails half-way (ENOSPC after some bytes)."""

    def write_shard(self, name, version, rank, plan, arrays, **kw):
        if rank == 1 and str(version) == os.environ.get("JOB_FAIL_AT"):
            with replacing_path(self.shard_path(name, version, rank), "scratch.shard.rename") as tmp:
                with open(tmp, "wb") as f:
                    f.write(b"half a shard")
                raise CheckpointWriteError(errno.ENOSPC, "No space left on device (injected)")
        return super().write_shard(name, version, rank, plan, arrays, **kw)


def state(run: str, version: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([int(run, 16) % (1 << 63), version])
    return {"dense/kernel": rng.standard_normal((64, 48)).astype(np.float32),
            "dense/bias": rng.standard_normal(48),
            "counter": np.array(version, dtype=np.int64)}


def pieces(plan: ShardPlan, rank: int, arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
    flat = [arrays[t.name].reshape(-1) for t in plan.tensors]
    return [flat[p.tensor_id][p.start:p.stop] for p in plan.for_rank(rank)]


def record(d: str, run: str, version: int, arrays: dict[str, np.ndarray]) -> None:
    os.makedirs(f"{d}/rec", exist_ok=True)
    tmp = f"{d}/rec/.{run}-{version}.npz"
    np.savez(tmp, **{k.replace("/", "|"): v for k, v in arrays.items()})
    os.replace(tmp, f"{d}/rec/{run}-{version}.npz")


def load_records(d: str) -> dict[tuple[str, int], dict[str, np.ndarray]]:
    """Every recorded state: (run id, version) -> tensors by name (empty before the first)."""
    out = {}
    if not os.path.isdir(os.path.join(d, "rec")):
        return out
    for n in os.listdir(os.path.join(d, "rec")):
        if n.endswith(".npz") and not n.startswith("."):
            run, v = n[:-4].rsplit("-", 1)
            with np.load(os.path.join(d, "rec", n)) as z:
                out[(run, int(v))] = {k.replace("|", "/"): z[k] for k in z.files}
    return out


def log_line(d: str, text: str) -> None:
    fd = os.open(f"{d}/committed.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, (text + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> None:
    d, phase = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    cfg = config(d)
    run = Run(cfg, NAME, 0, 1, resume=phase == "recover", overwrite=phase == "overwrite")
    info = run.begin()
    start = 0
    if phase == "recover":
        try:
            ck = load(cfg, NAME)
        except CheckpointNotFoundError:
            ck = None
        if ck is not None:
            start = ck.version
            info = run.resumed(start)
            ScratchLevel(cfg.scratch).clear(NAME, 1, above=start)  # the second rank's part of resumed()
    plan = ShardPlan.build(TENSORS, 2, min_shard_bytes=64)
    if phase == "overwrite":
        ScratchLevel(cfg.scratch).clear(NAME, 1)  # the second rank's part of begin() with overwrite
    engines = [Engine(cfg, NAME, r, plan, run=info, scratch_cls=FailingScratch) for r in (0, 1)]
    for v in range(start + 1, start + 1 + n):
        arrays = state(info.id, v)
        record(d, info.id, v, arrays)
        try:
            for r, e in enumerate(engines):
                e.checkpoint(v, pieces(plan, r, arrays), step=v, epoch=0)
        except CheckpointWriteError as err:
            print(f"v{v} not checkpointed: {err}")
            continue
        if cfg.mode == "sync":
            log_line(d, f"{info.id} {v}")
        time.sleep(float(os.environ.get("JOB_SLEEP", "0")))
    for e in engines:
        e.close()
    if cfg.mode == "async":  # committed once close() waited for the flushes
        for v in range(start + 1, start + 1 + n):
            log_line(d, f"{info.id} {v}")
    for e in engines:
        e.close()
    run.close()
    print(f"run {info.id} wrote v{start + 1}..v{start + n}")


if __name__ == "__main__":
    main()
