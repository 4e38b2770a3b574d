"""Long because: one conversion (a DCP directory into one DeepFreeze version), its checks and plan.

Import a ``torch.distributed.checkpoint`` (DCP) directory as a DeepFreeze version.

:func:`import_dcp` (``deepfreeze import --format dcp DIR``) makes version ``step`` of ``name``
from a DCP checkpoint directory written by ``dcp.save`` with ``FileSystemWriter`` (the default
of ``dcp.save(state_dict, checkpoint_id=DIR)``), so that ``Checkpointer(model, optimizer,
config, name, resume=True)`` continues from that step, bit-exact (docs/torch-reference.md, "Coming from
DCP").

**Keys.** DCP flattens ``{"model": model_sd, "optim": optim_sd}`` (the two dicts of
``get_state_dict(model, optimizers)``) into ``model.<fqn>``, ``optim.state.<fqn>.<key>`` and
``optim.param_groups.<i>.<key>`` (``optim.param_groups.<fqn>.<key>`` with
``StateDictOptions(flatten_optimizer_state_dict=True)``: then the parameters of consecutive FQNs
with equal hyperparameters form one group). ``model_prefix``/``optim_prefix`` name other places:
``{"app": AppState}`` (DCP's tutorial wrapper, whose ``state_dict()`` is ``{"model", "optim"}``)
is ``model_prefix="app.model", optim_prefix="app.optim"``; ``{**model_sd, "optim": optim_sd}``
(DeepFreeze's own ``export --format dcp``) is ``model_prefix=""``. No key under the prefix is a
:class:`~deepfreeze.errors.ConfigError` naming the top-level keys found (and the prefixes to
pass). Every other key is left out, with one warning naming the top-level keys left out, unless
``state={"sched": "sched"}`` maps a ``state=`` object's name to the DCP key whose dict it is
(the user's own ``{"sched": scheduler.state_dict()}``): that dict becomes the version's state of
that object. ``get_state_dict`` merges every optimizer's ``param_groups`` into one list:
``optimizer_groups=[2, 1]`` says how many of them belong to each optimizer, in the order the
Checkpointer is given them (default: one optimizer holding every group).

**The version** is written by :class:`~deepfreeze.torch.Checkpointer` itself, not a second
writer: the tensors are put into a stand-in module (the model's FQNs) and stand-in optimizers
(the DCP ``param_groups`` and state), and a Checkpointer with ``start_step=step`` takes one
checkpoint of them (:meth:`~deepfreeze.torch.Checkpointer.checkpoint`) and closes (flushed to
persistent). Its state record holds the optimizers' ``param_groups`` and non-tensor state, the
imported ``state=`` dicts, no RNG states, and ``"imported": {"format": "dcp", "path": DIR}``.
In one process (the CLI) it is a version of one rank; called on every rank of a job with
``torch.distributed`` initialized it is collective (every rank reads the directory; a version of
the job's world size). Either restores at any world size. The name must have no committed
version (``overwrite=True``: a new generation, the older versions retired), as for a new run.

**Safety: no byte of the directory reaches an unrestricted unpickler.** ``.metadata`` (a pickle)
is read, at most 256 MiB, by an allow-list unpickler (the pure-Python one, whose memo is a
dict: no index a pickle names makes it allocate): only DCP's metadata classes
(``torch.distributed.checkpoint.metadata``: ``Metadata``, ``TensorStorageMetadata``,
``TensorProperties``, ``ChunkStorageMetadata``, ``BytesStorageMetadata``, ``MetadataIndex``,
``StorageMeta``, ``_MEM_FORMAT_ENCODING``; ``filesystem._StorageInfo``), ``torch.Size``, torch
dtypes and layouts, ``collections.OrderedDict`` and ``pathlib`` paths may be named; any other
global (``os.system``, ``builtins.eval`` ...) is a :class:`~deepfreeze.errors.CorruptCheckpointError`
naming it, raised before anything it names is called. The unpickled metadata is then checked
before a byte of data is read or a tensor allocated: its types; every tensor's shape and dtype;
its chunks lie within it, do not overlap and cover it; every item's file is a plain file name in
the directory (a regular file, no link, no path), its offset and length lie within the file, and
a chunk's bytes fit its length; no storage transforms (compression extensions are refused).
Items are read by DCP's own ``FileSystemReader`` (subclassed), whose ``fs.create_stream`` serves
a ``dup`` of the checked descriptor of a file (below) and raises for any other name: tensors with
``torch.load(..., weights_only=True)`` (DCP's own), bytes items (``param_groups``, non-tensor state) with
``torch.load(..., weights_only=True)`` too, by this module's load planner (DCP's default one uses
``weights_only=False``). DCP's ``CheckpointException`` (a torch file that does not load, a size
that does not match) becomes a :class:`~deepfreeze.errors.CorruptCheckpointError`. The
``planner_data`` path of a key mapped to a ``state=`` object has integer parts (list indices)
below the number of keys mapped to that object, checked before anything is allocated.

**One open per file.** The directory may belong to another user, who may rename, link or replace
its files while the import runs. It is opened once (``O_DIRECTORY|O_NOFOLLOW``: a symbolic link
is an :class:`~deepfreeze.errors.UnsafePathError`); ``.metadata`` and every data file the
metadata names are opened relative to that descriptor (``O_RDONLY|O_NOFOLLOW|O_NONBLOCK``: a link
or FIFO is refused, never followed or waited on), checked with ``fstat`` (a regular file; owned
by the directory's owner, the importing user or root, so a third user's file, e.g. through a
hard link, is an ``UnsafePathError``), and kept open: the bounds are checked against that
descriptor's size, and the data are read only through it (a size that changed since is a
``CorruptCheckpointError``). Whatever is put at a name after the check is never read.

**Names.** A tensor named ``_deepfreeze/...`` (kept for DeepFreeze's records) or two tensors with
one name are refused at plan time (:func:`deepfreeze.shardplan.check_tensor_names`), and every
check runs before the Checkpointer that starts the new generation is built, so a refused import
with ``overwrite=True`` retires nothing.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import logging
import math
import os
import pickle
import stat
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dmd
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem

from ..config import Config
from ..errors import (ConfigError, CorruptCheckpointError, DeepFreezeError, ExistingCheckpointError,
                      UnsafePathError)
from ..fsafe import describe_mode
from ..ownership import open_dir_nofollow, owner_name
from ..shardplan import DEFAULT_MIN_SHARD_BYTES, check_tensor_names
from . import _state
from .capture import StateRecords
from .checkpointer import Checkpointer

__all__ = ["import_dcp", "DCPImport", "SafeFileSystemReader", "read_dcp_metadata"]

log = logging.getLogger("deepfreeze")

MAX_METADATA_BYTES = 256 << 20
_MAX_CHUNKS = 1 << 16  # chunks of one tensor whose overlap is checked pairwise

_MD = "torch.distributed.checkpoint.metadata"
_ALLOWED = {(_MD, n) for n in ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
                               "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib._local", "PosixPath"),
    ("pathlib._local", "PurePosixPath")}
_DTYPE_NAMES = frozenset(k for k, v in vars(torch).items() if isinstance(v, torch.dtype))


class _MetadataUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """An unpickler that may name only DCP's metadata classes, ``torch.Size``, torch dtypes and
    layouts, ``OrderedDict`` and ``pathlib`` paths (module docstring). The pure-Python one: its
    memo is a dict, while C's ``_pickle`` grows an array to any index a ``LONG_BINPUT`` names (a
    mutated index made it allocate and clear gigabytes for 40 s), and its reads stop at the data."""

    def __init__(self, f: Any, where: str) -> None:
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and name in _DTYPE_NAMES):
            return super().find_class(module, name)
        raise CorruptCheckpointError(
            f"{self.where}: the DCP metadata pickle names {module}.{name}, which is not a DCP metadata class: "
            "refused before anything ran (a .metadata that names other callables may run code when unpickled). "
            "Import only DCP checkpoints written by dcp.save with FileSystemWriter from a source you trust")

    def persistent_load(self, pid: Any) -> Any:
        raise CorruptCheckpointError(f"{self.where}: the DCP metadata pickle holds a persistent id: refused")


def _safe_name(rel: Any, where: str) -> str:
    if not (isinstance(rel, str) and rel and "/" not in rel and "\\" not in rel and "\0" not in rel
            and rel not in (".", "..")):
        raise CorruptCheckpointError(f"{where}: a storage item names the file {rel!r}: not a plain file name in "
                                     "the checkpoint directory")
    return rel


def _check_size(s: Any, what: str) -> tuple[int, ...]:
    if not (isinstance(s, torch.Size) and all(type(x) is int and x >= 0 for x in s) and len(s) <= 64):
        raise CorruptCheckpointError(f"{what}: bad size {s!r}")
    return tuple(s)


class _DCPDir:
    """The DCP directory ``path``, opened once and read only through descriptors (module
    docstring, "One open per file"): the directory with ``O_DIRECTORY|O_NOFOLLOW``, then
    ``.metadata`` and each data file relative to it (``O_NOFOLLOW|O_NONBLOCK``), each checked with
    ``fstat`` (a regular file, owned by the directory's owner, this user or root) and kept open,
    so what is read is the file that was checked, whatever the directory's owner renames or
    links in its place meanwhile. :meth:`close` closes them."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.where = f"DCP checkpoint {path}"
        try:
            self.fd = open_dir_nofollow(path)
        except UnsafePathError as e:
            raise UnsafePathError(f"{path} is a symbolic link: give the DCP checkpoint directory itself "
                                  f"({os.path.realpath(path)!r}; a link is never followed)") from e
        except (FileNotFoundError, NotADirectoryError) as e:
            raise ConfigError(f"{path} is not a directory: give the DCP checkpoint directory (dcp.save's "
                              "checkpoint_id)") from e
        except OSError as e:
            raise ConfigError(f"{path}: cannot open the DCP checkpoint directory: {e}") from e
        self.uid = os.fstat(self.fd).st_uid
        self.files: dict[str, tuple[int, int]] = {}  # data file name -> (its descriptor, its checked size)

    def __enter__(self) -> "_DCPDir":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the directory and every file opened in it."""
        for fd, _ in self.files.values():
            os.close(fd)
        self.files = {}
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:  # (a reader dropped without close(): no descriptor leaks)
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def _open(self, name: str) -> tuple[int, os.stat_result]:
        """``name`` opened relative to the directory: (descriptor, fstat) of a regular file owned
        by the directory's owner, this user or root; FileNotFoundError if it is not there."""
        where = os.path.join(self.path, name)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENXIO):  # a symlink (never followed); a socket
                raise CorruptCheckpointError(f"{where} is not a regular file (a link or special file): refused") \
                    from e
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptCheckpointError(f"{where} is {describe_mode(st.st_mode)}, not a regular file: refused")
            if st.st_uid not in (self.uid, os.geteuid(), 0):
                raise UnsafePathError(
                    f"{where} is owned by {owner_name(st.st_uid)}, not by the directory's owner "
                    f"({owner_name(self.uid)}), you or root (a hard link to another user's file?): not imported")
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def read_metadata(self, limit: int) -> bytes:
        """The bytes of ``.metadata`` (at most ``limit``), read through its checked descriptor."""
        fd, st = self._open(".metadata")
        with os.fdopen(fd, "rb") as f:
            # the size fstat gave (+1: a file that grew since is refused); nothing read for one over the limit
            data = f.read(st.st_size + 1) if st.st_size <= limit else b""
        if st.st_size > limit or len(data) > st.st_size:
            raise CorruptCheckpointError(f"{os.path.join(self.path, '.metadata')} is larger than {limit} bytes, or "
                                         "grew while being read")
        return data

    def size(self, name: str) -> int:
        """The size of data file ``name`` (a plain name), opened and checked once and kept open."""
        if name not in self.files:
            fd, st = self._open(name)
            self.files[name] = (fd, st.st_size)
        return self.files[name][1]

    def stream(self, name: str) -> io.BufferedReader:
        """A file object of a ``dup`` of the checked descriptor of data file ``name`` (one
        :meth:`size` opened), whose size is still the one the bounds were checked against;
        CorruptCheckpointError for any other name (nothing is opened by path)."""
        if name not in self.files:
            raise CorruptCheckpointError(f"{self.where}: DCP's reader asked for {name!r}, a file the checked "
                                         "metadata does not name: refused")
        fd, size = self.files[name]
        now = os.fstat(fd).st_size
        if now != size:
            raise CorruptCheckpointError(f"{os.path.join(self.path, name)} changed size while being imported "
                                         f"({size} -> {now} bytes): import it again once it is complete")
        dup = os.dup(fd)
        try:
            os.lseek(dup, 0, os.SEEK_SET)
            return os.fdopen(dup, "rb")
        except BaseException:
            os.close(dup)
            raise


