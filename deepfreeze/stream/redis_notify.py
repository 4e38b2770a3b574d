"""Optional Redis metadata and pub/sub notifications for the stream (the paper's choice).

Used when the configuration names a server (``redis = redis://host:port``); without it the
endpoints are 0600 files under ``<persistent>/<channel>`` and notes come from each rank's
:class:`~deepfreeze.stream.wire.RankServer`. The ``redis`` client package is imported only here,
lazily (``pip install deepfreeze[redis]``; missing: :class:`~deepfreeze.errors.ConfigError`).

Keys (``<channel>`` as given)::

    deepfreeze:stream:<channel>:endpoints   hash  r<rank> -> endpoint record (JSON object)
    deepfreeze:stream:<channel>:latest      hash  r<rank> -> newest note of that rank (JSON object)
    deepfreeze:stream:<channel>             pub/sub channel: every note (JSON object)

:meth:`RedisNotifier.notify` stores the note as the rank's latest, then publishes it, in one
MULTI/EXEC transaction: a consumer that subscribes and then reads :meth:`RedisListener.latest`
misses nothing. (The latest notes are one hash rather than one key per rank so a consumer reads
all ranks in one command.) :meth:`RedisListener.next_note` blocks in the client's socket read
with a timeout (push, no polling). Everything read from Redis is checked: a value that is not a
JSON object of at most 1 MiB, or a field that is not ``r<rank>``, is skipped and logged (another
writer's garbage never breaks the consumer).

**Authenticity.** Redis has no authentication of its own here, so anyone who can reach it could
rewrite an endpoint record (to redirect consumers) or publish notes. Every record and note
therefore carries ``"mac"``: HMAC-SHA256 under a key derived from the stream token
(``H(token, "deepfreeze-redis 1")``) over its context and its canonical JSON (sorted keys, no
spaces, ASCII), the context being ``<prefix>:endpoints/r<rank>`` for a record (a valid record
cannot be moved to another rank or channel) and ``<prefix>:note`` for a note. A value whose
MAC is missing or does not verify is ignored, never used, with one warning per key and cause
(not one per message). The socket handshake (:mod:`deepfreeze.net`) independently refuses a
server that does not know the token, so a forged record can at worst point to nothing; a
replayed old record or note of the same channel points to an older run, which the consumer
already tells apart by its run id and versions.

**Jobs.** A producer whose job has an id (``<persistent>/<channel>/job``,
:func:`deepfreeze.lease.read_job_id`) uses the keys ``deepfreeze:stream:<channel>:job:<id>``
(:func:`key_prefix`), and a consumer reads the id from the same file: two jobs of one user with
one channel name (and so one token) on one Redis never overwrite or read each other's records
and notes (the MAC's context is the key, so a record cannot be moved from one job's keys to the
other's either). A producer with a job id also writes everything under the channel's keys,
``deepfreeze:stream:<channel>``, for consumers that cannot read the id (another account's, whose
producer's persistent directory is ``0700``; a damaged ``job`` file): such a consumer reads the
channel's keys, with one warning, and there, as before job ids, two jobs with one channel name
on one Redis overwrite each other's records (it may reach either job's producer). Without a job
id (no ``job`` file) the channel's keys only.

A server that cannot be reached or that fails: :class:`~deepfreeze.errors.StreamError` naming
the URL (timeouts: :class:`~deepfreeze.errors.StreamTimeoutError`), the cause chained.
"""
from __future__ import annotations

import hmac
import json
import logging
import re
import time
from typing import Any, Mapping

from ..errors import ConfigError, StreamError, StreamTimeoutError
from ..jsonsafe import loads as bounded_loads
from ..lease import valid_job_id

__all__ = ["RedisNotifier", "RedisListener", "key_prefix", "safe_url", "MAX_VALUE"]

log = logging.getLogger("deepfreeze.stream")

#: largest note or endpoint record read from Redis
MAX_VALUE = 1 << 20
_RANK_FIELD = re.compile(r"r(0|[1-9][0-9]{0,8})")
_DEFAULT_TIMEOUT = 10.0


