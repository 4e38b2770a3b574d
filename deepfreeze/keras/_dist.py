"""Rank, world size, one small all-gather (Horovod, else one rank), the ranks' shared vote (any_rank) and the MPI communicator for DeepFreeze's own exchanges."""
from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from ..errors import ConfigError, StreamTimeoutError


def _hvd():
    try:
        import horovod.tensorflow as hvd
    except ImportError:
        return None
    try:
        return hvd if hvd.is_initialized() else None
    except (AttributeError, ValueError):
        return None


def rank_and_size() -> tuple[int, int]:
    hvd = _hvd()
    return (hvd.rank(), hvd.size()) if hvd is not None else (0, 1)


def allgather_bytes(data: bytes, width: int = 256) -> list[bytes]:
    """Every rank's ``data`` (at most ``width`` bytes), in rank order. No pickling."""
    if len(data) > width:
        raise ValueError(f"{len(data)} bytes do not fit the {width}-byte all-gather slot")
    hvd = _hvd()
    if hvd is None:
        return [data]
    import tensorflow as tf
    row = np.zeros((1, width + 2), dtype=np.uint8)
    row[0, :2] = divmod(len(data), 256)
    row[0, 2:2 + len(data)] = np.frombuffer(data, dtype=np.uint8)
    rows = hvd.allgather(tf.constant(row), name="deepfreeze_allgather").numpy()
    return [bytes(r[2:2 + int(r[0]) * 256 + int(r[1])]) for r in rows]


def broadcast_int(value: int) -> int:
    """Rank 0's ``value`` on every rank (an int64 broadcast; identity without Horovod)."""
    hvd = _hvd()
    if hvd is None:
        return value
    import tensorflow as tf
    return int(hvd.broadcast(tf.constant(value, dtype=tf.int64), 0, name="deepfreeze_broadcast").numpy())


def broadcast_bytes(data: bytes) -> bytes:
    """Rank 0's ``data`` on every rank (its length, then the bytes; no pickling)."""
    hvd = _hvd()
    if hvd is None:
        return data
    import tensorflow as tf
    n = broadcast_int(len(data))
    buf = np.zeros(max(n, 1), dtype=np.uint8)
    if hvd.rank() == 0:
        buf[:n] = np.frombuffer(data, dtype=np.uint8)
    out = hvd.broadcast(tf.constant(buf), 0, name="deepfreeze_broadcast_bytes").numpy()
    return out[:n].tobytes()


def allreduce_mean(values: np.ndarray) -> np.ndarray:
    """The element-wise mean over the ranks of a float64 vector of the same length everywhere."""
    hvd = _hvd()
    values = np.asarray(values, dtype=np.float64)
    if hvd is None or hvd.size() < 2:
        return values
    import tensorflow as tf
    return hvd.allreduce(tf.constant(values), op=hvd.Average, name="deepfreeze_allreduce_mean").numpy()


def any_rank(flag: bool, *, timeout: float = 300.0, what: str = "a vote") -> bool:
    """True on every rank when ``flag`` is True on any rank (collective: every rank calls it at the
    same point, from its training thread). An MPI all-reduce over a private duplicate of Horovod's
    communicator (microseconds: the ranks are in step), else (Horovod over Gloo) Horovod's
    all-reduce (milliseconds). The MPI wait is bounded: a non-blocking all-reduce, progressed by
    polling it (Open MPI here has no progress thread), a warning every 60 s, and
    :class:`~deepfreeze.errors.StreamTimeoutError` after ``timeout`` seconds (a rank died or left
    ``fit``: this process must then exit; with ``DEEPFREEZE_ON_PEER_LOSS=exit`` it does so itself,
    :mod:`deepfreeze.peerloss`)."""
    global _VOTE
    hvd = _hvd()
    if hvd is None or hvd.size() < 2:
        return bool(flag)
    comm = mpi_comm()
    if comm is None:
        return float(allreduce_mean(np.array([1.0 if flag else 0.0]))[0]) > 0.0
    if _VOTE is None or _VOTE[0] is not comm:
        _VOTE = (comm, comm.comm.Dup())  # its own communicator: never interleaved with the writer thread's
    from mpi4py import MPI
    out = np.zeros(1, dtype=np.int32)
    req = _VOTE[1].Iallreduce(np.array([1 if flag else 0], dtype=np.int32), out, op=MPI.MAX)
    spins, t0 = 0, time.monotonic()
    next_log = t0 + 60.0
    while not req.Test():
        spins += 1
        if spins < 2000:  # the ranks are in step: done within microseconds
            continue
        now = time.monotonic()
        if now - t0 >= timeout:
            e = StreamTimeoutError(
                f"rank {hvd.rank()}: the other ranks did not take part in {what} within {timeout:.0f} s (a rank "
                "died or left fit); this process must exit (Open MPI cannot recover the job)")
            from .. import peerloss
            peerloss.peer_lost(e, f"rank {hvd.rank()}: {what}")  # DEEPFREEZE_ON_PEER_LOSS=exit: ends here
            raise e
        if now >= next_log:
            next_log += 60.0
            logging.getLogger("deepfreeze").warning(
                "DeepFreeze (rank %d): has waited %.0f s for the other ranks to take part in %s", hvd.rank(),
                now - t0, what)
        time.sleep(0.0002)
    return bool(out[0])


