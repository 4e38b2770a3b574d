"""The per-rank stream server, its client, and push notifications (over :mod:`deepfreeze.net`).

Each producer rank runs one :class:`RankServer` next to its :class:`~deepfreeze.stream.slots.SlotRing`:
it serves that rank's shard bytes straight from the ring (no funnel through rank 0) and pushes a
small notification to every subscribed consumer once a version is complete. A consumer holds one
:class:`RankClient` per producer rank; it can ``poll()`` (or ``selectors``) over their :meth:`RankClient.fileno`.

**Protocol.** A connection first runs the :mod:`deepfreeze.net` handshake (both ends prove they
know the token, which never goes on the wire; a server that cannot prove it is refused before
the client sends anything); then every message is one sealed frame (JSON header, raw payload,
MACs under the session key over direction, sequence number, header and payload)::

    client                                            server
    {"op": "hello", "channel", "run"?}           ->  {"ok": true, "rank", "world", "run", "generation",
                                                      "channel", "capacity", "node", "pid", "ring"}
                                                      (another channel or run: StreamError;
                                                      then closed)
    {"op": "subscribe"}                          ->  {"ok": true, "op": "subscribed"}, then the newest
                                                      complete version's note (catch-up), then one
                                                      note per :meth:`RankServer.notify`, until closed:
        {"op": "ready", "channel", "run", "generation", "step", "rank", "world", "nbytes", "crc", "t"}
    {"op": "get", "generation": g, "step": s|null} -> {"ok": true, "generation", "step", "nbytes", "crc"}
                                                      + payload = the slot's bytes, sent from
                                                      ``ring.pinned(...)`` (zero copy, pinned while
                                                      sent); gone: VersionGoneError. Any number of
                                                      gets per connection.

A subscribed connection carries notifications only (the client sends nothing more on it); a
:class:`RankClient` that subscribed opens a second connection for its fetches, lazily.

**Push, never poll.** :meth:`RankServer.notify` seals the note for each subscriber (its own
sequence number and session key: one HMAC of a small header each) and, for each subscriber
with nothing queued, writes it to the socket right away without waiting (``MSG_DONTWAIT`` after
a zero-timeout ``poll`` for room): no handoff to another thread, so a producer whose other
threads hold the GIL does not add a thread switch (up to ``sys.getswitchinterval()``, 5 ms) to
the latency. What the socket does not take is
queued (bounded) and the subscriber's thread, woken through a pipe, sends it in order. The
consumer blocks in ``poll()`` on its socket (:meth:`RankClient.next_note`) until the frame
arrives or its timeout passes. ``notify`` never blocks the caller: a subscriber whose queue is
full (it stopped reading) or whose socket failed is dropped and logged once; it reconnects and
gets the catch-up note. A version is announced at most once per connection (the catch-up note
and a racing ``notify`` of the same version: once).

**Bounds.** Every size read from a socket is checked before anything is allocated: request
headers at most 64 KiB and no request payload on the server; on the client, headers at most
1 MiB and payloads at most the ring capacity the server announced (and never more than the
caller's buffer). Every wait has a deadline: a stopped server gives
:class:`~deepfreeze.errors.StreamTimeoutError`, a closed one :class:`~deepfreeze.errors.StreamError`
(transport errors of :mod:`deepfreeze.net` are re-raised as these, the cause chained, with
``net.is_transport_error(e)`` still true). Authenticated connections are capped
(``max_connections``); unauthenticated ones wait in the server's
:class:`~deepfreeze.net.Acceptor` (one thread, at most ``max_pending``, the oldest closed when
another arrives, each for at most ``handshake_timeout`` seconds), so idle or slow-loris
connections never cost a thread and never lock out a consumer that knows the token: it gets
through within ``handshake_timeout`` plus its own ``io_timeout``. A subscriber that stops
reading holds only its own queue (``max_queue`` notes, then dropped; a send blocked past
``io_timeout``: dropped), never anybody else's notes. A ``get`` is sent straight from its
pinned slot, but a reader that takes nothing for ``PIN_TIMEOUT`` seconds gets the rest from a
private copy and the pin goes, so readers that request and never read cannot keep the producer
from writing (at most ``MAX_STALLED`` such copies at once, one slot each; past that a stalled
reader is dropped); a stalled reader is dropped after ``io_timeout``.
"""
from __future__ import annotations

