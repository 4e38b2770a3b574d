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
"""
from __future__ import annotations

import os
import re
import socket

from .errors import ConfigError

__all__ = ["NODE_ENV", "node_id", "host_name", "boot_id", "is_here"]

#: environment variable that replaces the node id
NODE_ENV = "DEEPFREEZE_NODE_ID"
_BOOT_ID = "/proc/sys/kernel/random/boot_id"
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
    written by a DeepFreeze before node ids) written on this node? Only then can its ``pid`` be
    checked here. A record with neither is not here."""
    node = record.get("node")
    if isinstance(node, str):
        return node == node_id()
    host = record.get("host")
    return isinstance(host, str) and host == host_name()
