"""DeepFreeze's calls into the C library, all of them (layer L0: the standard library only).

The C library is loaded once, here (``ctypes.CDLL`` of ``ctypes.util.find_library("c")``, else
``libc.so.6``, with ``use_errno``); every function used is declared with its ``argtypes`` and
``restype``; a call that fails raises ``OSError(errno, "<strerror> (<what was being done>)")``
(so ``ESRCH`` arrives as :class:`ProcessLookupError`, ``EPERM`` as :class:`PermissionError`).
A function the C library lacks (another platform, an old glibc) raises ``OSError(ENOSYS)``
when called; :func:`available` says beforehand. Nothing here retries: ``EINTR`` is the
caller's to handle.

Who uses what: :func:`sync_file_range` (``deepfreeze.tiers.shardbytes``: the write-back hint of a flush),
:func:`madvise` (``deepfreeze.fused``: a buffer pool faulted in ahead of use, GIL released),
:func:`memcmp` (``deepfreeze.repo.store``: deduplication's byte comparison, GIL released),
:func:`process_vm_readv` / :func:`process_vm_writev` / :func:`prctl` / :func:`memmove`
(``deepfreeze.memtier.copy``: the memory tier's copies and the Yama ptracer permission),
:func:`ioprio_set` / :func:`ioprio_get` (``deepfreeze.priority``: the I/O priority of the
background threads, the writer's and the backend's flusher).

``ioprio_set``/``ioprio_get`` have no C-library wrapper: they go through ``syscall`` with this
architecture's numbers (x86_64: 251/252; aarch64: 30/31; elsewhere :func:`available` says False
and a call raises ``ENOSYS``). With :data:`IOPRIO_WHO_PROCESS` the ``who`` is a thread id (a pid
names its main thread only); a value is :func:`ioprio_value` ``(class, level)``. The kernel's
rules: the real-time class needs ``CAP_SYS_ADMIN``/``CAP_SYS_NICE``; the best-effort (levels
0-7, 0 highest) and idle classes do not, so a thread of the same user may move between them
either way (unlike the CPU nice value, which an unprivileged thread can only raise); class
``NONE`` means "derived from the nice value": best-effort level ``(nice + 20) // 5``.

Not here, by design: VeloC's own binding (``deepfreeze.bindings.veloc``, a library of its own),
and ctypes used only as a struct layout or a memory view (``memtier.copy``'s ``iovec`` array,
``stream.slots``'s ``struct flock`` packed for :func:`fcntl.fcntl`, ``keras.clone``'s writable view
of a variable's buffer); they call no C function.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from typing import Any

__all__ = ["available", "memcmp", "memmove", "sync_file_range", "SYNC_FILE_RANGE_WRITE", "madvise",
           "MADV_POPULATE_WRITE",
           "process_vm_readv", "process_vm_writev", "prctl", "PR_SET_PTRACER", "PR_SET_PTRACER_ANY",
           "ioprio_set", "ioprio_get", "ioprio_value", "ioprio_parts", "IOPRIO_WHO_PROCESS", "IOPRIO_CLASS_NONE",
           "IOPRIO_CLASS_RT", "IOPRIO_CLASS_BE", "IOPRIO_CLASS_IDLE"]

#: ``sync_file_range``'s flag: start writing the range's dirty pages, do not wait
SYNC_FILE_RANGE_WRITE = 2
#: ``madvise`` advice (Linux 5.14): fault the range's pages in for writing, their contents unchanged
MADV_POPULATE_WRITE = 23
#: ``prctl`` option (Yama): allow one process to ptrace (read the memory of) this one
PR_SET_PTRACER = 0x59616D61
#: ``PR_SET_PTRACER``'s argument allowing every process
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
#: ``ioprio_set``/``ioprio_get``'s ``which``: ``who`` is a thread id (0: the calling thread)
IOPRIO_WHO_PROCESS = 1
#: I/O scheduling classes (``ioprio.h``): none (from the nice value), real-time, best-effort, idle
IOPRIO_CLASS_NONE, IOPRIO_CLASS_RT, IOPRIO_CLASS_BE, IOPRIO_CLASS_IDLE = 0, 1, 2, 3
_IOPRIO_CLASS_SHIFT = 13
#: (ioprio_set, ioprio_get) system call numbers of this architecture
_IOPRIO_NR = {"x86_64": (251, 252), "aarch64": (30, 31)}.get(os.uname().machine)


def _load() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:  # pragma: no cover - every supported platform has a C library
        return None


_libc = _load()

# name -> (restype, argtypes), the signatures of everything called
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "memcmp": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]),
    "sync_file_range": (ctypes.c_int, [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]),
    "madvise": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]),
    "process_vm_readv": (ctypes.c_ssize_t, [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                                            ctypes.c_ulong, ctypes.c_ulong]),
    "process_vm_writev": (ctypes.c_ssize_t, [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                                             ctypes.c_ulong, ctypes.c_ulong]),
    "prctl": (ctypes.c_int, [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]),
    # (number, which, who, ioprio): ioprio_set and ioprio_get (which ignores its third argument)
    "syscall": (ctypes.c_long, [ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_int]),
}


def _bind(name: str) -> Any:
    f = getattr(_libc, name, None) if _libc is not None else None
    if f is not None:
        f.restype, f.argtypes = _SIGNATURES[name]
    return f


_FUNCS: dict[str, Any] = {name: _bind(name) for name in _SIGNATURES}
_memcmp = _FUNCS["memcmp"]
_sync_file_range = _FUNCS["sync_file_range"]
_madvise = _FUNCS["madvise"]
_readv = _FUNCS["process_vm_readv"]
_writev = _FUNCS["process_vm_writev"]
_prctl = _FUNCS["prctl"]
_syscall = _FUNCS.pop("syscall")
_FUNCS["ioprio_set"] = _FUNCS["ioprio_get"] = _syscall if _IOPRIO_NR is not None else None


def available(name: str) -> bool:
    """Whether this C library has the function ``name`` (one of this module's: ``"memcmp"``,
    ``"sync_file_range"``, ``"process_vm_readv"``, ``"process_vm_writev"``, ``"prctl"``; for
    ``"ioprio_set"``/``"ioprio_get"``: ``syscall``, on an architecture whose numbers are known)."""
    if name not in _FUNCS:
        raise ValueError(f"{name!r} is not one of deepfreeze._native's functions ({', '.join(sorted(_FUNCS))})")
    return _FUNCS[name] is not None


def _error(err: int, what: str) -> OSError:
    return OSError(err, f"{os.strerror(err)} ({what})")


def _missing(name: str) -> OSError:
    return _error(errno.ENOSYS, f"{name}: this C library does not have it")


def memcmp(a: int, b: int, n: int) -> int:
    """``memcmp`` of ``n`` bytes at addresses ``a`` and ``b`` (the GIL released): <0, 0 or >0."""
    if _memcmp is None:  # pragma: no cover - every C library has memcmp
        raise _missing("memcmp")
    return _memcmp(a, b, n)


def memmove(dst: int, src: int, n: int) -> None:
    """Copy ``n`` bytes from address ``src`` to ``dst`` (they may overlap; the GIL released)."""
    ctypes.memmove(dst, src, n)


def sync_file_range(fd: int, offset: int, length: int, flags: int) -> None:
    """``sync_file_range(fd, offset, length, flags)`` (Linux): start (or wait for) the write-back
    of a range of a file's dirty pages."""
    if _sync_file_range is None:
        raise _missing("sync_file_range")
    if _sync_file_range(fd, offset, length, flags) != 0:
        raise _error(ctypes.get_errno(), f"sync_file_range of descriptor {fd}, bytes [{offset}, {offset + length})")


