"""How much longer the first checkpoint step stalls training than a later one (issue 42, item 6).

    python -m experiments.first_stall --out experiments/results/first_stall.json
    python -m experiments.first_stall --reps 1 --every 5 --out /tmp/q.json          # smoke

One process, CPU, one torch thread, ``mode = async`` (the built-in engine and the node's backend),
a fresh scratch and persistent directory per repetition (so every repetition is a first run on
its node: no backend listens for that scratch yet), an MLP trained with Adam
(``Checkpointer(every_n_steps=every)``, ``overlap=True``). Each iteration is padded to
``--step-ms`` of busy CPU (the rest of a training step: data, forward, backward), so the first
checkpoint comes ``every * step_ms`` after the Checkpointer is built. Models: ``small`` (an MLP
of about 0.3 MB of parameters) and ``large`` (about 8 MB).

Per checkpoint, the **stall** is the training thread's time in DeepFreeze, from
``Checkpointer.timings``: ``post_hook_s + wait_s + handoff_s`` (the capture in the optimizer's
post-hook, which at the first checkpoint also builds the plan and the engine, the wait for the
background copy at the next pre-hook, the hand-off to the engine). ``iter_stall`` cross-checks it
from the iterations' wall times: ``t[s] + t[s+1] - 2 * median(plain iterations)`` for the checkpoint
captured in iteration ``s`` (plain: next to no checkpoint, the first 3 excluded). ``first`` is the
first checkpoint of a run, ``later`` the mean of the others (the last one, finished by ``close``,
excluded). Reported per model: mean and standard error over ``--reps`` repetitions of ``first``,
``later`` and ``first - later``, and the Checkpointer's construction time (which must not grow:
the backend is started off the training thread). The JSON holds every sample; on a tree whose
``Run`` records its engine set-ups (``Run.setup_s``), ``first_setup`` splits the first
checkpoint's post-hook: seconds waiting for the node's backend to start, and building the engine.

Run it on two trees to compare (``PYTHONPATH=<tree> python experiments/first_stall.py``): it uses
only the public API, the timings list and ``deepfreeze.backend.stop``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

import torch

MODELS = {"small": (256, 1), "large": (1024, 2)}  # (width, hidden layers): ~0.27 MB and ~8.4 MB of parameters


def _model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods: list = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(width, 10))


def _spin(until: float) -> None:
    while time.perf_counter() < until:
        pass


def one_run(kind: str, every: int, ckpts: int, step_ms: float, work: str) -> dict:
    import deepfreeze.torch as dft
    from deepfreeze import backend
    width, layers = MODELS[kind]
    model = _model(width, layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x, y = torch.randn(8, width), torch.randint(0, 10, (8,))
    scratch, persistent = os.path.join(work, "scratch"), os.path.join(work, "persistent")
    t0 = time.perf_counter()
    ck = dft.Checkpointer(model, opt, name="fs", every_n_steps=every, mode="async", scratch=scratch,
                          persistent=persistent)
    built_s = time.perf_counter() - t0
    setup: list = []  # where the Run says so (issue 42, item 6 on): (what, seconds) of each engine set-up
    if hasattr(ck._run, "setup_s"):
        new_engine = ck._run.new_engine

        def recorded(*a, **k):
            out = new_engine(*a, **k)
            setup.extend(ck._run.setup_s[-2:])
            return out
        ck._run.new_engine = recorded
    steps = every * (ckpts + 1)
    stamps = [time.perf_counter()]
    try:
        for _ in range(steps):
            start = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            _spin(start + step_ms / 1e3)
            stamps.append(time.perf_counter())
    finally:
        ck.close()
        backend.stop(scratch, timeout=10, veloc=False)
    iters = [b - a for a, b in zip(stamps, stamps[1:])]  # iters[i]: iteration i (optimizer step i+1)
    ck_iters = {v - 1 for v in range(every, steps + 1, every)}  # captured in iteration v-1, finished in v
    near = ck_iters | {i + 1 for i in ck_iters}
    plain = statistics.median(t for i, t in enumerate(iters) if i >= 3 and i not in near)
    timings = [t for t in ck.timings if t["version"] < steps]  # the last one is finished by close()
    stall = [t["post_hook_s"] + t["wait_s"] + t["handoff_s"] for t in timings]
    iter_stall = [iters[t["version"] - 1] + (iters[t["version"]] if t["version"] < len(iters) else plain) - 2 * plain
                  for t in timings]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"model": kind, "param_mb": params / 1e6, "built_s": built_s, "plain_iter_s": plain, "stall": stall,
            "iter_stall": iter_stall, "first": stall[0], "later": statistics.fmean(stall[1:]),
            "iter_first": iter_stall[0], "iter_later": statistics.fmean(iter_stall[1:]), "timings": ck.timings,
            "first_setup": dict(setup[:2])}


def _mse(xs: list[float]) -> dict:
    m = statistics.fmean(xs)
    se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")
    return {"mean": m, "se": se, "n": len(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--every", type=int, default=40, help="steps between checkpoints (and before the first)")
    ap.add_argument("--ckpts", type=int, default=4, help="checkpoints per run")
    ap.add_argument("--step-ms", type=float, default=28.0, help="each iteration padded to this much busy CPU")
    ap.add_argument("--models", default="small,large")
    ap.add_argument("--label", default="", help="what tree this measures (recorded)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "first_stall.json"))
    ap.add_argument("--combine", nargs="+", metavar="JSON", help="no run: put these results (before, after ...) "
                    "side by side in --out as sets, and draw --png")
    ap.add_argument("--png", default=None)
    args = ap.parse_args()
    if args.combine:
        combine(args.combine, args.out, args.png)
        return
    torch.set_num_threads(1)
    runtime = tempfile.mkdtemp(prefix="dffs-run-")  # a private backend socket directory
    os.environ["DEEPFREEZE_RUNTIME_DIR"] = runtime
    import deepfreeze
    runs, summary = [], {}
    for kind in args.models.split(","):
        rows = []
        for rep in range(args.reps):
            work = tempfile.mkdtemp(prefix=f"dffs-{kind}-{rep}-")
            r = one_run(kind, args.every, args.ckpts, args.step_ms, work)
            r["rep"] = rep
            rows.append(r)
            print(f"{kind} rep {rep}: built {r['built_s'] * 1e3:.0f} ms, first {r['first'] * 1e3:.1f} ms, later "
                  f"{r['later'] * 1e3:.1f} ms (iterations: first +{r['iter_first'] * 1e3:.1f} ms, later "
                  f"+{r['iter_later'] * 1e3:.1f} ms)", file=sys.stderr)
        runs += rows
        summary[kind] = {"param_mb": rows[0]["param_mb"],
                         **{k: _mse([r[k] for r in rows]) for k in ("built_s", "first", "later", "iter_first",
                                                                     "iter_later", "plain_iter_s")},
                         "first_minus_later": _mse([r["first"] - r["later"] for r in rows]),
                         "iter_first_minus_later": _mse([r["iter_first"] - r["iter_later"] for r in rows])}
        waits = [r["first_setup"].get("waiting for the node's backend to start") for r in rows]
        if all(w is not None for w in waits):
            summary[kind]["first_backend_wait"] = _mse(waits)
    out = {"label": args.label, "deepfreeze": os.path.dirname(deepfreeze.__file__), "reps": args.reps,
           "every": args.every, "ckpts": args.ckpts, "step_ms": args.step_ms,
           "first_checkpoint_after_s": args.every * args.step_ms / 1e3, "cpus": os.cpu_count(),
           "load": os.getloadavg(), "summary": summary, "runs": runs}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for kind, s in summary.items():
        print(f"{kind} ({s['param_mb']:.2f} MB): first {1e3 * s['first']['mean']:.1f} ± {1e3 * s['first']['se']:.1f} "
              f"ms, later {1e3 * s['later']['mean']:.1f} ± {1e3 * s['later']['se']:.1f} ms, first - later "
              f"{1e3 * s['first_minus_later']['mean']:.1f} ± {1e3 * s['first_minus_later']['se']:.1f} ms; built in "
              f"{1e3 * s['built_s']['mean']:.0f} ± {1e3 * s['built_s']['se']:.0f} ms")


def combine(paths: list[str], out: str, png: "str | None") -> None:
    """Results of runs on two trees (before, after), side by side: one JSON of sets and a bar chart
    of ``first - later`` (mean ± SE) per model and set."""
    sets = {}
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        sets[d["label"].split(":")[0] or os.path.basename(p)] = d
    with open(out, "w") as f:
        json.dump({"what": "experiments/first_stall.py: the first checkpoint's extra stall (first - later), "
                           "per tree, on one machine one after the other", "sets": sets}, f, indent=1)
    if png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        models = list(next(iter(sets.values()))["summary"])
        fig, ax = plt.subplots(figsize=(6, 3.5))
        w = 0.8 / len(sets)
        for i, (name, d) in enumerate(sets.items()):
            m = [1e3 * d["summary"][k]["first_minus_later"]["mean"] for k in models]
            e = [1e3 * d["summary"][k]["first_minus_later"]["se"] for k in models]
            ax.bar([j + i * w for j in range(len(models))], m, w, yerr=e, capsize=3, label=name)
        ax.axhline(50, color="k", lw=0.8, ls="--", label="target: 50 ms")
        ax.set_xticks([j + w * (len(sets) - 1) / 2 for j in range(len(models))])
        ax.set_xticklabels([f"{k} ({next(iter(sets.values()))['summary'][k]['param_mb']:.2f} MB)" for k in models])
        ax.set_ylabel("first checkpoint's stall - a later one's (ms)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main()
