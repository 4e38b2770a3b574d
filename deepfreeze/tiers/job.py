"""The flush job: what the writer hands the flusher (the node's backend, or itself in sync mode).

A :class:`FlushJob` is one rank's shard of one version, to be flushed from where the writer put
it (its *source*: a scratch file, a memory-tier slot, or persistent's partial file for a version
written once) to persistent, with the policy the flush applies (interval, retention, lease,
priority). It is the one thing that crosses the backend's socket (:mod:`deepfreeze.backend`:
``{"op": "flush", "job": job.encode()}``); the backend rebuilds it with :meth:`FlushJob.decode`
at the socket, and sync mode hands the object itself to :func:`deepfreeze.tiers.flush.flush_job`.
:meth:`FlushJob.decode` checks every field (type, range, length; paths without NUL; the JSON
objects it carries walked with a bound: on a backend connection, only the manifest's entries that
differ from the last job's, ``seen``), refuses unknown and missing keys, and raises nothing
but :class:`~deepfreeze.errors.CheckpointWriteError` (``EINVAL``), whatever the input (fuzzed:
``test_fuzz_flush_job`` in tests/fuzz/test_fuzz_decoders.py). The constructor checks the scalar
fields the same way. A change of the fields or of their encoding is a new
:data:`deepfreeze.backend.PROTOCOL`.

The encoding, a JSON object (``?``: may be left out, the default in brackets)::

    name                str    [a-zA-Z0-9_.]+, at most 200 characters, not . or ..
    version, rank       int    0 <= version < 2**63, 0 <= rank < 2**31
    scratch, persistent str    1 to 4096 characters, no NUL (the levels' roots)
    persistent_interval float  finite (seconds; < 0: nothing goes to persistent)
    keep_scratch        int    0 <= n < 2**31 (0: keep all)
    keep_persistent     int    0 <= n < 2**31 (0: keep all)
    manifest            object the version's manifest: str keys, depth <= 32, <= 2**22 values,
                               strings <= 2**20 characters (its schema: levels.plan_of at the flush)
    run?                str    16 lowercase hex digits [the anonymous run, 0 * 16]
    lease_timeout?      float  finite, > 0 [60]
    shared_group?       bool   [false]
    watchdog_interval?  float  finite, >= 0 [0: off]
    t?                  float  finite, >= 0, or null: the rank's monotonic time of the call [null]
    interval?           float  finite, >= 0, or null: seconds since the rank's previous call [null]
    priority?           str    "low" or "normal" [low]
    fsync?              bool   [true]
    memtier? | direct?  object the source's spec, under its kind's name; none: the scratch file
    manifest_same?      list   keys of the manifest taken from the last job the connection accepted
                               (not sent again: FlushJob.encode/decode's ``last``); a job naming it
                               on a connection with no job accepted yet is refused

The source table. How a flush reads the shard depends on the tier that holds it: each tier
registers its source kind here (:func:`register`) from the module that defines it: ``scratch``
(the default kind, no spec: the rank's shard file), ``memtier`` (a DONE slot of a memory-tier
device; spec :class:`deepfreeze.tiers.memtier.SlotSource`), ``direct`` (written once into
persistent's partial: no copy; spec the write-once record ``{"nonce", "has_crc", "crc32"}``, the
rank's piece CRCs as one base64 record, :func:`deepfreeze.format.encode_crcs`).
A kind's spec travels under the key named like the kind, a job names at most one; the flush looks
the kind up (:func:`source`) and opens the shard with its ``open`` (none: nothing to copy).
"""
from __future__ import annotations

import dataclasses
import errno
import math
import re
from typing import Any, Callable, ContextManager, Mapping

from ..errors import CheckpointWriteError

__all__ = ["FlushJob", "Source", "register", "source", "sources", "SCRATCH", "json_object", "bad"]

#: the default source kind: the rank's shard file on scratch
SCRATCH = "scratch"

