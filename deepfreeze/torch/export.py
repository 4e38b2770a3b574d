"""``deepfreeze export --format torch``: a committed torch checkpoint as a ``torch.save`` file.

The file holds ``{"model": {fqn: tensor}, "optim": {"state": {fqn: {key: value}},
"param_groups": [...]}, "deepfreeze": {"name", "version", "step", "world_size"}}`` (the
``get_state_dict`` layout, CPU tensors), readable with ``torch.load(path, weights_only=True)``.
Written to a temporary name and renamed into place (:func:`deepfreeze.export.atomic_output`).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..export import ExportError, atomic_output
from ..format import dtype_name
from ..loader import Checkpoint
from ._state import as_tensor
from .state_loader import _split_recorded

__all__ = ["write_torch", "torch_payload"]


def _weights_only(v: Any) -> Any:
    """``v`` with every numpy array (a state record may hold some: its ``{"N": ...}`` tag) as a CPU
    tensor: ``torch.load(weights_only=True)`` refuses numpy objects. Everything else a decoded
    record holds (tensors, torch dtypes, numbers, strings, bytes, None, lists, tuples, dicts) it reads."""
    if isinstance(v, np.ndarray):
        return as_tensor(np.ascontiguousarray(v), dtype_name(v.dtype))
    if isinstance(v, (list, tuple)):
        return type(v)(_weights_only(x) for x in v)
    if isinstance(v, dict):
        return {k: _weights_only(x) for k, x in v.items()}
    return v


def torch_payload(ck: Checkpoint) -> dict[str, Any]:
    """What :func:`write_torch` saves (module docstring); the optimizers' ``param_groups`` are
    checked against their classes' defaults first (:func:`~deepfreeze.torch._state.check_recorded_groups`:
    a damaged record is a CorruptCheckpointError, not a file whose load breaks ``opt.step()``)."""
    st = _split_recorded(ck)
    return {"model": st.model, "optim": _weights_only(st.optim),
            "deepfreeze": {"name": st.name, "version": st.version, "step": st.step, "world_size": st.world_size}}


def write_torch(ck: Checkpoint, path: str, *, force: bool = False, shared_group: bool = False) -> int:
    """Write ``ck`` (a version written by :class:`deepfreeze.torch.Checkpointer`) to ``path``, whose
    directory must follow :func:`deepfreeze.export.atomic_output`'s rule (owned by you or root,
    writable by nobody else; ``shared_group``: a group-writable one is trusted)."""
    if ck.manifest.get("framework") != "torch":
        raise ExportError(f"checkpoint {ck.name!r} v{ck.version} was not written by deepfreeze.torch: export it as "
                          "npz, safetensors or h5")
    payload = torch_payload(ck)
    return atomic_output(path, force, lambda tmp: torch.save(payload, tmp), shared_group=shared_group)
