"""The one exception hierarchy of DeepFreeze.

Every error DeepFreeze raises is a :class:`DeepFreezeError`; each subclass also
subclasses the built-in exception a caller would naturally catch, so
``except FileNotFoundError`` keeps working around ``restore``.
Messages say what went wrong, why, and what to do.

The classes named in ``__all__`` are the *registry* (:func:`error_class`, :func:`error_classes`):
the only classes a failure sent by another rank (:func:`deepfreeze.comm.error_record`) or
another process can be rebuilt as. A class's ``record_fields`` name the attributes (JSON
scalars, with their types) that travel with its message.
"""
from __future__ import annotations

__all__ = [
    "DeepFreezeError",
    "MemtierError",
    "MemtierFullError",
    "MemtierCorruptError",
    "MemtierPermissionError",
    "MemtierBusyError",
    "ConfigError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "ModelMismatchError",
    "BackendError",
    "BackendUnresponsiveError",
    "CheckpointWriteError",
    "VelocNotFoundError",
    "VelocError",
    "LeaseHeldError",
    "ExistingCheckpointError",
    "UnsafePathError",
    "UntrustedOwnerError",
    "CaptureMissedError",
    "NativeBuildError",
    "CloneError",
    "CloneTimeoutError",
    "RepositoryError",
    "ModelNotFoundError",
    "NameExistsError",
    "ProviderError",
    "ProviderTimeoutError",
    "AuthenticationError",
    "StreamError",
    "StreamTimeoutError",
    "VersionGoneError",
    "RepositoryDatabaseError",
    "FrameAuthenticationError",
    "ProtocolVersionError",
    "CaptureTornError",
    "PeerLostError",
    "NodeIdConflictError",
    "PeerClosedError",
    "ChangedInPlaceError",
    "StateRecordOverflowError",
    "RanksFailedError",
    "ErrorRecordError",
    "error_class",
    "error_classes",
]


class DeepFreezeError(Exception):
    """Base class of every error raised by DeepFreeze."""

    #: attributes carried with the message in a cross-rank record (:func:`deepfreeze.comm.error_record`), each
    #: with the types its value may have (JSON scalars: int, float, str, bool, None)
    record_fields: "dict[str, tuple[type, ...]]" = {}
    #: the sender's class name when this error was rebuilt from another rank's record, else None
    sender_type: "str | None" = None


class ConfigError(DeepFreezeError, ValueError):
    """A configuration file, key, value or option is invalid."""


class CheckpointNotFoundError(DeepFreezeError, FileNotFoundError):
    """No committed checkpoint matches the request."""


class CorruptCheckpointError(DeepFreezeError, ValueError):
    """A file on disk is not a valid DeepFreeze file (damaged, truncated, hostile)."""


class ModelMismatchError(DeepFreezeError, ValueError):
    """The model's tensors do not match the checkpoint's."""


class BackendError(DeepFreezeError, RuntimeError):
    """The background flush process failed or cannot be reached."""


class BackendUnresponsiveError(BackendError):
    """The backend process accepted the connection (or took a request) but did not answer in time:
    stopped (SIGSTOP), or stuck in uninterruptible I/O (a hung file system). It may still be alive;
    DeepFreeze never kills it. ``pid`` is its process id when known, ``inode`` the inode of the
    socket file it listened on (to tell it from a successor on the same path)."""

    record_fields = {"pid": (int, type(None)), "inode": (int, type(None))}

    def __init__(self, message: str, pid: int | None = None, inode: int | None = None) -> None:
        super().__init__(message)
        self.pid, self.inode = pid, inode


class CheckpointWriteError(DeepFreezeError, OSError):
    """Writing a checkpoint failed (disk full, permissions, I/O error)."""


class VelocNotFoundError(DeepFreezeError, ImportError):
    """``engine="veloc"`` was asked for but no VeloC client library can be loaded."""


class VelocError(DeepFreezeError, RuntimeError):
    """A VeloC C API call returned ``VELOC_FAILURE`` (the message names the call and arguments)."""


class LeaseHeldError(DeepFreezeError, RuntimeError):
    """Another live run holds the lease on the checkpoint name (the message names it)."""


class ExistingCheckpointError(DeepFreezeError, FileExistsError):
    """A new run (no ``resume``, no ``overwrite``) found committed versions of its name."""


