"""The clone ranks' relay: every clone rank forwards each route it receives from the source
ranks to every other clone rank as soon as it has landed, over authenticated TCP, so each clone
rank ends with every tensor without a second pass after the transfer (issue 44, item 2).

numpy and :mod:`deepfreeze.net` only; the receiving side is
:class:`deepfreeze.clone.wire.CloneListener` (which runs a :class:`Forwarder` per other clone
rank and serves the other clone ranks' connections beside the source ranks').

Why a relay. The sources keep the paper's disjoint sends: source rank ``r`` sends its 1/N of
every replicated tensor, each byte to exactly one clone rank (the plan's routes), so the
training ranks' outbound traffic does not grow with the number of clone ranks ``M``. Every
clone rank then needs the routes the others received. Each route lands straight in the clone
rank's final tensor (the adapter's target buffers), and the same bytes, read from there, go to
each other clone rank, which receives them straight into *its* final tensor: every byte lands
once per clone rank. The forwarding overlaps the receive (a route is forwarded while the next
ones are still arriving). Every clone rank sends to each other one directly (one hop, ``M (M -
1)`` connections): each sends and receives ``(M - 1) / M`` of the state, as a ring would, with no
relaying through a third rank, so a dead rank stops only what it owed.

Protocol, on the clone ranks' listening sockets (:func:`deepfreeze.net.client_handshake`
channels, token proven both ways, every frame sealed):

1. **Peer hello.** Once clone rank ``j`` accepted the source's plan it connects to every other
   clone rank ``k`` and sends ``{"df": "clone-peer", "rank": j, "digest": <plan digest>}``
   (:func:`check_peer_hello`). ``k`` answers ``{"ok": true}`` once its own plan (from its first
   source hello, waited for within the deadline) has that digest, else the error.
2. **Forwards.** ``{"df": "clone-fwd", "routes": [[tensor id, start, stop], ...]}`` (at most
   :data:`MAX_FWD_ROUTES` routes), whose payload is the routes' bytes back to back in that
   order. Each route must be one the plan sends to ``j`` (``dst == j``) and not received from
   ``j`` before; the payload must be exactly their bytes (:func:`check_forward`, before a byte
   of it is read). ``k`` receives each route straight into its buffer of that tensor.
3. **End.** ``{"df": "clone-done"}`` once every route of ``j`` was forwarded; refused unless
   every one arrived. ``{"df": "clone-abort", "reason": ...}`` instead: ``j``'s receive failed
   (the reason names the rank that did; ``k``'s receive fails with it, so the cause is named,
   not ``j``); ``j`` then shuts its connections (within 1 s). A rank that dies is a closed
   connection.

Every wait is bounded by the receive's deadline: a clone rank that stops is a
:class:`~deepfreeze.errors.CloneTimeoutError`, one that dies (its connection closes) a
:class:`~deepfreeze.errors.CloneError`, each naming the clone rank, the transport error chained.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Mapping

import numpy as np

from .. import net
from ..errors import AuthenticationError, CloneError, CloneTimeoutError, DeepFreezeError, ModelMismatchError, \
    ProviderTimeoutError
from ..format import dtype_itemsize
from .plan import ClonePlan, Route

__all__ = ["MAX_FWD_ROUTES", "MAX_FWD_HEADER", "check_peer_hello", "check_forward", "Forwarder"]

#: the most routes one forward frame carries
MAX_FWD_ROUTES = 1024
#: the bound of a forward frame's JSON header (MAX_FWD_ROUTES routes of three 63-bit integers)
MAX_FWD_HEADER = 64 + MAX_FWD_ROUTES * 64
_MAX_FWD_BYTES = 64 << 20  # a forward frame gathers queued routes up to about this many bytes
_STOP = None  # the queue's sentinel: stop forwarding


def _int(v: Any, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def check_peer_hello(h: Mapping[str, Any], n_clone: int) -> tuple[int, str]:
    """``(clone rank, plan digest)`` of another clone rank's hello (:class:`CloneError` for
    anything else, or a rank outside ``0 .. n_clone - 1``)."""
    if not isinstance(h, Mapping) or h.get("df") != "clone-peer":
        raise CloneError("not a clone peer hello (expected {'df': 'clone-peer', ...})")
    j, digest = h.get("rank"), h.get("digest")
    if not _int(j, 0, n_clone - 1) or not isinstance(digest, str) or len(digest) != 64:
        shown = j if type(j) is int else type(j).__name__
        raise CloneError(f"malformed clone peer hello: rank {shown} of {n_clone} clone ranks, and a digest of 64 hex")
    return j, digest


def check_forward(h: Mapping[str, Any], plan: ClonePlan, expected: dict, payload: int) -> list[Route]:
    """The routes a forward frame carries, in order, checked against ``expected`` (``(tensor id,
    start, stop)`` -> :class:`Route` still awaited from that clone rank) before a byte of its
    ``payload`` is read: known, distinct, and ``payload`` exactly their bytes. :class:`CloneError`
    for anything else."""
    if not isinstance(h, Mapping):
        raise CloneError("malformed clone forward frame: the header is not an object")
    rs = h.get("routes")
    if not isinstance(rs, list) or not 1 <= len(rs) <= MAX_FWD_ROUTES:
        raise CloneError(f"malformed clone forward frame: expected 1 to {MAX_FWD_ROUTES} routes")
    out, seen, total = [], set(), 0
    for x in rs:
        if not (isinstance(x, list) and len(x) == 3 and all(_int(v, 0, 1 << 62) for v in x)):
            raise CloneError("malformed clone forward frame: a route is not [tensor id, start, stop]")
        key = (x[0], x[1], x[2])
        route = expected.get(key)
        if route is None or key in seen:
            raise CloneError(f"a clone forward frame carries tensor #{x[0]} elements [{x[1]}, {x[2]}), which is not a "
                             "route still awaited from that clone rank (a duplicate, or another plan)")
        seen.add(key)
        out.append(route)
        total += (route.stop - route.start) * dtype_itemsize(plan.tensors[route.tensor_id].dtype)
    if payload != total:
        raise CloneError(f"a clone forward frame of {len(out)} route(s) carries {payload} bytes, the plan {total}")
    return out


class Forwarder:
    """Clone rank ``rank``'s forwards to the other clone rank ``peer`` (at ``address``): every
    route of the plan whose ``dst`` is ``rank``, read from ``buffers`` (tensor id -> the
    tensor's flat bytes) once :meth:`put` says it has landed. :meth:`run` (a thread of the
    listener) connects, says hello, sends what is queued in frames as it comes, then the end;
    it returns ``peer`` or raises a :class:`CloneError`/:class:`CloneTimeoutError` naming it.
    Subclass and override :meth:`send_batch` to inject faults (tests)."""

    def __init__(self, rank: int, peer: int, address: str, token: str, plan: ClonePlan,
                 buffers: Mapping[int, np.ndarray], *, timeout: float) -> None:
        self.rank, self.peer, self.address, self.token = rank, peer, address, token
        self.plan, self.buffers, self.timeout = plan, buffers, float(timeout)
        self.total = sum(1 for r in plan.routes if r.dst == rank)  # the routes this rank forwards
        self.forwarded = 0  #: routes sent so far
        self.bytes_sent = 0
        self.ended = False  #: every route forwarded and the end sent
        self.running = False  #: :meth:`run` started
        self.finished = threading.Event()  #: :meth:`run` returned or raised
        self._reason = ""
        self._q: "queue.Queue[Route | None]" = queue.Queue()
        self._ch: net.Channel | None = None

    def put(self, route: Route) -> None:
        """``route`` (``dst == rank``) has landed in ``buffers``: forward it."""
        self._q.put(route)

    def stop(self, reason: str) -> None:
        """Give up (this rank's receive failed): :meth:`run` sends the peer ``{"df":
        "clone-abort", "reason": reason}`` before its next frame and ends (the peer's receive
        fails naming the cause, not this rank); :meth:`kill` ends it at once."""
        self._reason = reason
        self._q.put(_STOP)

    def kill(self) -> None:
        """End :meth:`run` at once: the connection shut."""
        self._q.put(_STOP)
        ch = self._ch
        if ch is not None:
            try:
                ch.shutdown()
            except OSError:
                pass

    def send_batch(self, ch: net.Channel, routes: list[Route], views: list[np.ndarray], deadline: float) -> None:
        """One forward frame: ``routes`` and their bytes (``views``, into ``buffers``) back to back."""
        ch.send({"df": "clone-fwd", "routes": [[r.tensor_id, r.start, r.stop] for r in routes]}, views,
                deadline=deadline)

    def _view(self, r: Route) -> np.ndarray:
        item = dtype_itemsize(self.plan.tensors[r.tensor_id].dtype)
        return self.buffers[r.tensor_id][r.start * item:r.stop * item]

    def run(self, deadline: float) -> int:
        self.running = True
        try:
            return self._run(deadline)
        finally:
            self.finished.set()

    def _run(self, deadline: float) -> int:
        what = f"clone rank {self.rank}: forwarding to clone rank {self.peer} ({self.address})"
        try:
            sock = net.connect(self.address, max(0.001, deadline - time.monotonic()))
            try:
                ch, _ = net.client_handshake(sock, self.token, {"df": "clone-peer", "rank": self.rank,
                                                                "digest": self.plan.digest()}, deadline=deadline)
            except BaseException:
                sock.close()
                raise
            self._ch = ch
            while self.forwarded < self.total:
                try:
                    first = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise CloneTimeoutError(f"{what}: {self.total - self.forwarded} of {self.total} route(s) never "
                                            "arrived from the source to be forwarded within the timeout") from None
                batch, size = [first], 0
                while first is not _STOP and len(batch) < MAX_FWD_ROUTES and size < _MAX_FWD_BYTES:
                    try:
                        batch.append(self._q.get_nowait())
                    except queue.Empty:
                        break
                    size += 0 if batch[-1] is _STOP else self._view(batch[-1]).nbytes
                if any(r is _STOP for r in batch):
                    if self._reason:  # the peer learns why (bounded: 1 s)
                        ch.send({"df": "clone-abort", "reason": self._reason[:2000]},
                                deadline=min(deadline, time.monotonic() + 1.0))
                    raise CloneError(f"{what}: stopped (this clone rank's receive failed)")
                routes = [r for r in batch if r is not None]
                views = [self._view(r) for r in routes]
                self.send_batch(ch, routes, views, deadline)
                self.forwarded += len(routes)
                self.bytes_sent += sum(v.nbytes for v in views)
            ch.send({"df": "clone-done"}, deadline=deadline)
            self.ended = True
            return self.peer
        except ProviderTimeoutError as e:
            raise CloneTimeoutError(f"{what} did not complete within timeout={self.timeout:g} s (it stopped taking "
                                    f"data): {e}") from e
        except (CloneError, CloneTimeoutError, ModelMismatchError, AuthenticationError):
            raise
        except DeepFreezeError as e:
            err = CloneError(f"{what} failed after {self.forwarded} of {self.total} route(s) (clone rank {self.peer} "
                             f"died, or refused): {e}")
            err.peer_lost = True  # (the receive prefers a peer's own reason when one comes: CloneListener)
            raise err from e

    def close(self) -> None:
        ch, self._ch = self._ch, None
        if ch is not None:
            try:
                ch.shutdown()
            except OSError:
                pass
            ch.close()
