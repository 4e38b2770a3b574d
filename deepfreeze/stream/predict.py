"""Long because: one algorithm (Viper 4.3): curve fit, cost model and schedules all feed make_plan.

When to publish: the learning-curve predictor and the publish schedules (Viper section 4.3).

Framework-neutral (numpy + scipy; no TensorFlow, no torch). The producer (the Keras
``PublishCallback``, the torch ``Publisher``) calls :func:`producer_plan` at the end of the
warm-up: :func:`make_plan` on rank 0, the :class:`Plan` broadcast as JSON.

**Training loss predictor.** Keras' ``logs["loss"]`` is the running mean of the current epoch;
:func:`per_batch_losses` recovers the per-batch values (``l_k = k·avg_k − (k−1)·avg_{k−1}``).
:func:`fit_curve` fits the warm-up losses, with x = the global iteration, to four families and
keeps the lowest mean squared error:

* ``exp2``  ``a·e^(−b·x)``
* ``exp3``  ``a·e^(−b·x) + c``
* ``lin2``  ``a·x + b``
* ``expd3`` ``c − (c − a)·e^(−b·x)``

Robustness: x is shifted and scaled to ``u = (x − x_offset)/x_scale`` in [0, 1] (raw iterations
in the thousands overflow ``e^(−b·x)`` and stall the optimizer), ``b`` is bounded to
``[0, 1000]`` in scaled units (``b = 0`` is the flat curve), every exponential family is
first solved exactly for its linear parameters on a grid of ``b`` (variable projection), then
polished with ``scipy.optimize.curve_fit`` (a failed polish keeps the grid optimum; a family
that yields nothing finite is skipped). Non-finite points are dropped. ``exp3`` and ``expd3``
are one family under two parameterisations: the better of the two fits is kept for both (so
they tie exactly). Ties (MSE within a relative 1e-9, or both below 1e-12 of the data's mean
square) go to fewer parameters, then to the order of ``families``.

**Cost model** (:class:`CostModel`): ``t_train`` seconds per iteration, ``t_infer`` seconds per
inference request, ``t_p`` producer stall per publish (``model_bytes / write_bw``), ``t_c``
consumer load of a version (``model_bytes / read_bw``).

**The timeline every CIL function here uses** (Eq. 1-2 of the paper, with the fixes below).
Time 0 is when the warm-up version (iteration ``s_iter``, published at the end of the warm-up)
is live on the consumer. Requests are issued back to back: request ``j`` at ``j·t_infer``,
``j = 0 .. total_infers−1``, and is served by the newest version live at that instant. The
``m``-th publish after the warm-up, at global iteration ``c_m``, completes at
``(c_m − s_iter)·t_train + m·t_p`` (training plus every stall so far) and is live ``t_c`` later:
the consumer loads it into its idle replica while it keeps serving the previous version, so
loads overlap training and each other's serving. The cumulative inference loss (CIL) is the
sum over requests of the predicted loss of the version serving it (:func:`predicted_cil`), or
of the loss recorded at that version's iteration (:func:`realized_cil`). Versions live after
the last request serve nobody: the schedules never contain them. The model assumes
``t_c ≤`` the gap between publishes (a consumer slower than that would skip versions, and the
model is then optimistic).

**Fixes of the printed pseudo-code** (the paper's text is what is implemented):

1. *Eq. 1 divisor.* The printed ``x' = ckpt_i·⌊t_k/t_train⌋ + ⌊t_rem/t_train⌋`` divides by
   ``t_train`` where the cycle ``t'_train = ckpt_i·t_train + t_p`` is meant; and ``t_rem`` is
   capped at the cycle's training part ``ckpt_i·t_train`` (not at ``t'_train``) so time spent
   in the stall is not counted as iterations. :func:`iteration_at` is the fixed Eq. 1.
2. *Alg. 1 line 8* is garbled in the print (``e_iter ← e_iter − s_iter ← loss·infers``); it
   means ``acc_infer_loss ← loss·infers``.
3. *Alg. 1 rounding.* It floors every interval on its own (``⌊(inter·t_train + t_p)/t_infer⌋``),
   so a schedule of K intervals loses up to K requests, all of which then land on the last
   version: short intervals look better than they are. Here requests are counted on one clock
   (the requests issued before each version goes live), which is Eq. 2 in whole requests.
4. *``t_c`` only on the first load* (Alg. 1 lines 3/5, Eq. 2's ``infers(0)``): it is one
   shift of the whole timeline by the first load, since later loads overlap the serving of the
   previous version; it is not added per interval.
5. *Iterations offset by the warm-up end.* Eq. 2 evaluates ``loss_pred(k·ckpt_i)`` and Alg. 2/3
   start at ``s_iter`` but the loss must be read at the global iteration: the k-th version is
   ``loss_pred(s_iter + k·ckpt_i)`` (the warm-up version ``loss_pred(s_iter)``).
6. *Alg. 3 never advances ``i``* outside its ``if`` (an endless loop once the first candidate
   fails the threshold): ``i`` advances on every iteration. The comparison stays the one
   printed: the predicted drop since the *last publish* must exceed ``thresh``, so publishes
   are dense where the curve falls fast and sparse near convergence. The threshold
   (:func:`warmup_threshold`) is the mean plus the (population) standard deviation of the
   absolute differences of consecutive warm-up losses, taken on the *smoothed* losses
   (:func:`smooth_losses`, a moving average over about a quarter of the warm-up): the
   threshold is compared with drops of the fitted (smooth) curve, so it must be in a smooth
   curve's units. On raw per-batch losses (the printed rule, ``smooth=1``) per-batch noise
   makes it larger than the curve's whole later drop and nothing is ever published.
7. *Alg. 2 ties.* The printed ``t_l < min_loss`` keeps the first, i.e. the *smallest* interval
   on a flat curve (a publish every iteration for no gain); ties (relative 1e-9) go to the
   largest interval instead.

Alg. 2 is O(N²) as printed; :func:`fixed_interval_cils` evaluates every interval at once
(interval i has ⌊N/i⌋ publishes, so N·ln N predictor evaluations), and :func:`simulate_eq2` is
an independent request-by-request simulation the tests compare it with.

**Flat or rising curves** (the fitted curve does not fall between ``s_iter`` and ``e_iter``):
``adaptive`` plans no publish after the warm-up one, ``fixed`` takes the largest interval (one
publish at ``e_iter``, unless it would serve no request). When no curve can be fitted at all
(too few finite losses), :func:`make_plan` returns the same flat plan with ``curve=None`` and
says why in ``Plan.note`` (it never raises for data).

:func:`producer_plan` is what both adapters' publishers do with it at the end of the warm-up:
rank 0 makes the plan from the cost model's inputs, every rank gets it, rank 0 logs it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import warnings
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..errors import ConfigError, DeepFreezeError, StreamError

__all__ = [
    "FAMILIES", "per_batch_losses", "Curve", "fit_curve", "CostModel", "iteration_at", "cil_fixed",
    "fixed_interval_cils", "optimal_interval", "simulate_eq2", "warmup_threshold", "adaptive_schedule",
    "optimal_threshold", "smooth_losses", "smoothing_window",
    "predicted_cil", "realized_cil", "Plan", "make_plan", "producer_plan",
]

log = logging.getLogger("deepfreeze")

FAMILIES: tuple[str, ...] = ("exp2", "exp3", "lin2", "expd3")
_NPARAMS = {"exp2": 2, "exp3": 3, "lin2": 2, "expd3": 3}
_B_MAX = 1000.0                    # bound of b in scaled units (e^-1000u: a drop within 0.1 % of the warm-up)
_B_GRID = np.concatenate([[0.0], np.geomspace(1e-3, _B_MAX, 73)])
_TIE_REL, _TIE_ABS = 1e-9, 1e-12   # MSE ties: relative, and relative to the data's mean square
_MAX_PLAN_STEPS = 10_000_000       # bound on a plan read from JSON


# ----------------------------------------------------------------------------- losses, curves

def per_batch_losses(running_means: Sequence[float]) -> np.ndarray:
    """Per-batch losses from Keras' running mean over ONE epoch (``logs["loss"]`` at batch k, k from 1).

    ``l_k = k·avg_k − (k−1)·avg_{k−1}``; split a multi-epoch record at the epoch boundaries and
    call this once per epoch. float64 throughout (Keras' float32 mean loses about 1e-7 relative
    per value, amplified by k).
    """
    a = np.asarray(running_means, dtype=np.float64).ravel()
    if a.size == 0:
        return a.copy()
    k = np.arange(1, a.size + 1, dtype=np.float64)
    prev = np.concatenate([[0.0], a[:-1]])
    return k * a - (k - 1.0) * prev


def _f(family: str, u: np.ndarray, p: Sequence[float]) -> np.ndarray:
    if family == "exp2":
        return p[0] * np.exp(-p[1] * u)
    if family == "exp3":
        return p[0] * np.exp(-p[1] * u) + p[2]
    if family == "lin2":
        return p[0] * u + p[1]
    if family == "expd3":
        return p[2] - (p[2] - p[0]) * np.exp(-p[1] * u)
    raise ConfigError(f"unknown curve family {family!r}: use one of {', '.join(FAMILIES)}")


@dataclasses.dataclass(frozen=True)
class Curve:
    """A fitted learning curve. ``params`` are in scaled units ``u = (x − x_offset)/x_scale``
    (see :meth:`unscaled` for the raw-iteration ones); calling it takes global iterations x."""

    family: str
    params: tuple[float, ...]
    mse: float
    x_scale: float
    x_offset: float = 0.0

    def __post_init__(self) -> None:
        if self.family not in _NPARAMS:
            raise ConfigError(f"unknown curve family {self.family!r}: use one of {', '.join(FAMILIES)}")
        if len(self.params) != _NPARAMS[self.family]:
            raise ConfigError(f"curve {self.family} takes {_NPARAMS[self.family]} parameters, got {len(self.params)}")
        if not (math.isfinite(self.x_scale) and self.x_scale > 0 and math.isfinite(self.x_offset)):
            raise ConfigError(f"curve x_scale must be finite and > 0 and x_offset finite "
                              f"(got {self.x_scale!r}, {self.x_offset!r})")

    def __call__(self, x: "np.ndarray | float") -> "np.ndarray | float":
        u = (np.asarray(x, dtype=np.float64) - self.x_offset) / self.x_scale
        with np.errstate(over="ignore", invalid="ignore"):
            y = _f(self.family, u, self.params)
        return float(y) if np.ndim(y) == 0 else y

    def unscaled(self) -> tuple[float, ...]:
        """The parameters for raw global iterations x (``a·e^(−b·x)+c`` with b per iteration, etc.)."""
        s, x0 = self.x_scale, self.x_offset
        p = self.params
        if self.family == "lin2":
            return (p[0] / s, p[1] - p[0] * x0 / s)
        g = math.exp(p[1] * x0 / s) if x0 else 1.0
        if self.family == "exp2":
            return (p[0] * g, p[1] / s)
        if self.family == "exp3":
            return (p[0] * g, p[1] / s, p[2])
        return (p[2] - (p[2] - p[0]) * g, p[1] / s, p[2])    # expd3

    def decreasing(self, x_from: float, x_to: float) -> bool:
        """True when the curve ends lower at ``x_to`` than at ``x_from`` (all four families are monotone)."""
        a, b = self(x_from), self(x_to)
        return bool(math.isfinite(a) and math.isfinite(b) and b < a)

    def to_json(self) -> dict:
        return {"family": self.family, "params": [float(v) for v in self.params], "mse": float(self.mse),
                "x_scale": float(self.x_scale), "x_offset": float(self.x_offset)}

    @classmethod
    def from_json(cls, obj: Any) -> "Curve":
        try:
            if not isinstance(obj, Mapping):
                raise TypeError("not an object")
            params = obj["params"]
            if not isinstance(params, list) or not all(_is_num(v) for v in params):
                raise TypeError("params must be a list of numbers")
            if not all(math.isfinite(v) for v in params):
                raise ValueError("params must be finite")
            for k in ("mse", "x_scale", "x_offset"):
                if not _is_num(obj.get(k, 0.0)):
                    raise TypeError(f"{k} must be a number")
            return cls(str(obj["family"]), tuple(float(v) for v in params), float(obj["mse"]),
                       float(obj["x_scale"]), float(obj.get("x_offset", 0.0)))
        except (KeyError, TypeError, ValueError) as e:   # ConfigError is a ValueError
            raise StreamError(f"malformed curve in a plan ({e}): the plan must come from Plan.to_json") from e


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def _basis(family: str, u: np.ndarray, b: float) -> np.ndarray:
    e = np.exp(-b * u)
    if family == "exp2":
        return e[:, None]
    if family == "exp3":
        return np.stack([e, np.ones_like(u)], axis=1)          # (a, c)
    return np.stack([e, 1.0 - e], axis=1)                      # expd3: a·e + c·(1 − e) -> (a, c)


def _params(family: str, b: float, lin: np.ndarray) -> tuple[float, ...]:
    if family == "exp2":
        return (float(lin[0]), b)
    return (float(lin[0]), b, float(lin[1]))


def _mse(family: str, u: np.ndarray, y: np.ndarray, p: Sequence[float]) -> float:
    with np.errstate(all="ignore"):
        r = _f(family, u, p) - y
        m = float(np.mean(r * r))
    return m if math.isfinite(m) else math.inf


def _fit_one(family: str, u: np.ndarray, y: np.ndarray) -> tuple[tuple[float, ...], float] | None:
    """Best parameters of one family on scaled data, or None when nothing finite comes out."""
    if family == "lin2":
        try:
            A = np.stack([u, np.ones_like(u)], axis=1)
            lin, *_ = np.linalg.lstsq(A, y, rcond=None)
        except (np.linalg.LinAlgError, ValueError):
            return None
        p = (float(lin[0]), float(lin[1]))
        m = _mse(family, u, y, p)
        return (p, m) if math.isfinite(m) else None
    best: tuple[tuple[float, ...], float] | None = None
    for b in _B_GRID:                                   # variable projection: exact linear part per b
        try:
            lin, *_ = np.linalg.lstsq(_basis(family, u, float(b)), y, rcond=None)
        except (np.linalg.LinAlgError, ValueError):
            continue
        p = _params(family, float(b), lin)
        m = _mse(family, u, y, p)
        if math.isfinite(m) and (best is None or m < best[1]):
            best = (p, m)
    if best is None:
        return None
    try:                                               # polish all parameters together
        from scipy.optimize import OptimizeWarning, curve_fit
        n = _NPARAMS[family]
        lo = [-np.inf, 0.0, -np.inf][:n]
        hi = [np.inf, _B_MAX, np.inf][:n]
        p0 = list(best[0])
        p0[1] = min(max(p0[1], 1e-9), _B_MAX)          # strictly inside the bounds
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OptimizeWarning)
            warnings.simplefilter("ignore", RuntimeWarning)
            popt, _ = curve_fit(lambda uu, *pp: _f(family, uu, pp), u, y, p0=p0, bounds=(lo, hi),
                                method="trf", maxfev=4000, ftol=1e-14, xtol=1e-14, gtol=1e-14)
        p = tuple(float(v) for v in popt)
        m = _mse(family, u, y, p)
        if m < best[1]:
            best = (p, m)
    except (RuntimeError, ValueError, FloatingPointError, np.linalg.LinAlgError):
        pass                                           # keep the grid optimum
    return best


def fit_curve(x: Sequence[float], y: Sequence[float], families: Sequence[str] = FAMILIES) -> Curve:
    """Fit ``y`` (losses) against ``x`` (global iterations) to each family; the lowest MSE wins.

    Non-finite points are dropped; a family needs at least as many points as parameters.
    Ties (relative 1e-9, or both MSEs below 1e-12 of ``mean(y²)``) go to fewer parameters,
    then to the order of ``families``. Raises :class:`StreamError` when no family could be
    fitted (too few finite points), :class:`ConfigError` for an unknown family or mismatched
    x/y lengths.
    """
    fams = tuple(families)
    for fam in fams:
        if fam not in _NPARAMS:
            raise ConfigError(f"unknown curve family {fam!r}: use one of {', '.join(FAMILIES)}")
    if not fams:
        raise ConfigError("fit_curve needs at least one family")
    xa = np.asarray(x, dtype=np.float64).ravel()
    ya = np.asarray(y, dtype=np.float64).ravel()
    if xa.shape != ya.shape:
        raise ConfigError(f"fit_curve: x has {xa.size} values and y {ya.size}; give one loss per iteration")
    keep = np.isfinite(xa) & np.isfinite(ya)
    xa, ya = xa[keep], ya[keep]
    need = min(_NPARAMS[f] for f in fams)
    if xa.size < need:
        raise StreamError(f"cannot fit a learning curve to {xa.size} finite loss values "
                          f"(of {keep.size}; families {', '.join(fams)} need at least {need}): "
                          f"use a longer warm-up, or check for NaN/inf losses")
    x0 = float(xa.min())
    span = float(xa.max()) - x0
    scale = span if span > 0 else 1.0
    u = (xa - x0) / scale
    fits: dict[str, tuple[tuple[float, ...], float]] = {}
    for fam in fams:
        if xa.size < _NPARAMS[fam]:
            continue
        r = _fit_one(fam, u, ya)
        if r is not None:
            fits[fam] = r
    if "exp3" in fits and "expd3" in fits:             # one family, two parameterisations
        (pa, ma), (pd, md) = fits["exp3"], fits["expd3"]
        if ma <= md:
            fits["expd3"] = ((pa[0] + pa[2], pa[1], pa[2]), ma)
        else:
            fits["exp3"] = ((pd[0] - pd[2], pd[1], pd[2]), md)
    if not fits:
        raise StreamError(f"no learning-curve family ({', '.join(fams)}) could be fitted to the "
                          f"{xa.size} warm-up losses: check them for NaN/inf or constant x")
    best_mse = min(m for _, m in fits.values())
    tol = _TIE_REL * best_mse + _TIE_ABS * float(np.mean(ya * ya))
    tied = [f for f in fams if f in fits and fits[f][1] <= best_mse + tol]
    win = min(tied, key=lambda f: (_NPARAMS[f], fams.index(f)))
    p, m = fits[win]
    return Curve(win, p, m, scale, x0)


# ----------------------------------------------------------------------------- cost model, CIL

@dataclasses.dataclass(frozen=True)
class CostModel:
    """Seconds: ``t_train`` per training iteration, ``t_infer`` per inference request, ``t_p``
    producer stall per publish, ``t_c`` consumer load of one version."""

    t_train: float
    t_infer: float
    t_p: float
    t_c: float

    def __post_init__(self) -> None:
        for name in ("t_train", "t_infer", "t_p", "t_c"):
            v = getattr(self, name)
            if not _is_num(v) or not math.isfinite(v):
                raise ConfigError(f"CostModel.{name} must be a finite number of seconds, got {v!r}")
        if self.t_train <= 0 or self.t_infer <= 0:
            raise ConfigError(f"CostModel: t_train and t_infer must be > 0 seconds "
                              f"(got {self.t_train!r}, {self.t_infer!r}); measure them on the real job")
        if self.t_p < 0 or self.t_c < 0:
            raise ConfigError(f"CostModel: t_p and t_c must be >= 0 seconds (got {self.t_p!r}, {self.t_c!r})")

    @classmethod
    def from_measurements(cls, t_train: float, t_infer: float, model_bytes: float, write_bw: float,
                          read_bw: float) -> "CostModel":
        """``t_p = model_bytes / write_bw`` and ``t_c = model_bytes / read_bw`` (bytes, bytes/s)."""
        for name, v in (("model_bytes", model_bytes), ("write_bw", write_bw), ("read_bw", read_bw)):
            if not _is_num(v) or not math.isfinite(v):
                raise ConfigError(f"CostModel.from_measurements: {name} must be a finite number, got {v!r}")
        if model_bytes < 0 or write_bw <= 0 or read_bw <= 0:
            raise ConfigError(f"CostModel.from_measurements: model_bytes must be >= 0 and the bandwidths > 0 "
                              f"(got {model_bytes!r}, {write_bw!r}, {read_bw!r} B/s)")
        return cls(float(t_train), float(t_infer), model_bytes / write_bw, model_bytes / read_bw)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _check_range(s_iter: int, e_iter: int, total_infers: int) -> None:
    for name, v in (("s_iter", s_iter), ("e_iter", e_iter), ("total_infers", total_infers)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise ConfigError(f"{name} must be an integer, got {v!r}")
    if e_iter < s_iter:
        raise ConfigError(f"e_iter ({e_iter}) is before s_iter ({s_iter}): the schedule covers (s_iter, e_iter]")
    if total_infers < 0:
        raise ConfigError(f"total_infers must be >= 0, got {total_infers}")


def iteration_at(t: float, cost: CostModel, interval: int) -> int:
    """Eq. 1, fixed: training iterations completed ``t`` seconds after the warm-up end when
    publishing every ``interval`` iterations (one cycle = ``interval·t_train + t_p``)."""
    if interval < 1:
        raise ConfigError(f"interval must be >= 1, got {interval}")
    if t <= 0:
        return 0
    cycle = interval * cost.t_train + cost.t_p
    n = math.floor(t / cycle)
    t_rem = min(t - n * cycle, interval * cost.t_train)
    return interval * n + math.floor(t_rem / cost.t_train)


def _issued_before(T: np.ndarray, t_infer: float, total: int) -> np.ndarray:
    """Requests ``j`` in ``[0, total)`` issued before ``T`` (``j·t_infer < T``), exactly."""
    T = np.asarray(T, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        n = np.clip(np.ceil(T / t_infer), 0, total)
        n = np.where((n > 0) & ((n - 1) * t_infer >= T), n - 1, n)
        n = np.where((n < total) & (n * t_infer < T), n + 1, n)
    return n.astype(np.int64)


def _deliveries(steps: np.ndarray, s_iter: int, cost: CostModel) -> np.ndarray:
    """When each publish (global iterations ``steps``, in order) is live on the consumer."""
    m = np.arange(1, steps.size + 1, dtype=np.float64)
    return (steps - s_iter).astype(np.float64) * cost.t_train + m * cost.t_p + cost.t_c


def _timeline_cil(version_losses: np.ndarray, deliveries: np.ndarray, cost: CostModel, total: int) -> float:
    """Σ loss(version) · requests it serves; version 0 is live at 0, version m from deliveries[m−1]."""
    before = _issued_before(deliveries, cost.t_infer, total)
    served = np.diff(np.concatenate([[0], before, [total]]))
    return float(np.dot(np.asarray(version_losses, dtype=np.float64), served))


def _check_schedule(schedule: Sequence[int], s_iter: int, e_iter: int | None) -> np.ndarray:
    steps = np.asarray(list(schedule), dtype=np.int64)
    if steps.ndim != 1:
        raise ConfigError("a schedule is a flat list of global iterations")
    if steps.size:
        if np.any(np.diff(steps) <= 0):
            raise ConfigError("a schedule's iterations must strictly increase")
        if steps[0] <= s_iter or (e_iter is not None and steps[-1] > e_iter):
            raise ConfigError(f"a schedule's iterations must lie in (s_iter, e_iter] = ({s_iter}, {e_iter}]; "
                              f"got {int(steps[0])} .. {int(steps[-1])}")
    return steps


def predicted_cil(curve: Curve, cost: CostModel, schedule: Sequence[int], s_iter: int, e_iter: int,
                  total_infers: int) -> float:
    """The CIL the curve predicts for publishing at ``schedule`` (global iterations in (s_iter, e_iter])."""
    _check_range(s_iter, e_iter, total_infers)
    steps = _check_schedule(schedule, s_iter, e_iter)
    losses = curve(np.concatenate([[s_iter], steps]).astype(np.float64))
    return _timeline_cil(np.atleast_1d(losses), _deliveries(steps, s_iter, cost), cost, total_infers)


def realized_cil(losses: Sequence[float], cost: CostModel, schedule: Sequence[int], s_iter: int,
                 total_infers: int) -> float:
    """The same CIL model evaluated on RECORDED losses: ``losses[x]`` is the loss at global
    iteration x (the version published at x is charged ``losses[x]``)."""
    la = np.asarray(losses, dtype=np.float64).ravel()
    _check_range(s_iter, s_iter, total_infers)
    steps = _check_schedule(schedule, s_iter, None)
    last = int(steps[-1]) if steps.size else s_iter
    if s_iter < 0 or last >= la.size:
        raise ConfigError(f"realized_cil: the losses cover iterations 0..{la.size - 1}, the schedule needs "
                          f"{s_iter}..{last}")
    vl = la[np.concatenate([[s_iter], steps])]
    return _timeline_cil(vl, _deliveries(steps, s_iter, cost), cost, total_infers)


def cil_fixed(curve: Curve, cost: CostModel, s_iter: int, e_iter: int, interval: int, total_infers: int) -> float:
    """Alg. 1 + Alg. 2 (fixed text) for one interval: the predicted CIL of publishing every
    ``interval`` iterations after ``s_iter`` up to ``e_iter``. A plain loop, as printed."""
    _check_range(s_iter, e_iter, total_infers)
    if interval < 1:
        raise ConfigError(f"interval must be >= 1, got {interval}")
    t_l, rem, issued = 0.0, total_infers, 0
    p_l = curve(float(s_iter))
    c, ver = s_iter + interval, 1
    while c <= e_iter:
        # Alg. 1 (fixed): the version served so far (p_l) serves every request issued before the
        # new one is live; the clock is cumulative (t_c once: it shifts the whole timeline).
        live = float(c - s_iter) * cost.t_train + float(ver) * cost.t_p + cost.t_c
        now = int(_issued_before(np.array([live]), cost.t_infer, total_infers)[0])
        infers = min(now - issued, rem)
        t_l += p_l * infers                      # Alg. 1 line 8: acc_infer_loss <- loss * infers
        rem -= infers
        issued += infers
        p_l = curve(float(c))                    # the loss at the GLOBAL iteration c
        c, ver = c + interval, ver + 1
    return t_l + p_l * rem                       # the rest is served by the last version


def fixed_interval_cils(curve: Curve, cost: CostModel, s_iter: int, e_iter: int, total_infers: int,
                        max_interval: int | None = None) -> np.ndarray:
    """Vectorised Alg. 2: ``out[i−1]`` = predicted CIL of publishing every i iterations, for
    i = 1 .. min(e_iter − s_iter, max_interval)."""
    _check_range(s_iter, e_iter, total_infers)
    n_it = e_iter - s_iter
    m_int = n_it if max_interval is None else min(n_it, int(max_interval))
    if m_int < 1:
        raise ConfigError(f"no interval to evaluate: e_iter - s_iter = {n_it}, max_interval = {max_interval}")
    l0 = float(curve(float(s_iter)))
    out = np.empty(m_int, dtype=np.float64)
    lo = 1
    budget = 2_000_000                            # (interval, publish) pairs per chunk
    while lo <= m_int:
        hi, tot = lo, 0
        while hi <= m_int and (tot == 0 or tot + n_it // hi <= budget):
            tot += n_it // hi
            hi += 1
        ivals = np.arange(lo, hi, dtype=np.int64)
        K = n_it // ivals                          # publishes of each interval (>= 1)
        starts = np.concatenate([[0], np.cumsum(K)[:-1]])
        rep_i = np.repeat(ivals, K)
        k = np.arange(int(K.sum()), dtype=np.int64) - np.repeat(starts, K) + 1
        steps_off = k * rep_i
        live = steps_off.astype(np.float64) * cost.t_train + k.astype(np.float64) * cost.t_p + cost.t_c
        before = _issued_before(live, cost.t_infer, total_infers)
        after = np.empty_like(before)
        after[:-1] = before[1:]
        ends = starts + K - 1
        after[ends] = total_infers
        lk = np.asarray(curve((s_iter + steps_off).astype(np.float64)), dtype=np.float64)
        contrib = lk * (after - before)
        out[lo - 1:hi - 1] = l0 * before[starts] + np.add.reduceat(contrib, starts)
        lo = hi
    return out


def optimal_interval(curve: Curve, cost: CostModel, s_iter: int, e_iter: int, total_infers: int,
                     max_interval: int | None = None) -> tuple[int, float]:
    """Alg. 2 / Eq. 3: ``(interval, predicted CIL)`` minimising the CIL over i = 1 .. N
    (N = e_iter − s_iter, or ``max_interval``). Ties (relative 1e-9) go to the LARGEST interval
    (fewest publishes): a flat curve gives the largest interval, not a publish every iteration."""
    cils = fixed_interval_cils(curve, cost, s_iter, e_iter, total_infers, max_interval)
    finite = np.isfinite(cils)
    if not finite.any():
        return len(cils), float(cils[-1])
    best = float(np.min(cils[finite]))
    tied = np.flatnonzero(finite & (cils <= best + 1e-9 * abs(best)))
    i = int(tied[-1])
    return i + 1, float(cils[i])


def simulate_eq2(curve: Curve, cost: CostModel, s_iter: int, e_iter: int, interval: int, total_infers: int) -> float:
    """An independent, request-by-request simulation of Eq. 2 for one fixed interval: the
    producer is stepped iteration by iteration (``t += t_train``, plus ``t_p`` at a publish,
    live ``t_c`` later); each request at ``j·t_infer`` is charged the predicted loss of the newest
    live version. Slow (a Python loop per request): for tests."""
    _check_range(s_iter, e_iter, total_infers)
    if interval < 1:
        raise ConfigError(f"interval must be >= 1, got {interval}")
    events: list[tuple[float, int]] = []
    t, x = 0.0, s_iter
    while x < e_iter:
        x += 1
        t += cost.t_train
        if (x - s_iter) % interval == 0:
            t += cost.t_p
            events.append((t + cost.t_c, x))
    live, ev, acc = s_iter, 0, 0.0
    cache: dict[int, float] = {}
    for j in range(total_infers):
        now = j * cost.t_infer
        while ev < len(events) and events[ev][0] <= now:
            live = events[ev][1]
            ev += 1
        if live not in cache:
            cache[live] = float(curve(float(live)))
        acc += cache[live]
    return acc


def smoothing_window(n: int) -> int:
    """The default smoothing window for ``n`` warm-up losses: odd, about a quarter of them
    (``2·⌊n/8⌋ + 1``; 1, i.e. no smoothing, below 8 losses)."""
    return 2 * (max(int(n), 0) // 8) + 1


def smooth_losses(losses: Sequence[float], window: int | None = None) -> np.ndarray:
    """The warm-up losses smoothed: the mean of every ``window`` consecutive finite losses (a
    moving average over full windows only, so ``n − window + 1`` values; no shrunken, noisier
    windows at the ends). ``window`` None: :func:`smoothing_window`; 1: the losses themselves.
    A linear trend passes unchanged (its consecutive differences keep the slope) while
    independent per-batch noise of standard deviation σ shrinks to σ/√window, and the noise in
    consecutive differences to σ·√2/window."""
    a = np.asarray(losses, dtype=np.float64).ravel()
    a = a[np.isfinite(a)]
    w = smoothing_window(a.size) if window is None else window
    if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 1:
        raise ConfigError(f"smoothing window must be an integer >= 1, got {window!r}")
    w = int(w)
    if a.size < w:
        w = max(1, a.size)
    c = np.concatenate([[0.0], np.cumsum(a)])
    return (c[w:] - c[:-w]) / w


def warmup_threshold(losses: Sequence[float], window: int | None = None) -> float:
    """Alg. 3's threshold, in the smoothed loss curve's units: mean + std (population) of |Δ| of
    consecutive values of :func:`smooth_losses` of the per-batch warm-up losses (non-finite
    values dropped). ``window=1`` is the paper's printed rule on the raw per-batch losses, which
    per-batch noise dominates (it can exceed the fitted curve's whole later drop, so nothing is
    ever published). Needs at least 2 finite losses (else :class:`StreamError`)."""
    a = np.asarray(losses, dtype=np.float64).ravel()
    a = a[np.isfinite(a)]
    if a.size < 2:
        raise StreamError(f"the adaptive threshold needs at least 2 finite warm-up losses, got {a.size}: "
                          f"use a longer warm-up or pass thresh= explicitly")
    sm = smooth_losses(a, window)
    if sm.size < 2:  # window == n: one mean; fall back to the largest window with two values
        sm = smooth_losses(a, a.size - 1)
    d = np.abs(np.diff(sm))
    return float(d.mean() + d.std())


def adaptive_schedule(curve: Curve, cost: CostModel, s_iter: int, e_iter: int, total_infers: int,
                      thresh: float) -> list[int]:
    """Alg. 3 (fixed: ``i`` advances every iteration): publish at iteration i when the predicted
    loss fell by more than ``thresh`` since the last publish (strictly lower). Stops at the first
    publish that would be live after the last request (it would serve nobody)."""
    _check_range(s_iter, e_iter, total_infers)
    if not _is_num(thresh) or not math.isfinite(thresh) or thresh < 0:
        raise ConfigError(f"thresh must be a finite number >= 0, got {thresh!r}")
    if e_iter == s_iter or total_infers == 0:
        return []
    vals = np.asarray(curve(np.arange(s_iter + 1, e_iter + 1, dtype=np.float64)), dtype=np.float64)
    p_l = float(curve(float(s_iter)))
    sched: list[int] = []
    pos = 0
    while pos < vals.size:
        idx, width = -1, 64                                 # scan windows of growing width: O(gap)
        start = pos
        while start < vals.size:
            seg = vals[start:start + width]
            with np.errstate(invalid="ignore"):
                hit = (seg < p_l) & ((p_l - seg) > thresh)
            j = int(np.argmax(hit))
            if hit[j]:
                idx = start + j
                break
            start += width
            width *= 2
        if idx < 0:
            break
        c = s_iter + 1 + idx
        live = float(c - s_iter) * cost.t_train + float(len(sched) + 1) * cost.t_p + cost.t_c
        if int(_issued_before(np.array([live]), cost.t_infer, total_infers)[0]) >= total_infers:
            break                                           # no request left for it
        sched.append(c)
        p_l = float(vals[idx])
        pos = idx + 1
    return sched


def optimal_threshold(curve: Curve, cost: CostModel, s_iter: int, e_iter: int, total_infers: int,
                      candidates: int = 200) -> tuple[float, float]:
    """``(thresh, predicted CIL)``: the Alg. 3 threshold that minimises the predicted CIL, searched
    over ``candidates`` values ``drop/k`` (drop = the predicted fall from s_iter to e_iter, k
    log-spaced in 1 .. e_iter − s_iter); ties go to the larger threshold (fewer publishes). Not the
    paper's rule (which fixes the threshold from the warm-up's noise, see :func:`warmup_threshold`):
    an option for when that threshold is dominated by per-batch noise. A curve that does not
    fall: ``(inf, CIL without publishes)``."""
    _check_range(s_iter, e_iter, total_infers)
    none = predicted_cil(curve, cost, [], s_iter, e_iter, total_infers)
    if e_iter == s_iter or not curve.decreasing(s_iter, e_iter):
        return math.inf, none
    drop = float(curve(float(s_iter))) - float(curve(float(e_iter)))
    ks = np.unique(np.geomspace(1.0, float(e_iter - s_iter), max(2, int(candidates))))
    best_t, best_c = math.inf, none
    for th in sorted(drop / ks, reverse=True):          # large thresholds first: ties keep them
        steps = adaptive_schedule(curve, cost, s_iter, e_iter, total_infers, float(th))
        c = predicted_cil(curve, cost, steps, s_iter, e_iter, total_infers)
        if c < best_c - 1e-9 * abs(best_c):
            best_t, best_c = float(th), c
    return best_t, best_c


def _fixed_steps(interval: int, cost: CostModel, s_iter: int, e_iter: int, total_infers: int) -> list[int]:
    """Publishes every ``interval`` after s_iter, without the ones live after the last request."""
    steps = np.arange(s_iter + interval, e_iter + 1, interval, dtype=np.int64)
    before = _issued_before(_deliveries(steps, s_iter, cost), cost.t_infer, total_infers)
    return [int(v) for v in steps[before < total_infers]]


# ----------------------------------------------------------------------------- plans

@dataclasses.dataclass(frozen=True)
class Plan:
    """A publish plan: global iterations (optimizer steps) at which to publish after the warm-up."""

    kind: str                       # "fixed" | "adaptive"
    steps: tuple[int, ...]
    curve: Curve | None
    predicted_cil: float
    interval: int | None            # fixed: the chosen interval
    thresh: float | None = None     # adaptive: the threshold used
    note: str = ""                  # why the plan is degenerate (flat/rising curve, no fit), else ""
    s_iter: int | None = None       # the range planned: steps in (s_iter, e_iter]
    e_iter: int | None = None
    cost: "CostModel | None" = None  # the cost model it was made with (for the reasons it gives)

    def to_json(self) -> dict:
        pc = self.predicted_cil
        return {"kind": self.kind, "steps": [int(s) for s in self.steps],
                "curve": self.curve.to_json() if self.curve is not None else None,
                "predicted_cil": float(pc) if math.isfinite(pc) else None,
                "interval": self.interval, "thresh": self.thresh, "note": self.note,
                "s_iter": self.s_iter, "e_iter": self.e_iter,
                "cost": self.cost.to_json() if self.cost is not None else None}

    @property
    def degenerate(self) -> str:
        """Why this plan does not do a schedule's job, or ``""``: it publishes nothing after the
        warm-up, or at (nearly) every step. Needs the planned range (``s_iter``, ``e_iter``)."""
        if self.s_iter is None or self.e_iter is None or self.e_iter <= self.s_iter:
            return ""
        n_it = self.e_iter - self.s_iter
        why = f" ({self.note})" if self.note else ""
        if not self.steps:
            if self.kind == "adaptive" and self.thresh is not None and self.curve is not None and not self.note:
                drop = float(self.curve(float(self.s_iter))) - float(self.curve(float(self.e_iter)))
                why = (f" (the fitted {self.curve.family} curve falls {drop:.4g} from step {self.s_iter} to "
                       f"{self.e_iter}, less than the threshold {self.thresh:.4g}, or its publishes would serve no "
                       "request)")
            return f"no publish after the warm-up in steps ({self.s_iter}, {self.e_iter}]{why}"
        if n_it >= 4 and len(self.steps) >= 0.5 * n_it:
            cost = ""
            if self.cost is not None:
                cost = (f": the cost model charges t_p = {self.cost.t_p:.3g} s per publish against t_train = "
                        f"{self.cost.t_train:.3g} s per step, so publishing looks nearly free and the densest plan "
                        "minimises the predicted loss (give realistic publish/load costs, e.g. consumer_load_s)")
            return f"a publish at {len(self.steps)} of the {n_it} steps in ({self.s_iter}, {self.e_iter}]{cost}"
        return ""

    def summary(self) -> str:
        """One line: kind, range, publishes, intervals, threshold, curve, predicted CIL."""
        st = list(self.steps)
        rng = f"steps ({self.s_iter}, {self.e_iter}]" if self.s_iter is not None else "after the warm-up"
        gaps = np.diff(np.array(([self.s_iter] if self.s_iter is not None else []) + st, dtype=np.int64))
        parts = [f"{self.kind} plan: {len(st)} publish{'es' if len(st) != 1 else ''} expected in {rng}"]
        if st:
            parts.append(f"first at {st[0]}, last at {st[-1]}")
        if self.interval is not None:
            parts.append(f"interval {self.interval}")
        elif gaps.size:
            parts.append(f"intervals {int(gaps.min())}..{int(gaps.max())} (median {float(np.median(gaps)):g})")
        if self.thresh is not None:
            parts.append(f"threshold {self.thresh:.4g}")
        if self.curve is not None:
            parts.append(f"curve {self.curve.family}")
        if math.isfinite(self.predicted_cil):
            parts.append(f"predicted CIL {self.predicted_cil:.6g}")
        return ", ".join(parts)

    @classmethod
    def from_json(cls, obj: Any) -> "Plan":
        """Validate and rebuild a plan (what rank 0 broadcast): :class:`StreamError` when malformed."""
        def bad(why: str) -> StreamError:
            return StreamError(f"malformed publish plan: {why} (it must come from Plan.to_json)")
        if not isinstance(obj, Mapping):
            raise bad("not a JSON object")
        kind = obj.get("kind")
        if kind not in ("fixed", "adaptive"):
            raise bad(f"kind {kind!r}")
        steps = obj.get("steps")
        if not isinstance(steps, list) or len(steps) > _MAX_PLAN_STEPS:
            raise bad("steps must be a list of at most %d iterations" % _MAX_PLAN_STEPS)
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps):
            raise bad("steps must be integers >= 0")
        if any(b <= a for a, b in zip(steps, steps[1:])):
            raise bad("steps must strictly increase")
        interval = obj.get("interval")
        if interval is not None and (not isinstance(interval, int) or isinstance(interval, bool) or interval < 1):
            raise bad(f"interval {interval!r}")
        pc = obj.get("predicted_cil")
        if pc is not None and not _is_num(pc):
            raise bad("predicted_cil must be a number or null")
        thresh = obj.get("thresh")
        if thresh is not None and not _is_num(thresh):
            raise bad("thresh must be a number or null")
        note = obj.get("note", "")
        if not isinstance(note, str):
            raise bad("note must be a string")
        rng = [obj.get("s_iter"), obj.get("e_iter")]
        if any(v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0) for v in rng):
            raise bad("s_iter/e_iter must be integers >= 0 or null")
        cost = obj.get("cost")
        if cost is not None:
            keys = ("t_train", "t_infer", "t_p", "t_c")
            if not isinstance(cost, Mapping) or not all(_is_num(cost.get(k)) for k in keys):
                raise bad("cost must be a CostModel's JSON or null")
            try:
                cost = CostModel(**{k: float(cost[k]) for k in keys})
            except ConfigError as e:
                raise bad(f"cost: {e}") from e
        curve = obj.get("curve")
        return cls(kind, tuple(steps), Curve.from_json(curve) if curve is not None else None,
                   float(pc) if pc is not None else math.nan, interval,
                   float(thresh) if thresh is not None else None, note, rng[0], rng[1], cost)


def make_plan(kind: str, losses_warmup: Sequence[float], s_iter: int, e_iter: int, cost: CostModel,
              total_infers: int, *, thresh: "float | str | None" = None, families: Sequence[str] = FAMILIES,
              max_interval: int | None = None, smooth: int | None = None) -> Plan:
    """The plan the producer follows after its warm-up (rank 0 calls this; others get the JSON).

    ``losses_warmup``: the per-batch losses of the warm-up, the last one at global iteration
    ``s_iter`` (so x runs ``s_iter − len + 1 .. s_iter``); steps are planned in ``(s_iter, e_iter]``.
    ``"fixed"``: the optimal interval (Alg. 2); ``"adaptive"``: the greedy schedule (Alg. 3) with
    ``thresh`` (default :func:`warmup_threshold` of the warm-up losses smoothed over ``smooth``
    values, default :func:`smoothing_window`: the paper's rule in the smoothed curve's units;
    ``smooth=1`` is the rule as printed, on raw per-batch losses; ``"optimal"``:
    :func:`optimal_threshold`, the one minimising the predicted CIL). A flat or rising fitted
    curve, or none at all: adaptive plans nothing, fixed the largest interval (``note`` says
    why; :attr:`Plan.degenerate` says when a plan publishes nothing after the warm-up or at
    nearly every step). Raises only :class:`ConfigError` for invalid arguments, never for the data.
    """
    if kind not in ("fixed", "adaptive"):
        raise ConfigError(f"make_plan: kind must be 'fixed' or 'adaptive', got {kind!r}")
    if not isinstance(cost, CostModel):
        raise ConfigError(f"make_plan: cost must be a CostModel, got {type(cost).__name__}")
    _check_range(s_iter, e_iter, total_infers)
    if max_interval is not None and (not isinstance(max_interval, int) or max_interval < 1):
        raise ConfigError(f"max_interval must be an integer >= 1, got {max_interval!r}")
    if smooth is not None and (isinstance(smooth, bool) or not isinstance(smooth, (int, np.integer)) or smooth < 1):
        raise ConfigError(f"make_plan: smooth must be an integer >= 1 (values per smoothing window), got {smooth!r}")
    rng = (int(s_iter), int(e_iter), cost)
    y = np.asarray(list(losses_warmup), dtype=np.float64).ravel()
    x = np.arange(s_iter - y.size + 1, s_iter + 1, dtype=np.float64)
    notes: list[str] = []
    curve: Curve | None
    try:
        curve = fit_curve(x, y, families)
    except StreamError as e:
        curve = None
        notes.append(f"no learning curve ({e}); treated as flat")
    n_it = e_iter - s_iter
    if n_it == 0:
        notes.append("no iteration after the warm-up (e_iter == s_iter): nothing to schedule")
    flat = (curve is None or not curve.decreasing(s_iter, e_iter)) if n_it > 0 else True
    if curve is not None and flat and n_it > 0:
        notes.append(f"the fitted {curve.family} curve does not decrease after the warm-up "
                     f"({curve(s_iter):.6g} at {s_iter}, {curve(e_iter):.6g} at {e_iter})")

    def cil(steps: Sequence[int]) -> float:
        return predicted_cil(curve, cost, steps, s_iter, e_iter, total_infers) if curve is not None else math.nan

    if kind == "fixed":
        if n_it == 0:
            return Plan("fixed", (), curve, cil([]), None, None, "; ".join(notes), *rng)
        if flat:
            interval = n_it if max_interval is None else min(n_it, max_interval)
            notes.append(f"fixed takes the largest interval ({interval})")
        else:
            interval, _ = optimal_interval(curve, cost, s_iter, e_iter, total_infers, max_interval)
        steps = _fixed_steps(interval, cost, s_iter, e_iter, total_infers)
        return Plan("fixed", tuple(steps), curve, cil(steps), interval, None, "; ".join(notes), *rng)
    th = thresh
    if th is None:
        try:
            th = warmup_threshold(y, smooth)
        except StreamError as e:
            notes.append(str(e))
            th = None
    elif th == "optimal":
        th = None
        if curve is not None and not flat and n_it > 0:
            th, _ = optimal_threshold(curve, cost, s_iter, e_iter, total_infers)
            if not math.isfinite(th):
                notes.append("the CIL-minimising threshold publishes nothing after the warm-up")
                th = None
    elif not _is_num(th) or not math.isfinite(th) or th < 0:
        raise ConfigError(f"make_plan: thresh must be a finite number >= 0 or 'optimal', got {th!r}")
    if n_it == 0 or flat or th is None:
        if flat and n_it > 0:
            notes.append("adaptive publishes nothing after the warm-up")
        return Plan("adaptive", (), curve, cil([]), None, th, "; ".join(notes), *rng)
    steps = adaptive_schedule(curve, cost, s_iter, e_iter, total_infers, float(th))
    return Plan("adaptive", tuple(steps), curve, cil(steps), None, float(th), "; ".join(notes), *rng)


def producer_plan(kind: str, channel: str, losses_warmup: Sequence[float], *, rank: int,
                  broadcast: Callable[[bytes], bytes], s_iter: int, t_train: float, t_p: float, nbytes: int,
                  horizon_s: float, inference_interval_s: float, consumer_load_s: float | None = None,
                  total_steps: int | None = None, verbose: int = 0, fallback: str = "") -> Plan | None:
    """The plan a producer of ``channel`` follows after its warm-up, the same on every rank (what
    both adapters' publishers do at the end of the warm-up; collective).

    Rank 0 makes it (:func:`make_plan`, with ``t_c = consumer_load_s``, default ``nbytes`` at
    1 GB/s, and steps planned in ``(s_iter, e_iter]`` with ``e_iter = s_iter +
    horizon_s / t_train``, capped at ``total_steps``); ``broadcast(bytes)`` returns rank 0's
    bytes on every rank (its JSON). Logged once, on rank 0: the summary (a warning with
    ``verbose``, else info), then a plan that does not do its job (:attr:`Plan.degenerate`) or
    the plan's ``note`` as a warning. Returns None on every rank when rank 0 could not make one
    (a warning: "publishing ``fallback`` from now on")."""
    t_c = float(consumer_load_s) if consumer_load_s is not None else max(nbytes / 1e9, 1e-5)
    e_iter = s_iter + max(1, int(horizon_s / t_train))
    if total_steps is not None:
        e_iter = min(e_iter, total_steps)
    data = b""
    if rank == 0:
        try:
            cost = CostModel(t_train=t_train, t_infer=inference_interval_s, t_p=t_p, t_c=t_c)
            total = max(1, int(horizon_s / inference_interval_s))
            plan = make_plan(kind, losses_warmup, s_iter, max(e_iter, s_iter + 1), cost, total)
            data = json.dumps(plan.to_json()).encode()
        except (DeepFreezeError, ValueError) as e:
            log.warning("DeepFreeze: the %s publish plan of %r could not be made (%s): publishing %s from now on",
                        kind, channel, e, fallback)
    data = broadcast(data)
    if not data:
        return None
    plan = Plan.from_json(json.loads(data))
    if rank == 0:
        (log.warning if verbose else log.info)("DeepFreeze: channel %r: %s", channel, plan.summary())
        if plan.degenerate:
            log.warning("DeepFreeze: the %s publish plan of channel %r does not do its job: %s", kind, channel,
                        plan.degenerate)
        elif plan.note:
            log.warning("DeepFreeze: the %s publish plan of channel %r: %s", kind, channel, plan.note)
    return plan
