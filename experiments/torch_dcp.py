"""DeepFreeze for PyTorch against torch.save and torch.distributed.checkpoint (DCP), side by side,
idle and beside documented load (issue 34; the comparison itself: issue 25).

    python -m experiments.torch_dcp --out experiments/results/torch_dcp.json          # the pass (~50 min)
    python -m experiments.torch_dcp --quick --out /tmp/q.json                         # smoke, a few min
    python -m experiments.torch_dcp --models gpt2 --ranks 2 --busy disk --out /tmp/gpt2_disk.json
    python -m experiments.torch_dcp --profile --models mlp --ranks 2 --out /tmp/prof.json  # where DF's CPU goes
    python -m experiments.torch_dcp --models gpt2 --ranks 2 --busy none --approaches dcp-async-process-staged,\
        deepfreeze,deepfreeze-shm,deepfreeze-shm-nocrc,deepfreeze-if1 --out experiments/results/torch_dcp_bounds.json
    python -m experiments.torch_dcp plot --out experiments/results/torch_dcp.json     # tables + PNG again

Models (``experiments/torch_models.py``, written by hand): ``gpt2`` (124 M parameters, AdamW:
1.5 GB of state), ``resnet50`` (25.6 M, BatchNorm), ``mlp`` (1000 small tensors). World sizes 1
and 2 (gloo, CPU, DDP). One ``torchrun`` per (model, world size, busy mode) runs every approach in
the same processes (same model, same disk). Approaches:

* ``torch-save``: rank 0 ``torch.save({"model", "optim"})`` + fsync (synchronous);
* ``dcp-save``: ``dcp.save(get_state_dict(model, opt))`` (synchronous; DCP fsyncs its files);
  every DCP call gets its own gloo group (``dist.new_group(backend="gloo")``, as torchtitan does):
  an upload thread sharing the training group's gloo pairs with DDP's all-reduce hangs or aborts
  (seen here at 2 ranks);
* ``dcp-async-thread`` / ``dcp-async-process``: ``dcp.async_save`` with its default stager
  (a blocking copy to CPU inside the call) and a thread / process checkpointer;
* ``dcp-async-thread-staged`` / ``dcp-async-process-staged``: the same with a
  ``DefaultStager(StagingOptions(use_async_staging=True))`` (cached staging buffers; on CPU no
  pinned memory or non-blocking copy exist): ``async_save`` returns after an enqueue, and the loop
  waits for ``staging_completion`` before the next ``optimizer.step()`` mutates the state;
* ``deepfreeze``: :class:`deepfreeze.torch.Checkpointer` with the shipped defaults (built-in
  engine, async mode, ``chksum`` on; each rank its own simulated node: scratch directory and
  backend process; no partner copies, as DCP has none), capture in the optimizer step; variants
  ``-shm``, ``-nocrc``, ``-if1``, ``-sync`` (:func:`df_options`).

The default pass runs ``torch-save``, the two staged DCP configurations (the best by stall in
issue 25's run) and ``deepfreeze`` idle; in a busy mode ``torch-save``, the idle run's best DCP
async configuration by stall, and ``deepfreeze``, and the same three at the smaller world size
(``--approaches`` runs the given ones everywhere). Every DCP approach waits for the previous
checkpoint's upload before the next ``async_save`` (DCP allows one in flight); DeepFreeze waits
the same way on its own (``max_inflight``). Those waits are inside the measured iterations.

**Repetitions, interleaved**: ``reps`` (default 5) rounds, each running every approach once in
turn (A, B, C, then A, B, C again). One repetition of an approach: ``none_steps`` plain
iterations (its own baseline: iteration times drift on this machine; they also let the previous
approach's background work end), a new checkpointer (a new DeepFreeze run with ``overwrite``, a
new DCP stager), its warm-up checkpoint at the first iteration (``every`` iterations, then every
checkpoint durable), then the window: ``measured`` checkpoints, one every ``every`` iterations,
until all are durable. Idle: ``measured`` from the grid (:data:`FULL`); busy: the warm-up plus
``max_inflight + max_pending_flushes + 2`` (:func:`min_busy_checkpoints` minus one: 6 with the
defaults; ``--busy-measured``) consecutive checkpoints in the window, so a repetition takes
``max_inflight + max_pending_flushes + 3`` = 7 checkpoints and its window more than the 4 that fill
DeepFreeze's queue (``write_waits`` counts a checkpoint that waited because its background work
fell behind). In the last repetition one more checkpoint (not timed) is taken
and its state recorded (BLAKE2b of every tensor of ``get_state_dict``) for the restore test.

**Busy modes** (``--busy``; load documented in :class:`experiments.cpuload.Load`): ``none``
(idle); ``spin``: one CPU-bound process per core beside the job; ``disk``: a neighbour process
writing 8 MiB blocks and fsyncing each, on the checkpoints' disk (scratch and persistent);
``loader``: in the job, a ``DataLoader`` per rank with ``num_workers=2`` decoding every batch
(zlib + float32 normalisation, about a quarter of a baseline iteration of CPU per batch) that
feeds the loop. Busy modes run at the largest world size; the default pass runs them for resnet50 and mlp
(:data:`MODES`: gpt2's would add ~15 min each).

Figures, per repetition (iteration times averaged over the ranks), then the **mean over the
repetitions ± its standard error** (n = reps):

* **stall**: the mean, over the window's checkpoints, of the checkpoint iteration plus the next
  one, minus two baseline iterations (the waits before state is mutated fall in the next one);
  **first checkpoint's stall**: the same for the warm-up checkpoint (plans, buffers, threads,
  processes of a new checkpointer; the first repetition's is also given alone);
* **slowdown per interval**: extra time of the ``every`` iterations from a checkpoint on, over
  ``every`` baseline iterations;
* **time to durable**: from the start of the checkpoint iteration's ``optimizer.step()`` (or the
  save call) until the checkpoint is complete on the persistent directory: the call's end
  (synchronous), the upload future's completion (DCP async), the manifest's ``committed`` time
  (DeepFreeze);
* **CPU-seconds per checkpoint**: the CPU attributable to checkpointing in the window, read
  directly (:class:`experiments.cpuload.CkptCPU`), summed over the ranks, over the window's
  checkpoints: the threads a checkpointer adds (DeepFreeze's ``deepfreeze-capture-r<r>`` and
  ``deepfreeze-writer-r<r>``, DCP's ``AsyncCheckpointExecutor`` and stager threads, their OpenMP
  teams and gloo groups; threads that ended in the window included), the training thread's CPU
  inside checkpoint calls (``time.thread_time`` around the save call, the staging wait, the final
  wait, and DeepFreeze's step and forward hooks, through a subclass of the Checkpointer), and the
  approach's child processes including reaped children (DeepFreeze's backend, DCP's checkpoint
  process; ``utime + stime + cutime + cstime``). No baseline is subtracted; the three parts are
  in ``cpu_parts``;
* **write waits** (DeepFreeze): checkpoint calls that waited for the writer thread
  (``Engine.write_waits``), per repetition summed over the ranks;
* **extra memory**: the peak resident memory of the rank's process tree in the window (sampled
  every 20 ms) minus its peak during the baseline iterations, summed over the ranks;
* **restore** (idle run at the largest world size): a later ``torchrun`` at the same and at the
  other world size restores the final checkpoint of every approach into a fresh model and
  optimizer after dropping the page cache (cold, as after a restart), checks it bit-exact against
  the recorded digests, and times it.

``--profile`` (one repetition, no restore; default approaches ``deepfreeze,deepfreeze-sync``):
cProfile of DeepFreeze's training-thread hooks, its capture thread and its writer thread (each
profiler enabled in its own thread through the pools), and the CPU of every thread of the
backend; with ``-sync`` the scratch write and the flush (persistent write, CRC, manifest, commit,
retention) run in the training thread, so they show in the hooks' profile. The top functions by
own time go into each row's ``profile``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from experiments.bench import commit_times, finish_doc, mean, var, write_doc  # noqa: E402
from experiments.cpuload import BUSY_MODES, CkptCPU, Load, Prof, make_loader  # noqa: E402
from experiments.torch_dcp_report import DCP_ASYNC, plot, table  # noqa: E402

APPROACHES = ["torch-save", "dcp-save", "dcp-async-thread", "dcp-async-process", "dcp-async-thread-staged",
              "dcp-async-process-staged", "deepfreeze"]
#: the default approaches: torch.save, the two DCP async configurations best by stall in issue 25's
#: run (the other three are kept for --approaches), DeepFreeze with the shipped defaults
DEFAULT = ["torch-save", "dcp-async-thread-staged", "dcp-async-process-staged", "deepfreeze"]
#: every / measured checkpoints per repetition (idle; busy: at least min_busy_checkpoints() - 1) /
#: baseline iterations per repetition
FULL = {"gpt2": (3, 2, 2), "resnet50": (4, 2, 2), "mlp": (5, 2, 2)}
QUICK = {"mlp": (3, 2, 2)}
REPS, QUICK_REPS = 5, 2
#: the modes run by default per model at the largest world size (the others: idle only); gpt2's
#: busy modes are left to --busy: at >= 7 consecutive checkpoints of ~6 s each, 5 repetitions and
#: 3 approaches they add ~15 min per mode, past the pass's hour
MODES = {"gpt2": ["none"], "resnet50": BUSY_MODES, "mlp": BUSY_MODES}
QUICK_MODES, QUICK_APPROACHES = ["none", "spin"], ["torch-save", "dcp-async-thread-staged", "deepfreeze"]
SCRATCH_VERSIONS = 2
NAME = "bench"


def min_busy_checkpoints() -> int:
    """``max_inflight + max_pending_flushes + 3`` with DeepFreeze's defaults (``max_inflight``
    from deepfreeze/config.py; ``max_pending_flushes = max(2, scratch_versions)``, engine.py):
    the checkpoints of one busy repetition (the warm-up, then the rest consecutively in the window)."""
    from deepfreeze.config import Config
    return Config.__dataclass_fields__["max_inflight"].default + max(2, SCRATCH_VERSIONS) + 3


# ---------------------------------------------------------------------------------------------- rank side
_HZ = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def tree(root: int) -> list[int]:
    """``root`` and every process descended from it (the DCP checkpoint process, the node's
    DeepFreeze backend: both are started by a rank)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def tree_rss(pids: list[int]) -> int:
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            pass
    return total


