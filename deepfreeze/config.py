"""VeloC-compatible configuration: one validated :class:`Config` object.

DeepFreeze reads the same INI file VeloC reads (``key = value`` lines, ``#``
comments, no sections), so one file drives the built-in engine and a site's
VeloC alike. Precedence, lowest first: the file, then ``VELOC_<KEY>``
environment variables (as VeloC does), then keyword overrides given in code
(``DeepFreezeCheckpoint(scratch=...)``). Unknown keys and bad values raise
:class:`~deepfreeze.errors.ConfigError` naming the key, the source and the fix.

No file is needed to start: without one, ``mode`` defaults to ``async`` and ``scratch`` to
``$DEEPFREEZE_SCRATCH``, else ``/var/tmp/deepfreeze-<uid>/scratch`` (disk-backed: ``/tmp`` is
RAM on many systems), created owner-only when the configuration is loaded (a directory of that
name another user made first is refused by name); only ``persistent`` must be given. A file keeps
VeloC's rule: ``mode``, ``scratch`` and ``persistent`` are mandatory in it.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import stat
from typing import Any, Mapping

from . import node as _node
from .errors import ConfigError

__all__ = ["Config", "KEYS", "VELOC_ONLY", "NO_FILE", "default_scratch", "validate_name", "did_you_mean"]

#: the source of a configuration given without a file (keyword arguments, ``VELOC_<KEY>``, defaults)
NO_FILE = "keyword arguments"
#: the environment variable naming the scratch directory when no file sets one
SCRATCH_ENV = "DEEPFREEZE_SCRATCH"

#: every key DeepFreeze understands, with a one-line meaning (see docs/configuration.md)
KEYS: dict[str, str] = {
    "mode": "sync | async (mandatory in a file; async without one): flush in the client (blocking) or in a per-node backend process",
    "scratch": "node-local directory for the first-level checkpoint (mandatory in a file; without one "
               "$DEEPFREEZE_SCRATCH, else /var/tmp/deepfreeze-<uid>/scratch)",
    "persistent": "shared directory (parallel file system) for assembled checkpoints (mandatory)",
    "persistent_interval": "seconds between versions flushed to persistent; 0 = every version, -1 = never",
    "ec_interval": "seconds between versions protected by partner/erasure coding; 0 = every version, -1 = off",
    "ec_scheme": "xor | partner: how the built-in engine protects scratch across failure domains (DeepFreeze key)",
    "ec_group_size": "xor: at most this many ranks, each of another failure domain, per parity group (>= 3; "
                     "0 = all domains in one group) (DeepFreeze key)",
    "max_versions": "versions kept per level; 0 = keep all",
    "scratch_versions": "versions kept on scratch (overrides max_versions there); 0 = use max_versions",
    "chksum": "true | false: CRC32 of every shard piece, verified on restore",
    "meta": "directory for VeloC's checksum metadata (VeloC engine); the built-in engine keeps checksums in its index",
    "failure_domain": "name of the failure domain (node) of this process; default: host name",
    "watchdog_interval": "seconds: the backend reports a rank that sent no checkpoint for this long; 0 = off",
    "max_inflight": "versions of a rank handed to its writer thread and not yet on scratch; one more waits (DeepFreeze key)",
    "lease_timeout": "seconds without a heartbeat after which a run's lease on a name is stale (DeepFreeze key)",
    "shared_group": "true | false: scratch/persistent may be group-writable (you trust every group member) (DeepFreeze key)",
    "axl_type": "VeloC AXL transfer type (VeloC engine only)",
    "backend_timeout": "seconds without an answer after which the backend is declared dead and replaced (DeepFreeze key)",
    "redis": "redis://host:port[/db]: a Redis server for the stream's metadata and notifications (DeepFreeze key)",
    "memtier": "path of a memory-tier device (deepfreeze memtier create): shards go there instead of scratch files "
               "(DeepFreeze key)",
    "memtier_slots": "slots per (model, shard) on the memory-tier device, >= 2: the newest DONE version is never "
                     "overwritten, more slots let flushes to persistent lag further (DeepFreeze key)",
    "write_once": "auto | on | off: a version decided 'flush' is written by the writer thread straight into the "
                  "persistent level (no scratch file read back and copied); auto: when scratch and persistent are "
                  "on the same file system (DeepFreeze key)",
    "background_priority": "low | normal: the writer's and the backend's background work runs at nice +10 and I/O "
                           "best-effort 7 until it would end over half an interval late or is waited for (low), or at normal "
                           "priority (DeepFreeze key)",
}

#: keys only VeloC acts on; accepted so a site's VeloC file parses, passed to VeloC as written
VELOC_ONLY: dict[str, str] = {
    "threaded": "true | false: VeloC runs its backend in the client process (needs MPI_THREAD_MULTIPLE)",
    "aggregated": "true | false: VeloC writes one aggregated file per version on persistent (needs meta)",
    "log_prefix": "directory for VeloC's client and backend logs (default /dev/shm)",
    "max_parallelism": "VeloC backend: concurrent transfers",
    "daos_pool": "VeloC: DAOS pool for persistent (VeloC built with DAOS)",
    "daos_cont": "VeloC: DAOS container for persistent (VeloC built with DAOS)",
}
KEYS.update(VELOC_ONLY)

_NAME_RE = re.compile(r"^[A-Za-z0-9_.]+$")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def validate_name(name: str, what: str = "checkpoint name") -> str:
    """Return ``name`` if it is a safe VeloC name (``[a-zA-Z0-9_.]+``, not ``.``/``..``)."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or name in (".", "..") or len(name) > 200:
        raise ConfigError(
            f"invalid {what} {name!r}: it must match [a-zA-Z0-9_.]+ (VeloC's rule, and it "
            f"becomes a directory name), be at most 200 characters and not be '.' or '..'; "
            f"pick e.g. 'nt3' or 'resnet50_run2'"
        )
    return name


