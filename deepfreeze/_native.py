"""DeepFreeze's calls into the C library, all of them (layer L0: the standard library only).

The C library is loaded once, here (``ctypes.CDLL`` of ``ctypes.util.find_library("c")``, else
``libc.so.6``, with ``use_errno``); every function used is declared with its ``argtypes`` and
``restype``; a call that fails raises ``OSError(errno, "<strerror> (<what was being done>)")``
(so ``ESRCH`` arrives as :class:`ProcessLookupError`, ``EPERM`` as :class:`PermissionError`).
A function the C library lacks (another platform, an old glibc) raises ``OSError(ENOSYS)``
when called; :func:`available` says beforehand. Nothing here retries: ``EINTR`` is the
caller's to handle.

Who uses what: :func:`sync_file_range` (``deepfreeze.levels``: the write-back hint of a flush),
:func:`memcmp` (``deepfreeze.repo.store``: deduplication's byte comparison, GIL released),
:func:`process_vm_readv` / :func:`process_vm_writev` / :func:`prctl` / :func:`memmove`
(``deepfreeze.memtier.copy``: the memory tier's copies and the Yama ptracer permission).

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

__all__ = ["available", "memcmp", "memmove", "sync_file_range", "SYNC_FILE_RANGE_WRITE",
           "process_vm_readv", "process_vm_writev", "prctl", "PR_SET_PTRACER", "PR_SET_PTRACER_ANY"]

#: ``sync_file_range``'s flag: start writing the range's dirty pages, do not wait
SYNC_FILE_RANGE_WRITE = 2
#: ``prctl`` option (Yama): allow one process to ptrace (read the memory of) this one
PR_SET_PTRACER = 0x59616D61
#: ``PR_SET_PTRACER``'s argument allowing every process
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


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
    "process_vm_readv": (ctypes.c_ssize_t, [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                                            ctypes.c_ulong, ctypes.c_ulong]),
    "process_vm_writev": (ctypes.c_ssize_t, [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                                             ctypes.c_ulong, ctypes.c_ulong]),
    "prctl": (ctypes.c_int, [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]),
}


def _bind(name: str) -> Any:
    f = getattr(_libc, name, None) if _libc is not None else None
    if f is not None:
        f.restype, f.argtypes = _SIGNATURES[name]
    return f


_FUNCS: dict[str, Any] = {name: _bind(name) for name in _SIGNATURES}
_memcmp = _FUNCS["memcmp"]
_sync_file_range = _FUNCS["sync_file_range"]
_readv = _FUNCS["process_vm_readv"]
_writev = _FUNCS["process_vm_writev"]
_prctl = _FUNCS["prctl"]


def available(name: str) -> bool:
    """Whether this C library has the function ``name`` (one of this module's: ``"memcmp"``,
    ``"sync_file_range"``, ``"process_vm_readv"``, ``"process_vm_writev"``, ``"prctl"``)."""
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