_VOTE = None  # (the MPIComm it was made from, a duplicate of its communicator for any_rank)
_COMM = None  # (the communicator Horovod runs over, its duplicate: an MPIComm)
_GLOO_WARNED = False


def _horovod_mpi_comm(hvd: Any) -> Any:
    """The mpi4py communicator Horovod runs over: the one given to ``hvd.init(comm=...)``,
    else ``MPI.COMM_WORLD`` (each only if its rank and size are Horovod's: the one Horovod
    keeps may be freed, or stale after a re-initialization). Raises
    :class:`~deepfreeze.errors.ConfigError` when neither is (Horovod initialized with a list
    of ranks that is not all of COMM_WORLD)."""
    from mpi4py import MPI
    try:
        from horovod.common.process_sets import global_process_set
        given = global_process_set.mpi_comm
    except (ImportError, AttributeError):
        given = None
    rank, size = hvd.rank(), hvd.size()
    if given is not None:
        try:
            ok = given != MPI.COMM_NULL and (given.Get_rank(), given.Get_size()) == (rank, size)
        except MPI.Exception:  # freed since hvd.init
            ok = False
        if ok:
            return given
    world = MPI.COMM_WORLD
    if (world.Get_rank(), world.Get_size()) == (rank, size):
        return world
    raise ConfigError(
        f"DeepFreeze cannot tell which MPI communicator Horovod runs over: Horovod has {size} ranks "
        f"(this is rank {rank}) but MPI_COMM_WORLD has {world.Get_size()} (rank {world.Get_rank()}), and "
        "Horovod holds no mpi4py communicator of its ranks (hvd.init(comm=[ranks]) keeps none). DeepFreeze's "
        "own exchanges (redundancy, collective restore, the run's start) must run over the same ranks as "
        "Horovod: pass an mpi4py communicator instead, e.g. hvd.init(comm=deepfreeze.clone.split(...).comm) "
        "or hvd.init(comm=MPI.COMM_WORLD.Split(color, key))")


def mpi_comm() -> Any:
    """A :class:`deepfreeze.comm.MPIComm` over Horovod's MPI world: a duplicate of the
    communicator given to ``hvd.init(comm=...)`` (``MPI.COMM_WORLD`` when none was), never
    of COMM_WORLD when Horovod runs over fewer ranks. Created once per Horovod
    communicator, collectively; None when Horovod is not running over MPI with several ranks.

    Raises :class:`~deepfreeze.errors.ConfigError` when Horovod was initialized with a list
    of ranks (``hvd.init(comm=[...])``) smaller than the MPI world: give it an mpi4py
    communicator instead."""
    global _COMM, _GLOO_WARNED
    hvd = _hvd()
    if hvd is None or hvd.size() < 2:
        return None
    if not hvd.mpi_enabled():
        import logging
        if hvd.rank() == 0 and not _GLOO_WARNED:  # one line for the job, not one per rank or call
            _GLOO_WARNED = True
            logging.getLogger("deepfreeze").warning(
                "DeepFreeze: Horovod runs without MPI (Gloo): partner/parity protection and pooled "
                "scratch restore need MPI and are off")
        return None
    base = _horovod_mpi_comm(hvd)
    if _COMM is None or _COMM[0] is not base:  # first use, or Horovod re-initialized over another one
        from ..comm import MPIComm
        _COMM = (base, MPIComm(base))
    return _COMM[1]


class _HorovodComm:
    """The small all-gather a :class:`deepfreeze.run.Run` needs, over Horovod (any controller)."""

    def __init__(self) -> None:
        self.rank, self.size = rank_and_size()

    def allgather(self, data: bytes) -> list[bytes]:
        return allgather_bytes(data, width=4096)


def run_comm():
    """The communicator a run starts over: MPI when Horovod runs over it, else Horovod's
    all-gather (Gloo), else one process."""
    comm = mpi_comm()
    if comm is not None:
        return comm
    hvd = _hvd()
    if hvd is None or hvd.size() < 2:
        from ..comm import LocalComm
        return LocalComm()
    return _HorovodComm()
