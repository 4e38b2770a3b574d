"""ctypes bindings to VeloC's C client library (``libveloc-client.so``).

All of DeepFreeze's ctypes lives in this module: every symbol gets its
``argtypes``/``restype`` once, in :data:`_SIGNATURES`; every call goes through
:meth:`Veloc._call`, the one place where ``VELOC_FAILURE`` (-1) becomes a
:class:`~deepfreeze.errors.VelocError` naming the call and its arguments.
numpy buffers are passed by address (no copies); the caller keeps them alive
and unchanged until the checkpoint call that reads them returns.

Finding the library, first match wins:

1. ``$VELOC_LIB``: the path of ``libveloc-client.so`` itself;
2. ``$DEEPFREEZE_VELOC_PREFIX``: an install prefix (``lib/`` or ``lib64/`` below it);
3. the dynamic loader's path (``LD_LIBRARY_PATH``, ``ldconfig``; e.g. after
   ``module load veloc`` or ``spack load veloc``).

VeloC 1.8 behaviour the callers must mind (see ``docs/veloc.md``):

* ``mode`` is mandatory in the INI file, and every key can be overridden by the
  environment variable ``VELOC_<KEY>``, which wins over the file;
* checkpoint names must match ``[a-zA-Z0-9_.]+``;
* memory regions are kept per checkpoint name; the first checkpoint of a name
  freezes a copy of the default regions for it, so later ``VELOC_Mem_protect``
  calls are ignored for that name: use ``region_protect(..., name=...)``;
* in ``async`` mode the client starts ``veloc-backend`` from ``$VELOC_BIN``
  (``<prefix>/bin`` is filled in when the prefix is known) through ``system()``,
  so the daemon inherits the caller's open pipes: start it first with
  :func:`deepfreeze.veloc_daemon.start_backend`. There is one backend per user and
  machine, and it keeps the configuration it was started with;
* a process can call ``VELOC_Init`` once (a second one crashes): enforced here;
* the file API (:meth:`Veloc.route_file`) always writes
  ``<scratch>/<name>-<id>-<version>.dat``; the backend copies it to the routed
  ``original`` path and leaves a symlink ``<persistent>/<name>-<id>-<version>.dat``.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from typing import Any, Sequence

import numpy as np

from deepfreeze.errors import VelocError, VelocNotFoundError

__all__ = ["Veloc", "find_library", "available", "VELOC_SUCCESS", "VELOC_FAILURE",
           "VELOC_CKPT_ALL", "VELOC_CKPT_SOME", "VELOC_CKPT_REST",
           "VELOC_RECOVER_ALL", "VELOC_RECOVER_SOME", "VELOC_RECOVER_REST", "VELOC_MAX_NAME"]

VELOC_SUCCESS, VELOC_FAILURE = 0, -1
VELOC_CKPT_ALL, VELOC_CKPT_SOME, VELOC_CKPT_REST = 0, 1, 2
VELOC_RECOVER_ALL, VELOC_RECOVER_SOME, VELOC_RECOVER_REST = 0, 1, 2
VELOC_MAX_NAME = 1024  # size of the buffer VELOC_Route_file writes into (veloc/defs.h)
LIBRARY = "libveloc-client.so"

_p, _i, _s, _sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t
_ip = ctypes.POINTER(ctypes.c_int)
#: name -> (argtypes, restype); ``"comm"`` is replaced by the MPI_Comm type of the loaded MPI
_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "VELOC_Init": (["comm", _s], _i),
    "VELOC_Init_single": ([ctypes.c_uint, _s], _i),
    "VELOC_Finalize": ([_i], _i),
    "VELOC_Mem_protect": ([_i, _p, _sz, _sz], _i),
    "VELOC_Region_protect": ([_i, _p, _sz, _sz, _s], _i),
    "VELOC_Mem_unprotect": ([_i], _i),
    "VELOC_Region_unprotect": ([_i, _s], _i),
    "VELOC_Mem_clear": ([], _i),
    "VELOC_Region_clear": ([_s], _i),
    "VELOC_Route_file": ([_s, ctypes.c_char_p], _i),
    "VELOC_Cleanup": ([_s], _i),
    "VELOC_Checkpoint_begin": ([_s, _i], _i),
    "VELOC_Checkpoint_selective": ([_i, _ip, _i], _i),
    "VELOC_Checkpoint_mem": ([], _i),
    "VELOC_Checkpoint_end": ([_i], _i),
    "VELOC_Checkpoint_wait": ([], _i),
    "VELOC_Checkpoint_finished": ([], _i),
    "VELOC_Checkpoint": ([_s, _i], _i),
    "VELOC_Restart_test": ([_s, _i], _i),
    "VELOC_Restart_begin": ([_s, _i], _i),
    "VELOC_Recover_selective": ([_i, _ip, _i], _i),
    "VELOC_Recover_size": ([_i], _i),
    "VELOC_Recover_mem": ([], _i),
    "VELOC_Restart_end": ([_i], _i),
    "VELOC_Restart": ([_s, _i], _i),
}


def find_library(env: dict[str, str] | None = None) -> str | None:
    """Path (or loader name) of ``libveloc-client.so``, or None when nothing points to one."""
    env = os.environ if env is None else env
    if env.get("VELOC_LIB"):
        return env["VELOC_LIB"]
    prefix = env.get("DEEPFREEZE_VELOC_PREFIX")
    if prefix:
        for sub in ("lib", "lib64"):
            path = os.path.join(prefix, sub, LIBRARY)
            if os.path.exists(path):
                return path
        return os.path.join(prefix, "lib", LIBRARY)  # reported as missing by load()
    return ctypes.util.find_library("veloc-client")


def _prefix_of(path: str) -> str | None:
    d = os.path.dirname(os.path.abspath(path))
    return os.path.dirname(d) if os.path.basename(d) in ("lib", "lib64") else None


_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_INITIALIZED = False  # VeloC 1.8 can be initialized once per process (a second VELOC_Init crashes)


def _load() -> ctypes.CDLL:
    global _LIB
    with _LOCK:
        if _LIB is not None:
            return _LIB
        where = find_library()
        if where is None:
            raise VelocNotFoundError(
                "VeloC's client library (libveloc-client.so) was not found: set DEEPFREEZE_VELOC_PREFIX to "
                "the VeloC install prefix (the directory holding lib/libveloc-client.so and bin/veloc-backend), "
                "or VELOC_LIB to the library itself, or load the site's module (module load veloc). "
                "Without VeloC use engine='builtin'.")
        try:
            lib = ctypes.CDLL(where, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            raise VelocNotFoundError(
                f"VeloC's client library could not be loaded from {where}: {e}. Check DEEPFREEZE_VELOC_PREFIX / "
                "VELOC_LIB, and that VeloC was built against this MPI (its dependencies must resolve: "
                f"ldd {where})") from e
        comm_t = _mpi_comm_type()
        for name, (args, res) in _SIGNATURES.items():
            try:
                fn = getattr(lib, name)
            except AttributeError as e:
                raise VelocNotFoundError(f"{where} has no symbol {name}: it is not a VeloC >= 1.7 client "
                                         "library") from e
            fn.argtypes = [comm_t if a == "comm" else a for a in args]
            fn.restype = res
        if "VELOC_BIN" not in os.environ and os.path.sep in where:
            prefix = _prefix_of(where)
            if prefix and os.path.exists(os.path.join(prefix, "bin", "veloc-backend")):
                os.environ["VELOC_BIN"] = os.path.join(prefix, "bin")  # the client starts the backend from here
        _LIB = lib
        return lib


def _mpi_comm_type() -> Any:
    """``MPI_Comm`` of the MPI in this process: a pointer (Open MPI) or an int (MPICH)."""
    try:
        from mpi4py import MPI
        return ctypes.c_void_p if MPI._sizeof(MPI.Comm) == ctypes.sizeof(ctypes.c_void_p) else ctypes.c_int
    except ImportError:
        return ctypes.c_void_p


def available() -> str | None:
    """None if VeloC can be loaded, else why not (for skips and ``engine="auto"``)."""
    try:
        _load()
        return None
    except VelocNotFoundError as e:
        return str(e)


def _b(s: str) -> bytes:
    return os.fsencode(s)


class Veloc:
    """One process's VeloC client: :meth:`init` (collective, with an mpi4py communicator) or
    :meth:`init_single`, then the checkpoint/restart calls, then :meth:`finalize`."""

    def __init__(self) -> None:
        self.lib = _load()
        self.initialized = False

    def _call(self, name: str, *args: Any, ok: Any = None) -> int:
        """Call ``VELOC_<name>``; a ``VELOC_FAILURE`` (or a result ``ok`` rejects) raises VelocError."""
        rc = getattr(self.lib, name)(*args)
        if (rc == VELOC_FAILURE) if ok is None else not ok(rc):
            shown = ", ".join(a.decode(errors="replace") if isinstance(a, bytes) else
                              ("<MPI_Comm>" if name == "VELOC_Init" and i == 0 else str(a))
                              for i, a in enumerate(args))
            raise VelocError(f"{name}({shown}) failed (returned {rc}); VeloC's own message is on stdout/stderr "
                             "and in its logs (/dev/shm/veloc-*.log by default)")
        return rc

    def _require_init(self, call: str) -> None:
        if not self.initialized:
            raise VelocError(f"{call} called before VELOC_Init / VELOC_Init_single (or after VELOC_Finalize)")

    # -- init / finalize
    def _once(self, call: str) -> None:
        global _INITIALIZED
        with _LOCK:
            if _INITIALIZED:
                raise VelocError(f"{call}: VeloC 1.8 can be initialized once per process (its Finalize leaves "
                                 "a dangling client and a second Init crashes): create one VeloC engine per "
                                 "process and keep it")
            _INITIALIZED = True

    def init(self, comm: Any, cfg_file: str) -> None:
        """``VELOC_Init`` on an mpi4py communicator (collective over it)."""
        from mpi4py import MPI
        self._once("VELOC_Init")
        self._call("VELOC_Init", MPI._handleof(comm), _b(cfg_file))
        self.initialized = True

    def init_single(self, id: int, cfg_file: str) -> None:
        self._once("VELOC_Init_single")
        self._call("VELOC_Init_single", id, _b(cfg_file))
        self.initialized = True

    def finalize(self, drain: bool = True) -> None:
        if self.initialized:
            self.initialized = False
            self._call("VELOC_Finalize", int(drain))

    # -- memory regions (buffers by address: no copies)
    # VeloC 1.8 returns VELOC_FAILURE from (Mem|Region)_protect when the id existed, although it
    # updated the region (insert_or_assign(...).second): both results mean success here.
    def mem_protect(self, id: int, array: np.ndarray) -> None:
        self._require_init("VELOC_Mem_protect")
        self._call("VELOC_Mem_protect", id, *_region(array), ok=lambda rc: rc in (VELOC_SUCCESS, VELOC_FAILURE))

    def region_protect(self, id: int, array: np.ndarray, name: str) -> None:
        self._require_init("VELOC_Region_protect")
        self._call("VELOC_Region_protect", id, *_region(array), _b(name),
                   ok=lambda rc: rc in (VELOC_SUCCESS, VELOC_FAILURE))

    def mem_unprotect(self, id: int) -> None:
        self._call("VELOC_Mem_unprotect", id)

    def region_unprotect(self, id: int, name: str) -> None:
        self._call("VELOC_Region_unprotect", id, _b(name))

    def mem_clear(self) -> None:
        self._call("VELOC_Mem_clear")

    def region_clear(self, name: str) -> None:
        self._call("VELOC_Region_clear", _b(name))

    # -- checkpoint
    def checkpoint_begin(self, name: str, version: int) -> None:
        self._call("VELOC_Checkpoint_begin", _b(name), version)

    def checkpoint_selective(self, mode: int, ids: Sequence[int]) -> None:
        arr = (ctypes.c_int * len(ids))(*ids)
        self._call("VELOC_Checkpoint_selective", mode, arr, len(ids))

    def checkpoint_mem(self) -> None:
        self._call("VELOC_Checkpoint_mem")

    def checkpoint_end(self, success: bool = True) -> None:
        self._call("VELOC_Checkpoint_end", int(success))

    def checkpoint_wait(self) -> None:
        self._call("VELOC_Checkpoint_wait")

    def checkpoint_finished(self) -> bool:
        """True when the last asynchronous checkpoint is done. (VeloC 1.8 returns VELOC_SUCCESS
        when done and VELOC_FAILURE while it runs, despite its header's wording; with its default
        socket queue it cannot tell in async mode and always answers "not done": use
        :meth:`checkpoint_wait` there.)"""
        return self.lib.VELOC_Checkpoint_finished() == VELOC_SUCCESS

    def checkpoint(self, name: str, version: int) -> None:
        self._call("VELOC_Checkpoint", _b(name), version)

    def route_file(self, original: str) -> str:
        """Scratch path to write this checkpoint's file at (VeloC then flushes it to ``original``)."""
        self._require_init("VELOC_Route_file")  # VeloC 1.8 dereferences its client unchecked: a crash
        buf = ctypes.create_string_buffer(VELOC_MAX_NAME)
        if len(_b(original)) >= 4096:
            raise VelocError(f"VELOC_Route_file({original!r}): path longer than PATH_MAX")
        self._call("VELOC_Route_file", _b(original), buf)
        return os.fsdecode(buf.value)

    def cleanup(self, name: str) -> None:
        self._call("VELOC_Cleanup", _b(name))

    # -- restart
    def restart_test(self, name: str, version: int = 0) -> int | None:
        """Newest version <= ``version`` (0: any) this process can restart from, or None.
        (VeloC 1.8 returns -2, not VELOC_FAILURE, when there is none: any negative means none.)"""
        rc = self.lib.VELOC_Restart_test(_b(name), version)
        return None if rc < 0 else rc

    def restart_begin(self, name: str, version: int) -> None:
        self._call("VELOC_Restart_begin", _b(name), version)

    def recover_selective(self, mode: int, ids: Sequence[int]) -> None:
        arr = (ctypes.c_int * len(ids))(*ids)
        self._call("VELOC_Recover_selective", mode, arr, len(ids))

    def recover_size(self, id: int) -> int:
        """Bytes saved under region ``id`` in the checkpoint being restarted (0: no such id)."""
        return self._call("VELOC_Recover_size", id)

    def recover_mem(self) -> None:
        self._call("VELOC_Recover_mem")

    def restart_end(self, success: bool = True) -> None:
        self._call("VELOC_Restart_end", int(success))

    def restart(self, name: str, version: int) -> None:
        self._call("VELOC_Restart", _b(name), version)


def _region(array: np.ndarray) -> tuple[int, int, int]:
    if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
        raise ValueError("VeloC regions must be C-contiguous numpy arrays (no copy is made)")
    return array.ctypes.data, array.size, array.itemsize
