"""DeepFreeze checkpoints for ``torch.distributed.checkpoint`` (DCP) users.

:class:`Reader` is a DCP ``StorageReader``: ``dcp.load(state_dict,
storage_reader=deepfreeze.torch.Reader(config, name))`` fills a DCP user's state dict from a
committed DeepFreeze version, and :func:`write_dcp` (``deepfreeze export --format dcp``) writes a
version as a standard DCP checkpoint directory (``FileSystemWriter``).

Keys (the flattened keys of DCP's ``DefaultLoadPlanner``) are those of
``deepfreeze.torch.load`` for a state dict ``{**model_sd, "optim": optim_sd}`` built from
``get_state_dict(model, optimizers)``:

* every model tensor by FQN (``body.0.weight``), and every optimizer state tensor as
  ``optim.state.<fqn>.<key>``: :class:`TensorStorageMetadata` with exactly one chunk covering the
  tensor (offsets 0, sizes = shape);
* the optimizers' ``param_groups`` as ``optim.param_groups.<i>.<key>`` (``params``: the list of
  FQNs, as ``get_state_dict`` gives them) and non-tensor optimizer state as
  ``optim.state.<fqn>.<key>``: :class:`BytesStorageMetadata`, taken from rank 0's state record.

``model_prefix``/``optim_prefix`` move the two parts under other keys (``{"model": model_sd,
"optim": optim_sd}`` is ``model_prefix="model"``). ``Metadata.planner_data`` maps each key to
its path, so DCP's planners that rebuild a state dict from the metadata work too.

No pickle is ever read. Tensor items are copied from the checkpoint's arrays (read by
:func:`deepfreeze.loader.load`, which checks sizes and checksums). A bytes item is a value that
DeepFreeze's state record decoded *without* pickle (numbers, strings, booleans, None, lists,
tuples, dicts, tensors); the reader serializes it with ``torch.save`` in this process and checks
that ``torch.load(..., weights_only=True)`` (the restricted unpickler) reads it back, then hands
those bytes to the planner's ``load_bytes`` (DCP's ``DefaultLoadPlanner`` reads them with
``torch.load``: bytes made here, never bytes from disk). A value that fails the check is refused
with :class:`~deepfreeze.errors.ConfigError` when a plan asks for it.

Reading: ``read_metadata`` reads rank 0's state record (and, with ``version=None``, fixes the
newest committed version: every later read is of that version). ``read_data`` reads only the
tensors its plan asks for, and of each only the dim-0 rows its items cover (their union): an
FSDP2 load (DTensors ``Shard(0)``) reads each rank's own rows, as ``deepfreeze.torch.restore``
does (:func:`deepfreeze.loader.load` with ``rows=``). Under ``torch.distributed`` with several
ranks the reader is *collective* (build it on every rank; a dedicated gloo group,
:class:`TorchComm`): the metadata read pools every rank's scratch (partner copies, parity) and
agrees on the version; when every rank's plan asks for the same tensors (DDP-style and FSDP2
loads) the data read is pooled likewise (with rows: each rank receives only its rows' bytes),
else each rank reads its own tensors from its scratch directory and persistent. ``collective=False``
(e.g. ``dcp.load(..., no_dist=True)`` in one rank of a job) makes every read this process's own.
Every ``ReadItem``'s storage offsets and lengths are checked against the tensor (and a bytes
item's against its bytes) before anything is copied.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from typing import Any

import torch
from torch.futures import Future
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from .. import ownership
from ..config import Config, validate_name
from ..errors import ConfigError, ModelMismatchError
from ..loader import Checkpoint, load as _core_load
from . import _state
from ._dist import TorchComm, rank_and_size
from .state_loader import _aliases, read_config

__all__ = ["Reader", "write_dcp", "dcp_state_dict"]


def _prefixed(prefix: str, *parts: Any) -> tuple[tuple[Any, ...], str]:
    """(DCP path, flattened key) of ``parts`` under ``prefix`` (dotted; empty: at the top)."""
    path = (*(prefix.split(".") if prefix else ()), *parts)
    return path, ".".join(str(p) for p in path)


def _check_prefix(prefix: Any, what: str) -> str:
    if not isinstance(prefix, str) or (prefix and any(not p for p in prefix.split("."))):
        raise ConfigError(f"{what} = {prefix!r}: use '' or dotted non-empty names such as 'app.model'")
    return prefix


class Reader(StorageReader):
    """A DCP ``StorageReader`` over a committed DeepFreeze version of ``name`` (module docstring).

    Args:
      config: path of a VeloC INI file, or a :class:`~deepfreeze.Config` (``**overrides``: INI
        keys set in code, ``scratch=``, ``persistent=`` ...).
      name: checkpoint name.
      version: the version to read (None: the newest committed one, fixed at ``read_metadata``).
      collective: None: collective when ``torch.distributed`` runs with several ranks (then
        build the reader on every rank); False: this process reads alone.
      model_prefix, optim_prefix: where the model's and the optimizers' entries sit in the
        flattened state dict (defaults: the keys of ``deepfreeze.torch.load``).
      trust_owners: as for :func:`deepfreeze.loader.load`.
    """

    def __init__(self, config: "str | Config | None" = None, name: str = "model", version: int | None = None, *,
                 collective: bool | None = None, model_prefix: str = "", optim_prefix: str = "optim",
                 trust_owners: "list[str | int] | None" = None, **overrides: Any) -> None:
        super().__init__()
        if version is not None and (type(version) is not int or version < 0):
            raise ConfigError(f"version = {version!r}: use a committed version number (an int >= 0) or None")
        self.config = read_config(config, **overrides)
        self.name = validate_name(name)
        self.version = version
        self.model_prefix = _check_prefix(model_prefix, "model_prefix")
        self.optim_prefix = _check_prefix(optim_prefix, "optim_prefix")
        self.trust_owners = trust_owners
        self.rank, size = rank_and_size()
        if collective is None:
            collective = size > 1
        self._comm = TorchComm() if collective and size > 1 else None  # collective construction
        #: the version read (set by read_metadata)
        self.loaded_version: int | None = None
        #: tensor bytes this process got from the checkpoint for its plans (rows only, when ranged)
        self.bytes_loaded = 0
        self._meta: Metadata | None = None
        self._tensors: dict[str, tuple[str, str, tuple[int, ...]]] = {}  # key -> (checkpoint name, dtype, shape)
        self._values: dict[str, Any] = {}  # key -> value decoded from rank 0's state record
        self.is_coordinator = False

    # ------------------------------------------------------------------ StorageReader
    def reset(self, checkpoint_id: "str | os.PathLike | None" = None) -> None:
        """Forget the metadata read (the next load resolves ``version=None`` again). A
        ``checkpoint_id`` is refused: the reader is named by ``config``, ``name`` and ``version``."""
        if checkpoint_id is not None:
            raise ConfigError(f"checkpoint_id = {checkpoint_id!r}: a deepfreeze.torch.Reader reads the checkpoint "
                              "named when it was built (config, name, version); pass no checkpoint_id")
        self._meta, self.loaded_version = None, None
        self._tensors, self._values = {}, {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: "str | os.PathLike") -> bool:
        return False  # never picked by path: build a Reader with config and name

    def read_metadata(self) -> Metadata:  # (no **kwargs: DCP would retry a failed read as "rank-local")
        """The DCP metadata of the version (collective when the reader is). DCP's ``load`` reports
        an error raised here as an ``AssertionError`` quoting its message."""
        if self._meta is not None:
            return self._meta
        rec0 = f"{_state.RANK_PREFIX}0"
        ck = self._load(self.version, [rec0], self._comm)
        m = ck.manifest
        if m.get("framework") != "torch":
            raise ModelMismatchError(f"checkpoint {ck.name!r} v{ck.version} was not written by deepfreeze.torch "
                                     f"(framework {m.get('framework', 'keras')!r}): a DCP reader serves torch "
                                     "checkpoints only")
        record = _state.decode_record(ck.arrays[rec0], f"{ck.name} v{ck.version} {rec0}")
        _state.check_recorded_groups(record, f"checkpoint {ck.name!r} v{ck.version}")
        n_model = int(m.get("model_tensors", 0))
        md: dict[str, Any] = {}
        paths: dict[str, tuple[Any, ...]] = {}
        tensors: dict[str, tuple[str, str]] = {}
        values: dict[str, Any] = {}
        for i, t in enumerate(m["tensors"]):
            tname, dtype, shape = t["name"], t["dtype"], tuple(int(x) for x in t["shape"])
            if tname.startswith(_state.RANK_PREFIX):
                continue
            if i < n_model:
                path, key = _prefixed(self.model_prefix, tname)
            elif tname.startswith("optim.state."):
                fqn, _, k = tname[len("optim.state."):].rpartition(".")
                path, key = _prefixed(self.optim_prefix, "state", fqn, k)
            else:
                raise ModelMismatchError(f"checkpoint tensor {tname!r} is neither a model nor an optimizer tensor")
            md[key] = TensorStorageMetadata(TensorProperties(dtype=_state.torch_dtype(dtype)), torch.Size(shape),
                                            [ChunkStorageMetadata(torch.Size([0] * len(shape)), torch.Size(shape))])
            paths[key], tensors[key] = path, (tname, dtype, shape)
        for alias, target in _aliases(record).items():  # tied weights: both FQNs read the tensor stored once
            path, key = _prefixed(self.model_prefix, alias)
            tkey = _prefixed(self.model_prefix, target)[1]
            if tkey in tensors and key not in tensors:
                md[key], paths[key], tensors[key] = md[tkey], path, tensors[tkey]
        for ex in record.get("optim_extra", []):
            for fqn, kv in ex.items():
                for k, v in kv.items():
                    path, key = _prefixed(self.optim_prefix, "state", fqn, k)
                    md[key], paths[key], values[key] = BytesStorageMetadata(), path, v
        groups = [g for gs in record.get("param_groups", []) for g in gs]
        for i, g in enumerate(groups):
            for k, v in g.items():
                path, key = _prefixed(self.optim_prefix, "param_groups", i, k)
                md[key], paths[key], values[key] = BytesStorageMetadata(), path, v
        self._tensors, self._values, self.loaded_version = tensors, values, ck.version
        self._meta = Metadata(state_dict_metadata=md, planner_data=paths)
        return self._meta

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._meta is None:  # metadata from elsewhere: this reader serves only what it read itself
            raise ConfigError("deepfreeze.torch.Reader: read_metadata() was not called on this reader")
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> "Future[None]":
        """Serve every item of ``plan`` (offsets and lengths checked); collective when the reader is."""
        if self._meta is None:
            raise ConfigError("deepfreeze.torch.Reader: read_metadata() was not called on this reader")
        for ri in plan.items:
            key = ri.storage_index.fqn
            if key not in (self._tensors if ri.type != LoadItemType.BYTE_IO else self._values):
                raise ConfigError(f"the load plan asks for {key!r} ({ri.type.name}), which {self.name!r} "
                                  f"v{self.loaded_version} does not hold as such")
        cover: dict[str, list[int]] = {}  # checkpoint tensor -> [first row, end row, its rows] the items cover
        for ri in plan.items:
            if ri.type == LoadItemType.BYTE_IO:
                continue
            key = ri.storage_index.fqn
            tname, _, shape = self._tensors[key]
            _check_item(ri, shape, key)  # before anything is read
            lo, hi, n = (ri.storage_offsets[0], ri.storage_offsets[0] + ri.lengths[0], shape[0]) if shape else (0, 1, 1)
            c = cover.setdefault(tname, [lo, hi, n])
            c[0], c[1] = min(c[0], lo), max(c[1], hi)
        # dim-0 rows read of each tensor (None: all of it)
        spans = {t: None if (lo, hi) == (0, n) else (lo, hi) for t, (lo, hi, n) in cover.items()}
        wanted = sorted(spans)
        ranged = any(s is not None for s in spans.values())
        comm = self._comm
        if comm is not None:  # pooled when every rank asks for the same tensors, else each reads its own
            views = [json.loads(b) for b in comm.allgather(json.dumps([wanted, ranged]).encode())]
            if any(w != views[0][0] for w, _ in views):
                comm = None
            else:
                ranged = any(r for _, r in views)  # every participant of a pooled read passes rows, or none
        rows = (lambda name, shape: spans.get(name)) if ranged else None
        arrays = self._load(self.loaded_version, wanted, comm, rows).arrays if wanted else {}
        self.bytes_loaded += sum(arrays[t].nbytes for t in wanted)
        for ri in plan.items:
            key = ri.storage_index.fqn
            if ri.type == LoadItemType.BYTE_IO:
                data = _serialize(self._values[key], key)
                off, n = _byte_range(ri, len(data))
                planner.load_bytes(ri, io.BytesIO(data[off:off + n]))
                continue
            tname, dtype, _ = self._tensors[key]
            src = _state.as_tensor(arrays[tname], dtype)
            span = spans[tname]
            src = _narrow(src, ri, 0 if span is None else span[0])
            target = planner.resolve_tensor(ri).detach()
            if target.size() != src.size():
                raise ConfigError(f"{key!r}: the load plan's destination is {list(target.size())}, the read is "
                                  f"{list(src.size())}")
            target.copy_(src)
            planner.commit_tensor(ri, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # ------------------------------------------------------------------ helpers
    def _load(self, version: int | None, tensors: list[str], comm: Any, rows: Any = None) -> Checkpoint:
        from ..comm import LocalComm
        return _core_load(self.config, self.name, version, tensors=tensors, comm=comm or LocalComm(),
                          trust_owners=self.trust_owners, rows=rows)

    def close(self) -> None:
        """Release the reader's gloo group (collective when the reader is)."""
        comm, self._comm = self._comm, None
        if comm is not None and hasattr(comm, "close"):
            comm.close()


