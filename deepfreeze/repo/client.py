"""The client of repository providers: ``Repository("dstore://host1:7000,host2:7000")``.

:class:`RemoteRepository` implements the repository interface of
:class:`~deepfreeze.repo.store.EmbeddedRepository` over the provider protocol of
:mod:`deepfreeze.repo.provider`. A model lives whole on provider
``int.from_bytes(sha256(name)[:8], "big") % n`` of the ``n`` addresses (their order matters and is
checked by every provider). Each ``put`` and ``get`` moves the tensors in one bulk transfer:

* ``staging="arena"`` (the default when the provider is on this node and runs as this user): the
  tensors are copied into (or out of) the provider's pre-faulted shared-memory arena; the
  socket carries only offsets. Requests bigger than the arena's largest extent are split into
  several gets; a put that big goes over TCP (the store commits a model at once).
* ``staging="ondemand"`` (same node only): a fresh ``/dev/shm`` file per request (DStore's
  OnDemand variant, for the comparison).
* ``staging="tcp"`` (the default across nodes): the bytes travel on the socket, received
  straight into the destination arrays.

Every wait is bounded by ``timeout`` (:class:`~deepfreeze.errors.ProviderTimeoutError`); a
connection that failed is reopened by the next request. Specs, graphs and layer metadata are
write-once in a repository (names are never reused), so the client caches them.
"""
from __future__ import annotations

import json
import logging
import math
import mmap
import os
import threading
import time
from typing import Any, Iterable, Mapping

import numpy as np

from .. import net
from ..errors import (ConfigError, CorruptCheckpointError, DeepFreezeError, ModelMismatchError, ModelNotFoundError,
                      ProviderError, RepositoryError)
from ..format import byte_view, dtype_itemsize, dtype_name, numpy_dtype
from ..node import node_id
from .arena import close_mapping, create_staging_file, open_shared
from .graph import check_graph, tensor_keys
from .names import check_name
from .provider import placement

__all__ = ["RemoteRepository", "parse_location", "STAGINGS"]

STAGINGS = ("arena", "ondemand", "tcp")
_ALIGN = 64
_MAX_REPLY_HEADER = 256 << 20
log = logging.getLogger("deepfreeze")


