"""Communicators: what the engine, restore and the run need from the ranks of a job (layer L0).

:class:`Comm` is the protocol (``rank``, ``size``, ``allgather``, ``allgather_buffers``,
``exchange``; every call collective); :class:`LocalComm` is one process, :class:`MPIComm` a private
duplicate of an mpi4py communicator, safe from a background thread. The torch adapter's gloo
communicator (:class:`deepfreeze.torch.TorchComm`) implements the same protocol. Every call is
counted (:mod:`deepfreeze.counters`: ``comm.*``).

:class:`MPIComm` (``comm=None``: ``MPI.COMM_WORLD``) duplicates the mpi4py communicator, so
DeepFreeze's messages never mix with Horovod's or the application's, and requires
``MPI_THREAD_MULTIPLE`` (Horovod and mpi4py request it): the redundancy exchange runs in the
writer thread while the training thread runs the framework's collectives. ``allgather_buffers``
gathers with one ``Allgatherv`` into one receive buffer and returns views into it (one
broadcast per participant, in pieces of 1 GiB, beyond MPI's ``int`` counts); ``allgather`` is the
same for ``bytes``; ``exchange`` posts ``Isend``/``Irecv`` in pieces of 1 GiB and waits for all.
A lock serializes the calls of one process. The Keras adapter makes its ``MPIComm`` through
``deepfreeze.keras._dist.mpi_comm()`` (Horovod over MPI with more than one rank, a duplicate of
the communicator given to ``hvd.init``; over Gloo it logs that protection and pooled restore are
off).
"""
from __future__ import annotations

import threading
from typing import Any, Protocol

import numpy as np

from . import counters
from . import format as fmt

__all__ = ["Comm", "LocalComm", "MPIComm", "count_exchange"]

_MSG = 1 << 30  # point-to-point messages are cut at 1 GiB (MPI counts are int)


class Comm(Protocol):
    """What the engine and restore need from a communicator (all calls collective)."""

    rank: int
    size: int

    def allgather(self, data: bytes) -> list[bytes]:
        """Every participant's ``data``, in rank order."""

    def allgather_buffers(self, data: np.ndarray) -> list[np.ndarray]:
        """Like :meth:`allgather` for large uint8 buffers: views into one receive buffer, no copies."""

    def exchange(self, sends: dict[int, Any], recv_sizes: dict[int, int]) -> dict[int, np.ndarray]:
        """Send ``sends[dest]`` (bytes-like) to each dest and receive ``recv_sizes[src]`` bytes from
        each src, all at once; returns uint8 arrays by source."""


class LocalComm:
    """A communicator of one process."""

    rank, size = 0, 1

    def allgather(self, data: bytes) -> list[bytes]:
        return [bytes(data)]

    def allgather_buffers(self, data: np.ndarray) -> list[np.ndarray]:
        return [data]

    def exchange(self, sends: dict[int, Any], recv_sizes: dict[int, int]) -> dict[int, np.ndarray]:
        if set(sends) - {0} or set(recv_sizes) - {0}:
            raise ValueError("a one-process communicator can only exchange with itself")
        return {0: np.frombuffer(fmt.byte_view(sends[0]), dtype=np.uint8).copy()} if 0 in recv_sizes else {}


def count_exchange(sends: dict[int, Any], got: dict[int, Any]) -> None:
    """Count one :meth:`Comm.exchange` (:mod:`deepfreeze.counters`): its messages and bytes each way."""
    if counters.ENABLED:
        counters.add("comm.exchange")
        counters.add("comm.send", len(sends))
        counters.add("comm.send.bytes", sum(len(fmt.byte_view(d)) for d in sends.values()))
        counters.add("comm.recv", len(got))
        counters.add("comm.recv.bytes", sum(len(b) for b in got.values()))


class MPIComm:
    """A private duplicate of ``comm`` (an mpi4py communicator; default ``MPI.COMM_WORLD``),
    safe to use from the writer thread (Horovod and mpi4py initialize MPI with
    ``MPI_THREAD_MULTIPLE``). Create it on every rank of ``comm`` (collective). Under Horovod,
    :func:`deepfreeze.keras._dist.mpi_comm` passes the communicator Horovod was given."""

    def __init__(self, comm: Any = None) -> None:
        from mpi4py import MPI  # imported here: single-process use needs no MPI
        self._MPI = MPI
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError("MPI was initialized without MPI_THREAD_MULTIPLE; DeepFreeze's background "
                               "redundancy exchange needs it (Horovod and mpi4py request it by default)")
        self.comm = (comm or MPI.COMM_WORLD).Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self._lock = threading.Lock()

    def allgather(self, data: bytes) -> list[bytes]:
        return [b.tobytes() for b in self.allgather_buffers(np.frombuffer(data, dtype=np.uint8))]

    def allgather_buffers(self, data: np.ndarray) -> list[np.ndarray]:
        counters.add("comm.allgather")
        counters.add("comm.allgather.bytes", len(data))
        with self._lock:
            counts = np.zeros(self.size, dtype=np.int64)
            self.comm.Allgather(np.array([len(data)], dtype=np.int64), counts)
            sizes = [int(n) for n in counts]
            recv = np.empty(sum(sizes), dtype=np.uint8)
            offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
            send = data if len(data) else np.empty(0, np.uint8)
            if max(sizes) < (1 << 31) and sum(sizes) < (1 << 31):
                self.comm.Allgatherv(send, [recv, (sizes, offsets.tolist()), self._MPI.BYTE])
            else:  # beyond MPI's int counts: one broadcast per participant, in 1 GiB pieces
                for r, n in enumerate(sizes):
                    for o in range(0, n, _MSG):
                        buf = recv[offsets[r] + o:offsets[r] + min(n, o + _MSG)]
                        if r == self.rank:
                            buf[:] = send[o:o + len(buf)]
                        self.comm.Bcast(buf, root=r)
            return [recv[offsets[r]:offsets[r] + sizes[r]] for r in range(self.size)]

    def exchange(self, sends: dict[int, Any], recv_sizes: dict[int, int]) -> dict[int, np.ndarray]:
        with self._lock:
            out = {src: np.empty(n, dtype=np.uint8) for src, n in recv_sizes.items()}
            reqs = []
            for src, buf in out.items():
                for i, o in enumerate(range(0, len(buf), _MSG)):
                    reqs.append(self.comm.Irecv(buf[o:o + _MSG], source=src, tag=100 + i))
            for dest, data in sends.items():
                view = np.frombuffer(fmt.byte_view(data), dtype=np.uint8)
                for i, o in enumerate(range(0, len(view), _MSG)):
                    reqs.append(self.comm.Isend(view[o:o + _MSG], dest=dest, tag=100 + i))
            self._MPI.Request.Waitall(reqs)
            count_exchange(sends, out)
            return out

    def close(self) -> None:
        try:
            self.comm.Free()
        except Exception:  # MPI already finalized at interpreter exit
            pass