def _check_item(ri: ReadItem, shape: tuple[int, ...], key: str) -> None:
    """The item's storage offsets and lengths lie within a tensor of ``shape`` (else ConfigError)."""
    offs, lens = list(ri.storage_offsets), list(ri.lengths)
    if len(offs) != len(shape) or len(lens) != len(shape):
        raise ConfigError(f"{key!r}: a read of {len(lens)} dimension(s) at offsets {offs} of a tensor of shape "
                          f"{list(shape)}: the request does not fit the tensor")
    for d, (o, n) in enumerate(zip(offs, lens)):
        if not (type(o) is int and type(n) is int and 0 <= o and 0 <= n and o + n <= shape[d]):
            raise ConfigError(f"{key!r}: a read of {lens} at offsets {offs} lies outside the tensor of shape "
                              f"{list(shape)} (dimension {d})")


def _narrow(src: torch.Tensor, ri: ReadItem, first_row: int = 0) -> torch.Tensor:
    """``src`` (the tensor's rows from ``first_row`` on, checked by :func:`_check_item`) cut to the
    item's storage offsets and lengths."""
    for d, (o, n) in enumerate(zip(ri.storage_offsets, ri.lengths)):
        src = src.narrow(d, o - first_row if d == 0 else o, n)
    return src


def _byte_range(ri: ReadItem, size: int) -> tuple[int, int]:
    """(offset, length) of a bytes item within ``size`` bytes; length 0 means to the end."""
    offs, lens = list(ri.storage_offsets), list(ri.lengths)
    o = offs[0] if offs else 0
    n = lens[0] if lens else 0
    if len(offs) > 1 or len(lens) > 1 or not (type(o) is int and type(n) is int and 0 <= o <= size and n >= 0):
        raise ConfigError(f"{ri.storage_index.fqn!r}: a bytes read at {offs} of {lens} lies outside its {size} bytes")
    n = n or size - o
    if o + n > size:
        raise ConfigError(f"{ri.storage_index.fqn!r}: a bytes read at {o} of {n} bytes lies outside its {size} bytes")
    return o, n


