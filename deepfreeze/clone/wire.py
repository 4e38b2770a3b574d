"""The clone wire: a running job's ranks send a clone of their state to the ranks of another,
independently launched job over authenticated TCP (:mod:`deepfreeze.net`); nothing touches
storage. numpy and :mod:`deepfreeze.net` only (no framework): the PyTorch adapter
(:mod:`deepfreeze.torch.clone`) drives it.

The MPI transport (:mod:`deepfreeze.clone.transfer`) moves a clone between groups of one MPI
job; this one connects two jobs that share nothing but a token and an address. Its protocol
mirrors that one (hello with the plan digest, data per route, header, abort, agreement, bounded
waits naming the ranks awaited); every connection is a :func:`deepfreeze.net.client_handshake`
/ :class:`deepfreeze.net.Acceptor` channel (token proven both ways, every frame sealed).

1. **Request.** Every clone rank ``j`` listens (:class:`CloneListener`, loopback unless
   ``allow_remote``). Clone rank 0 connects to the source's address (source rank 0 listens,
   :class:`RequestServer`) and sends ``{"df": "clone-request", "n_clone": M, "endpoints":
   [every clone rank's address]}`` (:func:`check_request`); source rank 0 answers ``{"ok":
   true, "n_src": N}`` and queues the request. The source ranks then agree on a step ``K``
   (the adapter's business).
2. **Hello.** At ``K`` every source rank ``r`` connects to every clone rank ``j`` and sends
   ``{"df": "clone-hello", "rank": r, "plan": ClonePlan.describe(), "digest": ..., "header":
   {...}}`` (:func:`check_hello`; the header: the step and the like, a
   :class:`~deepfreeze.clone.CloneInfo` header). The first hello a clone rank accepts gives its
   plan (:func:`plan_from`, then the adapter's check against its own model: a
   :class:`~deepfreeze.errors.ModelMismatchError` naming the first difference); every later
   hello must carry the same digest (else ``ModelMismatchError`` naming the first difference,
   :func:`deepfreeze.clone.plan.first_difference`). The answer is ``{"ok": true}`` or the error
   (raised on the source rank too; after a refusal every source rank's hello, within 5 s, gets
   the same answer).
3. **Data.** Per route ``r -> j`` of the plan, one frame ``{"df": "clone-data", "t": tensor id,
   "start": a, "stop": b, "dtype": d}`` whose payload is elements ``[a, b)`` of the tensor's flat
   buffer; it is received straight into the buffer the adapter gave for that tensor (its final
   tensor; else a flat buffer) (:meth:`net.Message.recv_into`) after :func:`check_data` checked
   it against the plan: a route from this source rank to this clone rank, not received before,
   the plan's dtype, a payload of exactly ``(b - a) * itemsize`` bytes. With more than one clone
   rank, each route that landed is forwarded to every other clone rank
   (:mod:`deepfreeze.clone.relay`: their connections arrive on the same listener, a
   ``clone-peer`` hello first). Then ``{"df": "clone-record", "rank": r}`` with the rank's opaque state record (at most
   :data:`MAX_RECORD` bytes), then ``{"df": "clone-done"}``, which is refused unless every route
   and the record arrived. ``{"df": "clone-abort", "reason": ...}`` instead: the source gave up
   (a :class:`~deepfreeze.errors.CloneError` naming its rank).
4. **Outcome.** When the clone job has agreed that every rank has everything (the adapter's
   collective), clone rank ``j`` answers every source rank ``{"ok": true}`` or the error.

Every wait is bounded by ``timeout``: past it a :class:`~deepfreeze.errors.CloneTimeoutError`
naming the ranks awaited; a peer that closes (died) is a :class:`~deepfreeze.errors.CloneError`
naming it, the transport error chained.
"""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .. import net
from ..errors import AuthenticationError, CloneError, CloneTimeoutError, ConfigError, DeepFreezeError, ModelMismatchError, \
    ProviderTimeoutError
from ..format import dtype_itemsize
from ..shardplan import TensorSpec
from .plan import PLAN_VERSION, ClonePlan, Route, first_difference
from .relay import MAX_FWD_HEADER, Forwarder, check_forward, check_peer_hello

__all__ = ["MAX_RECORD", "MAX_RANKS", "check_request", "check_hello", "check_data", "plan_from", "request",
           "RequestServer", "Request", "CloneListener", "Sender"]

log = logging.getLogger("deepfreeze")

#: the largest state record a source rank may send (bytes)
MAX_RECORD = 64 << 20
#: the most ranks either job may have
MAX_RANKS = 1 << 16
_MAX_HELLO = 16 << 20  # a hello's JSON (the plan's tensor list)
_MAX_SMALL = 4096  # every other header


