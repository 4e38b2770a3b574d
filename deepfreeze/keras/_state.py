"""The training state of a Keras model as a tensor list: one definition for every sink.

Checkpoints and clones list the same tensors in the same order: the model's weights
(``model.weights``: layer order, the forward pass's), then the optimizer's variables.
A tensor is *replicated* when every Horovod rank holds it bit-identical (trainable
weights and their optimizer slots: every rank applies the same all-reduced gradient);
the others (non-trainable weights such as BatchNormalization's moving statistics,
updated locally by each rank's forward pass, and optimizer variables that are not a
slot of one weight, e.g. the iteration counter) are *pinned*: taken whole from rank 0.

What is checkpointed, in this order: (1) ``model.weights`` (trainable and non-trainable, in the
order Keras lists them), named by :func:`deepfreeze.keras.state_loader.model_tensors` (the variable
name without ``:0``, ``_<n>`` appended to repeated names); (2) with ``save_optimizer=True`` (the
default) the optimizer's variables, ``optimizer.variables()`` in its order after
``optimizer.build(model.trainable_variables)`` (the callback builds it in ``on_train_begin``, so
the slots exist before the train step is traced), named ``optimizer/<name without :0>``: for SGD
with momentum ``optimizer/iteration`` and ``optimizer/m/<weight>`` per trainable weight, for Adam
also ``optimizer/v/<weight>``; a name already used gets ``_<n>``. The manifest's
``model_tensors`` says how many leading tensors are model weights (``Checkpoint.model_arrays()``
and ``optimizer_arrays()`` split there); with ``save_optimizer=False`` the list is the weights
alone. (The paper checkpoints the weights only; here the optimizer state travels in the same
checkpoint, sharded and captured the same way.) A *slot* is an optimizer variable whose shared
name is ``<slot>/<shared name of a trainable weight>`` and whose shape is that weight's
(momentum, Adam's ``m`` and ``v``): updated in the same ``_update_step`` as its weight, it is
captured in the graph right after that update and placed by the shard plan like any tensor.
Every other optimizer variable is pinned to rank 0 and read eagerly when the callback captures.

The version number of a checkpoint is the optimizer step (``optimizer.iterations``) after the
checkpointed batch, also its manifest's ``step``. Not checkpointed: random-number generator state
outside ``model.weights``, the input pipeline's position, metric accumulators and other callbacks'
state.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..format import dtype_name
from ..shardplan import TensorSpec
from .state_loader import model_tensors

__all__ = ["TrainState", "train_state"]


@dataclasses.dataclass
class TrainState:
    """``variables[i]`` is tensor ``specs[i]``; ``pinned``: ids taken whole from rank 0;
    ``slots``: id of a trainable weight -> ids of its optimizer slots (updated with it)."""

    variables: list
    specs: list[TensorSpec]
    pinned: list[int]
    slots: dict[int, list[int]]


def train_state(model: Any, optimizer: bool = True) -> TrainState:
    """The model's weights, then (with ``optimizer``) its optimizer's variables (built now,
    so slots exist before a train step is traced)."""
    weights = list(model.weights)
    named = model_tensors(model)
    variables = list(weights)
    pinned = [i for i, w in enumerate(weights) if not w.trainable]
    slots: dict[int, list[int]] = {}
    if optimizer:
        opt = model.optimizer
        opt.build(model.trainable_variables)
        owner_of = {w._shared_name: i for i, w in enumerate(weights) if w.trainable}
        for v in opt.variables():
            tid = len(variables)
            variables.append(v)
            name = v.name[:-2] if v.name.endswith(":0") else v.name
            named.append((f"optimizer/{name}", dtype_name(v.dtype.as_numpy_dtype), tuple(v.shape)))
            owner = owner_of.get(v._shared_name.split("/", 1)[-1])
            is_slot = owner is not None and tuple(v.shape) == tuple(weights[owner].shape) and "/" in v._shared_name
            if is_slot:
                slots.setdefault(owner, []).append(tid)
            else:
                pinned.append(tid)  # e.g. the iteration counter
    seen: dict[str, int] = {}
    specs = []
    for i, (n, d, shape) in enumerate(named):
        k = seen.get(n, 0)
        seen[n] = k + 1
        specs.append(TensorSpec(i, n if k == 0 else f"{n}_{k}", d, shape))
    return TrainState(variables, specs, pinned, slots)
