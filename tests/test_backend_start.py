"""Issue 42, item 6: no training step waits for the node's backend to start.

:meth:`deepfreeze.run.Run.begin` (async mode, the built-in engine) starts or finds the node's
backend in a background thread (:func:`deepfreeze.backend.start_async`), so the first checkpoint's
engine only connects to a running backend; and the run's first checkpoint that stalls the step
over :data:`deepfreeze.run.STALL_WARN` says, in one WARNING, what took the time.

One process, the torch Checkpointer, the default configuration but for the directories (in
tmp_path). No assertion depends on timing: where a slow part is needed, it is forced (the start
lock held by the test until the training thread waits, a Checkpointer subclass that sleeps in its
copy), and only lower bounds of it are relied on.
"""
from __future__ import annotations

import fcntl
import logging
import os
import threading
import time

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (scripts/setup.sh installs torch==2.13.0, CPU)")

import deepfreeze.torch as dft  # noqa: E402
from deepfreeze import backend  # noqa: E402
from deepfreeze.run import STALL_WARN  # noqa: E402
from deepfreeze.torch.capture import Capture  # noqa: E402


def where(d) -> dict:
    return {"mode": "async", "scratch": str(d / "s"), "persistent": str(d / "p")}


def model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train(model, opt, steps: int) -> None:
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    for _ in range(steps):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


class StartLock:
    """The backend start lock of ``scratch`` (``<socket>.lock``), held by the test: no backend for
    that scratch can be started until :meth:`release`."""

    def __init__(self, scratch: str) -> None:
        self.path = backend.socket_path(scratch) + ".lock"
        self.f = open(self.path, "a+")
        fcntl.flock(self.f, fcntl.LOCK_EX)

    def release(self) -> None:
        if not self.f.closed:
            fcntl.flock(self.f, fcntl.LOCK_UN)
            self.f.close()


def release_when_waited_for(start: backend.BackendStart, lock: StartLock, hold: float) -> threading.Thread:
    """Release ``lock`` ``hold`` seconds after a thread began waiting for ``start`` (or after 60 s)."""
    def run() -> None:
        deadline = time.monotonic() + 60
        while start.waiting == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(hold)
        lock.release()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def stop_backend(scratch: str) -> None:
    backend.stop(scratch, timeout=10, veloc=False)


def test_backend_started_off_the_training_thread_when_the_checkpointer_is_built(tmp_path):
    """The Checkpointer is built while no backend can start (the start lock held): its construction
    does not wait for one; the start goes on in ``deepfreeze-backend-start``, which spawns the
    backend once the lock is free. The first checkpoint's engine connects to that backend and
    starts none itself; the connection held for the start is let go once the engine holds its own."""
    cfg = where(tmp_path)
    model, opt = model_and_opt()
    lock = StartLock(cfg["scratch"])
    try:
        ck = dft.Checkpointer(model, opt, name="bs", every_n_steps=2, **cfg)
        start = ck._run.backend_start
        assert start is not None and not start.done(), "the Checkpointer waited for the backend's start"
        assert start.thread.name == "deepfreeze-backend-start" and start.thread is not threading.current_thread()
    finally:
        lock.release()
    try:
        assert start.wait(120) and start.error is None, start.error
        assert start.started == start.pid is not None  # this start spawned it (in its own thread)
        assert start.client is not None  # held until the engine connects: the backend stays up meanwhile
        train(model, opt, 5)  # checkpoints v2 and v4 (the first builds the engine)
        assert ck._run.backend_start is None and start.client is None
        client = ck.engine._backend
        assert client.pid == start.pid and client.started is None, \
            "the training thread started a backend of its own in the first checkpoint"
        ck.wait()
        assert [t["version"] for t in ck.timings] == [2, 4]
    finally:
        ck.close()
        stop_backend(cfg["scratch"])
    assert dft.load(name="bs", **cfg)["0.weight"].shape == (16, 16)


def test_first_checkpoint_during_the_start_uses_that_backend(tmp_path):
    """A first checkpoint that comes while the backend is still starting waits for that start (in
    new_engine, bounded) and connects to the backend it started: one backend, none started by the
    training thread."""
    cfg = where(tmp_path)
    model, opt = model_and_opt()
    lock = StartLock(cfg["scratch"])
    try:
        ck = dft.Checkpointer(model, opt, name="bs", every_n_steps=1, **cfg)
        start = ck._run.backend_start
        release_when_waited_for(start, lock, STALL_WARN + 0.05)
        train(model, opt, 3)  # v1's engine is built while the start waits for the lock
    finally:
        lock.release()
    try:
        assert start.done() and start.error is None and start.started == start.pid is not None
        client = ck.engine._backend
        assert client.pid == start.pid and client.started is None
    finally:
        ck.close()
        stop_backend(cfg["scratch"])


