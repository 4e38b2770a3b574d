"""The native fused-copy op: build, load and call ``DeepFreezeFusedCopy``.

The op (source ``_ops/fused_copy.cc``, shipped with the package) copies this rank's
pieces of many tensors into one caller-owned, pre-faulted host buffer in one kernel
launch, with no TensorFlow allocation: each piece ``i`` goes to ``dst_offsets[i]``, then
bytes ``[0, 8)`` of the buffer get the step (int64, little-endian). It is compiled
against the installed TensorFlow's headers (as Horovod is) by ``scripts/setup.sh``::

    python -m deepfreeze.keras.native build [--force]

which writes ``_ops/_fused_copy.so`` next to the source (through a temporary name
renamed into place, so a half-built library is never loaded) and rebuilds only when
the source is newer than the library, the library is missing, or it was built for
another TensorFlow. :func:`load` never builds and never raises: without the library
it returns ``None`` and :func:`unavailable_reason` says why (DeepFreeze then uses its
pure-TensorFlow capture).

The kernel copies on the calling thread with non-temporal stores for pieces of 64 KiB-16 MiB
(fastest measured on the 2-core test machine, ``experiments/fused_copy.py``);
``DEEPFREEZE_FUSED_COPY_THREADS=0`` (or ``n``) spreads copies of >= 4 MiB over TensorFlow's CPU
worker threads in 2 MiB chunks, ``DEEPFREEZE_FUSED_COPY_NT=0`` uses ``memcpy`` only. Both are
read when a kernel is built (a function's first run).

Two ops: ``DeepFreezeFusedCopyVars(dest, step, vars, src_offsets, dst_offsets, lengths)`` takes
a reference to each resource variable's current buffer under its lock (as ``ReadVariableOp``
does, no copy) and copies every piece, one graph node for all the variables (a
``ReadVariableOp`` per tensor cost 3-10 us each); ``DeepFreezeFusedCopy`` is the same copy over
tensors. ``dest`` is ``[address, capacity]`` of the caller's buffer (the sink's ``control[1:]``);
the kernel validates every offset and length against the value sizes and the capacity before it
writes a byte.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Any, Sequence

import tensorflow as tf

from ..errors import NativeBuildError

__all__ = ["SOURCE", "LIBRARY", "build", "load", "unavailable_reason", "fused_copy", "fused_copy_vars",
           "buffer_address"]

log = logging.getLogger("deepfreeze")

_OPS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ops")
SOURCE = os.path.join(_OPS_DIR, "fused_copy.cc")  #: the op's C++ source (package data)
LIBRARY = os.path.join(_OPS_DIR, "_fused_copy.so")  #: where :func:`build` puts the library
_BUILD_INFO = LIBRARY + ".json"  # what the library was built against (TF version, flags)
_BUILD_TIMEOUT = 600.0


_lock = threading.Lock()
_loaded: Any = None
_reason: str | None = None
_tried = False


def _compiler() -> str | None:
    """The C++ compiler: ``$CXX`` if set, else ``g++`` on PATH, else ``/usr/bin/g++``."""
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx) or (cxx if os.access(cxx, os.X_OK) else None)
    return shutil.which("g++") or ("/usr/bin/g++" if os.access("/usr/bin/g++", os.X_OK) else None)


def _tf_build_info() -> dict[str, Any]:
    return {"tensorflow": tf.__version__, "compile_flags": list(tf.sysconfig.get_compile_flags()),
            "link_flags": list(tf.sysconfig.get_link_flags())}


def _stale_reason(info: dict[str, Any]) -> str | None:
    """Why the library must be (re)built, or ``None`` when it is up to date."""
    if not os.path.exists(LIBRARY):
        return f"{LIBRARY} is missing"
    if os.path.getmtime(SOURCE) > os.path.getmtime(LIBRARY):
        return f"{SOURCE} is newer than {LIBRARY}"
    try:
        with open(_BUILD_INFO) as f:
            built = json.load(f)
    except (OSError, ValueError):
        return f"{_BUILD_INFO} is missing or unreadable"
    if built != info:
        return f"it was built for TensorFlow {built.get('tensorflow')!r}, this is {info['tensorflow']!r}"
    return None


def build(force: bool = False, *, verbose: bool = False) -> str:
    """Compile the op into :data:`LIBRARY` unless it is up to date (or ``force``); return its path.

    Raises :class:`NativeBuildError` (with the compiler's output) when no compiler is found, the
    compilation fails, the result does not load or the directory is not writable; the previous
    library, if any, is left in place.
    """
    if not os.path.exists(SOURCE):
        raise NativeBuildError(f"the op's source {SOURCE} is missing: reinstall deepfreeze")
    info = _tf_build_info()
    why = "forced" if force else _stale_reason(info)
    if why is None:
        return LIBRARY
    cxx = _compiler()
    if cxx is None:
        raise NativeBuildError("no C++ compiler found (set CXX or install g++); DeepFreeze uses its "
                               "pure-TensorFlow capture without the op")
    try:
        fd, tmp = tempfile.mkstemp(prefix="._fused_copy.", suffix=".so.tmp", dir=_OPS_DIR)
    except OSError as e:
        raise NativeBuildError(f"cannot write the op's library into {_OPS_DIR}: {e}; run the build "
                               f"as a user who can write there") from e
    os.close(fd)
    cmd = [cxx, "-shared", "-fPIC", "-O2", *info["compile_flags"], SOURCE, "-o", tmp, *info["link_flags"]]
    if verbose:
        print(f"building {LIBRARY} ({why}): {' '.join(cmd)}", flush=True)
    try:
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise NativeBuildError(f"running the compiler failed: {' '.join(cmd)}: {e}") from e
        if p.returncode != 0:
            raise NativeBuildError(f"compiling the fused-copy op failed (exit {p.returncode}): "
                                   f"{' '.join(cmd)}\n{(p.stdout + p.stderr)[-4000:]}")
        # load it in a fresh process before it replaces anything (an unresolved symbol shows here)
        check = [sys.executable, "-c", "import sys, tensorflow as tf; tf.load_op_library(sys.argv[1])", tmp]
        try:
            q = subprocess.run(check, capture_output=True, text=True, timeout=_BUILD_TIMEOUT,
                               env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        except (OSError, subprocess.TimeoutExpired) as e:
            raise NativeBuildError(f"loading the freshly built op failed: {e}") from e
        if q.returncode != 0:
            raise NativeBuildError(f"the freshly built op does not load into TensorFlow "
                                   f"{info['tensorflow']}:\n{(q.stdout + q.stderr)[-4000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, LIBRARY)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    try:
        with open(_BUILD_INFO + ".tmp", "w") as f:
            json.dump(info, f)
        os.replace(_BUILD_INFO + ".tmp", _BUILD_INFO)
    except OSError as e:  # the library is in place; without this record the next build redoes it
        raise NativeBuildError(f"cannot record the build in {_BUILD_INFO}: {e}") from e
    return LIBRARY


def load() -> Any | None:
    """The loaded op module (``tf.load_op_library``, once per process), or ``None`` when the
    library is missing or does not load; the reason is logged once (a warning) and kept for
    :func:`unavailable_reason`. Never builds, never raises."""
    global _loaded, _reason, _tried
    with _lock:
        if _tried:
            return _loaded
        _tried = True
        try:
            if not os.path.exists(LIBRARY):
                raise FileNotFoundError(f"{LIBRARY} is missing (run `python -m deepfreeze.keras.native build`)")
            _loaded = tf.load_op_library(LIBRARY)
        except Exception as e:  # noqa: BLE001 -- any failure means: use the fallback
            _loaded, _reason = None, f"fused-copy op unavailable: {type(e).__name__}: {e}"
            log.warning("deepfreeze: %s; using the pure-TensorFlow capture", _reason)
        return _loaded


def unavailable_reason() -> str | None:
    """Why :func:`load` returned ``None`` (loads first if needed), or ``None`` if the op is loaded."""
    load()
    return _reason


def buffer_address(buffer: Any) -> tuple[int, int]:
    """``(address, capacity in bytes)`` of a writable, C-contiguous numpy array (the caller keeps it
    alive for as long as an op that writes it may run)."""
    import numpy as np
    if not isinstance(buffer, np.ndarray):
        raise TypeError(f"dest must be a numpy array or an (address, capacity) pair, got {type(buffer).__name__}")
    if not buffer.flags.c_contiguous or not buffer.flags.writeable:
        raise ValueError("dest must be a writable, C-contiguous numpy array")
    return int(buffer.ctypes.data), int(buffer.nbytes)


@tf.autograph.experimental.do_not_convert  # no tensor control flow; spares AutoGraph's warnings
def fused_copy(dest: Any, step: Any, values: Sequence[Any], src_offsets: Sequence[int],
               dst_offsets: Sequence[int], lengths: Sequence[int]) -> Any:
    """Run ``DeepFreezeFusedCopy``: copy ``values[i]``'s bytes
    ``[src_offsets[i], src_offsets[i] + lengths[i])`` to
    ``dest[dst_offsets[i]:dst_offsets[i] + lengths[i]]``, then write ``step`` (int64,
    little-endian) to ``dest[0:8]``; return it (int64 scalar tensor).

    ``dest``: the buffer itself, a writable C-contiguous uint8 numpy array the caller keeps
    alive (its address is baked into a traced function), or ``[address, capacity]`` as an
    int64 tensor, int64 numpy array of shape (2,), list or tuple. ``values``: tensors or
    variables (read where the op is built; put it under ``tf.control_dependencies`` to order
    it after updates).
    Bad offsets or lengths raise ``tf.errors.InvalidArgumentError`` when the op runs, with
    nothing written. Raises :class:`NativeBuildError` if the op is not available.
    """
    import numpy as np
    mod = load()
    if mod is None:
        raise NativeBuildError(unavailable_reason() or "fused-copy op unavailable")
    if isinstance(dest, np.ndarray):
        if dest.dtype == np.uint8:
            dest = buffer_address(dest)
        elif dest.dtype != np.int64 or dest.shape != (2,):
            raise TypeError(f"dest must be the buffer (a uint8 numpy array) or [address, capacity] "
                            f"(int64, shape (2,)); got a {dest.dtype} array of shape {dest.shape}")
    return mod.deep_freeze_fused_copy(
        dest=tf.convert_to_tensor(dest, dtype=tf.int64), step=tf.convert_to_tensor(step, dtype=tf.int64),
        values=list(values), src_offsets=[int(x) for x in src_offsets],
        dst_offsets=[int(x) for x in dst_offsets], lengths=[int(x) for x in lengths])


@tf.autograph.experimental.do_not_convert
def fused_copy_vars(dest: Any, step: Any, variables: Sequence[Any], src_offsets: Sequence[int],
                    dst_offsets: Sequence[int], lengths: Sequence[int]) -> Any:
    """:func:`fused_copy` reading resource variables directly (``DeepFreezeFusedCopyVars``): the
    op takes each variable's current buffer under its lock, as ``ReadVariableOp`` does, so N
    variables cost one graph node instead of N reads and the copy. ``dest`` is
    ``[address, capacity]`` (int64). Order it after updates with ``tf.control_dependencies``."""
    mod = load()
    if mod is None:
        raise NativeBuildError(unavailable_reason() or "fused-copy op unavailable")
    return mod.deep_freeze_fused_copy_vars(
        dest=tf.convert_to_tensor(dest, dtype=tf.int64), step=tf.convert_to_tensor(step, dtype=tf.int64),
        vars=[v.handle for v in variables], src_offsets=[int(x) for x in src_offsets],
        dst_offsets=[int(x) for x in dst_offsets], lengths=[int(x) for x in lengths])


def _main(argv: Sequence[str]) -> int:
    usage = "usage: python -m deepfreeze.keras.native build [--force]"
    args = list(argv)
    if not args or args[0] != "build" or any(a != "--force" for a in args[1:]):
        print(usage, file=sys.stderr)
        return 2
    try:
        path = build(force="--force" in args, verbose=True)
    except (NativeBuildError, OSError) as e:
        print(f"deepfreeze: {e}", file=sys.stderr)
        return 1
    print(f"fused-copy op: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
