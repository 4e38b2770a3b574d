"""Restore a committed version into a Keras model (the TensorFlow side of restore).

:func:`apply_checkpoint` is the one function both ``deepfreeze.restore`` (weights only) and
``resume=True`` (weights and optimizer state) use. The model is matched by position, dtype and
shape (not by name) against the first ``model_tensors`` tensors of the manifest; a difference
raises :class:`~deepfreeze.errors.ModelMismatchError` naming the first mismatching tensor. With
``optimizer=True`` it then calls ``optimizer.build(model.trainable_variables)``, matches
``optimizer.variables()`` against the remaining tensors the same way (the weights are already
set then) and assigns them by position; it returns whether optimizer state was restored (False
when not asked or when the checkpoint has none). Restore needs no MPI (without a communicator)
and works at any world size: the manifest's plan says where every piece is.
"""
from __future__ import annotations

import logging
import re
from typing import Any

from ..config import Config
from ..errors import ConfigError, ModelMismatchError
from ..format import dtype_name
from ..loader import Checkpoint, apply_loaded

__all__ = ["restore_model", "apply_checkpoint", "model_tensors", "build_from_spec"]

log = logging.getLogger("deepfreeze")


def model_tensors(model: Any) -> list[tuple[str, str, tuple[int, ...]]]:
    """(stable name, dtype, shape) of every weight of ``model``, in ``get_weights()`` order."""
    out, seen = [], {}
    for w in model.weights:
        name = w.name[:-2] if w.name.endswith(":0") else w.name
        n = seen.get(name, 0)
        seen[name] = n + 1
        out.append((name if n == 0 else f"{name}_{n}", dtype_name(w.dtype.as_numpy_dtype), tuple(w.shape)))
    return out


def build_from_spec(model: Any, spec: Any, who: str = "DeepFreezeCheckpoint", *,
                    what: str = "the input shape", when: str = "first") -> None:
    """Build an unbuilt ``model`` from the shape of the data it will be fit on: ``spec`` is a
    ``tf.data.Dataset``, an iterator or anything with an ``element_spec``, or an element spec
    itself (``(x, y)``, ``(x, y, sample_weight)`` or ``x``: ``tf.TensorSpec`` structures), or a
    bare shape such as ``(None, 28, 28)``. Nothing is drawn from the data. The one way DeepFreeze
    builds a model (the checkpoint and clone callbacks at the first step, ``receive_clone``,
    ``restore`` and ``ModelSubscriber`` with ``input_spec=``). ``who``/``what``/``when`` word the
    :class:`ConfigError` raised when the model cannot be built from it."""
    import tensorflow as tf
    if model.built and model.weights:  # built already (e.g. by another callback's first-step set-up)
        return
    spec = getattr(spec, "element_spec", spec)
    if isinstance(spec, tf.TensorShape) or isinstance(spec, (tuple, list)) and spec and \
            all(d is None or isinstance(d, int) and not isinstance(d, bool) for d in spec):
        spec = tf.TensorSpec(tf.TensorShape(spec))  # a bare shape
    if spec is None:
        raise ConfigError(f"{who}: the model is not built and fit's input does not tell its shape: give the model "
                          "an Input layer or call model.build(...) before fit")
    x, _, _ = tf.keras.utils.unpack_x_y_sample_weight(spec)
    try:
        shapes = tf.nest.map_structure(lambda t: t.shape, x)
        model.build(shapes)
    except Exception as e:  # Keras raises several kinds here
        raise ConfigError(f"{who}: building the model from {what} {x} failed ({type(e).__name__}: {e}): "
                          f"give the model an Input layer or call model.build(...) {when}") from e
    if not model.built or not model.weights:
        raise ConfigError(f"{who}: the model has no weights after model.build({shapes}): give it an Input layer "
                          f"or call it on a batch {when}")


def restore_model(model: Any, config: "str | Config | None" = None, *, name: str,
                  version: int | None = None, trust_owners: "list[str | int] | None" = None,
                  input_spec: Any = None, **overrides: Any) -> tuple[int, int]:
    """Load a committed version's weights into ``model`` (bit-exact); returns ``(version, step)``.
    ``trust_owners``: also read persistent files of these users (:func:`deepfreeze.loader.load`).
    ``input_spec``: builds an unbuilt model first (a dataset or its element spec, see
    :func:`build_from_spec`)."""
    from ._dist import mpi_comm
    cfg = Config.resolve(config, **overrides)
    if input_spec is not None and (not getattr(model, "built", True) or not model.weights):
        build_from_spec(model, input_spec, "restore")
    def apply(ck: Checkpoint) -> tuple[int, int]:
        apply_checkpoint(model, ck)  # memory-tier slots: straight from the slot into the variables
        return ck.version, ck.step
    return apply_loaded(cfg, name, version, apply, comm=mpi_comm(), trust_owners=trust_owners)


