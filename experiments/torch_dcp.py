"""DeepFreeze for PyTorch against torch.distributed.checkpoint (DCP), side by side in one run.

    python -m experiments.torch_dcp --out experiments/results/torch_dcp.json          # the grid
    python -m experiments.torch_dcp --quick --out /tmp/q.json                         # smoke, ~4 min
    python -m experiments.torch_dcp --models gpt2 --ranks 2 --approaches dcp-async-process-staged,\
        deepfreeze,deepfreeze-shm,deepfreeze-shm-nocrc,deepfreeze-if1 --out experiments/results/torch_dcp_bounds.json
    python -m experiments.torch_dcp plot --out experiments/results/torch_dcp.json     # tables + PNG again

Models (``experiments/torch_models.py``, written by hand): ``gpt2`` (124 M parameters, AdamW:
1.5 GB of state), ``resnet50`` (25.6 M, BatchNorm), ``mlp`` (1000 small tensors). World sizes 1
and 2 (gloo, CPU, DDP). One ``torchrun`` per (model, world size) runs every approach in turn in
the same processes (same model, same steps, same disk):

* ``torch-save``: rank 0 ``torch.save({"model", "optim"})`` + fsync (synchronous);
* ``dcp-save``: ``dcp.save(get_state_dict(model, opt))`` (synchronous; DCP fsyncs its files);
  every DCP call gets its own gloo group (``dist.new_group(backend="gloo")``, as torchtitan does):
  an upload thread sharing the training group's gloo pairs with DDP's all-reduce hangs or aborts
  (seen here at 2 ranks);
* ``dcp-async-thread`` / ``dcp-async-process``: ``dcp.async_save`` with its default stager
  (a blocking copy to CPU inside the call) and a thread / process checkpointer;
* ``dcp-async-thread-staged`` / ``dcp-async-process-staged``: the same with one
  ``DefaultStager(StagingOptions(use_async_staging=True))`` kept for the run (cached staging
  buffers; on CPU no pinned memory or non-blocking copy exist): ``async_save`` returns after an
  enqueue, and the loop waits for ``staging_completion`` before the next ``optimizer.step()``
  mutates the state;
* ``deepfreeze``: :class:`deepfreeze.torch.Checkpointer` (built-in engine, async mode, each rank
  its own simulated node: scratch directory and backend process; no partner copies, as DCP has
  none), capture in the optimizer step.

Every DCP approach waits for the previous checkpoint's upload before the next ``async_save``
(DCP allows one in flight); DeepFreeze waits the same way on its own (``max_inflight``). Those
waits are inside the measured iterations.

Schedule of an approach: first ``none_steps`` plain iterations (its own baseline: iteration
times drift on this machine; they also let the previous approach's background work end), then a
checkpoint after iterations ``every-1, 2*every-1, ...``;
the first is warm-up (plans, buffers, processes) and excluded, then ``measured`` checkpoints each
followed by ``every-1`` plain iterations, then a final checkpoint (not timed) whose state is
recorded (BLAKE2b of every tensor of ``get_state_dict``) for the restore test.

Figures (the same way for every approach; iteration times averaged over the ranks; CPU and memory
of each rank's process tree: the rank, its threads, the DCP checkpoint process and the node's
DeepFreeze backend, which the ranks start, so other work on the machine does not count):

* **stall**: time of the checkpoint iteration plus the next one, minus two baseline iterations
  (the waits before state is mutated fall in the next one);
* **slowdown per interval**: extra time of the ``every`` iterations from a checkpoint on, over
  ``every`` baseline iterations;
* **time to durable**: from the start of the checkpoint iteration's ``optimizer.step()`` (or the
  save call) until the checkpoint is complete on the persistent directory: the call's end
  (synchronous), the upload future's completion (DCP async), the manifest's ``committed`` time
  (DeepFreeze);
* **CPU-seconds per checkpoint**: CPU seconds of the process trees from the end of the warm-up
  interval until the final checkpoint is durable, minus the baseline's CPU per iteration times
  the iterations, over the checkpoints in that window;
* **extra memory**: the peak resident memory of the process trees in that window (sampled every
  20 ms) minus their peak during the baseline iterations, summed over the ranks;
* **restore**: a later ``torchrun`` at the same and at the other world size restores the final
  checkpoint of every approach into a fresh model and optimizer after dropping the page cache
  (cold, as after a restart), checks it bit-exact against the recorded digests, and times it.
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

APPROACHES = ["torch-save", "dcp-save", "dcp-async-thread", "dcp-async-process", "dcp-async-thread-staged",
              "dcp-async-process-staged", "deepfreeze"]
DCP_ASYNC = [a for a in APPROACHES if a.startswith("dcp-async")]
#: every / measured / none_steps per model
FULL = {"gpt2": (3, 3, 5), "resnet50": (5, 4, 8), "mlp": (5, 4, 8)}
QUICK = {"mlp": (3, 2, 4)}
NAME = "bench"


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


def tree_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system, every thread) of ``pids`` so far."""
    total = 0.0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                v = f.read().rsplit(")", 1)[1].split()
            total += (int(v[11]) + int(v[12])) / _HZ
        except (OSError, IndexError, ValueError):
            pass
    return total


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
    """This rank's process tree: its CPU seconds and its peak resident memory since ``reset``
    (RSS summed over the tree every 20 ms; the tree itself re-read every 0.5 s)."""

    def __init__(self) -> None:
        super().__init__(name="tree", daemon=True)
        self.pids = tree(os.getpid())
        self.peak, self.stop = tree_rss(self.pids), threading.Event()

    def cpu(self) -> float:
        self.pids = tree(os.getpid())
        return tree_cpu(self.pids)

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
    """One approach's checkpoint call and waits, in the training loop."""

    def __init__(self, approach: str, model, opt, work: str, rank: int, every: int, pg) -> None:
        self.pg = pg  # DCP's own gloo group: its upload thread must not share the training group
        self.approach, self.model, self.opt, self.work, self.rank = approach, model, opt, work, rank
        self.every = every
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
            from deepfreeze.torch import Checkpointer
            opts = df_options(approach, work, rank)
            self.ckpt = Checkpointer(model, opt, config=os.path.join(ROOT, "veloc_cfg", "local.cfg"), name=NAME,
                                     every_n_steps=every, overwrite=True, ec_interval=-1, max_versions=0,
                                     scratch_versions=2, failure_domain=f"node{rank}", **opts)

    def before_step(self) -> None:
        """Before ``optimizer.step()``: DCP's staged copy must be complete before state is mutated."""
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def save(self, k: int) -> None:
        """After ``optimizer.step()`` of checkpoint ``k``."""
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        a, t0 = self.approach, self.t_start
        path = f"{self.work}/{a}/ckpt{k}"
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
        if self.staging is not None:
            self.staging.result()
        if self.future is not None:
            self.future.result()
        if self.ckpt is not None:
            self.ckpt.wait()

    def close(self) -> dict:
        out: dict = {}
        if self.stager is not None:
            self.stager.close()
        if self.ckpt is not None:
            out["df_timings"] = self.ckpt.timings
            self.ckpt.close()
        return out


