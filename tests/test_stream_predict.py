"""deepfreeze.stream.predict: learning-curve fits, the CIL model (Eq. 1-2, Alg. 1-3 fixed), plans.

Framework-neutral: runs under the project venv and the system python3 (numpy 2, scipy 1.17).
"""
import json
import math

import numpy as np
import pytest

from deepfreeze.errors import ConfigError, StreamError
from deepfreeze.stream import predict as P
from deepfreeze.stream.predict import (FAMILIES, CostModel, Curve, Plan, adaptive_schedule, cil_fixed, fit_curve,
                                       fixed_interval_cils, iteration_at, make_plan, optimal_interval,
                                       per_batch_losses, predicted_cil, realized_cil, simulate_eq2,
                                       smooth_losses, smoothing_window, warmup_threshold)

# dyadic costs: every time below is exact in binary floating point, so request/delivery
# coincidences really happen and both implementations must agree on them exactly
DYADIC = CostModel(t_train=1 / 64, t_infer=1 / 256, t_p=3 / 512, t_c=5 / 512)


def _exp3(x, a=2.0, b=0.004, c=0.5):
    return a * np.exp(-b * x) + c


# ----------------------------------------------------------------------------- per-batch losses

def test_per_batch_losses_inverts_the_running_mean():
    rng = np.random.default_rng(1)
    losses = rng.uniform(0.1, 3.0, 300)
    running = np.cumsum(losses) / np.arange(1, 301)          # what Keras reports at each batch end
    got = per_batch_losses(running)
    np.testing.assert_allclose(got, losses, rtol=1e-11, atol=0)
    # Keras keeps the mean in float32: still close (relative error grows like k * 1e-7)
    got32 = per_batch_losses(running.astype(np.float32))
    np.testing.assert_allclose(got32, losses, rtol=0, atol=300 * 3e-7 * 3)
    assert per_batch_losses([]).size == 0
    assert per_batch_losses([1.5]).tolist() == [1.5]


# ----------------------------------------------------------------------------- fits

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recovers_exp3_with_2pct_noise_and_picks_it(seed):
    rng = np.random.default_rng(seed)
    a, b, c = 2.0, 0.004, 0.5                                 # 1000 points cover 4/b > 3/b
    x = np.arange(1000, dtype=float)
    y = _exp3(x, a, b, c) * (1 + 0.02 * rng.standard_normal(x.size))
    cv = fit_curve(x, y)
    assert cv.family == "exp3"
    ga, gb, gc = cv.unscaled()
    for got, want in ((ga, a), (gb, b), (gc, c)):
        assert abs(got - want) <= 0.05 * want, (cv, got, want)
    assert cv(500.0) == pytest.approx(_exp3(500.0, a, b, c), rel=0.02)


def test_fit_with_offset_iterations():
    # the warm-up of a resumed run does not start at iteration 0: x is shifted before scaling
    rng = np.random.default_rng(3)
    x = np.arange(50_000, 51_000, dtype=float)
    y = _exp3(x - 50_000) * (1 + 0.02 * rng.standard_normal(x.size))
    cv = fit_curve(x, y)
    assert cv.family == "exp3" and cv.x_offset == 50_000
    _, gb, gc = cv.unscaled()
    assert gb == pytest.approx(0.004, rel=0.05) and gc == pytest.approx(0.5, rel=0.05)
    assert cv(50_700.0) == pytest.approx(_exp3(700.0), rel=0.02)