def apply_checkpoint(model: Any, ck: Checkpoint, *, optimizer: bool = False) -> bool:
    """Put ``ck``'s weights into ``model`` (and, with ``optimizer``, its optimizer state).

    Returns True if optimizer state was restored (False: the checkpoint has none).
    Raises :class:`ModelMismatchError` naming the first tensor that does not match.
    """
    if not getattr(model, "built", True) or not model.weights:
        raise ModelMismatchError("the model has no weights yet: build it (call it on an input or "
                                 "give it an Input layer) before restoring, or pass input_spec=<the dataset "
                                 "or its element_spec> to restore")
    tensors = ck.manifest["tensors"][:ck.model_tensors]
    mine = model_tensors(model)
    _check(mine, tensors, ck, "model")
    _warn_renamed(mine, tensors, ck)
    model.set_weights(list(ck.model_arrays().values()))  # memory-tier slots: views of the slot, no copy before
    saved = ck.optimizer_arrays()
    if not optimizer or not saved:
        return False
    opt = model.optimizer
    opt.build(model.trainable_variables)
    mine = [(v.name, dtype_name(v.dtype.as_numpy_dtype), tuple(v.shape)) for v in opt.variables()]
    _check(mine, ck.manifest["tensors"][ck.model_tensors:], ck, "optimizer")
    for v, a in zip(opt.variables(), saved.values()):
        v.assign(a)
    return True


def _check(mine: list[tuple[str, str, tuple[int, ...]]], tensors: list[dict], ck: Checkpoint, what: str) -> None:
    for i in range(max(len(mine), len(tensors))):
        if i >= len(tensors):
            raise ModelMismatchError(f"{what} tensor #{i} {mine[i][0]!r} {mine[i][1]}{list(mine[i][2])} is not in "
                                     f"checkpoint {ck.name!r} v{ck.version}, which holds {len(tensors)} {what} tensors")
        t = tensors[i]
        if i >= len(mine):
            raise ModelMismatchError(f"checkpoint {what} tensor #{i} {t['name']!r} has no counterpart: there are "
                                     f"only {len(mine)}")
        if (t["dtype"], tuple(t["shape"])) != mine[i][1:]:
            raise ModelMismatchError(
                f"{what} tensor #{i} does not match: the model has {mine[i][0]!r} {mine[i][1]}{list(mine[i][2])}, "
                f"checkpoint {ck.name!r} v{ck.version} has {t['name']!r} {t['dtype']}{t['shape']}. "
                "Build the same architecture (and optimizer) as the one that was trained.")


def _warn_renamed(mine: list[tuple[str, str, tuple[int, ...]]], tensors: list[dict], ck: Checkpoint) -> None:
    """One warning (rank 0) when dtypes and shapes match but tensor names differ: weights are
    matched by position, so a reordered model of the same shapes would get the wrong tensors.
    Keras' automatic numbering (``dense`` built again in one process is ``dense_1``) is not a
    difference."""
    diff = [(m[0], t["name"]) for m, t in zip(mine, tensors) if _base(m[0]) != _base(str(t["name"]))]
    if not diff:
        return
    from ._dist import rank_and_size
    if rank_and_size()[0] == 0:
        log.warning("DeepFreeze: %d of %d tensor names of the model differ from checkpoint %r v%d (first: model %r, "
                    "checkpoint %r); shapes and dtypes match and weights are restored by position: check that "
                    "this is the architecture that was trained", len(diff), len(mine), ck.name, ck.version,
                    diff[0][0], diff[0][1])


_KERAS_NUMBER = re.compile(r"_\d+(?=/|$)")


def _base(name: str) -> str:
    """``name`` without Keras' uniquifying suffixes: ``sequential_3/dense_1/kernel`` -> ``sequential/dense/kernel``."""
    return _KERAS_NUMBER.sub("", name)