def read_dcp_metadata(path: str) -> dmd.Metadata:
    """The checked :class:`~torch.distributed.checkpoint.metadata.Metadata` of the DCP directory
    ``path`` (module docstring: the allow-list unpickler, then every field and bound checked)."""
    with _DCPDir(path) as d:
        return _read_metadata(d)


def _read_metadata(d: _DCPDir) -> dmd.Metadata:
    """:func:`read_dcp_metadata` of the open directory ``d``: its data files stay open in ``d``."""
    path = d.path
    where = os.path.join(path, ".metadata")
    try:  # a regular file (no link, a FIFO never waited on), at most MAX_METADATA_BYTES
        data = d.read_metadata(MAX_METADATA_BYTES)
    except FileNotFoundError:
        raise ConfigError(f"{path} is not a DCP checkpoint directory (no .metadata): give the directory "
                          "dcp.save wrote (its checkpoint_id)") from None
    except OSError as e:
        raise CorruptCheckpointError(f"{where}: cannot read: {e}") from e
    try:
        md = _MetadataUnpickler(io.BytesIO(data), where).load()
    except CorruptCheckpointError:
        raise
    except Exception as e:  # any damage: truncated, wrong opcodes, a class called with bad arguments
        raise CorruptCheckpointError(f"{where}: not a readable DCP metadata pickle ({type(e).__name__}: "
                                     f"{str(e)[:200]})") from e
    try:
        _check_metadata(md, d, where)
    except DeepFreezeError:
        raise
    except Exception as e:  # an allowed class built without its fields, a field of another type ...
        raise CorruptCheckpointError(f"{where}: malformed DCP metadata ({type(e).__name__}: {str(e)[:200]})") from e
    return md