_NAME = re.compile(r"^[a-zA-Z0-9_.]{1,200}$")
_RUN = re.compile(r"^[0-9a-f]{16}$")
_ANONYMOUS_RUN = "0" * 16  # deepfreeze.format.ANONYMOUS_RUN (this module imports nothing but errors)
_MAX_PATH = 4096
_MAX_DEPTH = 32          # deepfreeze.jsonsafe.MAX_JSON_DEPTH: what a backend message may hold at all
_MAX_VALUES = 1 << 22
_MAX_STRING = 1 << 20


def bad(why: str) -> CheckpointWriteError:
    """The error of a malformed flush job (``EINVAL``)."""
    return CheckpointWriteError(errno.EINVAL, f"malformed flush job: {why}")


# ----------------------------------------------------------------------------- the source table

@dataclasses.dataclass(frozen=True)
class Source:
    """A source kind of the table: ``decode(spec, job)`` checks the spec that crossed the socket
    (``job``: the rest of the job, already checked) and returns the typed spec, raising only
    :func:`bad`'s error; ``encode(spec)`` is its JSON object (``None`` for both: the kind has no
    spec); ``open(shard_path, spec)``: a context manager of ``(fd, base, index, label, recheck)``
    (see :func:`deepfreeze.tiers.flush.flush_job`), ``None`` where the shard is already in
    persistent's partial; ``scratch_files``: whether the version has files on scratch that the
    flush's scratch retention counts."""

    kind: str
    open: "Callable[[str | None, Any], ContextManager[Any]] | None" = None
    decode: "Callable[[Any, FlushJob], Any] | None" = None
    encode: "Callable[[Any], dict[str, Any]] | None" = None
    scratch_files: bool = True


_SOURCES: dict[str, Source] = {}


def register(kind: str, *, open: "Callable[[str | None, Any], ContextManager[Any]] | None" = None,
             decode: "Callable[[Any, FlushJob], Any] | None" = None,
             encode: "Callable[[Any], dict[str, Any]] | None" = None, scratch_files: bool = True) -> Source:
    """Register (or replace: a module imported again) the source kind ``kind``; what a tier calls
    when its module is imported. Returns the entry."""
    if not isinstance(kind, str) or not re.match(r"^[a-z][a-z0-9_]{0,31}$", kind) \
            or (decode is not None and kind in _FIELDS):
        raise ValueError(f"source kind {kind!r}: a short lowercase name (one with a spec: not a FlushJob field)")
    if (decode is None) != (encode is None) or (kind == SCRATCH and decode is not None):
        raise ValueError(f"source kind {kind!r}: decode and encode go together (the scratch kind has no spec)")
    entry = _SOURCES[kind] = Source(kind, open, decode, encode, scratch_files)
    return entry


def source(kind: str) -> Source:
    """The registered source kind ``kind``; :func:`bad`'s error if none is."""
    try:
        return _SOURCES[kind]
    except (KeyError, TypeError):
        raise bad(f"unknown source kind {str(kind)[:40]!r} (registered: {', '.join(sorted(_SOURCES))}; "
                  "is the module of its tier imported?)") from None


def sources() -> dict[str, Source]:
    """The table: kind -> entry (a copy)."""
    return dict(_SOURCES)


# ----------------------------------------------------------------------------- checks

def _int(v: Any, what: str, hi: int) -> int:
    if type(v) is not int or not 0 <= v < hi:
        raise bad(f"{what}: an int in [0, {hi}) expected, got {_show(v)}")
    return v


def _float(v: Any, what: str, *, lo: float | None = None, above: float | None = None,
           null: bool = False) -> float | None:
    if v is None and null:
        return None
    if type(v) not in (int, float) or not math.isfinite(v) or (lo is not None and v < lo) \
            or (above is not None and not v > above):
        rng = f" >= {lo:g}" if lo is not None else f" > {above:g}" if above is not None else ""
        raise bad(f"{what}: a finite number{rng}{' or null' if null else ''} expected, got {_show(v)}")
    return float(v)