def key_prefix(channel: str, job: str | None = None) -> str:
    """``deepfreeze:stream:<channel>``, and ``:job:<job>`` after it for a producer of a job (the
    pub/sub channel; the hashes add ``:endpoints``/``:latest``). ``job``: the id of the job
    (``<persistent>/<channel>/job``, :func:`deepfreeze.lease.read_job_id`): two jobs of one user
    with one channel name (and one token) on one Redis never see each other's records or notes."""
    if not isinstance(channel, str) or not 0 < len(channel) <= 200 or not channel.isprintable() or any(
            c.isspace() for c in channel):
        raise ConfigError(f"stream channel {channel!r:.100}: expected 1..200 printable characters without spaces")
    if job is not None and not valid_job_id(job):
        raise ConfigError(f"stream job {job!r:.100}: not a job id (32 hex digits)")
    return f"deepfreeze:stream:{channel}" + (f":job:{job}" if job is not None else "")


def safe_url(url: Any) -> str:
    """``url`` without its password (``redis://user:secret@host`` -> ``redis://user:***@host``),
    for messages and logs."""
    text = str(url)[:300]
    return re.sub(r"(//[^/@:]*:)[^/@]*@", r"\1***@", text)


def _redis() -> Any:
    try:
        import redis
    except ImportError as e:
        raise ConfigError("the configuration names a Redis server but the 'redis' package is not installed: "
                          "pip install 'deepfreeze[redis]' (or 'redis'), or remove the redis setting to use the "
                          "embedded notifications") from e
    return redis


def _connect(url: str, timeout: float) -> tuple[Any, Any]:
    redis = _redis()
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"redis URL {safe_url(url)!r}: expected redis://host:port[/db] (or rediss://, unix://)")
    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        client.ping()
    except (ValueError, TypeError) as e:
        raise ConfigError(f"redis URL {safe_url(url)!r}: {e}") from e
    except redis.RedisError as e:
        raise _error(redis, e, f"cannot reach the Redis server {safe_url(url)} ({e}); is it running there?") from e
    return redis, client


def _error(redis: Any, e: BaseException, message: str) -> StreamError:
    cls = StreamTimeoutError if isinstance(e, (redis.TimeoutError, TimeoutError)) else StreamError
    return cls(message)


def _mac_key(token: str) -> bytes:
    if not isinstance(token, str) or not token:
        raise ConfigError("the Redis notifications need the stream token (deepfreeze.net.load_token()) to "
                          "authenticate their records and notes")
    return hmac.new(token.encode(), b"deepfreeze-redis 1", "sha256").digest()