def _serialize(value: Any, key: str) -> bytes:
    """``torch.save`` bytes of ``value``, checked to load with ``weights_only=True``."""
    buf = io.BytesIO()
    torch.save(value, buf)
    data = buf.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:
        raise ConfigError(f"{key!r} holds a {type(value).__name__} that torch.load(weights_only=True) does not "
                          f"accept ({type(e).__name__}), so the reader does not serve it: load it with "
                          "deepfreeze.torch.load_state") from e
    return data


# --------------------------------------------------------------------------- export --format dcp

def dcp_state_dict(ck: Checkpoint, model_prefix: str = "", optim_prefix: str = "optim") -> dict[str, Any]:
    """The state dict a DCP user gets from the :class:`Reader` of ``ck`` (nested; the model's
    entries at ``model_prefix``, ``get_state_dict``'s optimizer dict at ``optim_prefix``); the
    ``param_groups`` checked first (:func:`~deepfreeze.torch._state.check_recorded_groups`)."""
    from .state_loader import _split_recorded
    st = _split_recorded(ck)
    out: dict[str, Any] = {}

    def put(prefix: str, value: Any) -> None:
        if not prefix:
            out.update(value)
            return
        node = out
        *head, last = prefix.split(".")
        for p in head:
            node = node.setdefault(p, {})
        node[last] = value
    put(_check_prefix(model_prefix, "model_prefix"), dict(st.model))
    put(_check_prefix(optim_prefix, "optim_prefix"), st.optim)
    return out


