"""Clones of a running torchrun job, sent rank to rank over TCP to a second, independent job.

Source job (every rank, after ``init_process_group`` and the DDP wrapper)::

    server = deepfreeze.torch.CloneServer(model, optimizer, "127.0.0.1:7100", state={"sched": sched})
    for x, y in server.iterate(loader):   # or call server.end_iteration() at each iteration's end
        ...                               # forward, backward, optimizer.step(), sched.step()
    server.close()

Clone job (any world size, gloo or none; a fresh model and optimizer of the same architecture)::

    info = deepfreeze.torch.clone.receive(model, optimizer, "127.0.0.1:7100", state={"sched": sched})
    # model, optimizer, sched (and, at the source's world size, every rank's RNG) are the source's
    # after its step info.step; continue training from there

How: a :class:`CloneServer` is the policy; the mechanism is a live capture of the step
(:class:`deepfreeze.torch.capture.LiveCapture`, a sink of the model's
:class:`~deepfreeze.torch.hook.StepHook`, shared with a Checkpointer of the same model), to
which it subscribes as a :class:`~deepfreeze.torch.capture.LiveSubscriber`. Source rank 0
listens on ``address`` (:class:`deepfreeze.clone.wire.RequestServer`, authenticated with the
token). Every ``every_n_steps`` optimizer steps, in the post-hook of the last optimizer
(``wants_live``), the source ranks agree whether a request is pending: one ``all_reduce`` of one
int64 over a dedicated gloo group (the training's process group, NCCL or gloo, is never used).
When one is, that step is ``K``: the capture lends every source rank its live tensor list
(``on_live``: :func:`deepfreeze.torch._state.train_state`, the model's state dict and every
optimizer state tensor, no copy) and the server makes a :class:`~deepfreeze.clone.ClonePlan`
for ``N -> M`` ranks; a background thread sends its routes (its 1/N of every replicated tensor;
buffers whole from rank 0, copied in the hook) straight to the clone ranks
(:class:`deepfreeze.clone.wire.Sender`), then its state record (the Checkpointer's record,
:class:`deepfreeze.torch.capture.StateRecords`, encoded by :func:`deepfreeze.torch._state.encode`:
RNG states, ``state=`` objects with the schedulers, ``param_groups``, the position of
:meth:`CloneServer.iterate`), which the capture takes at the loop's boundary
(:meth:`CloneServer.end_iteration`) when the loop marks it, else as the Checkpointer takes it
(post-hook, then the next forward's pre-hook). The next ``optimizer.step()`` waits for the
routes to be sent before it updates anything (the capture's hold: ``on_release``, bounded by
``timeout``); the clone's answer is awaited in the background. The source never fails because a
clone did: a failed clone is logged (its named error) and kept in :attr:`CloneServer.failures`;
:meth:`CloneServer.wait` raises it.

The clone side (:func:`receive`, collective over the clone job's ``torch.distributed`` world
when it has one): every rank listens (:class:`deepfreeze.clone.wire.CloneListener`), rank 0
requests the clone with every rank's endpoint. At the first source hello each rank checks the
plan against its model and the source's optimizers and ``state=`` keys (a
``ModelMismatchError`` before any byte lands), then says where the bytes land (:class:`_Landing`):
a new tensor per tensor of the plan, which becomes the model's parameter or buffer (``t.data =``,
no copy) or the optimizer's state (``load_state_dict`` keeps it) once every check passed; a
host buffer only for a model tensor the socket cannot reach (another device: one copy there).
Each frame is received straight there, and each route, once landed and its MAC checked, is
forwarded to every other clone rank
(:mod:`deepfreeze.clone.relay`, over the same authenticated listeners), which receives it
straight into *its* tensors: the forwarding overlaps the receive, every byte lands once per
clone rank, and the sources' traffic does not grow with the clone ranks. The ranks then agree
(an all-reduce of outcomes on a dedicated gloo group) and the records go in through the restore
path (:func:`deepfreeze.torch.state_loader.apply`: the same checks, then the received tensors
become the model's, any world size; each rank's own record, RNG included, at the source's world
size, rank 0's otherwise). Until then nothing of the job's model or optimizers is touched: a
failure leaves them as they were. A clone rank that dies while forwarding is a ``CloneError``
naming it on the others (their connection from it closes), the source training on.
"""
from __future__ import annotations

