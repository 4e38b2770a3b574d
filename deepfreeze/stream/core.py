"""Long because: one protocol (publish/subscribe), its two ends sharing the endpoint and layout helpers.

Publisher and Subscriber: model updates from a training job to inference consumers.

Framework-neutral (numpy; no TensorFlow). The Keras side is :mod:`deepfreeze.keras.stream`.

**What is published.** A producer job has ``world`` ranks; at a publish step each rank holds its
shard of the model's weights as one contiguous buffer (the hook's capture, laid out as the shard
file's data region, :class:`~deepfreeze.fused.FusedLayout`; only the model-weight prefix of it is
published, optimizer state goes to the checkpoint only). A version is
:class:`~deepfreeze.lease.Version` ``(generation, step)``: a producer that resumed continues its
generation, one that overwrote starts a new one, and consumers follow both.

**Producer side** (:class:`Publisher`, one per rank; rank r publishes only its own shard, nothing
goes through rank 0): a :class:`~deepfreeze.stream.slots.SlotRing` in ``/dev/shm`` (K >= 3
slots, readers pin, the writer skips pinned slots: it never waits for a reader), a
:class:`~deepfreeze.stream.wire.RankServer` (TCP via :mod:`deepfreeze.net`: token, loopback unless
``allow_remote``) serving the ring and pushing notifications, and an endpoint file
``<persistent>/<channel>/stream/r<rank>.json`` (mode 0600) telling consumers where all that is.
With ``redis`` (``redis://host:port``) the endpoints and notifications also go through Redis,
under keys of the producer's job (:func:`deepfreeze.stream.redis_notify.key_prefix`: the id in
``<persistent>/<channel>/job``, which the consumer reads too), so a consumer never finds another
job's producer of the same channel name there (one that cannot read the id, such as a consumer
of another account, uses the channel's keys: see :mod:`deepfreeze.stream.redis_notify`).
:meth:`Publisher.publish` hands the buffer to the background thread ``deepfreeze-publish-r<rank>``
and returns; that thread copies it into a slot (header written last), then notifies. If a
version is handed over while the previous one is still being copied, the older *pending* one
is dropped (``coalesced``): the producer never waits for its publisher.

**Notification** (push): ``{"op": "ready", "channel", "run", "generation", "step", "rank",
"world", "nbytes", "crc", "t"}``, sent by each rank after its slot is complete; a version is
complete for a consumer when every rank of the run has announced it. A consumer that subscribes
first gets each rank's newest complete version at once (catch-up).

**Consumer side** (:class:`Subscriber`): finds the newest run's endpoints (files, or Redis),
subscribes to every rank (one thread per rank, ``deepfreeze-subscribe-r<rank>``, blocking in a
socket read: no polling), and :meth:`Subscriber.next` returns the newest complete version newer
than the last one delivered, skipping intermediate ones (bounded memory). Each rank's shard is
read from its ring when the consumer is on the same node and can open it (same account), else
fetched over TCP from that rank (all ranks in parallel), CRC-checked, and assembled into whole
tensors. When no producer is reachable (none running, or its node unreachable) the persistent
level (the channel's DeepFreeze checkpoint) is the fallback; only then, and to find a new
producer run, are the endpoint files and the persistent level re-read (every ``rescan`` s).
While connected, the registered endpoints are checked every ``5 * rescan`` s (endpoint files:
a ``stat`` of their directory first; Redis: also at once on another run's note): a newer run,
or none, replaces the connection (:meth:`Subscriber._check_superseded`), since a producer whose
node vanished fails no connection of the consumer's; records that are there but none of them
usable (forged, planted) keep it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .. import format as fmt
from .. import net, ownership
from ..config import validate_name
from ..errors import (ConfigError, DeepFreezeError, StreamError, StreamTimeoutError, UnsafePathError,
                      UntrustedOwnerError, VersionGoneError)
from ..fused import STAMP_BYTES, FusedLayout
from ..jsonsafe import loads as bounded_loads
from ..fsafe import atomic_write
from ..node import host_name, node_id
from ..lease import RunInfo, Version, read_job_id
from ..shardplan import ShardPlan, TensorSpec

__all__ = ["Publisher", "Subscriber", "Update", "StreamOptions", "endpoint_dir", "read_endpoints",
           "model_prefix", "ENDPOINT_FORMAT"]

log = logging.getLogger("deepfreeze")

ENDPOINT_FORMAT = 1
_MAX_ENDPOINT_BYTES = 16 << 20  # an endpoint file holds the plan: bounded, checked before reading
TIERS = ("auto", "shm", "tcp", "persistent")


def endpoint_dir(persistent: str, channel: str) -> str:
    """``<persistent>/<channel>/stream``: where each producer rank's endpoint file lives."""
    return os.path.join(persistent, validate_name(channel, "channel"), "stream")


def model_prefix(layout: FusedLayout, model_tensors: int) -> int:
    """Bytes of a rank's data region (the buffer after the stamp) holding the model weights:
    the pieces of tensors ``< model_tensors`` come first in a fused layout (plan order)."""
    end, seen_other = 0, False
    for s in layout.segments:
        if s.piece.tensor_id < model_tensors:
            if seen_other:
                raise StreamError(f"rank {layout.rank}'s layout interleaves model and optimizer tensors: the model "
                                  "weights are not a prefix of its shard (a plan DeepFreeze did not build)")
            end = s.offset + s.nbytes - STAMP_BYTES
        else:
            seen_other = True
    return end


@dataclasses.dataclass(frozen=True)
class StreamOptions:
    """How a producer publishes (one object, validated when built).

    ``slots``: slots of each rank's shared-memory ring (>= 3: a reader pins one, the writer
    never laps it nor waits). ``shm_dir``: where the rings live (tmpfs). ``host``/``port``:
    where each rank's server listens (port 0: any free one; with several ranks on a node,
    ``port`` must be 0); a non-loopback host needs ``allow_remote=True`` (then the token is
    what keeps others out). ``token``: a token file (default: ``$DEEPFREEZE_TOKEN``, the token text
    itself, else the file ``$DEEPFREEZE_TOKEN_FILE`` names, else ``~/.deepfreeze/token``, created
    0600 when missing). ``redis``: ``redis://host:port`` for
    metadata and notifications (default: the config's ``redis`` key, else none).
    ``io_timeout``: seconds any single network wait may take.
    """

    slots: int = 4
    shm_dir: str = "/dev/shm"
    host: str = "127.0.0.1"
    port: int = 0
    allow_remote: bool = False
    token: str | None = None
    redis: str | None = None
    io_timeout: float = 30.0

    def __post_init__(self) -> None:
        if not isinstance(self.slots, int) or self.slots < 3:
            raise ConfigError(f"slots = {self.slots!r}: use an integer >= 3 (a reader pins one slot, the writer "
                              "needs one that is neither pinned nor the newest)")
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ConfigError(f"port = {self.port!r}: use 0 (any free port) or a port number")
        if not self.io_timeout > 0:
            raise ConfigError(f"io_timeout = {self.io_timeout!r} must be > 0 seconds")
        if not net.is_loopback(self.host) and not self.allow_remote:
            raise ConfigError(f"host = {self.host!r} is not a loopback address: pass allow_remote=True to serve "
                              "consumers on other nodes (the token is then what keeps others out)")