TRUTH = {
    "exp2": ((3.0, 0.003), lambda x: 3.0 * np.exp(-0.003 * x)),
    "exp3": ((2.0, 0.004, 0.5), lambda x: _exp3(x)),
    "lin2": ((-0.0007, 2.5), lambda x: -0.0007 * x + 2.5),
    "expd3": ((2.5, 0.005, 0.4), lambda x: 0.4 - (0.4 - 2.5) * np.exp(-0.005 * x)),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_recovered_from_its_own_data(family):
    rng = np.random.default_rng(7)
    want, fn = TRUTH[family]
    x = np.arange(1, 1001, dtype=float)
    y = fn(x) * (1 + 0.005 * rng.standard_normal(x.size))
    cv = fit_curve(x, y, families=(family,))
    assert cv.family == family
    for got, w in zip(cv.unscaled(), want):
        assert got == pytest.approx(w, rel=0.03), (family, cv.unscaled(), want)
    # noise-free: every family is picked on its own data; expd3 is exp3 reparameterised, so
    # they tie and exp3 (listed first) wins, with the same curve
    exact = fit_curve(x, fn(x))
    assert exact.family == ("exp3" if family == "expd3" else family)
    np.testing.assert_allclose(exact(x), fn(x), rtol=1e-6)


def test_tie_break_fewer_parameters_then_listed_order():
    x = np.arange(500, dtype=float)
    y2 = 3.0 * np.exp(-0.003 * x)                             # exp3 (c = 0) fits it exactly too
    assert fit_curve(x, y2).family == "exp2"
    assert fit_curve(x, y2, families=("exp3", "exp2")).family == "exp2"
    rng = np.random.default_rng(5)
    y3 = _exp3(x) * (1 + 0.02 * rng.standard_normal(x.size))
    a = fit_curve(x, y3)
    b = fit_curve(x, y3, families=("expd3", "exp3"))
    assert a.family == "exp3" and b.family == "expd3" and a.mse == b.mse
    np.testing.assert_allclose(a(x), b(x), rtol=1e-12)
    # the noisy exp3 data is not fitted as well by the 2-parameter families: no tie there
    assert fit_curve(x, y3, families=("exp2",)).mse > a.mse * 1.01


def test_failing_fits_are_handled():
    with pytest.raises(StreamError, match="finite"):
        fit_curve([1.0, 2.0, 3.0], [math.nan, math.inf, math.nan])
    with pytest.raises(StreamError, match="at least 2"):
        fit_curve([1.0], [2.0])
    # two points: only the 2-parameter families can be fitted; the 3-parameter ones are skipped
    assert fit_curve([1.0, 2.0], [2.0, 1.0], families=("exp3", "lin2")).family == "lin2"
    with pytest.raises(StreamError):
        fit_curve([1.0, 2.0], [2.0, 1.0], families=("exp3",))
    # NaN points in between are dropped, the rest is fitted
    x = np.arange(300, dtype=float)
    y = _exp3(x)
    y[::7] = np.nan
    cv = fit_curve(x, y)
    assert cv.family == "exp3" and cv.unscaled()[1] == pytest.approx(0.004, rel=1e-3)
    with pytest.raises(ConfigError, match="unknown curve family"):
        fit_curve(x, y, families=("exp4",))
    with pytest.raises(ConfigError, match="one loss per iteration"):
        fit_curve(x, y[:-1])


def test_constant_x_does_not_crash():
    cv = fit_curve([5.0] * 10, [1.0] * 10)
    assert cv(5.0) == pytest.approx(1.0)


# ----------------------------------------------------------------------------- cost model, Eq. 1

def test_cost_model_validation_and_measurements():
    c = CostModel.from_measurements(0.02, 0.001, 100e6, 5e9, 2e9)
    assert c.t_p == pytest.approx(0.02) and c.t_c == pytest.approx(0.05)
    for bad in ((0, 1, 0, 0), (1, 0, 0, 0), (1, 1, -1, 0), (1, 1, 0, math.nan), (1, 1, math.inf, 0), (1, 1, "1", 0)):
        with pytest.raises(ConfigError):
            CostModel(*bad)
    with pytest.raises(ConfigError, match="bandwidths"):
        CostModel.from_measurements(0.02, 0.001, 100e6, 0, 2e9)


def test_eq1_iteration_at_matches_the_producer_clock():
    cost = DYADIC
    for interval in (1, 3, 10):
        # step the producer: (end time of iteration n) for every n; a stall follows every interval-th
        t, ends = 0.0, []
        for n in range(1, 200):
            t += cost.t_train
            ends.append(t)
            if n % interval == 0:
                t += cost.t_p
        for q in np.arange(0, ends[-1], 1 / 512):
            done = sum(1 for e in ends if e <= q)
            assert iteration_at(float(q), cost, interval) == done, (interval, q)


# ----------------------------------------------------------------------------- CIL: Alg. 1/2 vs Eq. 2

@pytest.mark.parametrize("total_infers", [700, 20_000, 0, 1])
def test_vectorised_alg2_equals_step_by_step_eq2_for_every_interval(total_infers):
    # 700 requests end mid-training; 20 000 outlast it (the last version serves the rest)
    cv = Curve("exp3", (2.0, 3.0, 0.5), 0.0, 200.0, 40.0)
    s, e = 50, 230
    cils = fixed_interval_cils(cv, DYADIC, s, e, total_infers)
    assert cils.shape == (e - s,)
    for i in range(1, e - s + 1):
        sim = simulate_eq2(cv, DYADIC, s, e, i, total_infers)
        assert cils[i - 1] == pytest.approx(sim, rel=1e-12, abs=1e-12), i
        assert cil_fixed(cv, DYADIC, s, e, i, total_infers) == pytest.approx(sim, rel=1e-12, abs=1e-12), i
        steps = list(range(s + i, e + 1, i))
        assert predicted_cil(cv, DYADIC, steps, s, e, total_infers) == pytest.approx(sim, rel=1e-12, abs=1e-12)
    best, val = optimal_interval(cv, DYADIC, s, e, total_infers)
    assert val == pytest.approx(float(np.min(cils)), rel=1e-9)


def test_vectorised_alg2_equals_simulation_with_random_costs():
    rng = np.random.default_rng(11)
    cv = Curve("expd3", (2.5, 4.0, 0.4), 0.0, 300.0, 0.0)
    for _ in range(3):
        cost = CostModel(*rng.uniform(0.001, 0.02, 2), *rng.uniform(0.0, 0.02, 2))
        cils = fixed_interval_cils(cv, cost, 100, 260, 3000)
        for i in range(1, 161):
            assert cils[i - 1] == pytest.approx(simulate_eq2(cv, cost, 100, 260, i, 3000), rel=1e-9), (cost, i)


def test_max_interval_caps_the_search():
    cv = Curve("exp3", (2.0, 3.0, 0.5), 0.0, 200.0, 0.0)
    full = fixed_interval_cils(cv, DYADIC, 10, 400, 5000)
    capped = fixed_interval_cils(cv, DYADIC, 10, 400, 5000, max_interval=25)
    np.testing.assert_allclose(capped, full[:25], rtol=1e-12)
    assert optimal_interval(cv, DYADIC, 10, 400, 5000, max_interval=25)[0] <= 25
    with pytest.raises(ConfigError):
        fixed_interval_cils(cv, DYADIC, 10, 10, 5000)


def test_realized_cil_on_curve_samples_equals_predicted():
    cv = Curve("exp3", (2.0, 3.0, 0.5), 0.0, 200.0, 0.0)
    losses = cv(np.arange(0, 401, dtype=float))
    for sched in ([], [15, 16, 40, 200, 399], list(range(20, 401, 7))):
        assert realized_cil(losses, DYADIC, sched, 10, 6000) == pytest.approx(
            predicted_cil(cv, DYADIC, sched, 10, 400, 6000), rel=1e-12)
    with pytest.raises(ConfigError, match="losses cover"):
        realized_cil(losses[:100], DYADIC, [150], 10, 6000)
    with pytest.raises(ConfigError, match="strictly increase"):
        realized_cil(losses, DYADIC, [30, 30], 10, 6000)
    # the warm-up version alone serves everything
    assert realized_cil(losses, DYADIC, [], 10, 6000) == pytest.approx(losses[10] * 6000)


# ----------------------------------------------------------------------------- schedules

def test_adaptive_is_dense_early_and_sparse_late():
    cv = Curve("exp3", (2.0, 4.0, 0.5), 0.0, 1000.0, 0.0)
    cost = CostModel(0.01, 0.002, 0.001, 0.002)
    sched = adaptive_schedule(cv, cost, 100, 1000, 100_000, thresh=0.02)
    assert len(sched) >= 10 and all(100 < s <= 1000 for s in sched)
    gaps = np.diff([100] + sched)
    assert gaps[:3].mean() * 3 < gaps[-3:].mean(), gaps
    assert np.all(np.diff(gaps) >= -1), gaps                 # non-decreasing up to integer rounding
    drops = -np.diff(cv(np.array([100] + sched, dtype=float)))
    assert np.all(drops > 0.02)
    # a publish is made at the FIRST iteration whose cumulative predicted drop exceeds thresh
    assert cv(float(sched[0] - 1)) >= cv(100.0) - 0.02
    # thresh 0: every iteration on a strictly decreasing curve
    assert adaptive_schedule(cv, cost, 100, 150, 100_000, thresh=0.0) == list(range(101, 151))


def _reference_greedy(curve, s, e, thresh):
    """Alg. 3 as printed, with i advancing every iteration (no request limit)."""
    sched, p_l, i = [], curve(float(s)), s + 1
    while i <= e:
        c_l = curve(float(i))
        if c_l < p_l and abs(c_l - p_l) > thresh:
            p_l = c_l
            sched.append(i)
        i += 1
    return sched


@pytest.mark.parametrize("thresh", [0.0, 1e-4, 0.003, 0.05, 0.7, 5.0])
def test_adaptive_equals_the_printed_greedy_loop(thresh):
    cv = Curve("exp3", (2.0, 6.0, 0.5), 0.0, 3000.0, 0.0)
    assert adaptive_schedule(cv, DYADIC, 10, 3000, 10**9, thresh) == _reference_greedy(cv, 10, 3000, thresh)


def test_optimal_threshold_beats_or_ties_every_other():
    cv = Curve("exp3", (2.0, 4.0, 0.5), 0.0, 1000.0, 0.0)
    cost = CostModel(0.01, 0.002, 0.004, 0.003)
    th, val = P.optimal_threshold(cv, cost, 100, 1000, 4500)
    assert val == pytest.approx(predicted_cil(cv, cost, adaptive_schedule(cv, cost, 100, 1000, 4500, th),
                                              100, 1000, 4500))
    for other in (0.0, 0.001, 0.01, 0.05, 0.2, 1.0):
        steps = adaptive_schedule(cv, cost, 100, 1000, 4500, other)
        assert val <= predicted_cil(cv, cost, steps, 100, 1000, 4500) * (1 + 1e-9)
    warm = cv(np.arange(0, 101, dtype=float))
    plan = make_plan("adaptive", warm, 100, 1000, cost, 4500, thresh="optimal")
    assert plan.thresh == pytest.approx(th) and plan.predicted_cil == pytest.approx(val)
    flat = Curve("lin2", (0.0, 1.0), 0.0, 1.0, 0.0)
    assert P.optimal_threshold(flat, cost, 100, 1000, 4500)[0] == math.inf


def test_schedules_drop_publishes_that_serve_no_request():
    cv = Curve("exp3", (2.0, 4.0, 0.5), 0.0, 1000.0, 0.0)
    cost = CostModel(0.01, 0.01, 0.0, 0.0)                   # one request per iteration
    sched = adaptive_schedule(cv, cost, 100, 1000, 50, thresh=0.0)
    assert sched == list(range(101, 150))                     # request 49 is issued at 0.49 s: iteration 149
    plan = make_plan("fixed", cv(np.arange(0, 101, dtype=float)), 100, 1000, cost, 50)
    assert plan.steps and plan.steps[-1] < 150
    assert make_plan("adaptive", cv(np.arange(0, 101, dtype=float)), 100, 1000, cost, 0).steps == ()


def test_flat_and_rising_curves_give_defined_plans():
    rng = np.random.default_rng(2)
    s, e = 200, 1200
    flat = 1.0 + 0.01 * rng.standard_normal(s + 1)
    rising = np.linspace(1.0, 1.5, s + 1) + 0.01 * rng.standard_normal(s + 1)
    cost = CostModel(0.01, 0.002, 0.003, 0.004)
    for losses in (flat, rising):
        a = make_plan("adaptive", losses, s, e, cost, 6000)   # requests until 12 s, training until ~10 s
        f = make_plan("fixed", losses, s, e, cost, 6000)
        if a.curve is not None and a.curve.decreasing(s, e):   # a noisy flat fit may tilt down a little
            assert len(a.steps) <= 2
        else:
            assert a.steps == () and "does not decrease" in a.note
            assert f.interval == e - s and f.steps == (e,) and "largest interval" in f.note
            assert make_plan("fixed", losses, s, e, cost, 5000).steps == ()   # (e,) would be live after 10 s
        assert math.isfinite(a.predicted_cil) and math.isfinite(f.predicted_cil)
    # an exactly flat curve: every interval ties, the largest one wins (not a publish per iteration)
    cv = Curve("lin2", (0.0, 1.0), 0.0, 1.0, 0.0)
    assert optimal_interval(cv, cost, s, e, 5000) == (e - s, pytest.approx(5000.0))
    # a rising one gives a defined answer too
    up = Curve("lin2", (0.001, 1.0), 0.0, 1.0, 0.0)
    i, v = optimal_interval(up, cost, s, e, 5000)
    assert 1 <= i <= e - s and math.isfinite(v)


def test_make_plan_without_a_curve_and_degenerate_ranges():
    cost = CostModel(0.01, 0.002, 0.003, 0.004)
    nan = [math.nan] * 50
    a = make_plan("adaptive", nan, 49, 500, cost, 3000)   # requests until 6 s, training until ~4.5 s
    f = make_plan("fixed", nan, 49, 500, cost, 3000)
    assert a.curve is None and a.steps == () and "no learning curve" in a.note and math.isnan(a.predicted_cil)
    assert f.curve is None and f.interval == 451 and f.steps == (500,)
    assert make_plan("fixed", [], 0, 100, cost, 1000).curve is None
    z = make_plan("fixed", _exp3(np.arange(101.0)), 100, 100, cost, 1000)
    assert z.steps == () and z.interval is None
    with pytest.raises(ConfigError, match="kind"):
        make_plan("weekly", nan, 49, 500, cost, 1000)
    with pytest.raises(ConfigError, match="e_iter"):
        make_plan("fixed", nan, 49, 10, cost, 1000)
    with pytest.raises(ConfigError, match="thresh"):
        make_plan("adaptive", _exp3(np.arange(50.0)), 49, 500, cost, 1000, thresh=-1.0)


def test_make_plan_on_a_decreasing_warmup():
    rng = np.random.default_rng(4)
    s, e = 216, 216 * 8
    x = np.arange(1, s + 1, dtype=float)
    warm = _exp3(x, 2.0, 0.003, 0.4) * (1 + 0.02 * rng.standard_normal(s))
    cost = CostModel(0.02, 0.002, 0.004, 0.006)
    total = int((e - s) * cost.t_train / cost.t_infer)
    f = make_plan("fixed", warm, s, e, cost, total)
    a = make_plan("adaptive", warm, s, e, cost, total)
    assert f.note == "" and a.note == ""
    assert f.interval >= 1 and list(f.steps) == list(range(s + f.interval, e + 1, f.interval))[:len(f.steps)]
    assert f.predicted_cil == pytest.approx(predicted_cil(f.curve, cost, f.steps, s, e, total))
    assert a.thresh == pytest.approx(warmup_threshold(warm))
    assert a.steps and all(s < v <= e for v in a.steps)
    assert a.predicted_cil == pytest.approx(predicted_cil(a.curve, cost, a.steps, s, e, total))
    # the epoch boundary schedule, predicted: never better than the optimal fixed interval
    epoch = list(range(s + 216, e + 1, 216))
    assert predicted_cil(f.curve, cost, epoch, s, e, total) >= f.predicted_cil * (1 - 1e-12)


def test_warmup_threshold():
    assert warmup_threshold([1.0, 3.0, 2.0, 2.0]) == pytest.approx(np.mean([2, 1, 0]) + np.std([2, 1, 0]))
    assert warmup_threshold([1.0, math.nan, 2.0]) == pytest.approx(1.0)
    with pytest.raises(StreamError, match="at least 2"):
        warmup_threshold([1.0])


# ----------------------------------------------------------------------------- plan JSON

def test_plan_json_round_trip_and_hostile_plans():
    cost = CostModel(0.02, 0.002, 0.004, 0.006)
    warm = _exp3(np.arange(1, 217, dtype=float), 2.0, 0.003, 0.4)
    for kind in ("fixed", "adaptive"):
        plan = make_plan(kind, warm, 216, 1000, cost, 5000)
        back = Plan.from_json(json.loads(json.dumps(plan.to_json(), allow_nan=False)))
        assert back == plan
    nanplan = make_plan("adaptive", [math.nan], 0, 10, cost, 10)
    assert Plan.from_json(json.loads(json.dumps(nanplan.to_json(), allow_nan=False))).curve is None
    good = plan.to_json()
    hostile = [
        [],
        {**good, "kind": "epoch"},
        {**good, "steps": [5, 5]},
        {**good, "steps": [True]},
        {**good, "steps": [-1]},
        {**good, "steps": "1,2"},
        {**good, "interval": 0},
        {**good, "predicted_cil": "low"},
        {**good, "note": 3},
        {**good, "curve": {"family": "exp9", "params": [1, 2], "mse": 0, "x_scale": 1}},
        {**good, "curve": {"family": "exp3", "params": [1, 2], "mse": 0, "x_scale": 1}},
        {**good, "curve": {"family": "exp3", "params": [1, 2, 3], "mse": 0, "x_scale": 0}},
        {**good, "curve": {"family": "exp3", "params": [1, "2", 3], "mse": 0, "x_scale": 1}},
        {**good, "curve": "exp3"},
        {**good, "s_iter": -1},
        {**good, "e_iter": "9"},
        {**good, "cost": {"t_train": 0, "t_infer": 1, "t_p": 0, "t_c": 0}},
        {**good, "cost": {"t_train": 1}},
    ]
    for obj in hostile:
        with pytest.raises(StreamError, match="malformed"):
            Plan.from_json(obj)


# ----------------------------------------------------------------------------- smoothing, degenerate plans

def test_smoothing_keeps_a_trend_and_shrinks_noise():
    line = 3.0 - 0.01 * np.arange(200.0)
    sm = smooth_losses(line, 21)
    assert sm.size == 180 and np.allclose(np.diff(sm), -0.01)            # a linear trend passes unchanged
    assert np.allclose(sm, line[10:190])                                   # centred: value at the window's middle
    noise = np.random.default_rng(0).standard_normal(20000)
    for w in (1, 9, 49):                                                    # sd σ/√w; consecutive |Δ|: σ·√2/w
        s = smooth_losses(noise, w)
        assert np.std(s) == pytest.approx(1 / math.sqrt(w), rel=0.1)
        assert np.std(np.diff(s)) == pytest.approx(math.sqrt(2 / (w * w)) if w > 1 else math.sqrt(2), rel=0.1)
    assert smooth_losses([1.0, math.nan, 3.0, math.inf, 5.0], 1).tolist() == [1.0, 3.0, 5.0]  # non-finite dropped
    assert smooth_losses([1.0, 2.0], 5).tolist() == [1.5]                 # a window longer than the data: one mean
    assert [smoothing_window(n) for n in (0, 7, 8, 216)] == [1, 1, 3, 55]
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match="window"):
            smooth_losses([1.0, 2.0, 3.0], bad)


