"""deepfreeze.priority: background work at low CPU and I/O priority, within a bound (issue 34).

The lanes with real threads in this process; then a real engine and backend as the unprivileged
user ``nobody`` (and as root), their threads' priorities read from ``/proc`` and ``ioprio_get``."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from deepfreeze import _native as nat
from deepfreeze.priority import BACKGROUND_IOPRIO, DEFERRAL, Lanes, thread_priority

pytestmark = pytest.mark.skipif(not nat.available("ioprio_get"), reason="ioprio_get: Linux x86_64/aarch64")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BE = nat.IOPRIO_CLASS_BE


def proc_nice(pid: int, tid: int) -> int:
    """Field 19 (nice) of /proc/<pid>/task/<tid>/stat."""
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def test_lanes_order_bound_boost_and_sections():
    base_nice, _ = thread_priority()
    lanes = Lanes("dftest-lanes")
    try:
        low, normal = lanes.tids["low"], lanes.tids["normal"]
        assert proc_nice(os.getpid(), low) == min(19, base_nice + 10)
        assert nat.ioprio_get(nat.IOPRIO_WHO_PROCESS, low) == BACKGROUND_IOPRIO
        assert proc_nice(os.getpid(), normal) == base_nice
        ran: list[tuple[str, int]] = []

        def job(name: str, gate: threading.Event | None = None) -> int:
            ran.append((name, threading.get_native_id()))
            if gate is not None:
                assert gate.wait(30)
            return len(ran)

        # normal work: no interval known, nobody waits -> the low lane
        assert lanes.submit(job, "a").result(30) == 1
        # someone waits (the queue is full): queued jobs go to the normal lane, the running one is raised
        gate = threading.Event()
        b = lanes.submit(job, "b", gate)
        while len(ran) < 2:
            time.sleep(0.005)
        c, d = lanes.submit(job, "c"), lanes.submit(job, "d")
        assert lanes.hurry() == 2
        try:
            assert nat.ioprio_parts(nat.ioprio_get(nat.IOPRIO_WHO_PROCESS, low))[1] < 7  # b runs on, raised
        finally:
            gate.set()
        assert [f.result(30) for f in (b, c, d)] == [2, 3, 4]  # in order, one at a time
        assert [who for _, who in ran] == [low, low, normal, normal]
        # the time bound: a job more than one interval old runs on the normal lane
        lanes.interval = 0.05
        assert lanes.submit(job, "e", t=time.monotonic() - 1).result(30) == 5 and ran[-1][1] == normal
        # a running low-lane job passing its deadline is raised by the normal lane (I/O priority)
        gate = threading.Event()
        f = lanes.submit(job, "f", gate, interval=0.2)
        try:
            time.sleep(0.6)
            assert ran[-1] == ("f", low) and lanes.stats["boosted"] == 2
            assert nat.ioprio_get(nat.IOPRIO_WHO_PROCESS, low) != BACKGROUND_IOPRIO
        finally:
            gate.set()
        f.result(30)
        lanes.interval = None  # no interval known: what follows would stay on the low lane
        # a section others wait on (a commit.lock) runs on the normal lane; errors reach the caller
        g = lanes.submit(lambda: lanes.run_normal(threading.get_native_id))
        assert g.result(30) == normal and lanes.stats["sections"] == 1
        with pytest.raises(ZeroDivisionError):
            lanes.submit(lambda: lanes.run_normal(lambda: 1 / 0)).result(30)
        time.sleep(0.05)  # the low lane lowered itself again after the raised job
        assert nat.ioprio_get(nat.IOPRIO_WHO_PROCESS, low) == BACKGROUND_IOPRIO
        assert lanes.stats["low_jobs"] == 5 and lanes.stats["urgent_jobs"] == 3
    finally:
        lanes.shutdown()


def test_deferral_ends_early_enough_to_end_within_half_an_interval():
    """The bound counts the last job's pace: a job whose predecessor took longer than half the
    interval runs on the normal lane at once; one that fits stays low; a queued job behind the
    head pulls the head forward (both must end half an interval after their calls)."""
    lanes = Lanes("dftest-pace")
    try:
        low, normal = lanes.tids["low"], lanes.tids["normal"]
        who = lambda: threading.get_native_id()  # noqa: E731
        assert lanes.submit(time.sleep, 0.3).result(30) is None  # pace 0.3 s, on the low lane
        assert lanes.snapshot()["pace_s"] >= 0.3 and lanes.stats["low_jobs"] == 1
        # an interval of 10 s: 0.3 s of work fits -> low lane
        assert lanes.submit(who, interval=10.0).result(30) == low
        time.sleep(0.01)
        lanes.submit(time.sleep, 0.3).result(30)
        # an interval of 0.5 s: at the last pace (0.3 s) it would end after half of it (0.25 s),
        # though within the whole -> normal lane at once
        assert DEFERRAL == 0.5 and lanes.submit(who, interval=0.5).result(30) == normal
        # the head alone (interval 100 s) would stay low; a job queued behind it (interval 0.9 s,
        # two jobs of the last pace, 0.5 s, ahead of its end) pulls the head to the normal lane
        urgent = lanes.stats["urgent_jobs"]
        hold = lanes.submit(time.sleep, 0.5)  # holds the turn; its 0.5 s becomes the pace
        t = time.monotonic()
        h = lanes.submit(who, t=t, interval=100.0)
        lanes.submit(time.sleep, 0.01, t=t, interval=0.9)
        hold.result(30)
        assert h.result(30) == normal and lanes.stats["urgent_jobs"] >= urgent + 1
    finally:
        lanes.shutdown()


class LowLaneLooksLate(Lanes):
    """The interleaving of a loaded machine, pinned: the normal lane looks at a new job first (its
    deadline has not come: not its job), and the low lane only after the deadline has passed (the
    job is urgent by then: not its job either). Injected at the lanes' one time-dependent choice,
    :meth:`Lanes._urgent`; every other part is the real class."""

    def __init__(self, *args, **kwargs):
        self.normal_looked = threading.Event()
        self.late = 0.0  # set by the test: the low lane looks this long after the job's deadline
        super().__init__(*args, **kwargs)

    def _urgent(self, job, now):
        if not self.late:
            return super()._urgent(job, now)
        if threading.get_native_id() == self.tids.get("normal"):
            self.normal_looked.set()
            self._cond.notify_all()
            return super()._urgent(job, now)
        self._cond.wait_for(self.normal_looked.is_set)  # releases the lock: the normal lane looks first
        time.sleep(max(0.0, self._deadline(job) - time.monotonic()) + self.late)  # holding the lock
        self.late = 0.0
        return super()._urgent(job, time.monotonic())


def test_a_job_whose_deadline_passes_between_the_lanes_looks_runs():
    """Both lanes decline the head, the normal lane before its deadline and the low lane after it
    (found as a hang of tests/test_engine.py::test_backpressure_bounds_pending_flushes beside other
    tests: the training thread waiting for a version no lane ran): the normal lane looks again
    when the deadline comes, and the job runs there."""
    lanes = LowLaneLooksLate("dftest-late")
    try:
        lanes.late = 0.1
        fut = lanes.submit(threading.get_native_id, interval=0.4)  # deadline: 0.2 s after now
        assert fut.result(60) == lanes.tids["normal"]
        assert lanes.normal_looked.is_set() and lanes.late == 0.0  # both lanes looked, as pinned
    finally:
        lanes.shutdown()


def test_background_priority_normal_is_one_thread_at_normal_priority():
    lanes = Lanes("dftest-normal", low=False)
    try:
        assert list(lanes.tids) == ["normal"]
        assert lanes.submit(thread_priority).result(30) == thread_priority()
    finally:
        lanes.shutdown()


# Runs a real engine and its backend (async mode) as the user it is started as, or as nobody
# (root drops to it once everything is imported), and writes what it saw to argv[2].
WORKER = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    from deepfreeze import Config, _native as nat, backend
    from deepfreeze.engine import Engine
    from deepfreeze.loader import load
    from deepfreeze.shardplan import ShardPlan, TensorSpec
    root, out, user = sys.argv[1], sys.argv[2], sys.argv[3]
    if user == "nobody":
        os.setgroups([]); os.setgid(65534); os.setuid(65534)
    os.environ["DEEPFREEZE_RUNTIME_DIR"] = os.path.join(root, "run")
    os.environ["DEEPFREEZE_BACKEND_IDLE"] = "1"
    W = nat.IOPRIO_WHO_PROCESS

    def nice(pid, tid):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[16])

    def threads(pid, tids):
        return {lane: [nice(pid, tid), nat.ioprio_get(W, tid)] for lane, tid in tids.items()}

    arrays = [np.arange(1 << 20, dtype=np.float32) * (v + 1) for v in range(5)]  # 4 MiB per version
    plan = ShardPlan.build([TensorSpec(0, "w", "float32", (1 << 20,))], 1)
    cfg = Config.load(None, mode="async", scratch=os.path.join(root, "scratch"),
                      persistent=os.path.join(root, "pfs"))
    if user == "nobody":  # nobody may not exec this interpreter (under /root): its backend is forked
        os.makedirs(cfg.scratch, 0o700)
        path = backend.socket_path(cfg.scratch)
        if os.fork() == 0:
            os.setsid()
            try:
                backend.main(["--socket", path])
            finally:
                os._exit(0)
        for _ in range(600):
            if os.path.exists(path):
                break
            time.sleep(0.05)
    e = Engine(cfg, "job", 0, plan)
    res = {"uid": os.getuid(), "main": [nice(os.getpid(), os.getpid()), nat.ioprio_get(W, os.getpid())]}
    # normal work: one version, nobody waits for it, no interval known yet
    e.checkpoint(1, [arrays[1]], step=1, epoch=0)
    client = backend.BackendClient(cfg.scratch, start=False)  # (no import after dropping to nobody)
    for _ in range(600):
        b = client.request({"op": "status"})
        if b["pending"] == 0 and b["jobs"] == 1:
            break
        time.sleep(0.05)
    res["normal_work"] = {"writer": e.priority, "backend": b["priority"]}
    res["writer_threads"] = threads(os.getpid(), e.priority["tids"])
    res["backend_threads"] = threads(b["pid"], b["priority"]["tids"])
    res["backend_all_nice"] = {t: nice(b["pid"], int(t)) for t in os.listdir(f"/proc/{b['pid']}/task")}
    # the bound: three calls back to back (an interval of microseconds; max_inflight = 2 reached)
    for v in (2, 3, 4):
        e.checkpoint(v, [arrays[v]], step=v, epoch=0)
    e.wait()
    b = client.request({"op": "status"})
    client.close()
    res["bound"] = {"writer": e.priority, "backend": b["priority"], "write_waits": e.write_waits}
    res["writer_threads_after"] = threads(os.getpid(), e.priority["tids"])
    e.close()
    res["restored"] = [bool(np.array_equal(next(iter(load(cfg, "job", v).arrays.values())), arrays[v]))
                       for v in (1, 4)]
    with open(out, "w") as f:
        json.dump(res, f)
""")