def test_the_first_slow_checkpoint_says_why_once(tmp_path, caplog):
    """One WARNING per run: the first checkpoint whose stall exceeds STALL_WARN names its parts
    (here the backend's start, waited for at least as long as the test held the start lock); the
    second checkpoint logs no second line."""
    cfg = where(tmp_path)
    model, opt = model_and_opt()
    lock = StartLock(cfg["scratch"])
    try:
        ck = dft.Checkpointer(model, opt, name="bs", every_n_steps=1, overlap=False, **cfg)
        release_when_waited_for(ck._run.backend_start, lock, STALL_WARN + 0.05)
        with caplog.at_level(logging.WARNING, logger="deepfreeze"):
            train(model, opt, 2)
    finally:
        lock.release()
    try:
        lines = [r.getMessage() for r in caplog.records if "first checkpoint stalled" in r.getMessage()]
        assert len(lines) == 1, lines
        assert lines[0].startswith("DeepFreeze: 'bs' v1: the first checkpoint stalled the step ")
        parts = dict(reversed(p.split(" s ", 1)) for p in lines[0].split(": ", 3)[-1].split(", "))
        assert float(parts["waiting for the node's backend to start"]) >= STALL_WARN + 0.05 - 0.005, lines[0]
        assert set(parts) <= {"waiting for the node's backend to start", "building the engine", "capturing",
                              "waiting for the background copy", "handing off to the engine"}, lines[0]
    finally:
        ck.close()
        stop_backend(cfg["scratch"])


class SlowCopy(Capture):
    """A Checkpointer's capture whose copy takes at least ``delay`` seconds (in the post-hook: overlap=False)."""

    delay = STALL_WARN + 0.05

    def _copy(self, items, buf):
        time.sleep(self.delay)
        return super()._copy(items, buf)


def test_a_slow_capture_is_named_and_said_once(tmp_path, caplog, monkeypatch):
    cfg = where(tmp_path)
    model, opt = model_and_opt()
    monkeypatch.setattr("deepfreeze.torch.checkpointer.Capture", SlowCopy)
    ck = dft.Checkpointer(model, opt, name="bs", every_n_steps=2, overlap=False, **cfg)
    try:
        with caplog.at_level(logging.WARNING, logger="deepfreeze"):
            train(model, opt, 6)  # v2, v4, v6: each stalls over STALL_WARN
        assert len(ck.timings) >= 2
        lines = [r.getMessage() for r in caplog.records if "first checkpoint stalled" in r.getMessage()]
        assert len(lines) == 1, lines
        assert lines[0].startswith("DeepFreeze: 'bs' v2: the first checkpoint stalled the step ")
        assert "s capturing" in lines[0]
    finally:
        ck.close()
        stop_backend(cfg["scratch"])


def test_sync_mode_starts_no_backend(tmp_path):
    cfg = dict(where(tmp_path), mode="sync")
    model, opt = model_and_opt()
    with dft.Checkpointer(model, opt, name="bs", every_n_steps=1, **cfg) as ck:
        assert ck._run.backend_start is None
        train(model, opt, 2)
    assert backend.status(cfg["scratch"], veloc=False)["state"] == "none"


def test_a_run_closed_before_its_first_checkpoint_lets_the_backend_go(tmp_path):
    """A Checkpointer closed before any checkpoint releases the held connection (now or when the
    start finishes), so the backend exits once idle (DEEPFREEZE_BACKEND_IDLE=2 in the tests)."""
    cfg = where(tmp_path)
    model, opt = model_and_opt()
    ck = dft.Checkpointer(model, opt, name="bs", every_n_steps=100, **cfg)
    start = ck._run.backend_start
    ck.close()
    assert ck._run.backend_start is None
    assert start.wait(120) and start.client is None
    path = backend.socket_path(cfg["scratch"])  # watched without connecting (a client keeps it up)
    deadline = time.monotonic() + 60
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(path), "the backend stayed up: the start's connection was never let go"


def test_a_child_forked_while_the_start_lock_is_held_does_not_keep_it(tmp_path):
    """A process forked (a DataLoader worker) while a background thread holds the backend start lock
    (``start_async`` starting the backend) lets go of its copy of the lock's descriptor: once the
    thread leaves the lock, another process can take it while the child still lives (a ``flock``
    belongs to the open file, which the child would otherwise share until it exits)."""
    path = backend.socket_path(str(tmp_path / "s")) + ".lock"
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with backend._start_lock(path, 30):
            inside.set()
            leave.wait(60)
    t = threading.Thread(target=hold)
    t.start()
    assert inside.wait(60)
    r, w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child (its fork handlers have run): says so, lives until the parent closes the pipe
        os.close(w)
        os.write(ready_w, b"1")
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"1"
        os.close(ready_r)
        leave.set()
        t.join(60)
        with open(path) as f:  # another open file of the lock: free although the child lives
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(f, fcntl.LOCK_UN)
    finally:
        os.close(w)
        os.waitpid(pid, 0)
