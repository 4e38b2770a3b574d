"""DeepFreeze's communicator over ``torch.distributed`` and the launcher's node layout.

:class:`TorchComm` implements what the core asks of a communicator
(:class:`deepfreeze.comm.Comm`: ``rank``, ``size``, ``allgather``,
``allgather_buffers``, ``exchange``) on a *dedicated* process group created with
``dist.new_group(backend="gloo")`` when it is built (collectively, on every rank): the
training group is never used (NCCL cannot carry host bytes, and DeepFreeze's collectives must
not interleave with the training's). A checkpointer builds two: one for the training thread
(the run's start, plan agreement, resume) and one for the engine's writer thread (partner
copies and parity), so collectives issued by two threads of a rank never share a group.

Wire format (no pickling): gloo all-gathers tensors of equal size, so an all-gather first
gathers every rank's byte length (one int64 each), then every rank's bytes padded with zeros
to the longest; each row is cut back to its length. Point-to-point exchanges send raw
``uint8`` tensors of the sizes both sides computed from the same plan, in pieces of at most
1 GiB (tags 100, 101, ...). A rank's failure crosses this all-gather as an error record
(:func:`deepfreeze.comm.allgather_failures`: JSON naming a registered error class, as over MPI).

Nodes and failure domains come from the launcher (``torchrun``): ``GROUP_RANK`` is the node's
index, ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` the process's place on it; a ``failure_domain`` set
in the INI file or in code wins.
"""
from __future__ import annotations

import os
import socket
import threading
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import counters, peerloss
from .. import format as fmt
from ..errors import ConfigError, PeerLostError
from ..comm import count_exchange

__all__ = ["TorchComm", "rank_and_size", "node_domain", "make_comm"]

_MSG = 1 << 30