class UnsafePathError(DeepFreezeError, PermissionError):
    """A directory or file DeepFreeze would use is a symbolic link, owned by another user, or
    writable by others (see docs/guarantees.md, "Shared directories"); nothing was written."""


class UntrustedOwnerError(DeepFreezeError, PermissionError):
    """A checkpoint file is owned by a user this process does not trust (``trust_owners``)."""


class CaptureMissedError(DeepFreezeError, RuntimeError):
    """The train step did not capture a step a sink was armed for (its apply path bypassed the hook)."""


class NativeBuildError(DeepFreezeError, RuntimeError):
    """The fused-copy TensorFlow op could not be compiled (no compiler, a compiler error, an
    unwritable package directory) or is not available to call."""


class CloneError(DeepFreezeError, RuntimeError):
    """A clone transfer failed: the source group gave up (its ``fit`` ended or failed before the
    clone step), a clone rank gave up (its timeout, or another rank of its group failed), a
    message was malformed, or a collective of the clone group failed."""


class CloneTimeoutError(CloneError, TimeoutError):
    """A clone transfer did not complete within ``clone_timeout``: the other group never showed
    up, stopped sending or stopped receiving (the message names the ranks waited for)."""


class RepositoryError(DeepFreezeError, RuntimeError):
    """A model repository operation failed: a bad name, a repository directory that is not one,
    a provider list that differs from the one the repository was created with, a hostile or
    malformed request."""


class ModelNotFoundError(RepositoryError, LookupError):
    """No model of that name is stored in the repository (or a requested tensor is not part of it)."""


class NameExistsError(RepositoryError, FileExistsError):
    """A store under a name that exists or existed: names are write-once and a deleted name is
    never reused (clients cache by name). Store under a new tag."""


class ProviderError(RepositoryError, ConnectionError):
    """A repository provider could not be reached, closed the connection, or answered with an error."""


class ProviderTimeoutError(ProviderError, TimeoutError):
    """A provider did not answer within the timeout (or its staging arena stayed full that long)."""


class AuthenticationError(DeepFreezeError, PermissionError):
    """A connection presented no token or a wrong one (tokens: a 0600 file, or
    DEEPFREEZE_TOKEN holding the token text itself), or DEEPFREEZE_TOKEN holds no token text."""


class StreamError(DeepFreezeError, RuntimeError):
    """Publishing or receiving a model update failed: a malformed or hostile slot file, endpoint
    file or message, a checksum that does not hold, a producer that went away mid-transfer."""


class StreamTimeoutError(StreamError, TimeoutError):
    """No (newer) version became live within the timeout (``ModelSubscriber.wait``), or a
    producer did not answer within its I/O timeout."""


class VersionGoneError(StreamError, LookupError):
    """The requested version is no longer held by the producer (a newer one replaced it in every
    slot it could use): take the newest instead."""


class MemtierError(DeepFreezeError, RuntimeError):
    """The memory tier (:mod:`deepfreeze.memtier`) could not register, write or read a model."""


class MemtierFullError(MemtierError, MemoryError):
    """The memory-tier device (or the memory behind it) has no room for what was asked: raised
    at creation (size beyond the available memory) or at registration (a model that does not
    fit), before training starts. Names the bytes needed and free, and what to do."""


class MemtierCorruptError(MemtierError, ValueError):
    """A memory-tier device file is not one, or holds a table entry, index or slot header that
    fails its checksum or bounds checks (offsets outside the file, overlapping regions)."""


class MemtierPermissionError(MemtierError, PermissionError):
    """The backend may not read the rank's memory (``process_vm_readv``: Yama ``ptrace_scope``,
    another user, a container without CAP_SYS_PTRACE)."""


class MemtierBusyError(MemtierError, TimeoutError):
    """The device lock or a free slot did not become available within the bounded wait."""


class RepositoryDatabaseError(RepositoryError):
    """The repository's SQLite database (``meta.db``) failed: the disk holding it is full, another
    process kept it locked past the busy timeout, it is damaged, or it may not be written. The
    message says which and what to do; the ``sqlite3`` error is chained as the cause."""


class FrameAuthenticationError(ProviderError):
    """A frame on an authenticated connection (:mod:`deepfreeze.net`) failed its MAC, came out of
    sequence or without one: it was changed, reordered, replayed or injected on the way (or by
    a peer that does not hold the session). The connection is closed; nothing of the frame is used."""