def test_smoothed_threshold_is_in_the_curve_units_and_the_raw_one_is_noise():
    """Per-batch noise (sd 0.3, as TC1-like training at batch 20) on an exp3 warm-up: the printed rule
    (window 1) gives a threshold of the noise's size, larger than the curve's whole later drop, so
    adaptive publishes nothing; the smoothed threshold is within a small factor of the curve's own
    per-step drop statistic, and adaptive then publishes, densely early and sparsely late."""
    rng = np.random.default_rng(3)
    s, e = 216, 216 * 8
    x = np.arange(1, s + 1, dtype=float)
    warm = _exp3(x, 1.5, 0.008, 1.2) + 0.3 * rng.standard_normal(s)
    d = np.abs(np.diff(_exp3(x, 1.5, 0.008, 1.2)))
    truth = d.mean() + d.std()                                  # the noiseless curve's rule
    raw, smoothed = warmup_threshold(warm, 1), warmup_threshold(warm)
    later_drop = _exp3(s, 1.5, 0.008, 1.2) - _exp3(e, 1.5, 0.008, 1.2)
    assert raw > later_drop > smoothed
    assert truth / 3 < smoothed < 3 * truth
    cost = CostModel(0.02, 0.002, 0.0004, 0.0006)
    total = int((e - s) * cost.t_train / cost.t_infer)
    paper = make_plan("adaptive", warm, s, e, cost, total, smooth=1)
    plan = make_plan("adaptive", warm, s, e, cost, total)
    assert paper.steps == () and "no publish after the warm-up" in paper.degenerate
    assert plan.thresh == pytest.approx(smoothed) and len(plan.steps) >= 3 and plan.degenerate == ""
    gaps = np.diff([s, *plan.steps])
    assert gaps[0] < gaps[-1]                                   # dense early, sparse late
    with pytest.raises(ConfigError, match="smooth"):
        make_plan("adaptive", warm, s, e, cost, total, smooth=0)


