"""A repository provider: one process serving one repository directory over TCP.

``deepfreeze repo serve --dir DIR --listen HOST:PORT`` (or ``python -m deepfreeze.repo.provider``)
runs :func:`serve`: an :class:`~deepfreeze.repo.store.EmbeddedRepository` on ``DIR`` underneath, a
thread per authenticated connection, a staging :class:`~deepfreeze.repo.arena.Arena` in ``/dev/shm`` for
clients on the same node. It listens on loopback unless ``--allow-remote``; every connection
runs the :mod:`deepfreeze.net` handshake first (both ends prove they know the token, which
never goes on the wire; a provider that cannot prove it is refused by the client before the
client sends anything), and every frame after it is sealed (MACs under the session key over
direction, sequence number, header and payload: a changed, replayed or reordered frame closes
the connection). Connections still in the handshake wait in one thread
(:class:`deepfreeze.net.Acceptor`: at most ``MAX_PENDING``, the oldest closed when another
arrives, each for at most ``HANDSHAKE_TIMEOUT`` seconds); only authenticated ones get a thread.
SIGTERM or SIGINT stops it cleanly (the arena file is unlinked); a provider killed outright
leaves nothing half-stored (the store commits atomically) and only its arena file in
``/dev/shm`` (named with its pid).

Protocol (frames of :mod:`deepfreeze.net`: a JSON header plus a raw payload; every answer has
``"ok"``; an error answer is ``{"ok": false, "type": <deepfreeze.errors class>, "error": ...}``
and leaves the connection usable, except for a frame that cannot be read (bad magic, oversize
header or payload, a failed MAC, a dead peer): then the provider closes the connection.)::

    hello   {providers: ["h:p", ...], index: i, node: <boot id>, uid: n}
            -> {pid, providers, arena: {path, size, max_extent} | null}
        The first sealed frame, after the handshake. The provider records the client's provider list once
        (set_setting_once('providers')) and refuses a client with another list (RepositoryError).
        ``index`` is this provider's position in it (puts of names placed elsewhere are refused).
        ``arena`` is offered to a client of the same node (same boot id) and user.
    alloc   {nbytes, timeout}           -> {offset, length}   one arena extent for this connection
                                                              (waits up to timeout, at most the
                                                              provider's io timeout, while full)
    release {}                          -> {}                 gives the extent back
    put     {name, staging, tensors: [[key, dtype, shape, offset, length], ...], graph, meta, path?}
            -> {result: {bytes, written, deduplicated}}
        staging "arena": the tensors are in this connection's extent (offsets absolute in the
        arena, inside the extent); the extent is released by the put, whatever its outcome.
        staging "tcp": the payload carries the tensors back to back (offsets relative to it,
        contiguous, the payload length equal to their sum); the provider receives them into an
        arena extent when one is free right now (TCP never waits for the arena), else into one buffer.
        staging "file": the tensors are in the client's on-demand file ``path`` (DStore-OnDemand).
        A put bigger than the arena's largest extent is sent over "tcp" by the client (the store
        commits a model in one pack file and one transaction, so it needs all of it at once).
    get     {name, tensors: [key, ...] | null, staging, verify, path?}
            -> {tensors: [[key, dtype, shape, offset, length], ...], bytes_read}
        "arena": read into a new extent of this connection (answer's offsets absolute); the
        client copies out and sends ``release``. "tcp": the tensors follow in the payload, back
        to back. "file": read into the client's on-demand file. A get bigger than the largest
        extent is refused: the client splits it into several gets (one tensor bigger than that
        goes over "tcp"). ``bytes_read``: tensor bytes read for this connection so far.
    specs   {name}        -> {specs: {key: [dtype, shape]}}
    graph   {name}        -> {graph: {...} | null}
    layer_meta {ids}      -> {meta: {id: {...}}}
    list    {}            -> {models: {model: [names]}}
    info    {name | null} -> {info: {...}}
    delete  {name}        -> {}
    gc      {}            -> {result: {...}}

Every name is checked by :func:`deepfreeze.repo.names.parse_name`, every key, dtype (the
DeepFreeze format's dtypes), shape (at most 32 dimensions, sizes consistent with the length),
offset (inside this connection's extent, the payload or the file) before anything is read or
allocated. Every wait is bounded: the handshake and the hello (5 s each), each request once its first byte
arrived (``io_timeout``), the arena (``io_timeout``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Mapping

import numpy as np

from .. import net
from ..errors import (AuthenticationError, ConfigError, CorruptCheckpointError, DeepFreezeError, ModelNotFoundError,
                      PeerClosedError, ProviderError, ProviderTimeoutError, RepositoryError)
from ..jsonsafe import loads as bounded_loads
from ..format import MAX_NDIM, dtype_itemsize, numpy_dtype
from ..node import node_id
from .arena import DEFAULT_ARENA_BYTES, Arena, Extent, close_mapping, open_shared
from .graph import ID_HEX_RE
from .names import check_name

__all__ = ["serve", "main", "placement", "DEFAULT_IO_TIMEOUT", "MAX_HEADER", "MAX_TENSORS",
           "MAX_REQUEST_BYTES", "HANDSHAKE_TIMEOUT", "MAX_PENDING", "MAX_KEY", "MAX_CONNECTIONS", "Provider"]

log = logging.getLogger("deepfreeze.repo.provider")

#: seconds a request may take to arrive and to be answered once its first byte came (and the
#: longest wait for arena space)
DEFAULT_IO_TIMEOUT = 60.0
#: seconds a new connection has to complete the handshake (and then to send its hello)
HANDSHAKE_TIMEOUT = 5.0
#: connections waiting in the handshake at once (:class:`deepfreeze.net.Acceptor`); one more
#: closes the oldest
MAX_PENDING = 64
#: largest request header (the graph and layer metadata of a big model travel in it)
MAX_HEADER = 64 << 20
#: most tensors in one request
MAX_TENSORS = 1 << 20
#: longest tensor key (the store's limit)
MAX_KEY = 4096
#: most authenticated connections served at once (more are closed at once)
MAX_CONNECTIONS = 1024
#: largest hello (the first sealed frame)
_MAX_HELLO = 256 << 10
#: default largest payload of one request (a put over TCP; the provider holds it in memory)
MAX_REQUEST_BYTES = 64 << 30
#: a failed request with more payload left than this closes the connection instead of reading it
_DISCARD_LIMIT = 64 << 20
_ALIGN = 64
_MAX_DIM = 1 << 48


def placement(name: str, n: int) -> int:
    """The index of the provider (of ``n``) that holds model ``name``."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") % n


