"""Export a restored checkpoint to other formats: NumPy ``.npz``, safetensors, Keras HDF5 weights.

Used by ``deepfreeze export`` (see docs/cli.md). The input is a
:class:`deepfreeze.Checkpoint` (from :func:`deepfreeze.load`): tensors by name,
in model order. Every writer writes a temporary file next to the output and
renames it into place, so an interrupted export never leaves a half-written
file under the output name; the output's directory must be owned by the user
or root and writable by nobody else (:func:`atomic_output`,
:func:`deepfreeze.ownership.check_output_dir`), checked before anything is written. No TensorFlow, no pickle; the libraries a format
needs are imported only when that format is written (``safetensors`` for
``safetensors``, ``h5py`` for ``h5``; both in the ``export`` extra).

* ``npz``: what ``np.savez`` writes (a ZIP of ``.npy`` members, stored, not
  compressed), keyed by tensor name, written with ``allow_pickle=False``.
* ``safetensors``: written by the ``safetensors`` library
  (``safetensors.numpy.save_file``): an 8-byte little-endian header length, a
  JSON header (per tensor ``dtype``, ``shape``, ``data_offsets`` relative to
  the data, plus ``__metadata__`` with string values), padded with spaces to a
  multiple of 8, then the raw little-endian bytes of every tensor, back to
  back. The library chooses the order (larger dtypes first, then by name), not
  the checkpoint's; readers look tensors up by name. Only the dtypes of
  :data:`SAFETENSORS_DTYPES` are written (``bfloat16`` from ``ml_dtypes``
  included); others are refused before anything is written.
* ``h5``: a Keras 2.15 HDF5 *weights* file, laid out as
  ``model.save_weights("x.h5")`` writes it, so ``model.load_weights(path)``
  reads it. Layer names come from the tensor names (``<layer>/<weight>``:
  the part before the last ``/``), layers and weights keep the checkpoint
  order.
"""
from __future__ import annotations

import os
import zipfile
from typing import Any, Callable, Mapping

import numpy as np

from . import ownership
from .errors import DeepFreezeError
from .fsafe import replacing_path

__all__ = ["FORMATS", "SAFETENSORS_DTYPES", "ExportError", "export", "write_npz", "write_safetensors",
           "write_h5", "h5_layers", "format_from_path", "atomic_output"]

FORMATS = ("h5", "npz", "safetensors")
_SUFFIXES = {".h5": "h5", ".hdf5": "h5", ".npz": "npz", ".safetensors": "safetensors"}

#: numpy dtype name -> safetensors dtype code
SAFETENSORS_DTYPES = {
    "float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16",
    "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64",
    "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL",
}

#: what tf.keras 2.15 writes in the root attributes of a weights file
KERAS_VERSION = "2.15.0"
KERAS_BACKEND = "tensorflow"
_HDF5_OBJECT_HEADER_LIMIT = 64512  # keras/src/saving/legacy/hdf5_format.py
TOP_LEVEL_GROUP = "top_level_model_weights"


class ExportError(DeepFreezeError, ValueError):
    """The checkpoint cannot be represented in the requested format, or the output is refused."""


def format_from_path(path: str) -> str | None:
    """The format a file name's suffix implies (``.h5``, ``.hdf5``, ``.npz``, ``.safetensors``), or None."""
    low = path.lower()
    for suffix, name in _SUFFIXES.items():
        if low.endswith(suffix):
            return name
    return None


def _dtype_name(a: np.ndarray) -> str:
    return a.dtype.name  # "bfloat16" for ml_dtypes' bfloat16


