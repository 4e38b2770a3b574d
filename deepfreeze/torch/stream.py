"""PyTorch side of the stream: ``Publisher`` (producer) and ``Subscriber`` / ``ModelSubscriber`` (consumer).

The producer publishes each rank's share of the weights (:class:`deepfreeze.stream.Publisher`,
one per rank; each DDP rank its 1/N, FSDP2 ranks their local shards; nothing goes through rank 0)
beside a :class:`~deepfreeze.torch.Checkpointer`: a channel *is* a checkpoint name, one run and
one lease serve both, and the Checkpointer's checkpoints are the consumers' fallback tier (a
regular DeepFreeze checkpoint: ``deepfreeze ls``, ``deepfreeze.torch.load``, ``resume=True``):
a running one (``checkpointer=ckpt``: the channel is its name) or, without one, its own on the
channel's name (``every_n_steps=`` gives it the checkpoints a Checkpointer would take). The
fallback tier serves checkpoint versions only: a publish-only version is never a checkpoint.

**One copy from the step to the slot.** The Publisher is a
:class:`~deepfreeze.torch.capture.LiveSubscriber` of its own
:class:`~deepfreeze.torch.capture.LiveCapture` (a sink of the model's step hook beside the
Checkpointer's capture, which captures nothing for it). Call order, on every rank: the post-hook
of a step its schedule wants (``wants_live``) lends it the live tensors (``on_live``: the plan of
the model's tensors checked, made with one all-gather when the tensor list changed; the buffers
rank 0 publishes copied aside, the next forward changes them; a :class:`SlotCopy` handed to the
publish thread); the publish thread copies the rank's pieces straight into a free slot of its
ring (:meth:`SlotRing.write_with <deepfreeze.stream.slots.SlotRing.write_with>`: chunk by chunk,
each chunk's CRC32 right after its copy) while the next forward and backward run, then compares
the tensors' ``_version`` counters (a tensor written during the copy: *torn*, the slot is never
completed and nothing announced) and announces the version; the next ``optimizer.step()``
(``on_release``) waits for the copy, at most the stream's ``io_timeout``. A process confined to
one CPU (``os.sched_getaffinity``) copies in the post-hook instead: a thread could only take
turns with training there (the same CPU, twice the latency).

The consumer (:class:`Subscriber`, any process, no ``torch.distributed``) holds two replicas of the
module: each new version is copied in place into the idle one (a replica is reloaded only when no
request runs on it; from shared memory into CPU tensors straight from the producers' pinned
slots, the CRC checked in the same pass: :meth:`Subscriber._out_for`) and swapped in
(:class:`deepfreeze.stream.serve.ReplicaServer`), so a request run under ``with sub.current() as
m:`` sees one whole version, never a mix.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from .. import format as fmt
from ..config import Config, did_you_mean
from ..errors import ConfigError, ModelMismatchError, StreamTimeoutError
from ..fused import FusedLayout
from ..lease import RunInfo, Version
from ..shardplan import ShardPlan
from ..stream.core import Publisher as _CorePublisher, StreamOptions, Subscriber as _CoreSubscriber, Update
from ..stream.serve import ReplicaServer
from . import _cuda, _state
from .capture import Captured, Live, LiveCapture
from .checkpointer import Checkpointer
from .slot_copy import SlotCopy, slot_chunks
from .hook import sinks_of

__all__ = ["Publisher", "Subscriber", "ModelSubscriber", "Served", "SCHEDULES"]

log = logging.getLogger("deepfreeze")

#: named schedules (an int n publishes every n optimizer steps)
SCHEDULES = ("adaptive", "fixed")


class Publisher:
    """Publish a DDP/FSDP2 (or plain) model's weights to serving processes as it trains.

    Beside a :class:`~deepfreeze.torch.Checkpointer`: its own (made from ``config``,
    ``every_n_steps`` and ``**kwargs`` on the channel's name) or the one given as
    ``checkpointer=`` (the channel is then that Checkpointer's name; its run and lease serve both,
    its checkpoints are the consumers' fallback tier). Each version's weights are copied from the
    live tensors straight into this rank's shared-memory slot (module docstring); the
    Checkpointer captures and writes its own steps only.

    Args:
      model, optimizer: as :class:`~deepfreeze.torch.Checkpointer` (with ``checkpointer=``: the
        very model and optimizers it captures).
      config: as :class:`~deepfreeze.torch.Checkpointer` (not with ``checkpointer=``).
      channel: the channel (= checkpoint) name; consumers subscribe to it. Default ``"model"``, or
        the name of ``checkpointer``.
      checkpointer: a running Checkpointer of this model and optimizers whose run the Publisher
        shares (its name is the channel, its checkpoints the fallback tier; a version only the
        publish schedule wanted is never written). Closing the Publisher stops publishing and
        leaves the Checkpointer running; closing the Checkpointer closes the Publisher.
      schedule: an int n (every n optimizer steps), ``"fixed"`` (the interval minimising the
        predicted cumulative inference loss) or ``"adaptive"`` (greedy irregular steps from the
        predicted learning curve). The last two need :meth:`report` after every optimizer step:
        they publish once at the end of the warm-up (``warmup_steps``) and follow the plan made
        there (:mod:`deepfreeze.stream.predict`; the plan in :attr:`publish_plan`). Steps are
        counted from the Checkpointer's step when the Publisher is made.
      warmup_steps: optimizer steps of reported losses the curve is fitted on (fixed/adaptive).
      horizon_s: seconds over which the consumers serve after the warm-up (required for fixed/adaptive).
      inference_interval_s: seconds between two inference requests (required for fixed/adaptive).
      consumer_load_s: seconds a consumer takes to load one version (the cost model's t_c);
        default: the published bytes at 1 GB/s.
      total_steps: the optimizer steps the run will take, if known (the plan ends there).
      every_n_steps: also checkpoint every N steps (never skipped: what a Checkpointer on this
        name would write); not with ``checkpointer=`` (that one's ``every_n_steps`` serves).
      stream: :class:`~deepfreeze.stream.StreamOptions` (slots, listening address, token, Redis...).
      **kwargs: :class:`~deepfreeze.torch.Checkpointer` arguments (``resume``, ``overwrite``,
        ``state``, ``overlap``, ``on_error`` ...) and INI keys (``scratch=``, ``persistent=`` ...);
        not with ``checkpointer=``.

    Its own: :attr:`published`, :attr:`publish_timings`, :attr:`torn`, :attr:`capture`,
    :attr:`publisher`, :attr:`publish_plan`. Other public attributes (``step``, ``start_step``,
    ``rank``, ``size``, ``config``, ``plan``, ``timings`` ...) are the Checkpointer's
    (:attr:`checkpointer`).

    Build it on every rank after ``dist.init_process_group`` and the DDP wrapper (collective).
    """

    def __init__(self, model: torch.nn.Module, optimizer: "torch.optim.Optimizer | Sequence[torch.optim.Optimizer]",
                 config: "str | Config | None" = None, channel: str | None = None, *,
                 checkpointer: Checkpointer | None = None, schedule: "str | int" = 1,
                 warmup_steps: int = 100, horizon_s: float | None = None, inference_interval_s: float | None = None,
                 consumer_load_s: float | None = None, total_steps: int | None = None,
                 every_n_steps: int | None = None, stream: StreamOptions | None = None, **kwargs: Any) -> None:
        if isinstance(schedule, bool) or not (isinstance(schedule, int) and schedule >= 1 or schedule in SCHEDULES):
            hint = did_you_mean(schedule.strip().lower(), SCHEDULES) if isinstance(schedule, str) else ""
            raise ConfigError(f"schedule = {schedule!r}: use a positive int (publish every n optimizer steps), "
                              f"'fixed' or 'adaptive'.{hint}")
        if schedule in SCHEDULES:
            for key, value in (("horizon_s", horizon_s), ("inference_interval_s", inference_interval_s)):
                if value is None or not float(value) > 0:
                    raise ConfigError(f"schedule={schedule!r} needs {key} > 0 (seconds): the plan minimises the "
                                      f"inference loss over horizon_s with a request every inference_interval_s")
            if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 2:
                raise ConfigError(f"warmup_steps = {warmup_steps!r}: use an integer >= 2 (steps of reported losses)")
        if consumer_load_s is not None and not float(consumer_load_s) >= 0:
            raise ConfigError(f"consumer_load_s = {consumer_load_s!r} must be >= 0 seconds")
        if total_steps is not None and (isinstance(total_steps, bool) or not isinstance(total_steps, int)
                                        or total_steps < 1):
            raise ConfigError(f"total_steps = {total_steps!r}: use a positive integer or None")
        if "name" in kwargs:
            raise ConfigError("Publisher takes channel=..., not name= (the channel is the checkpoint name)")
        opts = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        if checkpointer is not None:
            ck = checkpointer
            _check_ride(ck, model, opts, channel, config, every_n_steps, kwargs)
            self._owns = False
        else:
            channel = "model" if channel is None else channel
            for sink in sinks_of(model):  # (no hook made here)
                if isinstance(sink, Checkpointer) and sink.name == channel and not sink.closed:
                    raise ConfigError(f"a Checkpointer on {channel!r} already captures this model: one run owns a "
                                      "name. Pass it as Publisher(model, optimizer, checkpointer=ckpt, ...) to publish "
                                      "on its capture (its checkpoints are the consumers' fallback), or publish on "
                                      "another channel")
            ck = Checkpointer(model, opts, config, channel, every_n_steps=every_n_steps, **kwargs)
            self._owns = True
        #: the Checkpointer beside which this Publisher runs (its own, or ``checkpointer=``)
        self.checkpointer: Checkpointer = ck
        self.schedule = schedule
        self.warmup_steps = int(warmup_steps)
        self.horizon_s = None if horizon_s is None else float(horizon_s)
        self.inference_interval_s = None if inference_interval_s is None else float(inference_interval_s)
        self.consumer_load_s = consumer_load_s
        self.total_steps = total_steps
        #: the core publisher of this rank (made at the first publish, again when the shard plan changes)
        self.publisher: _CorePublisher | None = None
        #: the plan made at the end of the warm-up (fixed/adaptive), a :class:`deepfreeze.stream.predict.Plan`
        self.publish_plan: Any = None
        self._plan_steps: set[int] = set()
        self._losses: list[float] = []
        self._step_t: list[float] = []
        self._t_last: float | None = None
        self._report_missing = False
        self._closed = False
        #: versions published by this rank, in order
        self.published: list[Version] = []
        base = stream or StreamOptions()
        if base.redis is None and ck.config.redis:
            base = dataclasses.replace(base, redis=ck.config.redis)
        self.stream_options = base
        self._base = ck.step  # an int schedule counts its n steps from here
        self._warmup_end = ck.step + self.warmup_steps
        self._step0 = ck.step  # the live capture counts steps from 0 at this step
        #: per version published by this rank: {"version", "hook_s" (the post-hook's part), "wait_s" (the
        #: next optimizer.step() waiting for the copy)}: the training thread's stall per publish
        self.publish_timings: list[dict[str, Any]] = []
        self._copy: "SlotCopy | None" = None  # the copy of the version lent now (or the last one)
        self._plan: ShardPlan | None = None
        self._key: bytes | None = None
        self._specs_seen: Any = None
        self._chunks: list = []
        self._pieces: list = []  # (tensor id, piece, pinned) of this rank's copy, once each
        self._views: dict = {}
        self._torn_before = 0
        self._t_hook = 0.0
        self._pinned_at: "int | None" = None  # the slots' address while registered with CUDA (_cuda.pin_host)
        #: the live capture of the steps to publish (:class:`~deepfreeze.torch.capture.LiveCapture`, on the
        #: model's step hook beside the Checkpointer's capture): the tensors lent from the post-hook to the
        #: next optimizer.step(), no copy but the Publisher's own into its slot
        self.capture = LiveCapture(ck.model, ck.optimizers, records=ck.records)
        self.capture.subscribe(self)
        ck.subscribe(self)  # its wait() and close() reach the Publisher (on_wait, on_close); it captures nothing for it

    def __getattr__(self, name: str) -> Any:
        ck = self.__dict__.get("checkpointer")
        if ck is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(ck, name)

    # ------------------------------------------------------------------ public
    @property
    def channel(self) -> str:
        return self.checkpointer.name

    def report(self, loss: "float | torch.Tensor") -> None:
        """The loss of the optimizer step just taken (fixed/adaptive schedules: call it on every
        rank after every ``optimizer.step()``; other schedules ignore it). At the end of the
        warm-up the ranks' losses are averaged and the plan is made (collective)."""
        if self.schedule not in SCHEDULES or self.publish_plan is not None:
            return
        now = time.perf_counter()
        if self._t_last is not None:
            self._step_t.append(now - self._t_last)
        self._t_last = now
        self._losses.append(float(loss.detach().float().item() if isinstance(loss, torch.Tensor) else loss))
        if self.checkpointer.step >= self._warmup_end:
            self._make_plan()

    def end_iteration(self) -> None:
        """:meth:`Checkpointer.end_iteration`: a version to publish is then published at once."""
        self.checkpointer.end_iteration()

    def iterate(self, iterable: Any) -> Any:
        """:meth:`Checkpointer.iterate` (each item's end is an :meth:`end_iteration`)."""
        return self.checkpointer.iterate(iterable)

    def checkpoint(self) -> None:
        """Checkpoint the state after the current step now (:meth:`Checkpointer.checkpoint`; collective)."""
        self.checkpointer.checkpoint()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the copy of the version in flight and its notification, and for every
        checkpoint to be committed on persistent (:meth:`Checkpointer.wait`)."""
        self.checkpointer.wait(timeout)

    def close(self) -> None:
        """Finish the copy in flight, stop publishing (consumers keep their live version,
        then fall back to the persistent copy). A Publisher that made its own Checkpointer closes
        it (the hooks, the run and the lease are released); one given ``checkpointer=`` leaves it
        running."""
        if self._closed:
            return
        ck = self.checkpointer
        if self._owns:
            ck.close()  # finishes, writes, then closes this subscriber (on_close)
            return
        ck.unsubscribe(self)  # collective: every rank closes its Publisher; then on_close

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ the schedule
    def _wants_publish(self, step: int) -> bool:
        """Does the schedule publish the state after optimizer step ``step``?"""
        s = self.schedule
        if isinstance(s, int):
            return (step - self._base) % s == 0
        if self.publish_plan is None:  # warm-up: publish once, at its end
            if step > self._warmup_end + 1 and not self._report_missing:
                self._report_missing = True  # raised once, through optimizer.step()
                raise ConfigError(
                    f"schedule={s!r} on channel {self.channel!r}: no plan after {self.warmup_steps} warm-up steps "
                    f"({len(self._losses)} losses reported): call publisher.report(loss) after every "
                    "optimizer.step() on every rank")
            return step == self._warmup_end
        return step in self._plan_steps

    # ------------------------------------------------------------------ a subscriber of the Checkpointer
    def wants_capture(self, step: int) -> bool:
        """Never: a version is copied from the live tensors straight into a slot (:meth:`on_live`),
        not from the Checkpointer's capture, which serves its own checkpoints only. The Publisher
        stays a :class:`~deepfreeze.torch.capture.CaptureSubscriber` of it for its ``wait`` and
        ``close`` (:meth:`on_wait`, :meth:`on_close`)."""
        return False

    def on_capture(self, captured: Captured, run: RunInfo) -> None:
        """Not called (:meth:`wants_capture` wants none)."""

    def on_wait(self, timeout: float | None) -> None:
        """Wait for the copy of the version lent now and for the publisher's notification (the Checkpointer's ``wait``)."""
        copy_ = self._copy
        if copy_ is not None and not copy_.finished.wait(self.timeout if timeout is None else timeout):
            raise StreamTimeoutError(f"channel {self.channel!r}: the copy of v{copy_.step} did not end within "
                                     f"{timeout}s")
        if self.publisher is not None:
            self.publisher.wait(timeout)

    def on_close(self) -> None:
        """Stop publishing (the Checkpointer closes, or this Publisher does): the lent state is
        released (its copy ends first), the live capture leaves the step hook, then the publisher."""
        if self._closed:
            return
        self._closed = True
        try:
            self.capture.close()  # (calls on_close again: returns above)
        finally:
            self._drop_publisher()

    def _drop_publisher(self) -> None:
        """Close this rank's core publisher (its ring, server and endpoint), its slots unpinned first."""
        pub, self.publisher = self.publisher, None
        if pub is None:
            return
        self._torn_before += int(pub.ring.torn)
        if self._pinned_at is not None:  # unregistered while mapped, once no copy runs into the slots
            copy_ = self._copy
            if copy_ is None or copy_.finished.wait(self.timeout):
                _cuda.unpin_host(self._pinned_at)
            self._pinned_at = None
        pub.close()

    # ------------------------------------------------------------------ a live subscriber of the step
    #: the Publisher needs no state record and no optimizer state (weights only): the live capture
    #: takes no record and walks no optimizer for it
    wants_record = False
    wants_optimizer_state = False
    #: advanced: the :class:`SlotCopy` subclass that copies a version into its slot (tests inject faults)
    copy_cls: "type[SlotCopy]"

    def wants_live(self, step: int) -> bool:
        """Does the schedule publish the state after this optimizer step (``step`` counted by the
        live capture from the Publisher's start)? (:class:`~deepfreeze.torch.capture.LiveSubscriber`,
        as :meth:`on_live` and :meth:`on_release`.)"""
        self._t_hook = time.perf_counter()  # the post-hook's part from here (the tensor list, the hand-off)
        if self._closed:
            return False  # (a schedule error, e.g. no report(loss), goes through the Checkpointer's on_error)
        return self.checkpointer._ask(self._wants_publish, self._step0 + step)

    def on_live(self, live: Live) -> None:
        """The post-hook of a step to publish: this rank's 1/N of the weights goes from the live
        tensors straight into a slot of its ring, on the publish thread, overlapping the next
        forward and backward (the tensors do not change before :meth:`on_release`); in a process
        confined to one CPU (its affinity) here, in the post-hook (a thread could not overlap). Buffers (taken
        whole by rank 0) change in the next forward: they are copied here. Collective only when the
        model's tensor list changed (one all-gather: every rank publishes the same model). Runs
        under the Checkpointer's ``on_error`` policy."""
        self.checkpointer._guard(self._publish_live, live)

    def _publish_live(self, live: Live) -> None:
        t0 = self._t_hook
        ck, st = self.checkpointer, live.state
        self._plan_for(st)
        info = ck._run.info
        pub = self.publisher
        if pub is None or pub.run.id != info.id:
            self._drop_publisher()
            self.publisher = _CorePublisher(ck.name, ck.config.persistent, rank=ck.rank, world=ck.size, run=info,
                                            plan=self._plan, model_tensors=len(self._plan.tensors),
                                            options=self.stream_options)
            if any(t.is_cuda for t in st.tensors[:st.model_tensors]):  # device-to-host copies land in the slots
                addr, n = self.publisher.ring.data_region()
                self._pinned_at = addr if _cuda.pin_host(addr, n) else None
            if ck.verbose and ck.rank == 0:
                log.warning("DeepFreeze: publishing %r at %s (%.1f MB per version on rank 0)", ck.name,
                            self.publisher.address, self.publisher.prefix / 1e6)
        v = Version(info.generation, self._step0 + live.step)
        copy_ = self._copy = self.copy_cls(v.step, self._chunks, self._pieces, st, self._views)
        # confined to one CPU, a publish thread would only take turns with this one (the same CPU,
        # twice the latency): the copy runs here, in the post-hook
        self.publisher.publish_with(v, copy_, copy_.done, inline=len(os.sched_getaffinity(0)) < 2)
        self.published.append(v)
        self.publish_timings.append({"version": v.step, "hook_s": time.perf_counter() - t0, "wait_s": 0.0})

    def on_release(self, live: Live) -> None:
        """Before the tensors change (the next ``optimizer.step()``): wait for the copy (bounded by
        the stream's ``io_timeout``: past it the step goes on, and a copy that then sees a tensor
        change is torn, never published)."""
        copy_ = self._copy
        if copy_ is None or copy_.finished.is_set():
            return
        t0 = time.perf_counter()
        if not copy_.finished.wait(self.timeout):
            log.warning("DeepFreeze: channel %r: the copy of v%d did not end within %.0fs: training goes on (the "
                        "version is torn, not published)", self.channel, copy_.step, self.timeout)
        if self.publish_timings:
            self.publish_timings[-1]["wait_s"] += time.perf_counter() - t0

    @property
    def timeout(self) -> float:
        """Seconds a step waits at most for a version's copy (the stream's ``io_timeout``)."""
        return float(self.stream_options.io_timeout)

    @property
    def torn(self) -> int:
        """Versions not published because a tensor changed during their copy (this rank)."""
        return 0 if self.publisher is None else int(self.publisher.ring.torn) + self._torn_before

    def _plan_for(self, st: "_state.TrainState") -> None:
        """The shard plan of the model's tensors (weights and buffers; no optimizer state, no state
        record) and this rank's copy of it into a slot, made when the tensor list changes. One
        all-gather checks that every rank publishes the same model."""
        if st.specs is self._specs_seen:
            return
        mt = st.model_tensors
        pinned = sorted(p for p in st.pinned if p < mt)
        given = {t: list(b) for t, b in st.bounds.items() if t < mt}
        key = st.key()  # (the live capture lists the model's tensors only for the Publisher: their names, shapes...)
        self._specs_seen = st.specs
        if key == self._key:
            return
        ck = self.checkpointer
        if ck.size > 1:
            keys = ck.comm.allgather(key)
            if any(k != key for k in keys):
                bad = next(r for r, k in enumerate(keys) if k != key)
                raise ModelMismatchError(f"channel {self.channel!r}: rank {bad} publishes a different model than "
                                         f"rank {ck.rank}: every rank must build the same model")
        plan = ShardPlan.build(st.specs[:mt], ck.size, min_shard_bytes=ck.min_shard_bytes, pinned=pinned, given=given)
        if self._plan is not None:
            self._drop_publisher()  # a new ring, endpoint and plan for consumers
            if ck.rank == 0:
                log.warning("DeepFreeze: channel %r: the model's tensors changed: a new plan from step %d on",
                            self.channel, ck.step)
        self._plan, self._key = plan, key
        self._chunks = slot_chunks(FusedLayout.build(plan, ck.rank), st.bounds, ck.rank, set(pinned))
        self._pieces = sorted({(c[2], c[3], c[5]) for _, group in self._chunks for c in group}, key=lambda x: x[0])
        self._views = {}

    # ------------------------------------------------------------------ the plan
    def _make_plan(self) -> None:
        from ..stream.predict import producer_plan
        ck = self.checkpointer
        losses = np.asarray(self._losses[-self.warmup_steps:], dtype=np.float64)
        t_step = float(np.median(self._step_t)) if self._step_t else 1e-3
        row = np.concatenate([losses, [t_step]]).tobytes()
        rows = ck.comm.allgather(row) if ck.size > 1 else [row]
        if any(len(r) != len(row) for r in rows):
            raise ConfigError(f"channel {self.channel!r}: the ranks reported different numbers of losses: call "
                              "publisher.report(loss) once after every optimizer.step() on every rank")
        stats = np.mean([np.frombuffer(r, dtype=np.float64) for r in rows], axis=0)
        t_p = max(max((t["hook_s"] + t["wait_s"] for t in self.publish_timings[-3:]), default=0.0), 1e-5)
        plan = producer_plan(
            self.schedule, self.channel, stats[:-1], rank=ck.rank,
            broadcast=(lambda b: ck.comm.allgather(b)[0]) if ck.size > 1 else (lambda b: b),
            s_iter=ck.step, t_train=max(float(stats[-1]), 1e-6), t_p=t_p,
            nbytes=(self.publisher.prefix if self.publisher is not None else 0) * ck.size,
            horizon_s=self.horizon_s, inference_interval_s=self.inference_interval_s,
            consumer_load_s=self.consumer_load_s, total_steps=self.total_steps, verbose=ck.verbose,
            fallback=f"every {self.warmup_steps} steps")
        if plan is None:
            self.schedule, self._base = self.warmup_steps, ck.step
            return
        self.publish_plan = plan
        self._plan_steps = {int(s) for s in plan.steps}


Publisher.copy_cls = SlotCopy


def _check_ride(ck: Any, model: torch.nn.Module, opts: list, channel: "str | None", config: Any,
                every_n_steps: "int | None", kwargs: dict) -> None:
    """``Publisher(..., checkpointer=ck)``: ``ck`` must be a running Checkpointer of this very
    model and these optimizers, on the channel's name, with no Publisher riding on it yet; the
    Checkpointer's own arguments are not given again."""
    if not isinstance(ck, Checkpointer):
        raise ConfigError(f"checkpointer= must be a deepfreeze.torch.Checkpointer, got {type(ck).__name__}")
    if ck.closed:
        raise ConfigError(f"checkpointer= {ck.name!r} is closed: give a running Checkpointer (or none: the "
                          "Publisher then makes its own)")
    if ck.model is not model or len(ck.optimizers) != len(opts) or \
            any(a is not b for a, b in zip(ck.optimizers, opts)):
        raise ConfigError(f"checkpointer= {ck.name!r} captures another model or other optimizers than the "
                          "Publisher's: give both the same model object and optimizers (in the same order), since "
                          "they share one capture in the optimizer step")
    if channel is not None and channel != ck.name:
        raise ConfigError(f"channel={channel!r} with checkpointer= {ck.name!r}: the channel is the checkpoint name "
                          "(the consumers' fallback tier reads its versions): leave channel out, or publish on "
                          "another name without checkpointer=")
    given = sorted(kwargs) + (["config"] if config is not None else []) + \
        (["every_n_steps"] if every_n_steps is not None else [])
    if given:
        raise ConfigError(f"Publisher(checkpointer=...) takes no Checkpointer arguments ({', '.join(given)}): they "
                          f"belong to the Checkpointer {ck.name!r}, whose run the Publisher shares")
    if ck.subscribers:
        raise ConfigError(f"a Publisher already publishes the capture of {ck.name!r} (channel {ck.name!r}): one "
                          "channel has one Publisher; close it first")


# --------------------------------------------------------------------------- consumer
class Served:
    """The replica a request runs on (what ``with sub.current() as m:`` gives): call it as the
    module (``m(x)``); ``m.module`` is the ``nn.Module`` itself (other attributes are the
    module's); ``m.version`` and ``m.step`` say which version it holds, for the whole block."""

    __slots__ = ("module", "version")

    def __init__(self, module: torch.nn.Module, version: Version) -> None:
        self.module, self.version = module, version

    @property
    def step(self) -> int:
        """The producer's optimizer step of the version served."""
        return self.version.step

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)

    def __repr__(self) -> str:
        return f"Served({type(self.module).__name__}, {self.version})"


def _where_conflict(persistent: "str | None", config: Any, redis: "str | None", overrides: dict[str, Any]) -> str:
    """The :class:`Subscriber` refusal of keywords that name the producer's directory twice: the
    keyword it cannot take with the others, named, and the two ways that work."""
    ways = ("give the producer's persistent directory as persistent= (with redis= if it uses Redis) and nothing "
            "else, or a config (INI path or Config, with INI keys as keywords) and no persistent=/redis=")
    given = (["config="] if config is not None else []) + [f"{k}=" for k in sorted(overrides)]
    if persistent is not None:
        return f"Subscriber: persistent= cannot be taken with {', '.join(given)}: {ways}"
    if given:
        return (f"Subscriber: redis= cannot be taken with {', '.join(given)} (with a config, Redis is its 'redis' "
                f"key): {ways}")
    return f"Subscriber: redis= needs persistent= (the producer's persistent directory): {ways}"


class Subscriber(ReplicaServer):
    """Serve an ``nn.Module`` that follows a producer's published versions (double-buffered).

    Any process, no ``torch.distributed``::

        sub = Subscriber(model, channel="clf", persistent="/ckpt")   # model: the producer's architecture
        sub.wait(0, timeout=60)                                      # any version live
        with sub.current() as m:                                     # one whole version for the block
            y = m(x)                                                 # m.version, m.step: what answered

    Args:
      module: a module of the producer's architecture (its state-dict names, shapes and dtypes: the
        published model tensors, DDP's ``module.`` prefix removed). It becomes one replica; the
        other is ``replica`` (default ``copy.deepcopy(module)``). Put both where they will run
        (CPU or a CUDA device) before; the subscriber never moves them.
      channel: the producer's channel name.
      config: VeloC INI path or :class:`~deepfreeze.Config` (its ``persistent`` directory holds the
        producer's endpoint files and the fallback checkpoint; its ``redis`` key, if set, is used).
      persistent: the producer's persistent directory, instead of a ``config`` (a consumer needs
        nothing else of one); ``redis=`` may come with it.
      tier: ``"auto"``, ``"shm"``, ``"tcp"`` or ``"persistent"`` (:class:`deepfreeze.stream.Subscriber`).
      token: token file for TCP (default: ``$DEEPFREEZE_TOKEN``, the token text itself, else the file
        ``$DEEPFREEZE_TOKEN_FILE`` names, else ``~/.deepfreeze/token``).
      io_timeout: seconds any single network wait may take.
      warn_after: seconds without any producer or committed version after which one warning says
        that nobody publishes the channel, naming where the subscriber looked.
      **overrides: INI keys (with ``config``).

    Memory: two replicas; through shared memory into CPU replicas nothing else (each version is
    copied from the producer's slots straight into the idle replica, its CRC checked in the same
    pass); over TCP (or into CUDA replicas) also a staging copy of the weights and per producer
    rank a receive buffer of its shard (about four times the weights). A version whose tensors do not match the module
    is a :class:`~deepfreeze.errors.ModelMismatchError` raised (once) by :meth:`wait`/:meth:`current`;
    the live version stays live.
    """

    _thread_name = "deepfreeze-torch-subscriber"

    def __init__(self, module: torch.nn.Module, channel: str = "model", config: "str | Config | None" = None, *,
                 persistent: str | None = None, redis: str | None = None, replica: torch.nn.Module | None = None,
                 tier: str = "auto", token: str | None = None, io_timeout: float = 30.0, warn_after: float = 10.0,
                 **overrides: Any) -> None:
        if not isinstance(module, torch.nn.Module):
            raise ConfigError(f"Subscriber: module must be a torch.nn.Module, got {type(module).__name__}")
        other = copy.deepcopy(module) if replica is None else replica
        if other is module or not isinstance(other, torch.nn.Module):
            raise ConfigError("Subscriber: replica must be a second torch.nn.Module of the same architecture")
        if persistent is not None and config is None and not overrides:
            where = str(persistent)
        elif persistent is None and redis is None:
            cfg = Config.resolve(config, **overrides)
            where, redis = cfg.persistent, cfg.redis
        else:
            raise ConfigError(_where_conflict(persistent, config, redis, overrides))
        sub = _CoreSubscriber(channel, where, tier=tier, token=token, redis=redis, io_timeout=io_timeout,
                              warn_after=warn_after)
        super().__init__(channel, sub, [module, other])
        self._targets: dict[int, dict[str, torch.Tensor]] = {}  # id(replica module) -> name -> tensor
        self._views: dict[tuple, tuple] = {}  # (id(replica module), tensors) -> (targets, numpy views or None)
        self._start()

    @contextlib.contextmanager
    def current(self) -> Iterator[Served]:
        """The live replica for one request: ``with sub.current() as m: y = m(x)``. It is not
        reloaded before the block ends (a newer version goes into the other replica), so the
        whole block runs on ``m.version``. Raises :class:`~deepfreeze.errors.StreamError` when no
        version is live yet (call :meth:`wait` first)."""
        with self.pinned() as rep:
            yield Served(rep.model, rep.version)

    def predict(self, *args: Any, **kwargs: Any) -> tuple[Any, Version]:
        """``(module(*args, **kwargs), version)`` under ``torch.no_grad()``: one whole version answers."""
        with self.current() as m, torch.no_grad():
            return m(*args, **kwargs), m.version

    def state_dict(self) -> tuple[dict[str, torch.Tensor], Version]:
        """A consistent copy of the live version's state dict (CPU tensors) and its version."""
        with self.current() as m:
            return {k: v.detach().to("cpu", copy=True) for k, v in m.module.state_dict().items()}, m.version

    # -- the framework's part
    def _targets_of(self, module: torch.nn.Module, published: "list[tuple[str, str, tuple]]") -> dict[str, torch.Tensor]:
        """The replica's tensors by published name (tied FQNs: the one published), checked once
        against ``published`` ((name, dtype, shape) of each published tensor)."""
        names = [n for n, _, _ in published]
        got = self._targets.get(id(module))
        if got is not None and list(got) == names:
            return got
        entries = _state.model_entries(module)
        first: dict[int, str] = {}
        mine: dict[str, torch.Tensor] = {}
        for fqn, t, _ in entries:
            if first.setdefault(id(t), fqn) == fqn:
                mine[fqn] = t
        missing = [n for n in names if n not in mine]
        extra = [n for n in mine if n not in set(names)]
        if missing or extra:
            raise ModelMismatchError(
                f"channel {self.channel!r} publishes {len(names)} model tensors, the module has {len(mine)}: not in "
                f"the module: {missing[:5]}; not published: {extra[:5]}. Build the producer's architecture (the "
                "names are its state-dict keys without DDP's 'module.' prefix)")
        out = {}
        for n, dtype, shape in published:
            t = mine[n]
            mt = (_state.dtype_of(t, n), tuple(t.shape))
            if mt != (dtype, tuple(shape)):
                raise ModelMismatchError(f"channel {self.channel!r}: tensor {n!r} is {dtype}{list(shape)} published, "
                                         f"{mt[0]}{list(mt[1])} in the module")
            out[n] = t
        self._targets[id(module)] = out
        return out

    def _out_for(self, module: torch.nn.Module) -> "dict[str, np.ndarray] | None":
        """The replica's CPU tensors as numpy arrays sharing their memory: the subscriber copies each
        version straight from the producer's slot into them (one copy, its CRC in the same pass).
        None (the staged path, :meth:`_load`) before the producer's tensors are known, for CUDA
        replicas, and for tensors numpy cannot view (bfloat16, non-contiguous)."""
        specs = self._sub.specs()
        if not specs:
            return None
        targets = self._targets_of(module, [(sp.name, sp.dtype, tuple(sp.shape)) for sp in specs])
        key = (id(module), len(specs))
        hit = self._views.get(key)
        if hit is not None and hit[0] is targets:
            return hit[1]
        views: "dict[str, np.ndarray] | None" = {}
        for n, t in targets.items():
            if t.device.type != "cpu" or not t.is_contiguous():
                views = None
                break
            try:
                views[n] = t.detach().numpy()
            except (TypeError, RuntimeError):  # a dtype numpy has no view of
                views = None
                break
        self._views[key] = (targets, views)
        return views

    def _load(self, module: torch.nn.Module, up: Update) -> None:
        targets = self._targets_of(module, [(n, fmt.dtype_name(a.dtype), a.shape) for n, a in up.arrays.items()])
        cuda = [t for t in targets.values() if t.is_cuda]
        stream = None
        if cuda and torch.cuda.is_available():  # a side stream; its event is waited for before the swap
            stream = torch.cuda.Stream(device=cuda[0].device)
            # requests that ran on this replica may still have kernels queued on the device's
            # default stream: the copies start after them
            stream.wait_stream(torch.cuda.default_stream(cuda[0].device))
        with torch.no_grad(), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
            for n, a in up.arrays.items():
                t = targets[n]
                src = _state.as_tensor(a, fmt.dtype_name(a.dtype))  # a view of the subscriber's buffer
                t.copy_(src, non_blocking=False)  # in place: no fresh memory per update
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            event.synchronize()  # the copies are done before the replica goes live (and the buffer is reused)


class ModelSubscriber(Subscriber):
    """:class:`Subscriber` with the other adapter's ``ModelSubscriber`` signature: ``build()`` returns a fresh module
    of the producer's architecture and is called twice (two replicas)."""

    def __init__(self, channel: str, config: "str | Config | None" = None, *,
                 build: Callable[[], torch.nn.Module], **kwargs: Any) -> None:
        if not callable(build):
            raise ConfigError("build must be a function returning a new nn.Module of the producer's architecture")
        super().__init__(build(), channel, config, replica=build(), **kwargs)