import collections
import logging
import os
import select
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Mapping

from .. import net
from ..errors import (AuthenticationError, ConfigError, DeepFreezeError, PeerClosedError, ProviderError,
                      StreamError, StreamTimeoutError, VersionGoneError)
from ..format import crc32
from ..node import node_id
from ..lease import RunInfo, Version

if TYPE_CHECKING:  # the ring is duck-typed at run time (latest, pinned, capacity, path)
    from .slots import SlotRing

__all__ = ["RankServer", "RankClient", "ready_note", "MAX_REQUEST_HEADER", "MAX_REPLY_HEADER",
           "DEFAULT_MAX_QUEUE", "DEFAULT_MAX_CONNECTIONS", "DEFAULT_HANDSHAKE_TIMEOUT", "DEFAULT_MAX_PENDING",
           "PIN_TIMEOUT", "MAX_STALLED"]

log = logging.getLogger("deepfreeze.stream")

#: largest request header the server reads (requests are small JSON objects)
MAX_REQUEST_HEADER = 64 << 10
#: largest reply or notification header a client reads
MAX_REPLY_HEADER = 1 << 20
#: notifications queued per subscriber before it counts as stalled and is dropped
DEFAULT_MAX_QUEUE = 256
#: authenticated connections a server serves at once (each has a thread); more are refused
DEFAULT_MAX_CONNECTIONS = 128
#: seconds a get may keep its slot pinned while the reader takes nothing (then the rest is copied)
PIN_TIMEOUT = 0.5
#: stalled readers served from private copies at once (memory: at most this many slots); more are dropped
MAX_STALLED = 4
#: seconds a new connection has to complete the handshake (:class:`deepfreeze.net.Acceptor`)
DEFAULT_HANDSHAKE_TIMEOUT = 5.0
#: connections waiting in the handshake at once; one more closes the oldest
DEFAULT_MAX_PENDING = 64
_MAX_CAPACITY = 1 << 48
_MAX_INT = 1 << 63
_NOTE_KEYS = ("generation", "step", "nbytes", "crc")


def _poller(*fds: int) -> "select.poll":
    """A ``poll`` object over ``fds`` (``poll``, not ``select``: a training process may hold more
    than FD_SETSIZE = 1024 descriptors)."""
    p = select.poll()
    for fd in fds:
        p.register(fd, select.POLLIN | select.POLLPRI)
    return p


def _ready(p: "select.poll", timeout: float | None) -> set[int]:
    """The descriptors of ``p`` readable (or closed, or failed) within ``timeout`` seconds (None: no limit)."""
    ms = None if timeout is None else max(0, int(timeout * 1000 + 0.999))
    return {fd for fd, _ev in p.poll(ms)}


def _is_int(x: Any, lo: int = 0, hi: int = _MAX_INT) -> bool:
    return type(x) is int and lo <= x < hi


def _stream_error(e: DeepFreezeError, where: str) -> StreamError:
    """The stream's form of a :mod:`deepfreeze.net` transport error (timeouts stay timeouts)."""
    cls = StreamTimeoutError if isinstance(e, TimeoutError) else StreamError
    out = cls(f"{where}: {e}")
    out.transport = True
    return out


def ready_note(version: Version, nbytes: int, crc: int, **extra: Any) -> dict[str, Any]:
    """The part of a "ready" note the publisher knows (:meth:`RankServer.notify` adds the rest)."""
    return {"generation": version.generation, "step": version.step, "nbytes": nbytes, "crc": crc, **extra}