def _mac(key: bytes, context: str, body: Mapping[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hmac.new(key, context.encode() + b"\0" + canonical.encode(), "sha256").hexdigest()


def _sealed(key: bytes, context: str, obj: Mapping[str, Any]) -> str:
    """``obj`` as JSON with its ``"mac"`` (see the module doc)."""
    body = {k: v for k, v in obj.items() if k != "mac"}
    return json.dumps({**body, "mac": _mac(key, context, body)}, separators=(",", ":"))


class _Reader:
    """Decoding and verification of what comes from Redis, warning once per key and cause."""

    def __init__(self, token: str) -> None:
        self._key = _mac_key(token)
        self._warned: set[tuple[str, str]] = set()
        self.ignored = 0  #: values skipped (malformed, or a MAC that does not verify)

    def skip(self, key: str, cause: str, message: str, *args: Any) -> None:
        self.ignored += 1
        if (key, cause) not in self._warned:
            self._warned.add((key, cause))
            log.warning("stream: " + message + " (warned once for this key)", *args)

    def decode(self, raw: Any, what: str, context: str) -> dict[str, Any] | None:
        """A JSON object from Redis whose MAC verifies (without its "mac"), or None (warned once)."""
        if not isinstance(raw, (bytes, str)) or len(raw) > MAX_VALUE:
            self.skip(what, "size", "%s is not a string of at most %d bytes: ignored", what, MAX_VALUE)
            return None
        try:  # size and nesting bounded before parsing
            obj = bounded_loads(raw, what, max_bytes=MAX_VALUE, error=StreamError, advice="damaged or not DeepFreeze's")
        except StreamError as e:
            self.skip(what, "json", "%s is not valid JSON (%s): ignored", what, e)
            return None
        if not isinstance(obj, dict):
            self.skip(what, "json", "%s is not a JSON object: ignored", what)
            return None
        mac = obj.pop("mac", None)
        if not isinstance(mac, str) or not hmac.compare_digest(mac.encode("ascii", "replace"),
                                                               _mac(self._key, context, obj).encode()):
            self.skip(what, "mac", "%s has no valid MAC: written by someone without the stream token (or with "
                      "another token): ignored", what)
            return None
        return obj

    def by_rank(self, items: Mapping[Any, Any], what: str, hash_key: str) -> dict[int, dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        for field, raw in items.items():
            name = field.decode("utf-8", "replace") if isinstance(field, bytes) else str(field)
            m = _RANK_FIELD.fullmatch(name)
            if m is None:
                self.skip(f"{what} {name[:100]}", "field", "field %r of %s is not r<rank>: ignored", name[:100], what)
                continue
            context = f"{hash_key}/{name}" if hash_key.endswith(":endpoints") else hash_key
            obj = self.decode(raw, f"{what} {name}", context)
            if obj is not None:
                if hash_key.endswith(":note") and obj.get("rank") != int(m.group(1)):
                    self.skip(f"{what} {name}", "rank", "%s %s names rank %r: ignored", what, name, obj.get("rank"))
                    continue
                out[int(m.group(1))] = obj
        return out


class RedisNotifier:
    """Producer side, one per rank: registers the rank's endpoint and publishes its notes.

    ``url``: ``redis://host:port[/db]``; ``channel``: the stream's channel (checkpoint name);
    ``token``: the stream token (records and notes are MACed with it).
    ``timeout`` bounds every command (:class:`StreamTimeoutError`). ``job``: the producer's job
    id: records and notes go under the job's keys, and also under the channel's keys for
    consumers that cannot read the id (see the module docstring)."""

    def __init__(self, url: str, channel: str, *, token: str, timeout: float = _DEFAULT_TIMEOUT,
                 job: str | None = None) -> None:
        self.url, self.channel, self.prefix = safe_url(url), channel, key_prefix(channel, job)
        #: every prefix written: the job's, then the channel's (None: the channel's only)
        self.prefixes = [self.prefix] + ([key_prefix(channel)] if job is not None else [])
        self._key = _mac_key(token)
        self._redis, self._client = _connect(url, timeout)  # self.url: the URL without its password

    def register(self, rank: int, endpoint: Mapping[str, Any]) -> None:
        """Store ``endpoint`` (a JSON-able mapping: address, node, ring path, ...) as rank ``rank``'s."""
        field = self._field(rank)
        pipe = self._client.pipeline(transaction=True)
        for prefix in self.prefixes:
            pipe.hset(f"{prefix}:endpoints", field, _sealed(self._key, f"{prefix}:endpoints/{field}", endpoint))
        self._exec("register", pipe)

    def unregister(self, rank: int) -> None:
        """Remove rank ``rank``'s endpoint and latest note (at the producer's clean close)."""
        pipe = self._client.pipeline(transaction=True)
        for prefix in self.prefixes:
            pipe.hdel(f"{prefix}:endpoints", self._field(rank))
            pipe.hdel(f"{prefix}:latest", self._field(rank))
        self._exec("unregister", pipe)

    def notify(self, note: Mapping[str, Any]) -> None:
        """Record ``note`` as its rank's latest, then publish it (one transaction, one round trip).
        ``note["rank"]`` names the rank (the note of :meth:`RankServer.notify` has it)."""
        rank = note.get("rank")
        field = self._field(rank)
        pipe = self._client.pipeline(transaction=True)
        for prefix in self.prefixes:
            data = _sealed(self._key, f"{prefix}:note", note)
            pipe.hset(f"{prefix}:latest", field, data)
            pipe.publish(prefix, data)
        self._exec("notify", pipe)

    def close(self) -> None:
        """Close the connections."""
        self._client.close()

    def __enter__(self) -> "RedisNotifier":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @staticmethod
    def _field(rank: Any) -> str:
        if type(rank) is not int or not 0 <= rank < 1 << 24:
            raise ValueError(f"rank {rank!r}: expected an integer >= 0")
        return f"r{rank}"

    def _run(self, what: str, cmd: str, *args: Any) -> Any:
        try:
            return getattr(self._client, cmd)(*args)
        except self._redis.RedisError as e:
            raise _error(self._redis, e, f"stream {self.channel!r}: {what} on the Redis server {self.url} failed: "
                                         f"{e}") from e

    def _exec(self, what: str, pipe: Any) -> Any:
        try:
            return pipe.execute()
        except self._redis.RedisError as e:
            raise _error(self._redis, e, f"stream {self.channel!r}: {what} on the Redis server {self.url} failed: "
                                         f"{e}") from e


class RedisListener:
    """Consumer side: reads the endpoints and latest notes, receives notes by pub/sub.

    Subscribed when the constructor returns (it waits for the server's confirmation), so every
    note published afterwards is received; :meth:`latest` gives what came before. ``token``: the
    stream token; records and notes whose MAC does not verify under it are ignored (one warning
    per key and cause; :attr:`ignored` counts them)."""

    def __init__(self, url: str, channel: str, *, token: str, timeout: float = _DEFAULT_TIMEOUT,
                 job: str | None = None) -> None:
        self.url, self.channel, self.prefix = safe_url(url), channel, key_prefix(channel, job)
        self.job = job  #: the job whose records and notes this listener reads (None: no job id)
        self.timeout = timeout
        self._reader = _Reader(token)
        self._redis, self._client = _connect(url, timeout)  # self.url: the URL without its password
        self._pubsub = self._client.pubsub()
        try:
            self._pubsub.subscribe(self.prefix)
            deadline = time.monotonic() + timeout
            while True:  # the confirmation, within the timeout (each read blocks in the socket)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StreamTimeoutError(f"the Redis server {self.url} did not confirm the subscription to "
                                             f"{self.prefix} within {timeout:g}s")
                msg = self._pubsub.get_message(timeout=left)
                if msg is not None and msg.get("type") == "subscribe":
                    break
        except self._redis.RedisError as e:
            self.close()
            raise _error(self._redis, e, f"subscribing to {self.prefix} on the Redis server {self.url} failed: {e}") from e
        except BaseException:
            self.close()
            raise

    def endpoints(self) -> dict[int, dict[str, Any]]:
        """rank -> endpoint record, for every registered rank."""
        return self._reader.by_rank(self._cmd("hgetall", f"{self.prefix}:endpoints"), f"{self.prefix}:endpoints",
                                    f"{self.prefix}:endpoints")

    def latest(self) -> dict[int, dict[str, Any]]:
        """rank -> that rank's newest note (to catch up at start)."""
        return self._reader.by_rank(self._cmd("hgetall", f"{self.prefix}:latest"), f"{self.prefix}:latest",
                                    f"{self.prefix}:note")

    def next_note(self, timeout: float | None) -> dict[str, Any] | None:
        """The next published note, or ``None`` when none came within ``timeout`` seconds
        (``None``: as long as it takes). Blocks in the socket read (push, no polling). A message
        that is not a JSON object is skipped (logged). The server gone: :class:`StreamError`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 3600.0 if deadline is None else deadline - time.monotonic()
            if left < 0:
                return None
            try:
                msg = self._pubsub.get_message(timeout=left)
            except self._redis.RedisError as e:
                raise _error(self._redis, e, f"notifications of {self.prefix} from the Redis server {self.url}: "
                                             f"{e}") from e
            if msg is None:
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            if msg.get("type") != "message":
                continue
            note = self._reader.decode(msg.get("data"), f"a message on {self.prefix}", f"{self.prefix}:note")
            if note is not None:
                return note

    @property
    def ignored(self) -> int:
        """Values read from Redis and ignored so far (malformed, or a MAC that does not verify)."""
        return self._reader.ignored

    def fileno(self) -> int | None:
        """The pub/sub socket's descriptor (for ``select``), or None when not connected."""
        conn = getattr(self._pubsub, "connection", None)
        sock = getattr(conn, "_sock", None)
        return None if sock is None else sock.fileno()

    def close(self) -> None:
        """Unsubscribe and close the connections."""
        try:
            self._pubsub.close()
        except Exception:  # closing a broken connection: nothing left to do
            pass
        self._client.close()

    def __enter__(self) -> "RedisListener":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _cmd(self, cmd: str, *args: Any) -> Any:
        try:
            return getattr(self._client, cmd)(*args)
        except self._redis.RedisError as e:
            raise _error(self._redis, e, f"{cmd} of {args[0]} on the Redis server {self.url} failed: {e}") from e