def parse_location(addresses: "str | Iterable[str]") -> list[str]:
    """The normalized ``host:port`` list of ``"dstore://h:p,h:p"`` or a list of addresses."""
    if isinstance(addresses, str):
        rest = addresses[len("dstore://"):] if addresses.startswith("dstore://") else addresses
        items = [a for a in rest.split(",")]
    else:
        items = list(addresses)
    if not items or any(not isinstance(a, str) or not a for a in items):
        raise ConfigError(f"repository location {addresses!r}: expected 'dstore://host:port[,host:port...]'")
    out = [net.format_address(*net.parse_address(a.strip())) for a in items]
    if len(set(out)) != len(out):
        raise ConfigError(f"repository location {addresses!r}: an address appears twice")
    return out


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _Provider:
    """One provider connection (a lock serializes its requests)."""

    def __init__(self, repo: "RemoteRepository", index: int, *, connect: bool = True) -> None:
        self.repo, self.index, self.addr = repo, index, repo.addresses[index]
        self.lock = threading.RLock()  # held across an arena sequence (alloc, put / get, release)
        self.sock: net.Channel | None = None
        self.arena: mmap.mmap | None = None
        self.arena_np: np.ndarray | None = None
        self.arena_path: str | None = None
        self.max_extent = 0
        self.staging: str | None = None  # until the first connection
        self.bytes_read = 0
        if connect:
            self._connect()

    def _connect(self) -> None:
        r = self.repo
        deadline = time.monotonic() + r.timeout
        sock = net.connect(self.addr, r.timeout)
        try:
            ch, hello = net.client_handshake(sock, r.token, {"op": "hello", "providers": r.addresses,
                                                             "index": self.index, "node": node_id(),
                                                             "uid": os.getuid()}, deadline=deadline)
        except BaseException:
            sock.close()
            raise
        arena = hello.get("arena")
        staging = r.requested_staging
        if self.arena is not None and (not isinstance(arena, dict) or arena.get("path") != self.arena_path):
            self._unmap()  # a restarted provider has a new arena: never write into the old one
        if staging in ("arena", "ondemand", None) and self.arena is None and isinstance(arena, dict):
            try:
                size, max_extent = int(arena["size"]), int(arena["max_extent"])
                if not 0 < max_extent <= size:
                    raise RepositoryError("bad arena size")
                self.arena = open_shared(arena["path"], size, kind="arena")
                self.arena_np = np.frombuffer(self.arena, dtype=np.uint8, count=size)
                self.arena_path, self.max_extent = arena["path"], max_extent
            except (DeepFreezeError, KeyError, TypeError, ValueError) as e:
                if staging is not None:
                    sock.close()
                    raise ConfigError(f"staging={staging!r}: cannot map the arena of provider {self.addr}: {e}") from e
        if staging in ("arena", "ondemand") and self.arena is None:
            sock.close()
            raise ConfigError(f"staging={staging!r} needs provider {self.addr} on this node and running as this "
                              "user; use staging='tcp' (or the default) for a provider on another node")
        self.staging = staging or ("arena" if self.arena is not None else "tcp")
        self.sock = ch

    def call(self, header: dict[str, Any], payload: Iterable[Any] = (), recv: Any = None,
             wait: float = 0.0) -> dict[str, Any]:
        """Send a request, return the answer's header (its error raised). ``recv(msg)`` takes the
        answer's payload. ``wait``: seconds the provider may wait on its side (arena space) on top
        of the timeout. A failed connection is closed and reopened by the next call."""
        timeout = self.repo.timeout + wait
        with self.lock:
            if self.sock is None:
                self._connect()
            deadline = time.monotonic() + timeout
            try:
                try:
                    net.send_msg(self.sock, header, payload, deadline=deadline)
                except DeepFreezeError as e:
                    self._why_refused(e)
                    raise
                msg = net.recv_msg(self.sock, max_header=_MAX_REPLY_HEADER,
                                   max_payload=0 if recv is None else 1 << 48, deadline=deadline)
                if msg.header.get("ok") is True and recv is not None:
                    recv(msg)
                msg.discard()
            except BaseException as e:
                self._drop()  # out of step with the provider: the next call reconnects
                if net.is_transport_error(e):
                    raise type(e)(f"provider {self.addr}: {e}") from e
                raise
            return dict(net.raise_for_reply(msg.header, f"provider {self.addr}: "))

    def _why_refused(self, e: BaseException) -> None:
        """After a failed send: the provider may have answered why before closing (a request over
        its limits): raise that answer instead of a bare 'connection lost'."""
        if isinstance(e, TimeoutError) or not net.is_transport_error(e):
            return
        try:
            reply = net.recv_msg(self.sock, max_header=1 << 20, max_payload=0, deadline=time.monotonic() + 1.0)
        except DeepFreezeError:
            return
        net.raise_for_reply(reply.header, f"provider {self.addr}: ")

    def _drop(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None

    def _unmap(self) -> None:
        self.arena_np, self.arena_path, self.max_extent = None, None, 0
        if self.arena is not None:
            try:
                self.arena.close()
            except BufferError:  # a view is still alive: the mapping goes with it
                pass
            self.arena = None

    def close(self) -> None:
        with self.lock:
            self._drop()
            self._unmap()


def _check_reply_segs(segs: Any, keys: list[str], specs: Mapping[str, tuple[str, tuple[int, ...]]],
                      where: str) -> list[tuple[str, int, int]]:
    """``[(key, offset, length)]`` of a get answer, checked against what was asked."""
    if not isinstance(segs, list) or len(segs) != len(keys):
        raise ProviderError(f"{where}: malformed answer (tensor list)")
    out = []
    for seg, key in zip(segs, keys):
        if (not isinstance(seg, list) or len(seg) != 5 or seg[0] != key or seg[1] != specs[key][0]
                or list(seg[2]) != list(specs[key][1])):
            raise ProviderError(f"{where}: malformed answer for tensor {key!r}")
        off, length = seg[3], seg[4]
        if type(off) is not int or type(length) is not int or off < 0 or \
                length != math.prod(specs[key][1]) * dtype_itemsize(specs[key][0]):
            raise ProviderError(f"{where}: malformed answer for tensor {key!r} (offset/length)")
        out.append((key, off, length))
    return out


class RemoteRepository:
    """A repository served by provider processes (``deepfreeze repo serve``).

    ``addresses``: ``"dstore://h:p,h:p"`` or a list of ``"host:port"``, in the repository's
    order. ``token``: the shared secret (default :func:`deepfreeze.net.load_token`). ``timeout``:
    seconds any request may take. ``staging``: ``"arena"``, ``"ondemand"``, ``"tcp"`` or None
    (arena for providers on this node, TCP for the others). Connects to every provider at once:
    one that refuses the token or has another provider list raises here. One that cannot be
    reached (refused, unreachable, no answer within ``timeout``) is warned about and tried again
    by each request placed on it, which raises :class:`ProviderError` or
    :class:`ProviderTimeoutError` naming it until it answers: the models on the other providers
    stay usable (``unreachable`` lists it meanwhile). When none can be reached, the first
    provider's error is raised here.
    """

    def __init__(self, addresses: "str | Iterable[str]", *, token: str | None = None, timeout: float = 60.0,
                 staging: str | None = None, verify: bool = True) -> None:
        if staging is not None and staging not in STAGINGS:
            raise ConfigError(f"staging={staging!r}: expected one of {STAGINGS} or None")
        if not timeout > 0:
            raise ConfigError(f"timeout={timeout!r}: expected a positive number of seconds")
        self.addresses = parse_location(addresses)
        self.location = "dstore://" + ",".join(self.addresses)
        self.token = token if token is not None else net.load_token()
        self.timeout = float(timeout)
        self.requested_staging = staging
        self.verify = verify
        self._specs: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
        self._graphs: dict[str, Any] = {}
        self._meta: dict[str, dict] = {}
        self._providers: list[_Provider] = []
        errors: list[DeepFreezeError] = []
        try:
            for i in range(len(self.addresses)):
                try:
                    self._providers.append(_Provider(self, i))
                except DeepFreezeError as e:
                    if not net.is_transport_error(e):
                        raise  # it answered: a refused token, another provider list, a bad staging
                    errors.append(e)
                    self._providers.append(_Provider(self, i, connect=False))
                    log.warning("deepfreeze: repository %s: provider %s cannot be reached (%s): the models placed "
                                "on it raise until it answers; the other providers are in use", self.location,
                                self.addresses[i], e)
            if len(errors) == len(self.addresses):
                raise errors[0]
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ helpers
    def _at(self, name: str) -> _Provider:
        """The provider of ``name``, connected first if it was never reached (so its staging is
        known; it raises naming the provider while it cannot be reached)."""
        p = self._providers[placement(name, len(self._providers))]
        if p.staging is None:
            with p.lock:
                if p.sock is None:
                    p._connect()
        return p

    @property
    def staging(self) -> list[str | None]:
        """The staging each provider's transfers use (``"arena"``, ``"ondemand"`` or ``"tcp"``;
        None for a provider not reached yet)."""
        return [p.staging for p in self._providers]

    @property
    def unreachable(self) -> list[str]:
        """The providers with no connection now (not reached yet, or dropped after an error)."""
        return [p.addr for p in self._providers if p.sock is None]

    @property
    def bytes_read(self) -> int:
        """Tensor bytes the providers read for this client's gets."""
        return sum(p.bytes_read for p in self._providers)

    # ------------------------------------------------------------------ the interface
    def put(self, name: str, tensors: Mapping[str, np.ndarray], graph: dict | None = None,
            meta: Mapping[str, dict] | None = None) -> dict:
        """Store ``tensors`` under the new name ``name`` on its provider (see EmbeddedRepository.put)."""
        check_name(name)
        if graph is not None:
            check_graph(graph)
            if set(tensors) != set(tensor_keys(graph)):
                raise RepositoryError(f"model {name!r}: the tensors' keys are not the graph's tensor keys")
        arrays: dict[str, np.ndarray] = {}
        segs: list[list] = []
        for key, value in tensors.items():
            if not isinstance(key, str):
                raise RepositoryError(f"tensor key {key!r}: expected a string")
            a = np.asarray(value)
            if not a.dtype.isnative:  # the wire and the store are little-endian native
                a = a.astype(a.dtype.newbyteorder("="))
            try:
                dt = dtype_name(a.dtype)
            except CorruptCheckpointError as e:
                raise RepositoryError(f"tensor {key!r}: {e}") from e
            arrays[key] = a
            segs.append([key, dt, list(a.shape), 0, a.nbytes])
        if meta is not None:
            meta = {str(k): v for k, v in meta.items()}
            json.dumps(meta)  # JSON-able or TypeError now, before anything is sent
        p = self._at(name)
        head = {"op": "put", "name": name, "graph": graph, "meta": meta}
        aligned = sum(_round_up(s[4]) for s in segs)
        if p.staging == "arena" and aligned <= p.max_extent:
            return self._put_arena(p, head, segs, arrays, aligned)
        if p.staging == "ondemand":
            return self._put_file(p, head, segs, arrays, aligned)
        pos = 0
        for s in segs:
            s[3], pos = pos, pos + s[4]
        payload = [byte_view(arrays[s[0]]) for s in segs]
        return self._result(p.call({**head, "staging": "tcp", "tensors": segs}, payload))

    @staticmethod
    def _result(reply: Mapping[str, Any]) -> dict:
        res = reply.get("result")
        if not isinstance(res, dict):
            raise ProviderError("malformed answer to put")
        return res

    def _put_arena(self, p: _Provider, head: dict, segs: list[list], arrays: dict, total: int) -> dict:
        with p.lock:  # one extent per connection: no other thread's arena request in between
            return self._put_arena_locked(p, head, segs, arrays, total)

    def _put_arena_locked(self, p: _Provider, head: dict, segs: list[list], arrays: dict, total: int) -> dict:
        ext = p.call({"op": "alloc", "nbytes": total, "timeout": self.timeout}, wait=self.timeout)
        off, length = ext.get("offset"), ext.get("length")
        if type(off) is not int or type(length) is not int or not (0 <= off and total <= length
                                                                   and off + length <= p.arena_np.size):
            raise ProviderError(f"provider {p.addr}: malformed answer to alloc")
        try:
            pos = off
            for s in segs:
                a = arrays[s[0]]
                dst = p.arena_np[pos:pos + s[4]].view(a.dtype).reshape(a.shape)
                np.copyto(dst, a, casting="no")
                s[3] = pos
                pos = _round_up(pos + s[4] - off) + off
        except BaseException:
            self._release_quietly(p)
            raise
        return self._result(p.call({**head, "staging": "arena", "tensors": segs}))  # the put releases

    def _put_file(self, p: _Provider, head: dict, segs: list[list], arrays: dict, total: int) -> dict:
        path, mm = create_staging_file(total)
        try:
            buf = np.frombuffer(mm, dtype=np.uint8)
            pos = 0
            for s in segs:
                a = arrays[s[0]]
                np.copyto(buf[pos:pos + s[4]].view(a.dtype).reshape(a.shape), a, casting="no")
                s[3] = pos
                pos = _round_up(pos + s[4])
            del buf
            return self._result(p.call({**head, "staging": "file", "path": path, "tensors": segs}))
        finally:
            os.unlink(path)
            close_mapping(mm)

    def get(self, name: str, tensors: Iterable[str] | None = None, *,
            out: Mapping[str, np.ndarray] | None = None, verify: bool | None = None) -> dict[str, np.ndarray]:
        """The requested tensors of ``name`` (all by default), filled into ``out`` where given."""
        specs = self.specs(name)
        keys = list(specs) if tensors is None else list(dict.fromkeys(tensors))
        for k in keys:
            if k not in specs:
                raise ModelNotFoundError(f"model {name!r} has no tensor {k!r}")
        out = dict(out or {})
        extra = [k for k in out if k not in keys]
        if extra:
            raise RepositoryError(f"out= has key(s) {extra[:5]!r} that are not among the requested tensors")
        res: dict[str, np.ndarray] = {}
        for k in keys:
            dt, shape = specs[k]
            dtype = numpy_dtype(dt)
            a = out.get(k)
            if a is None:
                a = np.empty(shape, dtype)
            elif (not isinstance(a, np.ndarray) or a.dtype != dtype or a.shape != shape
                  or not a.flags.c_contiguous or not a.flags.writeable):
                raise ModelMismatchError(f"model {name!r}, tensor {k!r}: the output array must be a writable "
                                         f"C-contiguous {dt} array of shape {shape}")
            res[k] = a
        verify = self.verify if verify is None else verify
        p = self._at(name)
        if p.staging == "tcp":
            self._get_tcp(p, name, keys, specs, res, verify)
        elif p.staging == "ondemand":
            self._get_file(p, name, keys, specs, res, verify)
        else:
            rounds: list[list[str]] = [[]]
            size, big = 0, []
            for k in keys:
                n = _round_up(res[k].nbytes)
                if n > p.max_extent:
                    big.append(k)
                    continue
                if size + n > p.max_extent:
                    rounds.append([])
                    size = 0
                rounds[-1].append(k)
                size += n
            for r in rounds:
                if r:
                    self._get_arena(p, name, r, specs, res, verify)
            if big:
                self._get_tcp(p, name, big, specs, res, verify)
        return res

    def _read_count(self, p: _Provider, reply: Mapping[str, Any]) -> None:
        n = reply.get("bytes_read")
        if type(n) is int and n >= 0:
            p.bytes_read = n

    def _get_arena(self, p: _Provider, name: str, keys: list[str], specs: Mapping, res: dict, verify: bool) -> None:
        with p.lock:  # one extent per connection: no other thread's arena request in between
            self._get_arena_locked(p, name, keys, specs, res, verify)

    def _get_arena_locked(self, p: _Provider, name: str, keys: list[str], specs: Mapping, res: dict,
                          verify: bool) -> None:
        reply = p.call({"op": "get", "name": name, "tensors": keys, "staging": "arena", "verify": verify,
                        "timeout": self.timeout}, wait=self.timeout)
        try:
            where = f"provider {p.addr}"
            segs = _check_reply_segs(reply.get("tensors"), keys, specs, where)
            ext = reply.get("extent")
            if (not isinstance(ext, list) or len(ext) != 2 or not all(type(x) is int for x in ext)
                    or ext[0] < 0 or ext[0] + ext[1] > p.arena_np.size):
                raise ProviderError(f"{where}: malformed answer (extent)")
            for key, off, length in segs:
                if not (ext[0] <= off and off + length <= ext[0] + ext[1]):
                    raise ProviderError(f"{where}: tensor {key!r} outside the extent it gave")
                a = res[key]
                np.copyto(a, p.arena_np[off:off + length].view(a.dtype).reshape(a.shape), casting="no")
            self._read_count(p, reply)
        except BaseException:
            self._release_quietly(p)
            raise
        p.call({"op": "release"})

    @staticmethod
    def _release_quietly(p: _Provider) -> None:
        """Give the extent back after a failure (a closed connection freed it already)."""
        if p.sock is not None:
            try:
                p.call({"op": "release"})
            except DeepFreezeError:
                pass

    def _get_tcp(self, p: _Provider, name: str, keys: list[str], specs: Mapping, res: dict, verify: bool) -> None:
        where = f"provider {p.addr}"

        def recv(msg: net.Message) -> None:
            segs = _check_reply_segs(msg.header.get("tensors"), keys, specs, where)
            pos = 0
            for key, off, length in segs:
                if off != pos:
                    raise ProviderError(f"{where}: malformed answer (offsets not back to back)")
                pos += length
            if pos != msg.payload_bytes:
                raise ProviderError(f"{where}: the answer's payload has {msg.payload_bytes} bytes, its tensors {pos}")
            for key, _off, _length in segs:
                msg.recv_into(byte_view(res[key]))

        reply = p.call({"op": "get", "name": name, "tensors": keys, "staging": "tcp", "verify": verify,
                        "timeout": self.timeout}, recv=recv, wait=self.timeout)
        self._read_count(p, reply)

    def _get_file(self, p: _Provider, name: str, keys: list[str], specs: Mapping, res: dict, verify: bool) -> None:
        total = sum(_round_up(res[k].nbytes) for k in keys)
        path, mm = create_staging_file(total)
        try:
            reply = p.call({"op": "get", "name": name, "tensors": keys, "staging": "file", "path": path,
                            "verify": verify})
            segs = _check_reply_segs(reply.get("tensors"), keys, specs, f"provider {p.addr}")
            buf = np.frombuffer(mm, dtype=np.uint8)
            for key, off, length in segs:
                if off + length > buf.size:
                    raise ProviderError(f"provider {p.addr}: tensor {key!r} outside the staging file")
                a = res[key]
                np.copyto(a, buf[off:off + length].view(a.dtype).reshape(a.shape), casting="no")
            del buf
            self._read_count(p, reply)
        finally:
            os.unlink(path)
            close_mapping(mm)

    def specs(self, name: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        """key -> (dtype name, shape) of model ``name`` (cached: a name's content never changes)."""
        check_name(name)
        if name not in self._specs:
            raw = self._at(name).call({"op": "specs", "name": name}).get("specs")
            if not isinstance(raw, dict):
                raise ProviderError("malformed answer to specs")
            specs = {}
            for k, v in raw.items():
                if (not isinstance(v, list) or len(v) != 2 or not isinstance(v[0], str) or not isinstance(v[1], list)
                        or not all(type(d) is int and d >= 0 for d in v[1])):
                    raise ProviderError(f"malformed answer to specs (tensor {k!r})")
                numpy_dtype(v[0])
                specs[k] = (v[0], tuple(v[1]))
            self._specs[name] = specs
        return dict(self._specs[name])

    def graph(self, name: str) -> dict | None:
        """The plain-data layer graph stored with ``name`` (None if it was stored without)."""
        check_name(name)
        if name not in self._graphs:
            g = self._at(name).call({"op": "graph", "name": name}).get("graph")
            self._graphs[name] = None if g is None else check_graph(g)
        g = self._graphs[name]
        return None if g is None else json.loads(json.dumps(g))

    def layer_meta(self, ids: Iterable[str]) -> dict[str, dict]:
        """The stored metadata of the layer ids among ``ids`` (cached; asked of every provider)."""
        ids = list(dict.fromkeys(ids))
        missing = [i for i in ids if i not in self._meta]
        if missing:
            for p in self._providers:
                got = p.call({"op": "layer_meta", "ids": missing}).get("meta")
                if not isinstance(got, dict):
                    raise ProviderError(f"provider {p.addr}: malformed answer to layer_meta")
                for k, v in got.items():
                    if k in missing:
                        self._meta.setdefault(k, v)
                missing = [i for i in missing if i not in self._meta]
                if not missing:
                    break
        return {i: json.loads(json.dumps(self._meta[i])) for i in ids if i in self._meta}

    def list(self) -> dict[str, list[str]]:
        """model -> sorted names, over every provider."""
        merged: dict[str, set[str]] = {}
        for p in self._providers:
            got = p.call({"op": "list"}).get("models")
            if not isinstance(got, dict):
                raise ProviderError(f"provider {p.addr}: malformed answer to list")
            for model, names in got.items():
                merged.setdefault(model, set()).update(names)
        return {m: sorted(merged[m]) for m in sorted(merged)}

    def info(self, name: str | None = None) -> dict:
        """A model's info (from its provider), or the totals over every provider (numbers summed,
        with ``providers`` and ``per_provider``)."""
        if name is not None:
            check_name(name)
            return self._at(name).call({"op": "info", "name": name})["info"]
        per = [p.call({"op": "info", "name": None})["info"] for p in self._providers]
        total = {k: v for k, v in per[0].items()}
        for k in _SUMMED:
            if all(isinstance(d.get(k), int) for d in per):
                total[k] = sum(d[k] for d in per)
        total.update(location=self.location, models=len(self.list()), providers=list(self.addresses),
                     per_provider=per)
        return total

    def delete(self, name: str) -> dict:
        """Delete ``name`` on its provider (the name stays reserved); what it freed, as
        :meth:`EmbeddedRepository.delete <deepfreeze.repo.EmbeddedRepository.delete>` returns it."""
        check_name(name)
        reply = self._at(name).call({"op": "delete", "name": name})
        self._specs.pop(name, None)
        self._graphs.pop(name, None)
        result = reply.get("result")
        return result if isinstance(result, dict) else {}

    def gc(self) -> dict:
        """Compaction on every provider: the numbers summed, with ``per_provider``."""
        per = [p.call({"op": "gc"})["result"] for p in self._providers]
        return {**_sum_dicts(per), "per_provider": per}

    def close(self) -> None:
        for p in self._providers:
            p.close()

    def __enter__(self) -> "RemoteRepository":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteRepository({self.location!r})"


#: repository totals that add up over providers (a model's names may lie on several providers:
#: ``models`` is counted from list())
_SUMMED = ("names", "deleted_names", "tensors", "logical_bytes", "stored_bytes", "savings", "blobs", "packs",
           "pack_bytes", "layer_meta")


def _sum_dicts(dicts: list[dict]) -> dict:
    """Numbers summed key by key, lists (e.g. ``damaged``, ``warnings``) concatenated; other values
    from the first dict that has them."""
    out: dict[str, Any] = {}
    for d in dicts:
        for k, v in d.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(out.get(k, 0), (int, float)):
                out[k] = out.get(k, 0) + v
            elif isinstance(v, list) and isinstance(out.get(k, []), list):
                out[k] = [*out.get(k, []), *v]
            else:
                out.setdefault(k, v)
    return out
