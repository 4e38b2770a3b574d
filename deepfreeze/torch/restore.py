"""Restore a committed version into PyTorch (the torch side of :mod:`deepfreeze.restore`).

``load`` gives CPU tensors keyed by ``get_state_dict(model, optimizer)``'s FQNs (model tensors
by FQN, optimizer state as ``optim.state.<fqn>.<key>``) in any process, at any world size;
``load_state`` the same as state dicts plus every rank's state record; ``restore`` puts a
version into a model and its optimizers. With ``torch.distributed`` initialized the load is
collective (every rank's scratch directory, partner copies and parity are pooled over a
dedicated gloo group); without it, a plain process reads its own scratch and persistent.

Into an FSDP2 model (``fully_shard``, any world size) ``restore`` reads only this rank's dim-0
rows of each sharded parameter and of the optimizer state shaped like it (the core's ranged
read, :mod:`deepfreeze.restore`), and puts them into the local shards; the optimizer state
becomes DTensors placed as their parameters. A checkpoint written by FSDP2 restores into DDP
or a plain model (and a DDP one into FSDP2) as any other: the manifest holds global tensors.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import torch

from ..config import Config
from ..errors import ModelMismatchError
from ..restore import Checkpoint, load as _core_load
from . import _state

__all__ = ["load", "load_state", "restore", "TorchState", "apply"]

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


def _checkpoint(config: Any, name: str, version: int | None, comm: Any, trust_owners: Any,
                overrides: dict[str, Any], rows: Any = None) -> Checkpoint:
    from ._dist import make_comm
    cfg = Config.resolve(config, **overrides)
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


def load_state(config: "str | Config | None" = None, *, name: str, version: int | None = None,
               comm: Any = None, trust_owners: "list[str | int] | None" = None, **overrides: Any) -> TorchState:
    """The newest committed version (or ``version``) as a :class:`TorchState` of CPU tensors.
    ``overrides``: INI keys set in code (``scratch=``, ``persistent=`` ...)."""
    return _split(_checkpoint(config, name, version, comm, trust_owners, overrides))


def load(config: "str | Config | None" = None, *, name: str, version: int | None = None, comm: Any = None,
         trust_owners: "list[str | int] | None" = None, **overrides: Any) -> dict[str, torch.Tensor]:
    """CPU tensors of a committed version keyed by ``get_state_dict(model, optimizer)``'s FQNs:
    the model's by FQN, the optimizers' state tensors as ``optim.state.<fqn>.<key>`` (DCP's
    flattened names). Works in any process at any world size (collective when
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
            state: "dict[str, Any] | None" = None, rng: bool = False,
            trust_owners: "list[str | int] | None" = None, **overrides: Any) -> tuple[int, int]:
    """Put a committed version into ``model`` (bit-exact) and, if given, its optimizers (and the
    ``state=`` objects; with ``rng``, this rank's RNG states); returns ``(version, step)``.
    Collective when ``torch.distributed`` is initialized; any world size."""
    from ._dist import rank_and_size
    opts = [] if optimizer is None else [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    ck = _checkpoint(config, name, version, None, trust_owners, overrides, rows=_rows_of(model))
    rank, size = rank_and_size()
    apply(ck, model, opts, state=state or {}, rank=rank, world_size=size, rng=rng)
    return ck.version, ck.step


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


def apply(ck: Checkpoint, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], *,
          state: dict[str, Any], rank: int, world_size: int, rng: bool) -> None:
    """Put ``ck`` into the model, optimizers, ``state`` objects and (``rng``) RNG states of this
    process (rank ``rank`` of ``world_size``: its own state record at the checkpoint's world
    size, else rank 0's)."""
    st = _split(ck)
    where = f"checkpoint {ck.name!r} v{ck.version}"
    _state.check_model(model, ck.manifest["tensors"], int(ck.manifest.get("model_tensors", 0)), where)
    sharded = _sharded(model)
    with torch.no_grad():
        for fqn, t, _ in _state.model_entries(model):
            if fqn in sharded:  # an FSDP2 parameter: this rank's rows into its local shard
                t.to_local().copy_(_local(st.model[fqn], *sharded[fqn]))
            else:
                t.copy_(st.model[fqn])
    same = world_size == st.world_size and rank < len(st.records)
    rec = st.records[rank] if same else (st.records[0] if st.records else {})
    if optimizers:
        saved_groups = rec.get("param_groups", [])
        if len(saved_groups) != len(optimizers):
            raise ModelMismatchError(f"{where} holds {len(saved_groups)} optimizer(s), {len(optimizers)} given")
        cur = _state.train_state(model, optimizers)
        params = {fqn: t for fqn, t, is_param in _state.model_entries(model) if is_param}
        for k, opt in enumerate(optimizers):
            mine, saved = cur.groups[k], saved_groups[k]
            if [g["params"] for g in mine] != [g["params"] for g in saved]:
                raise ModelMismatchError(f"{where}: optimizer {k}'s parameter groups differ from the checkpoint's "
                                         "(other parameters or another grouping): build the optimizer that was trained")
            index = {fqn: i for i, fqn in enumerate(f for g in mine for f in g["params"])}
            sd_state = {index[fqn]: _placed(dict(st.optim["state"][fqn]), params.get(fqn), sharded.get(fqn))
                        for fqn in index if fqn in st.optim["state"]}
            groups = [{**{a: b for a, b in g.items() if a != "params"}, "params": [index[f] for f in g["params"]]}
                      for g in saved]
            opt.load_state_dict({"state": sd_state, "param_groups": groups})
    if state:
        saved_state = {**rec.get("a", {}).get("state", {}), **rec.get("state", {})}
        for key, obj in state.items():
            if key not in saved_state:
                raise ModelMismatchError(f"{where} holds no state object {key!r} (it has {sorted(saved_state)})")
            obj.load_state_dict(saved_state[key])
    if rng:
        if same and "rng" in rec.get("a", {}):
            _state.set_rng_state(rec["a"]["rng"])
        elif rank == 0:
            log.warning("DeepFreeze: %s was written by %d ranks, this job has %d: RNG states are not restored",
                        where, st.world_size, world_size)


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
