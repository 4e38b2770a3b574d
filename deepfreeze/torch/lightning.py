"""DeepFreeze in a PyTorch Lightning ``Trainer``: one callback, no change to the LightningModule.

    from deepfreeze.torch.lightning import DeepFreezeCallback
    cb = DeepFreezeCallback(config="veloc_cfg/local.cfg", name="gpt", every_n_train_steps=50, resume=True)
    trainer = pl.Trainer(strategy="ddp", callbacks=[cb], ...)
    trainer.fit(model, datamodule)

Imports ``pytorch_lightning`` (the ``pytorch-lightning`` package, 2.6.6 in ``scripts/setup.sh``);
``import deepfreeze.torch`` does not import this module.

* **Capture.** When fit starts (``on_fit_start``: after the strategy wrapped the model in DDP and
  built the optimizers), every rank builds a :class:`~deepfreeze.torch.Checkpointer` on the
  wrapped model and ``trainer.optimizers`` with ``every_n_steps=every_n_train_steps``: the
  tensors are captured in the optimizer step by its hooks, as in a plain loop. At every
  ``on_train_batch_end`` (after the optimizer step, the step-interval LR schedulers and Lightning's
  own batch bookkeeping, where Lightning's ``ModelCheckpoint`` saves too) the callback calls
  ``Checkpointer.end_iteration()``: the state record of a checkpoint step is taken there.
* **What the state record holds for Lightning** (the ``state=`` object ``"lightning"``): the
  parts of Lightning's own checkpoint dict that are not tensors of the model or the optimizers:
  ``loops`` (``fit_loop.state_dict()``: epoch, global step, batch within the epoch, and the
  state of every stateful data loader, e.g. torchdata's ``StatefulDataLoader``),
  ``lr_schedulers``, ``callbacks`` (every other callback's ``state_dict()``), the precision
  plugin's state (GradScaler), the datamodule's ``state_dict()``, ``epoch``/``global_step``, and
  the torch/numpy/Python RNG states taken at the same boundary. No pickling: values are what
  :mod:`deepfreeze.torch._state` encodes (numbers, strings, lists, dicts, tensors, arrays).
* **Resume** (``resume=True``, collective, every rank): the checkpointer loads the newest version
  every rank can recover and puts it into the model and the optimizers (bit-exact); the
  Lightning part goes back through Lightning's own ``load_state_dict`` methods, in the order of
  ``Trainer``'s restore of a checkpoint file: precision plugin, ``fit_loop`` (Lightning then
  resumes mid-epoch itself: it fast-forwards its progress counters and a stateful loader), LR
  schedulers, callbacks, datamodule (the schedulers' and the precision GradScaler's saved states
  are kind-checked with the checkpointer's other checks, before anything is set:
  :func:`deepfreeze.torch._state.check_stateful`). A version taken at the last batch of an epoch
  is resumed without the loader's position (see ``_restore``). Do not also pass ``ckpt_path`` to
  ``fit``: that is a :class:`~deepfreeze.errors.ConfigError`.
* **The train iterator, made again at** ``on_train_start`` **after a resume** (``_remake_iterator``):
  Lightning (2.6.6) makes it before it sets the samplers' epoch, and a ``StatefulDataLoader``
  (torchdata 0.11) with workers, or a plain ``DistributedSampler``, computes the permutation when
  the iterator is made: the resumed epoch (the rest of it, or the next one after a version taken at
  an epoch's last batch) would be shuffled as epoch 0. The callback sets every
  train sampler's epoch, loads the restored loader states again and makes the iterator again
  (the workers restart once); a loader with workers whose sampler stays at another epoch is a
  :class:`~deepfreeze.errors.ConfigError`. The RNG states of the boundary are set around it, so
  the next draw is the uninterrupted run's. Warned about: a mid-epoch resume over Lightning's
  ``DistributedSamplerWrapper`` (its wrapped sampler is in no saved state), and, once per fit at
  the first checkpoint, a loader with workers over a dataset without ``state_dict()`` (what the
  workers draw from their global RNGs is in no checkpoint; a ``torch.Generator`` the dataset keeps
  in its ``state_dict()`` is exact: ``StatefulDataLoader`` saves each worker's dataset state).
* **Refused** when the callback is set up (``setup``, before anything is loaded or captured), with
  a :class:`~deepfreeze.errors.ConfigError`: ``FSDPStrategy`` (FSDP1: flat parameters DeepFreeze
  does not capture; FSDP2 through a plain module sharded with ``fully_shard`` is what the
  checkpointer takes) and ``DeepSpeedStrategy`` (ZeRO partitions the optimizer state itself).
"""
from __future__ import annotations

