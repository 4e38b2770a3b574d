"""Rank, world size, one small all-gather (Horovod, else one rank) and the MPI communicator for DeepFreeze's own exchanges."""
from __future__ import annotations

import numpy as np


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


_COMM = None
_GLOO_WARNED = False


def mpi_comm():
    """A :class:`deepfreeze.redundancy.MPIComm` over Horovod's MPI world (created once per
    process, collectively), or None when Horovod is not running over MPI with several ranks."""
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
    if _COMM is None:
        from ..redundancy import MPIComm
        _COMM = MPIComm()
    return _COMM


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
        from ..redundancy import LocalComm
        return LocalComm()
    return _HorovodComm()