def _int(v: Any, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def _show(v: Any, n: int = 20) -> str:
    """A value read from the wire, for an error message: a scalar's repr cut to ``n`` characters,
    else only its type (never the repr of an arbitrarily nested object)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return repr(v if not isinstance(v, str) else v[:n])[:n + 2]
    return type(v).__name__


# ----------------------------------------------------------------------------- decoders (fuzzed)

def check_request(h: Mapping[str, Any]) -> tuple[int, list[str]]:
    """``(n_clone, endpoints)`` of a clone request; :class:`CloneError` for anything else."""
    if not isinstance(h, Mapping) or h.get("df") != "clone-request":
        raise CloneError("not a clone request (expected {'df': 'clone-request', ...})")
    n, eps = h.get("n_clone"), h.get("endpoints")
    if not _int(n, 1, MAX_RANKS) or not isinstance(eps, list) or len(eps) != n:
        raise CloneError(f"malformed clone request: n_clone {_show(n)} and {type(eps).__name__} endpoints "
                         "(expected n_clone in 1..65536 and one 'host:port' per clone rank)")
    for e in eps:
        if not isinstance(e, str) or len(e) > 300:
            raise CloneError("malformed clone request: an endpoint is not a 'host:port' string")
        try:
            net.parse_address(e)
        except ConfigError as err:
            raise CloneError(f"malformed clone request: {err}") from err
    return n, list(eps)


def check_hello(h: Mapping[str, Any]) -> tuple[int, dict, str, dict]:
    """``(source rank, plan description, digest, header)`` of a source rank's hello."""
    if not isinstance(h, Mapping) or h.get("df") != "clone-hello":
        raise CloneError("not a clone hello (expected {'df': 'clone-hello', ...})")
    r, plan, digest, header = h.get("rank"), h.get("plan"), h.get("digest"), h.get("header")
    if not _int(r, 0, MAX_RANKS - 1) or not isinstance(plan, dict) or not isinstance(digest, str) \
            or len(digest) != 64 or not isinstance(header, dict):
        raise CloneError("malformed clone hello: expected rank, plan, digest (64 hex) and header")
    return r, plan, digest, header


def plan_from(d: Mapping[str, Any]) -> ClonePlan:
    """The :class:`ClonePlan` a source's :meth:`ClonePlan.describe` names, every field checked
    (:class:`CloneError` for a malformed one; :class:`ModelMismatchError` for another version)."""
    if not isinstance(d, Mapping):
        raise CloneError("malformed clone plan: not an object")
    if d.get("version") != PLAN_VERSION:
        raise ModelMismatchError(f"the source's clone plan is version {_show(d.get('version'))}, this side's "
                                 f"{PLAN_VERSION}: run the same DeepFreeze on both jobs")
    n_src, n_clone, thr, ts = d.get("n_src"), d.get("n_clone"), d.get("threshold"), d.get("tensors")
    if not (_int(n_src, 1, MAX_RANKS) and _int(n_clone, 1, MAX_RANKS) and _int(thr, 0, 1 << 62)
            and isinstance(ts, list) and len(ts) <= 1 << 20):
        raise CloneError("malformed clone plan: n_src, n_clone, threshold or tensors out of bounds")
    specs, whole = [], []
    for i, t in enumerate(ts):
        if not (isinstance(t, list) and len(t) == 4 and isinstance(t[0], str) and isinstance(t[1], str)
                and isinstance(t[2], list) and len(t[2]) <= 64 and all(_int(x, 0, 1 << 48) for x in t[2])
                and isinstance(t[3], bool)):
            raise CloneError(f"malformed clone plan: tensor #{i} is not [name, dtype, shape, whole]")
        try:
            dtype_itemsize(t[1])
        except Exception as e:
            raise CloneError(f"malformed clone plan: tensor #{i} has dtype {t[1][:20]!r}") from e
        size = 1
        for x in t[2]:
            size *= x
        if size > 1 << 48:
            raise CloneError(f"malformed clone plan: tensor #{i} has {size} elements")
        specs.append(TensorSpec(i, t[0], t[1], tuple(t[2])))
        if t[3]:
            whole.append(i)
    return ClonePlan(specs, n_src, n_clone, whole=whole, threshold=thr)


def check_data(h: Mapping[str, Any], plan: ClonePlan, expected: dict, payload: int) -> Route:
    """The route a data frame carries, checked against ``expected`` (``(tensor id, start, stop)``
    -> :class:`Route` of the routes still awaited from this source rank) and the plan, before a
    byte of its ``payload`` is read. :class:`CloneError` for anything else."""
    if not isinstance(h, Mapping):
        raise CloneError("malformed clone data frame: the header is not an object")
    t, a, b, d = h.get("t"), h.get("start"), h.get("stop"), h.get("dtype")
    if not (_int(t, 0, len(plan.tensors) - 1) and _int(a, 0, 1 << 62) and _int(b, 0, 1 << 62)):
        raise CloneError("malformed clone data frame: tensor id or range out of bounds")
    route = expected.get((t, a, b))
    if route is None:
        raise CloneError(f"a clone data frame for tensor #{t} elements [{a}, {b}) is not a route of the plan "
                         "still awaited from this source rank (a duplicate, or another plan)")
    spec = plan.tensors[t]
    if d != spec.dtype:
        raise CloneError(f"a clone data frame for {spec.name!r} says dtype {_show(d)}, the plan {spec.dtype}")
    if payload != (b - a) * dtype_itemsize(spec.dtype):
        raise CloneError(f"a clone data frame for {spec.name!r} [{a}, {b}) carries {payload} bytes, the plan "
                         f"{(b - a) * dtype_itemsize(spec.dtype)}")
    return route


# ----------------------------------------------------------------------------- the request

def request(address: str, token: str, endpoints: Sequence[str], *, timeout: float) -> int:
    """Clone rank 0: ask the source at ``address`` for a clone to ``endpoints`` (every clone
    rank's listening address, in rank order); returns the source's world size. Raises
    :class:`~deepfreeze.errors.AuthenticationError` (wrong token), :class:`CloneTimeoutError`,
    :class:`CloneError` (no source there, or it refused)."""
    deadline = time.monotonic() + timeout
    try:
        sock = net.connect(address, timeout)
    except ProviderTimeoutError as e:
        raise CloneTimeoutError(f"the clone source at {address} did not accept a connection within {timeout:g} s") from e
    except DeepFreezeError as e:
        raise CloneError(f"cannot reach the clone source at {address}: {e} (is its CloneServer running?)") from e
    try:
        ch, reply = net.client_handshake(sock, token, {"df": "clone-request", "n_clone": len(endpoints),
                                                       "endpoints": list(endpoints)}, deadline=deadline)
        ch.close()
    except AuthenticationError:
        sock.close()
        raise
    except ProviderTimeoutError as e:
        sock.close()
        raise CloneTimeoutError(f"the clone source at {address} did not answer within {timeout:g} s") from e
    except DeepFreezeError as e:
        sock.close()
        if isinstance(e, (CloneError, ModelMismatchError)):
            raise
        raise CloneError(f"the clone source at {address} refused the request: {e}") from e
    n = reply.get("n_src")
    if not _int(n, 1, MAX_RANKS):
        raise CloneError(f"the clone source at {address} answered without its world size")
    return n


class Request:
    """A clone request as source rank 0 received it."""

    def __init__(self, n_clone: int, endpoints: list[str], peer: str) -> None:
        self.n_clone, self.endpoints, self.peer = n_clone, endpoints, peer


class RequestServer:
    """Source rank 0's listener for clone requests (:func:`request`): authenticated by an
    :class:`net.Acceptor`; each valid request is answered and queued (:meth:`next`)."""

    def __init__(self, host: str, port: int, token: str, n_src: int, *, allow_remote: bool = False,
                 timeout: float = 30.0) -> None:
        self.n_src, self.timeout = n_src, float(timeout)
        self._sock = net.listen(host, port, allow_remote=allow_remote)
        self.address = net.format_address(host, self._sock.getsockname()[1])
        self._q: "queue.Queue[Request]" = queue.Queue()
        self._acceptor = net.Acceptor(self._sock, token, self._ready, name="deepfreeze-clone-requests", log=log)

    def _ready(self, ch: net.Channel) -> None:
        threading.Thread(target=self._serve, args=(ch,), name="deepfreeze-clone-request", daemon=True).start()

    def _serve(self, ch: net.Channel) -> None:
        try:
            h = ch.recv(max_header=1 << 20, max_payload=0, deadline=time.monotonic() + self.timeout).header
            try:
                n, eps = check_request(h)
            except CloneError as e:
                ch.send(net.error_reply(e), deadline=time.monotonic() + self.timeout)
                return
            ch.send({"ok": True, "n_src": self.n_src}, deadline=time.monotonic() + self.timeout)
            self._q.put(Request(n, eps, ch.peer()))
        except DeepFreezeError as e:
            log.warning("DeepFreeze clone: a request from %s failed: %s", ch.peer(), e)
        finally:
            ch.close()

    def next(self) -> "Request | None":
        """The oldest request not taken yet, or None (never blocks)."""
        try:
            return self._q.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        self._acceptor.close()
        self._sock.close()


# ----------------------------------------------------------------------------- the clone side

def _buffers_for(plan: ClonePlan, targets: "Mapping[int, np.ndarray] | None") -> dict[int, np.ndarray]:
    """Where each tensor's bytes land: the adapter's ``targets`` (tensor id -> a writable,
    contiguous, one-dimensional uint8 array of exactly the tensor's bytes), else a new flat buffer."""
    out = {}
    for t in plan.tensors:
        n = t.size * dtype_itemsize(t.dtype)
        b = None if targets is None else targets.get(t.id)
        if b is None:
            b = np.empty(n, np.uint8)
        elif not (isinstance(b, np.ndarray) and b.dtype == np.uint8 and b.ndim == 1 and b.nbytes == n
                  and b.flags.c_contiguous and b.flags.writeable):
            raise CloneError(f"the buffer given for tensor {t.name[:200]!r} is not {n} writable contiguous bytes")
        out[t.id] = b
    return out


class CloneListener:
    """A clone rank's listener and receiver: the source ranks connect to :attr:`address` (and,
    with ``peers``, the other clone ranks: :mod:`deepfreeze.clone.relay`).

    :meth:`receive` serves one connection per source rank (a thread each): hello, data into the
    tensors' buffers, record, done. ``accept`` (the adapter's check of the first plan against
    its own model: raise :class:`ModelMismatchError`) runs once, before any data; it may return
    the buffers the data lands in (tensor id -> the tensor's flat bytes, writable uint8: the
    adapter's final tensors), else flat buffers are allocated (:attr:`buffers`). With ``peers``
    (every clone rank's address, this job's size > 1) each route is forwarded to every other
    clone rank as it lands (``forwarder_cls``, a :class:`~deepfreeze.clone.relay.Forwarder`),
    and the others' forwards are received the same way: :meth:`receive` returns when this rank
    holds every tensor whole. :meth:`finish` answers every source rank."""

    #: (class defaults: a listener made without ``__init__``, as the decoders' fuzz test does, forwards nothing)
    _peers: "Sequence[str]" = ()
    _planned: "threading.Event | None" = None
    _forwarders: "dict[int, Forwarder]" = {}

    def __init__(self, rank: int, token: str, *, host: str = "127.0.0.1", allow_remote: bool = False,
                 timeout: float = 60.0, forwarder_cls: type = Forwarder) -> None:
        self.rank, self.timeout = rank, float(timeout)
        self._token, self.forwarder_cls = token, forwarder_cls
        self._sock = net.listen(host, 0, allow_remote=allow_remote)
        self.address = net.format_address(host, self._sock.getsockname()[1])
        self._q: "queue.Queue[net.Channel]" = queue.Queue()
        self._acceptor = net.Acceptor(self._sock, token, self._q.put, name=f"deepfreeze-clone-r{rank}", log=log)
        self._lock = threading.Lock()
        self._channels: dict[int, net.Channel] = {}
        self._peer_channels: dict[int, net.Channel] = {}
        self._planned = threading.Event()  # set once a plan was accepted or refused
        self._forwarders = {}
        self.plan: ClonePlan | None = None
        self.digest = ""
        self.describe: dict = {}
        self.header: dict = {}
        self.buffers: dict[int, np.ndarray] = {}  # tensor id -> flat uint8 buffer (every byte of the tensor)
        self.records: dict[int, bytes] = {}
        self._refused: ModelMismatchError | None = None  # the first plan refused: the answer to every hello
        self._left: dict[int, int] = {}  # source rank (hello accepted) -> its routes not received yet
        self._peer_left: dict[int, int] = {}  # clone rank (peer hello accepted) -> its forwards not received yet
        self.bytes_received = 0  #: payload bytes received from the source ranks
        self.bytes_relayed = 0  #: payload bytes received from the other clone ranks (their forwards)
        self.first_data_at: float | None = None

    @property
    def bytes_forwarded(self) -> int:
        """Payload bytes this rank forwarded to the other clone ranks."""
        return sum(f.bytes_sent for f in self._forwarders.values())

    def receive(self, n_src: int, accept: "Callable[[ClonePlan, dict], Mapping[int, np.ndarray] | None]", *,
                peers: "Sequence[str] | None" = None) -> None:
        """Every route of this rank from each of the ``n_src`` source ranks, and their records;
        with ``peers`` (every clone rank's address, in rank order) also every other clone rank's
        routes, forwarded as they land (and this rank's forwarded to them). Raises
        :class:`CloneTimeoutError` (:meth:`_timeout_error`) naming, of the source ranks whose
        sends did not complete within ``timeout``, those that did not send every route and
        those whose routes all arrived but not their record and end, and the clone ranks whose
        forwards did not complete; :class:`CloneError` naming a source or clone rank that failed
        or died; :class:`ModelMismatchError`."""
        deadline = time.monotonic() + self.timeout
        self._peers = list(peers) if peers is not None and len(peers) > 1 else ()
        n_peer = max(0, len(self._peers) - 1)
        done: set[int] = set()
        peers_done: set[int] = set()
        pool = concurrent.futures.ThreadPoolExecutor(max(1, n_src + 2 * n_peer),
                                                     thread_name_prefix=f"deepfreeze-clone-in{self.rank}")
        futures: dict[concurrent.futures.Future, str] = {}
        started = False
        try:
            refused: ModelMismatchError | None = None
            while True:
                for f in [f for f in futures if f.done()]:
                    kind = futures.pop(f)
                    try:
                        got = f.result()  # raises the connection's error
                    except ModelMismatchError as e:  # every source rank gets the answer (a bounded wait)
                        if kind != "source":
                            raise
                        refused = refused or e
                        done.add(len(done) + n_src)
                        deadline = min(deadline, time.monotonic() + min(5.0, self.timeout))
                        continue
                    except CloneTimeoutError as e:  # a connection's wait ended at the deadline: say it for all
                        raise (self._timeout_error(n_src) or e) from e
                    except CloneError as e:
                        if getattr(e, "peer_lost", False):  # a lost clone rank: maybe it gave up, saying why
                            raise self._cause(e, futures)
                        raise
                    if isinstance(got, tuple):
                        peers_done.add(got[0] * 2 + (got[1] == "fwd"))
                    else:
                        done.add(got)
                if refused is not None and (len(done) >= n_src or time.monotonic() > deadline):
                    break
                if len(done) >= n_src and len(peers_done) >= 2 * n_peer:
                    break
                if not started and self._forwarders:  # the plan is here: forward what lands (queued until then)
                    started = True
                    for k, fw in self._forwarders.items():
                        futures[pool.submit(self._forward, fw, deadline)] = "forward"
                if time.monotonic() > deadline:
                    err = self._timeout_error(n_src)
                    if err is not None:
                        raise err
                    continue  # every rank finished just now: their connections end on the next pass
                try:
                    ch = self._q.get(timeout=0.01)
                except queue.Empty:
                    continue
                futures[pool.submit(self._serve, ch, n_src, accept, deadline)] = "source"
            if refused is not None:
                raise refused
        except BaseException as e:
            self._abort(f"{type(e).__name__}: {e}")
            raise
        finally:
            pool.shutdown(wait=False)

    @staticmethod
    def _forward(fw: Forwarder, deadline: float) -> tuple[int, str]:
        return fw.run(deadline), "fwd"

    @staticmethod
    def _cause(first: CloneError, futures: dict) -> BaseException:
        """After a connection to or from another clone rank was lost (``first``): the error of a
        connection that ends within 0.5 s with a reason of its own (a clone rank that gave up
        says why, naming the rank that failed first), else ``first``. A rank that gives up shuts
        its connections after telling the others, so both arrive together."""
        end = time.monotonic() + 0.5
        while True:
            for f in [f for f in futures if f.done()]:
                futures.pop(f)
                e = f.exception()
                if e is not None and not getattr(e, "peer_lost", False):
                    return e
            if time.monotonic() >= end:
                return first
            time.sleep(0.01)

    def _timeout_error(self, n_src: int) -> "CloneTimeoutError | None":
        """The timeout, naming only the source ranks whose sends did not complete (no end
        received): those that did not say hello, those with routes still missing (how many),
        and apart those whose every route arrived but not their state record and end (the source
        takes the record at its next step, which a stuck rank of the source job holds up); then
        the clone ranks whose forwards did not all arrive, and those this rank's forwards did not
        reach. None when every rank has finished after all."""
        with self._lock:
            finished, left, hello = set(self.records), dict(self._left), set(self._channels)
            peer_left, peer_hello = dict(self._peer_left), set(self._peer_channels)
        unfinished = [r for r in range(n_src) if r not in finished]
        relaying = [k for k in range(len(self._peers)) if k != self.rank and peer_left.get(k) != 0]
        stuck = [k for k, fw in sorted(self._forwarders.items()) if not fw.ended]
        if not unfinished and not relaying and not stuck:
            return None
        sending = [r for r in unfinished if left.get(r) != 0]
        ending = [r for r in unfinished if left.get(r) == 0]
        parts = []
        if sending:
            silent = [r for r in sending if r not in hello]
            why = [f"no hello from {silent}"] if silent else []
            why += [f"rank {r}: {left[r]} route(s) missing" if r in left else f"rank {r}: hello only"
                    for r in sending if r in hello]
            parts.append(f"source rank(s) {sending} did not finish sending their tensors ({'; '.join(why)})")
        if ending:
            parts.append(f"source rank(s) {ending} sent every tensor but not their state record and end (the source "
                         "takes the record at its next step: a stuck or dead rank of the source job holds it up)")
        if relaying:
            why = [f"rank {k}: {peer_left[k]} forward(s) missing" if k in peer_left else
                   f"rank {k}: {'hello only' if k in peer_hello else 'no hello'}" for k in relaying]
            parts.append(f"clone rank(s) {relaying} did not forward every chunk they received ({'; '.join(why)})")
        if stuck:
            parts.append(f"this rank's forwards to clone rank(s) {stuck} did not complete")
        return CloneTimeoutError(f"clone rank {self.rank}: within timeout={self.timeout:g} s, " + "; ".join(parts)
                                 + "; nothing was loaded (the source never reached its clone step, or a rank stalled "
                                   "or died)")

    def _serve(self, ch: net.Channel, n_src: int, accept: "Callable[[ClonePlan, dict], Any]",
               deadline: float) -> "int | tuple[int, str]":
        r = None
        try:
            first = ch.recv(max_header=_MAX_HELLO, max_payload=0, deadline=deadline).header
            if first.get("df") == "clone-peer" and self._peers:
                return self._serve_peer(ch, first, deadline)
            r, describe, digest, header = check_hello(first)
            try:
                with self._lock:
                    if self._refused is not None:  # the plan was refused: every source rank is told why
                        raise self._refused
                    if r >= n_src or r in self._channels:
                        raise CloneError(f"a second connection says it is source rank {r} (of {n_src})")
                    self._channels[r] = ch
                    if self.plan is None:
                        plan = plan_from(describe)
                        if plan.n_src != n_src or plan.n_clone <= self.rank:
                            raise ModelMismatchError(f"the source's plan is for {plan.n_src} -> {plan.n_clone} ranks, "
                                                     f"this is clone rank {self.rank} of a request to {n_src} ranks")
                        if self._peers and len(self._peers) != plan.n_clone:
                            raise ModelMismatchError(f"the source's plan is for {plan.n_clone} clone ranks, this "
                                                     f"job has {len(self._peers)}")
                        targets = accept(plan, header)
                        self.buffers = _buffers_for(plan, targets)
                        self.plan, self.digest, self.describe, self.header = plan, plan.digest(), describe, header
                        self._forwarders = {k: self.forwarder_cls(self.rank, k, addr, self._token, plan, self.buffers,
                                                                  timeout=self.timeout)
                                            for k, addr in enumerate(self._peers) if k != self.rank}
                        if self._planned is not None:
                            self._planned.set()
                    elif digest != self.digest:
                        raise ModelMismatchError(f"source rank {r} sends another plan than the source rank before it: "
                                                 f"{first_difference(describe, self.describe)}")
                    if r == 0:
                        self.header = header
            except (CloneError, ModelMismatchError) as e:
                if isinstance(e, ModelMismatchError):
                    with self._lock:
                        self._refused = self._refused or e
                    if self._planned is not None:
                        self._planned.set()
                ch.send(net.error_reply(e), deadline=deadline)
                raise
            ch.send({"ok": True}, deadline=deadline)
            plan = self.plan
            expected = {(x.tensor_id, x.start, x.stop): x for x in plan.routes if x.src == r and x.dst == self.rank}
            with self._lock:
                self._left[r] = len(expected)
            largest = max([(x.stop - x.start) * dtype_itemsize(plan.tensors[x.tensor_id].dtype)
                           for x in expected.values()] + [MAX_RECORD])
            record: bytes | None = None
            while True:
                msg = ch.recv(max_header=_MAX_SMALL, max_payload=largest, deadline=deadline)
                h, kind = msg.header, msg.header.get("df")
                if kind == "clone-data":
                    route = check_data(h, plan, expected, msg.payload_bytes)
                    item = dtype_itemsize(plan.tensors[route.tensor_id].dtype)
                    if self.first_data_at is None:
                        self.first_data_at = time.time()
                    msg.recv_into(self.buffers[route.tensor_id][route.start * item:route.stop * item])
                    del expected[(route.tensor_id, route.start, route.stop)]
                    for fw in self._forwarders.values():  # landed, its MAC checked: on to the other clone ranks
                        fw.put(route)
                    with self._lock:
                        self._left[r] = len(expected)
                    self.bytes_received += msg.payload_bytes
                elif kind == "clone-record":
                    if h.get("rank") != r or record is not None or msg.payload_bytes > MAX_RECORD:
                        raise CloneError(f"source rank {r} sent a record that is not its one record of at most "
                                         f"{MAX_RECORD} bytes")
                    buf = bytearray(msg.payload_bytes)
                    msg.recv_into(buf)
                    record = bytes(buf)
                elif kind == "clone-done":
                    if expected or record is None:
                        raise CloneError(f"source rank {r} said done with {len(expected)} route(s) and "
                                         f"{'no' if record is None else 'its'} record still missing")
                    with self._lock:
                        self.records[r] = record
                    return r
                elif kind == "clone-abort":
                    raise CloneError(f"source rank {r} gave up the clone: {str(h.get('reason'))[:2000]}")
                else:
                    raise CloneError(f"source rank {r} sent an unknown clone frame {_show(kind, 40)}")
        except ProviderTimeoutError as e:
            raise CloneTimeoutError(f"clone rank {self.rank}: source rank {'?' if r is None else r} ({ch.peer()}) "
                                    f"did not finish sending within timeout={self.timeout:g} s: {e}") from e
        except (CloneError, ModelMismatchError):
            raise
        except DeepFreezeError as e:
            raise CloneError(f"clone rank {self.rank}: the connection of source rank {'?' if r is None else r} "
                             f"({ch.peer()}) failed mid-transfer (it died, or closed): {e}") from e

    def _serve_peer(self, ch: net.Channel, h: dict, deadline: float) -> tuple[int, str]:
        """Another clone rank's forwards (:mod:`deepfreeze.clone.relay`), straight into
        :attr:`buffers` once this rank's own plan is known and the same; returns ``(its rank,
        "peer")`` when every route it owes arrived."""
        j = None
        try:
            j, digest = check_peer_hello(h, len(self._peers))
            try:
                with self._lock:
                    if j == self.rank or j in self._peer_channels:
                        raise CloneError(f"a second connection says it is clone rank {j}")
                    self._peer_channels[j] = ch
                if self._planned is None or not self._planned.wait(max(0.0, deadline - time.monotonic())):
                    raise CloneTimeoutError(f"clone rank {self.rank}: no plan from the source within "
                                            f"timeout={self.timeout:g} s")
                if self.plan is None:
                    raise CloneError(f"clone rank {self.rank} refused the source's plan: {self._refused}")
                if digest != self.digest:
                    raise CloneError(f"clone rank {j} received another plan than clone rank {self.rank}")
            except CloneError as e:
                ch.send(net.error_reply(e), deadline=deadline)
                raise
            ch.send({"ok": True}, deadline=deadline)
            plan = self.plan
            expected = {(x.tensor_id, x.start, x.stop): x for x in plan.routes if x.dst == j}
            left_bytes = sum((x.stop - x.start) * dtype_itemsize(plan.tensors[x.tensor_id].dtype)
                             for x in expected.values())
            with self._lock:
                self._peer_left[j] = len(expected)
            while True:
                msg = ch.recv(max_header=MAX_FWD_HEADER, max_payload=left_bytes, deadline=deadline)
                kind = msg.header.get("df")
                if kind == "clone-fwd":
                    for x in check_forward(msg.header, plan, expected, msg.payload_bytes):
                        item = dtype_itemsize(plan.tensors[x.tensor_id].dtype)
                        msg.recv_into(self.buffers[x.tensor_id][x.start * item:x.stop * item])
                        del expected[(x.tensor_id, x.start, x.stop)]
                    left_bytes -= msg.payload_bytes
                    with self._lock:
                        self._peer_left[j] = len(expected)
                        self.bytes_relayed += msg.payload_bytes
                elif kind == "clone-done":
                    if expected:
                        raise CloneError(f"clone rank {j} said done with {len(expected)} forward(s) still missing")
                    return j, "peer"
                elif kind == "clone-abort":
                    raise CloneError(f"clone rank {j} gave up the clone: {str(msg.header.get('reason'))[:2000]}")
                else:
                    raise CloneError(f"clone rank {j} sent an unknown clone frame {_show(kind, 40)}")
        except ProviderTimeoutError as e:
            raise CloneTimeoutError(f"clone rank {self.rank}: clone rank {'?' if j is None else j} ({ch.peer()}) did "
                                    f"not finish forwarding its chunks within timeout={self.timeout:g} s: {e}") from e
        except CloneError:
            raise
        except DeepFreezeError as e:
            err = CloneError(f"clone rank {self.rank}: the connection of clone rank {'?' if j is None else j} "
                             f"({ch.peer()}) failed while it forwarded its chunks (it died, or closed): {e}")
            err.peer_lost = True
            raise err from e

    def _abort(self, reason: str = "") -> None:
        """Give up: the source connections shut at once; the other clone ranks are told why by
        this rank's forwarders (within 1 s), then every connection is shut."""
        if self._planned is not None:  # a peer's connection waiting for this rank's plan ends now
            self._planned.set()
        for ch in list(self._channels.values()):
            try:
                ch.shutdown()
            except OSError:
                pass
        fws = list(self._forwarders.values())
        for fw in fws:
            fw.stop(reason)
        end = time.monotonic() + 1.0
        for fw in fws:
            if fw.running:
                fw.finished.wait(max(0.0, end - time.monotonic()))
            fw.kill()
        for ch in list(self._peer_channels.values()):
            try:
                ch.shutdown()
            except OSError:
                pass

    def finish(self, error: "BaseException | None") -> None:
        """Answer every connected source rank: ``{"ok": true}``, or ``error`` (best effort, 5 s at most)."""
        reply = {"ok": True} if error is None else net.error_reply(error)
        deadline = time.monotonic() + min(5.0, self.timeout)
        for ch in list(self._channels.values()):
            try:
                ch.send(reply, deadline=deadline)
            except (DeepFreezeError, OSError):
                pass

    def close(self) -> None:
        self._acceptor.close()
        self._sock.close()
        for fw in list(self._forwarders.values()):
            fw.close()
        for ch in list(self._channels.values()) + list(self._peer_channels.values()):
            ch.close()
        while True:
            try:
                self._q.get_nowait().close()
            except queue.Empty:
                break


# ----------------------------------------------------------------------------- the source side

class Sender:
    """Source rank ``rank``'s side of one clone: a connection to every clone rank, its routes,
    its record, done, then the clone's answer. Subclass and override :meth:`send_route` to inject
    faults (tests)."""

    def __init__(self, rank: int, plan: ClonePlan, endpoints: Sequence[str], token: str, *,
                 timeout: float = 60.0) -> None:
        self.rank, self.plan, self.endpoints, self.token = rank, plan, list(endpoints), token
        self.timeout = float(timeout)
        self._channels: dict[int, net.Channel] = {}
        self._lock = threading.Lock()
        self.bytes_sent = 0

    def send_route(self, ch: net.Channel, route: Route, data: np.ndarray, deadline: float) -> None:
        """One data frame (``data``: the route's bytes)."""
        ch.send({"df": "clone-data", "t": route.tensor_id, "start": route.start, "stop": route.stop,
                 "dtype": self.plan.tensors[route.tensor_id].dtype}, [data], deadline=deadline)

    def _one(self, j: int, buffers: Mapping[int, np.ndarray], record: "Callable[[], bytes]", header: dict) -> None:
        deadline = time.monotonic() + self.timeout
        addr = self.endpoints[j]
        try:
            sock = net.connect(addr, self.timeout)
            hello = {"df": "clone-hello", "rank": self.rank, "plan": self.plan.describe(),
                     "digest": self.plan.digest(), "header": header}
            try:
                ch, _ = net.client_handshake(sock, self.token, hello, deadline=deadline, max_header=1 << 20)
            except BaseException:
                sock.close()
                raise
            with self._lock:
                self._channels[j] = ch
            for route in self.plan.routes:
                if route.src != self.rank or route.dst != j:
                    continue
                item = dtype_itemsize(self.plan.tensors[route.tensor_id].dtype)
                self.send_route(ch, route, buffers[route.tensor_id][route.start * item:route.stop * item], deadline)
                self.bytes_sent += (route.stop - route.start) * item
            ch.send({"df": "clone-record", "rank": self.rank}, [record()], deadline=deadline)
            ch.send({"df": "clone-done"}, deadline=deadline)
        except ProviderTimeoutError as e:
            raise CloneTimeoutError(f"source rank {self.rank}: clone rank {j} ({addr}) did not take the clone within "
                                    f"timeout={self.timeout:g} s: {e}") from e
        except (CloneError, ModelMismatchError, AuthenticationError):
            raise
        except DeepFreezeError as e:
            raise CloneError(f"source rank {self.rank}: sending to clone rank {j} ({addr}) failed (it died, or "
                             f"refused): {e}") from e

    def send(self, buffers: Mapping[int, np.ndarray], record: "bytes | Callable[[], bytes]", header: dict) -> None:
        """Send this rank's routes (``buffers``: tensor id -> the tensor's flat bytes, uint8) and
        ``record`` (bytes, or a function returning them once they are taken: called after the
        routes) to every clone rank (a thread each); raises the first failure (named)."""
        if isinstance(record, (bytes, bytearray)):
            data = bytes(record)
            record = lambda: data  # noqa: E731
        n = len(self.endpoints)
        with concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix=f"deepfreeze-clone-out{self.rank}") as pool:
            futs = [pool.submit(self._one, j, buffers, record, header) for j in range(n)]
            errors = [f.exception() for f in futs]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            self.abort(f"source rank {self.rank}: {first}")
            raise first

    def outcome(self) -> None:
        """Wait (bounded) for every clone rank's answer after the clone job's agreement; raises
        the error one reports (named), :class:`CloneTimeoutError` for one that never answers,
        :class:`CloneError` for one that died."""
        deadline = time.monotonic() + self.timeout
        for j, ch in sorted(self._channels.items()):
            try:
                net.raise_for_reply(ch.recv(max_header=1 << 20, max_payload=0, deadline=deadline).header,
                                    f"clone rank {j} ({self.endpoints[j]}): ")
            except ProviderTimeoutError as e:
                raise CloneTimeoutError(f"source rank {self.rank}: clone rank {j} ({self.endpoints[j]}) did not say "
                                        f"whether it took the clone within timeout={self.timeout:g} s") from e
            except DeepFreezeError as e:
                if net.is_transport_error(e):
                    raise CloneError(f"source rank {self.rank}: clone rank {j} ({self.endpoints[j]}) closed before "
                                     f"saying whether it took the clone (it died?): {e}") from e
                raise

    def abort(self, reason: str) -> None:
        """Tell every connected clone rank this rank gives up (best effort, 1 s)."""
        deadline = time.monotonic() + 1.0
        for ch in list(self._channels.values()):
            try:
                ch.send({"df": "clone-abort", "reason": reason[:2000]}, deadline=deadline)
            except (DeepFreezeError, OSError):
                pass

    def close(self) -> None:
        for ch in list(self._channels.values()):
            try:
                ch.shutdown()
            except OSError:
                pass
            ch.close()
        self._channels.clear()
