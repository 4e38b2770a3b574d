"""Opening checkpoint files for reading: regular files only, never a hang.

The readers of checkpoint files go through :func:`open_regular` (or
:func:`open_regular_file`, :func:`read_small`, :func:`read_whole`): manifests
(``Level.read_manifest``), shards, partner copies and parity blocks (restore,
redundancy), assembled files (restore), and everything the inventory and the
``deepfreeze`` command open. It opens with ``O_NONBLOCK`` (a FIFO named ``manifest.json`` or ``model.dfz``
would otherwise block ``open`` until a writer appears: restore and the CLI would
hang), ``O_NOFOLLOW`` (a symlink as the last path component is refused, not
followed) and ``O_CLOEXEC``, then checks with ``fstat`` that what was opened is
a regular file. Anything else (FIFO, socket, directory, device, symlink) raises
:class:`~deepfreeze.errors.CorruptCheckpointError` naming the path and what it
is, so readers treat it as "not committed / damaged" and fall back. A file that
does not exist raises ``FileNotFoundError`` as ``open`` does (a file removed by
retention between listing and opening is "missing", not "damaged").
``O_NONBLOCK`` is cleared again once the file is known to be regular (it has
no effect on regular files anyway).
"""
from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import threading
from typing import Any, BinaryIO, Callable, Iterator

import numpy as np

from . import counters
from . import crashpoints as cp
from . import format as fmt
from .errors import CorruptCheckpointError
from .node import host_name

__all__ = ["open_regular", "open_regular_file", "read_small", "read_whole", "describe_mode", "temp_suffix", "fsync_dir",
           "replacing_path", "replacing_file", "atomic_write", "write_all"]

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symlink"))


def describe_mode(mode: int) -> str:
    """``"a FIFO (named pipe)"``, ``"a directory"``, ... for a ``st_mode``."""
    for test, what in _KINDS:
        if test(mode):
            return what
    return "a regular file" if stat.S_ISREG(mode) else f"a special file (mode {stat.S_IFMT(mode):o})"


def _not_regular(path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path} is {what}, not a regular file: DeepFreeze reads only regular files "
                                  "(remove or rename it; restore falls back to another level or version)")


