"""CIL of publish schedules on a real learning curve (issue 14, "Measure"; Viper Table 1).

    python experiments/stream_cil.py --quick      # smoke check (~25 s): 3 epochs
    python experiments/stream_cil.py              # the full run (~1 min): 12 epochs

Trains a TC1-like Keras model (CANDLE TC1's shape scaled down: one-channel profiles ->
Conv1D(32, 20) -> MaxPooling1D(10) -> Conv1D(32, 10) -> Flatten -> Dense(200) -> Dense(20) ->
Dense(18, softmax); SGD, cross-entropy, batch 20; 4320 synthetic training samples as in TC1, so
an epoch is TC1's 216 iterations; see :func:`tc1_like_data`; trained online: fresh samples every
epoch, so the training loss estimates the inference loss) in this process, single-threaded TensorFlow (intra/inter = 1:
the machine is shared). It records:

* the per-batch training loss of every iteration, recovered from Keras' running mean with
  :func:`deepfreeze.stream.predict.per_batch_losses` (``logs["loss"]`` is the epoch's running mean);
* ``t_train``: the median time of an iteration (``on_train_batch_begin`` to ``on_train_batch_end``);
* a held-out loss (the inference loss of a version, the paper's CIL metric) on 360 samples
  every ``--eval-every`` iterations, outside the timed window, linearly interpolated between;
* ``t_infer``: the median time of one single-sample inference (a ``tf.function`` call) after training.

Then it replays, with the same cost model for all: the warm-up is the first epoch (``s_iter`` =
216); the plan covers ``(s_iter, e_iter]`` (the end of training). ``t_p``/``t_c`` are the measured
model size over ``--write-bw``/``--read-bw`` (default 5 GB/s, the shared-memory tier's copy
rate); ``total_infers`` defaults to the requests that fit in the training time after the warm-up
(``(e_iter − s_iter)·t_train / t_infer``: a consumer serving while the producer trains). Schedules:

* ``epoch``: a publish at every epoch end after the warm-up (the paper's baseline);
* ``fixed``: :func:`~deepfreeze.stream.predict.make_plan` ``("fixed", ...)``: the optimal interval (Alg. 2);
* ``adaptive``: ``make_plan("adaptive", ...)`` (Alg. 3), threshold = mean + std of the warm-up's |Δloss|,
  fixed in advance.

All three drop publishes that would be live only after the last request (they serve nobody).
Per schedule: publishes, the CIL the fitted curve predicts, the realized CIL on the recorded
per-batch losses (the version published after step x is charged the loss recorded at step x+1,
computed on exactly those weights), the same on the per-batch losses smoothed over 21
iterations, the same on the held-out loss, and the training overhead ``publishes · t_p``.
Target (issue 14): realized adaptive CIL <= fixed, both < epoch. Writes
``experiments/results/stream_cil.json`` and ``.png`` (loss curve, fit, schedule marks, CIL bars).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if __package__ in (None, ""):                       # run as a script: python experiments/stream_cil.py
    sys.path.insert(0, os.path.dirname(HERE))

from deepfreeze.stream.predict import (CostModel, make_plan, per_batch_losses, predicted_cil,  # noqa: E402
                                       realized_cil, smoothing_window, warmup_threshold)

STEPS_PER_EPOCH = 216          # TC1: 4320 samples / batch 20
BATCH = 20
CLASSES = 18
LENGTH = 1000
QUICK = {"epochs": 3, "eval_every": 4}
FULL = {"epochs": 8, "eval_every": 4}
SEEDS = 5
MAIN = ("epoch", "fixed", "adaptive")      # the schedules compared; the others are shown for reference


def tc1_like_data(n: int, seed: int, noise: float = 6.0, broad: float = 3.0,
                  label_noise: float = 0.2) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic TC1-shaped samples: one-channel profiles of ``LENGTH`` values, 18 classes. Each
    class (the same for every seed) is a sum of 3 broad bumps (easy to learn: the loss falls at
    once) and 6 narrow ones (learned slowly: the long tail of the curve), plus Gaussian noise;
    a share ``label_noise`` of the labels is random (a loss floor, as real data has). Tuned so
    the curve falls from the first iteration and keeps falling for many epochs (TC1's shape in the
    paper's Fig. 5: Exp3 fits it best): without the broad bumps a plateau at ln(18) comes first.
    Test samples use another seed."""
    proto_rng = np.random.default_rng(1234)
    t = np.linspace(0.0, 1.0, LENGTH)
    protos = np.zeros((CLASSES, LENGTH))
    centres = proto_rng.uniform(0.1, 0.9, 3)
    for c in range(CLASSES):
        for mu in centres:
            protos[c] += broad * proto_rng.normal(0, 1) * np.exp(-0.5 * ((t - mu) / 0.08) ** 2)
        for _ in range(6):
            mu, sig, amp = proto_rng.uniform(0, 1), proto_rng.uniform(0.005, 0.03), proto_rng.normal(0, 1)
            protos[c] += amp * np.exp(-0.5 * ((t - mu) / sig) ** 2)
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, n)
    x = protos[y] + noise * rng.standard_normal((n, LENGTH))
    flip = rng.random(n) < label_noise                     # a share of random labels: a loss floor
    y = np.where(flip, rng.integers(0, CLASSES, n), y)
    return x[..., None].astype(np.float32), y.astype(np.int64)


