"""Where DeepFreeze's CPU goes per checkpoint, thread by thread (issue 34, items 1 and 4).

    python -m experiments.cpu_per_ckpt --model mlp --checkpoints 10 --out /tmp/cpu.json
    python -m experiments.cpu_per_ckpt --model mlp --profile          # + cProfile of the training thread

One process (gloo, world size 1), one model of ``experiments/torch_models.py`` with AdamW, a
:class:`deepfreeze.torch.Checkpointer` with the shipped defaults (``mode = async``; scratch and persistent
under ``--work``, one disk: ``write_once = auto`` applies), a checkpoint every 2 iterations.
After warm-up, ``--checkpoints`` checkpoints are taken and waited for, and the CPU seconds of
every thread of this process (``/proc/self/task/<tid>/stat``: the training thread, the capture
copier, the writer's lanes) and of the node's backend process tree (``/proc/<pid>/stat`` with
reaped children) are read before and after, per checkpoint. ``--baseline`` runs the same
iterations without a Checkpointer first: the training thread's extra CPU is the difference.

This is a profile, not a comparison: the figures of the issue's targets come from
``experiments/torch_dcp.py`` (interleaved repetitions, mean +- standard error). Thread names:
Python 3.11 does not name OS threads, so they are told apart by tid and by their CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

_HZ = os.sysconf("SC_CLK_TCK")


def task_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of every thread of this process, by ``comm:tid``."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                st = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        fields = st[st.rindex(")") + 2:].split()
        out[f"{name}:{tid}"] = (int(fields[11]) + int(fields[12])) / _HZ
    return out


def backend_cpu() -> float:
    """CPU seconds of this user's DeepFreeze backend processes, reaped children included."""
    total = 0.0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            if b"deepfreeze.backend" not in cmd or os.stat(f"/proc/{pid}").st_uid != os.getuid():
                continue
            with open(f"/proc/{pid}/stat") as f:
                st = f.read()
        except OSError:
            continue
        fields = st[st.rindex(")") + 2:].split()
        total += sum(int(x) for x in fields[11:15]) / _HZ
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="mlp", choices=["mlp", "resnet50", "gpt2"])
    ap.add_argument("--checkpoints", type=int, default=10)
    ap.add_argument("--work", default="/tmp/df-cpu-per-ckpt")
    ap.add_argument("--baseline", action="store_true", help="also run the iterations without a Checkpointer")
    ap.add_argument("--profile", action="store_true", help="cProfile the training thread (top 30 by cumulative)")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    import torch
    import torch.distributed as dist
    from experiments import torch_models as tm
    from deepfreeze.torch import Checkpointer
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model = torch.nn.parallel.DistributedDataParallel(tm.build(args.model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    shutil.rmtree(args.work, ignore_errors=True)

    def iterate() -> None:
        x, y = tm.batch(args.model, 0, 0)
        tm.loss_of(args.model, model(x), y).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        iterate()
    doc: dict = {"model": args.model, "checkpoints": args.checkpoints, "torch": torch.__version__}
    n_iter = 2 * args.checkpoints
    if args.baseline:
        c0 = task_cpu()
        for _ in range(n_iter):
            iterate()
        c1 = task_cpu()
        doc["baseline_cpu_s_per_2_iterations"] = sum(c1[k] - c0.get(k, 0.0) for k in c1) / args.checkpoints
    ck = Checkpointer(model, opt, name="cpu", every_n_steps=2, overwrite=True, max_versions=0, mode="async",
                      scratch=f"{args.work}/scratch", persistent=f"{args.work}/persistent")
    for _ in range(4):
        iterate()
    ck.wait()
    prof = None
    if args.profile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    c0, b0, w0 = task_cpu(), backend_cpu(), time.perf_counter()
    for _ in range(n_iter):
        iterate()
    ck.wait()
    c1, b1 = task_cpu(), backend_cpu()
    if prof is not None:
        prof.disable()
        import pstats
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    doc["wall_s"] = time.perf_counter() - w0
    doc["threads_cpu_s_per_ckpt"] = {k: round((c1[k] - c0.get(k, 0.0)) / args.checkpoints, 4) for k in c1
                                     if c1[k] - c0.get(k, 0.0) > 0}
    doc["backend_cpu_s_per_ckpt"] = round((b1 - b0) / args.checkpoints, 4)
    ck.close()
    dist.destroy_process_group()
    shutil.rmtree(args.work, ignore_errors=True)
    print(json.dumps(doc, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
