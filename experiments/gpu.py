"""The project's one GPU script: the CUDA capture tests, then DeepFreeze against ``dcp.async_save``
with its pinned-memory stager on a 124 M and a 1.3 B parameter model, in one call.

    python experiments/gpu.py --out "$OUT"                                  # on a GPU machine (< 8 min)
    python experiments/gpu.py --device cpu --scale small --out /tmp/gpu-out  # CPU smoke (~1 min here)

Runs with the system Python of a bare GPU machine: nothing of the project is installed there;
``deepfreeze`` is imported from this tree (the script puts the repository root first on
``sys.path`` and in ``PYTHONPATH`` for the processes it starts), numpy and torch are the
machine's own. pytest is the machine's, else the one in ``<repo>/.gpu-deps`` (made here with
``python experiments/gpu.py --prepare-deps``: ``pip install --target .gpu-deps pytest``, pure
Python, 15 MB; carried to the device), else the test phase is recorded as not run. It never needs the network.

Phases, each written to ``<out>/gpu.json`` (atomically) as it ends, so a run cut short keeps what
it measured (``phases[*].wall_s`` times each): ``versions`` (printed first), ``cuda_tests``
(``tests/test_torch_cuda.py`` under pytest in a subprocess; counts from its JUnit XML),
``stream`` (a ``deepfreeze.torch.Publisher`` here and a consumer process whose replicas are on the
device: latency from the end of ``optimizer.step()`` to the version served, served weights
checked against digests recorded after each step: :func:`stream_phase`), then
``gpt2`` (124.4 M parameters) and ``gpt-1.3b`` (the same ``GPT2`` of experiments/torch_models.py,
24 layers, d_model 2048: 1.31 B parameters, 15.8 GB of fp32 state with AdamW), one process
(world size 1, a gloo group through a file), each approach on a fresh model and optimizer:
``deepfreeze`` (``Checkpointer``, async, the default configuration with retention 1) and
``dcp-async-thread-staged`` (``dcp.async_save``, thread checkpointer, a ``DefaultStager`` with
pinned memory and non-blocking copies on CUDA, async staging; torch 2.11's stager closes itself
after one stage, so there one is made per checkpoint: ``stagers``); ``--approaches`` can add
``dcp-async-process-staged``. DCP keeps one save in flight and at most two checkpoints on disk.

Per approach: baseline iterations, a warm-up checkpoint (``first_stall_s``), ``measured``
checkpoints every ``every`` iterations (the interval over the median baseline iteration), a
final one waited until durable, whose state (BLAKE2b of every tensor of ``get_state_dict``) is
restored into a fresh model and optimizer and compared (``bit_exact``). Figures: stall
(checkpoint iteration + next - 2 x baseline; iterations end with a sync of the current CUDA
stream only), slowdown per interval, time to durable (DCP's upload future; DeepFreeze's
manifest ``committed`` time, read by a 10 ms watcher thread whose CPU is left out), CPU-seconds
per checkpoint (this process's tree from ``/proc``, with reaped children, minus the baseline's
CPU per iteration), restore seconds; mean +- standard error over the measured checkpoints.
A time budget (``--budget``) shortens ``measured`` or skips an approach or the 1.3 B model (with
the reason in the JSON); a watchdog ends a hung run ``--grace`` seconds past it. Sizing, the
intervals and the device command: docs/performance-history.md, "GPU run (experiments/gpu.py)".
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEPS = os.path.join(ROOT, ".gpu-deps")
NAME = "gpu"
#: DeepFreeze's scratch when it goes to tmpfs (removed at the end, and when an approach fails)
SHM = f"/dev/shm/deepfreeze-gpu-{os.getpid()}"
_HZ = os.sysconf("SC_CLK_TCK")


def _paths() -> None:
    """The tree's deepfreeze first, here and in every child process; .gpu-deps too when it exists
    and this Python has no pytest of its own."""
    import importlib.util
    extra = [ROOT] + ([DEPS] if os.path.isdir(DEPS) and importlib.util.find_spec("pytest") is None else [])
    for p in reversed(extra):
        if p not in sys.path:
            sys.path.insert(0, p)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(extra + ([old] if old else []))


_paths()

from experiments.torch_dcp_report import fmt  # noqa: E402  (one formatter of mean ± SE for both reports)

#: model specs: (vocab, ctx, d, layers, heads) of experiments.torch_models.GPT2
MODELS = {
    "full": {"gpt2": (50257, 1024, 768, 12, 12), "gpt-1.3b": (50257, 1024, 2048, 24, 16)},
    "small": {"gpt2": (512, 64, 64, 2, 2), "gpt-1.3b": (512, 64, 128, 4, 4)},
}
#: per scale and model: (interval seconds, measured checkpoints, baseline iterations)
SCHEDULE = {
    "full": {"gpt2": (3.0, 5, 20), "gpt-1.3b": (10.0, 2, 10)},
    "small": {"gpt2": (0.15, 3, 6), "gpt-1.3b": (0.15, 3, 6)},
}
APPROACHES = {"gpt2": ["deepfreeze", "dcp-async-thread-staged"],
              "gpt-1.3b": ["deepfreeze", "dcp-async-thread-staged"]}


# ------------------------------------------------------------------------------------ small helpers
def write_json(doc: dict, out: str) -> None:
    """``<out>/gpu.json``, atomically (a run killed mid-write leaves the previous one)."""
    path = os.path.join(out, "gpu.json")
    tmp = f"{path}.{threading.get_ident()}.tmp"  # the watchdog thread may write too
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(tmp, path)


def mean(v: list[float]) -> float | None:
    return sum(v) / len(v) if v else None


def stat(v: list) -> dict:
    """mean, standard error (None below 2 values) and n of the finite values of ``v``."""
    v = [float(x) for x in v if x is not None and math.isfinite(x)]
    m = mean(v)
    se = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1) / len(v)) if len(v) > 1 else None
    return {"mean": m, "se": se, "n": len(v)}


def tree(root: int) -> dict[int, list[str]]:
    """``/proc/<pid>/stat`` fields (after the command name) of ``root`` and every live process
    descended from it (DeepFreeze's backend, DCP's checkpoint process)."""
    kids: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    v = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            stats[int(d)] = v
            kids.setdefault(int(v[1]), []).append(int(d))
    out, todo = {}, [root]
    while todo:
        p = todo.pop()
        if p in stats:
            out[p] = stats[p]
        todo += kids.get(p, [])
    return out


def tree_cpu(root: int) -> float:
    """CPU seconds (user + system, every thread, plus reaped children's) of ``root``'s tree."""
    return sum(sum(int(x) for x in v[11:15]) for v in tree(root).values()) / _HZ  # utime stime cutime cstime


def free_bytes(path: str) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def meminfo(key: str) -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _cmd(argv: list[str]) -> str | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def versions(device: str, work: str) -> dict:
    import numpy as np
    import torch
    v = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
         "torch": torch.__version__, "torch_cuda": torch.version.cuda, "numpy": np.__version__,
         "cuda_available": torch.cuda.is_available(), "device": device, "cpus": os.cpu_count(),
         "ram_GB": meminfo("MemTotal") / 1e9, "ram_available_GB": meminfo("MemAvailable") / 1e9,
         "work": work, "work_free_GB": free_bytes(work) / 1e9, "shm_free_GB": free_bytes("/dev/shm") / 1e9,
         "commit": _cmd(["git", "-C", ROOT, "rev-parse", "HEAD"])}
    try:
        import pytest
        v["pytest"] = pytest.__version__
    except ImportError:
        v["pytest"] = None
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name(0)
        v["gpu_memory_GB"] = torch.cuda.get_device_properties(0).total_memory / 1e9
        v["driver"] = _cmd(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        if not v["driver"]:
            try:
                with open("/proc/driver/nvidia/version") as f:
                    v["driver"] = f.readline().strip()
            except OSError:
                v["driver"] = None
    return v


# ------------------------------------------------------------------------------------ phase: tests
def cuda_tests(out: str, timeout: float) -> dict:
    """tests/test_torch_cuda.py under pytest in a subprocess; counts from its JUnit XML."""
    import importlib.util
    if importlib.util.find_spec("pytest") is None:
        return {"ran": False, "reason": "pytest is not importable (neither installed nor in .gpu-deps: "
                                        "pip install --target .gpu-deps pytest, and carry .gpu-deps)"}
    xml, log = os.path.join(out, "cuda_tests.xml"), os.path.join(out, "cuda_tests.log")
    cmd = [sys.executable, "-m", "pytest", "tests/test_torch_cuda.py", "-q", "-rs", "-p", "no:cacheprovider",
           f"--junitxml={xml}"]
    res: dict = {"ran": True, "command": " ".join(cmd[1:])}
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        res["rc"], text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        res["rc"], res["timed_out"] = None, True
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    with open(log, "w") as f:
        f.write(text)
    res["tail"] = text[-1500:]
    try:
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        res.update(n, passed=n["tests"] - n["failures"] - n["errors"] - n["skipped"])
        res["skip_reasons"] = sorted({s.get("message", "") for s in suite.iter("skipped")})
    except (OSError, ET.ParseError, AttributeError) as e:
        res["xml_error"] = str(e)
    return res


# ------------------------------------------------------------------------------------ the models
def build(spec: tuple, device: str, seed: int = 0):
    """GPT2 of experiments/torch_models.py with ``spec``, built on ``device`` (its init there)."""
    import torch
    from experiments import torch_models as tm
    vocab, ctx, d, layers, heads = spec
    torch.manual_seed(seed)
    with torch.device(device):
        net = tm.GPT2(vocab=vocab, ctx=ctx, d=d, layers=layers, heads=heads)
    return net


def make_batch(spec: tuple, step: int, device: str):
    import torch
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, spec[0], (2, min(32, spec[1]) + 1), generator=g).to(device)
    return idx[:, :-1], idx[:, 1:]


def digests(model, opt, threads: int = 8) -> dict[str, str]:
    """BLAKE2b of the bytes of every tensor of ``get_state_dict(model, opt)`` (flattened FQNs),
    hashed in ``threads`` threads (hashlib drops the GIL on large buffers)."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    items = dict(msd)
    for fqn, kv in osd["state"].items():
        for key, v in kv.items():
            items[f"optim.state.{fqn}.{key}"] = v

    keys = sorted(k for k, v in items.items() if isinstance(v, torch.Tensor))
    with ThreadPoolExecutor(threads) as ex:
        return dict(zip(keys, ex.map(tensor_digest, [items[k] for k in keys])))


def tensor_digest(v) -> str:
    """BLAKE2b (16 bytes, hex) of a tensor's bytes (copied to the CPU when on a device)."""
    import torch
    a = v.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()
    return hashlib.blake2b(memoryview(a), digest_size=16).hexdigest()


def module_digests(module) -> dict[str, str]:
    """:func:`tensor_digest` of every entry of ``module.state_dict()``."""
    return {k: tensor_digest(v) for k, v in module.state_dict().items()}


def big_state_bytes(spec: tuple) -> int:
    """fp32 bytes of a GPT2 ``spec``'s parameters and AdamW's two moments (12 per parameter)."""
    vocab, ctx, d, layers, _ = spec
    return 12 * (vocab * d + ctx * d + layers * (12 * d * d + 13 * d) + 2 * d)


def state_bytes(model, opt) -> int:
    import torch
    seen, n = set(), 0
    tensors = list(model.state_dict().values()) + [v for s in opt.state.values() for v in s.values()]
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            n += t.numel() * t.element_size()
    return n


# ------------------------------------------------------------------------------------ the approaches
class Saver:
    """One approach's checkpoint call and waits in the loop."""

    def __init__(self, approach: str, model, opt, work: str, scratch: str | None, every: int, pg, cuda: bool) -> None:
        self.approach, self.model, self.opt, self.pg = approach, model, opt, pg
        self.work, self.every = work, every
        self.future = self.staging = self.stager = self.ckpt = None
        self.durable: dict[int, float] = {}  # version -> seconds from its start to durable
        self.starts: dict[int, float] = {}
        self.paths: list[str] = []
        self.committed: dict[int, float] = {}
        self._seen: set[str] = set()
        self._gc: list[threading.Thread] = []
        if approach == "deepfreeze":
            from deepfreeze.torch import Checkpointer
            self.persistent = f"{work}/persistent"
            self.scratch = scratch or f"{work}/scratch"
            self.ckpt = Checkpointer(model, opt, name=NAME, every_n_steps=every, overwrite=True, mode="async",
                                     scratch=self.scratch, persistent=self.persistent, max_versions=1,
                                     scratch_versions=1)
            # commit times: a version's manifest is gone once the next one commits (retention 1), so
            # a thread lists persistent every 10 ms; its own CPU (watch_cpu) is left out of the figure
            self.watch_cpu, self._stop = 0.0, threading.Event()
            self._watcher = threading.Thread(target=self._watch, name="gpu-commit-watch", daemon=True)
            self._watcher.start()
        else:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            self.options = {"use_pinned_memory": cuda, "use_shared_memory": "process" in approach,
                            "use_async_staging": True, "use_non_blocking_copy": cuda}
            self._new_stager = lambda: DefaultStager(StagingOptions(**self.options))
            self.stager = self._new_stager()
            self.stagers = 1

    def before_step(self) -> None:
        """Before ``optimizer.step()``: DCP's staged copy complete before state is mutated."""
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def save(self, version: int, t0: float) -> None:
        """After ``optimizer.step()`` of the checkpoint iteration (DeepFreeze captured in it)."""
        self.starts[version] = t0
        if self.ckpt is not None:
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        if self.future is not None:
            self.future.result()  # one in flight
            self._remove(self.paths[:-1])  # keep the newest durable one only
            self.paths = self.paths[-1:]
        if self._spent(self.stager):
            # torch 2.11's DefaultStager closes its StateDictStager after every stage (its copy table
            # and cached buffers cleared: a second stage raises KeyError: <class 'type'>), so there a
            # stager serves one checkpoint; 2.13 keeps it (and its buffers) for the run
            self.stager.close()
            self.stager = self._new_stager()
            self.stagers += 1
        path = f"{self.work}/dcp/v{version}"
        self.paths.append(path)
        msd, osd = get_state_dict(self.model, self.opt)
        kind = AsyncCheckpointerType.PROCESS if "process" in self.approach else AsyncCheckpointerType.THREAD
        r = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path, async_checkpointer_type=kind,
                           async_stager=self.stager, process_group=self.pg)
        self.staging, self.future = r.staging_completion, r.upload_completion

        def done(_f, version=version, t0=t0) -> None:
            self.durable[version] = time.time() - t0
        self.future.add_done_callback(done)

    @staticmethod
    def _spent(stager) -> bool:
        """Whether ``stager`` closed itself after staging (torch 2.11): its copy table is empty."""
        table = getattr(getattr(stager, "_state_dict_stager", None), "_deepcopy_dispatch", None)
        return isinstance(table, dict) and not table

    def _remove(self, paths: list[str]) -> None:
        t = threading.Thread(target=lambda: [shutil.rmtree(p, ignore_errors=True) for p in paths], daemon=True)
        t.start()
        self._gc.append(t)

    def _watch(self) -> None:
        while not self._stop.wait(0.01):
            self.poll()
            self.watch_cpu = time.thread_time()

    def poll(self) -> None:
        """DeepFreeze: the ``committed`` time of every manifest new on persistent (one listing)."""
        if self.ckpt is None:
            return
        root = f"{self.persistent}/{NAME}"
        try:
            names = os.listdir(root)
        except OSError:
            return
        for d in names:
            if d in self._seen:
                continue
            try:
                with open(f"{root}/{d}/manifest.json") as f:
                    m = json.load(f)
                self.committed[int(m["version"])] = float(m["committed"])
                self._seen.add(d)
            except (OSError, ValueError, KeyError, TypeError):
                pass  # not a version, or not committed yet

    def finish(self) -> None:
        """Wait until every checkpoint is durable."""
        self.before_step()
        if self.future is not None:
            self.future.result()
        if self.ckpt is not None:
            self.ckpt.wait()
            self.poll()
            for v, t0 in self.starts.items():
                if v in self.committed:
                    self.durable[v] = self.committed[v] - t0

    def close(self) -> dict:
        out: dict = {}
        if self.stager is not None:
            self.stager.close()
            out["stager_options"], out["stagers"] = self.options, self.stagers
        if self.ckpt is not None:
            self._stop.set()
            self._watcher.join()
            out["df_timings"] = self.ckpt.timings
            self.ckpt.close()
        for t in self._gc:
            t.join()
        return out

    def final_path(self) -> str | None:
        return self.paths[-1] if self.paths else None