def open_regular(path: str, flags: int = os.O_RDONLY, mode: int = 0o600, *,
                 refuse: Callable[[str, str], BaseException] = _not_regular) -> int:
    """Open ``path`` (a descriptor) only if it is a regular file; see the module docstring.
    ``flags`` may hold ``O_CREAT`` (``mode``: the new file's mode).

    Raises ``FileNotFoundError`` if it does not exist, ``refuse(path, what)`` (by default a
    :class:`CorruptCheckpointError`) if it is a symlink or not a regular file, ``OSError`` for
    other failures (permissions, I/O). :func:`deepfreeze.ownership.open_trusted` passes its own
    ``refuse`` (an :class:`~deepfreeze.errors.UnsafePathError`)."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW on a symlink
            raise refuse(path, "a symbolic link (symlink), never followed") from e
        if e.errno in (errno.ENXIO, errno.EISDIR):  # a socket; a directory opened for writing
            try:
                what = describe_mode(os.lstat(path).st_mode)
            except OSError:
                what = "not openable"
            raise refuse(path, what) from e
        raise
    try:
        st_mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(st_mode):
            raise refuse(path, describe_mode(st_mode))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular_file(path: str, check: Callable[[os.stat_result], None] | None = None) -> BinaryIO:
    """:func:`open_regular` for reading, as a binary file object (unbuffered reads are the
    callers' business: ``read_index`` and ``read_entry`` use positional reads). ``check`` is
    called with the open file's ``fstat`` (e.g. an owner check) and may raise."""
    fd = open_regular(path, os.O_RDONLY)
    try:
        if check is not None:
            check(os.fstat(fd))
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_small(path: str, limit: int, check: Callable[[os.stat_result], None] | None = None) -> bytes:
    """The bytes of the small regular file ``path``: :class:`CorruptCheckpointError` if it holds more
    than ``limit``. ``check``: as for :func:`open_regular_file`. Allocates what the file holds, not
    ``limit`` (``read(limit + 1)`` allocates that much first: 256 MiB for an empty DCP
    ``.metadata``, found by the fuzz harness)."""
    with open_regular_file(path, check) as f:
        data = f.read(min(os.fstat(f.fileno()).st_size, limit) + 1)
        while len(data) <= limit:  # a file that grew since fstat: the rest, bounded
            more = f.read(min(1 << 20, limit + 1 - len(data)))
            if not more:
                break
            data += more
    if len(data) > limit:
        raise CorruptCheckpointError(f"{path} is larger than {limit} bytes")
    return data


def read_whole(path: str, check: Callable[[os.stat_result], None] | None = None) -> np.ndarray:
    """The bytes of the regular file ``path`` as a uint8 array of the size ``fstat`` gave (one
    allocation, the size of a real file; a file shrinking meanwhile is an error, not a short read).
    ``check``: as for :func:`open_regular_file`."""
    with open_regular_file(path, check) as f:
        size = os.fstat(f.fileno()).st_size
        data = np.empty(size, dtype=np.uint8)
        view = memoryview(data)
        got = 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                raise CorruptCheckpointError(f"{path}: shrank while being read ({got} of {size} bytes)")
            got += n
    return data


# ------------------------------------------------- temporary names and replacing writes

def temp_suffix() -> str:
    """Suffix for temporary names, unique across hosts, processes and threads."""
    return f"{host_name()}.{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}"


def fsync_dir(path: str, point: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        cp.fsync(fd, point)
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing_path(final: str, point: str = "export.rename") -> Iterator[str]:
    """Yield a temporary path beside ``final``; when the block ends, rename it to ``final``
    (crash point ``point``). On an error the temporary file is removed and nothing is left
    under ``final``."""
    tmp = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.tmp{temp_suffix()}")
    try:
        yield tmp
        cp.replace(tmp, final, point)
    except BaseException:
        try:
            cp.unlink(tmp, "tmp.cleanup")
        except OSError:
            pass
        raise


@contextlib.contextmanager
def replacing_file(final: str, *, fsync: bool, point: str) -> Iterator[int]:
    """Yield the descriptor of an owner-only temporary file beside ``final``; when the block
    ends, fsync it (if asked; crash point ``<point>.fsync``), close it and rename it to
    ``final`` (``<point>.rename``, :func:`replacing_path`)."""
    with replacing_path(final, point + ".rename") as tmp:
        counters.fs("create", point + ".create")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            yield fd
            if fsync:
                cp.fsync(fd, point + ".fsync")
        finally:
            os.close(fd)


def atomic_write(path: str, data: Any, *, fsync: bool, point: str) -> None:
    """Write ``data`` (bytes or an array) to ``path`` by temporary file and rename (and with
    ``fsync``, the file and its directory are flushed). ``point`` prefixes the crash points
    (``.fsync``, ``.rename``, ``.dirsync``; :mod:`deepfreeze.crashpoints`)."""
    with replacing_file(path, fsync=fsync, point=point) as fd:
        write_all(fd, data, 0, _BYTES_OF.get(point) or f"bytes.{point.split('.')[0]}.meta")
    if fsync:
        fsync_dir(os.path.dirname(path), point + ".dirsync")


#: the byte counter (:mod:`deepfreeze.counters`) of an :func:`atomic_write` at these points
_BYTES_OF = {"scratch.partner": "bytes.scratch.redundancy", "scratch.parity": "bytes.scratch.redundancy"}


def write_all(fd: int, buf: Any, offset: int, count: str | None = None) -> None:
    """Write all of ``buf`` at ``offset`` (``count``: the byte counter to add it to)."""
    view = fmt.byte_view(buf)
    if count is not None:
        counters.add(count, len(view))
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:done + (1 << 30)], offset + done)
