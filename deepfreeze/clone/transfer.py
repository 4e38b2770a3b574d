"""Moving a model's state from a source group to clone groups over MPI (mpi4py, numpy).

Protocol, on ``Group.bridge`` (a duplicate of the parent communicator, never Horovod's):

1. **Hello** (``TAG_HELLO``): every source rank sends every clone rank, and every clone
   rank sends every source rank, a JSON description of its :class:`ClonePlan` (tensor
   names, dtypes, shapes, group sizes, threshold) and its digest, before any data
   moves. Each side compares what it received with its own plan; a difference is a
   :class:`~deepfreeze.errors.ModelMismatchError` naming the first differing tensor, on
   both sides, without waiting for the other.
2. **Data** (tag ``DATA_TAG0 + tensor id``): one message per route (tensor, source range,
   clone range), in pieces of at most 1 GiB (MPI counts are ints; the pieces of one
   route keep their order: MPI does not overtake messages of one source, tag and
   communicator). The receiver posts every receive up front, into its final place in
   the flat tensor buffers, so arrival order does not matter.
3. **Header** (``TAG_HEADER``): source rank 0 sends every clone rank the step, epoch and
   run identity after it posted its own data. A clone rank is done when every data
   message and the header arrived.
4. **Abort** (``TAG_ABORT``): a source rank that will not send (its ``fit`` ended or
   failed before the clone step) tells every clone rank why; they raise
   :class:`~deepfreeze.errors.CloneError` at once instead of waiting out the timeout.
   A clone rank that gives up (its timeout, a malformed message, a failed group) tells
   every source rank the same way; the source raises ``CloneError`` at its next check
   (the next batch, or its wait for the sends).
5. **Source agreement** (``TAG_DONE``): once its sends completed, every source rank tells every
   other source rank (``1``; ``0`` from :meth:`Sender.close` of a rank that failed first) and
   waits, bounded by ``timeout``, for each one's word. Silence names the source ranks that died
   or are stuck (:class:`~deepfreeze.errors.CloneTimeoutError`): without it a surviving source
   rank would only find out in the framework's next collective, which never ends.
6. **Agreement** (clone group only, on its own duplicate of ``Group.comm``, made with a
   nonblocking ``Idup`` when the receive starts): after receiving, every clone rank
   all-gathers whether it received everything (a nonblocking ``Iallgather``, polled),
   before any all-gather of data: one rank that failed or died never leaves the others
   blocked in a collective. Both waits are bounded by ``timeout``.

Open MPI here has no asynchronous progress thread: a nonblocking send progresses only
inside an MPI call of its process. The sender's named thread ``deepfreeze-clone-progress``
tests the posted requests every ``poll`` seconds while any is pending, so transfers
overlap the rest of the step (on one node the receiver pulls large messages itself,
single-copy, through the shared-memory transport). Every wait is bounded
(``timeout``) and names the ranks still awaited: Open MPI 4.1 here has no fault-tolerant
MPI, so a dead peer is seen only as a wait that does not end; the process that raised
must exit (docs/clone.md, "Failures"). With ``DEEPFREEZE_ON_PEER_LOSS=exit``
(:mod:`deepfreeze.peerloss`) a rank that sees a peer lost ends its process itself, with exit
code 75: a :class:`~deepfreeze.errors.CloneTimeoutError` of a source rank's hello wait, send wait
or source agreement, and a clone rank's agreement that ends with a timeout (its own, or another
rank's silence) or names clone ranks that failed.
"""
from __future__ import annotations

import atexit
import json
import logging
import threading
import time
from typing import Any, Callable

import numpy as np

from .. import peerloss
from ..errors import CloneError, CloneTimeoutError, ModelMismatchError
from ..jsonsafe import loads as bounded_loads
from .group import Group
from .plan import ClonePlan, Route, first_difference

__all__ = ["Sender", "Receiver", "TAG_HELLO", "TAG_HEADER", "TAG_ABORT", "TAG_DONE", "DATA_TAG0", "DEFAULT_TIMEOUT"]

log = logging.getLogger("deepfreeze")