def test_degenerate_plans_say_why():
    s, e = 216, 1000
    warm = _exp3(np.arange(1, s + 1, dtype=float), 2.0, 0.003, 0.4)
    cheap = CostModel(0.02, 0.002, 1e-9, 1e-9)
    total = int((e - s) * cheap.t_train / cheap.t_infer)
    every = make_plan("fixed", warm, s, e, cheap, total)    # publishing is free to the model: every step
    assert every.interval == 1
    why = every.degenerate
    assert f"a publish at {len(every.steps)} of the {e - s} steps" in why and "t_p = 1e-09 s" in why
    flat = make_plan("adaptive", np.full(s, 0.7), s, e, cheap, total)
    assert flat.steps == () and "no publish after the warm-up" in flat.degenerate
    assert "does not decrease" in flat.degenerate
    high = make_plan("adaptive", warm, s, e, cheap, total, thresh=10.0)  # a threshold above the whole drop
    assert high.steps == () and "less than the threshold 10" in high.degenerate
    good = make_plan("fixed", warm, s, e, CostModel(0.02, 0.002, 0.004, 0.006), total)
    assert good.degenerate == "" and 1 < good.interval < e - s
    # the one-line summary every plan is logged with
    line = good.summary()
    assert line.startswith(f"fixed plan: {len(good.steps)} publishes expected in steps ({s}, {e}]")
    assert f"interval {good.interval}" in line and "curve" in line and "predicted CIL" in line
    a = make_plan("adaptive", warm, s, e, CostModel(0.02, 0.002, 0.004, 0.006), total)
    assert "intervals " in a.summary() and "threshold " in a.summary()
    # a plan without its range (an older JSON) is never called degenerate
    assert Plan("fixed", (), None, math.nan, None).degenerate == ""
    # round trip keeps what degenerate needs
    back = Plan.from_json(json.loads(json.dumps(every.to_json())))
    assert back == every and back.degenerate == why


def test_module_imports_no_tensorflow():
    import subprocess
    import sys
    code = "import sys, deepfreeze.stream.predict; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert set(P.__all__) <= set(dir(P))