_MAX_WARNED = 4096  # (path, cause) pairs a consumer remembers having warned about


def _warn_once(warned: "set[tuple[str, str]] | None", path: str, cause: str, msg: str, *args: Any) -> None:
    """Log ``msg % args`` unless ``warned`` (a consumer's memory) already holds ``(path, cause)``;
    without ``warned`` (a one-off call), always. The memory is bounded: when full it starts over."""
    if warned is not None:
        if (path, cause) in warned:
            return
        if len(warned) >= _MAX_WARNED:
            warned.clear()
        warned.add((path, cause))
    log.warning(msg, *args)


def read_endpoints(persistent: str, channel: str, *, trusted: "frozenset[int] | None" = None,
                   skipped: "list[str] | None" = None,
                   warned: "set[tuple[str, str]] | None" = None) -> dict[str, dict[int, dict[str, Any]]]:
    """Endpoint records under ``<persistent>/<channel>/stream``: run id -> rank -> record.
    Malformed files are skipped with a log line (a producer may be writing one); the path of
    every file skipped (malformed or untrusted) is appended to ``skipped`` when given. Trust
    (:mod:`deepfreeze.ownership`): the directory and every file must be owned by one of
    ``trusted`` (default: the user and root; endpoint files are ``0600`` in a ``0700`` directory,
    so another user's producer is reached through Redis, not files), not writable by anyone
    else, never a link: a planted directory or file is skipped with one warning. ``warned``: a
    set kept by the caller across calls (a :class:`Subscriber` rescanning): a warning is logged once
    per (path, cause) in it, not at every call."""
    trusted = ownership.trusted_uids() if trusted is None else trusted
    d = endpoint_dir(persistent, channel)
    out: dict[str, dict[int, dict[str, Any]]] = {}
    try:
        names = _trusted_listing(d, trusted)
    except FileNotFoundError:
        return out
    except (UnsafePathError, UntrustedOwnerError) as e:
        _warn_once(warned, d, f"{type(e).__name__}: {e}", "deepfreeze: stream endpoints in %s not used: %s", d, e)
        return out
    for n in names:
        if not (n.startswith("r") and n.endswith(".json") and n[1:-5].isdigit()):
            continue
        path = os.path.join(d, n)
        try:
            fd = ownership.open_trusted(path, os.O_RDONLY, kind="stream endpoint", trusted=trusted)
            with os.fdopen(fd, "rb") as f:
                data = f.read(_MAX_ENDPOINT_BYTES + 1)
            if len(data) > _MAX_ENDPOINT_BYTES:
                raise StreamError(f"larger than {_MAX_ENDPOINT_BYTES} bytes")
            rec = _check_endpoint(bounded_loads(data, path, max_bytes=_MAX_ENDPOINT_BYTES, error=StreamError,
                                                advice="not a DeepFreeze stream endpoint: ignored"), path)
        except FileNotFoundError:
            continue
        except (UnsafePathError, UntrustedOwnerError) as e:
            _warn_once(warned, path, f"{type(e).__name__}: {e}", "deepfreeze: stream endpoint not used: %s", e)
            if skipped is not None:
                skipped.append(path)
            continue
        except (OSError, ValueError, StreamError) as e:
            _warn_once(warned, path, f"{type(e).__name__}: {e}", "deepfreeze: stream endpoint %s is unreadable (%s); "
                       "skipped", path, e)
            if skipped is not None:
                skipped.append(path)
            continue
        out.setdefault(rec["run"], {})[rec["rank"]] = rec
    return out


def _trusted_listing(d: str, trusted: frozenset[int]) -> list[str]:
    """The names in endpoint directory ``d``, once it and ``<persistent>/<channel>`` pass
    :func:`deepfreeze.ownership.check_dir` (never a link, owned by one of ``trusted``, writable by
    nobody else)."""
    fd = ownership.open_dir_nofollow(d)
    try:
        up = os.path.dirname(d)
        ownership.check_dir(os.lstat(up), up, kind="stream channel directory", trusted=trusted)
        ownership.check_dir(os.fstat(fd), d, kind="stream endpoint directory", trusted=trusted)
        return os.listdir(fd)
    finally:
        os.close(fd)


def _check_endpoint(rec: Any, where: str) -> dict[str, Any]:
    def bad(why: str) -> StreamError:
        return StreamError(f"{where}: not a DeepFreeze stream endpoint ({why})")
    if not isinstance(rec, dict) or rec.get("format") != ENDPOINT_FORMAT:
        raise bad("format")
    for k, t in (("run", str), ("rank", int), ("world", int), ("generation", int), ("node", str),
                 ("address", str), ("ring", str), ("t", (int, float)), ("model_tensors", int), ("pid", int)):
        if not isinstance(rec.get(k), t) or isinstance(rec.get(k), bool):
            raise bad(f"field {k!r}")
    if not 0 <= rec["rank"] < rec["world"] <= 1 << 16:
        raise bad("rank/world")
    if not isinstance(rec.get("tensors"), list) or not isinstance(rec.get("plan"), dict):
        raise bad("tensors/plan")
    return rec


def _plan_of(rec: Mapping[str, Any]) -> tuple[list[TensorSpec], ShardPlan]:
    try:
        specs = [TensorSpec(int(t["id"]), str(t["name"]), str(t["dtype"]), tuple(int(d) for d in t["shape"]))
                 for t in rec["tensors"]]
        for s in specs:
            fmt.numpy_dtype(s.dtype)
            if any(d < 0 for d in s.shape):
                raise ValueError(f"negative dimension in {s.name}")
        plan = ShardPlan.from_json(specs, rec["plan"])
    except (KeyError, TypeError, ValueError, DeepFreezeError) as e:
        raise StreamError(f"the producer's endpoint for rank {rec.get('rank')} holds a malformed plan ({e})") from e
    if plan.world_size != rec["world"] or not 0 <= rec["model_tensors"] <= len(specs):
        raise StreamError("the producer's endpoint plan does not match its world size / tensor count")
    return specs, plan