TAG_HELLO, TAG_HEADER, TAG_ABORT, TAG_DONE = 1, 2, 3, 4
DATA_TAG0 = 16
CHUNK = 1 << 30  # bytes per message piece (MPI counts are C ints)
MAX_CONTROL_BYTES = 64 << 20  # a hello with a very large tensor list is still far below this
DEFAULT_TIMEOUT = 600.0
# Receivers sleep between tests (no spinning: on a node shared with the source, a spinning
# clone takes the source's cores); large messages are pulled inside one test (single copy)
STANDBY_POLL, ACTIVE_POLL = 0.005, 0.0005
FUSE_BYTES = 4 << 20  # tensors up to this size are all-gathered together (packed), see Receiver.reconstruct


def _chunks(start: int, stop: int) -> list[tuple[int, int]]:
    return [(o, min(stop, o + CHUNK)) for o in range(start, stop, CHUNK)] or [(start, start)]


def _recv_control(comm: Any, source: int, tag: int, status: Any) -> dict:
    """Receive one JSON control message already probed (``status``): size checked first."""
    from mpi4py import MPI
    n = status.Get_count(MPI.BYTE)
    if not 0 <= n <= MAX_CONTROL_BYTES:
        comm.Recv([np.empty(0, np.uint8), MPI.BYTE], source=source, tag=tag)  # discard (truncates)
        raise CloneError(f"clone control message of {n} bytes from rank {source} (tag {tag}) exceeds "
                         f"{MAX_CONTROL_BYTES}: not a DeepFreeze peer, or a damaged message")
    buf = np.empty(n, np.uint8)
    comm.Recv([buf, MPI.BYTE], source=source, tag=tag)
    try:
        obj = bounded_loads(buf.tobytes(), "clone control message", max_bytes=MAX_CONTROL_BYTES)
    except (UnicodeDecodeError, ValueError) as e:
        raise CloneError(f"malformed clone control message from rank {source} (tag {tag}): {e}") from e
    if not isinstance(obj, dict):
        raise CloneError(f"malformed clone control message from rank {source} (tag {tag}): not an object")
    return obj


def _flat(buffers: dict[int, np.ndarray], spec: Any) -> np.ndarray:
    """``buffers[spec.id]``, checked to be a flat C-contiguous array of the tensor's size."""
    buf = buffers[spec.id]
    if buf.size != spec.size or not buf.flags.c_contiguous:
        raise ValueError(f"buffer of tensor {spec.id} is not a flat C-contiguous array of its size")
    return buf


def _encode(obj: dict) -> np.ndarray:
    return np.frombuffer(json.dumps(obj, sort_keys=True).encode("utf-8"), np.uint8)


class _Hello:
    """One side's hello: sent to ``peers`` (parent ranks), compared with theirs."""

    def __init__(self, comm: Any, side: str, plans: dict[int, ClonePlan], peers: dict[int, int]) -> None:
        """``plans``: peer group index -> the plan with it; ``peers``: parent rank -> its group index."""
        self.comm, self.side, self.plans, self.peers = comm, side, plans, peers
        self.pending = set(peers)
        self.reqs: list[Any] = []
        self._msgs = []

    def post(self, me: dict) -> None:
        for rank, g in self.peers.items():
            msg = _encode(dict(me, digest=self.plans[g].digest(), plan=self.plans[g].describe()))
            self._msgs.append(msg)
            self.reqs.append(self.comm.Isend(msg, dest=rank, tag=TAG_HELLO))

    def poll(self) -> bool:
        """Take every hello that arrived; True once all did. Raises ModelMismatchError."""
        from mpi4py import MPI
        for rank in sorted(self.pending):
            st = MPI.Status()
            if not self.comm.Iprobe(source=rank, tag=TAG_HELLO, status=st):
                continue
            obj = _recv_control(self.comm, rank, TAG_HELLO, st)
            self.pending.discard(rank)
            plan = self.plans[self.peers[rank]]
            if obj.get("digest") != plan.digest():
                theirs = obj.get("plan") if isinstance(obj.get("plan"), dict) else {}
                other = "source" if self.side == "clone" else "clone"
                raise ModelMismatchError(
                    f"clone transfer refused before any data moved: the {other} rank {rank} "
                    f"(group {obj.get('group')}, rank {obj.get('rank')}) has another model or plan: "
                    f"{first_difference(plan.describe(), theirs)}. Build the same model (same layers, "
                    "shapes, dtypes, optimizer) in both groups, with the same clone threshold")
        if not self.pending:
            MPI.Request.Waitall(self.reqs)  # small eager sends: complete
            self.reqs, self._msgs = [], []
        return not self.pending

    def wait(self, timeout: float, what: str, abort: "Callable[[], None] | None" = None) -> None:
        deadline = time.monotonic() + timeout
        while not self.poll():
            if abort is not None:
                abort()
            if time.monotonic() > deadline:
                raise CloneTimeoutError(
                    f"{what}: no answer within clone_timeout={timeout:g} s from parent rank(s) "
                    f"{sorted(self.pending)}: they did not start (check the group sizes given to split and "
                    "that every group reaches its clone call), or raise clone_timeout")
            time.sleep(0.002)