def place_scratch(sbytes: int, work: str, forced: str | None, tag: str) -> tuple[str | None, str]:
    """Where DeepFreeze's scratch goes for ``sbytes`` of state (scratch_versions = 1: up to two
    versions at once), and why: a path, None (under ``work``), or "" (nowhere fits). tmpfs only
    when the memory left after DeepFreeze's pool (max_inflight + 1 = 3 buffers of the state,
    pinned on CUDA) and 8 GB more still holds it."""
    if forced:
        return f"{forced}/deepfreeze-gpu-{os.getpid()}-{tag}", "--scratch (a directory made in it)"
    ram_left = meminfo("MemAvailable") - 3 * sbytes - 8e9
    if free_bytes("/dev/shm") >= 2.2 * sbytes and ram_left >= 2.2 * sbytes:
        return f"{SHM}/{tag}", "/dev/shm (tmpfs) has 2.2x the state free"
    if free_bytes(work) >= 4.4 * sbytes:  # scratch and persistent both on this disk
        return None, "under --work: /dev/shm too small, the disk has 4.4x the state free"
    return "", (f"no room: /dev/shm {free_bytes('/dev/shm') / 1e9:.1f} GB and {work} {free_bytes(work) / 1e9:.1f} GB "
                f"free, {sbytes / 1e9:.1f} GB of state")


