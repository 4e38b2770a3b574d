"""CPU seconds attributable to checkpointing, read directly, and documented load beside a job.

Used by ``experiments/torch_dcp.py`` (stdlib only: no torch, no numpy).

:class:`CkptCPU` counts, in one rank's process, between :meth:`CkptCPU.open` and
:meth:`CkptCPU.close`:

* **threads**: the CPU of every thread of this process that is *not* one of the training-side
  threads listed by :meth:`CkptCPU.training_set` (taken before a checkpointer is built: the
  training thread, gloo's and OpenMP's workers, samplers): the process's CPU clock
  (``time.process_time``: every thread, including threads that ended in the window, such as
  ``dcp.async_save``'s per-call ``AsyncCheckpointExecutor`` thread) minus the training-side
  threads' own clocks (``/proc/self/task/<tid>/schedstat``, nanoseconds; ``stat`` ticks where
  schedstat is missing). So a checkpointer's capture, writer and staging threads, and threads they
  start (OpenMP teams of a copy in another thread, a gloo group made for the checkpointer), count
  whether or not they are alive at the end; a training-side thread that ended inside the window
  would count too (``lost_training_threads`` says how many);
* **in-call**: the training thread's own CPU inside checkpoint calls (``time.thread_time`` deltas
  the caller adds with :meth:`CkptCPU.incall`): the save call, the waits before the next step,
  the final wait, and for DeepFreeze its step and forward hooks;
* **processes**: ``utime + stime + cutime + cstime`` (``/proc/<pid>/stat``: the process, every
  thread of it, and its reaped children) of every child process of this rank whose command line
  names a checkpointer: ``deepfreeze.backend`` (the node's backend) or ``multiprocessing`` (DCP's
  checkpoint process, spawned, and its resource tracker). DataLoader workers (forked: the rank's
  own command line) are not counted. A process first seen inside the window counts from 0 (all
  of its CPU: e.g. a backend started again after its idle exit); each process's last reading is
  kept (:meth:`CkptCPU.sample`, called at every checkpoint), so one that exits in the window loses
  at most what it used after its last sample.

No baseline is subtracted: every figure is CPU of a thread or process that does checkpoint work,
or of the training thread inside a checkpoint call.

:class:`Load` starts the documented neighbours of a busy mode: ``spin`` (one CPU-bound process
per core, ``while True: pass``, nice 0) and ``disk`` (one process writing 8 MiB blocks into a
256 MiB file in the checkpoint directory's file system and calling ``fsync`` after each block,
in a loop). They run in their own session and are killed by their process group at the end.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

__all__ = ["CkptCPU", "Load", "proc_cpu", "children", "checkpoint_process", "thread_names", "backend_threads",
           "BUSY_MODES"]

#: busy modes (``none``: idle); ``loader`` is load inside the job (torch_dcp's DataLoader workers)
BUSY_MODES = ["none", "spin", "disk", "loader"]
_HZ = os.sysconf("SC_CLK_TCK")


def _task_cpu(tid: int) -> float | None:
    """CPU seconds of thread ``tid`` of this process (None: gone)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except FileNotFoundError:
        pass
    except (OSError, ValueError, IndexError):
        return None
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            v = f.read().rsplit(")", 1)[1].split()
        return (int(v[11]) + int(v[12])) / _HZ
    except (OSError, ValueError, IndexError):
        return None


def _tids() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")]


def proc_cpu(pid: int) -> float | None:
    """``utime + stime + cutime + cstime`` of process ``pid`` in seconds (None: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            v = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in v[11:15]) / _HZ
    except (OSError, ValueError, IndexError):
        return None


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (``/proc/<pid>/task/*/children``; a scan of /proc without it)."""
    out: list[int] = []
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{t}/children") as f:
                out += [int(x) for x in f.read().split()]
        return out
    except FileNotFoundError:
        pass
    except OSError:
        return out
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                continue
    return out


