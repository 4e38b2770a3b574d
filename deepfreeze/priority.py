"""Background work at a lower priority, within a bound: the writer's and the flusher's two lanes.

Background work (a rank's scratch write and its CRC32s in the engine's writer thread, the flush
to persistent in the node's backend) runs at a lower CPU priority (nice +10, capped at 19) and a
lower I/O priority (best-effort class, level 7) than training. Everything the training thread
waits for runs at normal priority: the capture copy and the hand-off (the training thread
itself), the memory-tier copy (the backend's connection thread; the writer's memory-tier jobs are
submitted urgent), the sections that hold a version's ``commit.lock`` which other nodes' flushes
wait on (the decision and the finalize: :meth:`Lanes.run_normal`), and any job once the deferral
reaches its bound.

**The bound.** A job is *urgent*, and runs at normal priority, when it is picked while

* it would otherwise end later than half an interval after its call:
  ``now + (k + 1) * d >= t + DEFERRAL * interval`` for itself or any job queued behind it, ``t``
  the monotonic time of the checkpoint call that made that job (``CLOCK_MONOTONIC``: one clock for
  every process of a node), ``interval`` the time between that call and the one before it (the
  engine learns its interval from successive ``checkpoint`` calls; the first version has none),
  ``k`` the number of jobs ahead of that one (the running one included), ``d`` the wall time of
  the last job run (its pace; 0 before the first) and :data:`DEFERRAL` = 0.5. So the deferral
  ends early enough that, at the last job's pace, every queued version is done half an interval
  after its call, and the other half is slack for a pace misjudged by up to 2x before the next
  version would wait for this one. Work that fits in the gaps of an interval yields for a good
  part of it; work that takes half an interval or more (a large model on a machine training flat
  out) runs at normal priority from the start instead of first losing an interval at nice +10
  (measured, gpt2 at 2 ranks here: time to durable 10.4 s with the plain one-interval bound,
  against 7.1-7.7 s for DCP's async checkpointers). This is within the bound asked of it: a job
  more than one interval behind is always urgent; or
* someone waits for it (:meth:`Lanes.hurry`): the queue is full (a ``checkpoint`` call finds
  ``max_inflight`` versions in flight; the writer finds ``max_pending_flushes`` flushes pending
  and polls the backend with ``need``), a memory-tier put found no free slot, or ``wait()``; or
* it was submitted urgent (memory-tier hand-offs; every job with ``background_priority = normal``).

**Why two threads (the scheme, for non-root users).** An unprivileged thread can raise its nice
value but never lower it again (``EACCES`` without ``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` above
the default 0; ``SCHED_IDLE`` cannot be left either). So a :class:`Lanes` has two threads: the
*low* lane ``<name>`` lowers itself once, when it starts; the *normal* lane ``<name>-urgent``
keeps the process's priority. Jobs still run one at a time and in submission order (a turn
shared by both threads under one condition variable): whichever lane the head job's urgency
names takes it when the previous job is done; the normal lane, having left a head to the low lane
because its deadline has not come, looks again at that deadline (the low lane may look only after
it, and leave the job, urgent by then, to the normal lane). A job already running on the low lane when it
becomes urgent (its deadline passes, or someone waits for it) cannot move: the normal lane
raises that thread's **I/O** priority back to normal at once (``ioprio_set`` on its thread id:
allowed within the same user, either way between the best-effort and idle classes) and tries
its nice value (works only when privileged: root, ``CAP_SYS_NICE`` or ``RLIMIT_NICE``); counted
as ``boosted``; the low lane lowers itself again before its next job. So past the bound at most
the remainder of one job runs at the low CPU priority, and none at the low I/O priority.

**Best-effort 7, not the idle class.** An idle-class thread gets the disk only when no other
I/O is queued for a grace period; beside a neighbour that keeps the disk busy (the measured
"beside real jobs" case) it may get none at all, and while it waits it can hold file-system
locks (a journal handle, an inode lock) that others, training among them, then wait for.
Best-effort level 7 is the lowest level that still always progresses. I/O priority acts only
where the block device's scheduler honours it (BFQ; mq-deadline from Linux 5.14); with ``none``
(many NVMe and virtual disks) only the CPU priority acts. Buffered writes are mostly written
back by the kernel's flusher threads, at their own priority: the I/O class acts on reads, on
``fsync`` and on the writes the job itself waits for.

Counters (:attr:`Lanes.stats`): ``low_jobs`` and ``urgent_jobs`` (jobs run by each lane),
``boosted`` (low-lane jobs raised while running), ``sections`` (critical sections handed to the
normal lane); :attr:`Lanes.tids` the two threads' ids (``/proc/self/task/<tid>/stat``). With
``low=False`` (``background_priority = normal``) or ``one_thread`` (the VeloC engine, whose calls
must stay on one thread) there is one thread: lowered when ``low``, and every job runs there.
"""
from __future__ import annotations