@dataclasses.dataclass(frozen=True)
class Config:
    """Validated engine configuration (VeloC keys). Build with :meth:`load`."""

    mode: str
    scratch: str
    persistent: str
    persistent_interval: float = 0.0
    ec_interval: float = -1.0
    ec_scheme: str = "xor"
    ec_group_size: int = 8
    max_versions: int = 0
    scratch_versions: int = 0
    chksum: bool = True
    meta: str | None = None
    failure_domain: str = dataclasses.field(default_factory=_node.host_name)
    watchdog_interval: float = 0.0
    max_inflight: int = 2
    lease_timeout: float = 30.0
    shared_group: bool = False
    axl_type: str | None = None
    backend_timeout: float = 60.0
    redis: str | None = None
    #: a memory-tier device file (:mod:`deepfreeze.memtier`); None: shards go to scratch files
    memtier: str | None = None
    memtier_slots: int = 2
    #: auto | on | off: write a version decided ``flush`` once, into persistent (:mod:`deepfreeze.tiers.direct`)
    write_once: str = "auto"
    #: ``low``: background work yields to training, within a bound (:mod:`deepfreeze.priority`); ``normal``: not
    background_priority: str = "low"
    veloc_only: tuple[tuple[str, str], ...] = ()  # VELOC_ONLY keys, as given
    source: str = NO_FILE
    #: where each key given explicitly came from: ``(key, "file:line" | "env VELOC_<KEY>" |
    #: "keyword override")``; keys not listed have their default (see :meth:`where`)
    origins: tuple[tuple[str, str], ...] = dataclasses.field(default=(), compare=False)

    def where(self, key: str) -> str:
        """Where ``key``'s value came from: ``file:line`` of the INI file, ``env VELOC_<KEY>``,
        ``keyword override`` (code; ``--set`` in the CLI), or ``default (<file>)``."""
        for k, w in self.origins:
            if k == key:
                return w
        return "default" if self.source == NO_FILE else f"default ({self.source})"

    def __post_init__(self) -> None:
        w = self.where
        if self.mode not in ("sync", "async"):
            raise ConfigError(f"{w('mode')}: mode = {self.mode!r} is invalid: use 'sync' or 'async'")
        for key in ("scratch", "persistent"):
            value = getattr(self, key)
            if not value:
                raise ConfigError(f"{w(key)}: '{key}' is empty: set it to a directory path")
            if "\0" in str(value):  # os.path would raise ValueError
                raise ConfigError(f"{w(key)}: '{key}' holds a NUL byte: set it to a directory path")
            object.__setattr__(self, key, os.path.abspath(os.path.expanduser(value)))
        if os.path.realpath(self.scratch) == os.path.realpath(self.persistent):
            raise ConfigError(
                f"scratch ({w('scratch')}) and persistent ({w('persistent')}) are the same directory "
                f"({self.scratch}); they are different levels: point scratch to node-local storage"
            )
        for key in ("max_versions", "scratch_versions"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{w(key)}: {key} = {getattr(self, key)} must be >= 0 (0 keeps all)")
        if self.ec_scheme not in ("xor", "partner"):
            raise ConfigError(f"{w('ec_scheme')}: ec_scheme = {self.ec_scheme!r} is invalid: use 'xor' "
                              "(parity, 1/(k-1) space) or 'partner' (a full copy on the next node)")
        if self.ec_group_size != 0 and self.ec_group_size < 3:
            raise ConfigError(f"{w('ec_group_size')}: ec_group_size = {self.ec_group_size} is invalid: use 3 or more "
                              "ranks per XOR parity group (parity takes 1/(k-1) of a shard; a group of 2 is a full "
                              "copy: use ec_scheme = partner), or 0 for one group of all failure domains")
        if self.max_inflight < 1:
            raise ConfigError(f"{w('max_inflight')}: max_inflight = {self.max_inflight} must be >= 1 (1: a "
                              "checkpoint waits until the previous shard is on scratch; 2: one more may wait "
                              "in memory)")
        if not self.lease_timeout > 0:
            raise ConfigError(f"{w('lease_timeout')}: lease_timeout = {self.lease_timeout} must be > 0 seconds (e.g. "
                              "30: a run's heartbeat renews its lease every third of it)")
        if self.watchdog_interval < 0:
            raise ConfigError(f"{w('watchdog_interval')}: watchdog_interval = {self.watchdog_interval} must be "
                              ">= 0 (0 = off)")
        if not self.backend_timeout > 0 or self.backend_timeout == float("inf"):
            raise ConfigError(f"{w('backend_timeout')}: backend_timeout = {self.backend_timeout} must be a number of "
                              "seconds > 0 (how long a backend may leave a request unanswered before it is declared "
                              "dead and replaced; default 60)")
        validate_name(self.failure_domain.replace("-", "_"), f"failure_domain ({w('failure_domain')})")
        self._check_redis()
        if not 2 <= self.memtier_slots <= 64:
            raise ConfigError(f"{w('memtier_slots')}: memtier_slots = {self.memtier_slots} must be between 2 and 64 (a "
                              "new version never overwrites the newest DONE one, so 1 slot could never be written)")
        if self.background_priority not in ("low", "normal"):
            raise ConfigError(f"{w('background_priority')}: background_priority = {self.background_priority!r} is "
                              "invalid: use 'low' (background writes and flushes yield the CPU and the disk to "
                              "training as long as they still end within half a checkpoint interval) or 'normal' (they run at "
                              "the training's priority)")
        if self.memtier is not None:
            if not self.memtier.strip():
                raise ConfigError(f"{w('memtier')}: 'memtier' is empty: set it to the path of a device made by "
                                  "'deepfreeze memtier create PATH --size 8G', or leave the key out")
            object.__setattr__(self, "memtier", os.path.abspath(os.path.expanduser(self.memtier)))
            if self.ec_interval >= 0:
                raise ConfigError(f"{w('memtier')}: memtier = {self.memtier} cannot be combined with ec_interval = "
                                  f"{self.ec_interval:g} ({w('ec_interval')}): the memory tier keeps no scratch "
                                  "files for partner copies or parity to protect; set ec_interval = -1 or leave "
                                  "memtier out")

        if self.write_once not in ("auto", "on", "off"):
            raise ConfigError(f"{w('write_once')}: write_once = {self.write_once!r} is invalid: use 'auto' (write "
                              "once into persistent when scratch and persistent share a file system), 'on' or 'off' "
                              "(every version through a scratch file)")
        if self.write_once == "on" and (self.ec_interval >= 0 or self.memtier is not None):
            other = "ec_interval" if self.ec_interval >= 0 else "memtier"
            raise ConfigError(f"{w('write_once')}: write_once = on cannot be combined with {other} ({w(other)}): "
                              + ("partner copies and parity protect scratch files, which write_once does not write; "
                                 "set ec_interval = -1" if other == "ec_interval" else
                                 "the memory tier already writes each version once to disk")
                              + ", or set write_once = auto or off")

    def _check_redis(self) -> None:
        if self.redis is not None and not re.match(r"^(redis|rediss|unix)://\S+$", self.redis):
            raise ConfigError(f"{self.where('redis')}: redis = {self.redis!r} is invalid: use redis://host:port "
                              "(or rediss://, unix://path), or leave it out for the embedded notifier")

    def check_directories(self, keys: tuple[str, ...] = ("scratch", "persistent")) -> None:
        """Raise :class:`ConfigError` unless each of ``keys`` is a directory this process can
        write in, or can be created (its nearest existing parent is a writable directory).
        Called when training begins, so an unusable path is one clear error, not a traceback
        from the first checkpoint. Creates nothing."""
        for key in keys:
            path = getattr(self, key)
            p = path
            while True:
                try:
                    st = os.stat(p)
                except (FileNotFoundError, NotADirectoryError):  # go up to the first existing path
                    parent = os.path.dirname(p)
                    if parent == p:
                        break
                    p = parent
                    continue
                except OSError as e:
                    raise ConfigError(f"{self.where(key)}: {key} = {path} is unusable: {p}: {e.strerror}; "
                                      f"point {key} to a directory you can write in") from e
                if not stat.S_ISDIR(st.st_mode):
                    raise ConfigError(f"{self.where(key)}: {key} = {path} is unusable: {p} exists and is not a "
                                      f"directory; point {key} to a directory (or remove that file)")
                if not os.access(p, os.W_OK | os.X_OK):
                    what = "write in" if p == path else f"create {path} in"
                    raise ConfigError(f"{self.where(key)}: {key} = {path} is unusable: no permission to {what} "
                                      f"{p} (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}, or a "
                                      f"read-only file system); point {key} to a directory you can write in")
                break
            from . import ownership  # the root (or the parent it is created in): owner, sticky, group
            from .errors import UnsafePathError
            try:
                ownership.check_root(p, shared_group=self.shared_group)
            except UnsafePathError as e:
                raise ConfigError(f"{self.where(key)}: {key} = {path} is unsafe: {e} (shared_group = "
                                  f"{str(self.shared_group).lower()}: {self.where('shared_group')})") from e

    def check_memtier(self) -> None:
        """Raise :class:`ConfigError` unless ``memtier`` (when set) names an existing regular file
        (a device made by ``deepfreeze memtier create``); :func:`deepfreeze.memtier.device.open`
        then validates its content. Called when an engine starts, not at load: a node without the
        device can still restore from the other levels."""
        if self.memtier is None:
            return
        try:
            st = os.stat(self.memtier)
        except OSError as e:
            raise ConfigError(f"{self.where('memtier')}: memtier = {self.memtier} is unusable: {e.strerror}; create "
                              f"the device first ('deepfreeze memtier create {self.memtier} --size 8G') or leave the "
                              "key out") from e
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{self.where('memtier')}: memtier = {self.memtier} is not a regular file (a memory-tier "
                              "device is one preallocated file, e.g. under /dev/shm): create it with 'deepfreeze "
                              "memtier create PATH --size 8G'")

    def _make_scratch(self, root: str, what: str) -> None:
        """Create the scratch directory this configuration chose itself (``what`` names it), owner-only,
        ``root`` and every parent checked (:func:`deepfreeze.ownership.ensure_dir`); one another user
        made is refused."""
        from . import ownership
        from .errors import UnsafePathError
        try:
            ownership.ensure_dir(self.scratch, root, shared_group=self.shared_group, site="config")
        except (UnsafePathError, OSError) as e:
            raise ConfigError(f"{what} cannot be used: {e}. Set {SCRATCH_ENV} (or scratch=DIR) to a node-local "
                              "directory of your own") from e

    @property
    def keep_scratch(self) -> int:
        """Versions kept on scratch (0 = all): ``scratch_versions`` else ``max_versions``."""
        return self.scratch_versions or self.max_versions

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, *, env: Mapping[str, str] | None = None,
             **overrides: Any) -> "Config":
        """Read ``path`` (VeloC INI), apply ``VELOC_<KEY>`` env vars, then ``overrides``."""
        env = os.environ if env is None else env
        raw: dict[str, tuple[str, Any]] = {}
        source = NO_FILE
        if path is not None:
            source = os.fspath(path)
            raw.update({k: (f"{source}:{n}", v) for k, (n, v) in _read_ini(source).items()})
        for key in KEYS:
            ev = env.get("VELOC_" + key.upper())
            if ev is not None:
                raw[key] = (f"env VELOC_{key.upper()}", ev)
        for key, value in overrides.items():
            if value is None:
                continue
            if key not in KEYS:
                raise ConfigError(_unknown(key, "keyword override"))
            raw[key] = ("keyword override", value)
        defaulted: dict[str, Any] = {}
        make: "tuple[str, str] | None" = None  # a scratch chosen here: (the root ensure_dir checks, what it is)
        if path is None:  # no file: only persistent must be given
            if "mode" not in raw:
                defaulted["mode"] = "async"
            if "scratch" not in raw:
                if env.get(SCRATCH_ENV):
                    raw["scratch"] = (f"env {SCRATCH_ENV}", env[SCRATCH_ENV])
                    given = os.path.abspath(os.path.expanduser(env[SCRATCH_ENV]))
                    make = (given, f"scratch = {given} (env {SCRATCH_ENV})")
                else:
                    defaulted["scratch"] = default_scratch()  # /var/tmp (root's, sticky) is the root checked;
                    make = (os.path.dirname(os.path.dirname(defaulted["scratch"])),  # deepfreeze-<uid> is ours
                            f"the default scratch directory {defaulted['scratch']}")
        if "mode" not in raw and "mode" not in defaulted:
            raise ConfigError(f"{source}: 'mode' is mandatory in a configuration file (as in VeloC): add 'mode = "
                              "async' or 'mode = sync' (without a file it defaults to async)")
        for key in ("scratch", "persistent"):
            if key not in raw and key not in defaulted:
                if path is None:
                    raise ConfigError(f"{source}: '{key}' is missing: pass {key}=DIR (the shared directory the "
                                      f"checkpoints are kept in), or set VELOC_{key.upper()}")
                raise ConfigError(f"{source}: '{key}' is missing: set it to a directory path")
        kwargs: dict[str, Any] = {"source": source, **defaulted}
        extra = []
        for key, (where, value) in raw.items():
            if key in VELOC_ONLY:
                extra.append((key, str(value)))
            else:
                kwargs[key] = _convert(key, value, where)
        origins = tuple(sorted((key, where) for key, (where, _) in raw.items()))
        config = cls(veloc_only=tuple(sorted(extra)), origins=origins, **kwargs)
        if make is not None:
            config._make_scratch(*make)
        return config

    @classmethod
    def resolve(cls, config: "str | os.PathLike | Config | None", **overrides: Any) -> "Config":
        """A Config from a path, a Config or None, with keyword ``overrides`` applied (validated)."""
        if not isinstance(config, Config):
            return cls.load(config, **overrides)
        changes: dict[str, Any] = {}
        extra = dict(config.veloc_only)
        origins = dict(config.origins)
        for key, value in overrides.items():
            if value is None:
                continue
            if key not in KEYS:
                raise ConfigError(_unknown(key, "keyword override"))
            origins[key] = "keyword override"
            if key in VELOC_ONLY:
                extra[key] = str(value)
                changes["veloc_only"] = tuple(sorted(extra.items()))
            else:
                changes[key] = _convert(key, value, "keyword override")
        if not changes:
            return config
        return dataclasses.replace(config, origins=tuple(sorted(origins.items())), **changes)