def checkpoint_process(pid: int) -> str | None:
    """``"deepfreeze-backend"``, ``"multiprocessing"`` (DCP's checkpoint process, its resource
    tracker) or None for any other process (a DataLoader worker)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ")
    except OSError:
        return None
    if b"deepfreeze.backend" in cmd:
        return "deepfreeze-backend"
    if b"multiprocessing" in cmd:
        return "multiprocessing"
    return None


def thread_names() -> dict[int, str]:
    """Native thread id -> Python thread name, for the Python threads of this process (Python
    3.11 does not name OS threads: ``/proc/.../comm`` shows the process name)."""
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


class CkptCPU:
    """CPU seconds of checkpoint work in one rank (see the module docstring)."""

    def __init__(self) -> None:
        self.training: list[int] = []
        self.incall_s = 0.0
        self._t0: dict[int, float] = {}
        self._p0 = 0.0
        self._procs: dict[int, list] = {}  # pid -> [kind, cpu at open (0 if first seen later), last cpu]
        self.open_ = False

    def training_set(self) -> None:
        """Every thread alive now is training-side (call before a checkpointer is built)."""
        self.training = _tids()

    def incall(self, seconds: float) -> None:
        """Add the training thread's CPU inside one checkpoint call (a ``thread_time`` delta)."""
        if self.open_:
            self.incall_s += seconds

    def sample(self) -> None:
        """Read every checkpoint child process now (kept: the last reading counts)."""
        for pid in children(os.getpid()):
            rec = self._procs.get(pid)
            if rec is None:
                kind = checkpoint_process(pid)
                if kind is None:
                    continue
                rec = self._procs[pid] = [kind, 0.0 if self.open_ else None, 0.0]
            c = proc_cpu(pid)
            if c is not None:
                if rec[1] is None:
                    rec[1] = c
                rec[2] = c

    def open(self) -> None:
        """Start the window."""
        self._procs = {}
        self.sample()  # the processes alive now count from their current CPU
        self._t0 = {t: c for t in self.training if (c := _task_cpu(t)) is not None}
        self._p0 = time.process_time()
        self.incall_s = 0.0
        self.open_ = True

    def close(self) -> dict:
        """End the window: ``threads_s``, ``incall_s``, ``procs_s`` (with ``procs``: per kind) and
        ``lost_training_threads``."""
        p1 = time.process_time()
        train, lost = 0.0, 0
        for t, c0 in self._t0.items():
            c = _task_cpu(t)
            if c is None:
                lost += 1
            else:
                train += c - c0
        self.sample()
        self.open_ = False
        kinds: dict[str, float] = {}
        for kind, c0, c1 in self._procs.values():
            kinds[kind] = kinds.get(kind, 0.0) + c1 - (c0 or 0.0)
        return {"threads_s": max(0.0, (p1 - self._p0) - train), "incall_s": self.incall_s,
                "procs_s": sum(kinds.values()), "procs": kinds, "lost_training_threads": lost}


def backend_threads(pid: int) -> dict[int, float]:
    """tid -> CPU seconds of each thread of process ``pid`` (ticks)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tids:
        try:
            with open(f"/proc/{pid}/task/{t}/stat") as f:
                v = f.read().rsplit(")", 1)[1].split()
            out[int(t)] = (int(v[11]) + int(v[12])) / _HZ
        except (OSError, ValueError, IndexError):
            continue
    return out


_SPIN = "while True: pass"
_DISK = """
import os, sys
path, block, size = sys.argv[1], 8 << 20, 256 << 20
buf = os.urandom(block)
fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
off = 0
while True:
    os.pwrite(fd, buf, off)
    os.fsync(fd)
    off = (off + block) % size
"""


class Load:
    """The neighbours of busy mode ``mode`` (``spin``, ``disk``; nothing for ``none`` and
    ``loader``), started by :meth:`start`, killed by :meth:`stop`. ``disk_dir``: a directory on
    the checkpoints' file system."""

    def __init__(self, mode: str, disk_dir: str) -> None:
        if mode not in BUSY_MODES:
            raise ValueError(f"busy mode {mode!r}: use one of {BUSY_MODES}")
        self.mode, self.disk_dir = mode, disk_dir
        self.procs: list[subprocess.Popen] = []

    def describe(self) -> str:
        return {"none": "nothing beside the job",
                "spin": f"{os.cpu_count()} CPU-bound processes (`{_SPIN}`, nice 0), one per core",
                "disk": "one process writing 8 MiB blocks into a 256 MiB file on the checkpoints' disk, fsync "
                        "after each block",
                "loader": "in the job: a torch DataLoader per rank, num_workers=2, each batch decoded "
                          "(zlib + float32 normalisation) in the workers, sized to about half a baseline "
                          "iteration of CPU per batch"}[self.mode]

    def start(self) -> None:
        cmds = []
        if self.mode == "spin":
            cmds = [[sys.executable, "-c", _SPIN] for _ in range(os.cpu_count() or 1)]
        elif self.mode == "disk":
            cmds = [[sys.executable, "-c", _DISK, os.path.join(self.disk_dir, "disk-neighbour.bin")]]
        for c in cmds:
            self.procs.append(subprocess.Popen(c, stdin=subprocess.DEVNULL, start_new_session=True))

    def stop(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        self.procs = []
        try:
            os.unlink(os.path.join(self.disk_dir, "disk-neighbour.bin"))
        except FileNotFoundError:
            pass

    def __enter__(self) -> "Load":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