def _path(v: Any, what: str) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= _MAX_PATH or "\x00" in v:
        raise bad(f"{what}: a path of 1 to {_MAX_PATH} characters without NUL expected, got {_show(v)}")
    return v


def _bool(v: Any, what: str) -> bool:
    if type(v) is not bool:
        raise bad(f"{what}: true or false expected, got {_show(v)}")
    return v


def _show(v: Any) -> str:
    try:
        s = repr(v) if not isinstance(v, (dict, list)) else f"a {type(v).__name__} of {len(v)}"
    except Exception:  # (a repr that raises: never from JSON)
        s = type(v).__name__
    return s[:80]


def json_object(v: Any, what: str, *, max_depth: int = _MAX_DEPTH, max_values: int = _MAX_VALUES,
                seen: "dict[str, tuple[Any, int]] | None" = None) -> dict[str, Any]:
    """``v`` if it is a JSON object within the bounds (str keys; lists, str, finite numbers, bools,
    null inside; ``max_depth`` nesting; ``max_values`` values; strings of at most 2**20
    characters); else :func:`bad`'s error. Iterative, one iterator per level: no recursion, and
    memory bounded by the depth, whatever ``v`` holds.

    ``seen``: for objects parsed from JSON only (the backend's flush messages, one per version of
    a rank's manifest, most of it the same each time), a dict the caller keeps between calls with
    the same bounds, empty at first: an entry of ``v`` equal (``==``) to the entry of the last
    object accepted with it is not walked again, since JSON values that compare equal have the
    same shape, keys and strings, and numbers of the same value (its values are counted as they
    were). The one pair of JSON values that compare equal and fall on either side of a bound, an
    integer and a float of the same value beyond the integers' range, cannot pass: an entry
    holding such a float is not kept. An entry equal to the last one is replaced in ``v`` by that
    object (so one run's manifests share their constant parts, and
    :func:`deepfreeze.tiers.base.plan_of` finds its plan by identity). On success ``seen`` holds
    ``v``'s entries (references, not copies: one object's worth)."""
    if type(v) is not dict:
        raise bad(f"{what}: a JSON object expected, got {_show(v)}")
    count = 1
    kept: dict[str, tuple[Any, int]] = {}
    for k, entry in v.items():
        if type(k) is not str or len(k) > _MAX_STRING:
            raise bad(f"{what}: a key that is not a string of at most {_MAX_STRING} characters")
        before = seen.get(k) if seen is not None else None
        if before is not None and before[0] == entry:
            n, beyond = before[1], False
            v[k] = entry = before[0]  # the last job's object: equal, and caches keyed by it hit (plan_of)
        else:
            n, beyond = _walk(entry, what, max_depth, max_values, max_values - count)
        count += n
        if count > max_values:
            raise bad(f"{what}: more than {max_values} values")
        if not beyond:
            kept[k] = (entry, n)
    if seen is not None:
        seen.clear()
        seen.update(kept)
    return v


def _walk(v: Any, what: str, max_depth: int, max_values: int, left: int) -> tuple[int, bool]:
    """Check one entry of a JSON object (:func:`json_object`'s bounds; the object is depth 1, and
    ``left`` of its ``max_values`` are left for the entry): the number of values in it, and
    whether it holds a float beyond the integers' range."""
    def container(node: Any) -> Any:
        if type(node) is dict:
            for k in node:
                if type(k) is not str or len(k) > _MAX_STRING:
                    raise bad(f"{what}: a key that is not a string of at most {_MAX_STRING} characters")
            return iter(node.values())
        return iter(node)
    stack = [iter((v,))]
    count = 0
    beyond = False
    while stack:
        for node in stack[-1]:
            count += 1
            if count > left:
                raise bad(f"{what}: more than {max_values} values")
            t = type(node)
            if t is dict or t is list:
                if len(stack) + 1 > max_depth:
                    raise bad(f"{what}: nested deeper than {max_depth}")
                stack.append(container(node))
                break
            if t is str:
                if len(node) > _MAX_STRING:
                    raise bad(f"{what}: a string longer than {_MAX_STRING} characters")
            elif t is float:
                if not math.isfinite(node):
                    raise bad(f"{what}: a number that is not finite")
                if not -(1 << 63) <= node < (1 << 64):
                    beyond = True
            elif t is int:
                if not -(1 << 63) <= node < (1 << 64):
                    raise bad(f"{what}: an integer outside [-2**63, 2**64)")
            elif t is not bool and node is not None:
                raise bad(f"{what}: a value of type {t.__name__} is not JSON")
        else:
            stack.pop()
    return count, beyond