def df_options(approach: str, work: str, rank: int) -> dict:
    """DeepFreeze's settings for ``approach``: ``deepfreeze`` (scratch on the same disk as the
    persistent directory) and variants that show what bounds a figure: ``-shm`` (node-local
    scratch in memory, /dev/shm, as on nodes with a tmpfs or an NVMe scratch), ``-nocrc``
    (``chksum = false``: no CRC32 per piece), ``-if1`` (``max_inflight = 1``: a pool of two
    buffers instead of three)."""
    root = f"/dev/shm/torch_dcp-{os.path.basename(work)}" if "-shm" in approach else work
    opts: dict = {"scratch": f"{root}/{approach}/node{rank}/scratch", "persistent": f"{work}/{approach}/persistent"}
    if "-nocrc" in approach:
        opts["chksum"] = False
    if "-if1" in approach:
        opts["max_inflight"] = 1
    return opts


def worker(args: argparse.Namespace) -> None:
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
    gstep = [0]

    def iterate(saver: "Saver | None", ck: "int | None") -> float:
        t = time.perf_counter()
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

    for _ in range(2):  # warm-up: DDP buckets, AdamW state
        iterate(None, None)
    approaches = args.approaches.split(",")
    for approach in approaches:
        # a plain run right before each approach: its own baseline (iteration times drift on this
        # machine), which also lets the previous approach's background work end
        dist.barrier()
        mem.reset()
        c0, t0 = mem.cpu(), time.perf_counter()
        rec: dict = {"rank": rank, "approach": approach}
        rec["base_iters"] = [iterate(None, None) for _ in range(args.none_steps)]
        rec.update(base_cpu_s=mem.cpu() - c0, base_wall_s=time.perf_counter() - t0, base_mem_peak=mem.reset())
        every, measured = args.every, args.measured
        saver = Saver(approach, model, opt, work, rank, every, pg)
        n_ck = measured + 2
        window = None
        rec["iters"] = []
        for i in range(n_ck * every):
            ck = (i + 1) // every if (i + 1) % every == 0 else None
            if i == every:  # end of the warm-up interval: its checkpoint durable, then the window opens
                saver.finish()
                dist.barrier()
                mem.reset()
                window = (mem.cpu(), time.perf_counter(), gstep[0])
            rec["iters"].append(iterate(saver, ck))
        saver.finish()
        dist.barrier()
        rec.update(cpu_s=mem.cpu() - window[0], wall_s=time.perf_counter() - window[1],
                   window_iters=gstep[0] - window[2], window_ckpts=n_ck - 1, mem_peak=mem.reset(),
                   durable=saver.durable, final=saver.paths[-1] if saver.paths else None)
        if approach.startswith("deepfreeze"):
            rec["committed"] = commit_times(f"{work}/{approach}/persistent/{NAME}")
            rec["starts"] = saver.starts
        rec.update(saver.close())
        if rank == 0:
            with open(f"{work}/res/{approach}.digests.json", "w") as f:
                json.dump({"step": gstep[0], "digests": digests(model, opt)}, f)
        with open(f"{work}/res/{approach}.r{rank}.json", "w") as f:
            json.dump(rec, f)
        # the older checkpoints of this approach are not needed any more (disk); the final one is kept
        if rank == 0:
            for p in saver.paths[:-1]:
                shutil.rmtree(p, ignore_errors=True)
                if os.path.exists(p + ".pt"):
                    os.unlink(p + ".pt")
    mem.stop.set()
    dist.destroy_process_group()


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
            final = json.load(f)["final"]
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