def atomic_output(path: str, force: bool, write: Callable[[str], None], *, shared_group: bool = False) -> int:
    """Run ``write(tmp)`` then rename ``tmp`` to ``path``; returns the size written. The directory of
    ``path`` must exist and follow the roots' rule (:func:`deepfreeze.ownership.check_output_dir`:
    owned by you or root, writable by nobody else unless sticky or, with ``shared_group``,
    group-writable): else :class:`~deepfreeze.errors.UnsafePathError` before anything is written."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        raise ExportError(f"output {path} is a directory: give a file name")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise ExportError(f"the directory of the output, {parent}, does not exist")
    ownership.check_output_dir(parent, what=f"output {path}", shared_group=shared_group)
    if os.path.lexists(path) and not force:
        raise ExportError(f"output {path} exists: pass --force to overwrite it")
    with replacing_path(path, "export.rename") as tmp:
        try:  # created here, owner-only, never through a symbolic link; the writer then truncates it
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        except FileExistsError as e:
            raise ExportError(f"{tmp} (the temporary name of the output) exists already, maybe a link planted by "
                              "another user: removed it; run the export again") from e
        write(tmp)
    return os.path.getsize(path)


# --------------------------------------------------------------------------- npz

def write_npz(arrays: Mapping[str, np.ndarray], path: str, *, force: bool = False, shared_group: bool = False) -> int:
    """``np.savez`` layout keyed by tensor name (any name, also ``file``), no pickle. The output's
    directory follows :func:`atomic_output`'s rule (``shared_group``: a group-writable one is trusted)."""
    for name, a in arrays.items():
        if _dtype_name(a) == "bfloat16":
            raise ExportError(f"tensor {name!r} is bfloat16, which .npy cannot describe (it would load back "
                              "as raw 2-byte void); export to safetensors instead")

    def write(tmp: str) -> None:
        # exactly what np.savez does: one stored (uncompressed) .npy member per array
        with zipfile.ZipFile(tmp, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, a in arrays.items():
                with zf.open(name + ".npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, np.asanyarray(a), allow_pickle=False)
    return atomic_output(path, force, write, shared_group=shared_group)


# --------------------------------------------------------------------------- safetensors

def _safetensors_ready(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays as the library needs them: C-contiguous, little-endian, dtype checked.

    ``safetensors.numpy`` reads an array's memory through its data pointer, so a strided view
    (a slice, a transpose) would be written as the bytes of its base: copied here first. A 0-d
    array stays 0-d (``np.ascontiguousarray`` would make it 1-d)."""
    out: dict[str, np.ndarray] = {}
    for name, a in arrays.items():
        if name == "__metadata__":
            raise ExportError("a tensor named '__metadata__' cannot be stored in safetensors (the format "
                              "reserves that key for the metadata): rename it")
        a = np.asarray(a)
        if _dtype_name(a) not in SAFETENSORS_DTYPES:
            raise ExportError(f"tensor {name!r} has dtype {a.dtype.name}, which safetensors does not define; "
                              f"it supports {', '.join(sorted(SAFETENSORS_DTYPES))}")
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        if not a.flags.c_contiguous:
            a = a.copy(order="C")
        out[name] = a
    return out


def write_safetensors(arrays: Mapping[str, np.ndarray], path: str, metadata: Mapping[str, Any] | None = None,
                      *, force: bool = False, shared_group: bool = False) -> int:
    """Write ``arrays`` as safetensors with the ``safetensors`` library; ``metadata`` values become
    strings in ``__metadata__``. Returns the bytes written. Refuses (:class:`ExportError`, nothing
    written) a dtype safetensors does not define, a tensor named ``__metadata__``, an existing
    output without ``force``, and a missing ``safetensors`` package; an output directory that breaks
    :func:`atomic_output`'s rule is an :class:`~deepfreeze.errors.UnsafePathError`."""
    try:
        from safetensors import SafetensorError
        from safetensors.numpy import save_file
    except ImportError as e:
        raise ExportError("safetensors export needs the safetensors package: pip install safetensors "
                          "(or install deepfreeze[export])") from e
    ready = _safetensors_ready(arrays)
    meta: dict[str, str] | None = {str(k): str(v) for k, v in (metadata or {}).items()}
    if not ready and not meta:
        meta = None  # safetensors 0.8 writes an invalid header for no tensors and an empty __metadata__

    def write(tmp: str) -> None:
        try:  # ``ready`` keeps every array alive while the library reads their memory
            save_file(ready, tmp, metadata=meta)
        except (SafetensorError, ValueError, TypeError) as e:
            raise ExportError(f"the safetensors library refused to write {path}: {e}") from e
    return atomic_output(path, force, write, shared_group=shared_group)


# --------------------------------------------------------------------------- Keras HDF5 weights

def h5_layers(names: list[str]) -> tuple[list[str], dict[str, list[str]], list[str]]:
    """Group tensor names by layer (the part before the last ``/``), in first-seen order.

    Returns (layer names, tensor names per layer, top-level tensor names without a ``/``).
    """
    order: list[str] = []
    per: dict[str, list[str]] = {}
    top: list[str] = []
    for n in names:
        if "/" not in n:
            top.append(n)
            continue
        layer = n.rsplit("/", 1)[0]
        if layer not in per:
            per[layer] = []
            order.append(layer)
        per[layer].append(n)
    return order, per, top


def _save_attributes(group: Any, name: str, data: list[bytes]) -> None:
    """keras' ``save_attributes_to_hdf5_group``: chunked when over the HDF5 object header limit."""
    data_npy = np.asarray(data)
    num_chunks = 1
    chunked = np.array_split(data_npy, num_chunks)
    while any(x.nbytes > _HDF5_OBJECT_HEADER_LIMIT for x in chunked):
        num_chunks += 1
        chunked = np.array_split(data_npy, num_chunks)
    if num_chunks > 1:
        for i, chunk in enumerate(chunked):
            group.attrs[f"{name}{i}"] = chunk
    else:
        group.attrs[name] = data


def _save_weights(group: Any, items: list[tuple[str, np.ndarray]]) -> None:
    """keras' ``save_subset_weights_to_hdf5_group``: ``weight_names`` attr, one dataset each."""
    weight_names = [f"{n}:0".encode("utf8") for n, _ in items]
    _save_attributes(group, "weight_names", weight_names)
    for wname, (_, val) in zip(weight_names, items):
        ds = group.create_dataset(wname, val.shape, dtype=val.dtype)
        if not val.shape:
            ds[()] = val
        else:
            ds[:] = val


def write_h5(arrays: Mapping[str, np.ndarray], path: str, *, force: bool = False, shared_group: bool = False) -> int:
    """A Keras 2.15 HDF5 weights file (``model.load_weights(path)``), as ``save_weights`` lays it out
    (the output's directory: :func:`atomic_output`'s rule)."""
    try:
        import h5py
    except ImportError as e:
        raise ExportError("h5 export needs h5py: pip install h5py (or install deepfreeze[keras])") from e
    for name, a in arrays.items():
        if _dtype_name(a) == "bfloat16":
            raise ExportError(f"tensor {name!r} is bfloat16, which HDF5 (h5py) cannot store; export to "
                              "safetensors instead")
    layers, per, top = h5_layers(list(arrays))

    def write(tmp: str) -> None:
        with h5py.File(tmp, "w") as f:
            _save_attributes(f, "layer_names", [layer.encode("utf8") for layer in layers])
            f.attrs["backend"] = KERAS_BACKEND.encode("utf8")
            f.attrs["keras_version"] = KERAS_VERSION.encode("utf8")
            for layer in sorted(layers):  # as keras: groups created in name order
                g = f.create_group(layer)
                _save_weights(g, [(n, arrays[n]) for n in per[layer]])
            g = f.create_group(TOP_LEVEL_GROUP)
            _save_weights(g, [(n, arrays[n]) for n in top])
    return atomic_output(path, force, write, shared_group=shared_group)


def export(arrays: Mapping[str, np.ndarray], fmt: str, path: str, *, metadata: Mapping[str, Any] | None = None,
           force: bool = False, shared_group: bool = False) -> int:
    """Write ``arrays`` in format ``fmt`` (``h5``, ``npz``, ``safetensors``) to ``path``; returns bytes.
    The directory of ``path`` must follow :func:`atomic_output`'s rule (``shared_group``: the
    configuration's key, a group-writable directory is trusted)."""
    if fmt == "npz":
        return write_npz(arrays, path, force=force, shared_group=shared_group)
    if fmt == "safetensors":
        return write_safetensors(arrays, path, metadata, force=force, shared_group=shared_group)
    if fmt == "h5":
        return write_h5(arrays, path, force=force, shared_group=shared_group)
    raise ExportError(f"unknown export format {fmt!r}: use one of {', '.join(FORMATS)}")