def write_dcp(ck: Checkpoint, outdir: str, *, force: bool = False, shared_group: bool = False) -> int:
    """Write ``ck`` (a torch checkpoint) as a DCP checkpoint directory ``outdir`` (``dcp.save``
    with ``FileSystemWriter`` in this process, no process group), built under a temporary name
    (``0700``) beside it and renamed into place. With ``force`` an existing DCP checkpoint directory
    (one holding ``.metadata``) is replaced; anything else there is refused. The directory holding
    ``outdir`` must follow the roots' rule (:func:`deepfreeze.ownership.check_output_dir`; with
    ``shared_group`` a group-writable one is trusted): else
    :class:`~deepfreeze.errors.UnsafePathError` before anything is written. Returns the bytes written."""
    import torch.distributed.checkpoint as dcp
    from ..export import ExportError
    if ck.manifest.get("framework") != "torch":
        raise ExportError(f"checkpoint {ck.name!r} v{ck.version} was not written by deepfreeze.torch: export it as "
                          "npz, safetensors or h5")
    outdir = os.path.abspath(outdir)
    parent = os.path.dirname(outdir)
    if not os.path.isdir(parent):
        raise ExportError(f"the directory of the output, {parent}, does not exist")
    ownership.check_output_dir(parent, what=f"output {outdir}", shared_group=shared_group)
    if os.path.lexists(outdir):
        if os.path.islink(outdir) or not os.path.isdir(outdir):
            raise ExportError(f"output {outdir} exists and is not a directory: give a new directory name")
        if not force:
            raise ExportError(f"output {outdir} exists: pass --force to replace it")
        if not os.path.isfile(os.path.join(outdir, ".metadata")):
            raise ExportError(f"output {outdir} exists and is not a DCP checkpoint (no .metadata): not replaced; "
                              "remove it yourself or give another name")
    sd = dcp_state_dict(ck)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(outdir)}.tmp-", dir=parent)
    try:
        import warnings
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process, as intended
            warnings.simplefilter("ignore")
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
        size = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
        old = None
        if os.path.lexists(outdir):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(outdir)}.old-", dir=parent)
            os.rename(outdir, os.path.join(old, "d"))
        os.rename(tmp, outdir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return size
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