def default_scratch() -> str:
    """The scratch directory when neither a file nor ``scratch=`` nor ``$DEEPFREEZE_SCRATCH`` sets
    one: ``/var/tmp/deepfreeze-<uid>/scratch`` (node-local and disk-backed; ``/tmp`` is RAM on many
    systems)."""
    return f"/var/tmp/deepfreeze-{os.getuid()}/scratch"


def did_you_mean(word: str, choices: "list[str] | tuple[str, ...] | Mapping[str, Any]") -> str:
    """`` Did you mean 'x'?`` (the close matches of ``word`` among ``choices``), or ``""``."""
    close = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.6)
    if not close:
        return ""
    return " Did you mean " + " or ".join(repr(c) for c in close) + "?"


def _unknown(key: str, where: str) -> str:
    return (f"{where}: unknown key {key!r}.{did_you_mean(key, KEYS)} Known keys: {', '.join(sorted(KEYS))} "
            "(see docs/configuration.md)")


def _read_ini(path: str) -> dict[str, tuple[int, str]]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(1 << 20)
    except FileNotFoundError as e:
        raise ConfigError(f"config file {path!r} does not exist: pass the path of a VeloC INI file "
                          "(see veloc_cfg/local.cfg)") from e
    except OSError as e:
        raise ConfigError(f"config file {path!r} cannot be read: {e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path!r} is not UTF-8 text ({e}): pass the path of a VeloC INI file "
                          "(see veloc_cfg/local.cfg)") from e
    out: dict[str, tuple[int, str]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line or (line.startswith("[") and line.endswith("]")):
            continue
        if "=" not in line:
            raise ConfigError(f"{path}:{n}: expected 'key = value', got {line!r}")
        key, value = (s.strip() for s in line.split("=", 1))
        if key not in KEYS:
            raise ConfigError(_unknown(key, f"{path}:{n}"))
        out[key] = (n, value)
    return out


def _convert(key: str, value: Any, where: str) -> Any:
    try:
        if key in ("persistent_interval", "ec_interval", "watchdog_interval", "lease_timeout", "backend_timeout"):
            return float(value)
        if key in ("max_versions", "scratch_versions", "max_inflight", "memtier_slots", "ec_group_size"):
            if isinstance(value, float) or (isinstance(value, str) and not value.strip().lstrip("-").isdigit()):
                raise ValueError("not an integer")
            return int(value)
        if key == "write_once":
            if isinstance(value, bool):
                return "on" if value else "off"
            return str(value).strip().lower()
        if key in ("chksum", "shared_group"):
            if isinstance(value, bool):
                return value
            v = str(value).strip().lower()
            if v in _TRUE:
                return True
            if v in _FALSE:
                return False
            raise ValueError("not a boolean (true/false)")
        return str(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {key} = {value!r} is invalid: {e}") from e