def madvise(addr: int, length: int, advice: int) -> None:
    """``madvise(addr, length, advice)`` (the GIL released: :data:`MADV_POPULATE_WRITE` of a large
    range takes a while); ``addr`` page-aligned."""
    if _madvise is None:  # pragma: no cover - every Linux C library has madvise
        raise _missing("madvise")
    if _madvise(addr, length, advice) != 0:
        raise _error(ctypes.get_errno(), f"madvise({advice}) of {length} bytes")


def _vm(f: Any, name: str, pid: int, local: int, liovcnt: int, remote: int, riovcnt: int, flags: int) -> int:
    if f is None:
        raise _missing(name)
    n = f(pid, local, liovcnt, remote, riovcnt, flags)
    if n < 0:
        raise _error(ctypes.get_errno(), f"{name} of process {pid}, {liovcnt} local and {riovcnt} remote iovecs")
    return n


def process_vm_readv(pid: int, local: int, liovcnt: int, remote: int, riovcnt: int, flags: int = 0) -> int:
    """``process_vm_readv`` (Linux >= 3.2): copy from process ``pid``'s memory described by the
    ``riovcnt`` iovecs at address ``remote`` into the ``liovcnt`` iovecs at ``local``; the number
    of bytes copied (may be fewer than asked)."""
    return _vm(_readv, "process_vm_readv", pid, local, liovcnt, remote, riovcnt, flags)