class Sender:
    """A source rank's side. ``plans``: clone group index -> :class:`ClonePlan` with it.

    :meth:`post` is called from TensorFlow's threads (inside the train step) with a view
    of the bytes to send; the view is kept until :meth:`wait` saw its sends complete."""

    def __init__(self, group: Group, plans: dict[int, ClonePlan], *, timeout: float = DEFAULT_TIMEOUT,
                 poll: float = 0.0005) -> None:
        if not group.is_source:
            raise ValueError("Sender runs on the source group (group index 0)")
        peerloss.policy()  # a bad DEEPFREEZE_ON_PEER_LOSS: an error now, not at a peer's loss
        self.group, self.plans, self.timeout, self.poll_s = group, dict(plans), float(timeout), poll
        self.comm = group.bridge
        self._sends = {g: p.sends_of(group.rank) for g, p in self.plans.items()}
        peers = {w: g for g in self.plans for w in group.members(g)}
        self._hello = _Hello(self.comm, "source", self.plans, peers)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._reqs: list[Any] = []
        self._keep: list[Any] = []
        self._error: BaseException | None = None
        self._stop = False
        self.posted: list[tuple[int, float, int]] = []  # (tensor id, time, bytes)
        self.bytes_sent = 0
        self._closed = False
        me = group.members(0)[group.rank]
        self._source_peers = {w: j for j, w in enumerate(group.members(0)) if w != me}  # parent rank -> source rank
        self._done: tuple[Any, list, dict] | None = None  # this rank's word, its sends, the peers' receives
        self._thread = threading.Thread(target=self._progress, name="deepfreeze-clone-progress", daemon=True)
        self._thread.start()
        atexit.register(self._at_exit)  # runs before mpi4py finalizes MPI (registered earlier)

    def _at_exit(self) -> None:
        """The process exits (an error in fit, a script's end) with the clone not done: tell
        the clones, so they fail now instead of at their timeout."""
        if not self._closed:
            self.abort(f"source rank {self.group.rank} exited before the clone was sent (an error in its fit, "
                       "or its script ended)")
            self.close()

    # -- hello ------------------------------------------------------------------------
    def hello(self, info: dict | None = None) -> None:
        """Send this rank's plan to every clone rank (nonblocking)."""
        self._hello.post(dict(info or {}, side="source", group=0, rank=self.group.rank))

    def poll_hello(self) -> bool:
        """Take the hellos that arrived (True once all did). Raises ModelMismatchError, or
        CloneError when a clone rank gave up."""
        self.check_abort()
        return self._hello.poll()

    def wait_hello(self, timeout: float | None = None) -> None:
        try:
            self._hello.wait(self.timeout if timeout is None else timeout,
                             f"source rank {self.group.rank} waiting for the clone groups' hello", abort=self.check_abort)
        except CloneTimeoutError as e:
            peerloss.peer_lost(e, f"clone: source rank {self.group.rank}")
            raise

    def check_abort(self) -> None:
        """Raise :class:`CloneError` if a clone rank said it gave up the clone."""
        from mpi4py import MPI
        st = MPI.Status()
        if self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_ABORT, status=st):
            w = st.Get_source()
            obj = _recv_control(self.comm, w, TAG_ABORT, st)
            raise CloneError(f"clone group {obj.get('group')} rank {obj.get('rank')} (parent rank {w}) gave up the "
                             f"clone: {obj.get('reason', '(no reason given)')}")

    # -- data -------------------------------------------------------------------------
    def routes(self, tensor_id: int) -> list[tuple[int, Route]]:
        """(clone group, route) pairs this rank sends for ``tensor_id``."""
        return [(g, r) for g, sends in self._sends.items() for r in sends.get(tensor_id, [])]

    def source_range(self, tensor_id: int) -> tuple[int, int]:
        """The element range of ``tensor_id`` this rank sends from ((0, 0): none)."""
        rs = [r for _, r in self.routes(tensor_id)]
        return (min(r.start for r in rs), max(r.stop for r in rs)) if rs else (0, 0)

    def post(self, tensor_id: int, flat: np.ndarray, base: int = 0) -> int:
        """Post the sends of ``tensor_id``; ``flat`` holds its elements ``[base, base + len)``
        (C-contiguous). Returns the bytes posted. ``flat`` is referenced until :meth:`wait`."""
        routes = self.routes(tensor_id)
        if not routes:
            return 0
        raw = flat.reshape(-1).view(np.uint8)
        item = flat.dtype.itemsize
        n = 0
        with self._lock:
            for g, r in routes:
                dest = self.group.members(g)[r.dst]
                lo, hi = (r.start - base) * item, (r.stop - base) * item
                if lo < 0 or hi > raw.size:
                    raise CloneError(f"tensor {tensor_id}: route [{r.start}, {r.stop}) is outside the "
                                     f"{flat.size} elements handed over from element {base}")
                for a, b in _chunks(lo, hi):
                    self._reqs.append(self.comm.Isend(raw[a:b], dest=dest, tag=DATA_TAG0 + tensor_id))
                n += hi - lo
            self._keep.append(flat)
            self.posted.append((tensor_id, time.time(), n))
            self.bytes_sent += n
            self._wake.notify()
        return n

    def post_control(self, tag: int, obj: dict) -> list:
        """Send a small JSON message (header, abort) to every rank of the clone groups; returns
        its requests (also waited for by :meth:`wait`)."""
        msg = _encode(obj)
        reqs = []
        with self._lock:
            for g in self.plans:
                for w in self.group.members(g):
                    reqs.append(self.comm.Isend(msg, dest=w, tag=tag))
            self._reqs.extend(reqs)
            self._keep.append(msg)
            self._wake.notify()
        return reqs

    def abort(self, reason: str) -> None:
        """Tell every clone rank the transfer will not happen. Waits (at most 10 s) for these
        small notices only, not for data sends a clone may never take."""
        from mpi4py import MPI
        reqs = self.post_control(TAG_ABORT, {"reason": reason, "rank": self.group.rank})
        deadline = time.monotonic() + min(self.timeout, 10.0)
        while True:
            with self._lock:
                if MPI.Request.Testall(reqs):
                    return
            if time.monotonic() > deadline:
                log.warning("DeepFreeze: clone abort notice not delivered within 10 s")
                return
            time.sleep(self.poll_s)

    def wait(self, timeout: float | None = None) -> None:
        """Until every posted send completed (then the views are released). Raises
        :class:`CloneTimeoutError` after ``timeout`` (default: the sender's)."""
        from mpi4py import MPI
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            with self._lock:
                if self._error is not None:
                    e, self._error = self._error, None
                    raise CloneError(f"clone progress thread failed: {e}") from e
                sent = not self._reqs or MPI.Request.Testall(self._reqs)
                if sent:
                    self._reqs, self._keep = [], []
            if sent:
                self._agree_sources(limit)
                return
            self.check_abort()
            if time.monotonic() > deadline:
                dests = sorted({w for g in self.plans for w in self.group.members(g)})
                e = CloneTimeoutError(
                    f"source rank {self.group.rank}: clone sends not received within clone_timeout="
                    f"{limit:g} s by the clone ranks (parent ranks "
                    f"{dests}): they stopped receiving or died")
                peerloss.peer_lost(e, f"clone: source rank {self.group.rank}")
                raise e
            time.sleep(self.poll_s)

    def _post_done(self, ok: bool) -> None:
        """Tell every other source rank whether this one finished its sends (once); a rank that
        finished also posts the receives of their words (a failed one takes none)."""
        if self._done is not None:
            return
        word = np.array([1 if ok else 0], np.uint8)
        with self._lock:
            sends = [self.comm.Isend(word, dest=w, tag=TAG_DONE) for w in self._source_peers]
            recvs = {w: (buf, self.comm.Irecv(buf, source=w, tag=TAG_DONE))
                     for w, buf in ((w, np.zeros(1, np.uint8)) for w in self._source_peers if ok)}
        self._done = (word, sends, recvs)

    def _agree_sources(self, limit: float) -> None:
        """The source agreement (module docstring, step 5): after this rank's sends completed,
        every other source rank's word within ``limit`` seconds, else
        :class:`CloneTimeoutError` naming the silent ones (they died, or are stuck)."""
        from mpi4py import MPI
        if self._done is not None or not self._source_peers:
            return
        self._post_done(True)
        _, sends, recvs = self._done
        deadline = time.monotonic() + limit
        while True:
            with self._lock:
                pending = [w for w, (_, rq) in recvs.items() if not rq.Test()]
                delivered = MPI.Request.Testall(sends)
            if not pending and delivered:
                return
            if time.monotonic() > deadline:
                silent = sorted(self._source_peers[w] for w in pending)
                with self._lock:
                    for w in pending:
                        recvs[w][1].Cancel()
                e = CloneTimeoutError(
                    f"source rank {self.group.rank}: source rank(s) {silent or '(none: its word was not taken)'} "
                    f"did not finish the clone within clone_timeout={limit:g} s after this rank's sends completed "
                    "(they died, or are stuck): the framework's next collective over the source group would "
                    "wait for them forever")
                peerloss.peer_lost(e, f"clone: source rank {self.group.rank}")
                raise e
            time.sleep(self.poll_s)

    def _progress(self) -> None:
        from mpi4py import MPI
        try:
            while True:
                with self._wake:
                    while not self._stop and not self._reqs:
                        self._wake.wait()
                    if self._stop:
                        return
                    if MPI.Request.Testall(self._reqs):
                        self._reqs, self._keep = [], []
                time.sleep(self.poll_s)
        except BaseException as e:  # surfaces once, in wait()
            with self._lock:
                self._error = e

    def close(self) -> None:
        """Stop the progress thread (the clone is sent, or abandoned). A rank that did not reach
        the source agreement tells the other source ranks that it failed (at most 1 s), so they
        do not take it for dead."""
        from mpi4py import MPI
        if self._done is None and self._source_peers:
            self._post_done(False)
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                with self._lock:
                    if MPI.Request.Testall(self._done[1]):
                        break
                time.sleep(0.002)
        self._closed = True
        atexit.unregister(self._at_exit)
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=5)