def _check_metadata(md: Any, d: _DCPDir, where: str) -> None:
    """Types, shapes, chunks and storage bounds of ``md`` (CorruptCheckpointError); every data
    file it names is opened in ``d`` and its bounds checked against that descriptor's size."""
    if not isinstance(md, dmd.Metadata) or not isinstance(md.state_dict_metadata, dict) \
            or not isinstance(md.storage_data, dict):
        raise CorruptCheckpointError(f"{where}: not DCP metadata of a FileSystemWriter checkpoint "
                                     f"({type(md).__name__})")
    sizes: dict[str, int] = {}

    def file_size(rel: str) -> int:
        if rel not in sizes:
            try:
                sizes[rel] = d.size(rel)
            except DeepFreezeError:  # (a link, a special file, a third user's file: named by d.size)
                raise
            except OSError as e:
                raise CorruptCheckpointError(f"{where}: a storage item's file {rel!r} cannot be opened: {e}") from e
        return sizes[rel]

    for idx, info in md.storage_data.items():
        if not (isinstance(idx, dmd.MetadataIndex) and isinstance(idx.fqn, str) and isinstance(info, _StorageInfo)):
            raise CorruptCheckpointError(f"{where}: a storage entry is {type(idx).__name__} -> "
                                         f"{type(info).__name__}, not MetadataIndex -> _StorageInfo")
        rel = _safe_name(info.relative_path, where)
        off, n = info.offset, info.length
        if not (type(off) is int and type(n) is int and off >= 0 and n >= 0 and off + n <= file_size(rel)):
            raise CorruptCheckpointError(f"{where}: item {idx.fqn!r} lies at {off!r}, {n!r} bytes of {rel!r}, "
                                         f"outside its {file_size(rel)} bytes")
        if getattr(info, "transform_descriptors", None):
            raise ConfigError(f"{where}: item {idx.fqn!r} was written through storage extensions "
                              f"{list(info.transform_descriptors)[:3]} (compression): not imported; save with "
                              "the default FileSystemWriter")
    total = 0
    for key, m in md.state_dict_metadata.items():
        if not isinstance(key, str):
            raise CorruptCheckpointError(f"{where}: a key is a {type(key).__name__}, not a string")
        if isinstance(m, dmd.BytesStorageMetadata):
            if dmd.MetadataIndex(key) not in md.storage_data:
                raise CorruptCheckpointError(f"{where}: bytes item {key!r} has no storage entry")
            continue
        if not (isinstance(m, dmd.TensorStorageMetadata) and isinstance(m.properties, dmd.TensorProperties)
                and isinstance(m.properties.dtype, torch.dtype) and isinstance(m.chunks, list)):
            raise CorruptCheckpointError(f"{where}: {key!r} is described by a {type(m).__name__}")
        shape = _check_size(m.size, f"{where}: tensor {key!r}")
        itemsize = m.properties.dtype.itemsize
        if len(m.chunks) > _MAX_CHUNKS:
            raise CorruptCheckpointError(f"{where}: tensor {key!r} has {len(m.chunks)} chunks")
        boxes, covered = [], 0
        for c in m.chunks:
            if not isinstance(c, dmd.ChunkStorageMetadata):
                raise CorruptCheckpointError(f"{where}: a chunk of {key!r} is a {type(c).__name__}")
            o = _check_size(c.offsets, f"{where}: a chunk of {key!r}")
            s = _check_size(c.sizes, f"{where}: a chunk of {key!r}")
            if len(o) != len(shape) or len(s) != len(shape) or any(a + b > d for a, b, d in zip(o, s, shape)):
                raise CorruptCheckpointError(f"{where}: a chunk of {key!r} at {list(o)} of {list(s)} lies outside "
                                             f"its shape {list(shape)}")
            info = md.storage_data.get(dmd.MetadataIndex(key, c.offsets))
            if info is None:
                raise CorruptCheckpointError(f"{where}: the chunk of {key!r} at {list(o)} has no storage entry")
            if math.prod(s) * itemsize > info.length:
                raise CorruptCheckpointError(f"{where}: the chunk of {key!r} at {list(o)} holds "
                                             f"{math.prod(s) * itemsize} bytes in {info.length}")
            for po, ps in boxes:
                if math.prod(s) and math.prod(ps) and all(a < pa + pb and pa < a + b for a, b, pa, pb in
                                                          zip(o, s, po, ps)):
                    raise CorruptCheckpointError(f"{where}: chunks of {key!r} at {list(po)} and {list(o)} overlap")
            boxes.append((o, s))
            covered += math.prod(s)
        if covered != math.prod(shape):
            raise CorruptCheckpointError(f"{where}: the chunks of {key!r} cover {covered} of its "
                                         f"{math.prod(shape)} elements")
        total += math.prod(shape) * itemsize
    if total > sum(sizes.values()):
        raise CorruptCheckpointError(f"{where}: its tensors hold {total} bytes, its files {sum(sizes.values())}")


