"""What DeepFreeze calls a node: the one definition.

A *node* is one operating-system instance as its processes see it: processes on one node share
the process ids, ``/dev/shm``, the node-local scratch and the runtime directory (where the
backend's Unix socket lives). DeepFreeze asks "is this on my node?" whenever it is about to rely
on one of those: checking whether a lock or lease holder's pid is alive, attaching to a stream
producer's ring in ``/dev/shm``, or sharing a repository provider's arena.

:func:`node_id` is ``<host name>/<boot id>`` (the boot id from
``/proc/sys/kernel/random/boot_id``). The boot id alone is not enough: it is one value for every
container and every namespaced "node" on one kernel, which do not share pids, ``/dev/shm`` or
``/tmp``; the host name alone is not enough either (two boots of a machine, or two machines that
are both called ``localhost``). Where even both are not (containers that share a host name but
not their pid namespace, say), set ``DEEPFREEZE_NODE_ID`` to a value of your own per node: it
replaces the whole id. It must be 1 to 200 printable ASCII characters without white space.

:func:`host_name` is the name shown to people and the default failure domain; it is never used
to decide whether two processes are on one node.

**Process identity** (:func:`process_identity`): what a lease or a ``commit.lock``
stores of the process holding it: its pid with the boot id, the inode of its PID namespace
(``/proc/self/ns/pid``) and its start time (field 22 of ``/proc/<pid>/stat``, clock ticks since
boot). Only a holder recorded with this process's node id, boot id and PID namespace is *in this
PID space* (:func:`in_this_pid_space`): only then does its pid mean anything here, and only then
is it *gone* (:func:`holder_gone`) when no process has that pid, the process is a zombie, or the
pid now belongs to a process with another start time (reused). A holder recorded elsewhere, or
without these fields (written by a DeepFreeze before them), is never judged by its pid: only by
its heartbeat going stale. So two jobs that share a node id (``DEEPFREEZE_NODE_ID`` set to one
value in two PID namespaces, or containers with one host name on one kernel) never take each
other's lease at once; a holder with this process's node id but another boot or PID namespace
(:func:`shares_node_id`) is reported as such.
"""
from __future__ import annotations

import os
import re
import socket

from .errors import ConfigError

__all__ = ["NODE_ENV", "node_id", "host_name", "boot_id", "is_here", "pid_namespace", "process_start",
           "process_identity", "in_this_pid_space", "holder_gone", "shares_node_id", "process_state"]

#: environment variable that replaces the node id
NODE_ENV = "DEEPFREEZE_NODE_ID"
_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_PID_NS = "/proc/self/ns/pid"
_VALID = re.compile(r"[!-~]{1,200}\Z")  # printable ASCII, no white space (lock files split on spaces)


def host_name() -> str:
    """This node's host name (for people, and the default ``failure_domain``)."""
    return socket.gethostname()


def boot_id() -> str:
    """The kernel's boot id, or ``""`` where there is none (not Linux)."""
    try:
        with open(_BOOT_ID, "rb") as f:
            return f.read(64).decode("ascii", "replace").strip()
    except OSError:
        return ""


def node_id() -> str:
    """This process's node: ``DEEPFREEZE_NODE_ID`` when set, else ``<host name>/<boot id>``
    (the host name alone where there is no boot id). Read afresh at every call (cheap), so a
    process that changes its UTS namespace or environment sees its new node.

    Raises :class:`~deepfreeze.errors.ConfigError` when ``DEEPFREEZE_NODE_ID`` is set but empty,
    too long, or holds white space or non-ASCII characters."""
    own = os.environ.get(NODE_ENV)
    if own is not None:
        if not _VALID.match(own):
            raise ConfigError(f"{NODE_ENV}={own[:60]!r} is not a node id: it must be 1 to 200 printable ASCII "
                              f"characters without white space; set one value per node, or unset it to use "
                              f"the host name and boot id")
        return own
    host, boot = host_name(), boot_id()
    return f"{host}/{boot}" if boot else host


def is_here(record: dict) -> bool:
    """Was ``record`` (a lease, lock or owner record holding ``"node"``, or only ``"host"`` when
    written by a DeepFreeze before node ids) written on this node? This alone never allows judging
    its ``pid``: :func:`holder_gone` does that. A record with neither is not here."""
    node = record.get("node")
    if isinstance(node, str):
        return node == node_id()
    host = record.get("host")
    return isinstance(host, str) and host == host_name()