class Receiver:
    """A clone rank's side: hello, then every message of its routes into flat buffers, then
    the all-gather-v over the clone group."""

    def __init__(self, group: Group, plan: ClonePlan, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        if group.is_source:
            raise ValueError("Receiver runs on a clone group (group index >= 1)")
        peerloss.policy()  # a bad DEEPFREEZE_ON_PEER_LOSS: an error now, not at a peer's loss
        self.group, self.plan, self.timeout = group, plan, float(timeout)
        self.comm = group.bridge
        self.source = group.members(0)
        self._hello = _Hello(self.comm, "clone", {0: plan}, {w: 0 for w in self.source})
        self.routes = plan.recvs_of(group.rank)
        self.bytes_received = 0
        self.first_data_at: float | None = None
        self.done_at: float | None = None
        self.gather_s: dict = {}  # seconds of reconstruct's fused and per-tensor parts
        self._fused: tuple | None = None  # made by prepare(), used once by reconstruct()
        self.gcomm: Any = None  # the clone group's own communicator (open_group)
        self._gcomm_req: Any = None
        self._notices: list = []  # give_up's messages and requests (kept until sent)

    def open_group(self, comm: Any = None) -> None:
        """Start making the clone group's own communicator (a nonblocking duplicate of
        ``Group.comm``, or ``comm`` as given): call it first, on every clone rank; :meth:`agree`
        waits for it, bounded (a blocking duplicate would hang on a rank that failed early)."""
        if comm is not None:
            self.gcomm, self._gcomm_req = comm, None
        else:
            self.gcomm, self._gcomm_req = self.group.comm.Idup()

    def give_up(self, reason: str) -> None:
        """Tell every source rank this clone rank will not take the clone (best effort: small
        notices, at most 1 s), so the source fails at once instead of at its timeout."""
        from mpi4py import MPI
        msg = _encode({"reason": reason, "group": self.group.index, "rank": self.group.rank})
        reqs = [self.comm.Isend(msg, dest=w, tag=TAG_ABORT) for w in self.source]
        self._notices.append((msg, reqs))
        deadline = time.monotonic() + 1.0
        while not MPI.Request.Testall(reqs) and time.monotonic() < deadline:
            time.sleep(0.002)

    def _wait_request(self, req: Any, deadline: float) -> bool:
        while not req.Test():
            if time.monotonic() > deadline:
                return False
            time.sleep(STANDBY_POLL)
        return True

    def agree(self, error: BaseException | None) -> Any:
        """After :meth:`receive` (``error``: what it, or the hello, raised; None: all arrived):
        every clone rank learns every other's outcome before any collective moves data.
        Returns the group's communicator (:meth:`open_group`) when every rank has everything.
        Raises ``error`` itself (after telling the source, :meth:`give_up`), :class:`CloneError`
        naming the clone ranks that failed, or :class:`CloneTimeoutError` when one never
        answered within ``2 * timeout`` (it died or is stuck; the others may still be receiving,
        each bounded by ``timeout``). A rank that failed waits too (bounded), so that its
        answer reaches the others. With ``DEEPFREEZE_ON_PEER_LOSS=exit`` every one of these
        except an error of the source's own making (an abort, a mismatch) ends the process
        (:func:`deepfreeze.peerloss.peer_lost`) once the others were told."""
        try:
            return self._agree(error)
        except CloneError as e:
            if isinstance(e, CloneTimeoutError) or getattr(e, "_peer_failed", False):
                peerloss.peer_lost(e, f"clone: clone group {self.group.index} rank {self.group.rank}")
            raise

    def _agree(self, error: BaseException | None) -> Any:
        if self.gcomm is None:
            self.open_group()
        if error is not None:
            self.give_up(f"{type(error).__name__}: {error}")
        # the others may still be receiving (each bounded by timeout, after a hello bounded the same way)
        deadline = time.monotonic() + 2 * self.timeout
        me = f"clone group {self.group.index} rank {self.group.rank}"
        if self._gcomm_req is not None:
            if not self._wait_request(self._gcomm_req, deadline):
                if error is not None:
                    raise error
                self.give_up("the clone group did not form")
                raise CloneTimeoutError(
                    f"{me}: the other ranks of this clone group did not all start the receive within 2 x "
                    f"clone_timeout = {2 * self.timeout:g} s (one died, or never started it)")
            self._gcomm_req = None
        mine = np.array([0 if error is not None else 1], np.int32)
        every = np.zeros(self.group.size, np.int32)
        if not self._wait_request(self.gcomm.Iallgather(mine, every), deadline):
            if error is not None:
                raise error
            self.give_up("a rank of the clone group did not answer")
            raise CloneTimeoutError(
                f"{me}: received everything, but not every rank of this clone group said whether it did within "
                f"2 x clone_timeout = {2 * self.timeout:g} s (one died, or is stuck): the model holds a partial clone")
        if error is not None:
            raise error
        bad = [j for j in range(self.group.size) if not every[j]]
        if bad:
            self.give_up(f"clone rank(s) {bad} of its group failed")
            e = CloneError(f"{me}: clone rank(s) {bad} of this clone group did not receive the clone (see their "
                           "error); the model holds a partial clone")
            e._peer_failed = True  # a peer of this group failed: its next collective would wait for it
            raise e
        return self.gcomm

    def hello(self, info: dict | None = None) -> None:
        """Exchange plans with every source rank (raises ModelMismatchError, CloneTimeoutError)."""
        self._hello.post(dict(info or {}, side="clone", group=self.group.index, rank=self.group.rank))
        self._hello.wait(self.timeout, f"clone group {self.group.index} rank {self.group.rank} waiting for the "
                                       "source group's hello", abort=self._check_abort)

    def _check_abort(self) -> None:
        from mpi4py import MPI
        st = MPI.Status()
        for w in self.source:
            if self.comm.Iprobe(source=w, tag=TAG_ABORT, status=st):
                obj = _recv_control(self.comm, w, TAG_ABORT, st)
                raise CloneError(f"the source group gave up the clone: {obj.get('reason', '(no reason given)')} "
                                 f"(source rank {obj.get('rank')})")

    def allocate(self) -> dict[int, np.ndarray]:
        """A flat buffer per tensor (every element this rank will hold after reconstruction),
        pre-faulted (one write per page) while the clone waits, so the transfer does not
        fault pages in (a cold destination is several times slower to fill)."""
        from ..format import numpy_dtype
        out = {t.id: np.empty(t.size, numpy_dtype(t.dtype)) for t in self.plan.tensors}
        for buf in out.values():
            buf.view(np.uint8)[::4096] = 0
        return out

    def receive(self, buffers: dict[int, np.ndarray]) -> dict:
        """Receive every route of this rank into ``buffers`` (tensor id -> flat array) and the
        header; returns the header. Waits without spinning (sleeps between tests)."""
        from mpi4py import MPI
        reqs, srcs = [], []
        for r in self.routes:
            buf = _flat(buffers, self.plan.tensors[r.tensor_id])
            raw, item = buf.view(np.uint8), buf.dtype.itemsize
            for a, b in _chunks(r.start * item, r.stop * item):
                reqs.append(self.comm.Irecv(raw[a:b], source=self.source[r.src], tag=DATA_TAG0 + r.tensor_id))
                srcs.append(self.source[r.src])
            self.bytes_received += (r.stop - r.start) * item
        header: dict | None = None
        st = MPI.Status()
        deadline = time.monotonic() + self.timeout
        left = len(reqs)
        sleep = STANDBY_POLL  # standby: a test every 5 ms; once data flows, every 0.5 ms
        while left or header is None:
            if left:
                done = MPI.Request.Testsome(reqs)  # completed requests become REQUEST_NULL
                if done:
                    left -= len(done)
                    if self.first_data_at is None:
                        self.first_data_at, sleep = time.time(), ACTIVE_POLL
            if header is None and self.comm.Iprobe(source=self.source[0], tag=TAG_HEADER, status=st):
                header = _recv_control(self.comm, self.source[0], TAG_HEADER, st)
                sleep = ACTIVE_POLL
            self._check_abort()
            if not left and header is not None:
                break
            if time.monotonic() > deadline:
                missing = {w for w, rq in zip(srcs, reqs) if rq != MPI.REQUEST_NULL}
                if header is None:
                    missing.add(self.source[0])
                for rq in reqs:
                    if rq != MPI.REQUEST_NULL:
                        rq.Cancel()
                raise CloneTimeoutError(
                    f"clone group {self.group.index} rank {self.group.rank}: the clone did not arrive within "
                    f"clone_timeout={self.timeout:g} s (still waiting for source parent rank(s) {sorted(missing)}): "
                    "the source never reached its clone step, or died; raise clone_timeout if it is just far away")
            time.sleep(sleep)
        self.done_at = time.time()
        return header

    def prepare(self, buffers: dict[int, np.ndarray], rank: int) -> None:
        """Set up :meth:`reconstruct` while the clone waits (standby): which tensors are
        fused, and the packed buffer for them, allocated and pre-faulted now (a cold buffer
        of that size costs more to fault in than the collective takes). ``rank``: this rank
        in the clone group's communicator."""
        m = self.plan.n_clone
        small, large = [], []
        for t in self.plan.tensors:
            buf = _flat(buffers, t)
            if buf.nbytes:
                (small if buf.nbytes <= FUSE_BYTES else large).append(t.id)
        counts = [sum((self.plan.partition[i][j][1] - self.plan.partition[i][j][0]) * buffers[i].dtype.itemsize
                      for i in small) for j in range(m)]
        packed = np.empty(sum(counts) if m > 1 else 0, np.uint8)
        packed[::4096] = 0
        self._fused = (rank, small, large, counts, [sum(counts[:j]) for j in range(m)], packed)

    def reconstruct(self, buffers: dict[int, np.ndarray], comm: Any) -> None:
        """Every clone rank ends with every whole tensor, over the clone group's communicator
        ``comm``: the paper's ordered sequence of in-place all-gathers (plan order: the model's
        weights in forward order, then the optimizer's variables), with the small ones fused.

        * Tensors of at most ``FUSE_BYTES``: one all-gather-v of a packed buffer (each rank
          packs the ranges it holds, in plan order, into its segment; everyone unpacks the
          others'). The buffer is made by :meth:`prepare` during standby.
        * Larger tensors: one in-place all-gather-v each, on the flat buffer (contiguous, so
          the shared-memory transport moves each range with one single-copy pull).

        On a node shared with the source, each collective costs about a scheduling round
        trip: one per tensor (535 for ResNet-50 with its optimizer slots) took over a second;
        a derived datatype over the scattered ranges (no packing) was slower still, as the
        transport then pipelines small fragments. Every rank runs the same sequence."""
        from mpi4py import MPI
        if comm.Get_size() != self.plan.n_clone:
            raise CloneError(f"the clone group's communicator has {comm.Get_size()} ranks, the plan {self.plan.n_clone}")
        if self.plan.n_clone == 1:
            return
        if self._fused is None or self._fused[0] != comm.Get_rank():
            self.prepare(buffers, comm.Get_rank())
        me, small, large, counts, displs, packed = self._fused
        t0 = time.perf_counter()
        if sum(counts):
            pos = displs[me]
            for i in small:
                a, b = self.plan.partition[i][me]
                if a < b:
                    src = buffers[i][a:b].view(np.uint8)
                    packed[pos:pos + src.size] = src
                    pos += src.size
            _allgatherv(comm, MPI.IN_PLACE, packed, counts, displs)
            for j in range(self.plan.n_clone):
                if j == me:
                    continue
                pos = displs[j]
                for i in small:
                    a, b = self.plan.partition[i][j]
                    if a < b:
                        dst = buffers[i][a:b].view(np.uint8)
                        dst[:] = packed[pos:pos + dst.size]
                        pos += dst.size
        t1 = time.perf_counter()
        for i in large:  # in place
            buf = buffers[i]
            item = buf.dtype.itemsize
            parts = self.plan.partition[i]
            _allgatherv(comm, MPI.IN_PLACE, buf.view(np.uint8), [(b - a) * item for a, b in parts],
                        [a * item for a, _ in parts])
        self.gather_s = {"fused": t1 - t0, "fused_tensors": len(small), "large": time.perf_counter() - t1,
                         "large_tensors": len(large)}
        self._fused = None


def _allgatherv(comm: Any, send: Any, recv: np.ndarray, counts: list[int], displs: list[int]) -> None:
    """All-gather-v of bytes; beyond MPI's int counts, each owner broadcasts its range in pieces."""
    from mpi4py import MPI
    if max(counts) < (1 << 31) and recv.size < (1 << 31):
        comm.Allgatherv(send, [recv, (counts, displs), MPI.BYTE])
        return
    me = comm.Get_rank()
    if send is not MPI.IN_PLACE:
        recv[displs[me]:displs[me] + counts[me]] = send
    for j, (c, d) in enumerate(zip(counts, displs)):
        for a, b in _chunks(d, d + c) if c else []:
            comm.Bcast([recv[a:b], MPI.BYTE], root=j)