# ----------------------------------------------------------------------------- the job

@dataclasses.dataclass(frozen=True)
class FlushJob:
    """One rank's shard of one version to flush (the fields and their bounds: the module
    docstring). Built by the writer (:class:`deepfreeze.engine.Engine`), run by
    :func:`deepfreeze.tiers.flush.flush_job`; ``source`` is a registered kind (:func:`register`) and
    ``spec`` its typed spec (``None`` for ``scratch``). The constructor checks the scalar fields;
    :meth:`decode` also walks the JSON objects and the spec."""

    name: str
    version: int
    rank: int
    scratch: str
    persistent: str
    persistent_interval: float
    keep_scratch: int
    keep_persistent: int
    manifest: dict[str, Any]
    run: str = _ANONYMOUS_RUN
    lease_timeout: float = 60.0
    shared_group: bool = False
    watchdog_interval: float = 0.0
    t: float | None = None
    interval: float | None = None
    priority: str = "low"
    fsync: bool = True
    source: str = SCRATCH
    spec: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name) or self.name in (".", ".."):
            raise bad(f"name: [a-zA-Z0-9_.]+ of at most 200 characters, not . or .., expected, got {_show(self.name)}")
        _int(self.version, "version", 1 << 63)
        _int(self.rank, "rank", 1 << 31)
        _path(self.scratch, "scratch")
        _path(self.persistent, "persistent")
        _int(self.keep_scratch, "keep_scratch", 1 << 31)
        _int(self.keep_persistent, "keep_persistent", 1 << 31)
        if type(self.manifest) is not dict:
            raise bad(f"manifest: a JSON object expected, got {_show(self.manifest)}")
        if not isinstance(self.run, str) or not _RUN.match(self.run):
            raise bad(f"run: 16 lowercase hex digits expected, got {_show(self.run)}")
        _bool(self.shared_group, "shared_group")
        _bool(self.fsync, "fsync")
        if self.priority not in ("low", "normal"):
            raise bad(f"priority: 'low' or 'normal' expected, got {_show(self.priority)}")
        floats = {"persistent_interval": _float(self.persistent_interval, "persistent_interval"),
                  "lease_timeout": _float(self.lease_timeout, "lease_timeout", above=0.0),
                  "watchdog_interval": _float(self.watchdog_interval, "watchdog_interval", lo=0.0),
                  "t": _float(self.t, "t", lo=0.0, null=True),
                  "interval": _float(self.interval, "interval", lo=0.0, null=True)}
        for k, v in floats.items():  # an int given for a float field is stored as the float
            if v is not None and type(getattr(self, k)) is not float:
                object.__setattr__(self, k, v)
        kind = source(self.source)
        if (self.spec is None) != (kind.decode is None):
            raise bad(f"source {self.source!r}: " + ("a spec expected" if self.spec is None else "takes no spec"))

    def encode(self, last: "dict[str, Any] | None" = None) -> dict[str, Any]:
        """The job as a JSON object (what :meth:`decode` reads back). ``last``: the manifest of the
        last job the same reader accepted (a backend connection's): the entries of the manifest
        equal to its entries are named in ``manifest_same`` instead of sent again (a run's
        tensors and plan, hundreds of kilobytes with thousands of tensors, go once per
        connection); :meth:`decode` with the same ``last`` rebuilds the manifest."""
        obj = {f: getattr(self, f) for f in _FIELDS}
        if last is not None:
            m = self.manifest
            same = [k for k, v in m.items() if k in last and (last[k] is v or last[k] == v)]
            if same:
                kept = set(same)
                obj["manifest"] = {k: v for k, v in m.items() if k not in kept}
                obj["manifest_same"] = same
        if self.spec is not None:
            obj[self.source] = source(self.source).encode(self.spec)
        return obj

    @classmethod
    def decode(cls, obj: Any, *, seen: "dict[str, tuple[Any, int]] | None" = None,
               last: "dict[str, Any] | None" = None) -> "FlushJob":
        """The job ``obj`` (JSON that crossed a socket: nothing trusted) encodes; every field
        checked, unknown and missing keys refused. Raises only :class:`CheckpointWriteError`.
        ``seen``: for ``obj`` parsed from JSON, a dict the caller keeps for the jobs of one
        connection: the parts of the manifest equal to the last one's are not walked again
        (:func:`json_object`; the same answer, a fraction of the time). ``last``: the manifest of
        the last job accepted on the connection (:meth:`encode`'s ``last``): a job naming
        ``manifest_same`` takes those entries from it (each a key of ``last`` and not sent again);
        without ``last`` such a job is refused."""
        if not isinstance(obj, Mapping):
            raise bad(f"a JSON object expected, got {_show(obj)}")
        if "manifest_same" in obj:
            obj = _rebuild(obj, last)
        keys = set(obj)
        kinds = [k for k in keys if isinstance(k, str) and k in _SOURCES and _SOURCES[k].decode is not None]
        unknown = keys - set(_FIELDS) - set(kinds)
        if unknown:
            raise bad(f"unknown key(s) {sorted(str(k)[:40] for k in unknown)[:8]}")
        missing = [k for k in _REQUIRED if k not in keys]
        if missing:
            raise bad(f"missing key(s) {missing}")
        if len(kinds) > 1:
            raise bad(f"more than one source ({sorted(kinds)})")
        json_object(obj["manifest"], "manifest", seen=seen)
        try:
            job = cls(**{f: obj[f] for f in _FIELDS if f in keys})
        except TypeError as e:  # (not reached: every key is a field)
            raise bad(str(e)) from None
        if not kinds:
            return job
        kind = source(kinds[0])
        spec = kind.decode(obj[kind.kind], job)
        return dataclasses.replace(job, source=kind.kind, spec=spec)


