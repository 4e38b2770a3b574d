"""The PyTorch model repository (issues 35 and 45) against torch.save / torch.load and safetensors:
store, full load and a 25 % partial load, cold page cache, every load in a fresh process, time and
bytes read, side by side.

    python -m experiments.torch_repo_bench --out experiments/results/torch_repo.json     # the pass (~8 min idle)
    python -m experiments.torch_repo_bench --quick --out /tmp/tr.json                     # smoke (~40 s)
    python -m experiments.torch_repo_bench --table experiments/results/torch_repo.json    # markdown again

Model (``experiments/torch_models.py``): ``resnet50`` (25.6 M parameters, 102 MB of float32
weights and BatchNorm buffers; ``--quick``: ``mlp``, 500 ``Linear(32, 32)``). The partial module is
the transfer-learning case: a prefix of the model's layers (ResNet-50: the stem and the first
bottleneck blocks; MLP: the first layers) holding the fraction of the state-dict bytes closest
to 25 %, under a new head (``head = Linear(..., 10)``), the same attribute names as the stored
model (so ``load_state_dict(strict=False)`` and a load by name find them). ``torch.set_num_threads(1)``.

Approaches, every one in each round (the order fixed: A, B, C, ... then again):

* ``deepfreeze``: ``store_model(Repository(dir), "m<round>", model)`` (embedded repository, the
  defaults: no fsync, CRC32 checked on every read) / ``load_into(repo, name, module)`` (layers
  matched by id, the default: the module's graph traced with ``torch.fx``);
* ``deepfreeze-name`` (loads only; the same store): ``load_into(..., match="name")``: the module's
  layers found by walking it and paired with the stored layers by qualified name, nothing traced
  (issue 45: the caller names the layers);
* ``torch``: ``torch.save(state_dict, f.pt)`` / ``torch.load(f.pt, weights_only=True)`` +
  ``load_state_dict`` (partial: ``strict=False``);
* ``torch-mmap`` (partial): ``torch.load(f.pt, weights_only=True, mmap=True)`` +
  ``load_state_dict(strict=False)`` (only the pages of the partial's tensors are touched);
* ``safetensors``: ``safetensors.torch.save_file(state_dict, f.safetensors)`` /
  ``load_file`` + ``load_state_dict`` (full); partial: ``safe_open`` and ``get_tensor`` of only
  the partial's keys, then ``load_state_dict(strict=False)``.

A round: the source's weights get a new constant added (untimed: no store is de-duplicated
against an earlier round's), every approach stores (timed, no fsync, in this process, after an untimed
``sync`` so that no store is throttled for the dirty pages of the ones before it), then every
load runs in a fresh Python process of its own (``--child``: torch, the approach's library and the
target module ready before the clock starts), cold: before it, every file of that approach's store
(the repository's whole directory: ``packs/``, ``meta.db`` and its WAL; the ``.pt``; the
``.safetensors``) is written back and dropped from the page cache with
``posix_fadvise(POSIX_FADV_DONTNEED)`` (:func:`experiments.repo.drop_cache`; not
``/proc/sys/vm/drop_caches``, which would empty the other users' caches too). The time is that
process's first load (nothing imported lazily yet, nothing traced, no database page cached); the
same process then loads again, cold again, which is the *warm-process* figure beside it. Bytes
read: ``read_bytes`` of ``/proc/self/io`` around the first load (what the process made the block
layer read: read-ahead included). Every load is checked bit-exact (SHA-256 of the loaded tensors
against the source's). Round 0 stores only (a warm-up of the stores; the loads need none). Per
approach and operation: mean ± SE over the rounds; ratios: the baseline's mean time over each
DeepFreeze approach's, SE propagated. Targets (:data:`TARGETS`).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from experiments.repo import drop_cache, read_bytes  # noqa: E402
from experiments.torch_siblings_report import MINE, plot_bars, repo_table, speedup, stat  # noqa: E402

STORES = ["deepfreeze", "torch", "safetensors"]
FULL = ["deepfreeze", "deepfreeze-name", "torch", "safetensors"]
PARTIAL = ["deepfreeze", "deepfreeze-name", "torch", "torch-mmap", "safetensors"]
#: (operation, DeepFreeze approach, baseline) -> the target (DeepFreeze at least this many times faster): store
#: and full load at least as fast as torch.save/torch.load (issue 35); the partial load by name (issue 45: the
#: caller names the layers, nothing traced) at least 2x faster than torch.load + strict=False and faster than
#: safetensors' safe_open of the same tensors; the other ratios are reported without one
TARGETS = {("store", "deepfreeze", "torch"): 1.0, ("full", "deepfreeze", "torch"): 1.0,
           ("partial", "deepfreeze-name", "torch"): 2.0, ("partial", "deepfreeze-name", "safetensors"): 1.0}
FRACTION = 0.25


def partial_model(name: str, source):
    """A prefix of ``source``'s layers holding the share of its state-dict bytes closest to
    :data:`FRACTION`, under a new head; returns (module, fraction of the bytes, description)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    def nbytes(m) -> int:
        return sum(t.numel() * t.element_size() for t in m.state_dict().values())
    total = nbytes(source)
    blocks = list(source.layers)
    stem = nbytes(source) - sum(nbytes(b) for b in blocks) - (nbytes(source.fc) if name == "resnet50" else 0)
    acc, best = stem, (abs(stem / total - FRACTION), 0)
    for i, b in enumerate(blocks):
        acc += nbytes(b)
        best = min(best, (abs(acc / total - FRACTION), i + 1))
    n = best[1]
    torch.manual_seed(1)
    if name == "resnet50":
        class Partial(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.conv1, self.bn1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)
                self.layers = nn.Sequential(*[type(b)(b.conv1.in_channels, b.conv1.out_channels,
                                                      b.conv2.stride[0]) for b in blocks[:n]])
                self.head = nn.Linear(blocks[n - 1].conv3.out_channels, 10)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
                return self.head(torch.flatten(F.adaptive_avg_pool2d(self.layers(x), 1), 1))
        what = f"stem + the first {n} of 16 bottleneck blocks, new Linear head"
    elif name == "mlp":
        class Partial(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(n))
                self.head = nn.Linear(32, 10)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                for m in self.layers:
                    x = x + 0.1 * torch.tanh(m(x))
                return self.head(x)
        what = f"the first {n} of {len(blocks)} Linear layers, new Linear head"
    else:
        raise SystemExit(f"no partial module for {name!r}: use resnet50 or mlp")
    p = Partial()
    keys = [k for k in p.state_dict() if k in source.state_dict()]
    return p, sum(source.state_dict()[k].numel() * source.state_dict()[k].element_size() for k in keys) / total, \
        what, keys