class Tree(threading.Thread):
    """This rank's process tree: its peak resident memory since ``reset``
    (RSS summed over the tree every 20 ms; the tree itself re-read every 0.5 s)."""

    def __init__(self) -> None:
        super().__init__(name="tree", daemon=True)
        self.pids = tree(os.getpid())
        self.peak, self.stop = tree_rss(self.pids), threading.Event()

    def reset(self) -> int:
        p, self.peak = self.peak, tree_rss(self.pids)
        return p

    def run(self) -> None:
        n = 0
        while not self.stop.wait(0.02):
            n += 1
            if n % 25 == 0:
                self.pids = tree(os.getpid())
            self.peak = max(self.peak, tree_rss(self.pids))


def digests(model, opt) -> dict[str, str]:
    """BLAKE2b of every tensor of ``get_state_dict(model, opt)`` (flattened FQNs)."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    out = {k: v for k, v in msd.items()}
    for fqn, kv in osd["state"].items():
        for key, v in kv.items():
            out[f"optim.state.{fqn}.{key}"] = v
    res = {}
    for k, v in sorted(out.items()):
        if isinstance(v, torch.Tensor):
            res[k] = hashlib.blake2b(v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes(),
                                     digest_size=16).hexdigest()
    return res


def fsync_tree(path: str) -> None:
    for d, _, files in os.walk(path):
        for n in files:
            fd = os.open(os.path.join(d, n), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


class Saver:
    """One approach's checkpoint calls and waits, in the training loop, for one repetition. Every
    call adds the training thread's CPU inside it to ``cpu`` (:meth:`CkptCPU.incall`); DeepFreeze's
    hooks do the same (:func:`timed_checkpointer`)."""

    def __init__(self, approach: str, model, opt, work: str, rank: int, every: int, pg, cpu: CkptCPU,
                 rep: int, prof: "Prof | None" = None) -> None:
        self.pg = pg  # DCP's own gloo group: its upload thread must not share the training group
        self.approach, self.model, self.opt, self.work, self.rank = approach, model, opt, work, rank
        self.every, self.cpu, self.rep = every, cpu, rep
        self.future = self.staging = self.stager = self.ckpt = None
        self.durable: list[float] = []  # per checkpoint: seconds from its start to durable
        self.t_start = 0.0
        self.paths: list[str] = []
        self.starts: list[float] = []
        if approach.endswith("-staged"):
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory="process" in approach,
                                                       use_async_staging=True, use_non_blocking_copy=False))
        if approach.startswith("deepfreeze"):
            opts = df_options(approach, work, rank)
            # a new run per repetition (overwrite: the older versions are retired); the first
            # optimizer step is the warm-up checkpoint (start_step = every - 1)
            self.ckpt = timed_checkpointer()(model, opt, config=os.path.join(ROOT, "veloc_cfg", "local.cfg"),
                                             name=NAME, every_n_steps=every, overwrite=True, ec_interval=-1,
                                             max_versions=0, scratch_versions=SCRATCH_VERSIONS,
                                             failure_domain=f"node{rank}", start_step=every - 1, **opts)
            self.ckpt.cpu, self.ckpt.prof = cpu, prof

    def before_step(self) -> None:
        """Before ``optimizer.step()``: DCP's staged copy must be complete before state is mutated."""
        if self.staging is not None:
            c = time.thread_time()
            self.staging.result()
            self.staging = None
            self.cpu.incall(time.thread_time() - c)

    def save(self, k: int) -> None:
        """After ``optimizer.step()`` of checkpoint ``k``."""
        c = time.thread_time()
        try:
            self._save(k)
        finally:
            self.cpu.incall(time.thread_time() - c)

    def _save(self, k: int) -> None:
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        a, t0 = self.approach, self.t_start
        path = f"{self.work}/{a}/rep{self.rep}/ckpt{k}"
        self.paths.append(path)
        if a == "torch-save":
            if self.rank == 0:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path + ".pt", "wb") as f:
                    torch.save({"model": self.model.module.state_dict(), "optim": self.opt.state_dict()}, f)
                    f.flush()
                    os.fsync(f.fileno())
            self.durable.append(time.time() - t0)
        elif a == "dcp-save":
            msd, osd = get_state_dict(self.model, self.opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, process_group=self.pg)
            self.durable.append(time.time() - t0)
        elif a in DCP_ASYNC:
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
            if self.future is not None:
                self.future.result()  # one in flight
            msd, osd = get_state_dict(self.model, self.opt)
            kind = AsyncCheckpointerType.PROCESS if "process" in a else AsyncCheckpointerType.THREAD
            r = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path, async_checkpointer_type=kind,
                               async_stager=self.stager, process_group=self.pg)
            if self.stager is not None:
                self.staging, self.future = r.staging_completion, r.upload_completion
            else:
                self.future = r
            box = len(self.durable)
            self.durable.append(math.nan)

            def done(_f, box=box, t0=t0) -> None:
                self.durable[box] = time.time() - t0
            self.future.add_done_callback(done)
        else:  # deepfreeze: the capture ran in optimizer.step()'s post-hook; durable = the manifest's commit
            self.starts.append(t0)

    def finish(self) -> None:
        """Wait until every checkpoint is durable."""
        c = time.thread_time()
        if self.staging is not None:
            self.staging.result()
            self.staging = None
        if self.future is not None:
            self.future.result()
        if self.ckpt is not None:
            self.ckpt.wait()
        self.cpu.incall(time.thread_time() - c)

    def engine(self):
        """DeepFreeze's engine of this rank (its ``write_waits``, ``writer_cpu``), or None."""
        return None if self.ckpt is None else getattr(getattr(self.ckpt, "_run", None), "engine", None)

    def close(self) -> dict:
        out: dict = {}
        if self.stager is not None:
            self.stager.close()
        if self.ckpt is not None:
            out["df_timings"] = self.ckpt.timings
            eng = self.engine()
            if eng is not None:
                out["write_waits"] = eng.write_waits
                out["writer_cpu"] = {str(v): c for v, c in eng.writer_cpu.items()}
            self.ckpt.close()
        return out