class ProtocolVersionError(ProviderError):
    """The peer speaks another DeepFreeze network protocol version (both are named): run the
    same DeepFreeze version on both sides."""


class CaptureTornError(DeepFreezeError, RuntimeError):
    """A capture overlapped with training saw a tensor change while it was being copied (its
    ``_version`` moved before the next optimizer step), or its copy failed: the version is not
    written on any rank, never a wrong shard (``deepfreeze.torch``)."""


class PeerLostError(DeepFreezeError, ConnectionError):
    """A collective of DeepFreeze's own process group failed: a peer died (its connection
    closed) or did not answer within the group's timeout (``deepfreeze.torch.TorchComm``)."""


class NodeIdConflictError(LeaseHeldError):
    """The lease is held by a live run carrying this process's node id, but of another kernel boot
    or PID namespace: two jobs share one node id (``DEEPFREEZE_NODE_ID``, or the default host name
    and boot id of containers that share both). Its pid cannot be checked here, so the lease is
    only taken over once its heartbeat is stale; the id must be unique per node."""


class PeerClosedError(ProviderError):
    """The peer of a :mod:`deepfreeze.net` connection closed it (end of file) before a whole frame
    arrived: ``received`` of ``expected`` bytes of the part being read. ``between_messages``: it
    closed at a message boundary, with nothing of a next message sent (an orderly end of the
    connection, not a truncated message)."""

    record_fields = {"received": (int,), "expected": (int,), "between_messages": (bool,)}

    def __init__(self, message: str, received: int = 0, expected: int = 0, between_messages: bool = False) -> None:
        super().__init__(message)
        self.received, self.expected, self.between_messages = received, expected, between_messages


class ChangedInPlaceError(CaptureTornError):
    """An overlapped capture saw ``count`` tensor(s) change in place while they were copied
    (``first``: the first one's name): something other than the optimizer's step wrote them."""

    record_fields = {"count": (int,), "first": (str,)}

    def __init__(self, message: str, count: int = 0, first: str = "") -> None:
        super().__init__(message)
        self.count, self.first = count, first


class StateRecordOverflowError(CaptureTornError):
    """A rank's state record (RNG, loop and scheduler state) grew to ``size`` bytes, beyond the
    ``reserved`` bytes its shard plan holds for it: the next checkpoint builds a plan with more room."""

    record_fields = {"size": (int,), "reserved": (int,)}

    def __init__(self, message: str, size: int = 0, reserved: int = 0) -> None:
        super().__init__(message)
        self.size, self.reserved = size, reserved


class RanksFailedError(DeepFreezeError, RuntimeError):
    """Some ranks of a collective step failed: ``failures`` maps each failed rank to its error as it
    arrived (:func:`deepfreeze.comm.allgather_failures`: a registered class, its message and
    fields), the same on every rank. The message joins theirs, in rank order."""

    def __init__(self, message: str, failures: "dict[int, DeepFreezeError] | None" = None) -> None:
        super().__init__(message)
        self.failures: dict[int, DeepFreezeError] = dict(failures or {})

    @classmethod
    def of(cls, failures: "dict[int, DeepFreezeError]") -> "RanksFailedError":
        """The error of ``failures`` (rank -> error), its message theirs joined with "; " in rank order."""
        ordered = dict(sorted(failures.items()))
        return cls("; ".join(str(e) for e in ordered.values()), ordered)


class ErrorRecordError(DeepFreezeError, ValueError):
    """A cross-rank error record (:func:`deepfreeze.comm.error_from_record`) is not one: too large,
    not JSON, nested, of the wrong types, or of a class that cannot be built from it. Sent by
    another version of DeepFreeze, or not by DeepFreeze."""


def error_classes() -> dict[str, type[DeepFreezeError]]:
    """The registry: every :class:`DeepFreezeError` class named in this module's ``__all__``, by name."""
    found = {name: globals().get(name) for name in __all__}
    return {name: cls for name, cls in found.items() if isinstance(cls, type) and issubclass(cls, DeepFreezeError)}


def error_class(name: object) -> "type[DeepFreezeError] | None":
    """The registered class called ``name`` (:func:`error_classes`), else None (any other name or
    object, a private or a non-error name included)."""
    if not isinstance(name, str) or name not in __all__:
        return None
    cls = globals().get(name)
    return cls if isinstance(cls, type) and issubclass(cls, DeepFreezeError) else None
