"""``deepfreeze export --format torch``: a committed torch checkpoint as a ``torch.save`` file.

The file holds ``{"model": {fqn: tensor}, "optim": {"state": {fqn: {key: value}},
"param_groups": [...]}, "deepfreeze": {"name", "version", "step", "world_size"}}`` (the
``get_state_dict`` layout, CPU tensors), readable with ``torch.load(path, weights_only=True)``.
Written to a temporary name and renamed into place (:func:`deepfreeze.export._atomic`).
"""
from __future__ import annotations

from typing import Any

import torch

from ..export import ExportError, _atomic
from ..restore import Checkpoint
from .restore import _split

__all__ = ["write_torch", "torch_payload"]


def torch_payload(ck: Checkpoint) -> dict[str, Any]:
    st = _split(ck)
    return {"model": st.model, "optim": st.optim,
            "deepfreeze": {"name": st.name, "version": st.version, "step": st.step, "world_size": st.world_size}}


def write_torch(ck: Checkpoint, path: str, *, force: bool = False) -> int:
    """Write ``ck`` (a version written by :class:`deepfreeze.torch.Checkpointer`) to ``path``."""
    if ck.manifest.get("framework") != "torch":
        raise ExportError(f"checkpoint {ck.name!r} v{ck.version} was not written by deepfreeze.torch: export it as "
                          "npz, safetensors or h5")
    payload = torch_payload(ck)
    return _atomic(path, force, lambda tmp: torch.save(payload, tmp))