def build_model(tf: Any, seed: int = 0) -> Any:
    tf.keras.utils.set_random_seed(7 + seed)
    model = tf.keras.Sequential([
        tf.keras.Input((LENGTH, 1)),
        tf.keras.layers.Conv1D(32, 20, activation="relu"),
        tf.keras.layers.MaxPooling1D(10),
        tf.keras.layers.Conv1D(32, 10, activation="relu"),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(200, activation="relu"),
        tf.keras.layers.Dense(20, activation="relu"),
        tf.keras.layers.Dense(CLASSES, activation="softmax"),
    ])
    model.compile(optimizer=tf.keras.optimizers.SGD(learning_rate=0.01, momentum=0.5),
                  loss="sparse_categorical_crossentropy")
    return model


def train(epochs: int, eval_every: int, seed: int = 0) -> dict:
    """Train; return per-iteration records (index = global iteration, 1-based; [0] unused).
    ``seed`` changes the training samples and the model's initial weights (the held-out set is
    the same for every seed)."""
    import tensorflow as tf
    try:
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:            # TF already initialised by the caller: keep its setting
        pass
    # online training: fresh samples every epoch (a surrogate trained on a simulation's stream),
    # so the training loss is an unbiased estimate of the inference loss (the paper's assumption 2)
    x, y = tc1_like_data(STEPS_PER_EPOCH * BATCH * epochs, seed=1 + 1000 * seed)
    xt, yt = tc1_like_data(360, seed=2)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    model = build_model(tf, seed)
    xt_t, yt_t = tf.constant(xt), tf.constant(yt)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy()

    @tf.function
    def heldout_loss():
        return loss_fn(yt_t, model(xt_t, training=False))

    rec: dict[str, Any] = {"running": [], "iter_s": [], "heldout": {}}

    class Recorder(tf.keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            loss = float(logs["loss"])                      # forces the step's result: end of the step
            rec["iter_s"].append(time.perf_counter() - self.t0)
            rec["running"].append((batch, loss))
            step = len(rec["iter_s"])                       # global iteration just completed
            if step % eval_every == 0:
                rec["heldout"][step] = float(heldout_loss())

    rec["heldout"][0] = float(heldout_loss())
    t0 = time.time()
    # steps_per_epoch < the dataset: Keras keeps one iterator across epochs (no sample seen twice)
    model.fit(ds, epochs=epochs, steps_per_epoch=STEPS_PER_EPOCH, verbose=0, callbacks=[Recorder()])
    rec["train_wall_s"] = time.time() - t0
    total = len(rec["iter_s"])
    if total not in rec["heldout"]:
        rec["heldout"][total] = float(heldout_loss())
    # t_infer: one request = one sample through the model
    one = tf.constant(xt[:1])
    infer = tf.function(lambda v: model(v, training=False))
    for _ in range(20):
        infer(one)
    ts = []
    for _ in range(300):
        t1 = time.perf_counter()
        infer(one).numpy()
        ts.append(time.perf_counter() - t1)
    rec["t_infer_s"] = float(np.median(ts))
    rec["model_bytes"] = int(sum(int(np.prod(w.shape)) * w.dtype.size for w in model.weights))
    rec["weights"] = len(model.weights)
    return rec


def per_iteration(rec: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(batch loss by global iteration, version loss by iteration, held-out loss by iteration)."""
    running = rec["running"]
    per_batch: list[float] = []
    epoch: list[float] = []
    for b, v in running:                                     # split at the epoch boundaries
        if b == 0 and epoch:
            per_batch.extend(per_batch_losses(epoch))
            epoch = []
        epoch.append(v)
    per_batch.extend(per_batch_losses(epoch))
    n = len(per_batch)
    batch = np.full(n + 1, np.nan)
    batch[1:] = per_batch
    version = np.empty(n + 1)
    version[:-1] = batch[1:]                                 # weights after step x -> loss measured at x+1
    version[-1] = batch[-1]
    ks = np.array(sorted(rec["heldout"]))
    held = np.interp(np.arange(n + 1), ks, np.array([rec["heldout"][k] for k in ks]))
    return batch, version, held


def smooth(v: np.ndarray, w: int = 10) -> np.ndarray:
    """Centred mean over 2w+1 iterations (fewer at the ends)."""
    c = np.concatenate([[0.0], np.cumsum(v)])
    i = np.arange(v.size)
    lo, hi = np.maximum(0, i - w), np.minimum(v.size, i + w + 1)
    return (c[hi] - c[lo]) / (hi - lo)


def run_cil(out_json_part: dict, *, quick: bool, epochs: int | None = None, eval_every: int | None = None,
            t_infer: float | None = None, total_infers: int | None = None, write_bw: float = 5e9,
            read_bw: float = 5e9, model_bytes: int | None = None, seed: int = 0) -> dict:
    """Train, replay the schedules, fill ``out_json_part`` (settings, rows, table_md,
    targets, curves for the plot) and return it."""
    t_start = time.time()
    mode = QUICK if quick else FULL
    epochs = epochs or mode["epochs"]
    eval_every = eval_every or mode["eval_every"]
    rec = train(epochs, eval_every, seed)
    batch, version, held = per_iteration(rec)
    n = batch.size - 1
    s_iter, e_iter = STEPS_PER_EPOCH, n
    iters = np.asarray(rec["iter_s"])
    t_train = float(np.median(iters[STEPS_PER_EPOCH // 4:]))          # the first steps include tracing
    t_inf = float(t_infer) if t_infer else rec["t_infer_s"]
    mbytes = int(model_bytes) if model_bytes else rec["model_bytes"]
    cost = CostModel.from_measurements(t_train, t_inf, mbytes, write_bw, read_bw)
    total = int(total_infers) if total_infers else int((e_iter - s_iter) * t_train / t_inf)
    warm = batch[1:s_iter + 1]
    thresh = warmup_threshold(warm)                 # the default: the rule on the smoothed warm-up losses
    thresh_printed = warmup_threshold(warm, 1)      # the rule as printed: raw per-batch losses

    t0 = time.perf_counter()
    fixed = make_plan("fixed", warm, s_iter, e_iter, cost, total)
    t_fixed = time.perf_counter() - t0
    t0 = time.perf_counter()
    adaptive = make_plan("adaptive", warm, s_iter, e_iter, cost, total)
    t_adaptive = time.perf_counter() - t0
    # two variants beside the default (not targets): the printed rule on raw per-batch losses
    # (issue 24: it published nothing) and the CIL-minimising threshold
    adaptive_pr = make_plan("adaptive", warm, s_iter, e_iter, cost, total, smooth=1)
    adaptive_opt = make_plan("adaptive", warm, s_iter, e_iter, cost, total, thresh="optimal")
    curve = fixed.curve
    epoch_all = list(range(s_iter + STEPS_PER_EPOCH, e_iter + 1, STEPS_PER_EPOCH))
    # same rule as the plans: drop publishes live only after the last request
    epoch_steps = [s for k, s in enumerate(epoch_all, 1)
                   if (s - s_iter) * cost.t_train + k * cost.t_p + cost.t_c <= (total - 1) * cost.t_infer]
    version_smooth = smooth(version)
    rows = []
    for name, steps, interval in (("epoch", epoch_steps, STEPS_PER_EPOCH), ("fixed", list(fixed.steps), fixed.interval),
                                  ("adaptive", list(adaptive.steps), None),
                                  ("adaptive-printed-rule", list(adaptive_pr.steps), None),
                                  ("adaptive-cil-optimal", list(adaptive_opt.steps), None)):
        pc = predicted_cil(curve, cost, steps, s_iter, e_iter, total) if curve is not None else math.nan
        rows.append({
            "schedule": name, "publishes": len(steps), "interval": interval,
            "predicted_cil": pc,
            "realized_cil": realized_cil(version, cost, steps, s_iter, total),
            "realized_cil_smoothed": realized_cil(version_smooth, cost, steps, s_iter, total),
            "realized_cil_heldout": realized_cil(held, cost, steps, s_iter, total),
            "overhead_s": len(steps) * cost.t_p,
            "steps": steps,
        })
    by = {r["schedule"]: r for r in rows}
    targets = {}
    for key in ("realized_cil", "realized_cil_smoothed", "realized_cil_heldout", "predicted_cil"):
        targets[key] = {
            "adaptive_le_fixed": bool(by["adaptive"][key] <= by["fixed"][key]),
            "fixed_lt_epoch": bool(by["fixed"][key] < by["epoch"][key]),
            "adaptive_lt_epoch": bool(by["adaptive"][key] < by["epoch"][key]),
        }
    out_json_part.update({
        "settings": {
            "mode": "quick" if quick else "full", "epochs": epochs, "steps_per_epoch": STEPS_PER_EPOCH,
            "batch": BATCH, "s_iter": s_iter, "e_iter": e_iter, "total_infers": total,
            "total_infers_rule": "given" if total_infers else "(e_iter - s_iter) * t_train / t_infer",
            "t_train_s": t_train, "t_train_p10_s": float(np.percentile(iters, 10)),
            "t_train_p90_s": float(np.percentile(iters, 90)),
            "t_infer_s": t_inf, "t_infer_source": "given" if t_infer else "measured: median single-sample tf.function call",
            "model_bytes": mbytes, "model_bytes_source": "given" if model_bytes else "measured: sum of model.weights",
            "write_bw_Bps": write_bw, "read_bw_Bps": read_bw, "t_p_s": cost.t_p, "t_c_s": cost.t_c,
            "seed": seed, "thresh": thresh, "thresh_printed_rule": thresh_printed,
            "smoothing_window": smoothing_window(s_iter),
            "heldout_at_s_iter": float(held[s_iter]), "heldout_at_e_iter": float(held[e_iter]),
            "thresh_cil_optimal": adaptive_opt.thresh, "eval_every": eval_every, "heldout_samples": 360,
            "train_wall_s": rec["train_wall_s"], "plan_fixed_s": t_fixed, "plan_adaptive_s": t_adaptive,
            "tf_threads": "intra/inter = 1",
        },
        "curve": curve.to_json() if curve is not None else None,
        "plans": {"fixed": fixed.to_json(), "adaptive": adaptive.to_json(),
                  "adaptive-printed-rule": adaptive_pr.to_json(), "adaptive-cil-optimal": adaptive_opt.to_json()},
        "plan_summaries": {k: p.summary() for k, p in (("fixed", fixed), ("adaptive", adaptive),
                                                        ("adaptive-printed-rule", adaptive_pr))},
        "plan_degenerate": {k: p.degenerate for k, p in (("fixed", fixed), ("adaptive", adaptive),
                                                         ("adaptive-printed-rule", adaptive_pr))},
        "rows": rows, "targets": targets,
        "series": {"batch_loss": [None if not math.isfinite(v) else round(float(v), 6) for v in batch],
                   "heldout_loss": [round(float(v), 6) for v in held]},
    })
    out_json_part["table_md"] = table(out_json_part)
    out_json_part["settings"]["wall_s"] = round(time.time() - t_start, 1)
    return out_json_part


def _mean_se(v: "list[float]") -> tuple[float, float]:
    a = np.asarray(v, dtype=float)
    return float(a.mean()), (float(a.std(ddof=1) / math.sqrt(a.size)) if a.size > 1 else math.nan)


def _verdict(diffs: "list[float]") -> str:
    """Paired differences a − b over the seeds: 'lower' / 'higher' beyond one standard error, else
    'not resolvable'."""
    m, se = _mean_se(diffs)
    if not math.isfinite(se):
        return "lower" if m < 0 else "higher" if m > 0 else "equal"
    return "lower" if m < -se else "higher" if m > se else "not resolvable"


def summarize(runs: list[dict]) -> dict:
    """Mean ± standard error over the seeds, per schedule: held-out (the deciding metric) and smoothed
    per-batch realized CIL, publishes, CIL relative to epoch (paired per seed); paired verdicts."""
    names = [r["schedule"] for r in runs[0]["rows"]]
    per = {n: [{r["schedule"]: r for r in run["rows"]}[n] for run in runs] for n in names}
    out: dict[str, Any] = {"seeds": [run["settings"]["seed"] for run in runs], "schedules": {}}
    for n in names:
        rows = per[n]
        out["schedules"][n] = {
            key: _mean_se([r[key] for r in rows])
            for key in ("realized_cil_heldout", "realized_cil_smoothed", "predicted_cil", "publishes")}
        out["schedules"][n]["heldout_vs_epoch"] = _mean_se(
            [r["realized_cil_heldout"] / e["realized_cil_heldout"] for r, e in zip(rows, per["epoch"])])
        out["schedules"][n]["seeds_with_no_publish"] = sum(1 for r in rows if r["publishes"] == 0)
    pairs = {}
    for a, b in (("adaptive", "fixed"), ("adaptive", "epoch"), ("fixed", "epoch"), ("adaptive", "adaptive-printed-rule")):
        d = [x["realized_cil_heldout"] - y["realized_cil_heldout"] for x, y in zip(per[a], per[b])]
        pairs[f"{a} vs {b}"] = {"diff_mean_se": _mean_se(d), "verdict": _verdict(d),
                                "wins": sum(1 for v in d if v < 0), "of": len(d)}
    out["pairs_heldout"] = pairs
    drops = [run["settings"]["heldout_at_s_iter"] - run["settings"]["heldout_at_e_iter"] for run in runs]
    out["heldout_drop_after_warmup"] = _mean_se(drops)
    return out


def table_seeds(doc: dict) -> str:
    s, sm = doc["runs"][0]["settings"], doc["summary"]
    n = len(sm["seeds"])
    lines = [f"CIL over {n} seeds (mean ± standard error; held-out loss decides), TC1-like, {s['epochs']} epochs, "
             f"warm-up {s['s_iter']} iterations, plan to {s['e_iter']}; the held-out loss falls by "
             f"{sm['heldout_drop_after_warmup'][0]:.3f} ± {sm['heldout_drop_after_warmup'][1]:.3f} after the warm-up",
             "", "| schedule | publishes | realized CIL (held-out) | vs epoch | realized (smoothed per-batch) "
             "| predicted CIL | seeds with no publish |", "|---|---|---|---|---|---|---|"]
    for name, v in sm["schedules"].items():
        pub, held, rel, smo, pred = (v["publishes"], v["realized_cil_heldout"], v["heldout_vs_epoch"],
                                     v["realized_cil_smoothed"], v["predicted_cil"])
        lines.append(f"| {name} | {pub[0]:.1f} ± {pub[1]:.1f} | {held[0]:.0f} ± {held[1]:.0f} | "
                     f"{rel[0]:.3f} ± {rel[1]:.3f} | {smo[0]:.0f} ± {smo[1]:.0f} | {pred[0]:.0f} ± {pred[1]:.0f} | "
                     f"{v['seeds_with_no_publish']} of {n} |")
    lines.append("")
    for k, v in sm["pairs_heldout"].items():
        d = v["diff_mean_se"]
        lines.append(f"- {k} (held-out, paired): {d[0]:+.0f} ± {d[1]:.0f}: {v['verdict']} "
                     f"({v['wins']} of {v['of']} seeds lower)")
    return "\n".join(lines)


def run_seeds(doc: dict, *, seeds: int, quick: bool, **kw: Any) -> dict:
    """:func:`run_cil` for seeds 0..seeds−1 (one after another, in this process), then the summary."""
    import tensorflow as tf
    t0 = time.time()
    doc["runs"] = []
    for seed in range(seeds):
        tf.keras.backend.clear_session()
        part: dict = {}
        run_cil(part, quick=quick, seed=seed, **kw)
        doc["runs"].append(part)
        print(f"seed {seed}: " + ", ".join(f"{r['schedule']} {r['publishes']} publishes, held-out "
                                           f"{r['realized_cil_heldout']:.0f}" for r in part["rows"]), flush=True)
    doc["summary"] = summarize(doc["runs"])
    doc["table_md"] = table_seeds(doc)
    doc["statistic"] = (f"mean ± standard error over {seeds} seeds (training samples and initial weights change; "
                        "the held-out set and the cost model's bandwidths do not); a difference within one "
                        "standard error is 'not resolvable'")
    doc["wall_s"] = round(time.time() - t0, 1)
    return doc


def shown_run(doc: dict) -> dict:
    """The run the plot and the single-run table show: the first seed whose adaptive plan is not
    degenerate (else seed 0)."""
    return next((r for r in doc["runs"] if not r.get("plan_degenerate", {}).get("adaptive")), doc["runs"][0])


def table(doc: dict) -> str:
    s = doc["settings"]
    lines = [f"CIL over {s['total_infers']} requests (t_train {s['t_train_s'] * 1e3:.2f} ms, t_infer "
             f"{s['t_infer_s'] * 1e3:.3f} ms, t_p {s['t_p_s'] * 1e3:.3f} ms, t_c {s['t_c_s'] * 1e3:.3f} ms; "
             f"warm-up {s['s_iter']} iterations, plan to {s['e_iter']}; thresholds: smoothed ({s['smoothing_window']}) "
             f"{s['thresh']:.4g}, printed rule {s['thresh_printed_rule']:.4g}, CIL-optimal "
             f"{s['thresh_cil_optimal'] or math.nan:.4g})", "",
             "| schedule | publishes | interval | predicted CIL | realized CIL (per-batch) | realized (smoothed 21) "
             "| realized (held-out) | overhead (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['schedule']} | {r['publishes']} | {r['interval'] if r['interval'] else '-'} | "
                     f"{r['predicted_cil']:.1f} | {r['realized_cil']:.1f} | {r['realized_cil_smoothed']:.1f} | "
                     f"{r['realized_cil_heldout']:.1f} | {r['overhead_s']:.4f} |")
    return "\n".join(lines)


def plot(doc: dict, path: str, summary: dict | None = None) -> None:
    """One run's curve, fit and schedules, and its CIL bars; with ``summary`` (several seeds) a
    third panel: held-out CIL relative to epoch, mean ± standard error over the seeds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from deepfreeze.stream.predict import Curve
    s = doc["settings"]
    batch = np.array([np.nan if v is None else v for v in doc["series"]["batch_loss"]], dtype=float)
    held = np.array(doc["series"]["heldout_loss"], dtype=float)
    x = np.arange(batch.size)
    if summary is None:
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [2.2, 1]})
    else:
        fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(18, 4.8), gridspec_kw={"width_ratios": [2.2, 1, 1]})
        names = list(summary["schedules"])
        rel = [summary["schedules"][n]["heldout_vs_epoch"] for n in names]
        cx.bar(np.arange(len(names)), [r[0] for r in rel], 0.6, yerr=[r[1] for r in rel], capsize=4,
               color=["C1", "C4", "C5", "C6", "C8"][:len(names)])
        cx.axhline(1.0, color="k", lw=0.8, ls=":")
        cx.set_xticks(np.arange(len(names)), [n.replace("adaptive-", "adapt.\n") for n in names], fontsize=8)
        lo = min(r[0] - r[1] for r in rel)
        hi = max(r[0] + r[1] for r in rel)
        cx.set_ylim(lo - 0.1 * (hi - lo), hi + 0.1 * (hi - lo))
        cx.set_ylabel("held-out CIL / epoch's (paired)")
        cx.set_title(f"{len(summary['seeds'])} seeds: mean ± s.e.")
    ax.set_title(f"TC1-like learning curve (seed {s.get('seed', 0)}), fit and publish schedules")
    ax.plot(x, batch, lw=0.5, color="0.7", label="per-batch training loss")
    ax.plot(x[1:], smooth(batch[1:]), lw=1.2, color="C0", label="per-batch, smoothed (21)")
    ax.plot(x, held, lw=1.2, color="C2", label="held-out loss (interpolated)")
    if doc["curve"]:
        cv = Curve.from_json(doc["curve"])
        ax.plot(x[1:], cv(x[1:].astype(float)), "--", color="C3", lw=1.5, label=f"fit ({cv.family}) on the warm-up")
    ax.axvline(s["s_iter"], color="k", lw=0.8, ls=":")
    lo = np.nanmin(batch[1:])
    hi = np.nanpercentile(batch[1:], 99.5)
    span = hi - lo
    for k, (r, c) in enumerate(zip(doc["rows"], ("C1", "C4", "C5", "C6", "C8"))):
        yk = lo - (0.06 + 0.06 * k) * span
        ax.plot(r["steps"], [yk] * len(r["steps"]), "|", color=c, ms=8, label=f"{r['schedule']} ({r['publishes']})")
    ax.set_ylim(lo - (0.08 + 0.06 * len(doc["rows"])) * span, hi)
    ax.set_xlabel("global iteration")
    ax.set_ylabel("loss")
    ax.legend(fontsize=7, loc="upper right")
    names = [r["schedule"] for r in doc["rows"]]
    w = 0.2
    for j, (key, lab) in enumerate((("predicted_cil", "predicted"), ("realized_cil", "realized (per-batch)"),
                                    ("realized_cil_smoothed", "realized (smoothed)"),
                                    ("realized_cil_heldout", "realized (held-out)"))):
        bx.bar(np.arange(len(names)) + (j - 1.5) * w, [r[key] for r in doc["rows"]], w, label=lab)
    bx.set_xticks(np.arange(len(names)), [n.replace("adaptive-", "adapt.\n") for n in names], fontsize=8)
    vals = [r[k] for r in doc["rows"] for k in ("predicted_cil", "realized_cil", "realized_cil_heldout")]
    bx.set_ylim(min(vals) * 0.9, max(vals) * 1.04)
    bx.set_ylabel(f"CIL over {s['total_infers']} requests")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 epochs (about a minute)")
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--eval-every", type=int, default=None, help="iterations between held-out evaluations")
    ap.add_argument("--t-infer", type=float, default=None, help="seconds per request (default: measured)")
    ap.add_argument("--total-infers", type=int, default=None,
                    help="requests (default: as many as fit in the training time after the warm-up)")
    ap.add_argument("--write-bw", type=float, default=5e9, help="producer publish bandwidth, B/s (t_p)")
    ap.add_argument("--read-bw", type=float, default=5e9, help="consumer load bandwidth, B/s (t_c)")
    ap.add_argument("--model-bytes", type=int, default=None, help="published bytes (default: the model's weights)")
    ap.add_argument("--seeds", type=int, default=None, help=f"seeds 0..N-1 (default {SEEDS}; 1 with --quick)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "stream_cil.json"))
    args = ap.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    seeds = args.seeds or (1 if args.quick else SEEDS)
    doc: dict = {}
    run_seeds(doc, seeds=seeds, quick=args.quick, epochs=args.epochs, eval_every=args.eval_every,
              t_infer=args.t_infer, total_infers=args.total_infers, write_bw=args.write_bw, read_bw=args.read_bw,
              model_bytes=args.model_bytes)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        json.dump(doc, f, indent=1, allow_nan=True)
    os.replace(args.out + ".tmp", args.out)
    shown = shown_run(doc)
    plot(shown, os.path.splitext(args.out)[0] + ".png", doc["summary"] if seeds > 1 else None)
    print(shown["table_md"])
    print()
    print(doc["table_md"])
    print(f"wrote {args.out} ({doc['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
