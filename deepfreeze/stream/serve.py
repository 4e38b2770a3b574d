"""Double-buffered serving of a channel's versions: the framework-neutral half of a model subscriber.

A :class:`ReplicaServer` holds two replicas of the model and a
:class:`~deepfreeze.stream.core.Subscriber`. A background thread takes each new version
(:meth:`Subscriber.next`), loads it into the *idle* replica (:meth:`ReplicaServer._load`, the
framework's part: TensorFlow variables in :mod:`deepfreeze.keras.stream`, torch tensors in
:mod:`deepfreeze.torch.stream`; or the subscriber writes it there itself, straight from the
producer's slot, when the framework lends the replica's memory: :meth:`ReplicaServer._out_for`),
then makes that replica the live one. A request pins the live
replica (:meth:`ReplicaServer.pinned`) and runs entirely on it; a replica is reloaded only when
no request is running on it (the update thread waits for its pins to end), so no request ever
mixes versions and a swap never blocks a request. Framework-neutral (no numpy even).
"""
from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from typing import Any, Callable, Iterator

from ..errors import StreamError, StreamTimeoutError
from ..lease import Version
from .core import Subscriber, Update

__all__ = ["Replica", "ReplicaServer"]

log = logging.getLogger("deepfreeze")


class Replica:
    """One replica of the served model: the framework's object, the version loaded into it and
    how many requests run on it now."""

    __slots__ = ("model", "version", "users")

    def __init__(self, model: Any) -> None:
        self.model, self.version, self.users = model, None, 0

    @property
    def step(self) -> int | None:
        """The producer's optimizer step of the version this replica holds (None: none yet)."""
        return None if self.version is None else self.version.step


class ReplicaServer:
    """Two replicas following ``sub``'s versions (see the module docstring); a subclass loads a
    version into a replica (:meth:`_load`) and starts the update thread (:meth:`_start`)."""

    _thread_name = "deepfreeze-model-subscriber"

    def __init__(self, channel: str, sub: Subscriber, models: "list[Any]") -> None:
        if len(models) != 2:
            raise ValueError("a ReplicaServer holds exactly two replicas")
        self.channel = channel
        self._sub = sub
        self._replicas = [Replica(models[0]), Replica(models[1])]
        self._live: Replica | None = None
        self._cond = threading.Condition()
        self._callbacks: list[Callable[[Version], None]] = []
        self._error: BaseException | None = None
        self._stop = threading.Event()
        #: per update: {"version", "tier", "notify_s" (producer send -> consumer receipt), "fetch_s", "load_s",
        #: "swapped_at" (time.time())}
        self.updates: collections.deque[dict[str, Any]] = collections.deque(maxlen=100000)
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
        self._thread.start()

    # -- public
    @property
    def version(self) -> Version | None:
        """The live version ((generation, step); ``.step`` is the producer's optimizer step), or None."""
        live = self._live
        return None if live is None else live.version

    def on_update(self, fn: Callable[[Version], None]) -> None:
        """Call ``fn(version)`` on the update thread after each swap."""
        self._callbacks.append(fn)

    def wait(self, version: "Version | int | None" = None, timeout: float | None = 30.0) -> Version:
        """Block until a version >= ``version`` is live (an int: that step, or any newer generation;
        None: newer than the live one at the call); returns the live version. Raises
        :class:`~deepfreeze.errors.StreamTimeoutError` at ``timeout`` and, once, an error of the
        update thread."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            start = self.version

            def reached() -> bool:
                v = self.version
                if v is None:
                    return False
                if version is None:
                    return start is None or v > start
                if isinstance(version, Version):
                    return v >= version
                return v.step >= int(version) or (start is not None and v.generation > start.generation)

            while not reached():
                self._raise_error()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    why = (f"nobody publishes it: no producer run and no committed version found in "
                           f"{self._sub.where()}" if self.version is None and self._sub._conn is None else
                           "is the producer running and publishing?")
                    raise StreamTimeoutError(
                        f"no version {'newer than ' + str(start) if version is None else '>= ' + str(version)} of "
                        f"channel {self.channel!r} became live within {timeout}s (live: {self.version}); {why}")
                self._cond.wait(left if left is None else min(left, 1.0))
            return self.version

    @contextlib.contextmanager
    def pinned(self) -> Iterator[Replica]:
        """The live replica, pinned for the block: it is not reloaded before the block ends (a
        newer version goes into the other replica meanwhile). Raises
        :class:`~deepfreeze.errors.StreamError` when no version is live yet (call :meth:`wait`)."""
        rep = self._pin()
        try:
            yield rep
        finally:
            self._unpin(rep)

    def close(self) -> None:
        """Stop the update thread (the live replica stays usable) and the subscription."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._sub.close()

    def __enter__(self) -> "ReplicaServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the framework's part
    def _load(self, model: Any, up: Update) -> None:
        """Copy ``up``'s arrays into ``model`` (no request runs on it); raise on a mismatch.
        Not called for an update that filled :meth:`_out_for`'s arrays in place."""
        raise NotImplementedError

    def _out_for(self, model: Any) -> "dict[str, Any] | None":
        """The idle replica's own memory as arrays (published name -> C-contiguous array) for the
        subscriber to fill in place (its one copy from the producer's slot), or None (the update's
        arrays are then copied by :meth:`_load`). Raise on a mismatch with the published tensors."""
        return None

    # -- internals
    def _raise_error(self) -> None:
        e, self._error = self._error, None
        if e is not None:
            raise StreamError(f"the update thread of channel {self.channel!r} failed: {e}") from e

    def _pin(self) -> Replica:
        with self._cond:
            rep = self._live
            if rep is None:
                self._raise_error()
                raise StreamError(f"no version of channel {self.channel!r} is live yet: call wait() first")
            rep.users += 1
            return rep

    def _unpin(self, rep: Replica) -> None:
        with self._cond:
            rep.users -= 1
            if rep.users == 0:
                self._cond.notify_all()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                idle = self._idle()
                up = self._sub.next(0.5, out=self._out_for(idle.model))
                if up is not None:
                    self._apply(up, idle)
            except BaseException as e:  # surfaced once, at wait/predict; the thread goes on
                log.warning("deepfreeze: subscriber of %r: %s", self.channel, e)
                with self._cond:
                    self._error = self._error or e
                    self._cond.notify_all()
                self._stop.wait(1.0)

    def _idle(self) -> Replica:
        """The replica not live, once no request runs on it, marked as holding no version: the
        next update is written into it (in place, :meth:`_out_for`, or by :meth:`_load`), and a
        failed or torn one leaves it so: never served."""
        with self._cond:
            idle = self._replicas[1] if self._live is self._replicas[0] else self._replicas[0]
            while idle.users:  # a request that started before the last swap still runs on it
                self._cond.wait(1.0)
            idle.version = None  # being reloaded: holds no whole version until the swap
            return idle

    def _apply(self, up: Update, idle: Replica) -> None:
        t0 = time.perf_counter()
        if not up.filled:
            self._load(idle.model, up)
        load_s = time.perf_counter() - t0  # (filled in place: the copy is in fetch_s)
        with self._cond:
            idle.version = up.version
            self._live = idle
            self._cond.notify_all()
        self.updates.append({"version": up.version, "tier": up.tier, "fetch_s": up.fetch_s, "load_s": load_s,
                             "notify_s": up.notified_at - up.sent_at if up.sent_at else None,
                             "swapped_at": time.time()})
        for fn in list(self._callbacks):
            try:
                fn(up.version)
            except Exception as e:  # a user's callback must not stop the updates
                log.warning("deepfreeze: on_update callback %r failed: %s", fn, e)
