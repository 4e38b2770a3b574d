"""Stream (Viper) measurements: update latency per tier, producer stall and training slowdown per
publish, notification latency, waiting-consumer CPU, predict p99 during swaps; and the CIL part.

    python experiments/stream.py --quick                  # smoke check (~3 min): m100, 3 updates
    python experiments/stream.py                          # full run: nt3 + m100, 10 updates each
    python experiments/stream.py --parts latency --models m100 --resume

Writes ``experiments/results/stream.json`` and ``stream.png``.

**Latency part**, per model (``nt3``: NT3's 10 weight tensors, 620 MB, little compute,
:func:`experiments.models.nt3_weights`; ``m100``: a dense model of 101 MB) and per approach, one
producer process (1 rank, TF threads 1, pinned with ``taskset`` to core 0) trains continuously
and one consumer process (pinned to core 1) on the same node follows it:

- ``h5-poll``: a producer callback ``save_weights`` to a temporary .h5, fsync, rename into the
  directory (and fsync the directory); the consumer lists the directory every 100 ms,
  ``load_weights`` into its idle replica and swaps it in. ``h5-poll-nofsync``: the same
  without the fsyncs.
- ``persistent``: :class:`~deepfreeze.keras.PublishCallback` (async mode: the node's backend
  process flushes each version to the persistent level, ``persistent_interval = 0``);
  ``ModelSubscriber(tier="persistent")`` (it looks for a newer committed version every
  ``rescan`` = 1 s, the library's default).
- ``tcp`` / ``shm``: the same producer; ``ModelSubscriber(tier="tcp" / "shm")``.
- ``shm-nopersist``: ``shm`` with ``persistent_interval = -1`` (no version flushed to the persistent
  level): separates the cost of the checkpoint flush from that of publishing.

Each producer run: a warm-up fit (the step time decides the publish interval k steps, aiming
at ``interval_s`` seconds between publishes), then fit A: S = (N+1)·k steps without publishing,
then fit B: the same S steps publishing every k steps (N+1 publishes; the first one, which also
connects the consumer and touches fresh slots, is not measured), then quiet steps (publisher
open, nothing published) until the consumer has measured its idle CPU and its predict latency
without swaps. Measured:

- update latency: from ``time.time()`` at the start of the producer's ``on_train_batch_end`` of
  the publishing step (the first callback, so the producer's stall is included) until the
  consumer has swapped that version in (``ModelSubscriber.updates[*]["swapped_at"]``; h5: after
  the swap); versions the consumer skipped (a newer one was there) have no latency.
- producer stall per publish: time in the callbacks at a publish step (first to last callback).
- training slowdown per publish: (wall time of the N publishing intervals of fit B - the same
  steps of fit A) / N, in one process (the capture in the train step, the callbacks, and the
  background copies/flushes competing for the producer's core all count).
- notification latency: ``ModelSubscriber.updates[*]["notify_s"]`` (producer send -> consumer receipt).
- waiting consumer CPU: process CPU time / wall over ``idle_s`` of the quiet phase (no updates,
  the predict thread paused).
- predict latency: a consumer thread predicts one sample every ``predict_period`` s; p99 of the
  requests overlapping a swap (fetch + load + swap) vs p99 of those in the quiet phase.

**CIL part**: :func:`experiments.stream_cil.run_cil` (its dict is stored under ``"cil"``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
APPROACHES = ("h5-poll", "h5-poll-nofsync", "persistent", "tcp", "shm", "shm-nopersist")
MODELS = ("nt3", "m100")
# per model: seconds between publishes aimed at, batch size, seconds between predict requests
MODEL_SET = {"nt3": dict(interval_s=5.0, batch=8, predict_period=0.1),
             "m100": dict(interval_s=2.0, batch=32, predict_period=0.05)}
IDLE_S, NOSWAP_S = 4.0, 5.0


# --------------------------------------------------------------------------- workers (TF inside)
def _tf_setup():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    return tf


def build_model(name: str):
    """``nt3``: NT3's weight tensors (620 MB); ``m100``: Dense 2048-4096-4096-10 (25.2 M parameters, 101 MB)."""
    tf = _tf_setup()
    sys.path.insert(0, ROOT)
    if name == "nt3":
        from experiments.models import nt3_weights
        return nt3_weights()
    tf.keras.utils.set_random_seed(1)
    return tf.keras.Sequential([tf.keras.Input((2048,)), tf.keras.layers.Dense(4096, activation="relu"),
                                tf.keras.layers.Dense(4096, activation="relu"),
                                tf.keras.layers.Dense(10, activation="softmax")])