def big_interval(doc: dict, big_bytes: int, default: float, measured: int, left: float, n_approaches: int) -> tuple[float, str]:
    """The 1.3 B model's checkpoint interval: long enough that a checkpoint is durable before the
    next (1.25x the time to durable predicted from the slowest approach's bytes per second on
    gpt2), short enough that every approach fits its share of ``left``; never under ``default``."""
    rates = [r["state_bytes"] / r["durable_s"]["mean"] for r in doc["runs"]
             if r.get("model") == "gpt2" and not r.get("skipped") and not r.get("error")
             and (r.get("durable_s") or {}).get("mean")]
    if not rates:
        return default, "no gpt2 time to durable: the default"
    est = big_bytes / min(rates)
    fit = (left / n_approaches - 2 * est - 40) / (measured + 2)  # setup, restore: ~40 s + 2x durable
    want = 1.25 * est
    interval = max(default, min(want, fit))
    return interval, (f"predicted time to durable {est:.1f} s ({min(rates) / 1e9:.2f} GB/s on gpt2, the slowest); "
                      f"1.25x that is {want:.1f} s, the budget allows {fit:.1f} s, the floor is {default:.1f} s")


def run_approach(approach: str, mname: str, spec: tuple, device: str, work: str, args, deadline: float, pg,
                 interval: float | None = None) -> dict:
    """One approach on a fresh model: baseline, checkpoints, final durable, restore, compare."""
    import torch
    import torch.nn.functional as F
    cuda = device == "cuda"
    default, measured, nbase = SCHEDULE[args.scale][mname]
    interval = args.interval or interval or default
    if args.measured:
        measured = args.measured
    rec: dict = {"model": mname, "approach": approach}
    t_all = time.monotonic()
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    model = build(spec, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rec["params"] = sum(p.numel() for p in model.parameters())
    sync = torch.cuda.current_stream().synchronize if cuda else (lambda: None)
    step = [0]

    def iterate(saver: "Saver | None" = None, version: int | None = None) -> float:
        t = time.perf_counter()
        x, y = make_batch(spec, step[0], device)
        out = model(x)
        F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
        t0 = time.time()
        if saver is not None:
            saver.before_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if saver is not None and version is not None:
            saver.save(version, t0)
        sync()
        step[0] += 1
        return time.perf_counter() - t

    for _ in range(5):  # warm-up: AdamW's state, allocator, kernels / cuBLAS
        iterate()
    rec["state_bytes"] = sbytes = state_bytes(model, opt)
    scratch = None
    if approach == "deepfreeze":
        scratch, why = place_scratch(sbytes, work, args.scratch, os.path.basename(work))
        rec["scratch"], rec["scratch_why"] = scratch or f"{work}/scratch", why
        if scratch == "":
            rec["skipped"] = why
            shutil.rmtree(work, ignore_errors=True)
            return rec
    # persistent (DeepFreeze, retention 1) and DCP (the newest durable + the one in flight) hold up
    # to two checkpoints on the work directory's disk at once; scratch there too when not on tmpfs
    need = 2.2 * sbytes * (2 if approach == "deepfreeze" and not scratch else 1)
    if free_bytes(work) < need:
        rec["skipped"] = f"no room: {work} has {free_bytes(work) / 1e9:.1f} GB free, needs {need / 1e9:.1f} GB"
        shutil.rmtree(work, ignore_errors=True)
        return rec
    me = os.getpid()
    c0 = tree_cpu(me)
    rec["base_iters"] = base = [iterate() for _ in range(nbase)]
    rec["base_cpu_s"] = tree_cpu(me) - c0
    b = statistics.median(base)  # robust to a slow first iteration or a hiccup
    every = max(2, round(interval / b))
    t0 = time.monotonic()
    saver = Saver(approach, model, opt, work, scratch, every, pg, cuda)
    rec.update(every=every, interval_s=interval, setup_s=time.monotonic() - t0)
    try:
        iters: list[float] = []
        # warm-up checkpoint + its interval
        for j in range(1, every + 1):  # DeepFreeze captures where its own step count reaches every (1-based)
            iters.append(iterate(saver, j if j == every else None))
        first = every
        iters.append(iterate(saver))  # the iteration after it (the first checkpoint's stall)
        rec["first_stall_s"] = iters[-2] + iters[-1] - 2 * b
        for _ in range(every - 2):  # the interval: every iterations from the checkpoint on
            iters.append(iterate(saver))
        saver.finish()
        cpu0, w0, it0, watch0 = tree_cpu(me), time.monotonic(), step[0], getattr(saver, "watch_cpu", 0.0)
        # measured checkpoints while the time allows (the final one and the restore must still fit)
        per_ck = every * b
        d_first = saver.durable.get(first, math.nan)
        rec["first_durable_s"] = d_first
        # what must still fit after the measured checkpoints: the final one durable, digests, restore
        reserve = 1.5 * (d_first if math.isfinite(d_first) else interval) + 5.0
        done_ck = []
        while len(done_ck) < measured:
            if time.monotonic() + per_ck + reserve > deadline:
                rec["measured_cut"] = f"time budget: {len(done_ck)} of {measured} measured checkpoints"
                break
            v = first + (len(done_ck) + 1) * every
            start = len(iters)
            iters.append(iterate(saver, v))
            for _ in range(every - 1):
                iters.append(iterate(saver))
            done_ck.append((v, start))
        vfinal = first + (len(done_ck) + 1) * every
        iters.append(iterate(saver, vfinal))
        assert saver.ckpt is None or saver.ckpt.step == vfinal, (saver.ckpt.step, vfinal)  # same versions
        saver.finish()
        n_ck = len(done_ck) + 1
        rec["watch_cpu_s"] = getattr(saver, "watch_cpu", 0.0) - watch0
        cpu = tree_cpu(me) - cpu0 - rec["watch_cpu_s"]
        window_iters = step[0] - it0
        base_cpu_per_iter = rec["base_cpu_s"] / nbase
        rec["cpu_s_per_ckpt"] = (cpu - base_cpu_per_iter * window_iters) / n_ck
        rec.update(window_cpu_s=cpu, window_iters=window_iters, window_wall_s=time.monotonic() - w0, window_ckpts=n_ck)
        rec["baseline_iter_s"] = stat(base)
        rec["stall_s"] = stat([iters[s] + iters[s + 1] - 2 * b for _, s in done_ck])
        rec["slowdown"] = stat([sum(iters[s:s + every]) / (every * b) - 1 for _, s in done_ck])
        rec["durable_s"] = stat([saver.durable.get(v, math.nan) for v, _ in done_ck] + [saver.durable.get(vfinal, math.nan)])
        rec["durable_by_version"] = {str(k): v for k, v in sorted(saver.durable.items())}
        # DeepFreeze: a version committed and removed by the next one's commit between two listings
        # (the backend a whole interval behind) has no time
        rec["durable_missing"] = [v for v, _ in done_ck if v not in saver.durable] + \
            ([vfinal] if vfinal not in saver.durable else [])
        rec["iters"] = iters
        t = time.monotonic()
        ref = digests(model, opt)
        rec["digest_s"] = time.monotonic() - t
        final = saver.final_path()
    except BaseException:
        try:  # its hooks, threads, backend process and pinned buffers must not outlive it
            saver.close()
        except Exception:
            pass
        raise
    rec.update(saver.close())
    # restore into a fresh model and optimizer (the trained ones freed first: GPU memory)
    saver = model = opt = None  # (the loop's closure holds these names)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    if scratch:
        shutil.rmtree(scratch, ignore_errors=True)  # restore from persistent; frees /dev/shm
    shutil.rmtree(f"{work}/scratch", ignore_errors=True)
    model = build(spec, device, seed=123)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t = time.monotonic()
    if approach == "deepfreeze":
        import deepfreeze.torch as dft
        got = dft.restore(model, opt, name=NAME, mode="sync", scratch=f"{work}/restore-scratch",
                          persistent=f"{work}/persistent")
        rec["restored_version"] = int(got[0])
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=final, process_group=pg)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        rec["restored_version"] = int(os.path.basename(final)[1:])
    if cuda:
        torch.cuda.synchronize()
    rec["restore_s"] = time.monotonic() - t
    got_d = digests(model, opt)
    bad = sorted(k for k in ref if got_d.get(k) != ref[k])
    rec["bit_exact"] = not bad and set(got_d) == set(ref) and rec["restored_version"] == vfinal
    rec["mismatch"] = bad[:5]
    rec["final_version"] = vfinal
    model = opt = None
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    shutil.rmtree(work, ignore_errors=True)  # DCP outputs, DeepFreeze's persistent: the disk is small
    rec["wall_s"] = time.monotonic() - t_all
    return rec