_TIMED = None


def timed_checkpointer():
    """:class:`deepfreeze.torch.Checkpointer` whose step and forward hooks and ``wait`` add the
    training thread's CPU inside them to ``self.cpu`` (and, with ``self.prof``, run under its
    training-thread profiler): a subclass, the library unchanged."""
    global _TIMED
    if _TIMED is None:
        from deepfreeze.torch import Checkpointer

        class Timed(Checkpointer):
            cpu: "CkptCPU | None" = None
            prof: "Prof | None" = None

            def _timed(self, fn, *a):
                c = time.thread_time()
                p = self.prof.hooks if self.prof is not None and self.prof.on else None
                if p is not None:
                    p.enable()
                try:
                    return fn(*a)
                finally:
                    if p is not None:
                        p.disable()
                    if self.cpu is not None:
                        self.cpu.incall(time.thread_time() - c)

            def before_step(self, opt, args, kwargs):
                return self._timed(super().before_step, opt, args, kwargs)

            def after_step(self, opt):
                return self._timed(super().after_step, opt)

            def before_forward(self, module, args):
                return self._timed(super().before_forward, module, args)

            def wait(self, timeout=None):
                return self._timed(super().wait, timeout)
        _TIMED = Timed
    return _TIMED


def df_options(approach: str, work: str, rank: int) -> dict:
    """DeepFreeze's settings for ``approach``: ``deepfreeze`` (the shipped defaults, ``chksum`` on;
    scratch on the same disk as the persistent directory) and variants that show what bounds a
    figure: ``-shm`` (node-local scratch in memory, /dev/shm, as on nodes with a tmpfs or an NVMe
    scratch), ``-nocrc`` (``chksum = false``: no CRC32 per piece), ``-if1`` (``max_inflight = 1``:
    a pool of two buffers instead of three), ``-sync`` (``mode = sync``: the scratch write and the
    flush run inside the checkpoint call, in the training thread; with ``--profile`` the backend's
    work is then profiled in-process), ``-prionormal`` (``background_priority = normal``: no
    low-priority lane, what the deferral of issue 34's item 2 costs in time to durable),
    ``-wo0`` (``write_once = off``: every version through scratch, as before issue 34)."""
    root = f"/dev/shm/torch_dcp-{os.path.basename(work)}" if "-shm" in approach else work
    opts: dict = {"scratch": f"{root}/{approach}/node{rank}/scratch", "persistent": f"{work}/{approach}/persistent"}
    if "-nocrc" in approach:
        opts["chksum"] = False
    if "-if1" in approach:
        opts["max_inflight"] = 1
    if "-sync" in approach:
        opts["mode"] = "sync"
    if "-prionormal" in approach:
        opts["background_priority"] = "normal"
    if "-wo0" in approach:
        opts["write_once"] = "off"
    return opts


