"""DeepFreeze in Hugging Face ``transformers.Trainer`` (imports transformers; ``deepfreeze.torch`` does not).

* :class:`DeepFreezeCallback` (a ``TrainerCallback``) builds a
  :class:`~deepfreeze.torch.Checkpointer` on every rank when training begins, over the model and
  the optimizer Trainer made (the torch optimizer inside accelerate's ``AcceleratedOptimizer``),
  with the LR scheduler, the GradScaler (fp16) and the Trainer's own state (``TrainerState``
  with ``TrainerControl``, as ``trainer_state.json`` text) as ``state=`` objects. It captures
  in the optimizer step (the Checkpointer's hooks) and calls
  :meth:`~deepfreeze.torch.Checkpointer.end_iteration` at every ``on_step_end`` (after
  ``optimizer.step()``, ``lr_scheduler.step()``, ``zero_grad()`` and ``global_step += 1``), so
  the state record of a checkpoint step is taken at that boundary. Version numbers are
  Trainer's ``global_step``.
* :func:`checkpoint_dir` (collective) makes, from a committed version, a ``checkpoint-<step>``
  directory in the layout Trainer's own resume reads (``model.safetensors``, ``optimizer.pt``,
  ``scheduler.pt``, ``scaler.pt`` when there was a GradScaler, ``trainer_state.json``, one
  ``rng_state_<rank>.pth`` per rank), for ``trainer.train(resume_from_checkpoint=...)``.

Nothing here reaches a hub: models and data are the caller's. FSDP (1 and 2) and DeepSpeed
under Trainer are refused with a :class:`~deepfreeze.errors.ConfigError` (see docs/torch-trainers.md,
"Hugging Face Trainer").
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import torch
from transformers import TrainerCallback

from .. import ownership
from ..config import Config, validate_name
from ..errors import (CheckpointNotFoundError, ConfigError, DeepFreezeError, ExistingCheckpointError,
                      ModelMismatchError, RanksFailedError)
from ..comm import allgather_failures
from ..export import atomic_output
from . import _state
from ._dist import make_comm, rank_and_size
from .checkpointer import Checkpointer
from .state_loader import TorchState, load_state, read_config

__all__ = ["DeepFreezeCallback", "checkpoint_dir", "TRAINER_STATE", "LR_SCHEDULER", "SCALER"]

log = logging.getLogger("deepfreeze")

#: ``state=`` keys the callback gives the Checkpointer (the names in the version's state records)
TRAINER_STATE, LR_SCHEDULER, SCALER = "hf_trainer_state", "hf_lr_scheduler", "hf_scaler"
_MARKER = "deepfreeze.json"  # in a directory checkpoint_dir made (and may therefore replace)


def _refuse_layout(args: Any) -> None:
    """ConfigError for the Trainer layouts DeepFreeze does not capture or resume: FSDP and DeepSpeed."""
    if getattr(args, "deepspeed", None) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true"):
        raise ConfigError("DeepFreezeCallback: Trainer runs DeepSpeed (TrainingArguments.deepspeed), whose ZeRO "
                          "stages own the optimizer state: DeepFreeze does not capture it. Train with DDP (no "
                          "deepspeed=) to use DeepFreeze, or keep DeepSpeed's own checkpoints")
    if getattr(args, "fsdp", None) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        raise ConfigError("DeepFreezeCallback: Trainer runs FSDP (TrainingArguments.fsdp / fsdp_config): "
                          "DeepFreeze refuses FSDP1 and does not yet make the sharded checkpoint layout Trainer's "
                          "FSDP resume reads. Train with DDP under Trainer, or use deepfreeze.torch.Checkpointer "
                          "in your own loop with fully_shard (FSDP2)")


def _torch_optimizer(opt: Any) -> torch.optim.Optimizer:
    """The torch optimizer whose ``step()`` runs (inside accelerate's ``AcceleratedOptimizer``,
    whose own ``step`` never runs an optimizer's hooks)."""
    seen = 0
    while hasattr(opt, "optimizer") and isinstance(opt.optimizer, torch.optim.Optimizer) and seen < 8:
        opt, seen = opt.optimizer, seen + 1
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError(f"DeepFreezeCallback: Trainer's optimizer is a {type(opt).__name__}, not a "
                          "torch.optim.Optimizer: DeepFreeze captures torch optimizers")
    return opt


class _TrainerStateful:
    """This rank's ``TrainerState`` (with ``TrainerControl``'s state among its stateful callbacks,
    as Trainer's ``_save_checkpoint`` updates it) as the text of Trainer's ``trainer_state.json``."""

    def __init__(self, state: Any, control: Any) -> None:
        self.trainer_state, self.control = state, control

    def state_dict(self) -> dict[str, str]:
        d = dataclasses.asdict(self.trainer_state)
        cbs = dict(d.get("stateful_callbacks") or {})
        if self.control is not None and hasattr(self.control, "state"):
            cbs[type(self.control).__name__] = self.control.state()
        d["stateful_callbacks"] = cbs
        return {"trainer_state": json.dumps(d, indent=2, sort_keys=True) + "\n"}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """A check, not a load: Trainer has read ``trainer_state.json`` of the same version
        (:func:`checkpoint_dir`); the version resumed must be at Trainer's ``global_step``."""
        try:
            step = int(json.loads(sd["trainer_state"])["global_step"])
        except (KeyError, TypeError, ValueError) as e:
            raise ModelMismatchError(f"the recorded Trainer state is unreadable: {type(e).__name__}: {e}") from e
        if step != int(self.trainer_state.global_step):
            raise ModelMismatchError(
                f"the DeepFreeze version this run continues was taken at global step {step}, but Trainer resumed at "
                f"step {self.trainer_state.global_step}: resume with trainer.train(resume_from_checkpoint="
                "deepfreeze.torch.hf.checkpoint_dir(...)) of the name's newest version, or give the callback a new "
                "name")


class DeepFreezeCallback(TrainerCallback):
    """DeepFreeze checkpoints of a ``transformers.Trainer`` run, captured in the optimizer step.

    Args:
      config: path of a VeloC INI file, a :class:`~deepfreeze.Config`, or None (keyword arguments; docs/configuration.md).
      name: checkpoint name (``[a-zA-Z0-9_.]+``).
      every_n_steps: checkpoint every N optimizer (update) steps; None: Trainer's ``save_steps``
        (``TrainerState.save_steps``, ``args.save_steps`` made absolute).
      **checkpointer_kwargs: passed to :class:`~deepfreeze.torch.Checkpointer` (``overlap``,
        ``on_error``, ``engine``, INI keys such as ``scratch=``/``persistent=`` ...); not
        ``resume``/``overwrite``/``state``/``start_step``, which the callback sets.

    The Checkpointer is built collectively in ``on_train_begin`` (every rank), continuing at
    Trainer's ``global_step`` (a run resumed through :func:`checkpoint_dir` continues the
    name's versions), and closed in ``on_train_end``; :attr:`checkpointer` is it meanwhile.
    """

    def __init__(self, config: "str | Config | None" = None, name: str = "model", *,
                 every_n_steps: int | None = None, **checkpointer_kwargs: Any) -> None:
        bad = sorted(set(checkpointer_kwargs) & {"resume", "overwrite", "state", "start_step", "model", "optimizer"})
        if bad:
            raise ConfigError(f"DeepFreezeCallback: {', '.join(bad)} cannot be given: the callback sets them (resume "
                              "through trainer.train(resume_from_checkpoint=deepfreeze.torch.hf.checkpoint_dir(...)))")
        if every_n_steps is not None and (not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool)
                                          or every_n_steps < 1):
            raise ConfigError(f"every_n_steps = {every_n_steps!r}: use a positive integer, or None for Trainer's "
                              "save_steps")
        self.config, self.name = config, validate_name(name)
        self.every_n_steps = every_n_steps
        self.kwargs = checkpointer_kwargs
        #: the Checkpointer while training runs (None before on_train_begin and after on_train_end)
        self.checkpointer: Checkpointer | None = None

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _refuse_layout(args)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        _refuse_layout(args)
        if self.checkpointer is not None:  # a second train() call on the same Trainer
            self.checkpointer.close()
            self.checkpointer = None
        if model is None or optimizer is None:
            raise ConfigError("DeepFreezeCallback: Trainer passed no model or optimizer to on_train_begin: attach the "
                              "callback to a transformers.Trainer (Trainer(..., callbacks=[cb]))")
        every = self.every_n_steps or int(getattr(state, "save_steps", 0) or 0) or None
        if every is None:
            raise ConfigError("DeepFreezeCallback: no checkpoint interval: give every_n_steps=N, or save_steps in "
                              "TrainingArguments")
        opt = _torch_optimizer(optimizer)
        objects: dict[str, Any] = {TRAINER_STATE: _TrainerStateful(state, control)}
        if lr_scheduler is not None and callable(getattr(lr_scheduler, "state_dict", None)):
            objects[LR_SCHEDULER] = lr_scheduler
        scaler = getattr(optimizer, "scaler", None)  # AcceleratedOptimizer's GradScaler (fp16)
        if scaler is not None:
            objects[SCALER] = scaler
        step = int(state.global_step)
        # A resumed Trainer (global_step > 0) continues the name: resume=True takes the newest version every
        # rank can recover (the one checkpoint_dir made the directory from: the same bytes Trainer loaded) and
        # checks it is at global_step (_TrainerStateful.load_state_dict); a name with no version starts there
        # (start_step: a Trainer resumed from its own checkpoint).
        ck = Checkpointer(model, opt, self.config, self.name, every_n_steps=every, resume=step > 0,
                          start_step=step, state=objects, **self.kwargs)
        if ck.start_step != step:
            ck.close()
            raise ModelMismatchError(f"DeepFreezeCallback: {self.name!r} continues at step {ck.start_step}, Trainer "
                                     f"at global step {step}: resume through deepfreeze.torch.hf.checkpoint_dir(...) "
                                     "of the name's newest version, or give the callback a new name")
        self.checkpointer = ck

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ck = self.checkpointer
        if ck is not None:
            if ck.step != state.global_step:  # a step fp16's GradScaler skipped: Trainer counted it, no hook ran
                ck.step = int(state.global_step)  # versions stay Trainer's global_step
            ck.end_iteration()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ck, self.checkpointer = self.checkpointer, None
        if ck is not None:
            ck.close()