# ------------------------------------------------------------------------------------ phase: stream
def stream_phase(spec: tuple, device: str, work: str, versions_n: int, timeout: float) -> dict:
    """deepfreeze.torch.Publisher in this process (world size 1, the model on ``device``) and a
    consumer process (this script with ``--stream-consumer``: a ModelSubscriber whose two replicas
    are built on ``device``, no torch.distributed). One warm-up version, then ``versions_n``
    measured ones, one at a time (the next step starts once the consumer served the last): the
    latency of each is the consumer's swap time (``Subscriber.updates[*].swapped_at``) minus the
    end of the update inside ``optimizer.step()`` (an optimizer post-hook registered before the
    Publisher's, whose copy into its slot starts there; on CUDA the update's kernels may still
    run then: the copy waits for them), both ``time.time()`` on this machine; the served weights' digests (BLAKE2b of every state-dict tensor, hashed in the
    consumer from its replica) must equal those recorded here right after the step."""
    import torch
    import torch.nn.functional as F
    from deepfreeze.stream import StreamOptions
    from deepfreeze.torch import Publisher
    rec: dict = {"device": device, "versions": versions_n}
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    token = os.path.join(work, "token")  # made by the Publisher (0600), read by the consumer
    cdir = os.path.join(work, "consumer")
    os.makedirs(cdir)
    until = versions_n + 1  # step 1: the warm-up version (the consumer's start, CUDA init)
    with open(os.path.join(cdir, "args.json"), "w") as f:
        json.dump({"spec": list(spec), "device": device, "persistent": os.path.join(work, "persistent"),
                   "token": token, "until": until, "timeout": timeout}, f)
    model = build(spec, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rec["params"] = sum(p.numel() for p in model.parameters())
    sync = torch.cuda.current_stream().synchronize if device == "cuda" else (lambda: None)
    sbytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # weights + AdamW's moments
    scratch = os.path.join(SHM, "stream") if free_bytes("/dev/shm") > 4 * sbytes else os.path.join(work, "scratch")
    # the end of a step's update: an optimizer post-hook registered before the Publisher's (whose
    # copy into its slot starts in its own post-hook, so a version can be served before step() returns)
    mark = {"t": 0.0}
    opt.register_step_post_hook(lambda *_: mark.__setitem__("t", time.time()))
    pub = Publisher(model, opt, channel="gpustream", schedule=1, stream=StreamOptions(token=token), scratch=scratch, persistent=os.path.join(work, "persistent"),
                    mode="async", overwrite=True)
    log = open(os.path.join(cdir, "consumer.log"), "w")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--stream-consumer", cdir],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    recorded: dict[int, dict] = {}
    try:
        deadline = time.monotonic() + timeout
        for step in range(1, until + 1):
            x, y = make_batch(spec, step, device)
            out = model(x)
            F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
            opt.step()
            t_end = mark["t"]
            opt.zero_grad(set_to_none=True)
            sync()
            pub.end_iteration()
            # hashed after publishing (not in the latency): the weights do not change before the next step
            recorded[pub.step] = {"t_end": t_end, "digests": module_digests(model)}
            while _seen(cdir) < pub.step:  # bounded: the consumer serves it, or it died
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"stream: the consumer did not serve step {pub.step} (exit {proc.poll()}, "
                                       f"{timeout:.0f} s budget); its log: {os.path.join(cdir, 'consumer.log')}")
                time.sleep(0.001)
        proc.wait(max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        pub.close()
        shutil.rmtree(os.path.join(SHM, "stream"), ignore_errors=True)
    if proc.returncode != 0:
        with open(os.path.join(cdir, "consumer.log")) as f:
            raise RuntimeError(f"stream: the consumer exited {proc.returncode}: {f.read()[-1500:]}")
    with open(os.path.join(cdir, "served.json")) as f:
        served = json.load(f)
    rec["consumer_device"] = served["device"]
    rec["tiers"] = sorted({s["tier"] for s in served["served"]})
    lat, mismatch, steps = [], [], []
    for s in served["served"]:
        want = recorded.get(s["step"])
        steps.append(s["step"])
        if want is None or s["digests"] != want["digests"]:
            mismatch.append(s["step"])
        if s["step"] > 1 and want is not None:  # the warm-up version is not measured
            lat.append(s["swapped_at"] - want["t_end"])
    rec["served_steps"] = steps
    rec["bit_exact"] = not mismatch and steps[-1:] == [until]
    rec["mismatch"] = mismatch
    rec["latency_s"] = stat(lat)
    rec["latency_all_s"] = lat
    rec["state_bytes"] = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    shutil.rmtree(work, ignore_errors=True)
    return rec


def _seen(cdir: str) -> int:
    try:
        with open(os.path.join(cdir, "seen")) as f:
            return int(f.read().strip() or -1)
    except (OSError, ValueError):
        return -1


def stream_consumer(cdir: str) -> int:
    """The consumer process of :func:`stream_phase`: serves until step ``until``; for each new
    version its step, tier, swap time and the digests of the replica serving it, in
    ``<cdir>/served.json``; ``<cdir>/seen`` holds the newest step served."""
    from deepfreeze.torch import ModelSubscriber
    with open(os.path.join(cdir, "args.json")) as f:
        a = json.load(f)
    spec, device = tuple(a["spec"]), a["device"]
    served: list[dict] = []
    with ModelSubscriber("gpustream", build=lambda: build(spec, device, seed=1).eval(), persistent=a["persistent"],
                         token=a["token"], warn_after=60.0) as sub:
        deadline = time.monotonic() + a["timeout"]
        last = -1
        while last < a["until"]:
            sub.wait(last + 1, timeout=max(1.0, deadline - time.monotonic()))
            with sub.current() as m:
                step = m.step
                digests = module_digests(m.module)
                on = str(next(m.module.parameters()).device)
            up = next(u for u in reversed(sub.updates) if u["version"].step == step)
            served.append({"step": step, "tier": up["tier"], "swapped_at": up["swapped_at"], "digests": digests})
            last = step
            with open(os.path.join(cdir, "seen.tmp"), "w") as f:
                f.write(str(step))
            os.replace(os.path.join(cdir, "seen.tmp"), os.path.join(cdir, "seen"))
    with open(os.path.join(cdir, "served.json"), "w") as f:
        json.dump({"device": on, "served": served}, f)
    return 0



# ------------------------------------------------------------------------------------ report
def table(doc: dict) -> str:
    v = doc.get("versions", {})
    card = v.get("gpu") or f"CPU ({v.get('cpus')} cores)"
    lines = [f"{card}, torch {v.get('torch')}, Python {v.get('python')}, numpy {v.get('numpy')}"
             f"{', driver ' + str(v.get('driver')) if v.get('driver') else ''}", "",
             "| model | approach | baseline iteration (s) | first stall (s) | stall (s) | slowdown / interval "
             "| to durable (s) | CPU-s / ckpt | restore (s) | bit-exact |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["runs"]:
        if r.get("skipped") or r.get("error"):
            why = f"skipped: {r['skipped']}" if r.get("skipped") else f"error: {r['error']}"
            lines.append(f"| {r['model']} | {r['approach']} | {why.replace('|', '/')[:200]} | | | | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['approach']} | {fmt(r['baseline_iter_s'], 1, 4)} | {fmt(r['first_stall_s'])} "
                     f"| {fmt(r['stall_s'])} | {fmt(r['slowdown'], 100, 1)} % | {fmt(r['durable_s'])} "
                     f"| {fmt(r['cpu_s_per_ckpt'], 1, 2)} | {fmt(r['restore_s'], 1, 2)} | {r['bit_exact']} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ driver
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="directory for gpu.json and the logs (on the device: $OUT)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    ap.add_argument("--scale", choices=["full", "small"], default="full", help="small: tiny models (CPU smoke)")
    ap.add_argument("--models", default="gpt2,gpt-1.3b")
    ap.add_argument("--approaches", default=None, help="comma list for every model (default: per model)")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run (default 450)")
    ap.add_argument("--grace", type=float, default=60.0,
                    help="seconds past the budget after which a hung run writes its JSON and exits 3 (default 60)")
    ap.add_argument("--big-min", type=float, default=200.0,
                    help="seconds the 1.3 B phase needs left, else it is skipped (default 200)")
    ap.add_argument("--interval", type=float, default=None, help="seconds between checkpoints (default per model)")
    ap.add_argument("--measured", type=int, default=None, help="measured checkpoints (default per model)")
    ap.add_argument("--work", default=None, help="checkpoint directory (default: new dir in $TMPDIR or /var/tmp)")
    ap.add_argument("--scratch", default=None,
                    help="where DeepFreeze's scratch directories go (default: /dev/shm when it fits, else --work)")
    ap.add_argument("--skip-tests", action="store_true", help="skip the cuda_tests phase")
    ap.add_argument("--skip-stream", action="store_true", help="skip the stream phase")
    ap.add_argument("--stream-versions", type=int, default=None,
                    help="measured versions of the stream phase (default 10; --scale small: 4)")
    ap.add_argument("--stream-consumer", default=None, help=argparse.SUPPRESS)  # the stream phase's consumer
    ap.add_argument("--prepare-deps", action="store_true",
                    help="only install pytest into <repo>/.gpu-deps (pure Python; carry it to a machine without pytest)")
    args = ap.parse_args(argv)
    if args.stream_consumer:
        return stream_consumer(args.stream_consumer)
    if args.prepare_deps:
        return subprocess.call([sys.executable, "-m", "pip", "install", "-q", "--target", DEPS, "pytest"])
    if not args.out:
        ap.error("--out is required")
    t_start = time.monotonic()
    deadline = t_start + args.budget
    os.makedirs(args.out, exist_ok=True)
    import torch
    import torch.distributed as dist
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu.py: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    base = args.work or tempfile.mkdtemp(prefix="deepfreeze-gpu-", dir=os.environ.get("TMPDIR") or "/var/tmp")
    os.makedirs(base, exist_ok=True)
    doc: dict = {"settings": {k: v for k, v in vars(args).items()}, "phases": [], "runs": [], "errors": []}
    doc["settings"]["statistic"] = "mean ± standard error over the measured checkpoints of one run"

    def phase(name: str, t0: float, **extra) -> None:
        doc["phases"].append({"phase": name, "wall_s": time.monotonic() - t0, "elapsed_s": time.monotonic() - t_start,
                              **extra})
        doc["table_md"] = table(doc)
        write_json(doc, args.out)
        print(f"[gpu] phase {name}: {time.monotonic() - t0:.1f} s (elapsed {time.monotonic() - t_start:.1f} s)",
              flush=True)

    def watchdog() -> None:
        """Past the budget by ``--grace`` seconds (a hang): record where, write the JSON, exit 3."""
        if not stop.wait(max(0.0, deadline + args.grace - time.monotonic())):
            doc["errors"].append(f"watchdog: still running {args.grace:.0f} s past the budget, in "
                                 f"{doc.get('running')}: exited")
            try:
                write_json(doc, args.out)
            finally:
                print(f"[gpu] {doc['errors'][-1]}", flush=True)
                for pid in tree(os.getpid()):  # the processes this run started (backend, DCP's, pytest)
                    if pid != os.getpid():
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except OSError:
                            pass
                shutil.rmtree(SHM, ignore_errors=True)
                if not args.work:
                    shutil.rmtree(base, ignore_errors=True)
                os._exit(3)
    stop = threading.Event()
    threading.Thread(target=watchdog, name="gpu-watchdog", daemon=True).start()

    t0 = time.monotonic()
    doc["versions"] = versions(device, base)
    print("[gpu] versions: " + json.dumps(doc["versions"]), flush=True)
    phase("versions", t0)

    t0 = time.monotonic()
    if args.skip_tests:
        doc["cuda_tests"] = {"ran": False, "reason": "--skip-tests"}
    else:
        doc["running"] = "cuda_tests"
        doc["cuda_tests"] = cuda_tests(args.out, timeout=max(30.0, min(240.0, deadline - time.monotonic() - 60)))
    print("[gpu] cuda_tests: " + json.dumps({k: v for k, v in doc["cuda_tests"].items() if k != "tail"}), flush=True)
    phase("cuda_tests", t0)

    # one process, world size 1: a gloo process group (DCP gathers its plans over it; DeepFreeze
    # makes its own gloo group), rendezvous through a file: no port, no NCCL
    pgfile = os.path.join(base, "pg")
    dist.init_process_group("gloo", init_method=f"file://{pgfile}", rank=0, world_size=1)
    pg = dist.new_group(backend="gloo")  # DCP's own group, as in experiments/torch_dcp.py
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    try:
        t0 = time.monotonic()
        if args.skip_stream:
            doc["stream"] = {"ran": False, "reason": "--skip-stream"}
        else:
            doc["running"] = "stream"
            n = args.stream_versions or (4 if args.scale == "small" else 10)
            try:
                doc["stream"] = {"ran": True, **stream_phase(MODELS[args.scale]["gpt2"], device, f"{base}/stream", n,
                                                             timeout=max(30.0, min(180.0, deadline - t0 - 60)))}
            except Exception as e:  # recorded; the checkpoint phases still run
                import traceback
                doc["stream"] = {"ran": True, "error": f"{type(e).__name__}: {e}",
                                 "traceback": traceback.format_exc()[-3000:]}
                doc["errors"].append(f"stream: {doc['stream']['error']}")
                shutil.rmtree(f"{base}/stream", ignore_errors=True)
            print("[gpu] stream: " + json.dumps({k: v for k, v in doc["stream"].items()
                                                 if k not in ("traceback", "latency_all_s")}), flush=True)
        phase("stream", t0)
        for mname in args.models.split(","):
            spec = MODELS[args.scale][mname]
            t0 = time.monotonic()
            left = deadline - t0
            if mname == "gpt-1.3b" and args.scale == "full" and left < args.big_min:
                doc["runs"].append({"model": mname, "approach": "*",
                                    "skipped": f"time budget: {left:.0f} s left, the phase needs {args.big_min:.0f} s"})
                phase(mname, t0, skipped=True)
                continue
            approaches = args.approaches.split(",") if args.approaches else APPROACHES[mname]
            interval = None
            if mname == "gpt-1.3b" and not args.interval:
                default, measured, _ = SCHEDULE[args.scale][mname]
                interval, why = big_interval(doc, big_state_bytes(spec), default, args.measured or measured,
                                             deadline - t0, len(approaches))
                doc["settings"]["big_interval_s"], doc["settings"]["big_interval_why"] = interval, why
            for i, a in enumerate(approaches):
                ta = time.monotonic()
                doc["running"] = f"{mname}/{a}"
                # an even share of what is left for each approach still to run
                share = (deadline - ta) / (len(approaches) - i)
                if share < (20.0 if args.scale == "full" else 3.0):
                    rec = {"model": mname, "approach": a, "skipped": f"time budget: {deadline - ta:.0f} s left"}
                else:
                    try:
                        rec = run_approach(a, mname, spec, device, f"{base}/{mname}-{a}", args, ta + share, pg,
                                           interval)
                    except Exception as e:  # recorded; the other approaches still run
                        import traceback
                        rec = {"model": mname, "approach": a, "error": f"{type(e).__name__}: {e}",
                               "traceback": traceback.format_exc()[-3000:]}
                        doc["errors"].append(rec["error"])
                        shutil.rmtree(f"{base}/{mname}-{a}", ignore_errors=True)
                        shutil.rmtree(SHM, ignore_errors=True)
                doc["runs"].append(rec)
                print("[gpu] " + json.dumps({k: v for k, v in rec.items()
                                             if k not in ("iters", "base_iters", "df_timings", "traceback")}), flush=True)
                phase(f"{mname}/{a}", ta)
            phase(mname, t0)
    finally:
        dist.destroy_process_group()
        shutil.rmtree(SHM, ignore_errors=True)
        if os.path.exists(pgfile):
            os.unlink(pgfile)
        if not args.work:
            shutil.rmtree(base, ignore_errors=True)
    stop.set()
    doc["running"] = None
    doc["total_s"] = time.monotonic() - t_start
    doc["table_md"] = table(doc)
    write_json(doc, args.out)
    print(doc["table_md"], flush=True)
    print(f"[gpu] done in {doc['total_s']:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