import copy
import logging
from typing import Any

try:
    import pytorch_lightning as pl
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("deepfreeze.torch.lightning needs PyTorch Lightning: pip install 'pytorch-lightning==2.6.6' "
                      "(scripts/setup.sh installs it)") from e

from ..errors import ConfigError, ModelMismatchError
from . import _state
from .checkpointer import Checkpointer

__all__ = ["DeepFreezeCallback", "check_strategy"]

log = logging.getLogger("deepfreeze")
STATE_KEY = "lightning"  # the key of Lightning's state among the checkpointer's state= objects


def check_strategy(strategy: Any) -> None:
    """Raise a :class:`~deepfreeze.errors.ConfigError` for a Lightning strategy DeepFreeze does not
    capture (``FSDPStrategy``: FSDP1; ``DeepSpeedStrategy``); called by the callback's ``setup``."""
    from pytorch_lightning.strategies import DeepSpeedStrategy, FSDPStrategy
    if isinstance(strategy, DeepSpeedStrategy):
        raise ConfigError("DeepFreezeCallback: DeepSpeedStrategy is not supported (ZeRO partitions and saves the "
                          "optimizer state itself): use strategy='ddp', or DeepSpeed's own checkpoints")
    if isinstance(strategy, FSDPStrategy):
        raise ConfigError("DeepFreezeCallback: FSDPStrategy (FSDP1, flat parameters) is not supported: use "
                          "strategy='ddp', or shard the model with FSDP2's fully_shard (which deepfreeze.torch."
                          "Checkpointer takes in a plain loop)")


def _train_loaders(trainer: "pl.Trainer") -> list[Any]:
    """The fit's train loaders as Lightning iterates them (``FitLoop._combined_loader.flattened``)."""
    combined = trainer.fit_loop._combined_loader
    return list(combined.flattened) if combined is not None else []


def _samplers(dl: Any) -> list[Any]:
    """A loader's samplers whose epoch Lightning sets (``lightning_fabric``'s ``_set_sampler_epoch``
    looks at the same two): ``dl.sampler`` and ``dl.batch_sampler.sampler``, each once."""
    found: dict[int, Any] = {}
    for s in (getattr(dl, "sampler", None), getattr(getattr(dl, "batch_sampler", None), "sampler", None)):
        if s is not None:
            found.setdefault(id(s), s)
    return list(found.values())


def _set_epoch(trainer: "pl.Trainer", epoch: int) -> None:
    """``set_epoch(epoch)`` on every train sampler that has it; a :class:`~deepfreeze.errors.ConfigError`
    where a loader with workers still has a sampler whose ``epoch`` is another one (its workers would
    be handed that epoch's permutation)."""
    for dl in _train_loaders(trainer):
        for s in _samplers(dl):
            if callable(getattr(s, "set_epoch", None)):
                s.set_epoch(epoch)
            got = getattr(s, "epoch", None)
            if (getattr(dl, "num_workers", 0) or 0) > 0 and isinstance(got, int) and got != epoch:
                raise ConfigError(
                    f"DeepFreezeCallback: the train loader's sampler {_state.class_name(s)} is at epoch {got} after "
                    f"set_epoch({epoch}) on the resumed epoch {epoch}: its {dl.num_workers} workers would be handed "
                    f"epoch {got}'s permutation for the rest of the epoch. Set the epoch where the loader is made, in "
                    "train_dataloader(): sampler.set_epoch(self.current_epoch) before the loader is returned (on a "
                    "mid-epoch resume current_epoch is the resumed epoch there), or give the loader a sampler whose "
                    "set_epoch() takes effect")


def _warn_wrapped_sampler(trainer: "pl.Trainer") -> None:
    """A warning per train loader whose sampler is Lightning's ``DistributedSamplerWrapper``, on a
    mid-epoch resume: the sampler it wraps (torchdata's ``RandomSampler`` for
    ``StatefulDataLoader(shuffle=True)``) is not in the loader's saved state and draws its
    permutation when the iterator is made, from the RNG of that moment, not the interrupted epoch's."""
    from lightning_fabric.utilities.distributed import DistributedSamplerWrapper
    for dl in _train_loaders(trainer):
        if any(isinstance(s, DistributedSamplerWrapper) for s in _samplers(dl)):
            log.warning("DeepFreeze: the resumed epoch %d's train loader samples through Lightning's "
                        "DistributedSamplerWrapper (use_distributed_sampler=True over a sampler other than torch's "
                        "RandomSampler/SequentialSampler, e.g. StatefulDataLoader(shuffle=True)): the sampler it "
                        "wraps is not in the loader's saved state, so a shuffling one gives the rest of the epoch "
                        "another permutation. Exact: torchdata's StatefulDistributedSampler and "
                        "Trainer(use_distributed_sampler=False)", trainer.fit_loop.epoch_progress.current.processed)