# --------------------------------------------------------------------------- producer
class Publisher:
    """Publishes one producer rank's shard of each version (see the module docstring).

    ``capacity``: bytes of the largest shard this rank publishes. ``plan``/``tensors``: the
    shard plan (recorded in the endpoint file so consumers can assemble whole tensors);
    ``model_tensors``: how many leading tensors are the model's weights (the published ones).
    """

    def __init__(self, channel: str, persistent: str, *, rank: int, world: int, run: RunInfo,
                 plan: ShardPlan, model_tensors: int, options: StreamOptions | None = None) -> None:
        from . import slots
        from .wire import RankServer
        self.channel, self.rank, self.world, self.run = validate_name(channel, "channel"), rank, world, run
        self.options = options or StreamOptions()
        self.persistent = os.path.abspath(persistent)
        self.layout = FusedLayout.build(plan, rank)
        self.prefix = model_prefix(self.layout, model_tensors)
        self.coalesced = 0  #: versions dropped because a newer one was handed over before they were copied
        self.published: list[Version] = []  #: versions copied and announced, in order
        self.publish_times: dict[Version, float] = {}  #: version -> seconds from hand-over to notification
        self._error: BaseException | None = None
        token = net.ensure_token(self.options.token)  # created when missing; concurrent starters agree on one
        self.ring_path = os.path.join(self.options.shm_dir,
                                      f"deepfreeze-stream-{self.channel}-{run.id}-r{rank}")
        slots.sweep_stale(self.options.shm_dir)  # rings of producers killed earlier (their writer is gone)
        if os.path.lexists(self.ring_path):
            os.unlink(self.ring_path)  # this run's own ring from a failed start (the run id is new per run)
        self.ring = slots.SlotRing.create(self.ring_path, max(self.prefix, 1), self.options.slots,
                                    meta={"channel": self.channel, "run": run.id, "rank": rank})
        self.server: Any = None
        self.redis: Any = None
        try:
            self.server = RankServer(self.ring, channel=self.channel, rank=rank, world=world, run=run, token=token,
                                     host=self.options.host, port=self.options.port,
                                     allow_remote=self.options.allow_remote, io_timeout=self.options.io_timeout)
            self.endpoint = {
                "format": ENDPOINT_FORMAT, "channel": self.channel, "run": run.id, "generation": run.generation,
                "rank": rank, "world": world, "node": node_id(), "host": host_name(),
                "pid": os.getpid(), "uid": os.getuid(), "ring": self.ring_path, "address": self.server.address,
                "nbytes": self.prefix, "model_tensors": model_tensors, "t": time.time(),
                "tensors": [t.to_json() for t in plan.tensors], "plan": plan.to_json()}
            d = endpoint_dir(self.persistent, self.channel)
            ownership.ensure_dir(d, self.persistent)  # 0700, the user's own, never a link (deepfreeze.ownership)
            self.endpoint_path = os.path.join(d, f"r{rank}.json")
            atomic_write(self.endpoint_path, json.dumps(self.endpoint).encode(), fsync=False, point="stream.endpoint")  # 0600
            redis_url = self.options.redis
            if redis_url:
                from .redis_notify import RedisNotifier
                # keys of this job only (its id, as consumers read it: <persistent>/<channel>/job), so two
                # jobs of one channel name on one Redis never overwrite or read each other's records
                self.redis = RedisNotifier(redis_url, self.channel, token=token,
                                           job=read_job_id(self.persistent, self.channel))
                self.redis.register(rank, self.endpoint)
        except BaseException:
            self._close_parts()
            raise
        self._cond = threading.Condition()
        self._pending: tuple[Version, Any, float] | None = None
        self._busy = False
        self._closing = False
        self._thread = threading.Thread(target=self._worker, name=f"deepfreeze-publish-r{rank}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank's server sent to consumers over TCP."""
        return int(self.server.bytes_sent)

    def publish(self, version: Version, data: Any) -> None:
        """Hand over this rank's shard of ``version``: ``data`` is the data region (or the whole
        capture buffer, stamp included: a :class:`~deepfreeze.fused.FusedShard` is accepted too);
        only its model prefix is published. Returns at once; ``data`` is held, unchanged, until
        copied. Raises a background error of an earlier publish, once."""
        self._raise_pending()
        buf = getattr(data, "data", data)  # a FusedShard: its data region
        arr = np.asarray(buf)
        if arr.dtype != np.uint8 or arr.ndim != 1 or arr.size < self.prefix:
            raise StreamError(f"rank {self.rank} publishes {self.prefix} bytes per version, got an array of "
                              f"{arr.size} {arr.dtype} (ndim {arr.ndim})")
        self._hand_over(version, arr[:self.prefix])

    def publish_with(self, version: Version, fill: Any, done: "Callable[[], None]", *, inline: bool = False) -> None:
        """Hand over a version that ``fill`` copies straight into a slot on the publish thread
        (:meth:`SlotRing.write_with <deepfreeze.stream.slots.SlotRing.write_with>`: ``fill(dst,
        copied)`` returns the CRC of its :attr:`prefix` bytes computed in the same pass, or None when
        its source was torn: nothing is published). ``done()`` is called once, on the publish
        thread, when ``fill`` returned or will never run (dropped for a newer version, every slot
        pinned, the publisher closing): then nothing reads ``fill``'s source any more. Returns at
        once; raises a background error of an earlier publish, once. ``inline``: copy and notify
        in the caller's thread instead (returns once the version is announced; its error is raised
        here): for a process confined to one CPU, where a thread would only take turns with the
        caller."""
        self._raise_pending()
        if not inline:
            self._hand_over(version, (fill, done))
            return
        with self._cond:
            self._check_next(version)
        self._publish_now(version, (fill, done), time.perf_counter())

    def _check_next(self, version: Version) -> None:
        """Refuse ``version`` unless it may be published next: the publisher is open and it is newer
        than every version published or pending. Called under ``_cond``."""
        if self._closing:
            raise StreamError("this Publisher is closed")
        if self.published and version <= self.published[-1] or \
                self._pending is not None and version <= self._pending[0]:
            raise ConfigError(f"channel {self.channel!r}: version {version} published after a newer or equal one")

    def _hand_over(self, version: Version, item: Any) -> None:
        """Make ``item`` (an array, or a ``(fill, done)`` pair) the pending version; an older
        pending one is dropped (``coalesced``; a dropped fill's ``done()`` is called)."""
        with self._cond:
            self._check_next(version)
            dropped, self._pending = self._pending, (version, item, time.perf_counter())
            if dropped is not None:
                self.coalesced += 1
            self._cond.notify_all()
        if dropped is not None and isinstance(dropped[1], tuple):
            dropped[1][1]()  # a fill that will never run: its source is free

    def wait(self, timeout: float | None = None) -> None:
        """Block until every version handed over is published (or dropped for a newer one)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending is not None or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise StreamTimeoutError(f"rank {self.rank}'s publisher did not finish within {timeout}s")
                self._cond.wait(left)
        self._raise_pending()

    def close(self, *, remove: bool = True) -> None:
        """Stop publishing: finish the version being copied, stop the server, remove the
        endpoint file and the ring (``remove=False`` keeps them, e.g. for a test of a dead producer)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=60)
        self._close_parts(remove=remove)

    def _close_parts(self, remove: bool = True) -> None:
        if self.redis is not None and remove:
            try:
                self.redis.unregister(self.rank)
            except Exception as e:
                log.warning("deepfreeze: unregistering %s rank %d from Redis failed: %s", self.channel, self.rank, e)
        for part in (self.server, self.redis):
            if part is not None:
                try:
                    part.close()
                except Exception as e:  # closing must not hide the error being raised
                    log.warning("deepfreeze: closing %s failed: %s", type(part).__name__, e)
        if remove and getattr(self, "endpoint_path", None):
            try:
                os.unlink(self.endpoint_path)
            except FileNotFoundError:
                pass
        if getattr(self, "ring", None) is not None:
            self.ring.close()
            if remove:
                try:
                    self.ring.unlink()
                except FileNotFoundError:
                    pass

    def _raise_pending(self) -> None:
        e, self._error = self._error, None
        if e is not None:
            raise StreamError(f"publishing on channel {self.channel!r} (rank {self.rank}) failed: {e}") from e

    def _worker(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closing:
                    self._cond.wait()
                if self._pending is None:
                    return
                (version, data, t0), self._pending = self._pending, None
                self._busy = True
            try:
                self._publish_now(version, data, t0)
            except BaseException as e:  # surfaced once, at the next publish/wait
                self._error = self._error or e
                log.warning("deepfreeze: publishing %s v%s failed: %s", self.channel, version, e)
            finally:
                del data
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _publish_now(self, version: Version, data: Any, t0: float) -> None:
        if isinstance(data, tuple):  # publish_with: the fill copies straight from its source
            fill, done = data
            torn = self.ring.torn
            try:
                slot = self.ring.write_with(version, self.prefix, fill)
            finally:
                done()
            if slot is None and self.ring.torn > torn:
                log.info("deepfreeze: %s v%s not published: its tensors changed during the copy (torn)",
                         self.channel, version)
                return
            nbytes = self.prefix
        else:
            slot, nbytes = self.ring.write(version, data), int(data.size)
        if slot is None:  # every slot but the newest is pinned by readers: the next version will go
            log.info("deepfreeze: %s v%s not placed in shared memory (every free slot pinned)", self.channel, version)
            return
        crc = int(self.ring.last_written[2])  # computed by the ring as it copied
        note = {"op": "ready", "channel": self.channel, "run": self.run.id, "generation": version.generation,
                "step": version.step, "rank": self.rank, "world": self.world, "nbytes": nbytes, "crc": crc,
                "t": time.time()}
        self.server.notify(note)
        if self.redis is not None:
            self.redis.notify(note)
        self.published.append(version)
        self.publish_times[version] = time.perf_counter() - t0


# --------------------------------------------------------------------------- consumer
@dataclasses.dataclass
class Update:
    """One version delivered to a consumer: the model's tensors by name (model order), its
    version, a checksum (``"crc32:<rank0>,<rank1>,..."`` of the published shards, or
    ``"persistent"``), the tier it came through and timings (seconds)."""

    version: Version
    arrays: dict[str, np.ndarray]
    checksum: str
    tier: str
    notified_at: float = 0.0  #: time.time() when the last rank's notification arrived
    sent_at: float = 0.0  #: the producer's time.time() in the last notification
    fetch_s: float = 0.0
    #: the arrays are the caller's ``out`` (:meth:`Subscriber.next`), filled in place: nothing to copy
    filled: bool = False


class _Conn:
    """The consumer's connections to one producer run."""

    def __init__(self, run: str, recs: dict[int, dict[str, Any]]) -> None:
        self.run, self.recs = run, recs
        self.world = recs[0]["world"]
        self.generation = recs[0]["generation"]
        self.specs, self.plan = _plan_of(recs[0])
        self.model_tensors = recs[0]["model_tensors"]
        self.layouts = [FusedLayout.build(self.plan, r) for r in range(self.world)]
        self.prefixes = [model_prefix(lay, self.model_tensors) for lay in self.layouts]
        #: one producer rank holding every model tensor whole: (name, byte offset in its data, spec)
        #: per tensor, so a fetch hands out views of the receive buffer instead of scattering
        self.direct = _direct_views(self.layouts[0], self.model_tensors, self.specs) if self.world == 1 else None
        if self.direct and max(off + spec.nbytes for _, off, spec in self.direct) > self.prefixes[0]:
            self.direct = None  # not inside the published prefix: scatter (which checks nothing more)
        self.notes: dict[Version, dict[int, dict[str, Any]]] = {}
        self.subs: list[Any] = []
        self.fetchers: dict[int, Any] = {}
        self.rings: dict[int, Any] = {}
        self.threads: list[threading.Thread] = []
        self.stop = threading.Event()
        self.signature: tuple | None = None  # of the endpoint files when last checked (Subscriber._check_superseded)


class Subscriber:
    """Receives the newest versions published on ``channel`` (see the module docstring).

    ``persistent``: the producer's persistent directory (endpoint files, and the fallback
    checkpoint). ``tier``: ``"auto"`` (shared memory for shards on this node when readable, else
    TCP; the persistent level when no producer is reachable), or force ``"shm"``, ``"tcp"``,
    ``"persistent"``. ``token``: token file (default ``$DEEPFREEZE_TOKEN``, the token text
    itself, else the file ``$DEEPFREEZE_TOKEN_FILE`` names, else ``~/.deepfreeze/token``). ``redis``: find endpoints and notifications in Redis.
    ``rescan``: seconds between looks for a new producer run while none is connected (while
    one is, every ``5 * rescan`` s: a newer run registered replaces it).
    ``warn_after``: seconds of finding neither a producer nor a committed version after which
    one warning says so, naming the channel and where it looked (:meth:`where`); the subscriber
    keeps looking.
    """

    def __init__(self, channel: str, persistent: str, *, tier: str = "auto", token: str | None = None,
                 redis: str | None = None, io_timeout: float = 30.0, rescan: float = 1.0,
                 verify: bool = True, warn_after: float = 10.0) -> None:
        if tier not in TIERS:
            raise ConfigError(f"tier = {tier!r}: use one of {TIERS}")
        if not float(warn_after) >= 0:
            raise ConfigError(f"warn_after = {warn_after!r} must be >= 0 seconds")
        self.warn_after = float(warn_after)
        self._empty_since: float | None = None  # monotonic time since which nothing was found
        #: True once :attr:`warn_after` seconds passed with no producer and no committed version
        self.nobody_publishes = False
        self.channel, self.persistent = validate_name(channel, "channel"), os.path.abspath(persistent)
        self.tier, self.io_timeout, self.rescan, self.verify = tier, float(io_timeout), float(rescan), verify
        self.redis_url = redis
        self._token_path = token
        self._token: str | None = None
        self.version: Version | None = None  #: the last version delivered
        self._conn: _Conn | None = None
        self._queue: "queue.Queue[dict[str, Any]]" = queue.Queue()
        self._next_scan = 0.0
        self._next_check = 0.0  # when to check next that the connected run is still the newest registered
        self._staging: dict[int, np.ndarray] = {}
        self._out: dict[str, np.ndarray] | None = None
        self._listener: Any = None
        self._job_warned = ""
        #: (path, cause) of every endpoint directory, file or record warned about: once each
        self._endpoint_warned: set[tuple[str, str]] = set()
        self.bytes_by_tier: dict[str, int] = {"shm": 0, "tcp": 0, "persistent": 0}
        self.node = node_id()

    # -- public
    def next(self, timeout: float | None = None, *, out: dict[str, np.ndarray] | None = None) -> Update | None:
        """The newest complete version newer than the last one delivered (skipping older ones),
        or None at ``timeout`` (None: wait forever). ``out``: arrays (name -> C-contiguous, the
        model's dtype and shape) to fill in place; by default a buffer owned by the subscriber is
        reused (valid until the next call)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._conn is None and self.tier != "persistent":
                self._connect()
            if self._conn is None or self.tier == "persistent":
                up = self._from_persistent(out)
                if up is not None:
                    return up
            else:
                self._drain_queue()
                up = self._ready_update(out)
                if up is not None:
                    return up
                self._check_superseded()
                if self._conn is None:
                    continue  # another run took over: connect to it (or fall back) at once
            self._check_empty()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            wait = left
            if self._conn is None or self.tier == "persistent":
                wait = self.rescan if left is None else min(left, self.rescan)
            else:  # wake up for the next check of the connected run
                until = max(self._next_check - time.monotonic(), 0.05)
                wait = until if left is None else min(left, until)
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                continue
            self._take(item)
            self._drain_queue()  # every note already here counts: the newest complete version wins

    def where(self) -> str:
        """Where this subscriber looks for the channel's producers and versions (for messages)."""
        if self.redis_url:
            producers = f"Redis {self.redis_url} (hash deepfreeze:stream:{self.channel}:endpoints)"
        else:
            producers = f"endpoint files {endpoint_dir(self.persistent, self.channel)}/r<rank>.json"
        if self.tier == "persistent":
            return f"committed checkpoints in {os.path.join(self.persistent, self.channel)}"
        if self.tier in ("shm", "tcp"):
            return producers
        return f"{producers} and committed checkpoints in {os.path.join(self.persistent, self.channel)}"

    def _check_empty(self) -> None:
        """One warning once nothing (no producer, no version) was found for ``warn_after`` seconds."""
        if self._conn is not None or self.version is not None:
            self._empty_since = None
            return
        now = time.monotonic()
        if self._empty_since is None:
            self._empty_since = now
        if not self.nobody_publishes and now - self._empty_since >= self.warn_after:
            self.nobody_publishes = True
            log.warning("deepfreeze: nobody publishes channel %r: after %.0f s, no producer run and no committed "
                        "version found (looked in %s); still looking every %g s. Is the producer running, with the "
                        "same persistent directory%s and channel name?", self.channel, now - self._empty_since,
                        self.where(), self.rescan, " and Redis" if self.redis_url else "")

    def _drain_queue(self) -> None:
        while self._conn is not None:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            self._take(item)

    def specs(self) -> list[TensorSpec]:
        """The model tensors the producer publishes (connects if needed; empty when unknown)."""
        if self._conn is None and self.tier != "persistent":
            self._connect()
        if self._conn is not None:
            return self._conn.specs[:self._conn.model_tensors]
        return []

    def close(self) -> None:
        self._drop_conn()
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def __enter__(self) -> "Subscriber":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- connection
    def _token_value(self) -> str:
        if self._token is None:
            self._token = net.load_token(self._token_path)
        return self._token

    def _endpoints(self) -> tuple[dict[str, dict[int, dict[str, Any]]], int]:
        """The registered endpoint records that pass every check (run id -> rank -> record), and
        how many records are there but not usable (forged, untrusted, malformed)."""
        if self.redis_url:
            try:  # the producer's job (<persistent>/<channel>/job): only its records and notes are read
                job = read_job_id(self.persistent, self.channel)
            except DeepFreezeError as e:  # e.g. another account's producer (its directory is 0700)
                job = None
                if self._job_warned != str(e):
                    log.warning("deepfreeze: stream %s: cannot read the producer's job id (%s): looking it up in "
                                "Redis by channel name only (two jobs publishing this channel name there would "
                                "be told apart only by their job id)", self.channel, e)
                    self._job_warned = str(e)
            if self._listener is not None and getattr(self._listener, "job", None) != job:
                self._listener.close()  # the job's first run made its id since: that job's records from now on
                self._listener = None
            if self._listener is None:
                from .redis_notify import RedisListener
                self._listener = RedisListener(self.redis_url, self.channel, token=self._token_value(), job=job)
            out: dict[str, dict[int, dict[str, Any]]] = {}
            ignored = self._listener.ignored
            bad = 0
            for rank, rec in self._listener.endpoints().items():
                try:
                    rec = _check_endpoint(rec, f"redis endpoint r{rank}")
                except StreamError as e:
                    _warn_once(self._endpoint_warned, f"redis endpoint r{rank}", str(e), "deepfreeze: %s", e)
                    bad += 1
                    continue
                out.setdefault(rec["run"], {})[rec["rank"]] = rec
            return out, bad + self._listener.ignored - ignored
        skipped: list[str] = []
        out = read_endpoints(self.persistent, self.channel, skipped=skipped, warned=self._endpoint_warned)
        return out, len(skipped)

    def _connect(self) -> None:
        now = time.monotonic()
        if now < self._next_scan:
            return
        self._next_scan = now + self.rescan
        runs, _ = self._complete_runs()
        for run in self._newest_first(runs):
            try:
                self._conn = self._open(run, runs[run])
                return
            except (DeepFreezeError, OSError) as e:
                log.info("deepfreeze: stream %s: producer run %s not reachable (%s)", self.channel, run, e)

    def _complete_runs(self) -> tuple[dict[str, dict[int, dict[str, Any]]], int]:
        """The producer runs whose every rank has an endpoint (run id -> rank -> record), and the
        number of records there but not usable (:meth:`_endpoints`)."""
        endpoints, unusable = self._endpoints()
        return {run: recs for run, recs in endpoints.items()
                if len(recs) == next(iter(recs.values()))["world"] and set(recs) == set(range(len(recs)))}, unusable

    @staticmethod
    def _newest_first(runs: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> list[str]:
        """Run ids, newest first: (generation, start time)."""
        return sorted(runs, key=lambda r: (runs[r][0]["generation"], max(x["t"] for x in runs[r].values())),
                      reverse=True)

    def _check_superseded(self, now: float | None = None) -> None:
        """Drop the connected run once it is no longer the newest complete run registered.

        Before, a consumer looked for producer runs only while it had none, and learnt that its
        run was gone only from a connection failing. Across nodes that is not enough: a producer
        whose node vanished sends no FIN, so (endpoint files) the notification socket stays
        silent until TCP keepalive gives up (about two minutes), and (Redis) the consumer holds no
        connection of its own that would ever fail (notes come from Redis; a fetch connection is
        used only to fetch); a new run of the channel, whose records replace the old run's and
        whose notes are ignored as another run's, was not followed: with Redis, never. Now,
        every ``5 * rescan`` seconds while waiting (with Redis also at once, at most every
        ``rescan`` s, when a note of another run arrives), the registered endpoints are read
        again (endpoint files: only when a ``stat`` of the directory's entries changed): a newer
        run, or none (the producer closed and unregistered), drops the connection, and the next
        look connects to the newest run or falls back to the persistent level. Endpoints that
        cannot be read (Redis not answering), or records that are there but none of them usable
        (forged: no valid MAC; planted; half-written), keep the connection: the data path may
        still work, and its connection authenticated both ends."""
        conn = self._conn
        if conn is None:
            return
        now = time.monotonic() if now is None else now
        if now < self._next_check:
            return
        self._next_check = now + 5 * self.rescan
        if not self.redis_url:  # endpoint files: a cheap stat of the directory first
            sig = self._endpoint_files_signature()
            if sig is None or sig == conn.signature:
                return
            conn.signature = sig
        try:
            runs, unusable = self._complete_runs()
        except (DeepFreezeError, OSError) as e:
            log.info("deepfreeze: stream %s: cannot check the producer runs (%s)", self.channel, e)
            return
        order = self._newest_first(runs)
        if order and order[0] == conn.run:
            return
        if not order and unusable:
            # Records are there but none is usable (a MAC that does not verify, an untrusted or
            # half-written file): no sign that the connected run went away. Whoever wrote them
            # could as well delete the records (the consumer then falls back to the persistent
            # level) but never redirects it: its connection authenticated both ends.
            log.info("deepfreeze: stream %s: no usable endpoint record registered (%d ignored): staying with "
                     "producer run %s", self.channel, unusable, conn.run)
            return
        log.info("deepfreeze: stream %s: producer run %s is %s: looking for a producer", self.channel,
                 conn.run, f"superseded by run {order[0]}" if order else "no longer registered")
        self._drop_conn()
        self._next_scan = 0.0

    def _endpoint_files_signature(self) -> tuple | None:
        """(name, inode, mtime, size) of every entry of the endpoint directory (None: unreadable)."""
        try:
            with os.scandir(endpoint_dir(self.persistent, self.channel)) as it:
                out = []
                for e in it:
                    st = e.stat(follow_symlinks=False)
                    out.append((e.name, st.st_ino, st.st_mtime_ns, st.st_size))
            return tuple(sorted(out))
        except OSError:
            return None

    def _open(self, run: str, recs: dict[int, dict[str, Any]]) -> _Conn:
        from .wire import RankClient
        conn = _Conn(run, recs)
        try:
            for r in range(conn.world):
                rec = recs[r]
                if not self.redis_url:  # notifications from each rank's server (with Redis: its pub/sub)
                    c = RankClient(rec["address"], self._token_value(), channel=self.channel,
                                   timeout=self.io_timeout, subscribe=True)
                    conn.subs.append(c)
                if self.tier in ("auto", "shm") and rec["node"] == self.node:
                    ring = self._open_ring(rec)
                    if ring is not None:
                        conn.rings[r] = ring
                    elif self.tier == "shm":
                        raise StreamError(f"tier='shm' but rank {r}'s ring {rec['ring']} cannot be opened")
                elif self.tier == "shm":
                    raise StreamError(f"tier='shm' but rank {r} runs on another node")
                if self.redis_url:  # endpoints from Redis may outlive a killed producer: check it is there
                    if r in conn.rings:
                        if not conn.rings[r].writer_alive():
                            raise StreamError(f"rank {r}'s producer (pid {rec['pid']}) is gone")
                    else:
                        conn.fetchers[r] = RankClient(rec["address"], self._token_value(), channel=self.channel,
                                                      timeout=self.io_timeout)
            for r, c in enumerate(conn.subs):
                t = threading.Thread(target=self._listen, args=(conn, r, c), daemon=True,
                                     name=f"deepfreeze-subscribe-r{r}")
                conn.threads.append(t)
                t.start()
            if self.redis_url:
                for note in self._listener.latest().values():  # catch up: each rank's newest note
                    if note.get("run") == run:
                        self._queue.put(dict(note, _recv=time.time()))
                t = threading.Thread(target=self._listen, args=(conn, -1, self._listener), daemon=True,
                                     name="deepfreeze-subscribe-redis")
                conn.threads.append(t)
                t.start()
        except BaseException:
            self._close_conn(conn)
            raise
        if self.version is not None and conn.generation < self.version.generation:
            log.warning("deepfreeze: stream %s: producer run %s is of generation %d, older than the live version %s",
                        self.channel, run, conn.generation, self.version)
        return conn

    def _open_ring(self, rec: Mapping[str, Any]) -> Any:
        from .slots import SlotRing
        path = rec["ring"]
        if os.path.dirname(path) == "" or ".." in path.split(os.sep):
            return None
        try:
            return SlotRing.open(path)
        except (OSError, DeepFreezeError) as e:  # another account's ring (0600), or gone
            log.info("deepfreeze: stream %s: ring %s not readable (%s): TCP instead", self.channel, path, e)
            return None

    def _listen(self, conn: _Conn, rank: int, client: Any) -> None:
        while not conn.stop.is_set():
            try:
                note = client.next_note(0.5)
            except BaseException as e:  # the producer rank went away
                if not conn.stop.is_set():
                    self._queue.put({"op": "lost", "run": conn.run, "rank": rank if rank >= 0 else "redis",
                                     "error": str(e)})
                    if rank < 0 and self._listener is not None:  # a new listener at the next connection
                        try:
                            self._listener.close()
                        except Exception:
                            pass
                        self._listener = None
                return
            if note is not None:
                note = dict(note)
                note["_recv"] = time.time()
                self._queue.put(note)

    def _take(self, item: dict[str, Any]) -> None:
        conn = self._conn
        if conn is None:
            return
        if item.get("run") != conn.run:
            if self.redis_url and item.get("op") == "ready":  # another run publishes: check soon
                self._next_check = min(self._next_check, max(time.monotonic(), self._next_check - 4 * self.rescan))
            return
        if item.get("op") == "lost":
            log.info("deepfreeze: stream %s: lost producer rank %s of run %s (%s): looking for a producer",
                        self.channel, item.get("rank"), conn.run, item.get("error"))
            self._drop_conn()
            self._next_scan = 0.0
            return
        try:
            v = Version(int(item["generation"]), int(item["step"]))
            r = int(item["rank"])
            nbytes = int(item["nbytes"])
        except (KeyError, TypeError, ValueError):
            log.warning("deepfreeze: stream %s: malformed notification ignored", self.channel)
            return
        if not 0 <= r < conn.world or nbytes != conn.prefixes[r]:
            log.warning("deepfreeze: stream %s: notification of rank %s with %s bytes does not match the plan: ignored",
                        self.channel, r, nbytes)
            return
        if self.version is not None and v <= self.version:
            return
        conn.notes.setdefault(v, {})[r] = item

    def _drop_conn(self) -> None:
        if self._conn is not None:
            self._close_conn(self._conn)
            self._conn = None
            self._queue = queue.Queue()

    @staticmethod
    def _close_conn(conn: _Conn) -> None:
        conn.stop.set()
        for c in list(conn.subs) + list(conn.fetchers.values()):
            try:
                c.close()
            except Exception:
                pass
        for ring in conn.rings.values():
            ring.close()
        for t in conn.threads:
            t.join(timeout=2)

    # -- delivery
    def _ready_update(self, out: dict[str, np.ndarray] | None) -> Update | None:
        conn = self._conn
        while conn is not None:
            complete = [v for v, notes in conn.notes.items() if len(notes) == conn.world]
            if not complete:
                return None
            v = max(complete)
            notes = conn.notes[v]
            for old in [u for u in conn.notes if u <= v]:
                del conn.notes[old]
            try:
                return self._fetch(conn, v, notes, out)
            except VersionGoneError as e:  # lapped: a newer version is (or will be) announced
                log.info("deepfreeze: stream %s: %s gone before it was read (%s); waiting for the next", self.channel,
                         v, e)
            except (StreamError, OSError) as e:
                if conn.stop.is_set():
                    return None
                log.warning("deepfreeze: stream %s: fetching %s failed (%s)", self.channel, v, e)
                self._drop_conn()
                self._next_scan = 0.0
                return None
        return None

    def _arrays(self, specs: Sequence[TensorSpec], out: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        if out is not None:
            for s in specs:
                a = out.get(s.name)
                if a is None or a.shape != tuple(s.shape) or fmt.dtype_name(a.dtype) != s.dtype or \
                        not a.flags.c_contiguous or not a.flags.writeable:
                    raise StreamError(f"out[{s.name!r}] must be a writable C-contiguous {s.dtype} array of shape "
                                      f"{tuple(s.shape)}")
            return out
        if self._out is None or [k for k in self._out] != [s.name for s in specs]:
            self._out = _aligned_arrays(specs)
        return self._out

    def _fetch(self, conn: _Conn, v: Version, notes: dict[int, dict[str, Any]],
               out: dict[str, np.ndarray] | None) -> Update:
        t0 = time.perf_counter()
        specs = conn.specs[:conn.model_tensors]
        direct = conn.direct if out is None else None  # views of the receive buffer: one copy less
        arrays = {} if direct is not None else self._arrays(specs, out)
        flats = [arrays[s.name].reshape(-1).view(np.uint8) for s in specs] if direct is None else []
        crcs: list[int] = [0] * conn.world
        errors: list[BaseException] = []

        def one(r: int) -> None:
            try:
                n = conn.prefixes[r]
                buf = self._staging.get(r)  # a receive buffer: TCP, or the views of a one-rank producer
                if (r not in conn.rings or direct is not None) and (buf is None or buf.size < n):
                    buf = self._staging[r] = np.empty(max(n, 1), np.uint8)
                if r in conn.rings and direct is None:  # slot -> the arrays, CRC in the same pass: one copy
                    got, crc = conn.rings[r].read_into(v, _pieces(conn.layouts[r], conn.model_tensors, flats, specs),
                                                       verify=self.verify)
                    self.bytes_by_tier["shm"] += n
                elif r in conn.rings:
                    got, crc, _ = conn.rings[r].read(v, out=buf[:n], verify=self.verify)
                    self.bytes_by_tier["shm"] += n
                else:
                    c = conn.fetchers.get(r)
                    if c is None:
                        from .wire import RankClient
                        c = conn.fetchers[r] = RankClient(conn.recs[r]["address"], self._token_value(),
                                                          channel=self.channel, timeout=self.io_timeout)
                    got, nb, crc = c.fetch(v, buf[:n])
                    if nb != n:
                        raise StreamError(f"rank {r} sent {nb} bytes of {v}, the plan says {n}")
                    self.bytes_by_tier["tcp"] += n
                if got != v:
                    raise VersionGoneError(f"rank {r} answered {got} for {v}")
                if int(crc) != int(notes[r]["crc"]):
                    raise StreamError(f"rank {r}'s shard of {v} has CRC {crc:#x}, its notification said "
                                      f"{int(notes[r]['crc']):#x}")
                crcs[r] = int(crc)
                if direct is not None:
                    for name, off, spec in direct:
                        arrays[name] = buf[off:off + spec.nbytes].view(fmt.numpy_dtype(spec.dtype)).reshape(spec.shape)
                elif r not in conn.rings:
                    _scatter(conn.layouts[r], conn.model_tensors, buf[:n], flats, specs)
            except BaseException as e:
                errors.append(e)

        if conn.world == 1:
            one(0)
        else:
            threads = [threading.Thread(target=one, args=(r,), name=f"deepfreeze-fetch-r{r}") for r in range(conn.world)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if errors:
            gone = [e for e in errors if isinstance(e, VersionGoneError)]
            raise (gone[0] if gone else errors[0])
        self.version = v
        last = max(notes.values(), key=lambda n: n.get("_recv", 0.0))
        return Update(v, arrays, "crc32:" + ",".join(f"{c:08x}" for c in crcs),
                      "shm" if len(conn.rings) == conn.world else "tcp" if not conn.rings else "shm+tcp",
                      notified_at=float(last.get("_recv", 0.0)), sent_at=float(last.get("t", 0.0)),
                      fetch_s=time.perf_counter() - t0, filled=out is not None)

    def _from_persistent(self, out: dict[str, np.ndarray] | None) -> Update | None:
        """The newest committed version on the persistent level, if newer than the live one."""
        if self.tier not in ("auto", "persistent"):
            return None
        from ..tiers.persistent import PersistentLevel
        from ..loader import load_persistent
        level = PersistentLevel(self.persistent)
        try:
            gen = level.generation(self.channel)
            versions = level.committed_versions(self.channel, gen)
        except (OSError, DeepFreezeError) as e:
            log.info("deepfreeze: stream %s: persistent level unreadable (%s)", self.channel, e)
            return None
        for step in sorted(versions, reverse=True):
            v = Version(gen, step)
            if self.version is not None and v <= self.version:
                return None
            t0 = time.perf_counter()
            try:
                m = level.read_manifest(self.channel, step)
                n = m.get("model_tensors", len(m["tensors"]))
                names = [t["name"] for t in m["tensors"][:n]]
                ck = load_persistent(level, self.channel, step, self.verify, names)
            except (OSError, DeepFreezeError, KeyError, TypeError, ValueError) as e:
                log.warning("deepfreeze: stream %s: %s on persistent unreadable (%s)", self.channel, v, e)
                continue
            arrays = {k: ck.arrays[k] for k in names}
            if out is not None:
                for k, a in arrays.items():
                    if k not in out or out[k].shape != a.shape or out[k].dtype != a.dtype:
                        raise StreamError(f"out[{k!r}] must be a {a.dtype} array of shape {a.shape}")
                    out[k][...] = a
                arrays = {k: out[k] for k in names}
            self.version = v
            self.bytes_by_tier["persistent"] += sum(a.nbytes for a in arrays.values())
            return Update(v, arrays, "persistent", "persistent", notified_at=time.time(),
                          fetch_s=time.perf_counter() - t0, filled=out is not None)
        return None


def _aligned_arrays(specs: Sequence[TensorSpec], align: int = 64) -> dict[str, np.ndarray]:
    """Arrays for ``specs`` carved from one buffer, each starting on an ``align``-byte boundary
    (frameworks can then borrow them without a copy; allocated once, reused for every update)."""
    sizes = [s.nbytes for s in specs]
    raw = np.empty(sum(n + (-n) % align for n in sizes) + align, np.uint8)
    pos = (-raw.ctypes.data) % align
    out = {}
    for s, n in zip(specs, sizes):
        out[s.name] = raw[pos:pos + n].view(fmt.numpy_dtype(s.dtype)).reshape(s.shape)
        pos += n + (-n) % align
    return out


def _direct_views(layout: FusedLayout, model_tensors: int,
                  specs: Sequence[TensorSpec]) -> list[tuple[str, int, TensorSpec]] | None:
    """(name, offset in the published bytes, spec) of every model tensor when each is one whole
    piece of ``layout`` (a one-rank producer), else None (the pieces must be scattered)."""
    seen: dict[int, int] = {}
    for s in layout.segments:
        tid = s.piece.tensor_id
        if tid >= model_tensors:
            continue
        spec = specs[tid]
        if tid in seen or s.piece.start != 0 or s.piece.stop != spec.size or s.nbytes != spec.nbytes:
            return None
        seen[tid] = s.offset - STAMP_BYTES
    if len(seen) != model_tensors:
        return None
    return [(specs[t].name, seen[t], specs[t]) for t in range(model_tensors)]


def _pieces(layout: FusedLayout, model_tensors: int, flats: list[np.ndarray],
            specs: Sequence[TensorSpec]) -> list[tuple[int, np.ndarray]]:
    """(offset in a rank's published bytes, the bytes of the whole tensors it fills) of each model
    piece of ``layout``, in offset order: :meth:`SlotRing.read_into`'s destinations."""
    out = []
    for s in layout.segments:
        tid = s.piece.tensor_id
        if tid < model_tensors:
            item = fmt.dtype_itemsize(specs[tid].dtype)
            out.append((s.offset - STAMP_BYTES, flats[tid][s.piece.start * item:s.piece.stop * item]))
    out.sort(key=lambda p: p[0])
    return out


def _scatter(layout: FusedLayout, model_tensors: int, data: np.ndarray, flats: list[np.ndarray],
             specs: Sequence[TensorSpec]) -> None:
    """Copy a rank's published bytes (its data region's model prefix) into the whole tensors."""
    for off, dst in _pieces(layout, model_tensors, flats, specs):
        dst[:] = data[off:off + dst.size]

