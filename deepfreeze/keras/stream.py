"""Keras side of the stream: ``PublishCallback`` (producer) and ``ModelSubscriber`` (consumer).

The producer is a checkpoint callback whose captures are also published
(:class:`deepfreeze.stream.Publisher`): a channel *is* a checkpoint name, so its persistent
copy is a regular DeepFreeze checkpoint (``resume=True``, ``deepfreeze ls``, restore all work).
Publishing is one more role of the one capture in the train step: a ``PublishCallback`` and a
``DeepFreezeCheckpoint`` on the same name in one ``fit`` share one run (one lease), one engine
and one capture; the steps either wants are captured once. A capture only the publisher wanted
is handed to the engine when its writer has room, else the persistent copy coalesces to a newer
version (``coalesced``): dense early publishes never stall training. A ``DeepFreezeCheckpoint``'s
own versions are never skipped.

The consumer holds two replicas of the model: each new version is loaded into the idle one and
swapped in; a request runs entirely on the replica it started on (a replica is reloaded only
when no request is running on it), so no prediction mixes versions and swaps never block
``predict``. That double buffer is framework-neutral (:class:`deepfreeze.stream.serve.ReplicaServer`,
shared with :mod:`deepfreeze.torch.stream`); this module loads a version into Keras variables.
"""
from __future__ import annotations

import bisect
import logging
import time
from typing import Any, Callable

import numpy as np

from ..config import Config, did_you_mean
from ..errors import ConfigError, ModelMismatchError
from ..format import dtype_name
from ..fused import FusedShard
from ..lease import Version
from ..stream.core import Publisher, StreamOptions, Subscriber, Update
from ..stream.serve import ReplicaServer
from .callback import DeepFreezeCheckpoint
from .state_loader import build_from_spec
from ._dist import allreduce_mean, broadcast_bytes
from .repo import _copy_into

__all__ = ["PublishCallback", "ModelSubscriber", "SCHEDULES"]

log = logging.getLogger("deepfreeze")

#: named schedules (an int n publishes every n optimizer steps)
SCHEDULES = ("adaptive", "fixed", "epoch")