def _rebuild(obj: Mapping, last: "dict[str, Any] | None") -> dict[str, Any]:
    """``obj`` with its manifest whole again: the entries ``manifest_same`` names taken from
    ``last`` (the connection's last accepted manifest). Refused: no ``last``, a name that is not a
    string key of ``last``, a name twice or also sent, a manifest that is not an object."""
    same, sent = obj["manifest_same"], obj.get("manifest")
    if last is None:
        raise bad("manifest_same names parts of an earlier manifest, but no job was accepted on this connection "
                  "before: send the whole manifest")
    if type(same) is not list or len(same) > len(last) or type(sent) is not dict:
        raise bad(f"manifest_same: a list of at most {len(last)} keys and a manifest object expected")
    names = set()
    for k in same:
        if type(k) is not str or k not in last or k in sent or k in names:
            raise bad(f"manifest_same: {_show(k)} is not a key of the last manifest, or it is sent or named twice")
        names.add(k)
    out = {k: v for k, v in obj.items() if k != "manifest_same"}
    out["manifest"] = {**{k: last[k] for k in same}, **sent}
    return out


#: the fields that travel as themselves (the source travels as its spec, under its kind's key)
_FIELDS = tuple(f.name for f in dataclasses.fields(FlushJob) if f.name not in ("source", "spec"))
_REQUIRED = tuple(f.name for f in dataclasses.fields(FlushJob) if f.default is dataclasses.MISSING)