def _warn_worker_rng(trainer: "pl.Trainer") -> None:
    """One warning (at a fit's first checkpoint) per train loader with workers whose dataset has no
    ``state_dict()``: what its workers draw from their global RNGs is in no checkpoint."""
    for dl in _train_loaders(trainer):
        n, ds = getattr(dl, "num_workers", 0) or 0, getattr(dl, "dataset", None)
        if n > 0 and ds is not None and not callable(getattr(ds, "state_dict", None)):
            log.warning("DeepFreeze: the train loader has num_workers=%d and its dataset (%s) has no state_dict(): "
                        "random augmentation drawn in the workers (torch.rand, numpy, random in __getitem__) comes "
                        "from the workers' global RNGs, which no checkpoint holds, so a resumed run draws other "
                        "values. Exact: draw from a torch.Generator the dataset keeps in state_dict()/"
                        "load_state_dict() (StatefulDataLoader saves each worker's dataset state); nothing to do "
                        "if __getitem__ draws nothing", n, _state.class_name(ds))


class _LightningState:
    """The ``state=`` object that carries Lightning's own state through the checkpointer (a Stateful)."""

    def __init__(self, trainer: "pl.Trainer", owner: "DeepFreezeCallback") -> None:
        self.trainer, self.owner = trainer, owner
        self.loaded: "dict[str, Any] | None" = None
        self.warned = False  # the workers' RNG warning: once per fit

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        if not self.warned:
            self.warned = True
            _warn_worker_rng(t)
        d: dict[str, Any] = {
            "pytorch-lightning_version": pl.__version__,
            "epoch": t.current_epoch,
            "global_step": t.global_step,
            "loops": {"fit_loop": t.fit_loop.state_dict()},
            "lr_schedulers": [c.scheduler.state_dict() for c in t.lr_scheduler_configs],
            "callbacks": {cb.state_key: sd for cb in t.callbacks if cb is not self.owner and (sd := cb.state_dict())},
            "rng": _state.rng_state(),
        }
        prec = t.precision_plugin.state_dict()
        if prec:
            d["precision"] = prec
        dm = t.datamodule
        if dm is not None and (sd := dm.state_dict()):
            d["datamodule"] = sd
        return d

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.loaded = d  # put into Lightning by DeepFreezeCallback.on_fit_start, once the checkpointer is built

    def _deepfreeze_check(self, d: Any, what: str, where: str) -> None:
        """The restore's check of the torch states inside Lightning's (before anything is set:
        :func:`deepfreeze.torch._state.check_stateful`): each LR scheduler's, the precision
        plugin's GradScaler's. A different number of schedulers is :meth:`DeepFreezeCallback._restore`'s
        ModelMismatchError."""
        if not isinstance(d, dict):
            return
        configs, saved = self.trainer.lr_scheduler_configs, d.get("lr_schedulers")
        if isinstance(saved, list) and len(saved) == len(configs):
            for i, (c, sd) in enumerate(zip(configs, saved)):
                _state.check_stateful(c.scheduler, sd, f"{what}: LR scheduler {i}", where)
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if "precision" in d and scaler is not None:
            _state.check_stateful(scaler, d["precision"], f"{what}: the precision plugin's GradScaler", where)