class PublishCallback(DeepFreezeCheckpoint):
    """Publish the model's weights to inference consumers during ``fit``; add it to ``callbacks``.

    Args:
      channel: the channel (= checkpoint) name; consumers subscribe to it.
      config: VeloC INI path or :class:`~deepfreeze.Config` (as :class:`DeepFreezeCheckpoint`).
      schedule: ``"epoch"`` (each epoch end), an int n (every n global optimizer steps),
        ``"fixed"`` (the interval minimising the predicted cumulative inference loss) or
        ``"adaptive"`` (greedy irregular steps from the predicted learning curve): the last two
        publish once at the end of the warm-up and follow the plan made there
        (:mod:`deepfreeze.stream.predict`; plan in :attr:`publish_plan`).
      warmup_epochs: epochs of per-batch losses the curve is fitted on (fixed/adaptive).
      horizon_s: seconds over which the consumer serves inferences after the warm-up (required
        for fixed/adaptive).
      inference_interval_s: seconds between two inference requests (required for fixed/adaptive).
      consumer_load_s: seconds a consumer takes to load one version (the cost model's t_c);
        default: the published bytes at 1 GB/s.
      stream: :class:`~deepfreeze.stream.StreamOptions` (slots, listening address, token, ...).
      **kwargs: :class:`DeepFreezeCheckpoint` arguments (``resume``, ``overwrite``,
        ``save_optimizer``, ``on_error``, ``verbose``, ``capture``...) and INI keys.
    """

    _checkpoints = False

    def __init__(self, channel: str = "model", config: "str | Config | None" = None, *,
                 schedule: "str | int" = "epoch", warmup_epochs: int = 1, horizon_s: float | None = None,
                 inference_interval_s: float | None = None, consumer_load_s: float | None = None,
                 stream: StreamOptions | None = None, **kwargs: Any) -> None:
        if isinstance(schedule, bool) or not (isinstance(schedule, int) and schedule >= 1 or schedule in SCHEDULES):
            hint = did_you_mean(schedule.strip().lower(), SCHEDULES) if isinstance(schedule, str) else ""
            raise ConfigError(f"schedule = {schedule!r}: use 'adaptive', 'fixed', 'epoch' or a positive int "
                              f"(publish every n optimizer steps).{hint}")
        if schedule in ("fixed", "adaptive"):
            for key, value in (("horizon_s", horizon_s), ("inference_interval_s", inference_interval_s)):
                if value is None or not float(value) > 0:
                    raise ConfigError(f"schedule={schedule!r} needs {key} > 0 (seconds): the plan minimises the "
                                      f"inference loss over horizon_s with a request every inference_interval_s")
            if not isinstance(warmup_epochs, int) or warmup_epochs < 1:
                raise ConfigError(f"warmup_epochs = {warmup_epochs!r}: use an integer >= 1")
        if consumer_load_s is not None and not float(consumer_load_s) >= 0:
            raise ConfigError(f"consumer_load_s = {consumer_load_s!r} must be >= 0 seconds")
        for k in ("every_n_batches", "at_epoch_end"):
            if k in kwargs:
                raise ConfigError(f"PublishCallback takes schedule=..., not {k}")
        n = schedule if isinstance(schedule, int) else None
        super().__init__(config, channel, every_n_batches=n, at_epoch_end=n is None, **kwargs)
        self.schedule = schedule
        self.warmup_epochs = int(warmup_epochs)
        self.horizon_s = None if horizon_s is None else float(horizon_s)
        self.inference_interval_s = None if inference_interval_s is None else float(inference_interval_s)
        self.consumer_load_s = consumer_load_s
        base = stream or StreamOptions()
        if base.redis is None and self.config.redis:
            import dataclasses
            base = dataclasses.replace(base, redis=self.config.redis)
        self.stream_options = base
        self.publisher: Publisher | None = None
        #: the plan made at the end of the warm-up (fixed/adaptive), a :class:`deepfreeze.stream.predict.Plan`
        self.publish_plan: Any = None
        self._plan_steps: list[int] = []
        self._epoch_now = 0
        self._first_epoch: int | None = None
        self._running: list[float] = []  # this epoch's running-mean losses (Keras logs)
        self._losses: list[float] = []  # per-batch losses of the warm-up
        self._batch_t: list[float] = []  # wall time per batch (warm-up)
        self._t_last: float | None = None
        #: versions published by this rank (handed to its publisher)
        self.published: list[Version] = []

    # -- bookkeeping (also as a rider: the owner makes the captures)
    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch_now = epoch
        if self._first_epoch is None:
            self._first_epoch = epoch
        self._running = []
        super().on_epoch_begin(epoch, logs)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.schedule in ("fixed", "adaptive") and self.publish_plan is None:
            now = time.perf_counter()
            if self._t_last is not None and batch > 0:
                self._batch_t.append(now - self._t_last)
            self._t_last = now
            loss = (logs or {}).get("loss")
            if loss is not None:
                self._running.append(float(loss))
        super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.schedule in ("fixed", "adaptive") and self.publish_plan is None:
            from ..stream.predict import per_batch_losses
            self._losses.extend(per_batch_losses(self._running).tolist())
            self._t_last = None
        super().on_epoch_end(epoch, logs)
        if self.schedule in ("fixed", "adaptive") and self.publish_plan is None and self._warmup_ends(epoch):
            self._make_plan()

    def close(self) -> None:
        """Stop publishing (the consumer keeps its live version), wait for the checkpoint's
        flushes, release the run and the lease."""
        pub, self.publisher = self.publisher, None
        try:
            if pub is not None:
                pub.close()
        finally:
            super().close()

    # -- roles
    def _warmup_ends(self, epoch: int) -> bool:
        return epoch - (self._first_epoch or 0) + 1 == self.warmup_epochs

    def _want_batch(self, before: int, after: int, last: int, steps: "int | None") -> bool:
        s = self.schedule
        if isinstance(s, int):
            return after // s > before // s
        if s == "epoch":
            return bool(steps) and last >= steps
        if self.publish_plan is None:  # warm-up: publish once, at its end
            return bool(steps) and last >= steps and self._warmup_ends(self._epoch_now)
        i = bisect.bisect_right(self._plan_steps, before)
        return i < len(self._plan_steps) and self._plan_steps[i] <= after

    def _want_epoch_end(self, epoch: int) -> bool:
        if self.schedule == "epoch":
            return True
        if self.schedule in ("fixed", "adaptive") and self.publish_plan is None:
            return self._warmup_ends(epoch)
        return False

    def _attached(self, owner: DeepFreezeCheckpoint) -> None:
        if self.publisher is not None and self.publisher.layout.plan == owner.plan and \
                self.publisher.run.id == owner._run.info.id:
            return
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        self.publisher = Publisher(self.name, self.config.persistent, rank=owner.rank, world=owner.size,
                                   run=owner._run.info, plan=owner.plan, model_tensors=owner._model_tensors,
                                   options=self.stream_options)
        if self.verbose and owner.rank == 0:
            log.warning("DeepFreeze: publishing %r at %s (%.1f MB per version on rank 0)", self.name,
                        self.publisher.address, self.publisher.prefix / 1e6)

    def _captured(self, owner: DeepFreezeCheckpoint, version: int, arrays: Any) -> None:
        if self.publisher is None:
            return
        shard = arrays if isinstance(arrays, FusedShard) else \
            FusedShard.from_arrays(self.publisher.layout, arrays, version)
        v = Version(owner._run.info.generation, version)
        owner._guard(self.publisher.publish, v, shard)
        self.published.append(v)

    # -- the plan
    def _make_plan(self) -> None:
        from ..stream.predict import producer_plan
        owner = self._owner or self
        steps_total = None
        if self.params and self.params.get("steps") and self.params.get("epochs"):
            steps_total = int(self.params["steps"]) * int(self.params["epochs"])
        losses = np.asarray(self._losses, dtype=np.float64)
        t_batch = float(np.median(self._batch_t)) if self._batch_t else 1e-3
        stats = allreduce_mean(np.concatenate([losses, [t_batch]]))  # the same length on every rank
        t_p = max(float(owner.timings[-1]["blocking_s"]) if owner.timings else 0.0, 1e-5)
        plan = producer_plan(
            self.schedule, self.name, stats[:-1], rank=owner.rank, broadcast=broadcast_bytes,
            s_iter=int(self.model.optimizer.iterations.numpy()), t_train=max(float(stats[-1]), 1e-6), t_p=t_p,
            nbytes=self.publisher.prefix * owner.size if self.publisher is not None else 0,
            horizon_s=self.horizon_s, inference_interval_s=self.inference_interval_s,
            consumer_load_s=self.consumer_load_s, total_steps=steps_total, verbose=self.verbose,
            fallback="at epoch ends")
        if plan is None:
            self.schedule = "epoch"
            return
        self.publish_plan = plan
        self._plan_steps = sorted(int(s) for s in plan.steps)