def summarize(model: str, ranks: int, work: str, approaches: list[str], every: int, measured: int) -> list[dict]:
    def load(a: str) -> list[dict]:
        return [json.load(open(f"{work}/res/{a}.r{r}.json")) for r in range(ranks)]
    rows = []
    for a in approaches:
        rs = load(a)
        iters = [mean(col) for col in zip(*[r["iters"] for r in rs])]  # mean over ranks
        base_iters = [mean(col) for col in zip(*[r["base_iters"] for r in rs])]
        base = mean(base_iters)
        base_cpu = sum(r["base_cpu_s"] for r in rs) / len(base_iters)  # every rank's tree, per iteration
        cks = [k * every - 1 for k in range(2, measured + 2)]  # measured checkpoint iterations
        stall = [iters[i] + iters[i + 1] - 2 * base for i in cks]
        slow = [(sum(iters[i:i + every]) - every * base) / (every * base) for i in cks]
        r0 = rs[0]
        if a.startswith("deepfreeze"):
            durable = [r0["committed"].get(str(k * every), math.nan) - r0["starts"][k - 1]
                       for k in range(2, measured + 2)] if r0.get("starts") else []
        else:
            durable = [max(r["durable"][k - 1] for r in rs) for k in range(2, measured + 2)]
        cpu = (sum(r["cpu_s"] for r in rs) - base_cpu * r0["window_iters"]) / r0["window_ckpts"]
        row = {"model": model, "ranks": ranks, "approach": a, "baseline_iter_s": base, "baseline_se_s": se(base_iters),
               "stall_s": stat(stall), "slowdown": stat(slow), "durable_s": stat(durable), "cpu_s_per_ckpt": cpu,
               "mem_extra_GB": sum(r["mem_peak"] - r["base_mem_peak"] for r in rs) / 1e9, "iter_s": iters}
        if "df_timings" in r0:
            row["df_in_step_ms"] = [1e3 * (x["post_hook_s"] + x["wait_s"] + x["handoff_s"]) for x in r0["df_timings"]]
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", nargs="?", default="drive", choices=["drive", "worker", "restore", "plot"])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--approaches", default=",".join(APPROACHES))
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--measured", type=int, default=2)
    ap.add_argument("--none-steps", type=int, default=4)
    ap.add_argument("--work", default="")
    ap.add_argument("--models", default=None, help="comma list (default: gpt2,resnet50,mlp)")
    ap.add_argument("--ranks", default="1,2")
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
    ranks = [int(r) for r in args.ranks.split(",")]
    approaches = args.approaches.split(",")
    doc = {"settings": {"approaches": approaches, "grid": {m: grid.get(m, FULL.get(m)) for m in models},
                        "ranks": ranks, "torch": __import__("torch").__version__, "cpus": os.cpu_count(),
                        "statistic": "mean over measured checkpoints (each the mean over ranks) +- standard error"},
           "runs": [], "restore": [], "errors": []}
    base = args.base or tempfile.mkdtemp(prefix="torch_dcp-", dir="/var/tmp")
    for m in models:
        every, measured, none_steps = grid.get(m, FULL.get(m))
        for n in ranks:
            work = f"{base}/{m}-{n}"
            shutil.rmtree(work, ignore_errors=True)
            os.makedirs(f"{work}/res")
            t0 = time.time()
            err = torchrun(n, ["worker", "--model", m, "--approaches", ",".join(approaches), "--every", str(every),
                               "--measured", str(measured), "--none-steps", str(none_steps), "--work", work],
                           f"{work}/train.log", timeout=3600)
            if err:
                doc["errors"].append({"model": m, "ranks": n, "error": err})
                print(f"[torch_dcp] {m} x{n}: {err}", flush=True)
                continue
            rows = summarize(m, n, work, approaches, every, measured)
            doc["runs"].extend(rows)
            for row in rows:
                print(json.dumps({k: v for k, v in row.items() if k != "iter_s"}), flush=True)
            for rn in (n, 2 if n == 1 else 1):
                err = torchrun(rn, ["restore", "--model", m, "--approaches", ",".join(approaches), "--work", work],
                               f"{work}/restore{rn}.log", timeout=1800)
                if err:
                    doc["errors"].append({"model": m, "ranks": n, "restore_ranks": rn, "error": err})
                    print(f"[torch_dcp] restore {m} x{n} -> {rn}: {err}", flush=True)
                    continue
                rr = [json.load(open(f"{work}/res/restore{rn}.r{r}.json")) for r in range(rn)]
                for a in approaches:
                    doc["restore"].append({"model": m, "ranks": n, "restore_ranks": rn, "approach": a,
                                           "restore_s": max(x[a]["restore_all_s"] for x in rr),
                                           "bit_exact": all(x[a]["bit_exact"] for x in rr),
                                           "mismatch": rr[0][a]["mismatch"]})
            print(f"[torch_dcp] {m} x{n}: {time.time() - t0:.0f} s", flush=True)
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(f"/dev/shm/torch_dcp-{os.path.basename(work)}", ignore_errors=True)
            write_doc(doc, args.out)
    shutil.rmtree(base, ignore_errors=True)
    finish_doc(doc, args.out, t_start, table, plot)