class DeepFreezeCallback(pl.Callback):
    """DeepFreeze checkpoints of a Lightning fit: captured in the step, resumed through Lightning's own state.

    Args:
      config: path of a VeloC INI file, or a :class:`~deepfreeze.Config` (None: ``VELOC_*`` and ``overrides``).
      name: checkpoint name (``[a-zA-Z0-9_.]+``).
      every_n_train_steps: checkpoint after every N optimizer steps (None: never on its own).
      resume: continue from the newest committed version (model, optimizers, LR schedulers,
        Lightning's loop state, callbacks, RNG); a fresh start when there is none.
      overwrite: start a new generation of ``name`` (every committed version is retired).
      state: more ``{name: Stateful}`` objects to checkpoint with it (the key ``"lightning"`` is taken).
      checkpointer_cls: the class built at ``on_fit_start`` (a :class:`~deepfreeze.torch.Checkpointer`
        subclass: faults injected by subclassing, experiments).
      **kwargs: the :class:`~deepfreeze.torch.Checkpointer`'s other arguments (``overlap``,
        ``on_error``, ``lease_wait`` ...) and INI keys set in code (``scratch=``, ``persistent=``, ``mode=``).

    :attr:`checkpointer` is the :class:`~deepfreeze.torch.Checkpointer` while a fit runs (and
    after it, closed); :attr:`resumed_from` the version a resume started from.
    """

    def __init__(self, config: Any = None, name: str = "model", *, every_n_train_steps: "int | None" = None,
                 resume: bool = False, overwrite: bool = False, state: "dict[str, Any] | None" = None,
                 checkpointer_cls: type[Checkpointer] = Checkpointer, **kwargs: Any) -> None:
        super().__init__()
        if every_n_train_steps is not None and (isinstance(every_n_train_steps, bool)
                                                or not isinstance(every_n_train_steps, int) or every_n_train_steps < 1):
            raise ConfigError(f"every_n_train_steps = {every_n_train_steps!r}: use a positive integer or None")
        if resume and overwrite:
            raise ConfigError("resume=True and overwrite=True contradict each other: pick one")
        if state and STATE_KEY in state:
            raise ConfigError(f"state[{STATE_KEY!r}] is DeepFreezeCallback's own (Lightning's state): use another key")
        if not (isinstance(checkpointer_cls, type) and issubclass(checkpointer_cls, Checkpointer)):
            raise ConfigError(f"checkpointer_cls = {checkpointer_cls!r}: use deepfreeze.torch.Checkpointer or a "
                              "subclass")
        if "every_n_steps" in kwargs:
            raise ConfigError("DeepFreezeCallback takes every_n_train_steps=, not every_n_steps=")
        self.config, self.name, self.every_n_train_steps = config, name, every_n_train_steps
        self.resume, self.overwrite, self.extra_state, self.kwargs = resume, overwrite, dict(state or {}), kwargs
        self.checkpointer_cls = checkpointer_cls
        self.checkpointer: "Checkpointer | None" = None
        self.resumed_from: "int | None" = None
        self._lstate: "_LightningState | None" = None
        self._resumed: "dict[str, Any] | None" = None  # what on_train_start redoes after a resume (_restore)

    @property
    def state_key(self) -> str:
        return f"DeepFreezeCallback[{self.name}]"

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        check_strategy(trainer.strategy)

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        check_strategy(trainer.strategy)
        if self.resume and trainer.ckpt_path:
            raise ConfigError(f"DeepFreezeCallback(resume=True) and fit(ckpt_path={trainer.ckpt_path!r}) both restore "
                              "the run: drop one of them")
        if self.checkpointer is not None:
            self.checkpointer.close()  # a second fit with the same callback: a new checkpointer
        self._lstate = _LightningState(trainer, self)
        state = {**self.extra_state, STATE_KEY: self._lstate}
        self.checkpointer = self.checkpointer_cls(trainer.strategy.model, list(trainer.optimizers), self.config,
                                                  self.name, every_n_steps=self.every_n_train_steps,
                                                  resume=self.resume, overwrite=self.overwrite, state=state,
                                                  **self.kwargs)
        self.resumed_from = self.checkpointer.resumed_from
        if self._lstate.loaded is not None:
            self._restore(trainer, self._lstate.loaded)
            self._lstate.loaded = None

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._resumed is not None:
            r, self._resumed = self._resumed, None
            self._remake_iterator(trainer, r)

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.checkpointer is not None:
            self.checkpointer.end_iteration()  # the loop's boundary: the state record of a checkpoint step is taken

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        if self.checkpointer is not None:
            self.checkpointer.save_last = False  # never the last step with an exception in flight
        self._close()

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            self._close()

    # ------------------------------------------------------------------ internals
    def _close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()  # idempotent: finishes a pending capture, waits for the flushes

    def _restore(self, trainer: "pl.Trainer", d: dict[str, Any]) -> None:
        """Put Lightning's part of a resumed version back, in the order of Lightning's own restore
        of a checkpoint (``_CheckpointConnector.restore_training_state``)."""
        where = f"checkpoint {self.name!r} v{self.resumed_from}"
        if "precision" in d:
            trainer.precision_plugin.load_state_dict(d["precision"])
        fit_loop = d["loops"]["fit_loop"]
        last = bool(fit_loop.get("epoch_loop.batch_progress", {}).get("is_last_batch"))
        if last and "combined_loader" in fit_loop.get("state_dict", {}):
            # Taken at the last batch of an epoch: Lightning counts that epoch done, then reuses the iterator it
            # made at the start of the fit for the next epoch, which a restored loader state leaves exhausted (the
            # next epoch would run no batch; Lightning 2.6.6). Without it that iterator is a new epoch's.
            loop_sd = {k: v for k, v in fit_loop["state_dict"].items() if k != "combined_loader"}
            fit_loop = {**fit_loop, "state_dict": loop_sd}
        trainer.fit_loop.load_state_dict(fit_loop)
        configs = trainer.lr_scheduler_configs
        if len(configs) != len(d["lr_schedulers"]):
            raise ModelMismatchError(f"{where} holds {len(d['lr_schedulers'])} LR scheduler(s), this LightningModule "
                                     f"configures {len(configs)}: build the schedulers that were trained")
        for c, sd in zip(configs, d["lr_schedulers"]):
            c.scheduler.load_state_dict(sd)
        for cb in trainer.callbacks:
            sd = d.get("callbacks", {}).get(cb.state_key)
            if sd and cb is not self:
                cb.load_state_dict(copy.deepcopy(sd))
        if trainer.datamodule is not None and d.get("datamodule"):
            trainer.datamodule.load_state_dict(d["datamodule"])
        # Redone at on_train_start (see _remake_iterator): the loader states Lightning restores, the RNG states.
        loaders = fit_loop.get("state_dict", {}).get("combined_loader")
        self._resumed = {"last": last, "rng": d.get("rng"), "loaders": copy.deepcopy(loaders) if loaders else None}
        if trainer.global_rank == 0:
            log.warning("DeepFreeze: Lightning resumes %r from v%d: epoch %d, global step %d", self.name,
                        self.resumed_from, trainer.current_epoch, trainer.global_step)

    def _remake_iterator(self, trainer: "pl.Trainer", r: dict[str, Any]) -> None:
        """After a resume, at ``on_train_start``: the train iterator again, made after the samplers' epoch is set.

        Lightning (2.6.6) calls ``train_dataloader()``, loads the saved loader states and makes the
        iterator in one method (``FitLoop.setup_data``), and sets the samplers' epoch only later
        (``FitLoop.on_advance_start``). A ``StatefulDataLoader`` (torchdata 0.11) with workers
        prefetches indices when its iterator is made, and a plain ``DistributedSampler`` computes
        its permutation then, so the permutation was the epoch the samplers were built at (0), not
        the resumed one. Here, before the first batch: ``set_epoch`` on
        every train sampler (the epoch ``on_advance_start`` will set:
        ``fit_loop.epoch_progress.current.processed``; a :class:`~deepfreeze.errors.ConfigError`
        where a loader with workers keeps a sampler at another epoch), the iterators made before
        shut down (``CombinedLoader.reset``; a torchdata iterator's workers by its
        ``_shutdown_workers``), the loader states restored again (``CombinedLoader._load_state_dicts``)
        and the iterator made again (``iter(fit_loop._data_fetcher)``, as ``setup_data`` does): the
        workers restart once. Private Lightning attributes used: ``FitLoop._combined_loader``,
        ``FitLoop._data_fetcher``, ``CombinedLoader._load_state_dicts``; torchdata's:
        ``StatefulDataLoader._iterator`` and its ``_shutdown_workers`` (the versions are pinned in
        ``tests/test_torch_lightning.py``).

        RNG: making an iterator draws its base seed from torch's global RNG. Mid-epoch the
        restored loader state carries the interrupted iterator's seed, so the boundary's RNG states
        are set after it (the next draw is the next batch's). A version taken at an epoch's last
        batch has no loader state (see :meth:`_restore`): the iterator is the next epoch's, whose
        seed the uninterrupted run drew from the boundary's states, so they are set before it."""
        fit_loop = trainer.fit_loop
        combined, fetcher = fit_loop._combined_loader, fit_loop._data_fetcher
        if combined is not None and fetcher is not None:
            _set_epoch(trainer, fit_loop.epoch_progress.current.processed)
            if r["loaders"]:
                _warn_wrapped_sampler(trainer)
            for dl in combined.flattened:
                shutdown = getattr(getattr(dl, "_iterator", None), "_shutdown_workers", None)
                if callable(shutdown):
                    shutdown()
            combined.reset()  # (sets each loader's _iterator to None: a new one is made)
            if r["loaders"]:
                combined._load_state_dicts(copy.deepcopy(r["loaders"]))
            if r["last"] and r["rng"] is not None:
                _state.set_rng_state(r["rng"])
            iter(fetcher)
        if not r["last"] and r["rng"] is not None:
            _state.set_rng_state(r["rng"])
