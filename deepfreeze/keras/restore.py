"""Restore a committed version into a Keras model (the TensorFlow side of restore)."""
from __future__ import annotations

from typing import Any

from ..config import Config
from ..errors import ModelMismatchError
from ..format import dtype_name
from ..restore import load

__all__ = ["restore_model", "model_tensors"]


def model_tensors(model: Any) -> list[tuple[str, str, tuple[int, ...]]]:
    """(stable name, dtype, shape) of every weight of ``model``, in ``get_weights()`` order."""
    out, seen = [], {}
    for w in model.weights:
        name = w.name[:-2] if w.name.endswith(":0") else w.name
        n = seen.get(name, 0)
        seen[name] = n + 1
        out.append((name if n == 0 else f"{name}_{n}", dtype_name(w.dtype.as_numpy_dtype), tuple(w.shape)))
    return out


def restore_model(model: Any, config: "str | Config | None" = None, *, name: str,
                  version: int | None = None, **overrides: Any) -> tuple[int, int]:
    """Load a committed version into ``model`` (bit-exact); returns ``(version, step)``."""
    cfg = Config.resolve(config, **overrides)
    if not getattr(model, "built", True) or not model.weights:
        raise ModelMismatchError("the model has no weights yet: build it (call it on an input or "
                                 "give it an Input layer) before restoring")
    ck = load(cfg, name, version)
    tensors = ck.manifest["tensors"]
    mine = model_tensors(model)
    for i in range(max(len(mine), len(tensors))):
        if i >= len(tensors):
            raise ModelMismatchError(f"model tensor #{i} {mine[i][0]!r} {mine[i][1]}{list(mine[i][2])} is not in "
                                     f"checkpoint {name!r} v{ck.version}, which holds {len(tensors)} tensors")
        t = tensors[i]
        if i >= len(mine):
            raise ModelMismatchError(f"checkpoint tensor #{i} {t['name']!r} has no counterpart: the model has "
                                     f"only {len(mine)} weights")
        if (t["dtype"], tuple(t["shape"])) != mine[i][1:]:
            raise ModelMismatchError(
                f"tensor #{i} does not match: the model has {mine[i][0]!r} {mine[i][1]}{list(mine[i][2])}, "
                f"checkpoint {name!r} v{ck.version} has {t['name']!r} {t['dtype']}{t['shape']}. "
                "Build the same architecture as the one that was trained.")
    model.set_weights(list(ck.arrays.values()))
    return ck.version, ck.step