class _CheckedFileSystem(FileSystem):
    """DCP's ``FileSystem`` for reading a :class:`_DCPDir`: ``create_stream`` serves a ``dup`` of
    the checked descriptor of a data file of that directory and raises for any other path or
    mode; it never opens a path."""

    def __init__(self, d: _DCPDir) -> None:
        super().__init__()
        self._dir = d

    @contextlib.contextmanager
    def create_stream(self, path: "str | os.PathLike", mode: str) -> Iterator[io.IOBase]:
        p = Path(path)
        if mode != "rb" or p.parent != Path(self._dir.path):
            raise CorruptCheckpointError(f"{self._dir.where}: DCP's reader asked to open {str(path)!r} ({mode!r}): "
                                         "only the checked data files of the directory are read")
        with self._dir.stream(p.name) as f:
            yield f


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``read_metadata`` is :func:`read_dcp_metadata` (the
    allow-list unpickler and the bounds checks) and that serves only metadata it checked, and
    reads only the files that check opened (module docstring, "One open per file"). It holds the
    directory open from construction: :meth:`close` it (or use it as a context manager)."""

    def __init__(self, path: "str | os.PathLike") -> None:
        super().__init__(path)
        self._dir = _DCPDir(os.path.abspath(os.fspath(path)))
        self.path = Path(self._dir.path)
        self.fs = _CheckedFileSystem(self._dir)
        self._checked: "dmd.Metadata | None" = None

    def __enter__(self) -> "SafeFileSystemReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the directory and the data files it opened."""
        self._dir.close()

    def reset(self, checkpoint_id: "str | os.PathLike | None" = None) -> None:
        if checkpoint_id is not None and os.path.abspath(os.fspath(checkpoint_id)) != self._dir.path:
            raise ConfigError("SafeFileSystemReader reads only the directory it was made for")
        super().reset(None)

    def read_metadata(self, *args: Any, **kwargs: Any) -> dmd.Metadata:
        if kwargs.get("rank") is not None:
            raise ConfigError("a rank-local DCP metadata file is not imported: give a directory with .metadata")
        if self._checked is None:
            self._checked = _read_metadata(self._dir)
        return self._checked

    def set_up_storage_reader(self, metadata: dmd.Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata is not self._checked:
            raise ConfigError("SafeFileSystemReader serves only the metadata it read and checked itself")
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner (no flattening: the keys are the metadata's) whose bytes items
    are read with ``torch.load(..., weights_only=True)``."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        try:
            self.state_dict[key] = torch.load(value, weights_only=True)
        except Exception as e:
            raise CorruptCheckpointError(f"DCP bytes item {key!r} does not load with torch.load(weights_only=True) "
                                         f"({type(e).__name__}: {str(e)[:200]}): refused") from e


@dataclasses.dataclass
class DCPImport:
    """What :func:`import_dcp` wrote: the ``version`` (= step) of ``name``, its tensors, the
    optimizers' groups, the ``state=`` objects it holds and the top-level DCP keys left out."""

    name: str
    version: int
    model_tensors: int
    optimizer_tensors: int
    param_groups: list[int]
    state: list[str]
    ignored: list[str]


def _top(keys: Any) -> list[str]:
    return sorted({k.split(".", 1)[0] for k in keys})


def _under(prefix: str, key: str) -> "str | None":
    if not prefix:
        return key
    return key[len(prefix) + 1:] if key.startswith(prefix + ".") else None


def _parse(md: dmd.Metadata, values: dict[str, Any], model_prefix: str, optim_prefix: str,
           state: Mapping[str, str], where: str) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]],
                                                           list[dict[str, Any]], dict[str, Any]]:
    """(model tensors by FQN, optimizer state by FQN, param_groups with FQN params, state dicts
    by name) of the loaded ``values``."""
    model: dict[str, torch.Tensor] = {}
    ostate: dict[str, dict[str, Any]] = {}
    by_index: dict[int, dict[str, Any]] = {}
    by_fqn: dict[str, dict[str, Any]] = {}
    sdicts: dict[str, Any] = {}
    for key, v in values.items():
        for sname, sprefix in state.items():
            rest = _under(sprefix, key) if key != sprefix else ""
            if rest is not None:
                path = (md.planner_data or {}).get(key) if isinstance(md.planner_data, dict) else None
                _put(sdicts.setdefault(sname, {}), path, sprefix, rest, v, key, where)
                break
        else:
            rest = _under(optim_prefix, key)
            if rest is not None:
                kind, _, tail = rest.partition(".")
                head, _, k = tail.rpartition(".")
                if kind == "state" and head and k:
                    ostate.setdefault(head, {})[k] = v
                elif kind == "param_groups" and head and k:
                    if head.isdigit() and len(head) < 8:
                        by_index.setdefault(int(head), {})[k] = v
                    else:
                        by_fqn.setdefault(head, {})[k] = v
                else:
                    raise CorruptCheckpointError(f"{where}: key {key!r} under {optim_prefix!r} is neither "
                                                 "state.<fqn>.<key> nor param_groups.<i>.<key> (get_state_dict's "
                                                 "optimizer dict)")
                continue
            fqn = _under(model_prefix, key)
            if fqn is not None:
                if not isinstance(v, torch.Tensor):
                    raise ConfigError(f"{where}: model entry {key!r} is not a tensor: DeepFreeze checkpoints "
                                      "model tensors")
                model[fqn] = v
    if by_index and by_fqn:
        raise CorruptCheckpointError(f"{where}: {optim_prefix}.param_groups mixes indices and FQNs")
    groups: list[dict[str, Any]] = []
    if by_index:
        if sorted(by_index) != list(range(len(by_index))):
            raise CorruptCheckpointError(f"{where}: {optim_prefix}.param_groups has groups {sorted(by_index)}")
        for i in range(len(by_index)):
            g = by_index[i]
            params = g.get("params")
            if not (isinstance(params, list) and all(isinstance(p, str) for p in params)):
                raise CorruptCheckpointError(f"{where}: {optim_prefix}.param_groups.{i}.params is not a list of "
                                             "FQNs (get_state_dict's optimizer dict)")
            groups.append(g)
    for fqn, hp in by_fqn.items():  # flatten_optimizer_state_dict=True: consecutive equal hyperparameters
        if groups and {k: v for k, v in groups[-1].items() if k != "params"} == hp:
            groups[-1]["params"].append(fqn)
        else:
            groups.append({**hp, "params": [fqn]})
    return model, ostate, groups, sdicts


