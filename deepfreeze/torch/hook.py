"""One step hook, many sinks: the capture points of a PyTorch training loop.

A :class:`StepHook` registers, once per model and optimizer list, the hooks every consumer of the
train step's state needs: a step pre-hook on every optimizer, a step post-hook on the last one (the
one the loop steps last: its steps are counted) and a forward pre-hook on the model. Consumers are
:class:`Sink` objects subscribed to it (:meth:`StepHook.subscribe`): the
:class:`~deepfreeze.torch.Checkpointer` and the live capture of a clone server
(:class:`deepfreeze.torch.capture.LiveCapture`) share the same capture points (:func:`hook_for`
returns the hook already on a model and its optimizers). The hook is removed from
the model and the optimizers when its last sink unsubscribes (the counterpart of
:mod:`deepfreeze.keras.hook`).

Each sink sees, in the order it subscribed:

* :meth:`Sink.before_step` ``(optimizer, args, kwargs)`` before any optimizer's ``step()``; it may
  return new ``(args, kwargs)`` (e.g. a wrapped ``closure``), which the next sink and the optimizer
  receive (the hooks' contract of ``register_step_pre_hook``);
* :meth:`Sink.after_step` ``(optimizer)`` after the last optimizer's ``step()``;
* :meth:`Sink.before_forward` ``(module, args)`` before the model's forward.
"""
from __future__ import annotations

from typing import Any, Sequence

__all__ = ["Sink", "StepHook", "hook_for", "sinks_of"]


class Sink:
    """A consumer of the train step's capture points (override what you need)."""

    def before_step(self, optimizer: Any, args: Any, kwargs: Any) -> "tuple[Any, Any] | None":
        return None

    def after_step(self, optimizer: Any) -> None:
        pass

    def before_forward(self, module: Any, args: Any) -> None:
        pass


class StepHook:
    """The torch hooks on ``model`` and ``optimizers`` (in the order the loop steps them), shared by
    every subscribed :class:`Sink`; build it with :func:`hook_for`."""

    def __init__(self, model: Any, optimizers: Sequence[Any]) -> None:
        self.model, self.optimizers = model, list(optimizers)
        self.sinks: list[Sink] = []
        self._handles: list[Any] = []

    def subscribe(self, sink: Sink) -> None:
        """Add ``sink`` (its callbacks run after those of the sinks already subscribed); the torch
        hooks are registered with the first sink."""
        if sink in self.sinks:
            return
        self.sinks.append(sink)
        if not self._handles:
            for opt in self.optimizers:
                self._handles.append(opt.register_step_pre_hook(self._pre_hook))
            self._handles.append(self.optimizers[-1].register_step_post_hook(self._post_hook))
            self._handles.append(self.model.register_forward_pre_hook(self._forward_hook))

    def unsubscribe(self, sink: Sink) -> None:
        """Remove ``sink``; with the last one, the torch hooks are removed too."""
        if sink in self.sinks:
            self.sinks.remove(sink)
        if not self.sinks:
            for h in self._handles:
                h.remove()
            self._handles = []
            _release(self)

    def _pre_hook(self, opt: Any, args: Any, kwargs: Any) -> Any:
        changed = False
        for sink in list(self.sinks):
            out = sink.before_step(opt, args, kwargs)
            if out is not None:
                args, kwargs = out
                changed = True
        return (args, kwargs) if changed else None

    def _post_hook(self, opt: Any, args: Any, kwargs: Any) -> None:
        for sink in list(self.sinks):
            sink.after_step(opt)

    def _forward_hook(self, module: Any, args: Any) -> None:
        for sink in list(self.sinks):
            sink.before_forward(module, args)


_ATTR = "_deepfreeze_step_hooks"  # on the model: its hooks live and die with it


def hook_for(model: Any, optimizers: Sequence[Any]) -> StepHook:
    """The :class:`StepHook` on ``model`` and ``optimizers`` (the same objects, in the same order),
    made the first time; later callers share it, so one capture point serves every sink."""
    hooks = model.__dict__.setdefault(_ATTR, [])  # not a Module attribute: outside state_dict and children
    for h in hooks:
        if len(h.optimizers) == len(optimizers) and all(a is b for a, b in zip(h.optimizers, optimizers)):
            return h
    h = StepHook(model, optimizers)
    hooks.append(h)
    return h


def sinks_of(model: Any) -> list[Sink]:
    """The sinks subscribed to any :class:`StepHook` on ``model`` (none made here)."""
    return [s for h in model.__dict__.get(_ATTR, []) for s in h.sinks]


def _release(hook: StepHook) -> None:
    hooks = hook.model.__dict__.get(_ATTR)
    if hooks is not None and hook in hooks:
        hooks.remove(hook)