def process_vm_writev(pid: int, local: int, liovcnt: int, remote: int, riovcnt: int, flags: int = 0) -> int:
    """``process_vm_writev``: copy the ``liovcnt`` iovecs at ``local`` into process ``pid``'s memory
    described by the ``riovcnt`` iovecs at ``remote``; the number of bytes copied (may be fewer)."""
    return _vm(_writev, "process_vm_writev", pid, local, liovcnt, remote, riovcnt, flags)


def prctl(option: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0) -> int:
    """``prctl(option, arg2, arg3, arg4, arg5)`` (Linux); its (non-negative) result."""
    if _prctl is None:
        raise _missing("prctl")
    r = _prctl(option, arg2, arg3, arg4, arg5)
    if r < 0:
        raise _error(ctypes.get_errno(), f"prctl({option:#x}, {arg2}, {arg3}, {arg4}, {arg5})")
    return r


def ioprio_value(cls: int, level: int = 0) -> int:
    """The I/O priority value of ``cls`` (an ``IOPRIO_CLASS_*``) and ``level`` (0-7, 0 highest)."""
    return (cls << _IOPRIO_CLASS_SHIFT) | level


def ioprio_parts(value: int) -> tuple[int, int]:
    """``(class, level)`` of an I/O priority value (:func:`ioprio_get`'s result; the level is the
    low 3 bits: Linux 6.x keeps hints in the bits above it)."""
    return value >> _IOPRIO_CLASS_SHIFT, value & 7


def ioprio_set(which: int, who: int, ioprio: int) -> None:
    """``ioprio_set(which, who, ioprio)`` (Linux): set the I/O priority of thread ``who`` (with
    :data:`IOPRIO_WHO_PROCESS`) to ``ioprio`` (:func:`ioprio_value`)."""
    if _syscall is None or _IOPRIO_NR is None:
        raise _missing(f"ioprio_set (no system call number known for {os.uname().machine})")
    if _syscall(_IOPRIO_NR[0], which, who, ioprio) != 0:
        cls, level = ioprio_parts(ioprio)
        raise _error(ctypes.get_errno(), f"ioprio_set of {who} (which {which}) to class {cls} level {level}")


def ioprio_get(which: int, who: int) -> int:
    """``ioprio_get(which, who)`` (Linux): the I/O priority value of thread ``who`` (with
    :data:`IOPRIO_WHO_PROCESS`; class ``NONE`` (0) when never set: derived from its nice value)."""
    if _syscall is None or _IOPRIO_NR is None:
        raise _missing(f"ioprio_get (no system call number known for {os.uname().machine})")
    r = _syscall(_IOPRIO_NR[1], which, who, 0)
    if r < 0:
        raise _error(ctypes.get_errno(), f"ioprio_get of {who} (which {which})")
    return int(r)
