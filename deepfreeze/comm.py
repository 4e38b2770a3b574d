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

A rank's failure travels to the other ranks as an *error record* (:func:`error_record`,
:func:`error_from_record`, :func:`allgather_failures`), the same over gloo and MPI: UTF-8 JSON
``{"type": NAME, "message": TEXT, "fields": {...}}`` (plus ``"sent_as"``, the sender's own class,
when it is not registered), at most :data:`MAX_RECORD_BYTES` bytes, never a pickle. ``NAME`` is a
class of the registry (:func:`deepfreeze.errors.error_classes`); the receiver rebuilds that class
with the same message, so it decides on ``isinstance`` and fields, never on the text.
"""
from __future__ import annotations

import json
import math
import threading
from typing import Any, Protocol

import numpy as np

from . import counters
from . import format as fmt
from .errors import DeepFreezeError, ErrorRecordError, error_class
from .jsonsafe import loads as bounded_loads

__all__ = ["Comm", "LocalComm", "MPIComm", "count_exchange", "MAX_RECORD_BYTES", "error_record",
           "error_from_record", "allgather_failures"]

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


#: the largest error record sent or accepted (a message of MAX_MESSAGE characters always fits, escaped)
MAX_RECORD_BYTES = 16384
#: characters of an error's message a record carries (the rest is cut, "..." appended)
MAX_MESSAGE = 2000
_MAX_FIELD_TEXT = 200  # characters of a text field; the class names of "type" and "sent_as" too
_RECORD_ADVICE = "the rank that sent it runs another version of DeepFreeze, or it is not DeepFreeze's: refused"


_ERRNO = {"errno": (int, type(None))}  # carried for every OSError subclass


def _fields_of(cls: type) -> "dict[str, tuple[type, ...]]":
    return {**getattr(cls, "record_fields", {}), **(_ERRNO if issubclass(cls, OSError) else {})}


def _field_ok(v: Any, types: "tuple[type, ...]") -> bool:
    """``v`` is of one of ``types`` exactly (a bool is no int), a finite number or a short text."""
    if type(v) not in types:
        return False
    if type(v) is int:
        return -(1 << 63) <= v < 1 << 64
    if type(v) is float:
        return math.isfinite(v)
    return type(v) is not str or len(v) <= _MAX_FIELD_TEXT


def error_record(exc: BaseException) -> bytes:
    """``exc`` as an error record (module docstring), at most :data:`MAX_RECORD_BYTES` bytes: the
    nearest registered class of its type (:class:`~deepfreeze.errors.DeepFreezeError` for any other
    exception), ``str(exc)`` (cut at :data:`MAX_MESSAGE` characters) and the values of that class's
    ``record_fields`` that are JSON scalars (text of at most 200 characters; others are left out)."""
    cls = next((c for c in type(exc).__mro__ if isinstance(c, type) and error_class(c.__name__) is c),
               DeepFreezeError)
    try:
        message = str(exc)
    except Exception:  # an exception whose __str__ fails: its class name, rather than no record
        message = type(exc).__name__
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE - 3] + "..."
    fields = {k: getattr(exc, k, None) for k in _fields_of(cls)}
    rec: dict[str, Any] = {"type": cls.__name__, "message": message,
                           "fields": {k: v for k, v in fields.items() if _field_ok(v, _fields_of(cls)[k])}}
    if type(exc) is not cls:
        rec["sent_as"] = f"{type(exc).__module__}.{type(exc).__qualname__}"[-_MAX_FIELD_TEXT:]
    # ensure_ascii: any text (lone surrogates of undecodable file names too) is valid UTF-8 JSON
    raw = json.dumps(rec, ensure_ascii=True, allow_nan=False).encode()
    while len(raw) > MAX_RECORD_BYTES:  # a message of escapes (6 bytes a character) with long fields: cut both
        rec["fields"], rec["message"] = {}, rec["message"][:len(rec["message"]) // 2] + "..."
        raw = json.dumps(rec, ensure_ascii=True, allow_nan=False).encode()
    return raw


def error_from_record(raw: "bytes | bytearray | memoryview") -> DeepFreezeError:
    """The error an :func:`error_record` describes: its registered class, built with its message,
    the class's ``record_fields`` set from its fields (other field names are ignored: a newer
    sender may send more), ``sender_type`` set to the sender's class name. A type not in the
    registry (another version's class) gives a plain :class:`~deepfreeze.errors.DeepFreezeError`
    with the same message, ``sender_type`` naming it.

    Anything else (larger than :data:`MAX_RECORD_BYTES`, not UTF-8 JSON, nested deeper than the
    record's two levels, missing or mistyped keys, a field that is not a JSON scalar) raises
    :class:`~deepfreeze.errors.ErrorRecordError`, never another exception."""
    what = "an error record from another rank"
    rec = bounded_loads(raw, what, max_bytes=MAX_RECORD_BYTES, max_depth=2, kind=dict, error=ErrorRecordError,
                        advice=_RECORD_ADVICE)
    name, message, fields, sent_as = rec.get("type"), rec.get("message"), rec.get("fields", {}), rec.get("sent_as")

    def bad(why: str) -> ErrorRecordError:
        return ErrorRecordError(f"{what}: {why}; {_RECORD_ADVICE}")
    if not isinstance(name, str) or not 0 < len(name) <= _MAX_FIELD_TEXT:
        raise bad("its 'type' is not a class name")
    if not isinstance(message, str):
        raise bad(f"the message of a {name:.100} is not text")
    if sent_as is not None and (not isinstance(sent_as, str) or len(sent_as) > _MAX_FIELD_TEXT):
        raise bad(f"the 'sent_as' of a {name:.100} is not a class name")
    cls = error_class(name) or DeepFreezeError
    types = _fields_of(cls)
    if not isinstance(fields, dict):
        raise bad(f"the fields of a {name:.100} are not a JSON object")
    wrong = next((k for k, v in fields.items() if k in types and not _field_ok(v, types[k])), None)
    if wrong is not None:
        raise bad(f"field {wrong!r} of a {name} is not of a type it may have "
                  f"({' or '.join(t.__name__ for t in types[wrong])}; text of at most {_MAX_FIELD_TEXT} characters)")
    try:
        err = cls(message)
        for k in types:
            if k in fields:
                setattr(err, k, fields[k])
    except Exception as e:  # a registered class that cannot be built from its message (a bug: tested for each)
        raise bad(f"a {name} cannot be built from it ({type(e).__name__}: {e})") from e
    err.sender_type = sent_as or name
    return err


def allgather_failures(comm: Comm, error: "BaseException | None") -> dict[int, DeepFreezeError]:
    """Collective (one :meth:`Comm.allgather`): every rank's failure of a step that all of them take
    part in, ``error`` being this rank's (None: it succeeded, and sends no bytes). Returns the
    errors of the ranks that failed, in rank order, each rebuilt from its :func:`error_record`
    (this rank's own too): the same classes, messages and fields on every rank, so that every
    rank takes the same decision on them. A record that cannot be read counts as that rank's
    failure (an :class:`~deepfreeze.errors.ErrorRecordError` naming the rank). Wrap the result in
    a :class:`~deepfreeze.errors.RanksFailedError` (``RanksFailedError.of``) to raise or chain it."""
    rows = comm.allgather(error_record(error) if error is not None else b"")
    out: dict[int, DeepFreezeError] = {}
    for rank, raw in enumerate(rows):
        if len(raw):
            try:
                out[rank] = error_from_record(raw)
            except ErrorRecordError as e:
                bad = ErrorRecordError(f"rank {rank} failed, but {e}")
                bad.__cause__ = e
                out[rank] = bad
    return out