def _bad(why: str) -> RepositoryError:
    return RepositoryError(f"malformed request: {why}")


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _check_segments(raw: Any, *, check_key: bool = True) -> list[tuple[str, np.dtype, tuple[int, ...], int, int]]:
    """``[(key, dtype, shape, offset, length)]`` of a request's tensor list, every field checked."""
    if not isinstance(raw, list) or len(raw) > MAX_TENSORS:
        raise _bad(f"'tensors' must be a list of at most {MAX_TENSORS} entries")
    out, seen = [], set()
    for i, seg in enumerate(raw):
        if not isinstance(seg, list) or len(seg) != 5:
            raise _bad(f"tensor {i}: expected [key, dtype, shape, offset, length]")
        key, dt, shape, off, length = seg
        _check_key(key)
        if key in seen:
            raise _bad(f"tensor key {key!r} appears twice")
        seen.add(key)
        if not isinstance(dt, str):
            raise _bad(f"tensor {key!r}: dtype must be a string")
        try:
            dtype = numpy_dtype(dt)
        except CorruptCheckpointError as e:
            raise _bad(f"tensor {key!r}: {e}") from e
        if (not isinstance(shape, list) or len(shape) > MAX_NDIM
                or not all(type(d) is int and 0 <= d < _MAX_DIM for d in shape)):
            raise _bad(f"tensor {key!r}: shape must be a list of at most {MAX_NDIM} sizes in [0, 2**48)")
        if type(off) is not int or type(length) is not int or off < 0 or length < 0:
            raise _bad(f"tensor {key!r}: offset and length must be non-negative integers")
        if math.prod(shape) * dtype_itemsize(dt) != length:
            raise _bad(f"tensor {key!r}: length {length} is not shape {shape} x {dt}")
        out.append((key, dtype, tuple(shape), off, length))
    return out


def _check_key(key: Any) -> str:
    if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY or "\0" in key:
        raise _bad(f"tensor key {key!r:.80}: expected a string of 1..{MAX_KEY} characters without NUL")
    return key