def pid_namespace() -> int:
    """The inode of this process's PID namespace (``/proc/self/ns/pid``), 0 where there is none."""
    try:
        return os.stat(_PID_NS).st_ino
    except OSError:
        return 0


def _stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3, the state, first)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read(2048).rpartition(b")")[2].split()
    except OSError:
        return None


def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` as ``/proc`` shows it (field 22 of ``/proc/<pid>/stat``,
    clock ticks after boot), None when there is no such process (or no ``/proc``)."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields is not None else None
    except (ValueError, IndexError):
        return None


def _proc_is_ours() -> bool:
    """Does ``/proc`` show this process's PID namespace (a ``/proc`` of the parent namespace, not
    remounted after ``unshare --pid``, shows other pids: then no pid can be checked there)?"""
    try:
        with open("/proc/self/stat", "rb") as f:
            return int(f.read(64).split(b" ", 1)[0]) == os.getpid()
    except (OSError, ValueError):
        return False


def process_identity() -> dict[str, object]:
    """This process as a lease or lock holder: ``{"pid", "boot", "pidns", "start"}`` (see the module
    docstring). ``start`` is None where ``/proc`` does not show this process's PID namespace."""
    fields = _stat_fields("self") if _proc_is_ours() else None
    try:
        start = int(fields[19]) if fields is not None else None
    except (ValueError, IndexError):
        start = None
    return {"pid": os.getpid(), "boot": boot_id(), "pidns": pid_namespace(), "start": start}


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def in_this_pid_space(record: dict) -> bool:
    """Was ``record``'s holder (its ``node`` and :func:`process_identity` fields) a process of this
    node, kernel boot and PID namespace, as seen through a ``/proc`` of this namespace? Only then
    can its pid be checked here. A record without these fields (an older DeepFreeze's) is not."""
    boot, ns = record.get("boot"), record.get("pidns")
    return (record.get("node") == node_id() and isinstance(boot, str) and bool(boot) and boot == boot_id() and _int(ns) and ns != 0
            and ns == pid_namespace() and _int(record.get("pid")) and _int(record.get("start"))
            and _proc_is_ours())


def holder_gone(record: dict) -> bool:
    """Is ``record``'s holder provably gone: in this PID space (:func:`in_this_pid_space`) and its
    pid is free, a zombie, or another process now (another start time)? False whenever that
    cannot be proved: such a holder is judged by its heartbeat only."""
    if not in_this_pid_space(record):
        return False
    pid = record["pid"]
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # a process of another user has this pid: its start time tells whether it is the holder
    except (OverflowError, ValueError):
        return False
    fields = _stat_fields(pid)
    if fields is None:  # exited between the two looks
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass
        return False
    try:
        return fields[0] == b"Z" or int(fields[19]) != record["start"]
    except (ValueError, IndexError):
        return False


def shares_node_id(record: dict) -> bool:
    """Does ``record``'s holder carry this process's node id while its boot or PID namespace is
    another (recorded, and different)? Then two live jobs use one node id: see :func:`node_id`."""
    if record.get("node") != node_id():
        return False
    boot, ns = record.get("boot"), record.get("pidns")
    if not (isinstance(boot, str) and boot and _int(ns) and ns):
        return False
    return boot != boot_id() or ns != pid_namespace()


_PROC_STATES = {"R": "running", "S": "sleeping", "D": "uninterruptible I/O wait", "T": "stopped",
                "t": "stopped by a debugger", "Z": "exited (zombie)", "X": "exited", "I": "idle"}


def process_state(pid: int | None) -> str | None:
    """The kernel's state of process ``pid`` (``"T (stopped)"``, ``"D (uninterruptible I/O wait)"``...),
    or None if it is gone or unknown."""
    if not pid:
        return None
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            raw = f.read(4096).decode(errors="replace")
        letter = raw[raw.rindex(")") + 2]
    except (OSError, ValueError, IndexError):
        return None
    return f"{letter} ({_PROC_STATES.get(letter, 'unknown')})"