import datetime
import json
import logging
import threading
import time
import warnings
from typing import Any, Sequence

import numpy as np
import torch

from .. import net
from ..clone.api import CloneInfo
from ..clone.plan import DEFAULT_THRESHOLD, ClonePlan
from ..clone.relay import Forwarder
from ..clone.wire import CloneListener, RequestServer, Sender, request
from ..errors import CloneError, CloneTimeoutError, ConfigError, DeepFreezeError, ModelMismatchError, error_class
from ..format import numpy_dtype
from ..loader import Checkpoint
from . import _loop, _state
from ._dist import rank_and_size
from .capture import Live, LiveCapture, StateRecords

__all__ = ["CloneServer", "receive"]

log = logging.getLogger("deepfreeze")

def _group(timeout: float) -> Any:
    """A dedicated gloo group of every rank (collective), or None in a one-process job."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))


def _bcast_json(group: Any, obj: Any, rank: int) -> Any:
    """Rank 0's JSON-able ``obj`` on every rank of ``group`` (never pickled)."""
    if group is None:
        return obj
    return json.loads(_bcast_from(group, json.dumps(obj) if rank == 0 else "", 0, rank))


def _flat_bytes(t: torch.Tensor, copy: bool) -> np.ndarray:
    """The bytes of ``t`` as a flat uint8 numpy array (a view of a contiguous CPU tensor unless ``copy``)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    elif copy or not t.is_contiguous():
        t = t.clone(memory_format=torch.contiguous_format)
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)


class _Clone:
    """One clone in flight on a source rank, of the live state ``live``."""

    def __init__(self, live: Live, n_clone: int) -> None:
        self.live, self.step, self.n_clone = live, live.step, n_clone
        self.sent = threading.Event()  # the routes went out: the optimizer may update the tensors
        self.record = b""
        self.error: BaseException | None = None
        self.sender: Sender | None = None
        self.thread: threading.Thread | None = None
        self.t0 = time.perf_counter()
        self.at = time.time()  # when the clone step's sends began (wall clock)
        self.seconds = 0.0


class CloneServer:
    """Serve clones of this DDP (or one-process) training job to other jobs.

    Args:
      model, optimizer: as :class:`~deepfreeze.torch.Checkpointer` (DDP or a plain module; an
        optimizer or a sequence of them, the last one stepped last).
      address: ``host:port`` source rank 0 listens on for requests (port 0: any free port, see
        :attr:`address`); loopback unless ``allow_remote=True``.
      token: the token file (default ``$DEEPFREEZE_TOKEN``, the token text itself, else the file
        ``$DEEPFREEZE_TOKEN_FILE`` names, else ``~/.deepfreeze/token``, created 0600 when missing);
        the clone job must present the same token.
      state: ``{name: Stateful}`` sent in each rank's record (LR schedulers, GradScaler, a data
        position), as the Checkpointer's ``state=``.
      every_n_steps: agree on pending requests every N optimizer steps (the cost: one all_reduce
        of one int64 over a gloo group per check; docs/torch-siblings.md gives the measured number).
      timeout: seconds any wait may take (a clone that does not take its data, a step waiting
        for the routes to go out, the clone's answer).
      threshold: tensors up to this many bytes go whole from one rank (:class:`ClonePlan`).
      sender_cls: advanced, a :class:`deepfreeze.clone.wire.Sender` subclass (tests inject faults).

    Build it on every rank (collective when ``torch.distributed`` runs). It is the
    :class:`~deepfreeze.torch.capture.LiveSubscriber` of its own live capture (:attr:`capture`,
    a :class:`~deepfreeze.torch.capture.LiveCapture`: the steps, the state records, the hold of
    the next step); what is its own is the policy: the requests, the agreement, the plan, the sends.
    """

    def __init__(self, model: torch.nn.Module, optimizer: "torch.optim.Optimizer | Sequence[torch.optim.Optimizer]",
                 address: str = "127.0.0.1:0", *, token: str | None = None, state: "dict[str, Any] | None" = None,
                 every_n_steps: int = 1, timeout: float = 60.0, allow_remote: bool = False,
                 threshold: int = DEFAULT_THRESHOLD, sender_cls: type = Sender) -> None:
        opts = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        if not opts or not all(isinstance(o, torch.optim.Optimizer) for o in opts):
            raise ConfigError("CloneServer: optimizer must be a torch.optim.Optimizer or a sequence of them")
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ConfigError(f"every_n_steps = {every_n_steps!r}: use a positive integer")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"timeout = {timeout!r}: use a positive number of seconds")
        self.state = _state.statefuls(state)
        if _state.check_layout(model):
            raise ConfigError("CloneServer clones DDP and plain models; this one is sharded with FSDP2 "
                              "(fully_shard), which it does not clone yet")
        host, port = net.parse_address(address)
        self.model, self.optimizers = model, opts
        self.every_n_steps, self.timeout, self.threshold = every_n_steps, float(timeout), int(threshold)
        self.sender_cls = sender_cls
        self.rank, self.size = rank_and_size("deepfreeze.torch.CloneServer")
        #: seconds spent in the per-step agreement (all_reduce) and how many ran
        self.agree_s, self.agreements = 0.0, 0
        #: every clone served: {"step", "n_clone", "at" (``time.time()`` its sends began), "seconds", "bytes", "error"}
        self.clones: list[dict[str, Any]] = []
        #: the errors of clones that failed (also logged)
        self.failures: list[BaseException] = []
        self._clone: _Clone | None = None
        self._request: "tuple[int, list[str]] | None" = None  # agreed in wants_live, started in on_live
        #: clones started (the same count on every rank: they start at agreed steps)
        self.served = 0
        #: the step the last clone was taken at (None before the first)
        self.last_clone_step: int | None = None
        #: the state records sent (the Checkpointer's, deepfreeze.torch.capture.StateRecords)
        self.records = StateRecords(model, opts, self.state, _loop.Passes(), rank=self.rank, size=self.size,
                                    sharded=False)
        self._closed = False
        self._token = net.ensure_token(token)
        self._group = _group(self.timeout)
        self._server: RequestServer | None = None
        if self.rank == 0:
            self._server = RequestServer(host, port, self._token, self.size, allow_remote=allow_remote,
                                         timeout=self.timeout)
        #: where clone jobs connect (source rank 0's listening address), on every rank
        self.address: str = _bcast_json(self._group, self._server.address if self._server else "", self.rank)
        #: the live states of the steps (deepfreeze.torch.capture.LiveCapture, on the model's step hook)
        self.capture = LiveCapture(model, opts, records=self.records)
        self.capture.subscribe(self)

    @property
    def step(self) -> int:
        """Optimizer steps counted (the last optimizer's) since the server was built."""
        return self.capture.step

    # ------------------------------------------------------------------ the loop
    def iterate(self, iterable: Any) -> Any:
        """``iterable``'s items with :meth:`end_iteration` after each (as
        :meth:`Checkpointer.iterate <deepfreeze.torch.Checkpointer.iterate>`); the records sent
        hold the pass's position (:attr:`CloneInfo.epoch`, :attr:`CloneInfo.epoch_step` on the clone)."""
        return self.capture.iterate(iterable, "clone")

    def end_iteration(self) -> None:
        """Mark the end of a training iteration (after ``optimizer.step()``, ``scheduler.step()``):
        a clone's records are taken here. Not collective; cheap when no clone is in flight."""
        self.capture.end_iteration()

    # ------------------------------------------------------------------ LiveSubscriber
    def wants_live(self, step: int) -> bool:
        """Every ``every_n_steps`` steps: the ranks agree whether rank 0 holds a request (one
        all_reduce of one int64 over the gloo group; then the request, broadcast)."""
        if self._closed or step % self.every_n_steps:
            return False
        t0 = time.perf_counter()
        req = self._server.next() if self._server is not None else None
        flag = torch.tensor([0 if req is None else 1], dtype=torch.int64)
        if self._group is not None:
            import torch.distributed as dist
            dist.all_reduce(flag, group=self._group)
        self.agree_s += time.perf_counter() - t0
        self.agreements += 1
        if not int(flag.item()):
            return False
        msg = _bcast_json(self._group, {"n_clone": req.n_clone, "endpoints": req.endpoints} if req else None,
                          self.rank)
        self._request = (msg["n_clone"], msg["endpoints"])
        return True

    def on_live(self, live: Live) -> None:
        """The agreed step: this rank's routes of the live tensors go out from a background thread."""
        assert self._request is not None
        (n_clone, endpoints), self._request = self._request, None
        st = live.state
        c = self._clone = _Clone(live, n_clone)
        self.served += 1
        self.last_clone_step = live.step
        try:
            if live.error is not None:  # part "a" of the record failed in this post-hook
                raise live.error
            plan = ClonePlan(st.specs, self.size, n_clone, whole=st.pinned, threshold=self.threshold)
            sends = plan.sends_of(self.rank)
            pinned = set(st.pinned)
            buffers = {tid: _flat_bytes(st.tensors[tid], copy=tid in pinned) for tid in sends}
        except DeepFreezeError as e:
            self._failed(c, e)
            self._clone = None
            return
        header = {"step": live.step, "epoch": 0, "epoch_step": 0, "epoch_complete": False, "source_run": "",
                  "model_tensors": st.model_tensors, "aliases": st.aliases,
                  # what the clone checks before any byte moves (the record comes last)
                  "optimizers": [{"class": _state.class_name(o), "groups": [
                      {"params": list(g["params"]), "keys": sorted(str(k) for k in g if k != "params")} for g in gs]}
                      for o, gs in zip(self.optimizers, st.groups)],
                  "state_keys": sorted(self.state)}
        sender = c.sender = self.sender_cls(self.rank, plan, endpoints, self._token, timeout=self.timeout)

        def record() -> bytes:
            self._take_record(c, self.capture.boundary)
            return c.record

        def run() -> None:
            try:
                sender.send(buffers, record, header)
            except BaseException as e:  # noqa: BLE001 (reported in _failed)
                c.error = c.error or e
            finally:
                c.sent.set()
            try:
                if c.error is None:
                    sender.outcome()
            except BaseException as e:  # noqa: BLE001
                c.error = e
            finally:
                sender.close()
                c.seconds = time.perf_counter() - c.t0
                self.clones.append({"step": c.step, "n_clone": c.n_clone, "at": c.at, "seconds": c.seconds,
                                    "bytes": sender.bytes_sent, "error": None if c.error is None else
                                    f"{type(c.error).__name__}: {c.error}"})
                if c.error is not None:
                    self._failed(c, c.error)

        c.thread = threading.Thread(target=run, name=f"deepfreeze-clone-send-r{self.rank}", daemon=True)
        c.thread.start()

    def on_release(self, live: Live) -> None:
        """Before the tensors change: the routes of the clone in flight sent (bounded by
        ``timeout``: past it the connections are shut and the send ends with an error)."""
        c = self._clone
        if c is None or c.live is not live or c.sent.is_set():
            return
        if not c.sent.wait(self.timeout):
            if c.sender is not None:
                c.sender.close()  # the sending threads fail at once: nothing reads the tensors any more
            c.sent.wait(10.0)

    def on_close(self) -> None:
        """The capture closed (:meth:`close`): the listener and the gloo group go."""
        self._closed = True
        if self._server is not None:
            self._server.close()
        if self._group is not None:
            import torch.distributed as dist
            try:
                dist.destroy_process_group(self._group)
            except Exception:  # the default group is gone already
                pass
            self._group = None

    # ------------------------------------------------------------------ the clone
    def _take_record(self, c: _Clone, both: bool) -> None:
        """``c.record``: this rank's state record of the clone (the sender's thread), waited for
        within ``timeout`` (the capture takes it: whole at ``end_iteration`` when ``both``, the
        loop marking its boundaries; else in the post-hook and the next forward's pre-hook)."""
        got = c.live.record(self.timeout)  # raises the DeepFreezeError taking it raised
        if got is None:
            raise CloneTimeoutError(f"source rank {self.rank}: the state record of step {c.step} was not taken "
                                    f"within {self.timeout:g} s (the loop did not reach "
                                    f"{'end_iteration()' if both else 'its next iteration'})")
        c.record = got

    def _failed(self, c: _Clone, e: BaseException) -> None:
        self.failures.append(e)
        log.warning("DeepFreeze: rank %d: the clone of step %d to %d rank(s) failed: %s: %s", self.rank, c.step,
                    c.n_clone, type(e).__name__, e)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the clone in flight (its routes, then the clone's answer); raises its error
        (:class:`~deepfreeze.errors.CloneError`, :class:`~deepfreeze.errors.CloneTimeoutError`,
        :class:`~deepfreeze.errors.ModelMismatchError` ...) if it failed."""
        c = self._clone
        if c is None:
            return
        self.capture.release()
        if c.thread is not None:
            c.thread.join(timeout if timeout is not None else 2 * self.timeout + 10)
        if c.error is not None:
            raise c.error

    def close(self) -> None:
        """Stop serving: the clone in flight finishes (bounded), the listener and hooks go."""
        if self._closed:
            return
        self._closed = True
        try:
            self.capture.release()
            c = self._clone
            if c is not None and c.thread is not None:
                c.thread.join(2 * self.timeout + 10)
        finally:
            self.capture.close()  # the step hook, then on_close: the listener and the group

    def __enter__(self) -> "CloneServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ----------------------------------------------------------------------------- the clone side

def _check_plan(model: torch.nn.Module, plan: ClonePlan, header: dict) -> None:
    """The first hello's plan against this side's model (before anything is allocated): the
    model tensors by FQN, dtype and shape (:func:`_state.check_model`), then every other tensor
    an ``optim.state.<fqn>.<key>`` of a parameter, at most as large as it (or 64 elements)."""
    n_model, aliases = header.get("model_tensors"), header.get("aliases", {})
    if type(n_model) is not int or not 0 <= n_model <= len(plan.tensors) or not isinstance(aliases, dict) \
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        raise CloneError("malformed clone hello header: model_tensors and aliases")
    tensors = [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in plan.tensors]
    _state.check_model(model, tensors, n_model, "the clone source", aliases)
    params = {fqn: t.numel() for fqn, t, is_param in _state.model_entries(model) if is_param}
    for t in plan.tensors[n_model:]:
        fqn = t.name[len("optim.state."):].rpartition(".")[0] if t.name.startswith("optim.state.") else None
        if fqn not in params or t.size > max(params[fqn], 64):
            raise ModelMismatchError(f"the clone source sends optimizer tensor {t.name[:200]!r} {t.dtype}"
                                     f"{list(t.shape)}, which is no optimizer state of a parameter of this model")


def _check_header_optimizers(model: torch.nn.Module, opts: Sequence[torch.optim.Optimizer],
                             state: "dict[str, Any] | None", header: dict, strict: bool) -> None:
    """The optimizers and ``state=`` keys the source's hello names (``optimizers``, ``state_keys``)
    against this side's, before any byte moves (:func:`state_loader._check_optimizers`,
    the restore's own check; a difference: :class:`ModelMismatchError`). A header without them
    (none sent) is checked after the transfer, by the restore path."""
    from .state_loader import _check_optimizers
    optim, keys = header.get("optimizers"), header.get("state_keys")
    if optim is None and keys is None:
        return
    ok = isinstance(optim, list) and isinstance(keys, list) and len(optim) <= 1024 and all(
        isinstance(o, dict) and isinstance(o.get("class"), str) and isinstance(o.get("groups"), list)
        and all(isinstance(g, dict) and isinstance(g.get("params"), list) and isinstance(g.get("keys"), list)
                and all(isinstance(x, str) for x in g["params"] + g["keys"]) for g in o["groups"]) for o in optim) \
        and all(isinstance(k, str) for k in keys)
    if not ok:
        raise CloneError("malformed clone hello header: optimizers and state_keys")
    if opts:
        rec = {"param_groups": [[{**{k: None for k in g["keys"]}, "params": g["params"]} for g in o["groups"]]
                                for o in optim], "a": {"optimizers": [o["class"] for o in optim]}}
        _check_optimizers("the clone source", rec, model, opts, strict, [])
    if strict and state is not None and set(state) != set(keys):
        raise ModelMismatchError(f"the clone source: the state= objects differ: the source sends {sorted(keys)}, this "
                                 f"job gives {sorted(state)}: pass the same state= keys as the CloneServer")


class _Landing:
    """Where the clone's bytes land on this rank, decided at the first hello once the checks
    passed (before any data): a new tensor per tensor of the plan, which becomes the model's
    tensor (``t.data = it``, :func:`state_loader.apply`'s ``received``) or the optimizer's state
    (``load_state_dict`` keeps it) once every check passed, with no copy; a failure before
    that leaves the model and the optimizers as they were. A model tensor the socket cannot
    reach (another device, not contiguous) lands in a host buffer the restore path copies from.

    :meth:`prepare` (a thread, started before the request) makes and faults in the new tensors
    this side can foresee, of its own model's tensors and its optimizers' state, while the
    source has yet to reach its clone step: the page faults of new memory (about 25 ms of CPU per
    63 MB here) are then not paid while the bytes arrive."""

    def __init__(self, model: torch.nn.Module, opts: Sequence[torch.optim.Optimizer]) -> None:
        self.model, self.opts = model, opts
        self.received: dict[str, torch.Tensor] = {}  # model FQN -> the tensor its bytes landed in
        self._ready: dict[str, torch.Tensor] = {}  # name -> a new tensor made by prepare()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _reachable(t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.is_contiguous() and not _state.is_dtensor(t) and t.numel() > 0

    def prepare(self) -> None:
        """Start making the foreseeable tensors (a daemon thread; :meth:`__call__` waits for it)."""
        entries = _state.model_entries(self.model)
        fqn_of: dict[int, str] = {}
        want: dict[str, torch.Tensor] = {}
        for fqn, t, _ in entries:
            if id(t) not in fqn_of and self._reachable(t):
                want[fqn] = t
            fqn_of.setdefault(id(t), fqn)
        for opt in self.opts:
            for p, st in opt.state.items():
                fqn = fqn_of.get(id(p))
                for key, v in st.items() if fqn is not None else ():
                    if isinstance(v, torch.Tensor) and self._reachable(v):
                        want[f"optim.state.{fqn}.{key}"] = v
        specs = {name: (tuple(t.shape), t.dtype) for name, t in want.items()}

        def run() -> None:
            for name, (shape, dtype) in specs.items():
                fresh = torch.empty(shape, dtype=dtype)
                fresh.reshape(-1).view(torch.uint8).numpy()[::4096] = 0  # fault each page in now
                self._ready[name] = fresh
        self._thread = threading.Thread(target=run, name="deepfreeze-clone-prepare", daemon=True)
        self._thread.start()

    def __call__(self, plan: ClonePlan, header: dict) -> dict[int, np.ndarray]:
        if self._thread is not None:
            self._thread.join()
        live = {fqn: t for fqn, t, _ in _state.model_entries(self.model)}
        n_model = header["model_tensors"]
        out: dict[int, np.ndarray] = {}
        for t in plan.tensors:
            if not t.size or (t.id < n_model and not self._reachable(live[t.name])):
                continue  # (nothing, or a host buffer: the wire's default)
            dtype = _state.torch_dtype(t.dtype)
            fresh = self._ready.pop(t.name, None)
            if fresh is None or fresh.dtype != dtype or tuple(fresh.shape) != t.shape:
                fresh = torch.empty(t.shape, dtype=dtype)
            if t.id < n_model:
                self.received[t.name] = fresh
            out[t.id] = fresh.reshape(-1).view(torch.uint8).numpy()
        self._ready.clear()
        return out


def receive(model: torch.nn.Module, optimizer: "torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None",
            address: str, *, token: str | None = None, state: "dict[str, Any] | None" = None,
            timeout: float = 60.0, host: str = "127.0.0.1", allow_remote: bool = False,
            strict: bool = True, fuse_bytes: int | None = None, forwarder_cls: type = Forwarder) -> CloneInfo:
    """Take a clone of the job whose :class:`CloneServer` listens on ``address`` into ``model``,
    ``optimizer`` (one or a sequence, or None) and the ``state=`` objects; returns its
    :class:`~deepfreeze.clone.CloneInfo` (``step``: the source's optimizer steps; ``epoch``,
    ``epoch_step``: the position of the source's :meth:`CloneServer.iterate`, when it used it).

    Collective over this job's ``torch.distributed`` world when it is initialized (any size);
    each rank listens on ``host`` (loopback unless ``allow_remote``) for the source ranks and
    the other clone ranks. ``token``: the token file (default ``$DEEPFREEZE_TOKEN``, the token
    text itself, else the file ``$DEEPFREEZE_TOKEN_FILE`` names, else ``~/.deepfreeze/token``).
    Every wait is bounded by ``timeout``. The bytes land in new tensors that become the model's
    and the optimizer's once every check passed (no copy), each forwarded to the other clone
    ranks as it lands (:mod:`deepfreeze.clone.relay`). ``fuse_bytes``: ignored, with a ``DeprecationWarning`` (the rebuild it
    tuned is gone). ``forwarder_cls``: advanced, a :class:`deepfreeze.clone.relay.Forwarder` subclass
    (tests inject faults). Raises :class:`~deepfreeze.errors.AuthenticationError` (the source
    does not know this token), :class:`~deepfreeze.errors.ModelMismatchError` (another
    architecture, optimizers or ``state=`` keys: found before any byte lands, nothing is
    changed), :class:`~deepfreeze.errors.CloneTimeoutError` / :class:`~deepfreeze.errors.CloneError`
    naming the rank of either job that died or stopped; after any error the model, the
    optimizers, the ``state=`` objects and the RNG are as they were."""
    import torch.distributed as dist
    if fuse_bytes is not None:
        warnings.warn("deepfreeze.torch.clone.receive: fuse_bytes= is ignored since the bytes land in their tensors "
                      "(the rebuild it tuned is gone); leave it out", DeprecationWarning, stacklevel=2)
    opts = [] if optimizer is None else [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    rank, size = rank_and_size("deepfreeze.torch.clone.receive")
    timings = {"request": time.time()}
    tok = net.load_token(token)
    group = _group(timeout)
    listener = CloneListener(rank, tok, host=host, allow_remote=allow_remote, timeout=timeout,
                             forwarder_cls=forwarder_cls)
    landing = _Landing(model, opts)
    landing.prepare()  # the new tensors' page faults while the source reaches its clone step
    try:
        endpoints = [listener.address]
        if group is not None:
            endpoints = [_bcast_from(group, listener.address, j, rank) for j in range(size)]
        answer: dict = {}
        if rank == 0:
            try:
                answer = {"n_src": request(address, tok, endpoints, timeout=timeout)}
            except DeepFreezeError as e:
                answer = {"type": type(e).__name__, "error": str(e)}
                if group is None:
                    raise
                _bcast_json(group, answer, rank)
                raise
        answer = _bcast_json(group, answer, rank)
        timings["requested"] = time.time()
        if "n_src" not in answer:
            cls = error_class(answer.get("type")) or CloneError
            raise cls(f"clone rank 0's request failed: {answer.get('error')}")
        error: BaseException | None = None

        def accept(plan: ClonePlan, header: dict) -> dict[int, np.ndarray]:
            _check_plan(model, plan, header)
            _check_header_optimizers(model, opts, state, header, strict)
            return landing(plan, header)
        try:
            listener.receive(int(answer["n_src"]), accept, peers=endpoints if size > 1 else None)
        except DeepFreezeError as e:
            error = e
        timings["received"] = time.time()
        if listener.first_data_at is not None:
            timings["first_data"] = listener.first_data_at
        # -- agreement: every rank learns every other's outcome before anything is loaded
        try:
            failed = _agree(group, error, rank, size, timeout)
        except CloneTimeoutError:
            if error is None:
                raise
            failed = []  # a rank died: this rank's own error names it
        if error is not None or failed:
            err = error or CloneError(f"clone rank {rank}: clone rank(s) {failed} of this job did not receive the "
                                      "clone (see their error); nothing was loaded")
            listener.finish(err)
            raise err
        plan = listener.plan
        assert plan is not None
        arrays: dict[str, np.ndarray] = {}
        for t in plan.tensors:
            arrays[t.name] = listener.buffers[t.id].view(numpy_dtype(t.dtype)).reshape(t.shape)
        for r in range(plan.n_src):
            arrays[f"{_state.RANK_PREFIX}{r}"] = np.frombuffer(listener.records[r], np.uint8)
        header = listener.header
        step = header.get("step")
        if type(step) is not int or step < 0:
            raise CloneError("malformed clone header: no step")
        manifest = {"framework": "torch", "model_tensors": header["model_tensors"], "world_size": plan.n_src,
                    "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in plan.tensors]}
        ck = Checkpoint(name="clone", version=step, step=step, epoch=0, level="clone", arrays=arrays,
                        manifest=manifest)
        from .state_loader import apply
        try:
            applied = apply(ck, model, opts, state=state, rank=rank, world_size=size, rng=True, strict=strict,
                            received=landing.received)
        except DeepFreezeError as e:
            listener.finish(e)
            raise
        listener.finish(None)
        rec = applied.record or _state.decode_record(listener.records[0], "clone record of source rank 0")
        loop = rec.get("a", {}).get("loop") if isinstance(rec.get("a"), dict) else None
        if isinstance(loop, dict):
            loop = _loop.check_record(loop, "the clone source")
            header = {**header, "epoch": loop["pass"], "epoch_step": loop["yielded"],
                      "epoch_complete": bool(loop.get("done"))}
        info = CloneInfo.from_header(header)
        timings["loaded"] = time.time()
        info.timings.update(timings, bytes_received=listener.bytes_received, bytes_relayed=listener.bytes_relayed,
                            bytes_forwarded=listener.bytes_forwarded, state_bytes=plan.nbytes)
        return info
    finally:
        listener.close()
        if group is not None:
            try:
                dist.destroy_process_group(group)
            except Exception:
                pass


def _bcast_from(group: Any, text: str, root: int, rank: int) -> str:
    """``root``'s string on every rank of ``group``."""
    import torch.distributed as dist
    data = text.encode() if rank == root else b""
    n = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(n, src=root, group=group)
    buf = torch.zeros(int(n.item()), dtype=torch.uint8)
    if rank == root:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src=root, group=group)
    return bytes(buf.numpy()).decode()


def _agree(group: Any, error: "BaseException | None", rank: int, size: int, timeout: float) -> list[int]:
    """The clone ranks that failed (an all-reduce of one flag per rank over ``group``); a rank
    that died or never answers within the group's timeout is a :class:`CloneTimeoutError`."""
    import torch.distributed as dist
    if group is None:
        return []
    flags = torch.zeros(size, dtype=torch.int64)
    flags[rank] = 0 if error is None else 1
    try:
        dist.all_reduce(flags, group=group)
    except RuntimeError as e:
        raise CloneTimeoutError(f"clone rank {rank}: not every rank of this job said whether it received the clone "
                                f"within {timeout:g} s (one died, or is stuck): {str(e)[:300]}") from e
    return [j for j in range(size) if flags[j] and j != rank]