def _dataset(model, n: int, batch: int):
    import tensorflow as tf
    sys.path.insert(0, ROOT)
    from experiments.models import synthetic
    x, y = synthetic(model, n, seed=3)
    xs = tuple(x) if isinstance(x, list) else x
    return tf.data.Dataset.from_tensor_slices((xs, y)).repeat().batch(batch)


def producer(a: argparse.Namespace) -> None:
    tf = _tf_setup()
    from deepfreeze.keras import PublishCallback
    from deepfreeze.stream import StreamOptions
    work, spec = a.work, MODEL_SET[a.model]
    model = build_model(a.model)
    model.compile(optimizer=tf.keras.optimizers.SGD(1e-4), loss="sparse_categorical_crossentropy")
    ds = _dataset(model, 4 * spec["batch"], spec["batch"])
    head_t: dict[int, tuple[float, float]] = {}  # step -> (time.time(), perf_counter) at the first callback
    tail_t: dict[int, float] = {}  # step -> perf_counter after the last callback

    class Head(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            head_t[int(self.model.optimizer.iterations.numpy())] = (time.time(), time.perf_counter())

    class Tail(tf.keras.callbacks.Callback):
        def __init__(self, stop_file=None):
            super().__init__()
            self.stop_file = stop_file

        def on_train_batch_end(self, batch, logs=None):
            tail_t[int(self.model.optimizer.iterations.numpy())] = time.perf_counter()
            if self.stop_file and os.path.exists(self.stop_file):
                self.model.stop_training = True

    model.fit(ds, steps_per_epoch=6, epochs=1, verbose=0, callbacks=[Head(), Tail()])  # trace, warm
    s0 = int(model.optimizer.iterations.numpy())
    steps = sorted(head_t)[-4:]
    t_step = (head_t[steps[-1]][1] - head_t[steps[0]][1]) / (len(steps) - 1)
    k = max(1, round(spec["interval_s"] / t_step))
    n = a.updates
    S = (n + 1) * k
    # fit A: no publishing
    head_t.clear(), tail_t.clear()
    model.fit(ds, steps_per_epoch=S + 1, epochs=1, verbose=0, callbacks=[Head(), Tail()])
    a_first = s0 + k  # compare the same positions: intervals (tail of step k, tail of step (n+1)k]
    wall_a = tail_t[s0 + S] - tail_t[a_first]
    s1 = int(model.optimizer.iterations.numpy())
    first = (s1 // k + 1) * k  # an int schedule publishes when the global step crosses a multiple of k
    pub_steps = [first + k * i for i in range(n + 1)]
    with open(f"{work}/plan.json.tmp", "w") as f:
        json.dump({"k": k, "first": pub_steps[0], "last": pub_steps[-1], "pub_steps": pub_steps}, f)
    os.replace(f"{work}/plan.json.tmp", f"{work}/plan.json")
    cbs: list = [Head()]
    stop_at = pub_steps[-1]
    pub = None
    if a.approach.startswith("h5"):
        fsync = a.approach == "h5-poll"
        d = f"{work}/h5"
        os.makedirs(d, exist_ok=True)

        class H5(tf.keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                step = int(self.model.optimizer.iterations.numpy())
                if step in pub_steps:
                    tmp = f"{d}/.tmp-v{step}.h5"
                    self.model.save_weights(tmp, save_format="h5")
                    if fsync:
                        fd = os.open(tmp, os.O_RDONLY)
                        os.fsync(fd)
                        os.close(fd)
                    os.replace(tmp, f"{d}/v{step}.h5")
                    if fsync:
                        fd = os.open(d, os.O_RDONLY)
                        os.fsync(fd)
                        os.close(fd)
                    for old in pub_steps:  # keep the newest three
                        if old < step - 3 * k:
                            try:
                                os.unlink(f"{d}/v{old}.h5")
                            except FileNotFoundError:
                                pass
        cbs.append(H5())
    else:
        class Pub(PublishCallback):
            def _want_batch(self, before, after, last, steps):  # quiet after the last measured publish
                return after <= stop_at and super()._want_batch(before, after, last, steps)

        pub = Pub("chan", schedule=k, stream=StreamOptions(shm_dir=a.shm_dir), mode="async",
                  scratch=f"{work}/scratch", persistent=f"{work}/persistent",
                  persistent_interval=-1.0 if a.approach.endswith("-nopersist") else 0.0)
        cbs.append(pub)
    cbs.append(Tail(stop_file=f"{work}/consumer.done"))
    head_t.clear(), tail_t.clear()
    quiet = 10 ** 6
    t_fit = time.perf_counter()
    model.fit(ds, steps_per_epoch=S + quiet, epochs=1, verbose=0, callbacks=cbs)
    fit_s = time.perf_counter() - t_fit
    wall_b = tail_t[pub_steps[-1]] - tail_t[pub_steps[0]]
    stall = {s: tail_t[s] - head_t[s][1] for s in pub_steps if s in tail_t}
    nonpub = [tail_t[s] - head_t[s][1] for s in sorted(tail_t) if s not in pub_steps and s in head_t][:S]
    report = {"model": a.model, "approach": a.approach, "k": k, "t_step_warm_s": t_step, "S": S,
              "pub_steps": pub_steps, "publish_time": {str(s): head_t[s][0] for s in pub_steps if s in head_t},
              "stall_s": {str(s): v for s, v in stall.items()}, "callbacks_nonpub_s": nonpub,
              "wall_a_s": wall_a, "wall_b_s": wall_b, "measured_publishes": n, "fit_b_s": fit_s,
              "published": [v.step for v in pub.published] if pub is not None else pub_steps,
              "coalesced": getattr(pub, "coalesced", None), "weights_bytes": int(sum(w.numpy().nbytes
                                                                                    for w in model.weights))}
    if pub is not None:
        pub.close()
    with open(f"{work}/producer.json", "w") as f:
        json.dump(report, f)


def consumer(a: argparse.Namespace) -> None:
    _tf_setup()  # TensorFlow's thread settings (the models below import it)
    work, spec = a.work, MODEL_SET[a.model]
    sys.path.insert(0, ROOT)
    from experiments.models import synthetic
    x, _ = synthetic(build_model(a.model), 1, seed=9)
    swaps: list[dict] = []  # {"step", "start", "swapped_at"} (time.time())
    lock = threading.Lock()
    h5 = a.approach.startswith("h5")
    if h5:
        reps = [build_model(a.model), build_model(a.model)]
        state = {"live": None, "ver": None, "users": [0, 0]}
        d = f"{work}/h5"
        stop_poll = threading.Event()

        def poll():
            pat = re.compile(r"^v(\d+)\.h5$")
            while not stop_poll.is_set():
                try:
                    names = os.listdir(d)
                except FileNotFoundError:
                    names = []
                vs = [int(m.group(1)) for m in map(pat.match, names) if m]
                if vs and (state["ver"] is None or max(vs) > state["ver"]):
                    step = max(vs)
                    t0 = time.time()
                    idle = 1 if state["live"] == 0 else 0
                    while True:
                        with lock:
                            if state["users"][idle] == 0:
                                break
                        time.sleep(0.001)
                    try:
                        reps[idle].load_weights(f"{d}/v{step}.h5")
                    except (OSError, FileNotFoundError) as e:  # deleted under us: take the next newest
                        print(f"consumer: v{step}: {e}", flush=True)
                        continue
                    with lock:
                        state["live"], state["ver"] = idle, step
                    swaps.append({"step": step, "start": t0, "swapped_at": time.time()})
                stop_poll.wait(0.1)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()

        def predict(xx):
            with lock:
                i = state["live"]
                state["users"][i] += 1
            try:
                return reps[i](xx, training=False).numpy(), state["ver"]
            finally:
                with lock:
                    state["users"][i] -= 1

        def live():
            return state["ver"]

        def close():
            stop_poll.set()
            poller.join()
    else:
        from deepfreeze.keras import ModelSubscriber
        sub = ModelSubscriber("chan", build=lambda: build_model(a.model), tier=a.approach.split("-")[0], mode="async",
                              scratch=f"{work}/cscratch", persistent=f"{work}/persistent")

        def predict(xx):
            y, v = sub.predict(xx)
            return y, v.step

        def live():
            v = sub.version
            return None if v is None else v.step

        close = sub.close
    t_start = time.monotonic()
    while live() is None or not os.path.exists(f"{work}/plan.json"):
        if time.monotonic() - t_start > a.timeout:
            raise SystemExit("consumer: no first version")
        time.sleep(0.01)
    with open(f"{work}/plan.json") as f:
        plan = json.load(f)
    reqs: list[tuple[float, float, int]] = []
    run_pred = threading.Event()
    run_pred.set()
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            if not run_pred.is_set():
                time.sleep(0.01)
                continue
            t0 = time.time()
            _, v = predict(x)
            reqs.append((t0, time.time(), v))
            stop.wait(spec["predict_period"])

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    while (live() or 0) < plan["last"]:
        if time.monotonic() - t_start > a.timeout:
            print("consumer: timed out waiting for the last version", flush=True)
            break
        time.sleep(0.01)
    time.sleep(0.5)
    t_swaps_end = time.time()
    run_pred.clear()
    time.sleep(0.3)
    r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    time.sleep(IDLE_S)
    r1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    cpu = (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / (w1 - w0)
    q0 = time.time()
    run_pred.set()
    time.sleep(NOSWAP_S)
    stop.set()
    th.join()
    open(f"{work}/consumer.done", "w").close()
    if not h5:
        for u in sub.updates:
            swaps.append({"step": u["version"].step, "swapped_at": u["swapped_at"], "notify_s": u["notify_s"],
                          "fetch_s": u["fetch_s"], "load_s": u["load_s"], "tier": u["tier"],
                          "start": u["swapped_at"] - u["fetch_s"] - u["load_s"]})
    close()
    report = {"swaps": swaps, "idle_cpu_frac": cpu, "idle_s": w1 - w0, "t_swaps_end": t_swaps_end,
              "quiet_from": q0, "requests": reqs, "rss_max_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
    with open(f"{work}/consumer.json", "w") as f:
        json.dump(report, f)


# --------------------------------------------------------------------------- driver
def _cores() -> tuple[list[str], list[str]]:
    if shutil.which("taskset") and (os.cpu_count() or 1) >= 2:
        return ["taskset", "-c", "0"], ["taskset", "-c", "1"]
    return [], []


def pct(v, q):
    import numpy as np
    return float(np.percentile(v, q)) if len(v) else None


def run_pair(model: str, approach: str, updates: int, tmp_root: str) -> dict:
    """One producer + one consumer process; returns the row of (model, approach)."""
    import numpy as np
    work = tempfile.mkdtemp(prefix=f"{model}-{approach}-", dir=tmp_root)
    shm = tempfile.mkdtemp(prefix="dfstream-", dir="/dev/shm")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TF_CPP_MIN_LOG_LEVEL="2")
    env.setdefault("DEEPFREEZE_TOKEN", secrets.token_hex(16))
    pc, cc = _cores()
    me = [sys.executable, os.path.abspath(__file__), "--model", model, "--approach", approach, "--work", work,
          "--updates", str(updates), "--shm-dir", shm]
    t0 = time.time()
    try:
        with open(f"{work}/consumer.log", "w") as clog, open(f"{work}/producer.log", "w") as plog:
            cons = subprocess.Popen(cc + me + ["--role", "consumer"], env=env, stdout=clog, stderr=subprocess.STDOUT)
            prod = subprocess.Popen(pc + me + ["--role", "producer"], env=env, stdout=plog, stderr=subprocess.STDOUT)
            try:
                rc_p = prod.wait(timeout=3600)
                rc_c = cons.wait(timeout=120)
            finally:
                for p in (prod, cons):
                    if p.poll() is None:
                        p.kill()
                        p.wait()
        if rc_p or rc_c:
            logs = "".join(open(f"{work}/{w}.log").read()[-3000:] for w in ("producer", "consumer"))
            raise RuntimeError(f"{model}/{approach}: producer rc {rc_p}, consumer rc {rc_c}\n{logs}")
        P = json.load(open(f"{work}/producer.json"))
        C = json.load(open(f"{work}/consumer.json"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    pub_t = {int(s): t for s, t in P["publish_time"].items()}
    measured = set(P["pub_steps"][1:])  # the first publish connects the consumer: not measured
    lat, notify, seen = [], [], set()
    for sw in C["swaps"]:
        if sw["step"] in measured and sw["step"] not in seen:
            seen.add(sw["step"])
            lat.append(sw["swapped_at"] - pub_t[sw["step"]])
            if sw.get("notify_s") is not None:
                notify.append(sw["notify_s"])
    windows = [(sw["start"], sw["swapped_at"]) for sw in C["swaps"]]
    during = [e - s for s, e, _ in C["requests"] if any(s < we and e > ws for ws, we in windows)]
    without = [e - s for s, e, _ in C["requests"] if s >= C["quiet_from"]]
    stalls = [v for s, v in P["stall_s"].items() if int(s) in measured]
    slow = (P["wall_b_s"] - P["wall_a_s"]) / P["measured_publishes"]
    row = {"model": model, "approach": approach, "weights_MB": P["weights_bytes"] / 1e6, "k_steps": P["k"],
           "t_step_s": P["t_step_warm_s"], "publishes": len(P["pub_steps"]), "measured_publishes": len(measured),
           "delivered": len(lat), "skipped": len(measured) - len(lat),
           "latency_s": lat, "latency_median_s": pct(lat, 50), "latency_p90_s": pct(lat, 90),
           "latency_mean_s": float(np.mean(lat)) if lat else None,
           "latency_se_s": float(np.std(lat, ddof=1) / np.sqrt(len(lat))) if len(lat) > 1 else None,
           "stall_s": stalls, "stall_median_s": pct(stalls, 50),
           "callbacks_nonpub_median_s": pct(P["callbacks_nonpub_s"], 50),
           "wall_without_s": P["wall_a_s"], "wall_with_s": P["wall_b_s"], "slowdown_per_publish_s": slow,
           "notify_s": notify, "notify_median_s": pct(notify, 50),
           "idle_cpu_pct": 100 * C["idle_cpu_frac"], "idle_window_s": C["idle_s"],
           "predict_during_swaps": {"n": len(during), "p50_s": pct(during, 50), "p99_s": pct(during, 99)},
           "predict_without_swaps": {"n": len(without), "p50_s": pct(without, 50), "p99_s": pct(without, 99)},
           "coalesced": P["coalesced"], "consumer_rss_max_MB": C["rss_max_kb"] / 1e3,
           "swap_detail": [{k: v for k, v in sw.items() if k in ("step", "fetch_s", "load_s", "tier")}
                           for sw in C["swaps"]],
           "wall_s": round(time.time() - t0, 1)}
    print(f"[stream] {model}/{approach}: latency median {row['latency_median_s']} p90 {row['latency_p90_s']} "
          f"({len(lat)}/{len(measured)}), slowdown/publish {slow * 1e3:.1f} ms, stall {pct(stalls, 50)}, "
          f"idle cpu {row['idle_cpu_pct']:.2f} %, {row['wall_s']} s", flush=True)
    return row


def summarise(doc: dict) -> None:
    """Ratios vs h5-poll (fsync) per model and the targets."""
    import numpy as np
    lat = doc.get("latency", {})
    ratios, targets = {}, []
    for model, rows in lat.items():
        base = rows.get("h5-poll")
        if not base or not base.get("latency_median_s"):
            continue
        for ap, r in rows.items():
            if ap == "h5-poll" or not r.get("latency_median_s"):
                continue
            ratio = base["latency_median_s"] / r["latency_median_s"]
            # standard error of the ratio of means (delta method) to judge resolvability
            mb, ma = base["latency_mean_s"], r["latency_mean_s"]
            se = None
            if base.get("latency_se_s") is not None and r.get("latency_se_s") is not None:
                rm = mb / ma
                se = rm * float(np.sqrt((base["latency_se_s"] / mb) ** 2 + (r["latency_se_s"] / ma) ** 2))
            ratios.setdefault(model, {})[ap] = {"median_ratio": ratio, "mean_ratio": mb / ma, "mean_ratio_se": se,
                                                "resolvable_vs_1": None if se is None else abs(mb / ma - 1) > se}
        for ap, need in (("shm", 5.0), ("tcp", 2.0)):
            if ap in ratios.get(model, {}):
                x = ratios[model][ap]["median_ratio"]
                targets.append({"target": f"{model}: {ap} >= {need:g}x lower median latency than h5-poll (fsync)",
                                "value": round(x, 2), "holds": x >= need})
        for ap, r in rows.items():
            if ap in ("tcp", "shm", "persistent", "shm-nopersist"):
                if model == "m100":
                    targets.append({"target": f"m100/{ap}: training slowdown per publish < 5 ms",
                                    "value_ms": round(r["slowdown_per_publish_s"] * 1e3, 2),
                                    "holds": r["slowdown_per_publish_s"] < 0.005})
                if r.get("notify_median_s") is not None and ap != "persistent":
                    targets.append({"target": f"{model}/{ap}: notification median < 1 ms",
                                    "value_ms": round(r["notify_median_s"] * 1e3, 3),
                                    "holds": r["notify_median_s"] < 1e-3})
                targets.append({"target": f"{model}/{ap}: waiting consumer < 1 % CPU",
                                "value_pct": round(r["idle_cpu_pct"], 3), "holds": r["idle_cpu_pct"] < 1.0})
                d, w = r["predict_during_swaps"]["p99_s"], r["predict_without_swaps"]["p99_s"]
                if d is not None and w:
                    targets.append({"target": f"{model}/{ap}: predict p99 during swaps <= 2x without",
                                    "value_ratio": round(d / w, 2), "n_during": r["predict_during_swaps"]["n"],
                                    "holds": d <= 2 * w})
    doc["ratios_vs_h5_poll"] = ratios
    doc["targets"] = targets


def table(doc: dict) -> str:
    lines = ["| model | approach | median (s) | p90 (s) | n | median ratio vs h5-poll | stall (ms) | slowdown/publish (ms) "
             "| notify median (ms) | idle CPU % | predict p99 no swap / swap (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for model, rows in doc.get("latency", {}).items():
        for ap, r in rows.items():
            rat = doc.get("ratios_vs_h5_poll", {}).get(model, {}).get(ap, {}).get("median_ratio")
            f = (lambda v, m=1.0, p=3: "-" if v is None else f"{v * m:.{p}f}")
            lines.append(f"| {model} | {ap} | {f(r['latency_median_s'])} | {f(r['latency_p90_s'])} | "
                         f"{r['delivered']}/{r['measured_publishes']} | {'1' if ap == 'h5-poll' else f(rat, p=2)} | "
                         f"{f(r['stall_median_s'], 1e3, 1)} | {f(r['slowdown_per_publish_s'], 1e3, 1)} | "
                         f"{f(r['notify_median_s'], 1e3, 3)} | {r['idle_cpu_pct']:.2f} | "
                         f"{f(r['predict_without_swaps']['p99_s'], 1e3, 1)} / "
                         f"{f(r['predict_during_swaps']['p99_s'], 1e3, 1)} |")
    out = "\n".join(lines)
    if doc.get("targets"):
        out += "\n\n" + "\n".join(f"- {t['target']}: {'holds' if t['holds'] else 'MISSED'} "
                                  f"({', '.join(f'{k}={v}' for k, v in t.items() if k not in ('target', 'holds'))})"
                                  for t in doc["targets"])
    if doc.get("cil", {}).get("table_md"):
        out += "\n\nCIL:\n" + doc["cil"]["table_md"]
    return out


def plot(doc: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(doc.get("latency", {}))
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(6 * max(1, len(models)), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = doc["latency"][model]
        aps = list(rows)
        ax.boxplot([rows[a]["latency_s"] or [float("nan")] for a in aps], whis=(10, 90))
        ax.set_xticks(range(1, len(aps) + 1), aps)
        ax.set_yscale("log")
        ax.set_ylabel("update latency (s): publish step end -> swapped in")
        ax.set_title(f"{model} ({rows[aps[0]]['weights_MB']:.0f} MB), {rows[aps[0]]['measured_publishes']} updates")
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=("producer", "consumer"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--approach", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--shm-dir", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=900, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="smoke check: m100 only, 3 updates, no CIL full run")
    ap.add_argument("--parts", default="latency,cil", help="comma list of latency,cil")
    ap.add_argument("--models", default=None, help="comma list of nt3,m100 (default: both; --quick: m100)")
    ap.add_argument("--approaches", default=",".join(APPROACHES))
    ap.add_argument("--updates", type=int, default=None, help="measured updates per approach (default 10; --quick 3)")
    ap.add_argument("--resume", action="store_true", help="merge into an existing --out; skip (model, approach) "
                                                          "rows and parts already there")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "stream.json"))
    a = ap.parse_args()
    if a.role == "producer":
        return producer(a)
    if a.role == "consumer":
        return consumer(a)
    sys.path.insert(0, ROOT)
    from experiments.bench import finish_doc, write_doc
    t_start = time.time()
    updates = a.updates or (3 if a.quick else 10)
    models = a.models.split(",") if a.models else (["m100"] if a.quick else list(MODELS))
    parts = a.parts.split(",")
    doc: dict = {}
    if a.resume and os.path.exists(a.out):
        with open(a.out) as f:
            doc = json.load(f)
    doc.setdefault("settings", {}).update({
        "quick": a.quick, "updates": updates, "models": {m: MODEL_SET[m] for m in models}, "cores": os.cpu_count(),
        "taskset": bool(_cores()[0]), "idle_s": IDLE_S, "noswap_s": NOSWAP_S,
        "statistic": "median and p90 over the measured updates (the first publish of each run is not measured); "
                     "ratios are h5-poll median / approach median; resolvability from the ratio of means and its "
                     "delta-method standard error"})
    doc.setdefault("latency", {})
    if "latency" in parts:
        tmp_root = tempfile.mkdtemp(prefix="dfstream-exp-")
        try:
            for m in models:
                for ap_ in a.approaches.split(","):
                    if a.resume and ap_ in doc["latency"].get(m, {}):
                        continue
                    try:
                        doc["latency"].setdefault(m, {})[ap_] = run_pair(m, ap_, updates, tmp_root)
                    except Exception as e:  # recorded; the other rows go on
                        print(f"[stream] {m}/{ap_} FAILED: {e}", flush=True)
                        doc.setdefault("failed", {})[f"{m}/{ap_}"] = str(e)[-4000:]
                        continue
                    summarise(doc)
                    write_doc(doc, a.out)
        finally:
            shutil.rmtree(tmp_root, ignore_errors=True)
    if "cil" in parts and not (a.resume and doc.get("cil")):
        from experiments.stream_cil import run_cil
        doc["cil"] = {}
        run_cil(doc["cil"], quick=a.quick)
    summarise(doc)
    finish_doc(doc, a.out, t_start, table, plot)


if __name__ == "__main__":
    main()