class _Subscriber:
    """One subscribed connection: its queue of sealed notes (each with this connection's own
    sequence number and MAC, so they go out in the order they were sealed), the lock of its
    socket's writes and the pipe that wakes its thread. ``pending`` and ``last`` are guarded by
    the server's lock, and so is sealing (``ch.frame``)."""

    def __init__(self, ch: net.Channel, peer: str, max_queue: int) -> None:
        self.ch, self.conn, self.peer, self.max_queue = ch, ch.sock, peer, max_queue
        self.pending: collections.deque[bytes] = collections.deque()
        self.send_lock = threading.Lock()  # held by whoever writes to the socket
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)
        self._out = select.poll()
        self._out.register(ch.fileno(), select.POLLOUT)
        self.dropped = False
        self.last: tuple[int, int] | None = None  # (generation, step) last queued or sent

    def queue(self, frame: bytes) -> bool:
        """Queue ``frame`` for the thread (server lock held); False when the queue is full."""
        if len(self.pending) >= self.max_queue:
            return False
        self.pending.append(frame)
        try:
            os.write(self.wake_w, b"\0")
        except BlockingIOError:  # the pipe is full: the thread is already woken
            pass
        return True

    def try_send(self, frame: bytes) -> bytes:
        """Send what the socket takes now without waiting, when nothing is queued and no one else
        is writing (server lock held). Returns the part not sent (to queue). OSError: dead socket."""
        if self.pending or not self.send_lock.acquire(blocking=False):
            return frame
        try:
            if not self._out.poll(0):
                return frame
            n = self.conn.send(frame, socket.MSG_DONTWAIT)  # writable: returns at once, maybe partly
            return frame[n:]
        except BlockingIOError:
            return frame
        finally:
            self.send_lock.release()

    def close_pipe(self) -> None:
        for fd in (self.wake_r, self.wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


class RankServer:
    """The stream server of one producer rank: serves its ring's versions and pushes notes.

    ``ring``: the rank's :class:`~deepfreeze.stream.slots.SlotRing` (created by the producer).
    ``host``/``port``/``allow_remote``: as :func:`deepfreeze.net.listen` (loopback unless told
    otherwise); :attr:`address` is ``advertise:port``, ``advertise`` defaulting to ``host`` (to this
    machine's name when ``host`` is a wildcard such as ``0.0.0.0``). ``token``: the secret every
    connection must prove it knows. ``max_queue``: notes queued per subscriber before it is dropped.
    ``max_connections``: authenticated connections served at once. ``handshake_timeout`` and
    ``max_pending``: the pre-authentication bounds (module doc). ``io_timeout``: the bound of
    every send and receive (a consumer that does not take a payload within it is dropped, and the
    slot it pinned is released). Threads: ``deepfreeze-stream-r<rank>`` accepts and runs the handshakes, one
    ``deepfreeze-stream-r<rank>-c<n>`` per connection."""

    def __init__(self, ring: "SlotRing", *, channel: str, rank: int, world: int, run: RunInfo,
                 token: str, host: str = "127.0.0.1", port: int = 0, allow_remote: bool = False,
                 io_timeout: float = 30.0, max_queue: int = DEFAULT_MAX_QUEUE,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, advertise: str | None = None,
                 handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        if not _is_int(world, 1) or not _is_int(rank, 0, world):
            raise ConfigError(f"rank {rank!r} / world {world!r}: expected integers with 0 <= rank < world")
        if not isinstance(channel, str) or not channel:
            raise ConfigError(f"channel {channel!r}: expected a non-empty string")
        if not io_timeout > 0 or not _is_int(max_queue, 1) or not _is_int(max_connections, 1):
            raise ConfigError("io_timeout, max_queue and max_connections must be positive")
        self.ring, self.channel, self.rank, self.world, self.run = ring, channel, rank, world, run
        self.token, self.io_timeout = token, float(io_timeout)
        self.max_queue, self.max_connections = max_queue, max_connections
        self.bytes_sent = 0
        self.connections = 0
        self.stalled_copies = 0  #: payloads copied out of a slot because their reader stopped taking them
        self.pin_timeout, self.max_stalled = min(float(io_timeout), PIN_TIMEOUT), MAX_STALLED
        self._copies = 0
        self._subs: list[_Subscriber] = []
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._count = 0
        self._node = node_id()
        self._sock = net.listen(host, port, allow_remote=allow_remote)
        if advertise is None:  # a wildcard address is no address to connect to: name this machine
            advertise = socket.getfqdn() if host in ("", "0.0.0.0", "::") else host
        self.address = net.format_address(advertise, self._sock.getsockname()[1])
        self._stop_r, self._stop_w = os.pipe()  # written once at close, never drained: wakes every poll
        self._threads: list[threading.Thread] = []
        self._acceptor = net.Acceptor(self._sock, token, self._accepted, name=f"deepfreeze-stream-r{rank}",
                                      handshake_timeout=handshake_timeout, max_pending=max_pending, log=log)

    # ------------------------------------------------------------------ public
    @property
    def subscribers(self) -> int:
        """Subscribed connections currently served."""
        with self._lock:
            return len(self._subs)

    def notify(self, note: Mapping[str, Any]) -> None:
        """Push one "ready" note to every subscriber without blocking (see the module doc; one
        non-blocking ``send`` per subscriber, in the caller's thread).

        ``note`` must carry ``generation``, ``step``, ``nbytes`` and ``crc`` (:func:`ready_note`);
        ``op``, ``channel``, ``run``, ``rank``, ``world`` and ``t`` (``time.time()``) are filled in
        when absent. Call it only once the version is complete in the ring."""
        full = self._complete(note)
        key = (full["generation"], full["step"])
        with self._lock:
            if self._closed:
                return
            for sub in list(self._subs):
                if sub.last is not None and key <= sub.last:
                    continue  # already announced (the catch-up note of a fresh subscriber)
                sub.last = key
                frame = sub.ch.frame(full)  # sealed for this subscriber: its own sequence number and key
                try:
                    rest = sub.try_send(frame)  # the common case: sent right here, no thread handoff
                except OSError as e:
                    self._drop(sub, f"sending failed: {e}")
                    continue
                if rest and not sub.queue(rest):
                    self._drop(sub, f"its queue of {self.max_queue} notifications is full (it stopped reading)")

    def notify_latest(self, **extra: Any) -> dict[str, Any] | None:
        """Notify the ring's newest complete version (read from the ring itself, so the note can
        only name complete data); returns the note, or None when the ring is empty. After a write
        the ring skipped, this names the previous version again, which no subscriber gets twice."""
        latest = self.ring.latest()
        if latest is None:
            return None
        note = self._complete(ready_note(*latest, **extra))
        self.notify(note)
        return note

    def close(self) -> None:
        """Stop accepting, close every connection, join the threads (bounded by ``io_timeout``
        for a thread that is in the middle of a send)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        os.write(self._stop_w, b"\0")
        self._acceptor.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + self.io_timeout
        for t in list(self._threads):
            t.join(max(0.0, deadline - time.monotonic()))
        self._sock.close()
        for fd in (self._stop_r, self._stop_w):
            os.close(fd)

    def __enter__(self) -> "RankServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ notes
    def _complete(self, note: Mapping[str, Any]) -> dict[str, Any]:
        full = {"op": "ready", "channel": self.channel, "run": self.run.id, "rank": self.rank,
                "world": self.world, **note}
        for k in _NOTE_KEYS:
            if not _is_int(full.get(k), -_MAX_INT if k == "step" else 0):
                raise ValueError(f"notification {dict(note)!r}: {k!r} must be an integer (use ready_note())")
        full.setdefault("t", time.time())
        return full

    def _latest_note(self) -> dict[str, Any] | None:
        latest = self.ring.latest()
        if latest is None:
            return None
        version, nbytes, crc = latest
        return self._complete({**ready_note(version, nbytes, crc), "catchup": True})

    def _drop(self, sub: _Subscriber, why: str) -> None:
        """Forget a subscriber (lock held) and shut its socket, which ends its thread."""
        if sub.dropped:
            return
        sub.dropped = True
        if sub in self._subs:
            self._subs.remove(sub)
        if not self._closed:
            log.warning("stream %s rank %d: dropped subscriber %s: %s", self.channel, self.rank, sub.peer, why)
        try:
            sub.conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # ------------------------------------------------------------------ connections
    def _accepted(self, ch: net.Channel) -> None:
        """An authenticated connection from the :class:`~deepfreeze.net.Acceptor`: a thread of its
        own, or closed when ``max_connections`` are served (called in the acceptor's thread)."""
        with self._lock:
            if self._closed or self.connections >= self.max_connections:
                full = not self._closed
                ch.close()
                if full:
                    log.warning("stream %s rank %d: refused a connection: %d connections already served",
                                self.channel, self.rank, self.max_connections)
                return
            self.connections += 1
            self._conns.add(ch.sock)
            self._count += 1
            n = self._count
            self._threads = [t for t in self._threads if t.is_alive()]
            t = threading.Thread(target=self._handle, args=(ch,), daemon=True,
                                 name=f"deepfreeze-stream-r{self.rank}-c{n}")
            self._threads.append(t)
        t.start()

    def _handle(self, conn: net.Channel) -> None:
        peer = "?"
        try:
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            net.keepalive(conn.sock)
            peer = conn.peer()
            deadline = time.monotonic() + self.io_timeout
            hello = dict(net.recv_msg(conn, max_header=MAX_REQUEST_HEADER, max_payload=0, deadline=deadline).header)
            try:
                reply = self._hello(hello)
            except DeepFreezeError as e:
                net.send_msg(conn, net.error_reply(e), deadline=deadline)
                log.warning("stream %s rank %d: client %s refused: %s", self.channel, self.rank, peer, e)
                return
            net.send_msg(conn, reply, deadline=deadline)
            self._serve(conn, peer)
        except AuthenticationError as e:
            log.warning("stream %s rank %d: client %s refused: %s", self.channel, self.rank, peer, e)
        except (DeepFreezeError, OSError) as e:
            if not self._closed and not (isinstance(e, PeerClosedError) and e.between_messages):
                log.warning("stream %s rank %d: connection of %s dropped: %s", self.channel, self.rank, peer, e)
        except Exception:  # a bug: say so, keep the server serving the others
            log.exception("stream %s rank %d: connection of %s failed", self.channel, self.rank, peer)
        finally:
            with self._lock:
                self._conns.discard(conn.sock)
                self.connections -= 1
            conn.close()

    def _hello(self, req: Mapping[str, Any]) -> dict[str, Any]:
        if req.get("op") != "hello":
            raise StreamError("the first request must be 'hello'")
        if req.get("channel") != self.channel:
            raise StreamError(f"this server publishes channel {self.channel!r}, not {req.get('channel')!r:.100}: "
                              "check the endpoint (a stale endpoint file of another channel?)")
        run = req.get("run")
        if run is not None and run != self.run.id:
            raise StreamError(f"this server publishes run {self.run.id!r} of channel {self.channel!r}, not "
                              f"{run!r:.100}: the endpoint is of a newer run; read the endpoints again")
        return {"ok": True, "rank": self.rank, "world": self.world, "run": self.run.id,
                "generation": self.run.generation, "channel": self.channel, "capacity": int(self.ring.capacity),
                "node": self._node, "pid": os.getpid(), "ring": getattr(self.ring, "path", None)}

    def _serve(self, conn: net.Channel, peer: str) -> None:
        """Requests of one connection until it closes (or subscribes: then notes until it closes)."""
        p = _poller(conn.fileno(), self._stop_r)
        while True:
            if self._stop_r in _ready(p, None):
                return
            msg = net.recv_msg(conn, max_header=MAX_REQUEST_HEADER, max_payload=0,
                               deadline=time.monotonic() + self.io_timeout)
            op = msg.header.get("op")
            if op == "subscribe":
                return self._subscribed(conn, peer)
            if op == "get":
                self._get(conn, msg.header, peer)
                continue
            net.send_msg(conn, net.error_reply(StreamError(f"unknown request {op!r:.100}: expected 'get' or "
                                                           "'subscribe'")),
                         deadline=time.monotonic() + self.io_timeout)

    def _get(self, conn: net.Channel, req: Mapping[str, Any], peer: str = "?") -> None:
        g, s = req.get("generation"), req.get("step")
        deadline = time.monotonic() + self.io_timeout
        if (g is None) != (s is None) or (g is not None and (not _is_int(g) or not _is_int(s, -_MAX_INT))):
            net.send_msg(conn, net.error_reply(StreamError(
                "a get names 'generation' and 'step' as integers, or both null for the newest version")),
                deadline=deadline)
            return
        want = None if g is None else Version(g, s)
        rest: Any = None
        try:
            with self.ring.pinned(want) as (version, crc, view):  # a flat byte view of the slot
                header = {"ok": True, "generation": version.generation, "step": version.step,
                          "nbytes": view.nbytes, "crc": int(crc)}
                w, n = conn.begin(header, view.nbytes, deadline=deadline), view.nbytes
                # still pinned: zero copy from the slot, for at most pin_timeout of a peer taking nothing
                sent = w.write(view, deadline=deadline, pause_at=time.monotonic() + self.pin_timeout)
                if sent < view.nbytes:
                    rest = self._stalled_copy(view[sent:], peer)
        except StreamError as e:
            if net.is_transport_error(e):
                raise
            net.send_msg(conn, net.error_reply(e), deadline=deadline)
            return
        try:
            if rest is not None:  # the slot is free again; this reader waits on its own copy
                w.write(rest, deadline=deadline)
            w.finish(deadline=deadline)
        finally:
            if rest is not None:
                with self._lock:
                    self._copies -= 1
        with self._lock:
            self.bytes_sent += n

    def _stalled_copy(self, rest: memoryview, peer: str) -> bytearray:
        """A private copy of what a stalled reader has still to take, so its pin goes (at most
        ``max_stalled`` at once: past that the reader is dropped, :class:`StreamTimeoutError`)."""
        with self._lock:
            if self._copies >= self.max_stalled:
                e = StreamTimeoutError(f"client {peer} took nothing for {self.pin_timeout:g}s while "
                                       f"{self._copies} other stalled readers hold copies: dropped so that its "
                                       "pin does not keep the producer from writing")
                e.transport = True  # in the middle of a frame: the connection is closed
                raise e
            self._copies += 1
            self.stalled_copies += 1
        try:
            return bytearray(rest)
        except BaseException:
            with self._lock:
                self._copies -= 1
            raise

    def _subscribed(self, ch: net.Channel, peer: str) -> None:
        sub = _Subscriber(ch, peer, self.max_queue)
        conn = ch.sock
        sub.send_lock.acquire()  # notify() queues, and does not send, until the answer is out
        held = True
        try:
            with self._lock:
                if self._closed:
                    return
                self._subs.append(sub)  # from now on, every notify reaches it, in order
                sub.queue(ch.frame({"ok": True, "op": "subscribed"}))  # sealed first, so sent first
                first = self._latest_note()
                if first is not None:
                    sub.last = (first["generation"], first["step"])
                    sub.queue(ch.frame(first))
            p = _poller(conn.fileno(), sub.wake_r, self._stop_r)
            while True:
                while True:  # send what is queued (the send lock held: notify() queues behind it)
                    with self._lock:
                        if sub.dropped or not sub.pending:
                            break
                        frame = sub.pending.popleft()
                    self._send_frame(sub, frame)
                sub.send_lock.release()
                held = False
                r = _ready(p, None)
                sub.send_lock.acquire()
                held = True
                if self._stop_r in r or sub.dropped:
                    return
                if conn.fileno() in r:  # a subscriber sends nothing: this is EOF, a reset (or a protocol error)
                    try:
                        data = conn.recv(1)
                    except OSError:
                        return
                    if data:
                        log.warning("stream %s rank %d: subscriber %s sent data on a notification connection: "
                                    "closed", self.channel, self.rank, peer)
                    return
                if sub.wake_r in r:
                    try:
                        os.read(sub.wake_r, 4096)
                    except BlockingIOError:
                        pass
        except (DeepFreezeError, OSError) as e:
            with self._lock:
                self._drop(sub, f"sending failed: {e}")
        finally:
            with self._lock:
                sub.dropped = True
                if sub in self._subs:
                    self._subs.remove(sub)
            if held:
                sub.send_lock.release()
            sub.close_pipe()

    def _send_frame(self, sub: _Subscriber, frame: bytes) -> None:
        try:
            sub.conn.settimeout(self.io_timeout)
            sub.conn.sendall(frame)
        except (socket.timeout, TimeoutError) as e:
            raise StreamTimeoutError(f"subscriber {sub.peer} took no notification for {self.io_timeout:g}s") from e


class RankClient:
    """A consumer's connection to one producer rank's :class:`RankServer`.

    ``address``: ``"host:port"``; ``token``: the shared secret (:func:`deepfreeze.net.load_token`);
    ``channel`` (and optionally ``run``) must match the server's, else :class:`StreamError`.
    ``timeout`` bounds connecting and every request. With ``subscribe=True`` this connection
    receives notifications (:meth:`next_note`, :meth:`fileno` for ``poll``) and :meth:`fetch`
    uses a second connection, opened on first use.

    Errors: a wrong token: :class:`~deepfreeze.errors.AuthenticationError`; a server that does not
    answer in time: :class:`StreamTimeoutError`; one that closed, refused or sent something out of
    bounds: :class:`StreamError`; a version it no longer holds: :class:`VersionGoneError`."""

    def __init__(self, address: str, token: str, *, channel: str, timeout: float = 30.0, subscribe: bool = False,
                 run: str | None = None) -> None:
        if not timeout > 0:
            raise ConfigError(f"timeout {timeout!r}: must be positive")
        self.address, self.token, self.channel, self.run_id = address, token, channel, run
        self.timeout = float(timeout)
        self.subscribed = subscribe
        self.hello: dict[str, Any] = {}
        self.sock: net.Channel = self._open()
        self._data: net.Channel | None = None if subscribe else self.sock
        if subscribe:
            try:
                deadline = time.monotonic() + self.timeout
                net.send_msg(self.sock, {"op": "subscribe"}, deadline=deadline)
                reply = net.recv_msg(self.sock, max_header=MAX_REPLY_HEADER, max_payload=0, deadline=deadline)
                net.raise_for_reply(reply.header, f"stream server {address}: ")
            except ProviderError as e:
                self.sock.close()
                raise _stream_error(e, f"subscribing to {address}") from e
            except BaseException:
                self.sock.close()
                raise

    @property
    def capacity(self) -> int:
        """The largest shard the server can send (its ring's slot capacity)."""
        return self.hello["capacity"]

    def _open(self) -> net.Channel:
        try:
            sock = net.connect(self.address, self.timeout)
        except ProviderError as e:
            raise _stream_error(e, f"stream server {self.address} of channel {self.channel!r}") from e
        try:
            net.keepalive(sock)
            hello = {"op": "hello", "channel": self.channel}
            if self.run_id is not None:
                hello["run"] = self.run_id
            ch, reply = net.client_handshake(sock, self.token, hello, deadline=time.monotonic() + self.timeout,
                                             max_header=MAX_REPLY_HEADER)
            self._check_hello(reply)
        except ProviderError as e:
            sock.close()
            raise _stream_error(e, f"hello to stream server {self.address}") from e
        except BaseException:
            sock.close()
            raise
        if self.hello and (reply["run"], reply["rank"]) != (self.hello["run"], self.hello["rank"]):
            sock.close()
            raise StreamError(f"stream server {self.address} is now rank {reply['rank']} of run {reply['run']!r}, "
                              f"not rank {self.hello['rank']} of run {self.hello['run']!r}: read the endpoints again")
        self.hello = reply
        return ch

    def _check_hello(self, reply: Mapping[str, Any]) -> None:
        world = reply.get("world")
        ok = (_is_int(world, 1, 1 << 24) and _is_int(reply.get("rank"), 0, world)
              and _is_int(reply.get("capacity"), 0, _MAX_CAPACITY) and _is_int(reply.get("generation"))
              and isinstance(reply.get("run"), str) and reply.get("channel") == self.channel)
        if not ok:
            raise StreamError(f"stream server {self.address} answered a hello without a valid rank, world, "
                              f"capacity, run or generation, or for another channel: {dict(reply)!r:.300}")

    def fileno(self) -> int:
        """The notification socket's descriptor (readable when a note or EOF is there)."""
        return self.sock.fileno()

    def next_note(self, timeout: float | None) -> dict[str, Any] | None:
        """The next notification of a subscribed client; ``None`` when none came within
        ``timeout`` seconds (``None``: wait as long as it takes; TCP keepalive detects a dead
        machine). Blocks in ``poll`` (push: no polling loop). The server closed or a malformed
        note: :class:`StreamError`."""
        if not self.subscribed:
            raise StreamError("next_note() needs a RankClient made with subscribe=True")
        if not _ready(_poller(self.sock.fileno()), timeout):
            return None
        try:
            msg = net.recv_msg(self.sock, max_header=MAX_REPLY_HEADER, max_payload=0,
                               deadline=time.monotonic() + self.timeout)
        except ProviderError as e:
            raise _stream_error(e, f"notifications of stream server {self.address}") from e
        note = msg.header
        if note.get("ok") is False:
            net.raise_for_reply(note, f"stream server {self.address}: ")
        if note.get("op") != "ready" or not all(_is_int(note.get(k), -_MAX_INT if k == "step" else 0)
                                               for k in _NOTE_KEYS):
            raise StreamError(f"stream server {self.address} sent a malformed notification: {note!r:.300}")
        if note["nbytes"] > self.capacity:
            raise StreamError(f"stream server {self.address} announced {note['nbytes']} bytes, over its capacity "
                              f"of {self.capacity}")
        return note

    def fetch(self, version: Version | None, out: Any, *, verify: bool = True) -> tuple[Version, int, int]:
        """Receive ``version`` (``None``: the newest the server holds) straight into ``out`` (a
        writable C-contiguous buffer: numpy array, bytearray, memoryview) and return
        ``(version, nbytes, crc)``; the bytes are ``out[:nbytes]`` (as bytes). The CRC32 is
        checked against the server's (``verify``). A payload larger than ``out`` or than the
        announced capacity is refused before anything is read (:class:`StreamError`)."""
        mv = memoryview(out)
        if not mv.c_contiguous or mv.readonly:
            raise ValueError("fetch() needs a writable C-contiguous buffer")
        mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
        if self._data is None:  # the first fetch of a subscribed client, or after a failed one
            self._data = self._open()
            if not self.subscribed:
                self.sock = self._data
        sock = self._data
        req = {"op": "get", "generation": None if version is None else version.generation,
               "step": None if version is None else version.step}
        deadline = time.monotonic() + self.timeout
        try:
            net.send_msg(sock, req, deadline=deadline)
            msg = net.recv_msg(sock, max_header=MAX_REPLY_HEADER, max_payload=self.capacity, deadline=deadline)
            rep = msg.header
            if rep.get("ok") is not True:
                if msg.payload_bytes:
                    raise StreamError(f"stream server {self.address} sent an error with a payload")
                net.raise_for_reply(rep, f"stream server {self.address}: ")
            n = rep.get("nbytes")
            if not (_is_int(n) and n == msg.payload_bytes and _is_int(rep.get("crc"), 0, 1 << 32)
                    and _is_int(rep.get("generation")) and _is_int(rep.get("step"), -_MAX_INT)):
                raise StreamError(f"stream server {self.address} answered a get with a malformed header "
                                  f"(payload {msg.payload_bytes} bytes): {rep!r:.300}")
            got = Version(rep["generation"], rep["step"])
            if version is not None and got != version:
                raise StreamError(f"stream server {self.address} sent version {got} for a request of {version}")
            if n > mv.nbytes:
                raise StreamError(f"stream server {self.address} sends {n} bytes of {got}, more than the "
                                  f"{mv.nbytes} bytes of the buffer given to fetch(): pass a buffer of at least "
                                  f"the ring capacity ({self.capacity} bytes)")
            msg.recv_into(mv[:n])
        except ProviderError as e:
            self._drop_data()
            raise _stream_error(e, f"fetching from stream server {self.address}") from e
        except StreamError as e:
            if not isinstance(e, VersionGoneError) or net.is_transport_error(e):
                self._drop_data()  # the connection may be out of step: a fresh one next time
            raise
        crc = crc32(mv[:n])
        if verify and crc != rep["crc"]:
            raise StreamError(f"{got} from stream server {self.address}: CRC32 {crc:#010x} of the received "
                              f"bytes, {rep['crc']:#010x} announced (corrupted in transit or in the slot)")
        return got, n, crc

    def _drop_data(self) -> None:
        if self._data is not None:
            self._data.close()
            self._data = None

    def close(self) -> None:
        """Close the connection(s)."""
        if self._data is not None and self._data is not self.sock:
            self._data.close()
        self._data = None
        self.sock.close()

    def __enter__(self) -> "RankClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