@pytest.mark.parametrize("user", ["nobody", "self"])
def test_engine_and_backend_yield_within_the_bound(shared_dir, user):
    """Normal work runs on the low lanes (nice +10, best-effort 7: /proc and ioprio_get of the
    writer's and the backend's threads); past the bound (calls microseconds apart, a full queue,
    wait()) versions run on the normal lanes; every other backend thread stays at normal
    priority (the memory-tier copies run there); the versions restore bit-exact."""
    work = pathlib.Path(shared_dir) / "work"  # reachable by nobody, and a short socket path
    work.mkdir(mode=0o700)
    if user == "nobody":
        from _util import nobody_ids
        uid, gid = nobody_ids()
        os.chown(work, uid, gid)
    out = work / "result.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("DEEPFREEZE_RUNTIME_DIR", None)
    p = subprocess.run([sys.executable, "-c", WORKER, str(work), str(out), user], capture_output=True,
                       text=True, timeout=180, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    if user == "nobody":
        assert res["uid"] == uid
    base = res["main"][0]
    low_io, normal_io = [BACKGROUND_IOPRIO, BACKGROUND_IOPRIO], [res["main"][1]] * 2
    assert [res["writer_threads"][lane] for lane in ("low", "normal")] == [
        [min(19, base + 10), low_io[0]], [base, normal_io[0]]]
    assert [res["backend_threads"][lane] for lane in ("low", "normal")] == [
        [min(19, base + 10), low_io[0]], [base, normal_io[0]]]
    low_tid = str(res["normal_work"]["backend"]["tids"]["low"])
    assert {t: n for t, n in res["backend_all_nice"].items() if t != low_tid} == \
        {t: base for t in res["backend_all_nice"] if t != low_tid}
    for side in ("writer", "backend"):  # the first version: nothing waited, no interval: low lane
        got = res["normal_work"][side]
        assert (got["low_jobs"], got["urgent_jobs"]) == (1, 0), (side, got)
        assert res["bound"][side]["urgent_jobs"] >= 1, (side, res["bound"])
    assert res["writer_threads_after"]["low"] == [min(19, base + 10), low_io[0]]  # lowered again
    assert res["restored"] == [True, True]