import atexit
import collections
import concurrent.futures
import os
import threading
import time
import weakref
from typing import Any, Callable, Iterable

from ._native import (IOPRIO_CLASS_BE, IOPRIO_CLASS_NONE, IOPRIO_WHO_PROCESS, available, ioprio_get, ioprio_parts,
                      ioprio_set, ioprio_value)

__all__ = ["Lanes", "BACKGROUND_NICE", "DEFERRAL", "BACKGROUND_IOPRIO", "PRIORITIES", "lower_thread", "thread_priority",
           "normal_ioprio"]

#: how much the low lane raises its nice value (capped at 19)
BACKGROUND_NICE = 10
#: the low lane's I/O priority: best-effort class, level 7 (the lowest best-effort level)
BACKGROUND_IOPRIO = ioprio_value(IOPRIO_CLASS_BE, 7)
#: deferred work should be done this fraction of an interval after its checkpoint call (module docstring)
DEFERRAL = 0.5
#: values of the ``background_priority`` key
PRIORITIES = ("low", "normal")


def thread_priority(tid: int | None = None) -> tuple[int, int | None]:
    """``(nice, ioprio)`` of thread ``tid`` (default: the calling thread); ioprio None where
    ``ioprio_get`` is not available."""
    tid = tid or threading.get_native_id()
    nice = os.getpriority(os.PRIO_PROCESS, tid)
    if not available("ioprio_get"):
        return nice, None
    return nice, ioprio_get(IOPRIO_WHO_PROCESS, tid)


