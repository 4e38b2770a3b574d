"""In-library operation counters: what one process did to the file systems and the communicator.

Off by default: every call site tests one module-level bool (:data:`ENABLED`) and returns. With
the environment variable ``DEEPFREEZE_COUNTERS=<directory>`` set when this module is first
imported (a rank, a backend: every process of a job inherits it), counting is on and
:func:`dump` writes the process's counters to ``<directory>/<tag>.<host>.<pid>.json`` (the
engine at ``close`` with tag ``rank<r>``, the per-node backend at exit with tag ``backend``).

Names (``docs/cluster.md`` "Counts against node count" derives their values from the protocol):

``fs.<op>:<site>``
    one file-system call, issued (whatever its outcome) at ``site``: for the operations that pass
    a crash point (:mod:`deepfreeze.crashpoints`: ``rename``, ``replace``, ``link``, ``fsync``,
    ``unlink``, ``rmdir``) the site is the crash point's name; the other operations (``create``:
    an ``open`` with ``O_CREAT``, ``mkdir``, ``open``: of an existing file, to read it, ``stat``,
    ``listdir``) name a site of the same form. The first part of a site says where:
    ``scratch``/``tmp`` (node-local), ``persistent``/``run`` (the shared directory).
``bytes.<where>``
    bytes written (``pwrite``) or sent: ``bytes.scratch.data`` (shard payload),
    ``bytes.scratch.meta`` (shard header and index, scratch manifest), ``bytes.scratch.redundancy``
    (partner copies and parity files), ``bytes.persistent.data`` (a rank's pieces copied into the
    assembled file), ``bytes.persistent.meta`` (header and index, markers, decision, manifest).
``comm.<call>`` and ``comm.<what>.bytes``
    calls of the communicator wrappers (:class:`deepfreeze.comm.MPIComm`,
    ``deepfreeze.torch``'s ``TorchComm``): ``comm.allgather`` (one call: two MPI collectives,
    sizes then data), ``comm.exchange`` (one round of point-to-point messages), ``comm.send``/
    ``comm.recv`` (messages), ``comm.send.bytes``/``comm.recv.bytes``.

Records (:func:`record`): lists of JSON values, e.g. ``offsets.persistent``: ``[offset, length]``
of every piece this process wrote into an assembled file.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import threading
from typing import Any

__all__ = ["ENV", "ENABLED", "add", "record", "snapshot", "reset", "dump", "dump_at_exit", "fs"]

#: the environment variable that turns counting on and names the directory of the dumps
ENV = "DEEPFREEZE_COUNTERS"
_dir = os.environ.get(ENV) or None
#: True when counting (the environment variable was set at import)
ENABLED = _dir is not None
_lock = threading.Lock()
_counts: dict[str, int] = {}
_records: dict[str, list[Any]] = {}


def add(name: str, n: int = 1) -> None:
    """Add ``n`` to counter ``name`` (nothing when counting is off)."""
    if not ENABLED:
        return
    with _lock:
        _counts[name] = _counts.get(name, 0) + n


def fs(op: str, site: str) -> None:
    """Count one file-system call ``op`` issued at ``site`` (``fs.<op>:<site>``)."""
    if ENABLED:
        add(f"fs.{op}:{site}")


def record(name: str, value: Any) -> None:
    """Append ``value`` (JSON-able) to record list ``name`` (nothing when counting is off)."""
    if not ENABLED:
        return
    with _lock:
        _records.setdefault(name, []).append(value)


def snapshot() -> dict[str, Any]:
    """``{"counters": {name: n}, "records": {name: [...]}}`` of this process so far (copies)."""
    with _lock:
        return {"counters": dict(_counts), "records": {k: list(v) for k, v in _records.items()}}


def reset() -> None:
    """Forget everything counted so far in this process."""
    with _lock:
        _counts.clear()
        _records.clear()


def dump(tag: str) -> str | None:
    """Write this process's counters to ``<DEEPFREEZE_COUNTERS>/<tag>.<host>.<pid>.json`` (replaced
    atomically; written again by a later call of the same tag). Returns the path, or None when
    counting is off. Never raises: a counter dump must not fail a checkpoint (a failure is
    returned as None)."""
    if not ENABLED or _dir is None:
        return None
    snap = snapshot()
    snap.update(tag=tag, host=socket.gethostname(), pid=os.getpid())
    path = os.path.join(_dir, f"{tag}.{snap['host']}.{os.getpid()}.json")
    try:
        tmp = f"{path}.tmp{threading.get_ident()}"
        with open(tmp, "w") as f:
            json.dump(snap, f, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        return None
    return path


_at_exit: list[str] = []


def dump_at_exit(tag: str) -> None:
    """Dump with ``tag`` when the interpreter exits normally (once per tag)."""
    if ENABLED and tag not in _at_exit:
        _at_exit.append(tag)
        atexit.register(dump, tag)