def worker(args: argparse.Namespace) -> None:
    """One (model, world size, busy mode): ``reps`` repetitions, each running every approach in
    turn (interleaved: A, B, C, then A, B, C again)."""
    import torch
    import torch.distributed as dist
    from experiments import torch_models as tm
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // size))
    net = tm.build(args.model)
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    work = args.work
    pg = dist.new_group(backend="gloo")  # for DCP (as torchtitan does for async_save)
    mem = Tree()
    mem.start()
    cpu = CkptCPU()
    gstep = [0]
    batches = [None]

    def iterate(saver: "Saver | None", ck: "int | None") -> float:
        t = time.perf_counter()
        if batches[0] is not None:
            next(batches[0])  # the loader mode: a decoded batch per iteration (the workers run ahead)
        x, y = tm.batch(args.model, gstep[0], rank)
        tm.loss_of(args.model, model(x), y).backward()
        if saver is not None:
            saver.before_step()
            saver.t_start = time.time()
        opt.step()
        opt.zero_grad()
        if saver is not None and ck is not None:
            saver.save(ck)
        gstep[0] += 1
        return time.perf_counter() - t

    warm = [iterate(None, None) for _ in range(2)]  # warm-up: DDP buckets, AdamW state
    info: dict = {}
    if args.busy == "loader":
        loader, items, item_s = make_loader(min(warm))
        batches[0] = iter(loader)
        info = {"loader_items_per_batch": items, "loader_item_cpu_s": item_s}
    every, measured = args.every, args.measured
    approaches = args.approaches.split(",")
    recs = {a: {"rank": rank, "approach": a, "mode": args.busy, "reps": [], **info} for a in approaches}
    for rep in range(args.reps):
        for approach in approaches:
            prof = Prof() if args.profile and approach.startswith("deepfreeze") else None
            recs[approach]["reps"].append(
                one_rep(approach, rep, rep == args.reps - 1, every, measured, args.none_steps, iterate, mem, cpu,
                        model, opt, work, rank, pg, prof))
            recs[approach]["final_step"] = gstep[0]
    for a, rec in recs.items():
        with open(f"{work}/res/{a}.r{rank}.json", "w") as f:
            json.dump(rec, f)
    mem.stop.set()
    dist.destroy_process_group()