def normal_ioprio(nice: int, ioprio: int | None) -> int:
    """The explicit I/O priority a thread had at ``(nice, ioprio)`` before it was lowered: its
    own value, or for class NONE the best-effort level the kernel derives from its nice value."""
    if ioprio is not None and ioprio_parts(ioprio)[0] != IOPRIO_CLASS_NONE:
        return ioprio
    return ioprio_value(IOPRIO_CLASS_BE, min(7, max(0, (nice + 20) // 5)))


def lower_thread(base_nice: int | None = None) -> bool:
    """Lower the calling thread (Linux: per thread): nice ``base_nice + 10`` (default: its current
    value + 10; capped at 19) and I/O priority best-effort 7. Best effort: False if either was
    refused (an unknown architecture, a seccomp filter)."""
    tid = threading.get_native_id()
    ok = True
    try:
        base = os.getpriority(os.PRIO_PROCESS, tid) if base_nice is None else base_nice
        os.setpriority(os.PRIO_PROCESS, tid, min(19, base + BACKGROUND_NICE))
    except (OSError, AttributeError):
        ok = False
    try:
        ioprio_set(IOPRIO_WHO_PROCESS, tid, BACKGROUND_IOPRIO)
    except OSError:
        ok = False
    return ok


class _Job:
    __slots__ = ("fn", "args", "future", "t", "interval", "tag", "urgent")

    def __init__(self, fn: Callable, args: tuple, t: float, interval: float | None, tag: Any, urgent: bool) -> None:
        self.fn, self.args, self.future = fn, args, concurrent.futures.Future()
        self.t, self.interval, self.tag, self.urgent = t, interval, tag, urgent


_LIVE: "weakref.WeakSet[Lanes]" = weakref.WeakSet()


@atexit.register
def _drain_at_exit() -> None:  # like ThreadPoolExecutor: queued background work finishes at exit
    for lanes in list(_LIVE):
        lanes.shutdown(wait=True)


def _forget_lanes() -> None:  # a forked child has none of the parent's lane threads (nor their locks' holders)
    _LIVE.clear()


os.register_at_fork(after_in_child=_forget_lanes)


class Lanes:
    """Jobs run one at a time, in submission order, each on the low or the normal lane (see the
    module docstring). ``submit`` returns a :class:`concurrent.futures.Future`; ``shutdown``
    finishes the queued jobs. The threads are daemons; with ``drain_at_exit`` the jobs still
    queued when the interpreter exits are finished first (as a ``ThreadPoolExecutor``'s)."""

    def __init__(self, name: str, *, low: bool = True, one_thread: bool = False, drain_at_exit: bool = True) -> None:
        self.name, self.low = name, low
        self.two = low and not one_thread
        #: seconds between submissions, for jobs submitted without their own ``interval``
        self.interval: float | None = None
        self.stats = {"low_jobs": 0, "urgent_jobs": 0, "boosted": 0, "sections": 0}
        #: thread id of each lane: ``{"low": tid, "normal": tid}`` (one entry with one thread)
        self.tids: dict[str, int] = {}
        self._cond = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._running: _Job | None = None
        self._running_lane: str | None = None
        self._boosted = False  # the running low-lane job was raised
        self._sections: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]] = collections.deque()
        self._stop = False
        self._pace = 0.0  # wall seconds of the last job run: the deferral's estimate of a job's length
        self._base: tuple[int, int | None] = thread_priority()  # the process's own: what "normal" means
        lanes = [("low" if self.two else ("low" if low else "normal"), name)]
        if self.two:
            lanes.append(("normal", f"{name}-urgent"))
        self._threads = [threading.Thread(target=self._loop, args=(lane,), name=n, daemon=True) for lane, n in lanes]
        for th in self._threads:
            th.start()
        with self._cond:  # started and lowered before the first job (its tid readable at once)
            self._cond.wait_for(lambda: len(self.tids) == len(self._threads), 30.0)
        if drain_at_exit:
            _LIVE.add(self)

    # -- callers
    def submit(self, fn: Callable, *args: Any, t: float | None = None, interval: float | None = None,
               tag: Any = None, urgent: bool = False) -> concurrent.futures.Future:
        """Queue ``fn(*args)``: ``t`` (monotonic, default now) and ``interval`` (default
        :attr:`interval` when it is picked) set its deadline ``t + interval``; ``tag`` names it to
        :meth:`hurry`; ``urgent`` runs it on the normal lane whatever its age."""
        job = _Job(fn, args, time.monotonic() if t is None else t, interval, tag, urgent)
        with self._cond:
            if self._stop:
                raise RuntimeError(f"{self.name}: cannot submit after shutdown")
            self._queue.append(job)
            self._cond.notify_all()
        return job.future

    def hurry(self, through: Iterable[Any] | None = None) -> int:
        """Someone waits: the queued jobs up to the last one tagged in ``through`` (None: all of
        them) become urgent, and a low-lane job running ahead of them is raised now (I/O
        priority; nice where permitted). Returns how many queued jobs were marked."""
        with self._cond:
            if through is None:
                last = len(self._queue) - 1
            else:
                tags = set(through)
                last = max((i for i, j in enumerate(self._queue) if j.tag in tags), default=-1)
                if last < 0 and self._running is not None and self._running.tag in tags:
                    last = -1  # the running job itself is waited for
                elif last < 0:
                    return 0
            for j in list(self._queue)[:last + 1]:
                j.urgent = True
            self._boost_locked()
            self._cond.notify_all()
            return last + 1

    def run_normal(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` at normal priority: called from a job on the low lane, it runs
        on the normal lane while the low lane waits (a section others wait for: a lock other
        nodes' flushes wait on); from anywhere else, right here."""
        me = threading.get_native_id()
        if not self.two or me != self.tids.get("low"):
            return fn(*args, **kwargs)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._sections.append((lambda: fn(*args, **kwargs), fut))
            self._cond.notify_all()
        return fut.result()

    def shutdown(self, wait: bool = True) -> None:
        """Run what is queued, then end the threads (``wait``: return when they have ended)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        _LIVE.discard(self)
        if wait:
            for th in self._threads:
                if th is not threading.current_thread():
                    th.join()

    def snapshot(self) -> dict[str, Any]:
        """The counters, the lanes' thread ids and whether lowering is on (a copy)."""
        with self._cond:
            return dict(self.stats, tids=dict(self.tids), low=self.low, queued=len(self._queue), pace_s=self._pace)

    # -- the lanes
    def _urgent(self, job: _Job, now: float) -> bool:
        """The head job ``job`` goes to the normal lane (under the lock)."""
        if job.urgent:
            return True
        deadline = self._deadline(job)
        return deadline is not None and now >= deadline

    def _deadline(self, job: _Job) -> float | None:
        """When ``job`` (running or at the head) must run at normal priority: the earliest of
        ``t + DEFERRAL * interval - (k + 1) * d`` over it and the jobs queued behind it (module docstring);
        None when none of them has an interval. Under the lock."""
        d = self._pace
        jobs = [job] + [j for j in self._queue if j is not job]
        best = None
        for k, j in enumerate(jobs):
            interval = j.interval if j.interval is not None else self.interval
            if interval is None:
                continue
            when = j.t + DEFERRAL * interval - (k + 1) * d
            best = when if best is None else min(best, when)
        return best

    def _boost_locked(self) -> None:
        """Raise the running low-lane job's thread back to normal (under the lock)."""
        if self._running is None or self._running_lane != "low" or self._boosted or not self.two:
            return
        self._boosted = True
        self.stats["boosted"] += 1
        tid = self.tids["low"]
        try:
            ioprio_set(IOPRIO_WHO_PROCESS, tid, normal_ioprio(*self._base))
        except OSError:
            pass
        try:  # permitted only with CAP_SYS_NICE or RLIMIT_NICE; else the job ends at the low nice value
            os.setpriority(os.PRIO_PROCESS, tid, self._base[0])
        except OSError:
            pass

    def _loop(self, lane: str) -> None:
        with self._cond:
            if lane == "low" and self.low:
                lower_thread(self._base[0])
            self.tids[lane] = threading.get_native_id()
            self._cond.notify_all()
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    if lane == "normal" and self._sections:
                        section, fut = self._sections.popleft()
                        self.stats["sections"] += 1
                        job = None
                        break
                    timeout = None
                    if self._running is None and self._queue:
                        head = self._queue[0]
                        mine = (not self.two) or (lane == ("normal" if self._urgent(head, now) else "low"))
                        if mine:
                            job = self._queue.popleft()
                            self._running, self._running_lane, self._boosted = job, lane, False
                            self.stats["urgent_jobs" if lane == "normal" else "low_jobs"] += 1
                            self._cond.notify_all()  # the normal lane watches a low-lane job's deadline
                            break
                        if lane == "normal":
                            # declined because its deadline has not come: it may pass before the low
                            # lane looks (it then declines too, the head being urgent by then), so
                            # look again at the deadline rather than wait for a notify
                            deadline = self._deadline(head)
                            if deadline is not None:
                                timeout = max(0.0, deadline - now)
                    if self._stop and self._running is None and not self._queue and not self._sections:
                        self._cond.notify_all()
                        return
                    if lane == "normal" and self._running is not None and self._running_lane == "low" \
                            and not self._boosted:
                        deadline = self._deadline(self._running)
                        if deadline is not None:
                            if now >= deadline:
                                self._boost_locked()
                                continue
                            timeout = deadline - now
                    self._cond.wait(timeout)
            if job is None:  # a section handed over by the low lane
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(section())
                    except BaseException as e:  # noqa: BLE001 - handed to the waiting low lane
                        fut.set_exception(e)
                continue
            start = time.monotonic()
            if job.future.set_running_or_notify_cancel():
                try:
                    job.future.set_result(job.fn(*job.args))
                except BaseException as e:  # noqa: BLE001 - handed to whoever holds the future
                    job.future.set_exception(e)
            with self._cond:
                self._pace = time.monotonic() - start
                boosted = self._boosted
                self._running, self._running_lane, self._boosted = None, None, False
                self._cond.notify_all()
            if boosted and lane == "low" and self.low:
                lower_thread(self._base[0])
            del job