def _views(buf: np.ndarray, base: int, segs: list) -> dict[str, np.ndarray]:
    """Arrays over ``buf`` (uint8) for segments whose offsets are relative to ``base``."""
    return {key: buf[off - base:off - base + length].view(dtype).reshape(shape)
            for key, dtype, shape, off, length in segs}


def _layout(specs: Mapping[str, Any], keys: list[str], align: int) -> tuple[list[list], int]:
    segs, pos = [], 0
    for k in keys:
        dt, shape = specs[k]
        length = math.prod(shape) * dtype_itemsize(dt)
        pos = -(-pos // align) * align
        segs.append([k, dt, list(shape), pos, length])
        pos += length
    return segs, pos


class _Conn:
    def __init__(self) -> None:
        self.extent: Extent | None = None
        self.arena_ok = False
        self.index: int | None = None
        self.n: int | None = None
        self.bytes_read = 0
        self.after_send: Callable[[], None] | None = None


class Provider:
    """The request handler of :func:`serve` (one instance per provider process)."""

    def __init__(self, repository: Any, arena: Arena | None, token: str, *, io_timeout: float = DEFAULT_IO_TIMEOUT,
                 max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
        self.repo, self.arena, self.token = repository, arena, token
        self.io_timeout, self.max_request_bytes = io_timeout, max_request_bytes
        self.node, self.uid = node_id(), os.getuid()
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self.connections = 0

    # ------------------------------------------------------------------ connection loop
    def handle(self, conn: net.Channel) -> None:
        """Serve one authenticated connection (from :class:`deepfreeze.net.Acceptor`) until the
        client closes it, misbehaves or the provider stops."""
        peer = "?"
        st = _Conn()
        with self._lock:
            self.connections += 1
        try:
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            net.keepalive(conn.sock)  # a client whose machine died is dropped, not waited for forever
            peer = conn.peer()
            hello = dict(net.recv_msg(conn, max_header=_MAX_HELLO, max_payload=0,
                                      deadline=time.monotonic() + HANDSHAKE_TIMEOUT).header)
            try:
                reply = self._hello(st, hello)
            except DeepFreezeError as e:
                net.send_msg(conn, net.error_reply(e), deadline=time.monotonic() + HANDSHAKE_TIMEOUT)
                log.warning("client %s refused: %s", peer, e)
                return
            net.send_msg(conn, reply, deadline=time.monotonic() + HANDSHAKE_TIMEOUT)
            while True:
                while not net.wait_readable(conn, 0.5):
                    if self.stop.is_set():
                        return
                try:
                    msg = net.recv_msg(conn, max_header=MAX_HEADER, max_payload=self.max_request_bytes,
                                       deadline=time.monotonic() + self.io_timeout)
                except ProviderError as e:  # tell the client why (if it still listens), then close
                    if not isinstance(e, (TimeoutError, PeerClosedError)):
                        try:
                            net.send_msg(conn, net.error_reply(RepositoryError(f"request refused: {e}")),
                                         deadline=time.monotonic() + 1.0)
                        except DeepFreezeError:
                            pass
                    raise
                payload: list = []
                try:
                    reply, payload = self._dispatch(st, msg)
                except DeepFreezeError as e:
                    if net.is_transport_error(e):
                        raise  # the connection failed: close it
                    reply, payload = net.error_reply(e), []
                except Exception as e:  # a bug or an unexpected failure: report it, keep serving
                    log.exception("request %r of %s failed", msg.header.get("op"), peer)
                    reply, payload = net.error_reply(ProviderError(
                        f"internal error of the provider: {type(e).__name__}: {e} (see its log)")), []
                if msg.remaining > _DISCARD_LIMIT:  # not worth reading: answer, then close
                    net.send_msg(conn, reply, deadline=time.monotonic() + 1.0)
                    return
                msg.discard()  # whatever a failed request left of its payload
                try:
                    net.send_msg(conn, reply, payload, deadline=time.monotonic() + self.io_timeout)
                finally:
                    payload = []
                    self._after_send(st)
        except AuthenticationError as e:
            log.warning("client %s refused: %s", peer, e)
        except (ProviderError, OSError) as e:
            if not (isinstance(e, PeerClosedError) and e.between_messages):  # not a plain close between requests
                log.warning("connection of %s dropped: %s", peer, e)
        finally:
            self._after_send(st)
            if st.extent is not None and self.arena is not None:
                self.arena.free(st.extent)
                st.extent = None
            conn.close()
            with self._lock:
                self.connections -= 1

    @staticmethod
    def _after_send(st: _Conn) -> None:
        fn, st.after_send = st.after_send, None
        if fn is not None:
            fn()

    def _hello(self, st: _Conn, req: Mapping[str, Any]) -> dict[str, Any]:
        if req.get("op") != "hello":
            raise _bad("the first request must be 'hello'")
        providers = req.get("providers")
        if not isinstance(providers, list) or not 0 < len(providers) <= 1024 or not all(
                isinstance(p, str) and len(p) <= 300 for p in providers):
            raise _bad("'providers' must be the list of 'host:port' addresses of the repository")
        for p in providers:
            try:
                net.parse_address(p)
            except ConfigError as e:
                raise _bad(str(e)) from e
        index = req.get("index")
        if type(index) is not int or not 0 <= index < len(providers):
            raise _bad("'index' must be this provider's position in 'providers'")
        recorded = self.repo.set_setting_once("providers", json.dumps(providers))
        if recorded is not None and bounded_loads(recorded, "the providers setting", max_bytes=1 << 20) != providers:
            raise RepositoryError(
                f"this repository's provider list is {recorded} (fixed when it was first used: it "
                f"decides which provider holds which model); the client gave {providers}. Use the same "
                "dstore://host:port,... address, in the same order, on every client")
        st.index, st.n = index, len(providers)
        st.arena_ok = (self.arena is not None and req.get("node") == self.node and req.get("uid") == self.uid)
        arena = ({"path": self.arena.path, "size": self.arena.size, "max_extent": self.arena.max_extent}
                 if st.arena_ok else None)
        return {"ok": True, "pid": os.getpid(), "providers": providers, "arena": arena}

    # ------------------------------------------------------------------ requests
    def _dispatch(self, st: _Conn, msg: net.Message) -> tuple[dict[str, Any], list]:
        req = msg.header
        op = req.get("op")
        if op not in ("put",) and msg.payload_bytes:
            raise _bad(f"request {op!r} takes no payload")
        if op == "put":
            return {"ok": True, "result": _jsonable(self._put(st, msg))}, []
        if op == "get":
            return self._get(st, req)
        if op == "alloc":
            return self._alloc(st, req), []
        if op == "release":
            self._release(st)
            return {"ok": True}, []
        if op == "specs":
            specs = self.repo.specs(check_name(req.get("name")))
            return {"ok": True, "specs": {k: [dt, list(shape)] for k, (dt, shape) in specs.items()}}, []
        if op == "graph":
            return {"ok": True, "graph": self.repo.graph(check_name(req.get("name")))}, []
        if op == "layer_meta":
            ids = req.get("ids")
            if not isinstance(ids, list) or len(ids) > MAX_TENSORS or not all(
                    isinstance(i, str) and ID_HEX_RE.fullmatch(i) for i in ids):
                raise _bad("'ids' must be a list of layer ids (32 hex digits)")
            return {"ok": True, "meta": _jsonable(self.repo.layer_meta(ids))}, []
        if op == "list":
            return {"ok": True, "models": _jsonable(self.repo.list())}, []
        if op == "info":
            name = req.get("name")
            return {"ok": True, "info": _jsonable(self.repo.info(None if name is None else check_name(name)))}, []
        if op == "delete":
            return {"ok": True, "result": _jsonable(self.repo.delete(check_name(req.get("name"))))}, []
        if op == "gc":
            return {"ok": True, "result": _jsonable(self.repo.gc())}, []
        raise _bad(f"unknown request {op!r:.60}")

    def _timeout(self, req: Mapping[str, Any]) -> float:
        t = req.get("timeout", self.io_timeout)
        if not isinstance(t, (int, float)) or not t >= 0:
            raise _bad("'timeout' must be a non-negative number of seconds")
        return min(float(t), self.io_timeout)

    def _alloc(self, st: _Conn, req: Mapping[str, Any]) -> dict[str, Any]:
        if not st.arena_ok or self.arena is None:
            raise RepositoryError("no staging arena for this client (another node or user): use staging='tcp'")
        if st.extent is not None:
            raise RepositoryError("this connection holds a staging extent already: release it first")
        nbytes = req.get("nbytes")
        if type(nbytes) is not int or not 0 <= nbytes <= self.arena.max_extent:
            raise _bad(f"'nbytes' must be an integer in [0, {self.arena.max_extent}] (split bigger requests)")
        st.extent = self.arena.alloc(nbytes, self._timeout(req))
        return {"ok": True, "offset": st.extent.offset, "length": st.extent.length}

    def _release(self, st: _Conn) -> None:
        if st.extent is None:
            raise RepositoryError("this connection holds no staging extent")
        assert self.arena is not None
        ext, st.extent = st.extent, None
        self.arena.free(ext)

    def _check_placement(self, st: _Conn, name: str) -> None:
        if st.n is not None and placement(name, st.n) != st.index:
            raise RepositoryError(f"model {name!r} belongs to provider {placement(name, st.n)} of {st.n}, not to "
                                  f"this one ({st.index}): the client's placement is wrong")

    def _put(self, st: _Conn, msg: net.Message) -> Any:
        req = msg.header
        staging = req.get("staging")
        try:
            name = check_name(req.get("name"))
            self._check_placement(st, name)
            segs = _check_segments(req.get("tensors"))
            graph, meta = req.get("graph"), req.get("meta")
            if graph is not None and not isinstance(graph, dict) or meta is not None and not isinstance(meta, dict):
                raise _bad("'graph' and 'meta' must be objects or null")
            if staging == "arena":
                if msg.payload_bytes:
                    raise _bad("a put through the arena takes no payload")
                if st.extent is None or self.arena is None:
                    raise RepositoryError("a put through the arena needs a staging extent: send 'alloc' first")
                ext = st.extent
                for key, _dt, _shape, off, length in segs:
                    if not (ext.offset <= off and off + length <= ext.offset + ext.length):
                        raise _bad(f"tensor {key!r}: bytes [{off}, {off + length}) are outside this connection's "
                                   f"staging extent [{ext.offset}, {ext.offset + ext.length})")
                tensors = _views(self.arena.buffer, 0, segs)
                return self.repo.put(name, tensors, graph=graph, meta=meta)
            if staging == "tcp":
                pos = 0
                for key, _dt, _shape, off, length in segs:
                    if off != pos:
                        raise _bad(f"tensor {key!r}: offset {off} in the payload, expected {pos} (back to back)")
                    pos += length
                if pos != msg.payload_bytes:
                    raise _bad(f"the payload has {msg.payload_bytes} bytes, the tensors {pos}")
                return self._put_tcp(name, msg, segs, graph, meta)
            if staging == "file":
                end = max((off + length for _k, _d, _s, off, length in segs), default=0)
                mm = open_shared(req.get("path"), max(end, 1), kind="od")
                try:
                    buf = np.frombuffer(mm, dtype=np.uint8)
                    try:
                        return self.repo.put(name, _views(buf, 0, segs), graph=graph, meta=meta)
                    finally:
                        del buf
                finally:
                    close_mapping(mm)
            raise _bad(f"staging {staging!r:.40}: expected 'arena', 'tcp' or 'file'")
        finally:
            if staging == "arena" and st.extent is not None:
                self._release(st)

    def _try_alloc(self, total: int) -> Extent | None:
        """An arena extent for a TCP transfer when one is free right now (else None: a fresh buffer;
        TCP transfers never wait for the arena)."""
        if self.arena is None or total > self.arena.max_extent:
            return None
        try:
            return self.arena.alloc(total, 0.0)
        except ProviderTimeoutError:
            return None

    def _put_tcp(self, name: str, msg: net.Message, segs: list, graph: Any, meta: Any) -> Any:
        total = msg.payload_bytes
        ext = self._try_alloc(total)
        try:
            buf = self.arena.view(ext.offset, total) if ext is not None else np.empty(total, np.uint8)
            msg.recv_into(buf)
            tensors = _views(buf, 0, segs)
            return self.repo.put(name, tensors, graph=graph, meta=meta)
        finally:
            tensors = buf = None  # type: ignore[assignment]
            if ext is not None:
                self.arena.free(ext)  # type: ignore[union-attr]

    def _get(self, st: _Conn, req: Mapping[str, Any]) -> tuple[dict[str, Any], list]:
        name = check_name(req.get("name"))
        specs = self.repo.specs(name)
        keys = req.get("tensors")
        if keys is None:
            keys = list(specs)
        elif not isinstance(keys, list) or len(keys) > MAX_TENSORS:
            raise _bad(f"'tensors' must be null or a list of at most {MAX_TENSORS} keys")
        seen = set()
        for k in keys:
            _check_key(k)
            if k not in specs:
                raise ModelNotFoundError(f"model {name!r} has no tensor {k!r}")
            if k in seen:
                raise _bad(f"tensor key {k!r} requested twice")
            seen.add(k)
        verify = req.get("verify")
        if verify is not None and not isinstance(verify, bool):
            raise _bad("'verify' must be true, false or null")
        staging = req.get("staging")
        segs, total = _layout(specs, keys, _ALIGN if staging != "tcp" else 1)
        checked = _check_segments(segs)
        if staging == "arena":
            if not st.arena_ok or self.arena is None:
                raise RepositoryError("no staging arena for this client (another node or user): use staging='tcp'")
            if st.extent is not None:
                raise RepositoryError("this connection holds a staging extent already: release it first")
            if total > self.arena.max_extent:
                raise RepositoryError(f"a get of {total} bytes is bigger than the arena's largest extent "
                                      f"({self.arena.max_extent}): split it into several gets")
            ext = self.arena.alloc(total, self._timeout(req))
            try:
                out = _views(self.arena.view(ext.offset, total), 0, checked)
                self.repo.get(name, keys, out=out, verify=verify)
            except BaseException:
                self.arena.free(ext)
                raise
            st.extent = ext
            for s in segs:
                s[3] += ext.offset
            st.bytes_read += sum(seg[4] for seg in segs)
            return {"ok": True, "tensors": segs, "bytes_read": st.bytes_read,
                    "extent": [ext.offset, ext.length]}, []
        if staging == "tcp":
            if total > self.max_request_bytes:
                raise RepositoryError(f"a get of {total} bytes is over this provider's limit of "
                                      f"{self.max_request_bytes}: split it")
            ext = self._try_alloc(total)
            try:
                buf = self.arena.view(ext.offset, total) if ext is not None else np.empty(total, np.uint8)
                self.repo.get(name, keys, out=_views(buf, 0, checked), verify=verify)
                st.bytes_read += sum(seg[4] for seg in segs)
                reply = {"ok": True, "tensors": segs, "bytes_read": st.bytes_read}
                if ext is not None:  # the extent stays allocated until the answer is sent
                    arena = self.arena
                    st.after_send = lambda: arena.free(ext)  # type: ignore[union-attr]
                return reply, [buf]
            except BaseException:
                if ext is not None:
                    self.arena.free(ext)  # type: ignore[union-attr]
                raise
        if staging == "file":
            mm = open_shared(req.get("path"), max(total, 1), kind="od")
            try:
                buf = np.frombuffer(mm, dtype=np.uint8)
                try:
                    self.repo.get(name, keys, out=_views(buf, 0, checked), verify=verify)
                finally:
                    del buf
            finally:
                close_mapping(mm)
            st.bytes_read += sum(seg[4] for seg in segs)
            return {"ok": True, "tensors": segs, "bytes_read": st.bytes_read}, []
        raise _bad(f"staging {staging!r:.40}: expected 'arena', 'tcp' or 'file'")


def serve(directory: str, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None,
          token_file: str | None = None, arena_bytes: int = DEFAULT_ARENA_BYTES, allow_remote: bool = False,
          ready: Callable[[str], None] | None = None, io_timeout: float = DEFAULT_IO_TIMEOUT,
          max_request_bytes: int = MAX_REQUEST_BYTES, repository: Any = None,
          stop: threading.Event | None = None, fsync: bool = False,
          handshake_timeout: float = HANDSHAKE_TIMEOUT) -> None:
    """Serve the repository in ``directory`` on ``host:port`` until ``stop`` is set (``main``: SIGTERM).

    ``token``: the shared secret (default :func:`deepfreeze.net.load_token` of ``token_file``).
    ``arena_bytes``: the staging arena (0: none; same-node clients then use TCP). ``ready`` is
    called with the bound ``"host:port"`` once the provider accepts connections. ``repository``:
    an open repository object to serve instead of opening ``directory`` (tests slow it down by
    subclassing). ``fsync``: the store's durability option (EmbeddedRepository(fsync=...)).
    ``handshake_timeout``: seconds a new connection has to authenticate (at most
    ``MAX_PENDING`` wait at once, in one thread: :class:`deepfreeze.net.Acceptor`). The arena
    file is unlinked and the repository closed on return."""
    token = token if token is not None else net.load_token(token_file)
    sock = net.listen(host, port, allow_remote=allow_remote)
    repo = arena = None
    stop = stop if stop is not None else threading.Event()
    threads: list[threading.Thread] = []
    try:
        if repository is None:
            from .store import EmbeddedRepository
            repo = EmbeddedRepository(directory, fsync=fsync)
        else:
            repo = repository
        arena = Arena(arena_bytes) if arena_bytes else None
        prov = Provider(repo, arena, token, io_timeout=io_timeout, max_request_bytes=max_request_bytes)
        prov.stop = stop
        addr = net.format_address(*sock.getsockname()[:2])
        log.info("provider %d serving %s on %s (arena %s)", os.getpid(), directory, addr,
                 arena.path if arena else "none")
        threads_lock = threading.Lock()

        def accepted(ch: net.Channel) -> None:  # in the acceptor's thread: never blocks
            nonlocal threads
            with threads_lock:
                threads = [t for t in threads if t.is_alive()]
                if stop.is_set() or len(threads) >= MAX_CONNECTIONS:
                    if not stop.is_set():
                        log.warning("refusing a connection: %d connections open already", len(threads))
                    ch.close()
                    return
                t = threading.Thread(target=prov.handle, args=(ch,), name="deepfreeze-provider-conn", daemon=True)
                t.start()
                threads.append(t)

        acceptor = net.Acceptor(sock, token, accepted, name="deepfreeze-provider-accept",
                                handshake_timeout=handshake_timeout, max_pending=MAX_PENDING, log=log)
        try:
            if ready is not None:
                ready(addr)
            while not stop.wait(0.5):
                pass
        finally:
            acceptor.close()
    finally:
        sock.close()
        stop.set()
        deadline = time.monotonic() + 5.0
        for t in list(threads):  # each notices the stop within 0.5 s unless a request is running
            t.join(max(0.0, deadline - time.monotonic()))
        if arena is not None:
            arena.close()
        if repo is not None and repository is None:
            repo.close()
        log.info("provider %d stopped", os.getpid())


def main(argv: list[str] | None = None) -> int:
    """``python -m deepfreeze.repo.provider --dir DIR [--listen HOST:PORT]``: prints
    ``listening on HOST:PORT`` on stdout once it accepts connections; SIGTERM/SIGINT stop it."""
    ap = argparse.ArgumentParser(prog="deepfreeze repo serve", description="Serve a DeepFreeze model repository.")
    ap.add_argument("--dir", required=True, help="the repository directory (created if missing)")
    ap.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (default 127.0.0.1:0: any port)")
    ap.add_argument("--allow-remote", action="store_true", help="allow a non-loopback address (token still required)")
    ap.add_argument("--token-file", default=None, help=f"token file (default ${net.TOKEN_ENV}, the token text "
                    f"itself, else the file ${net.TOKEN_FILE_ENV} names, else {net.DEFAULT_TOKEN_PATH})")
    ap.add_argument("--arena-bytes", "--arena-size", dest="arena_bytes", type=int, default=DEFAULT_ARENA_BYTES,
                    help=f"staging arena size in bytes (default {DEFAULT_ARENA_BYTES}; 0: none)")
    ap.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                    help=f"largest put over TCP in bytes (default {MAX_REQUEST_BYTES})")
    ap.add_argument("--fsync", action="store_true",
                    help="make every store durable against power loss (fsync; slower)")
    ap.add_argument("--io-timeout", type=float, default=DEFAULT_IO_TIMEOUT,
                    help=f"seconds per request and for arena space (default {DEFAULT_IO_TIMEOUT:g})")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s provider[%(process)d] %(levelname)s %(message)s")
    try:
        host, port = net.parse_address(args.listen)
    except ConfigError as e:
        print(f"deepfreeze repo serve: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def ready(addr: str) -> None:
        print(f"listening on {addr}", flush=True)

    try:
        serve(args.dir, host, port, token_file=args.token_file, arena_bytes=args.arena_bytes,
              allow_remote=args.allow_remote, ready=ready, io_timeout=args.io_timeout,
              max_request_bytes=args.max_request_bytes, stop=stop, fsync=args.fsync)
    except DeepFreezeError as e:
        print(f"deepfreeze repo serve: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