def _state_of(key: str, state: Mapping[str, str]) -> "tuple[str, str] | None":
    """(state object name, DCP prefix) the key belongs to (the first mapping that holds it), or None."""
    for sname, sprefix in state.items():
        if key == sprefix or key.startswith(sprefix + "."):
            return sname, sprefix
    return None


def _check_planner_data(md: dmd.Metadata, keys: Sequence[str], state: Mapping[str, str], where: str) -> None:
    """Every integer part of the planner-data path of a key mapped to a ``state=`` object is an
    index in ``[0, n)``, ``n`` the number of keys mapped to that object (a list holds no more
    entries than the keys that fill it): CorruptCheckpointError naming the key and the index,
    before anything is allocated (DCP's ``set_element`` grows a list up to any index it is given)."""
    if not state or not isinstance(md.planner_data, dict):
        return
    mapped: dict[str, list[str]] = {}
    for k in keys:
        owner = _state_of(k, state)
        if owner is not None:
            mapped.setdefault(owner[0], []).append(k)
    for sname, ks in mapped.items():
        n = len(ks)
        drop = len(state[sname].split("."))
        for k in ks:
            path = md.planner_data.get(k)
            if not isinstance(path, tuple):
                continue
            for i in path[drop:]:
                if isinstance(i, int) and not 0 <= i < n:
                    raise CorruptCheckpointError(
                        f"{where}: key {k!r} of state object {sname!r} places its value at list index {i} "
                        f"(planner data {str(path)[:200]}): {sname!r} has {n} keys, so no list of it has more "
                        f"than {n} entries; the .metadata is damaged or hostile: refused")