def one_rep(approach: str, rep: int, last: bool, every: int, measured: int, none_steps: int, iterate, mem: Tree,
            cpu: CkptCPU, model, opt, work: str, rank: int, pg, prof: "Prof | None") -> dict:
    """One repetition of ``approach``: ``none_steps`` plain iterations (its baseline), a new
    checkpointer, the warm-up checkpoint at its first iteration (``every`` iterations), the
    window: ``measured`` checkpoints every ``every`` iterations, until all are durable; in the
    last repetition a final checkpoint (not timed) whose state is recorded for the restore check."""
    import torch.distributed as dist
    dist.barrier()
    mem.reset()
    rec: dict = {"base_iters": [iterate(None, None) for _ in range(none_steps)]}
    rec["base_mem_peak"] = mem.reset()
    cpu.training_set()  # every thread alive now is training-side
    t = time.perf_counter()
    saver = Saver(approach, model, opt, work, rank, every, pg, cpu, rep, prof)
    rec["setup_s"] = time.perf_counter() - t
    rec["warm_iters"] = [iterate(saver, 1 if i == 0 else None) for i in range(every)]
    saver.finish()
    dist.barrier()
    mem.reset()
    if prof is not None:
        eng = saver.engine()
        prof.start(saver.ckpt.capture._copier, getattr(eng, "_pool", None),
                   getattr(getattr(eng, "_backend", None), "pid", None))
    cpu.open(("deepfreeze-backend",) if approach.startswith("deepfreeze") else
             ("multiprocessing",) if approach.startswith("dcp") else ())
    iters = []
    for i in range(measured * every):
        ck = i // every + 2 if i % every == 0 else None
        iters.append(iterate(saver, ck))
        if ck is not None:
            cpu.sample()
    saver.finish()
    dist.barrier()
    rec["cpu"] = cpu.close()
    if prof is not None:
        rec["profile"] = prof.stop()
    rec.update(iters=iters, mem_peak=mem.reset(), durable=list(saver.durable))
    if approach.startswith("deepfreeze"):
        rec["committed"] = commit_times(f"{work}/{approach}/persistent/{NAME}")
        rec["starts"] = list(saver.starts)
        eng = saver.engine()
        rec["write_waits_window"] = None if eng is None else eng.write_waits
    if last:  # the final checkpoint: the state after it is recorded for the restore check
        iterate(saver, measured + 2)
        saver.finish()
        dist.barrier()
    rec.update(saver.close())
    rec["final"] = saver.paths[-1] if saver.paths else None
    if last and rank == 0:
        with open(f"{work}/res/{approach}.digests.json", "w") as f:
            json.dump({"digests": digests(model, opt)}, f)
    if rank == 0:  # older checkpoints are not needed any more (disk): the last repetition's final one is kept
        for p in saver.paths[:-1] if last else saver.paths:
            shutil.rmtree(p, ignore_errors=True)
            if os.path.exists(p + ".pt"):
                os.unlink(p + ".pt")
    return rec


