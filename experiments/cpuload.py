"""CPU seconds attributable to checkpointing, read directly, documented load beside a job, and
a per-thread profile of DeepFreeze's threads.

Used by ``experiments/torch_dcp.py`` (torch and numpy imported only inside :func:`make_loader`
and :class:`Decode`).

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

__all__ = ["CkptCPU", "Load", "Prof", "Decode", "make_loader", "top", "proc_cpu", "children", "checkpoint_process",
           "thread_names", "backend_threads", "BUSY_MODES"]

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
        self.kinds: tuple[str, ...] = ()
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
                if kind is None or kind not in self.kinds:
                    continue
                rec = self._procs[pid] = [kind, 0.0 if self.open_ else None, 0.0]
            c = proc_cpu(pid)
            if c is not None:
                if rec[1] is None:
                    rec[1] = c
                rec[2] = c

    def open(self, kinds: tuple[str, ...]) -> None:
        """Start the window; ``kinds``: the checkpoint processes of the approach measured
        (``("deepfreeze-backend",)``, ``("multiprocessing",)`` or none: another approach's
        process still alive, such as a backend before its idle exit, is not counted)."""
        self._procs, self.kinds = {}, tuple(kinds)
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


class Prof:
    """``--profile``: cProfile of DeepFreeze's training-thread hooks, capture thread and writer
    thread (each enabled in its own thread: the pools run ``enable``), and the CPU of every
    thread of the node's backend, over one repetition's window."""

    def __init__(self) -> None:
        import cProfile
        # the timer is the calling thread's CPU clock: own and cumulative times are CPU seconds of
        # that thread (a wait costs nothing), not wall time
        self.hooks, self.capture, self.writer = (cProfile.Profile(time.thread_time) for _ in range(3))
        self.on = False
        self.backend_pid: int | None = None
        self.backend0: dict[int, float] = {}
        self.pools: list = []

    def start(self, capture_pool, writer_pool, backend_pid: int | None) -> None:
        """``capture_pool``/``writer_pool``: the one-thread executors of the capture and writer
        threads (each runs its profiler's ``enable``); ``backend_pid``: the node's backend."""
        self.pools = [(capture_pool, self.capture), (writer_pool, self.writer)]
        for pool, p in self.pools:
            if pool is not None:
                pool.submit(p.enable).result()
        self.backend_pid = backend_pid
        if self.backend_pid:
            self.backend0 = backend_threads(self.backend_pid)
        self.on = True

    def stop(self) -> dict:
        """Profiles off; the top functions per thread and the backend's CPU per thread."""
        self.on = False
        for pool, p in self.pools:
            if pool is not None:
                pool.submit(p.disable).result()
        out = {name: top(p) for name, p in [("training-hooks", self.hooks), ("capture", self.capture),
                                              ("writer", self.writer)]}
        if self.backend_pid:
            b1 = backend_threads(self.backend_pid)
            out["backend_threads_cpu_s"] = {("main" if t == self.backend_pid else str(t)):
                                            round(c - self.backend0.get(t, 0.0), 3)
                                            for t, c in sorted(b1.items())}
        return out


def top(prof, n: int = 25) -> dict:
    """The ``n`` functions of ``prof`` with the most own CPU time: the total and
    ``[name, calls, tottime_s, cumtime_s]`` each."""
    import pstats
    st = pstats.Stats(prof)
    rows = sorted(((f"{_short(k[0])}:{k[1]}"
                    f"({k[2]})", v[1], v[2], v[3]) for k, v in st.stats.items()), key=lambda r: -r[2])
    return {"total_s": round(st.total_tt, 4), "top": [[r[0], r[1], round(r[2], 4), round(r[3], 4)] for r in rows[:n]]}


def _short(path: str) -> str:
    i = path.find("deepfreeze/")
    return path[i:] if i >= 0 else os.path.basename(path)


class Decode:
    """``--busy loader``: an endless stream of batches, each decoded in a DataLoader worker:
    ``items`` times zlib-decompress 1 MiB and normalise it as float32 (numpy). Iterated by a
    ``torch.utils.data.DataLoader(batch_size=None, num_workers=2)``; the training loop takes one
    batch per iteration."""

    def __init__(self, items: int) -> None:
        self.items = items

    @staticmethod
    def blob() -> bytes:
        import zlib
        import numpy as np
        rng = np.random.default_rng(0)
        img = (np.arange(1 << 20) % 251 + rng.integers(0, 24, 1 << 20)).astype(np.uint8)
        return zlib.compress(img.tobytes(), 6)

    @staticmethod
    def decode(blob: bytes):
        import zlib
        import numpy as np
        a = np.frombuffer(zlib.decompress(blob), np.uint8).astype(np.float32)
        return (a - a.mean()) / (a.std() + 1e-6)

    def __iter__(self):
        import torch
        blob = self.blob()
        while True:
            out = None
            for _ in range(self.items):
                out = self.decode(blob)
            yield torch.from_numpy(out[:16].copy())


def make_loader(iter_s: float):
    """The ``loader`` busy mode's DataLoader, sized so that one batch costs about a quarter of
    ``iter_s`` (a baseline iteration, calibrated at start) of CPU in a worker: with two workers per
    rank, about an eighth of a core per worker, and the workers run ahead (prefetch 2)."""
    import torch
    blob = Decode.blob()
    Decode.decode(blob)
    t = time.thread_time()
    for _ in range(3):
        Decode.decode(blob)
    item_s = max(1e-4, (time.thread_time() - t) / 3)
    items = max(1, round(0.25 * iter_s / item_s))

    class DS(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(Decode(items))
    return torch.utils.data.DataLoader(DS(), batch_size=None, num_workers=2, prefetch_factor=2), items, item_s


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
                          "(zlib + float32 normalisation) in the workers, sized to about a quarter of a "
                          "baseline iteration of CPU per batch"}[self.mode]

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
