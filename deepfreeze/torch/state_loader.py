"""Restore a committed version into PyTorch (the torch side of :mod:`deepfreeze.loader`).

``load`` gives CPU tensors keyed by ``get_state_dict(model, optimizer)``'s FQNs (model tensors
by FQN, optimizer state as ``optim.state.<fqn>.<key>``) in any process, at any world size;
``load_state`` the same as state dicts plus every rank's state record; ``restore`` puts a
version into a model and its optimizers. With ``torch.distributed`` initialized the load is
collective (every rank's scratch directory, partner copies and parity are pooled over a
dedicated gloo group); without it, a plain process reads its own scratch and persistent.

Before anything is written, ``restore`` (and ``Checkpointer(resume=True)``) checks the model's
tensors, the optimizers (their number and classes, each one's parameter groups: how many, the
parameters of each, the hyperparameter keys its class defines) and the ``state=`` keys against
the checkpoint: a difference is a :class:`~deepfreeze.errors.ModelMismatchError` naming both
sides, and nothing is changed. So are the kinds of what torch will take: each saved
``param_groups`` value whose key the live group has is of the live value's kind, and the saved
state of a torch LR scheduler or GradScaler given as ``state=`` has only keys of the live
``state_dict()``, each of the live kind (:func:`~deepfreeze.torch._state.check_groups`,
:func:`~deepfreeze.torch._state.check_stateful`); a value of another kind (a learning rate of
``"0.01"``, a scheduler state with an ``optimizer`` entry: a damaged or edited record) is a
:class:`~deepfreeze.errors.CorruptCheckpointError`, with or without ``strict``, and nothing is
changed. With ``strict=False`` the parts that match are loaded (model tensors of the same
FQN, dtype and shape; an optimizer whose structure matches; the ``state=`` objects the
checkpoint holds) and what was left out is logged and returned
(:attr:`Restored.skipped`). Tied weights (two FQNs of one tensor) are stored once; ``load``
gives both keys, ``restore`` copies into the model's tensors, so a tied model stays tied.

Into an FSDP2 model (``fully_shard``, any world size) ``restore`` reads only this rank's dim-0
rows of each sharded parameter and of the optimizer state shaped like it (the core's ranged
read, :mod:`deepfreeze.loader`), and puts them into the local shards; the optimizer state
becomes DTensors placed as their parameters. A checkpoint written by FSDP2 restores into DDP
or a plain model (and a DDP one into FSDP2) as any other: the manifest holds global tensors.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, NamedTuple, Sequence

import torch

from ..config import Config
from ..errors import ModelMismatchError
from ..loader import Checkpoint, load as _core_load
from . import _state

__all__ = ["load", "load_state", "restore", "TorchState", "Restored", "apply", "read_config"]

log = logging.getLogger("deepfreeze")


@dataclasses.dataclass
class TorchState:
    """A loaded version: ``model`` (FQN -> CPU tensor), ``optim`` (``get_state_dict``'s optimizer
    format: ``{"state": {fqn: {key: value}}, "param_groups": [...]}`` with FQNs for params, the
    groups of every optimizer in order), ``records`` (every rank's state record), and where it
    came from."""

    name: str
    version: int
    step: int
    level: str
    world_size: int
    model: dict[str, torch.Tensor]
    optim: dict[str, Any]
    records: list[dict[str, Any]]
    manifest: dict[str, Any]


class Restored(tuple):
    """``(version, step)`` of the version :func:`restore` put in place (unpacks as a pair);
    :attr:`skipped`: what ``strict=False`` left out (empty when everything was loaded)."""

    skipped: list[str]

    def __new__(cls, version: int, step: int, skipped: "Sequence[str]" = ()) -> "Restored":
        self = super().__new__(cls, (version, step))
        self.skipped = list(skipped)
        return self

    @property
    def version(self) -> int:
        return self[0]

    @property
    def step(self) -> int:
        return self[1]


def read_config(config: "str | Config | None", **overrides: Any) -> Config:
    """The configuration of a read: as :meth:`Config.resolve`, except that without a config file
    (and no ``mode=`` or ``VELOC_MODE``) ``mode`` is not demanded: it only says how versions are
    *written*, so ``load(name=..., persistent=..., scratch=...)`` needs nothing else."""
    if config is None and overrides.get("mode") is None and "VELOC_MODE" not in os.environ:
        overrides = {**overrides, "mode": "sync"}
    return Config.resolve(config, **overrides)


def _checkpoint(config: Any, name: str, version: int | None, comm: Any, trust_owners: Any,
                overrides: dict[str, Any], rows: Any = None) -> Checkpoint:
    from ._dist import make_comm
    cfg = read_config(config, **overrides)
    own = comm is None
    comm = comm if comm is not None else make_comm()
    try:
        return _core_load(cfg, name, version, comm=comm, trust_owners=trust_owners, rows=rows)
    finally:
        if own and hasattr(comm, "close"):
            comm.close()


def _split(ck: Checkpoint) -> TorchState:
    m = ck.manifest
    if m.get("framework") != "torch":
        raise ModelMismatchError(f"checkpoint {ck.name!r} v{ck.version} was not written by deepfreeze.torch "
                                 f"(framework {m.get('framework', 'keras')!r}): use deepfreeze.load or the "
                                 "matching adapter")
    dtypes = {t["name"]: t["dtype"] for t in m["tensors"]}
    n_model = int(m.get("model_tensors", 0))
    names = list(ck.arrays)
    model = {k: _state.as_tensor(ck.arrays[k], dtypes[k]) for k in names[:n_model]}
    records = [_state.decode_record(ck.arrays[k], f"{ck.name} v{ck.version} {k}")
               for k in names if k.startswith(_state.RANK_PREFIX)]
    rec0 = records[0] if records else {}
    for alias, target in _aliases(rec0).items():  # tied weights: one tensor under both FQNs
        if target in model and alias not in model:
            model[alias] = model[target]
    state: dict[str, dict[str, Any]] = {}
    for k in names[n_model:]:
        if k.startswith(_state.RANK_PREFIX):
            continue
        if not k.startswith("optim.state."):
            raise ModelMismatchError(f"checkpoint tensor {k!r} is neither a model nor an optimizer tensor")
        fqn, _, key = k[len("optim.state."):].rpartition(".")
        state.setdefault(fqn, {})[key] = _state.as_tensor(ck.arrays[k], dtypes[k])
    for ex in rec0.get("optim_extra", []):
        for fqn, kv in ex.items():
            state.setdefault(fqn, {}).update(kv)
    groups = [g for gs in rec0.get("param_groups", []) for g in gs]
    return TorchState(ck.name, ck.version, ck.step, ck.level, int(m.get("world_size", 1)), model,
                      {"state": state, "param_groups": groups}, records, m)


def _split_recorded(ck: Checkpoint) -> TorchState:
    """:func:`_split`, each optimizer's saved ``param_groups`` checked first against the defaults of
    its recorded class (:func:`~deepfreeze.torch._state.check_recorded_groups`): for readers with no
    live optimizer (``export --format torch|dcp``, the DCP :class:`~deepfreeze.torch.Reader`'s state
    dict); a damaged record is a CorruptCheckpointError, not a file whose load breaks ``opt.step()``."""
    st = _split(ck)
    _state.check_recorded_groups(st.records[0] if st.records else {}, f"checkpoint {ck.name!r} v{ck.version}")
    return st


def _aliases(rec: dict[str, Any]) -> dict[str, str]:
    """The tied FQNs a state record names (``{alias: FQN stored}``; none before they were recorded)."""
    a = rec.get("a", {}).get("aliases", {}) if isinstance(rec.get("a"), dict) else {}
    return {str(k): str(v) for k, v in a.items()} if isinstance(a, dict) else {}


def load_state(config: "str | Config | None" = None, *, name: str, version: int | None = None,
               comm: Any = None, trust_owners: "list[str | int] | None" = None, **overrides: Any) -> TorchState:
    """The newest committed version (or ``version``) as a :class:`TorchState` of CPU tensors.
    ``overrides``: INI keys set in code (``scratch=``, ``persistent=`` ...)."""
    return _split(_checkpoint(config, name, version, comm, trust_owners, overrides))


def load(config: "str | Config | None" = None, *, name: str, version: int | None = None, comm: Any = None,
         trust_owners: "list[str | int] | None" = None, **overrides: Any) -> dict[str, torch.Tensor]:
    """CPU tensors of a committed version keyed by ``get_state_dict(model, optimizer)``'s FQNs:
    the model's by FQN, the optimizers' state tensors as ``optim.state.<fqn>.<key>`` (DCP's
    flattened names); tied weights under each of their FQNs (one tensor). Works in any process at any world size (collective when
    ``torch.distributed`` is initialized)."""
    st = load_state(config, name=name, version=version, comm=comm, trust_owners=trust_owners, **overrides)
    out = dict(st.model)
    for fqn, kv in st.optim["state"].items():
        for key, v in kv.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.state.{fqn}.{key}"] = v
    return out


def restore(model: torch.nn.Module, optimizer: "torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None" = None,
            config: "str | Config | None" = None, *, name: str, version: int | None = None,
            state: "dict[str, Any] | None" = None, rng: bool = False, strict: bool = True,
            trust_owners: "list[str | int] | None" = None, **overrides: Any) -> Restored:
    """Put a committed version into ``model`` (bit-exact) and, if given, its optimizers (and the
    ``state=`` objects; with ``rng``, this rank's RNG states); returns :class:`Restored`, which
    unpacks as ``(version, step)``. Everything is checked before anything is written (module
    docstring); ``strict=False`` loads what matches and lists the rest in ``.skipped``. With
    ``state`` given, its keys must be those the checkpoint holds. Collective when
    ``torch.distributed`` is initialized; any world size."""
    from ._dist import rank_and_size
    opts = [] if optimizer is None else [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    rank, size = rank_and_size("deepfreeze.torch.restore")
    ck = _checkpoint(config, name, version, None, trust_owners, overrides, rows=_rows_of(model))
    skipped = apply(ck, model, opts, state=state, rank=rank, world_size=size, rng=rng, strict=strict).skipped
    return Restored(ck.version, ck.step, skipped)


def _sharded(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, int]]]:
    """FQN -> (global shape, this rank's dim-0 rows) of every FSDP2-sharded model tensor."""
    out = {}
    for fqn, t, _ in _state.model_entries(model):
        rows = _state.local_rows(t, f"model tensor {fqn!r}")
        if rows is not None:
            out[fqn] = (tuple(t.shape), rows)
    return out


def _rows_of(model: torch.nn.Module) -> Any:
    """The ranged read of an FSDP2 model (None for another): a sharded parameter's rows, and the
    same rows of its optimizer state of the same shape (``optim.state.<fqn>.<key>``)."""
    sharded = _sharded(model)
    if not sharded:
        return None

    def rows(name: str, shape: tuple[int, ...]) -> "tuple[int, int] | None":
        fqn = name[len("optim.state."):].rpartition(".")[0] if name.startswith("optim.state.") else name
        hit = sharded.get(fqn)
        return hit[1] if hit is not None and hit[0] == tuple(shape) else None
    return rows


def _local(a: torch.Tensor, shape: tuple[int, ...], rows: tuple[int, int]) -> torch.Tensor:
    """Rows ``rows`` of a tensor of global ``shape``: ``a`` is the whole tensor or those rows."""
    if tuple(a.shape) == shape:
        return a[rows[0]:rows[1]]
    if tuple(a.shape) != (rows[1] - rows[0], *shape[1:]):
        raise ModelMismatchError(f"a loaded part {tuple(a.shape)} is not rows {rows} of {shape}")
    return a


class Applied(NamedTuple):
    """What :func:`apply` did: what it left out (``strict=False``), this rank's own state record."""
    skipped: list[str]
    record: "dict[str, Any] | None"


def apply(ck: Checkpoint, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], *,
          state: "dict[str, Any] | None", rank: int, world_size: int, rng: bool, strict: bool = True,
          received: "dict[str, torch.Tensor] | None" = None) -> "Applied":
    """Put ``ck`` into the model, optimizers, ``state`` objects and (``rng``) RNG states of this
    process (rank ``rank`` of ``world_size``: its own state record at the checkpoint's world
    size, else rank 0's). Every check comes first (module docstring): a mismatch raises
    :class:`ModelMismatchError` with nothing written, or under ``strict=False`` is left out; a
    value of the wrong kind raises :class:`~deepfreeze.errors.CorruptCheckpointError`, nothing
    written; returns what was left out (logged once) and this rank's own state record (None at
    another world size). ``state``: None checks and restores no ``state=`` object; a dict
    (``{}`` too) must have the checkpoint's keys. ``received``: model FQN -> a CPU tensor holding
    that tensor's bytes (a clone received them there; of the model tensor's dtype and shape): after
    every check it becomes the model tensor's storage (``t.data = it``), not copied."""
    st = _split(ck)
    where = f"checkpoint {ck.name!r} v{ck.version}"
    same = world_size == st.world_size and rank < len(st.records)
    rec = st.records[rank] if same else (st.records[0] if st.records else {})
    # -- every check, before anything is written
    skip_model = set(_state.check_model(model, ck.manifest["tensors"], int(ck.manifest.get("model_tensors", 0)),
                                        where, _aliases(rec), strict))
    skipped = [f"model tensor {f!r}" for f in sorted(skip_model)]
    loads = _check_optimizers(where, rec, model, optimizers, strict, skipped)
    saved_state = {**rec.get("a", {}).get("state", {}), **rec.get("state", {})}
    imported = rec.get("a", {}).get("imported")
    if state is not None and set(state) != set(saved_state):
        gone, new = sorted(set(saved_state) - set(state)), sorted(set(state) - set(saved_state))
        if strict and isinstance(imported, dict):  # a version imported from elsewhere holds only what was there
            raise ModelMismatchError(f"{where} was imported from {imported.get('format')} ({imported.get('path')}): it "
                                     f"holds no state object {new} (it has {sorted(saved_state)}): resume with "
                                     "strict=False to restore what it holds (those objects keep their current "
                                     "state), or import their dicts too with import_dcp(state=...)")
        if strict:
            raise ModelMismatchError(f"{where}: the state= objects differ: the checkpoint holds {sorted(saved_state)}, "
                                     f"this run gives {sorted(state)} (not given: {gone}; not in the checkpoint: "
                                     f"{new}): pass the state= objects that were checkpointed, or strict=False to "
                                     "restore those both have")
        skipped += [f"state object {k!r} (not in the checkpoint)" for k in new]
        skipped += [f"the checkpoint's state object {k!r} (not given)" for k in gone]
    # the kinds of what torch takes: a value a damaged record holds must not wait for the next step to fail
    for k, (opt, mine) in loads.items():
        _state.check_groups(rec["param_groups"][k], mine, f"optimizer {k} ({_state.class_name(opt)})", where)
    for key, obj in (state or {}).items():
        if key in saved_state:
            _state.check_stateful(obj, saved_state[key], f"state object {key!r}", where)
    if skipped:
        log.warning("DeepFreeze: %s restored with strict=False; left out: %s", where, "; ".join(skipped))
    # -- the writes
    sharded = _sharded(model)
    done: set[int] = set()
    with torch.no_grad():
        for fqn, t, _ in _state.model_entries(model):
            if fqn in skip_model or id(t) in done:  # (tied weights: one tensor, copied once)
                continue
            done.add(id(t))
            if received and fqn in received:
                t.data = received[fqn]
                continue
            if fqn in sharded:  # an FSDP2 parameter: this rank's rows into its local shard
                t.to_local().copy_(_local(st.model[fqn], *sharded[fqn]))
            else:
                t.copy_(st.model[fqn])
    own_buffers = rec.get("a", {}).get("buffers") if same else None
    if own_buffers:  # FSDP2: this rank's buffers as they were on it (rank 0's are in the tensor list)
        with torch.no_grad():
            for fqn, t, is_param in _state.model_entries(model):
                if not is_param and isinstance(own_buffers.get(fqn), torch.Tensor) \
                        and own_buffers[fqn].shape == t.shape and own_buffers[fqn].dtype == t.dtype:
                    t.copy_(own_buffers[fqn])
    if loads:
        params = {fqn: t for fqn, t, is_param in _state.model_entries(model) if is_param}
        for k, (opt, mine) in loads.items():
            saved = rec["param_groups"][k]
            index = {fqn: i for i, fqn in enumerate(f for g in mine for f in g["params"])}
            sd_state = {index[fqn]: _placed(dict(st.optim["state"][fqn]), params.get(fqn), sharded.get(fqn))
                        for fqn in index if fqn in st.optim["state"]}
            groups = [{**{a: b for a, b in g.items() if a != "params"}, "params": [index[f] for f in g["params"]]}
                      for g in saved]
            opt.load_state_dict({"state": sd_state, "param_groups": groups})
    for key, obj in (state or {}).items():
        if key in saved_state:
            obj.load_state_dict(saved_state[key])
    if rng:
        if same and "rng" in rec.get("a", {}):
            _state.set_rng_state(rec["a"]["rng"])
        elif rank == 0 and rec.get("a", {}).get("imported"):
            log.warning("DeepFreeze: %s was imported (%s): it holds no RNG states; they are not restored", where,
                        rec["a"]["imported"].get("format"))
        elif rank == 0:  # a clone was written by nobody: its source had that many ranks
            log.warning("DeepFreeze: %s %d ranks, this job has %d: RNG states are not restored", "the source had" if
                        ck.level == "clone" else f"{where} was written by", st.world_size, world_size)
    return Applied(skipped, rec if same else None)


def _check_optimizers(where: str, rec: dict[str, Any], model: torch.nn.Module,
                      optimizers: Sequence[torch.optim.Optimizer], strict: bool, skipped: list[str]
                      ) -> dict[int, tuple[torch.optim.Optimizer, list[dict[str, Any]]]]:
    """The optimizers whose state can be loaded, ``{k: (optimizer, its groups with FQNs)}``:
    as many as the checkpoint's, each of the recorded class (versions written before classes
    were recorded: checked by their groups alone), with as many parameter groups, the same
    parameters in each, and every hyperparameter its class defines (``defaults``) in each saved
    group. A difference raises (``strict``) or is appended to ``skipped``."""
    if not optimizers:
        return {}
    saved_groups = rec.get("param_groups", [])
    saved_cls = rec.get("a", {}).get("optimizers")
    mine_cls = [_state.class_name(o) for o in optimizers]

    def side(k: int) -> str:
        return saved_cls[k] if isinstance(saved_cls, list) and k < len(saved_cls) else "(class not recorded)"

    if len(saved_groups) != len(optimizers):
        what = (f"{where} holds {len(saved_groups)} optimizer(s){' ' + str(saved_cls) if saved_cls else ''}, "
                f"this run gives {len(optimizers)} {mine_cls}")
        if strict:
            raise ModelMismatchError(f"{what}: build the optimizers that were trained, in the same order, or pass "
                                     "strict=False to load the model without the optimizer state")
        skipped.append(f"every optimizer's state ({what})")
        return {}
    fqn_of: dict[int, str] = {}
    for fqn, t, _ in _state.model_entries(model):
        fqn_of.setdefault(id(t), fqn)
    cur, _ = _state.optimizer_groups(optimizers, fqn_of)
    problems: dict[int, str] = {}
    for k, opt in enumerate(optimizers):
        mine, saved = cur[k], saved_groups[k]
        if isinstance(saved_cls, list) and side(k) != mine_cls[k]:
            problems[k] = f"it is {side(k)} in the checkpoint, {mine_cls[k]} in this run"
        elif len(mine) != len(saved):
            problems[k] = f"{len(saved)} parameter group(s) in the checkpoint, {len(mine)} in this run"
        elif [g["params"] for g in mine] != [g["params"] for g in saved]:
            i = next(i for i, (a, b) in enumerate(zip(mine, saved)) if a["params"] != b["params"])
            problems[k] = (f"parameter group {i} holds {len(saved[i]['params'])} parameter(s) in the checkpoint "
                           f"({saved[i]['params'][:3]}...), {len(mine[i]['params'])} in this run "
                           f"({mine[i]['params'][:3]}...)")
        else:
            for i, g in enumerate(saved):
                lacking = sorted(set(opt.defaults) - set(g) - {"params"})
                if lacking:
                    problems[k] = (f"parameter group {i} in the checkpoint lacks the hyperparameters {lacking} of "
                                   f"this run's {mine_cls[k]} (the checkpoint's group keys: "
                                   f"{sorted(set(g) - {'params'})}; its class: {side(k)})")
                    break
    for k, why in problems.items():
        what = f"{where}: optimizer {k} does not match: {why}"
        if strict:
            raise ModelMismatchError(f"{what}. Build the optimizer that was trained (same class, same parameter "
                                     "groups), or pass strict=False to load the model and the optimizers that match")
        skipped.append(f"optimizer {k}'s state ({why})")
    return {k: (opt, cur[k]) for k, opt in enumerate(optimizers) if k not in problems}


def _placed(state: dict[str, Any], param: "torch.Tensor | None", sharded: Any) -> dict[str, Any]:
    """An optimizer state entry of ``param``: under FSDP2 each tensor shaped as the parameter
    becomes a DTensor of this rank's rows placed as the parameter (others stay as they are)."""
    if param is None or sharded is None:
        return state
    from torch.distributed.tensor import DTensor
    shape, rows = sharded
    out = {}
    for key, v in state.items():
        if isinstance(v, torch.Tensor) and tuple(v.shape) in (shape, (rows[1] - rows[0], *shape[1:])) and v.dim():
            local = _local(v, shape, rows).contiguous().clone()
            v = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                   stride=param.stride())
        out[key] = v
    return out