# ---------------------------------------------------------------------------- resume


def _saved(rec: dict[str, Any]) -> tuple[dict[str, Any], "dict[str, Any] | None"]:
    """The ``state=`` objects and the RNG states in a rank's state record."""
    return {**rec.get("a", {}).get("state", {}), **rec.get("state", {})}, rec.get("a", {}).get("rng", rec.get("rng"))


def _trainer_files(st: TorchState) -> dict[str, Any]:
    """What rank 0 writes: {file name: (kind, payload)} for a version the callback wrote."""
    where = f"checkpoint {st.name!r} v{st.version}"
    saved, _ = _saved(st.records[0] if st.records else {})
    if TRAINER_STATE not in saved:
        raise ModelMismatchError(f"{where} was not written by deepfreeze.torch.hf.DeepFreezeCallback (its state "
                                 f"records hold {sorted(saved)}, no {TRAINER_STATE!r}): a Trainer cannot resume from "
                                 "it; use deepfreeze.torch.restore in your own loop")
    _state.check_recorded_groups(st.records[0], where)  # a damaged lr must not wait for Trainer's first step
    groups = st.records[0].get("param_groups", [])
    if len(groups) != 1:
        raise ModelMismatchError(f"{where} holds {len(groups)} optimizers; Trainer has one")
    order = [fqn for g in groups[0] for fqn in g["params"]]
    index = {fqn: i for i, fqn in enumerate(order)}
    optim = {"state": {index[fqn]: dict(kv) for fqn, kv in st.optim["state"].items() if fqn in index},
             "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                               "params": [index[f] for f in g["params"]]} for g in groups[0]]}
    model: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    for fqn, t in st.model.items():  # one copy of a tensor stored under several names (save_pretrained's rule)
        same = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if t.numel() and same in seen:
            continue
        seen.add(same)
        model[fqn] = t.contiguous()
    out = {"model.safetensors": ("safetensors", model), "optimizer.pt": ("torch", optim),
           "trainer_state.json": ("text", saved[TRAINER_STATE]["trainer_state"])}
    if LR_SCHEDULER in saved:
        out["scheduler.pt"] = ("torch", saved[LR_SCHEDULER])
    if SCALER in saved:
        out["scaler.pt"] = ("torch", saved[SCALER])
    out[_MARKER] = ("text", json.dumps({"name": st.name, "version": st.version, "step": st.step,
                                        "world_size": st.world_size, "level": st.level}) + "\n")
    return out


def _rng_file(rng: dict[str, Any]) -> dict[str, Any]:
    """A state record's RNG states as Trainer's ``_save_rng_state`` writes them."""
    out = {"python": rng["python"], "numpy": rng["numpy"], "cpu": rng["torch"]}
    if rng.get("cuda"):
        out["cuda"] = list(rng["cuda"])
    return out


def _write(path: str, kind: str, payload: Any) -> None:
    if kind == "safetensors":
        from safetensors.torch import save_file
        atomic_output(path, False, lambda tmp: save_file(payload, tmp, metadata={"format": "pt"}))
    elif kind == "torch":
        atomic_output(path, False, lambda tmp: torch.save(payload, tmp))
    else:
        def text(tmp: str) -> None:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(payload)
        atomic_output(path, False, text)


def _agree(comm: Any, error: "BaseException | None", what: str) -> None:
    """Every rank raises when any rank failed (collective, one all-gather of typed error records,
    :func:`deepfreeze.comm.allgather_failures`): the first failure's DeepFreeze error class
    (ConfigError for another exception), naming every failed rank, the ranks' errors its cause."""
    failures = allgather_failures(comm, error)
    if failures:
        first = next(iter(failures.values()))
        cls = type(first) if type(first) is not DeepFreezeError else ConfigError
        raise cls(f"checkpoint_dir: {what}: " + "; ".join(f"rank {r}: {e}" for r, e in failures.items())) \
            from RanksFailedError.of(failures)


def checkpoint_dir(config: "str | Config | None" = None, *, name: str, output_dir: str, version: int | None = None,
                   trust_owners: "list[str | int] | None" = None, **overrides: Any) -> "str | None":
    """Make ``<output_dir>/checkpoint-<step>`` from the newest committed version of ``name`` (or
    ``version``) in the layout ``trainer.train(resume_from_checkpoint=...)`` reads, and return its
    path; None when ``version`` is None and ``name`` has no committed version (train from scratch).

    Collective under ``torch.distributed`` (call it on every rank after building
    ``TrainingArguments``, which starts the process group): the version is read once, pooled
    (every rank's scratch, partner copies, parity, then persistent); rank 0 writes the shared
    files and each rank its ``rng_state_<rank>.pth`` (at the version's world size; at another,
    none, and Trainer resumes without them), each under a temporary name renamed into place, in
    a temporary directory renamed to ``checkpoint-<step>`` at the end. ``output_dir`` must be
    seen by every rank (as Trainer's own). An existing ``checkpoint-<step>`` made by this
    function is replaced (the old one, or a link in its place, removed without following a link);
    any other is refused (:class:`~deepfreeze.errors.ExistingCheckpointError`).

    ``output_dir`` (or, when missing, its nearest existing parent) must follow the roots' rule
    (:func:`deepfreeze.ownership.check_output_dir`: owned by you or root, writable by nobody else
    unless sticky or, with ``shared_group = true``, group-writable): else every rank raises
    :class:`~deepfreeze.errors.UnsafePathError` before anything is read or written (another user
    owning it could swap the checkpoint Trainer resumes from). A missing ``output_dir`` is created
    ``0700``.
    """
    validate_name(name)
    rank, size = rank_and_size()
    comm = make_comm()
    try:
        err: BaseException | None = None
        if rank == 0:  # the output directory first: nothing is read or written for a directory of another user
            try:
                shared = read_config(config, **overrides).shared_group
                ownership.check_output_dir(output_dir, what=f"checkpoint_dir(output_dir={output_dir!r})",
                                           shared_group=shared, create=True)
            except Exception as e:  # reported on every rank (none is left waiting)
                err = e
        _agree(comm, err, f"the output directory {os.path.abspath(output_dir)}")
        try:
            st = load_state(config, name=name, version=version, comm=comm, trust_owners=trust_owners, **overrides)
        except CheckpointNotFoundError as e:
            if version is not None:
                raise
            if rank == 0:
                log.warning("DeepFreeze: no committed version of %r (%s): Trainer starts from scratch", name, e)
            return None
        final = os.path.join(os.path.abspath(output_dir), f"checkpoint-{st.step}")
        tmp = f"{final}.deepfreeze-tmp-{os.getpid()}"  # rank 0's pid: every rank gets rank 0's name below
        err = None
        if rank == 0:
            try:
                if os.path.lexists(final) and not os.path.isfile(os.path.join(final, _MARKER)):
                    raise ExistingCheckpointError(f"{final} exists and was not made by checkpoint_dir (Trainer's own "
                                                  "checkpoint?): give another output_dir (a directory of its own)")
                files = _trainer_files(st)
                ownership.remove_tree_nofollow(tmp)  # a leftover of this pid's earlier call; a link only unlinked
                ownership.ensure_dir(tmp, os.path.dirname(final), site="hf.checkpoint_dir")  # 0700, checked
                for fname, (kind, payload) in files.items():
                    _write(os.path.join(tmp, fname), kind, payload)
            except Exception as e:  # any failure: reported on every rank (none is left waiting)
                err = e
        try:
            _agree(comm, err, f"v{st.version} into {final}")
            tmp = comm.allgather(tmp.encode() if rank == 0 else b"")[0].decode()
            err = None
            try:
                if size == st.world_size and rank < len(st.records):
                    _, rng = _saved(st.records[rank])
                    if rng is not None:
                        fname = f"rng_state_{rank}.pth" if size > 1 else "rng_state.pth"
                        _write(os.path.join(tmp, fname), "torch", _rng_file(rng))
                elif rank == 0:
                    log.warning("DeepFreeze: %r v%d was written by %d ranks, this job has %d: no RNG files (Trainer "
                                "resumes without them)", name, st.version, st.world_size, size)
            except Exception as e:
                err = OSError(f"{e} (output_dir must be a directory every rank sees)")
            _agree(comm, err, f"the RNG files of v{st.version} in {tmp}")
            if rank == 0:
                try:
                    if os.path.lexists(final):  # made by checkpoint_dir before (checked above): replaced
                        old = f"{final}.deepfreeze-old-{os.getpid()}"
                        os.rename(final, old)
                        ownership.remove_tree_nofollow(old)  # a link renamed aside is removed, never followed
                    os.rename(tmp, final)
                    fd = os.open(os.path.dirname(final), os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                except Exception as e:
                    err = e
            _agree(comm, err, f"renaming {tmp} to {final}")
        except BaseException:
            if rank == 0:
                try:
                    ownership.remove_tree_nofollow(tmp)
                except OSError:
                    pass
            raise
        if rank == 0:
            log.warning("DeepFreeze: %s made from %r v%d (%s)", final, name, st.version, st.level)
        return final
    finally:
        if hasattr(comm, "close"):
            comm.close()