def restore_worker(args: argparse.Namespace) -> None:
    """Restore the final checkpoint of every approach at this world size, cold, bit-exact."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from experiments import torch_models as tm
    import deepfreeze.torch
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // size))
    work = args.work
    out = {}
    for approach in args.approaches.split(","):
        with open(f"{work}/res/{approach}.digests.json") as f:
            ref = json.load(f)["digests"]
        with open(f"{work}/res/{approach}.r0.json") as f:
            final = json.load(f)["reps"][-1]["final"]
        net = tm.build(args.model)
        torch.manual_seed(123)
        with torch.no_grad():
            for p in net.parameters():
                p.normal_()
        model = torch.nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        dist.barrier()
        if rank == 0:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        dist.barrier()
        t = time.perf_counter()
        if approach == "torch-save":
            sd = torch.load(final + ".pt", weights_only=True)
            model.module.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])
        elif approach.startswith("deepfreeze"):
            deepfreeze.torch.restore(model, opt, os.path.join(ROOT, "veloc_cfg", "local.cfg"), name=NAME,
                                     scratch=f"{work}/{approach}/restore{size}/node{rank}/scratch",
                                     persistent=f"{work}/{approach}/persistent")
        else:
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=final)
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        dt = time.perf_counter() - t
        dist.barrier()
        dt_all = time.perf_counter() - t
        got = digests(model, opt)
        bad = sorted(k for k in ref if got.get(k) != ref[k])
        out[approach] = {"restore_s": dt, "restore_all_s": dt_all, "bit_exact": not bad and set(got) == set(ref),
                         "mismatch": bad[:5]}
    with open(f"{work}/res/restore{size}.r{rank}.json", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- driver
def torchrun(nproc: int, argv: list[str], log: str, timeout: float) -> str | None:
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc-per-node",
           str(nproc), "-m", "experiments.torch_dcp"] + argv
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                             env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=str(max(1, 2 // nproc))))
        try:
            if p.wait(timeout=timeout) != 0:
                return f"torchrun exited with {p.returncode}: {open(log, errors='replace').read()[-3000:]}"
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return f"timed out after {timeout:.0f} s"
    return None


def se(v: list[float]) -> float | None:
    s = var(v)
    return None if s is None else math.sqrt(s / len(v))


def stat(v: list[float]) -> dict:
    v = [x for x in v if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return {"mean": mean(v), "se": se(v), "n": len(v)}


def summarize(model: str, ranks: int, mode: str, work: str, approaches: list[str], every: int,
              measured: int) -> list[dict]:
    """One row per approach: each figure per repetition (the mean over its measured checkpoints,
    iteration times averaged over the ranks, CPU summed over the ranks), then the mean over the
    repetitions +- its standard error."""
    rows = []
    for a in approaches:
        rs = [json.load(open(f"{work}/res/{a}.r{r}.json")) for r in range(ranks)]
        per: dict[str, list] = {k: [] for k in ("base", "stall", "slow", "durable", "cpu", "threads", "incall", "procs",
                                                "first", "mem", "waits", "writer")}
        cks = [j * every for j in range(measured)]  # measured checkpoint iterations in the window
        for i in range(len(rs[0]["reps"])):
            reps = [r["reps"][i] for r in rs]
            iters = [mean(c) for c in zip(*[x["iters"] for x in reps])]
            warm = [mean(c) for c in zip(*[x["warm_iters"] for x in reps])]
            base = mean([mean(x["base_iters"]) for x in reps])
            nxt = 1 if every > 1 else 0
            per["base"].append(base)
            per["stall"].append(mean([iters[c] + iters[c + nxt] - (1 + nxt) * base for c in cks]))
            per["slow"].append(mean([(sum(iters[c:c + every]) - every * base) / (every * base) for c in cks]))
            per["first"].append(warm[0] + warm[nxt] - (1 + nxt) * base)
            r0 = reps[0]
            if a.startswith("deepfreeze"):
                dur = [r0["committed"].get(str(k * every), math.nan) - r0["starts"][k - 1]
                       for k in range(2, measured + 2)]
                per["waits"].append(sum(x.get("write_waits_window") or 0 for x in reps))
                per["writer"].append(sum(c for x in reps for v, c in x.get("writer_cpu", {}).items()
                                         if int(v) in {k * every for k in range(2, measured + 2)}) / measured)
            else:
                dur = [max(x["durable"][k - 1] for x in reps) for k in range(2, measured + 2)]
            per["durable"].append(mean([d for d in dur if not math.isnan(d)]))
            parts = {p: sum(x["cpu"][f"{p}_s"] for x in reps) / measured for p in ("threads", "incall", "procs")}
            for p, v in parts.items():
                per[p].append(v)
            per["cpu"].append(sum(parts.values()))
            per["mem"].append(sum(x["mem_peak"] - x["base_mem_peak"] for x in reps) / 1e9)
        row = {"model": model, "ranks": ranks, "mode": mode, "approach": a, "reps": len(per["base"]),
               "measured_per_rep": measured, "every": every, "baseline_iter_s": stat(per["base"]),
               "stall_s": stat(per["stall"]), "slowdown": stat(per["slow"]), "durable_s": stat(per["durable"]),
               "cpu_s_per_ckpt": stat(per["cpu"]),
               "cpu_parts": {p: stat(per[p]) for p in ("threads", "incall", "procs")},
               "first_stall_s": stat(per["first"]), "first_stall_first_rep_s": per["first"][0],
               "mem_extra_GB": mean(per["mem"]), "iter_s": iters,
               "cpu_per_rep": per["cpu"], "lost_training_threads": sum(x["cpu"]["lost_training_threads"]
                                                                       for r in rs for x in r["reps"])}
        if a.startswith("deepfreeze"):
            row.update(write_waits=per["waits"], writer_cpu_s_per_ckpt=stat(per["writer"]),
                       df_in_step_ms=[1e3 * (x["post_hook_s"] + x["wait_s"] + x["handoff_s"])
                                      for x in rs[0]["reps"][-1].get("df_timings", [])])
        if "loader_items_per_batch" in rs[0]:
            row["loader"] = {"items_per_batch": [r["loader_items_per_batch"] for r in rs],
                             "item_cpu_s": [r["loader_item_cpu_s"] for r in rs]}
        prof = {f"rank{r['rank']}": x["profile"] for r in rs for x in r["reps"] if "profile" in x}
        if prof:
            row["profile"] = prof
        rows.append(row)
    return rows


def cells(models: list[str], ranks: list[int], busy: "list[str] | None", quick: bool) -> list[tuple[str, int, str]]:
    """(model, world size, mode) in run order: per model the largest world size idle first (its
    run picks the busy modes' DCP configuration), its busy modes, then the other world sizes idle."""
    out = []
    top = max(ranks)
    for m in models:
        modes = busy if busy is not None else (QUICK_MODES if quick else MODES.get(m, BUSY_MODES))
        out += [(m, top, "none")] + [(m, top, b) for b in modes if b != "none"]
        out += [(m, n, "none") for n in sorted(ranks, reverse=True) if n != top]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", nargs="?", default="drive", choices=["drive", "worker", "restore", "plot"])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--approaches", default=None, help=f"comma list (default: {','.join(DEFAULT)}; busy modes: "
                    "torch-save, the idle run's best dcp-async by stall, deepfreeze)")
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--measured", type=int, default=2)
    ap.add_argument("--none-steps", type=int, default=2)
    ap.add_argument("--reps", type=int, default=None, help=f"interleaved repetitions (default {REPS}; --quick "
                    f"{QUICK_REPS})")
    ap.add_argument("--busy", default=None, help="comma list of modes, none,spin,disk,loader (default: per model, "
                    "at the largest world size; see MODES)")
    ap.add_argument("--busy-measured", type=int, default=None, help="measured checkpoints per repetition in a busy "
                    "mode (default: max_inflight + max_pending_flushes + 3 - 1, after the warm-up)")
    ap.add_argument("--profile", action="store_true", help="cProfile DeepFreeze's threads and read its backend's "
                    "threads over one repetition (default approaches: deepfreeze,deepfreeze-sync; idle unless "
                    "--busy; no restore)")
    ap.add_argument("--work", default="")
    ap.add_argument("--models", default=None, help="comma list (default: gpt2,resnet50,mlp)")
    ap.add_argument("--ranks", default=None, help="comma list (default 1,2; --quick 2)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--base", default=None, help="directory for checkpoints (default: a temp dir under /var/tmp)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "torch_dcp.json"))
    args = ap.parse_args()
    if args.mode == "worker":
        return worker(args)
    if args.mode == "restore":
        return restore_worker(args)
    if args.mode == "plot":  # the tables and the PNG again from --out's JSON
        with open(args.out) as f:
            doc = json.load(f)
        doc["table_md"] = table(doc)
        write_doc(doc, args.out)
        return plot(doc, os.path.splitext(args.out)[0] + ".png")
    t_start = time.time()
    grid = QUICK if args.quick else FULL
    models = args.models.split(",") if args.models else list(grid)
    ranks = [int(r) for r in (args.ranks or ("2" if args.quick else "1,2")).split(",")]
    reps = args.reps or (1 if args.profile else QUICK_REPS if args.quick else REPS)
    explicit = args.approaches is not None
    approaches = (args.approaches or ("deepfreeze,deepfreeze-sync" if args.profile else
                                      ",".join(QUICK_APPROACHES if args.quick else DEFAULT))).split(",")
    busy = args.busy.split(",") if args.busy else (["none"] if args.profile else None)
    for b in busy or []:
        if b not in BUSY_MODES:
            raise SystemExit(f"--busy {b!r}: use a comma list of {','.join(BUSY_MODES)}")
    min_busy = min_busy_checkpoints()
    doc = {"settings": {"approaches": approaches, "grid": {m: grid.get(m, FULL.get(m)) for m in models},
                        "grid_fields": "every, measured checkpoints per repetition (idle), baseline iterations "
                                       "per repetition", "reps": reps, "ranks": ranks,
                        "busy_checkpoints_per_rep": min_busy,
                        "busy_measured_per_rep": args.busy_measured or min_busy - 1, "profile": args.profile,
                        "load": {b: Load(b, "").describe() for b in BUSY_MODES},
                        "torch": __import__("torch").__version__, "cpus": os.cpu_count(),
                        "statistic": "per repetition: the mean over its measured checkpoints (iteration times "
                                     "averaged over the ranks, CPU summed over the ranks); reported: the mean over "
                                     "the interleaved repetitions +- its standard error"},
           "runs": [], "restore": [], "errors": []}
    base = args.base or tempfile.mkdtemp(prefix="torch_dcp-", dir="/var/tmp")
    best: dict[str, str] = {}
    for m, n, mode in cells(models, ranks, busy, args.quick):
        every, measured, none_steps = grid.get(m, FULL.get(m))
        apps = approaches
        if mode != "none":
            measured = args.busy_measured or max(measured, min_busy - 1)
        if (mode != "none" or n != max(ranks)) and not explicit and m in best:
            # busy, and the smaller world size: torch.save, the idle run's best DCP async, DeepFreeze
            apps = [a for a in approaches if a not in DCP_ASYNC or a == best[m]]
        work = f"{base}/{m}-{n}-{mode}"
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(f"{work}/res")
        t0 = time.time()
        argv = ["worker", "--model", m, "--approaches", ",".join(apps), "--every", str(every), "--measured",
                str(measured), "--none-steps", str(none_steps), "--work", work, "--reps", str(reps), "--busy", mode]
        with Load(mode, base):
            err = torchrun(n, argv + (["--profile"] if args.profile else []), f"{work}/train.log", timeout=3600)
        if err:
            doc["errors"].append({"model": m, "ranks": n, "mode": mode, "error": err})
            print(f"[torch_dcp] {m} x{n} {mode}: {err}", flush=True)
            continue
        rows = summarize(m, n, mode, work, apps, every, measured)
        doc["runs"].extend(rows)
        for row in rows:
            print(json.dumps({k: v for k, v in row.items() if k not in ("iter_s", "profile")}), flush=True)
        if mode == "none" and n == max(ranks):
            asyncs = [r for r in rows if r["approach"] in DCP_ASYNC and r["stall_s"]["mean"] is not None]
            if asyncs:
                best[m] = min(asyncs, key=lambda r: r["stall_s"]["mean"])["approach"]
            for rn in ([] if args.profile else [n] + [x for x in (1, 2) if x != n][:1]):
                err = torchrun(rn, ["restore", "--model", m, "--approaches", ",".join(apps), "--work", work],
                               f"{work}/restore{rn}.log", timeout=1800)
                if err:
                    doc["errors"].append({"model": m, "ranks": n, "restore_ranks": rn, "error": err})
                    print(f"[torch_dcp] restore {m} x{n} -> {rn}: {err}", flush=True)
                    continue
                rr = [json.load(open(f"{work}/res/restore{rn}.r{r}.json")) for r in range(rn)]
                for a in apps:
                    doc["restore"].append({"model": m, "ranks": n, "restore_ranks": rn, "approach": a,
                                           "restore_s": max(x[a]["restore_all_s"] for x in rr),
                                           "bit_exact": all(x[a]["bit_exact"] for x in rr),
                                           "mismatch": rr[0][a]["mismatch"]})
        doc.setdefault("cell_wall_s", []).append({"model": m, "ranks": n, "mode": mode,
                                                  "wall_s": round(time.time() - t0, 1)})
        print(f"[torch_dcp] {m} x{n} {mode}: {time.time() - t0:.0f} s", flush=True)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(f"/dev/shm/torch_dcp-{os.path.basename(work)}", ignore_errors=True)
        write_doc(doc, args.out)
    shutil.rmtree(base, ignore_errors=True)
    finish_doc(doc, args.out, t_start, table, plot)



if __name__ == "__main__":
    main()