def _put(root: dict, path: Any, sprefix: str, rest: str, v: Any, key: str, where: str) -> None:
    """``v`` into the state dict ``root`` at DCP's path of ``key`` (its planner data, the prefix's
    parts dropped), else at the key's remainder."""
    n = len(sprefix.split(".")) if sprefix else 0
    if isinstance(path, tuple) and len(path) > n and all(isinstance(p, (str, int)) for p in path):
        from torch.distributed.checkpoint._traverse import set_element
        try:
            set_element(root, tuple(path[n:]), v)
        except Exception as e:
            raise CorruptCheckpointError(f"{where}: key {key!r} cannot be placed at {path}: {e}") from e
    elif rest:
        root[rest] = v
    else:
        raise ConfigError(f"{where}: the state key {key!r} is one value, not a dict: map a prefix whose keys "
                          "are a state_dict")


class _Stand(torch.nn.Module):
    """A stand-in module holding the imported tensors under their FQNs."""


class _StandOptimizer(torch.optim.Optimizer):
    """A stand-in optimizer holding the imported param_groups and state (never stepped)."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        super().__init__(groups, {})

    def step(self, closure: Any = None) -> None:  # pragma: no cover - never called
        raise RuntimeError("the stand-in optimizer of a DCP import is not stepped")


class _ImportRecords(StateRecords):
    """The state records of an import: no RNG states, and where the version came from."""

    #: where the version came from (set before the checkpoint is taken)
    imported: dict[str, Any] = {}

    def part(self, phase: str, st: Any = None) -> Any:
        rec = super().part(phase, st)
        if phase == "a":
            rec.pop("rng", None)
            # the stand-ins' class is not the trained optimizer's: not recorded (if a record names
            # optimizer classes), so a resume checks the optimizers by their groups alone
            rec.pop("optimizers", None)
            rec["imported"] = dict(self.imported)
        return rec


class _Importer(Checkpointer):
    """The Checkpointer of an import: its state record holds no RNG states and says where the
    version came from (:class:`_ImportRecords`)."""

    records_cls = _ImportRecords


class _Held:
    """A state= object holding an imported state dict."""

    def __init__(self, sd: Any) -> None:
        self.sd = sd

    def state_dict(self) -> Any:
        return self.sd

    def load_state_dict(self, sd: Any) -> None:  # pragma: no cover - never restored into
        self.sd = sd


def _check_prefix(p: Any, what: str) -> str:
    if not isinstance(p, str) or p.startswith(".") or p.endswith(".") or ".." in p:
        raise ConfigError(f"{what} = {p!r}: use '' or dot-separated key parts such as 'model' or 'app.model'")
    return p


def _read(path: str, model_prefix: str, optim_prefix: str, state: Mapping[str, str], *,
          reader: "type[SafeFileSystemReader] | None" = None) -> tuple[
        dict[str, torch.Tensor], dict[str, dict[str, Any]], list[dict[str, Any]], dict[str, Any], list[str]]:
    """Read the DCP directory ``path`` (checked metadata, then DCP's reader with the safe planner):
    :func:`_parse`'s four parts and the top-level keys left out. ``reader``: the reader class
    (a test seam: a subclass of :class:`SafeFileSystemReader` whose ``read_metadata`` does
    something after the checks, such as replacing a data file)."""
    with (reader or SafeFileSystemReader)(path) as r:
        return _read_from(r, path, model_prefix, optim_prefix, state)


def _read_from(reader: SafeFileSystemReader, path: str, model_prefix: str, optim_prefix: str,
               state: Mapping[str, str]) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]],
                                                  list[dict[str, Any]], dict[str, Any], list[str]]:
    """:func:`_read` through the open ``reader``."""
    where = f"DCP checkpoint {path}"
    md = reader.read_metadata()
    keys = list(md.state_dict_metadata)
    owned = [p for p in [optim_prefix, *state.values(), model_prefix] if p]

    def belongs(k: str, p: str) -> bool:
        return k == p or k.startswith(p + ".")
    for what, p in (("model_prefix", model_prefix), ("optim_prefix", optim_prefix), *(
            (f"state[{k!r}]", v) for k, v in state.items())):
        if p and not any(belongs(k, p) for k in keys):
            hint = sorted({k.split(".model.", 1)[0] for k in keys if ".model." in k and k.index(".model.") > 0})
            raise ConfigError(
                f"{where} has no key under {p!r} ({what}): its top-level keys are {_top(keys)[:12]}. "
                + (f"For a wrapper such as {{'{hint[0]}': AppState}} pass model_prefix='{hint[0]}.model', "
                   f"optim_prefix='{hint[0]}.optim' (--model-prefix/--optim-prefix)" if hint else
                   "Pass the prefixes of the dicts dcp.save was given (model_prefix='' for a model at the top "
                   "level)"))
    wanted = [k for k in keys if any(belongs(k, p) for p in owned)  # (model_prefix '': every other tensor)
              or not model_prefix and isinstance(md.state_dict_metadata[k], dmd.TensorStorageMetadata)]
    taken = set(wanted)
    ignored = _top(k for k in keys if k not in taken)
    if ignored:
        log.warning("DeepFreeze: %s: keys under %s are not imported (not the model, the optimizer or a state= "
                    "entry); map one to a state object with state={name: key} (--state NAME=KEY)", where, ignored)
    _check_planner_data(md, wanted, state, where)
    sd: dict[str, Any] = {}
    for k in wanted:  # sizes checked against the files by read_dcp_metadata before this allocation
        m = md.state_dict_metadata[k]
        sd[k] = torch.empty(tuple(m.size), dtype=m.properties.dtype) if isinstance(m, dmd.TensorStorageMetadata) \
            else None
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": a local read, as intended
            warnings.simplefilter("ignore")
            dcp.load(sd, storage_reader=reader, planner=_SafeLoadPlanner(), no_dist=True)
    except CheckpointException as e:  # (a BaseException) holding each rank's (exception, traceback)
        inner = next((pair[0] for pair in e.failures.values()), None)
        if isinstance(inner, DeepFreezeError):
            raise inner from e
        raise CorruptCheckpointError(f"{where}: DCP could not read it: {type(inner).__name__}: "
                                     f"{' '.join(str(inner).split())[:400]}") from e
    return (*_parse(md, sd, model_prefix, optim_prefix, state, where), ignored)


def import_dcp(dcp_dir: "str | os.PathLike", config: "str | Config | None" = None, name: str = "model",
               step: int = 0, *, model_prefix: str = "model", optim_prefix: str = "optim",
               optimizer_groups: "Sequence[int] | None" = None, state: "Mapping[str, str] | None" = None,
               overwrite: bool = False, min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES, engine: "str | None" = None,
               **overrides: Any) -> DCPImport:
    """Make version ``step`` of ``name`` from the DCP checkpoint directory ``dcp_dir`` (model and
    optimizer state; module docstring). Returns a :class:`DCPImport`.

    Args:
      dcp_dir: the directory ``dcp.save`` wrote (``FileSystemWriter``; ``.metadata`` inside).
      config: VeloC INI file or :class:`~deepfreeze.Config` (``**overrides``: INI keys in code).
      name: the DeepFreeze checkpoint name to write.
      step: the training step the DCP checkpoint was saved at (an int >= 0): the version number,
        and the step ``Checkpointer(..., resume=True)`` continues from.
      model_prefix, optim_prefix: the DCP keys of the model's state dict and of
        ``get_state_dict``'s optimizer dict (``"model"``, ``"optim"``; ``""`` for a model at the
        top level; ``"app.model"``/``"app.optim"`` for DCP's ``{"app": AppState}``).
      optimizer_groups: how many of the ``param_groups`` belong to each optimizer, in order
        (``[1, 1]`` for ``get_state_dict(model, [opt_a, opt_b])`` with one group each); None:
        one optimizer.
      state: ``{state object name: DCP key}`` of dicts the user saved beside the model (an LR
        scheduler's ``state_dict()``, a data position): restored into ``Checkpointer(...,
        state={name: obj})``. DCP holds one value per key, so every rank gets the same one.
      overwrite: start a new generation of ``name`` (its committed versions are retired);
        otherwise a name with committed versions is refused. Every check (the metadata, the
        keys, reserved and duplicate tensor names, the bounds, the full read of the directory)
        runs before the new generation is started, so a refused import retires nothing; a write
        failure after that point (a full disk) retires the old generation, as any ``overwrite``
        run does.

    Collective when ``torch.distributed`` is initialized (call it on every rank). Raises
    :class:`~deepfreeze.errors.ConfigError` (bad arguments, keys not found: the top-level keys
    found are named; a tensor named ``_deepfreeze/...`` or two tensors with one name),
    :class:`~deepfreeze.errors.CorruptCheckpointError` (a damaged or hostile directory; nothing
    of it was unpickled unrestricted), :class:`~deepfreeze.errors.UnsafePathError` (the
    directory is a symbolic link; a file in it is owned by a third user) or the Checkpointer's
    errors.
    """
    if type(step) is not int or step < 0:
        raise ConfigError(f"step = {step!r}: the step the DCP checkpoint was saved at (an int >= 0)")
    model_prefix = _check_prefix(model_prefix, "model_prefix")
    optim_prefix = _check_prefix(optim_prefix, "optim_prefix")
    if not optim_prefix:
        raise ConfigError("optim_prefix = '': name the key of the optimizer dict (e.g. 'optim')")
    state = dict(state or {})
    for k, p in state.items():
        if not isinstance(k, str) or not k:
            raise ConfigError(f"state: {k!r} is not a state object name")
        _check_prefix(p, f"state[{k!r}]")
        if not p:
            raise ConfigError(f"state[{k!r}] = '': name the DCP key of that object's dict")
    if optimizer_groups is not None and (not optimizer_groups or not all(type(n) is int and n >= 1
                                                                         for n in optimizer_groups)):
        raise ConfigError(f"optimizer_groups = {optimizer_groups!r}: a list of positive group counts, one per "
                          "optimizer")
    path = os.path.abspath(os.fspath(dcp_dir))
    where = f"DCP checkpoint {path}"
    model, ostate, groups, sdicts, ignored = _read(path, model_prefix, optim_prefix, state)
    if not model:
        raise ConfigError(f"{where}: no model tensor under {model_prefix!r}")
    if not groups:
        raise ConfigError(f"{where}: no optimizer param_groups under {optim_prefix!r}: a model-only checkpoint is "
                          "not imported; load it with dcp.load and continue with Checkpointer(..., start_step=S)")
    counts = list(optimizer_groups) if optimizer_groups is not None else [len(groups)]
    if sum(counts) != len(groups):
        raise ConfigError(f"optimizer_groups = {counts} adds up to {sum(counts)} param groups; {where} holds "
                          f"{len(groups)}")
    root = _build_module(model, groups, where)
    opts, pos = [], 0
    params = dict(root.named_parameters())
    for n in counts:
        gs = [{**{k: v for k, v in g.items() if k != "params"}, "params": [params[f] for f in g["params"]]}
              for g in groups[pos:pos + n]]
        pos += n
        opts.append(_StandOptimizer(gs))
    for fqn, kv in ostate.items():
        p = params.get(fqn)
        if p is None:
            raise CorruptCheckpointError(f"{where}: optimizer state of {fqn!r}, which no param group holds")
        owner = next(o for o in opts if any(p is q for g in o.param_groups for q in g["params"]))
        owner.state[p] = dict(kv)
    # every check before the Checkpointer that starts the new generation (overwrite=True retires the
    # older versions when it is built): the names the Checkpointer will write, and the state record's
    # values it will encode
    check_tensor_names(_state.train_state(root, opts).specs, where)
    _state.encode({"state": sdicts, "param_groups": groups,
                   "optimizer state": {f: {k: v for k, v in kv.items() if not isinstance(v, torch.Tensor)}
                                       for f, kv in ostate.items()}}, where)
    try:
        ck = _Importer(root, opts, config, name, overwrite=overwrite, state={k: _Held(v) for k, v in sdicts.items()},
                       overlap=False, min_shard_bytes=min_shard_bytes, engine=engine, start_step=step, **overrides)
    except ExistingCheckpointError as e:
        raise ExistingCheckpointError(f"{str(e).split('; a new run')[0]}: an import starts a new run of it. "
                                      "Import into a new name, or pass overwrite=True (--overwrite) to retire "
                                      "its versions") from e
    ck.records.imported = {"format": "dcp", "path": path}
    try:
        ck.checkpoint()
    finally:
        ck.close()
    return DCPImport(ck.name, step, len(model), sum(1 for kv in ostate.values() for v in kv.values()
                                                    if isinstance(v, torch.Tensor)),
                     counts, sorted(sdicts), ignored)


def _build_module(model: dict[str, torch.Tensor], groups: list[dict[str, Any]], where: str) -> torch.nn.Module:
    """A stand-in module whose ``state_dict`` keys are the FQNs of ``model``: the tensors the
    param groups hold are parameters, the others buffers."""
    in_groups = [f for g in groups for f in g["params"]]
    missing = [f for f in in_groups if f not in model]
    if missing:
        raise CorruptCheckpointError(f"{where}: the optimizer's param_groups name {missing[:3]}, which are not "
                                     "model tensors")
    if len(set(in_groups)) != len(in_groups):
        raise CorruptCheckpointError(f"{where}: a parameter is in two param groups")
    params = set(in_groups)
    root = _Stand()
    for fqn, t in model.items():
        *mods, leaf = fqn.split(".")
        m = root
        try:
            for part in mods:
                child = m._modules.get(part)
                if child is None:
                    child = _Stand()
                    m.add_module(part, child)
                m = child
            if fqn in params:
                m.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
            else:
                m.register_buffer(leaf, t)
        except (KeyError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(f"{where}: model key {fqn!r} cannot be a module path ({e})") from e
    got = list(root.state_dict(keep_vars=True))
    if sorted(got) != sorted(model):
        raise CorruptCheckpointError(f"{where}: model keys collide as module paths ({len(got)} of {len(model)})")
    return root