# ---------------------------------------------------------------------------------------------- report
def fmt(s: "dict | float | None", scale: float = 1.0, digits: int = 3) -> str:
    if isinstance(s, dict):
        if s.get("mean") is None:
            return "–"
        e = f" ± {s['se'] * scale:.{digits}f}" if s.get("se") is not None else ""
        return f"{s['mean'] * scale:.{digits}f}{e}"
    return "–" if s is None else f"{s * scale:.{digits}f}"


def table(doc: dict) -> str:
    lines = []
    for m in dict.fromkeys(r["model"] for r in doc["runs"]):
        for n in sorted({r["ranks"] for r in doc["runs"] if r["model"] == m}):
            rows = [r for r in doc["runs"] if r["model"] == m and r["ranks"] == n]
            lines += [f"#### {m}, {n} rank{'s' if n > 1 else ''}", "",
                      "| approach | baseline iteration (s) | stall (s) | slowdown / interval | to durable (s) | CPU-s / ckpt "
                      f"| extra memory (GB) | restore x{n} (s) | restore x{2 if n == 1 else 1} (s) |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for r in rows:
                rs = {x["restore_ranks"]: x for x in doc["restore"]
                      if x["model"] == m and x["ranks"] == n and x["approach"] == r["approach"]}

                def rst(k: int) -> str:
                    x = rs.get(k)
                    return "–" if x is None else f"{x['restore_s']:.3f}" + ("" if x["bit_exact"] else " (NOT exact)")
                lines.append(f"| {r['approach']} | {fmt({'mean': r['baseline_iter_s'], 'se': r['baseline_se_s']})} "
                             f"| {fmt(r['stall_s'])} | {fmt(r['slowdown'], 100, 1)} % "
                             f"| {fmt(r['durable_s'])} | {fmt(r['cpu_s_per_ckpt'], 1, 2)} | {fmt(r['mem_extra_GB'], 1, 2)} "
                             f"| {rst(n)} | {rst(2 if n == 1 else 1)} |")
            lines.append("")
    lines += targets(doc)
    return "\n".join(lines)


def targets(doc: dict) -> list[str]:
    """The issue's targets at 2 ranks: DeepFreeze against dcp.async_save's best configuration."""
    out = ["#### Targets (2 ranks; DeepFreeze vs the best `dcp.async_save` configuration by stall)", "",
           "| model | best async | stall: async / DeepFreeze (target >= 2) | to durable: DF <= async | "
           "CPU-s: DF <= async | restore: DF <= dcp.load |", "|---|---|---|---|---|---|"]
    for m in dict.fromkeys(r["model"] for r in doc["runs"]):
        rows = {r["approach"]: r for r in doc["runs"] if r["model"] == m and r["ranks"] == 2}
        df = rows.get("deepfreeze") or next((r for a, r in rows.items() if a.startswith("deepfreeze")), None)
        asyncs = [rows[a] for a in DCP_ASYNC if a in rows and rows[a]["stall_s"].get("mean") is not None]
        if not df or not asyncs:
            continue
        best = min(asyncs, key=lambda r: r["stall_s"]["mean"])
        s_a, s_d = best["stall_s"], df["stall_s"]
        err = math.hypot(s_a.get("se") or 0, s_d.get("se") or 0)
        if s_d["mean"] <= (s_d.get("se") or 0):
            ratio = f">= {s_a['mean'] / max(s_d['mean'] + (s_d.get('se') or 0), 1e-9):.1f}x (DF stall within 1 SE of 0)"
        else:
            ratio = f"{s_a['mean'] / s_d['mean']:.1f}x"
        if abs(s_a["mean"] - s_d["mean"]) < err:
            ratio += " (not resolvable)"
        rest = {x["approach"]: x["restore_s"] for x in doc["restore"] if x["model"] == m and x["ranks"] == 2
                and x["restore_ranks"] == 2}
        dcp_load = min((rest[a] for a in ["dcp-save"] + DCP_ASYNC if a in rest), default=None)
        out.append(f"| {m} | {best['approach']} | {ratio} | {fmt(df['durable_s'])} vs {fmt(best['durable_s'])} "
                   f"| {df['cpu_s_per_ckpt']:.2f} vs {best['cpu_s_per_ckpt']:.2f} "
                   f"| {fmt(rest.get('deepfreeze'))} vs {fmt(dcp_load)} |")
    return out + [""]


def plot(doc: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(dict.fromkeys(r["model"] for r in doc["runs"]))
    metrics = [("stall_s", "stall (s)"), ("durable_s", "time to durable (s)"), ("cpu_s_per_ckpt", "CPU-s / ckpt")]
    if not models:
        return
    fig, axes = plt.subplots(len(models), len(metrics), figsize=(5 * len(metrics), 3.2 * len(models)), squeeze=False)
    for i, m in enumerate(models):
        for j, (key, label) in enumerate(metrics):
            ax = axes[i][j]
            ranks = sorted({r["ranks"] for r in doc["runs"] if r["model"] == m})
            approaches = [a for a in doc["settings"]["approaches"]]
            w = 0.8 / max(1, len(approaches))
            for k, a in enumerate(approaches):
                ys, es = [], []
                for n in ranks:
                    r = next((x for x in doc["runs"] if x["model"] == m and x["ranks"] == n and x["approach"] == a), None)
                    v = None if r is None else r[key]
                    ys.append(v["mean"] if isinstance(v, dict) else v)
                    es.append((v.get("se") or 0) if isinstance(v, dict) else 0)
                xs = [x + k * w for x in range(len(ranks))]
                ax.bar(xs, [y or 0 for y in ys], w, yerr=es, label=a)
            ax.set_xticks([x + 0.4 - w / 2 for x in range(len(ranks))], [f"{n} rank(s)" for n in ranks])
            ax.set_title(f"{m}: {label}", fontsize=9)
            if key != "cpu_s_per_ckpt":
                ax.set_yscale("symlog", linthresh=0.05)  # linear below 50 ms: values within noise of 0
                ax.set_ylim(bottom=0)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