def rank_and_size(user: "str | None" = None) -> tuple[int, int]:
    """This process's rank and the world size of the default group (0, 1 without one). With
    ``user`` (what is asking, e.g. ``"deepfreeze.torch.Checkpointer"``), a process of a launcher's
    job of several ranks (``WORLD_SIZE`` > 1, as torchrun sets it) whose default group is not
    initialized yet is a :class:`~deepfreeze.errors.ConfigError`: every rank would act as rank 0
    of a one-process job."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    ws = os.environ.get("WORLD_SIZE", "")
    if user is not None and ws.isdigit() and int(ws) > 1:
        raise ConfigError(f"{user} in rank {os.environ.get('RANK', '?')} of a job of WORLD_SIZE={ws} came "
                          "before torch.distributed.init_process_group: without the process group every rank would "
                          "act alone as rank 0 of a one-process job (one checkpoint written by several processes). "
                          "Call torch.distributed.init_process_group(...) on every rank first (and wrap the model "
                          "in DDP or fully_shard), then call it")
    return 0, 1


def node_domain(configured: "str | None" = None, explicit: bool = False) -> str:
    """The failure domain of this process: the configured one when it was set explicitly, else
    the launcher's node (``node<GROUP_RANK>`` under torchrun, qualified by the host name),
    else the host name."""
    if explicit and configured:
        return configured
    host = socket.gethostname()
    group = os.environ.get("GROUP_RANK")
    if group is not None and group.isdigit():
        return f"{host}-node{int(group)}"
    return configured or host


def _as_u8(data: Any) -> torch.Tensor:
    view = np.frombuffer(fmt.byte_view(data), dtype=np.uint8)
    if not view.flags.writeable:  # bytes: torch wants a writable buffer
        view = view.copy()
    return torch.from_numpy(view)


#: seconds one collective of DeepFreeze's group may wait for a peer (a hung peer; a dead one closes
#: its connections and is reported at once)
DEFAULT_TIMEOUT = 600.0


class TorchComm:
    """A communicator over a dedicated gloo group of every rank of the default group. Build it
    on every rank (collective). Calls are collective and serialized per instance; use one
    instance per thread that issues collectives. A peer that dies (its connection closes) or does
    not answer within ``timeout`` seconds is a :class:`~deepfreeze.errors.PeerLostError`."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("TorchComm needs torch.distributed initialized (dist.init_process_group)")
        import datetime
        self.timeout = float(timeout)
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout))
        self.rank, self.size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self._lock = threading.Lock()

    def _lost(self, what: str, e: BaseException) -> PeerLostError:
        err = PeerLostError(f"rank {self.rank}: DeepFreeze's {what} over its gloo group of {self.size} ranks failed: "
                            f"{type(e).__name__}: {str(e)[:500]} (a rank died, or did not answer within "
                            f"{self.timeout:g} s)")
        peerloss.peer_lost(err, f"the torch adapter's {what}")  # DEEPFREEZE_ON_PEER_LOSS=exit ends the process
        return err

    def allgather(self, data: bytes) -> list[bytes]:
        return [b.tobytes() for b in self.allgather_buffers(np.frombuffer(bytes(data), dtype=np.uint8))]

    def allgather_buffers(self, data: np.ndarray) -> list[np.ndarray]:
        """Every rank's bytes: lengths first, then the bytes padded to the longest (views into one
        receive buffer)."""
        data = np.frombuffer(fmt.byte_view(data), dtype=np.uint8)
        try:
            return self._allgather_buffers(data)
        except RuntimeError as e:
            raise self._lost("all-gather", e) from e

    def _allgather_buffers(self, data: np.ndarray) -> list[np.ndarray]:
        counters.add("comm.allgather")  # deepfreeze.counters: 2 collectives (lengths, bytes)
        counters.add("comm.allgather.bytes", int(data.size))
        with self._lock:
            n = torch.tensor([data.size], dtype=torch.int64)
            lens = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
            dist.all_gather(lens, n, group=self.group)
            sizes = [int(t.item()) for t in lens]
            width = max(sizes + [1])
            recv = np.zeros(self.size * width, dtype=np.uint8)
            rows = [torch.from_numpy(recv[r * width:(r + 1) * width]) for r in range(self.size)]
            send = np.zeros(width, dtype=np.uint8)
            send[:data.size] = data
            dist.all_gather(rows, torch.from_numpy(send), group=self.group)
            return [recv[r * width:r * width + sizes[r]] for r in range(self.size)]

    def exchange(self, sends: dict[int, Any], recv_sizes: dict[int, int]) -> dict[int, np.ndarray]:
        """Send ``sends[dest]`` to each dest and receive ``recv_sizes[src]`` bytes from each src."""
        try:
            return self._exchange(sends, recv_sizes)
        except RuntimeError as e:
            raise self._lost("exchange", e) from e

    def _exchange(self, sends: dict[int, Any], recv_sizes: dict[int, int]) -> dict[int, np.ndarray]:
        with self._lock:
            out = {src: np.empty(n, dtype=np.uint8) for src, n in recv_sizes.items()}
            ranks = dist.get_process_group_ranks(self.group)
            works = []
            for src, buf in out.items():
                for i, o in enumerate(range(0, len(buf), _MSG)):
                    works.append(dist.irecv(torch.from_numpy(buf[o:o + _MSG]), src=ranks[src], group=self.group,
                                            tag=100 + i))
            for dest, data in sends.items():
                t = _as_u8(data)
                for i, o in enumerate(range(0, t.numel(), _MSG)):
                    works.append(dist.isend(t[o:o + _MSG], dst=ranks[dest], group=self.group, tag=100 + i))
            for w in works:
                w.wait()
            count_exchange(sends, out)
            return out

    def broadcast_bytes(self, data: bytes, root: int = 0) -> bytes:
        """``root``'s bytes on every rank (the run id, a resume decision)."""
        return self.allgather(data if self.rank == root else b"")[root]

    def barrier(self) -> None:
        self.allgather(b"")

    def close(self) -> None:
        try:
            dist.destroy_process_group(self.group)
        except Exception:  # the default group is gone already (interpreter exit)
            pass


def make_comm() -> Any:
    """A :class:`TorchComm` when torch.distributed runs with several ranks, else a one-process
    :class:`~deepfreeze.comm.LocalComm`."""
    rank, size = rank_and_size()
    if size > 1:
        return TorchComm()
    from ..comm import LocalComm
    return LocalComm()