class ModelSubscriber(ReplicaServer):
    """Serve a model that follows a producer's published versions (double-buffered:
    :class:`deepfreeze.stream.serve.ReplicaServer`).

    Args:
      channel: the producer's channel name.
      config: VeloC INI path or :class:`~deepfreeze.Config` (its ``persistent`` directory holds the
        producer's endpoint files and the fallback checkpoint; its ``redis`` key, if set, is used).
      build: a function returning a fresh Keras model of the producer's architecture; it is
        called twice (two replicas). A model that is not built yet is built from ``input_spec``
        (as :class:`~deepfreeze.keras.DeepFreezeCheckpoint` builds one from fit's input).
      input_spec: the input's spec for an unbuilt model: a ``tf.TensorSpec`` (or a nested
        structure of them, or a dataset's ``element_spec``) or a shape such as ``(None, 28, 28)``.
      tier: ``"auto"``, ``"shm"``, ``"tcp"`` or ``"persistent"`` (see :class:`deepfreeze.stream.Subscriber`).
      token: token file for TCP (default: ``$DEEPFREEZE_TOKEN``, the token text itself, else the file
        ``$DEEPFREEZE_TOKEN_FILE`` names, else ``~/.deepfreeze/token``).
      warn_after: seconds without any producer or committed version after which one warning says
        that nobody publishes the channel, naming where the subscriber looked.
      **overrides: INI keys (``persistent=...``).

    Memory: two replicas of the model, one staging copy of its weights, and per producer rank a
    receive buffer of that rank's shard (so about four times the model's weights in all).
    """

    def __init__(self, channel: str, config: "str | Config | None" = None, *, build: Callable[[], Any],
                 tier: str = "auto", token: str | None = None, io_timeout: float = 30.0, input_spec: Any = None,
                 warn_after: float = 10.0, **overrides: Any) -> None:
        if not callable(build):
            raise ConfigError("build must be a function returning a new Keras model of the producer's architecture")
        cfg = Config.resolve(config, **overrides)
        self.channel, self._input_spec = channel, input_spec
        sub = Subscriber(channel, cfg.persistent, tier=tier, token=token, redis=cfg.redis,
                         io_timeout=io_timeout, warn_after=warn_after)
        try:
            models = [self._built(build), self._built(build)]
        except BaseException:
            sub.close()
            raise
        super().__init__(channel, sub, models)
        self._start()

    # -- public
    def predict(self, x: Any, **kwargs: Any) -> tuple[Any, Version]:
        """``(model(x), version)``: one whole version answers the request."""
        with self.pinned() as rep:
            y = rep.model(x, training=False, **kwargs)
            return (y.numpy() if hasattr(y, "numpy") else y), rep.version

    def get_weights(self) -> tuple[list[np.ndarray], Version]:
        """A consistent copy of the live version's weights (``model.get_weights()`` order)."""
        with self.pinned() as rep:
            return [np.array(w.numpy()) for w in rep.model.weights], rep.version

    def __enter__(self) -> "ModelSubscriber":
        return self

    # -- internals
    def _built(self, build: Callable[[], Any]) -> Any:
        model = build()
        if (not model.built or not model.weights) and self._input_spec is not None:
            build_from_spec(model, self._input_spec, who=f"ModelSubscriber({self.channel!r})",
                            what="input_spec", when="in build(), or pass input_spec=")
        if not model.built or not model.weights:
            raise ConfigError(f"ModelSubscriber({self.channel!r}): build() returned a model that is not built: give "
                              "it an Input layer, or pass input_spec= (e.g. a tf.TensorSpec or a shape such as "
                              "(None, 28, 28)) to build it from")
        return model

    def _load(self, model: Any, up: Update) -> None:
        weights = model.weights
        arrays = list(up.arrays.values())
        if len(arrays) != len(weights):
            raise ModelMismatchError(f"channel {self.channel!r} publishes {len(arrays)} tensors, the model from "
                                     f"build() has {len(weights)}: build the producer's architecture")
        for w, a in zip(weights, arrays):
            if tuple(w.shape) != a.shape or dtype_name(w.dtype.as_numpy_dtype) != dtype_name(a.dtype):
                raise ModelMismatchError(f"channel {self.channel!r}: tensor {w.name} is {a.dtype}{list(a.shape)} "
                                         f"published, {w.dtype.name}{list(w.shape)} in the model from build()")
            if a.ctypes.data % 64 == 0 and a.flags.c_contiguous:  # TensorFlow's alignment for a borrowed buffer
                _copy_into(w, a)  # in place, into the replica's own buffer: no fresh memory per update
            else:
                w.assign(a)