def _digest(tensors) -> str:
    """SHA-256 over the bytes of ``tensors`` (in order): what a load is checked bit-exact by."""
    import hashlib
    import torch
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def child(spec: dict) -> dict:
    """One load in this fresh process (``--child``): build the target (untimed), then the load cold
    twice: ``fresh`` (the first in the process: nothing imported lazily, nothing traced, no
    database page cached yet) and ``warm`` (the same again in this process, the page cache dropped
    again). Returns both times, bytes read and the digest of the loaded keys after each."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file
    from deepfreeze.repo import Repository
    from deepfreeze.torch import load_into
    from experiments.torch_models import build
    torch.set_num_threads(1)
    op, x, root, name = spec["op"], spec["approach"], spec["root"], spec["name"]
    if op == "full":
        module = build(spec["model"])
        keys = list(module.state_dict())
    else:
        module, _f, _w, keys = partial_model(spec["model"], build(spec["model"]))
    files = {"torch": os.path.join(root, "m.pt"), "safetensors": os.path.join(root, "m.safetensors")}
    where = os.path.join(root, "repo") if x.startswith("deepfreeze") else files["safetensors" if x == "safetensors"
                                                                                 else "torch"]
    out = {}
    for when in ("fresh", "warm"):
        with torch.no_grad():
            for t in module.state_dict().values():
                t.zero_() if not t.is_floating_point() else t.fill_(-7.0)
        gc.collect()
        drop_cache(where)
        repo = Repository(where) if x.startswith("deepfreeze") else None
        b0, t0 = read_bytes(), time.perf_counter()
        if repo is not None:
            rep = load_into(repo, name, module, match="name" if x == "deepfreeze-name" else "id")
        elif x in ("torch", "torch-mmap"):
            sd = torch.load(files["torch"], weights_only=True, mmap=x == "torch-mmap")
            module.load_state_dict(sd, strict=op == "full")
            del sd
        elif op == "full":
            module.load_state_dict(load_file(files["safetensors"]))
        else:
            with safe_open(files["safetensors"], framework="pt") as f:
                sd = {k: f.get_tensor(k) for k in keys}
            module.load_state_dict(sd, strict=False)
            del sd
        dt = time.perf_counter() - t0
        got = read_bytes() - b0
        if repo is not None:
            repo.close()
        sd = module.state_dict()
        out[when] = {"s": dt, "read": got, "digest": _digest(sd[k] for k in keys),
                     "layers": len(rep.loaded) if repo is not None else None}
    return out


def run(a: argparse.Namespace, root: str) -> dict:
    import subprocess
    import torch
    from safetensors.torch import save_file
    from deepfreeze.repo import Repository
    from deepfreeze.torch import store_model
    from experiments.torch_models import build
    torch.set_num_threads(1)
    src = build(a.model)
    part, fraction, what, part_keys = partial_model(a.model, src)
    total = sum(t.numel() * t.element_size() for t in src.state_dict().values())
    rdir = os.path.join(root, "repo")
    files = {"torch": os.path.join(root, "m.pt"), "safetensors": os.path.join(root, "m.safetensors")}
    ops = (("store", STORES), ("full", FULL), ("partial", PARTIAL))
    times: dict = {op: {x: [] for x in xs} for op, xs in ops}
    reads: dict = {op: {x: [] for x in xs} for op, xs in ops}
    warm: dict = {op: {x: [] for x in xs} for op, xs in ops[1:]}
    exact = True
    loaded_layers = {}
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for r in range(a.reps + 1):
        with torch.no_grad():
            for t in src.state_dict().values():
                if t.is_floating_point():
                    t.add_(0.001 * (r + 1))
        name = f"m{r}"
        sd = src.state_dict()
        want = {"full": _digest(sd[k] for k in sd), "partial": _digest(sd[k] for k in part_keys)}
        for x in STORES:
            os.sync()   # untimed: each store starts with no dirty pages of the last ones (the kernel throttles
            b0, t = read_bytes(), time.perf_counter()   # a writer past its dirty limit: 80-380 ms for one code)
            if x == "deepfreeze":
                repo = Repository(rdir)
                store_model(repo, name, src)
                repo.close()
            elif x == "torch":
                torch.save(sd, files["torch"])
            else:
                save_file({k: v.contiguous() for k, v in sd.items()}, files["safetensors"])
            dt = time.perf_counter() - t
            if r:
                times["store"][x].append(dt)
                reads["store"][x].append(read_bytes() - b0)
        for op, approaches in ops[1:] if r else ():   # (every load is in a fresh process: no warm-up round)
            for x in approaches:
                spec = {"op": op, "approach": x, "root": root, "name": name, "model": a.model}
                p = subprocess.run([sys.executable, "-m", "experiments.torch_repo_bench", "--child", json.dumps(spec)],
                                   cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
                if p.returncode != 0:
                    raise SystemExit(f"{op} {x} failed:\n{p.stderr[-3000:]}")
                got = json.loads(p.stdout.strip().splitlines()[-1])
                exact = exact and all(got[w]["digest"] == want[op] for w in ("fresh", "warm"))
                if op == "partial" and got["fresh"]["layers"] is not None:
                    loaded_layers[x] = got["fresh"]["layers"]
                if r:
                    times[op][x].append(got["fresh"]["s"])
                    reads[op][x].append(got["fresh"]["read"])
                    warm[op][x].append(got["warm"]["s"])
        print(f"round {r}: " + ", ".join(f"{op} {x} {v[-1] * 1e3:.0f} ms" for op in times
                                         for x, v in times[op].items() if v and r), flush=True)
        if r == 0:
            print(f"round 0 (warm-up) done, bit-exact so far: {exact}", flush=True)
    return {"model_MB": total / 1e6, "partial": {"what": what, "fraction": fraction, "tensors": len(part_keys),
                                                 "layers_loaded": loaded_layers},
            "times_s": times, "warm_times_s": warm, "read_bytes": reads, "bit_exact": exact}


def summarise(doc: dict) -> None:
    """Per operation and approach: mean ± SE of time (fresh process; and warm) and of MB read over
    the rounds; the ratios of each baseline to each DeepFreeze approach."""
    doc["ops"] = {op: {x: {"time_s": stat(v), "read_MB": stat([b / 1e6 for b in doc["read_bytes"][op][x]]),
                           **({"warm_s": stat(doc["warm_times_s"][op][x])} if op in doc.get("warm_times_s", {})
                              else {})}
                       for x, v in rows.items()} for op, rows in doc["times_s"].items()}
    doc["ratios"] = {op: {m: {x: speedup(r["time_s"], rows[m]["time_s"], TARGETS.get((op, m, x)))
                              for x, r in rows.items() if x not in MINE}
                          for m in MINE if m in rows} for op, rows in doc["ops"].items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke: mlp (2 MB), 1 round")
    ap.add_argument("--model", default=None, help="resnet50 or mlp (default resnet50; --quick mlp)")
    ap.add_argument("--reps", type=int, default=None, help="measured rounds (default 10; --quick 1)")
    ap.add_argument("--dir", default=None, help="where the files go (default: a temporary directory under /var/tmp, "
                                                "a disk: /tmp may be a tmpfs, whose pages cannot be dropped)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "torch_repo.json"))
    ap.add_argument("--table", metavar="JSON", help="print the markdown table of a results file and exit")
    ap.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)   # one load in a fresh process (JSON spec)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return
    if a.table:
        with open(a.table) as f:
            doc = json.load(f)
        summarise(doc)  # (every figure follows from the samples)
        print(repo_table(doc))
        return
    a.model = a.model or ("mlp" if a.quick else "resnet50")
    a.reps = a.reps or (1 if a.quick else 10)
    root = tempfile.mkdtemp(prefix="dftr-", dir=a.dir or "/var/tmp")
    t0 = time.time()
    load_start = os.getloadavg()
    import torch
    try:
        got = run(a, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    doc = {"experiment": "torch_repo", "model": a.model, "reps": a.reps, "quick": a.quick,
           "cold": "posix_fadvise(POSIX_FADV_DONTNEED) on every file of the store before each load",
           "cores": os.cpu_count(), "torch": torch.__version__, "load_avg_start": load_start,
           "load_avg_end": os.getloadavg(),
           "command": " ".join(["python -m experiments.torch_repo_bench"] + sys.argv[1:]), **got,
           "wall_s": time.time() - t0}
    summarise(doc)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(repo_table(doc))
    try:
        plot_bars({op: {x: r["time_s"] for x, r in rows.items()} for op, rows in doc["ops"].items()}, "ms",
                  f"torch repository, {a.model}, cold", os.path.splitext(a.out)[0] + ".png")
    except ImportError:
        pass


if __name__ == "__main__":
    main()
