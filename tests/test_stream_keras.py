"""PublishCallback -> ModelSubscriber with real Horovod producers and consumer processes.

References are recorded in the run: the producer's rank 0 saves its weights right after every
published (and checkpointed) step; each consumer saves the live weights after every swap and
checks every prediction against the output recomputed from the recorded weights."""
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from _util import WORKERS, mpirun

pytestmark = pytest.mark.mpi
TOKEN = "e" * 64


@pytest.fixture
def out(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPFREEZE_TOKEN", TOKEN)
    shm = f"/dev/shm/dftest-{uuid.uuid4().hex[:8]}"
    os.makedirs(shm)
    yield tmp_path, shm
    shutil.rmtree(shm, ignore_errors=True)


def consumer(tmp_path, **opts):
    args = [f"{k}={v}" for k, v in opts.items()]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(sys.path))
    log = open(tmp_path / f"consumer-{opts.get('tag', 'c0')}.log", "w")
    return subprocess.Popen([sys.executable, os.path.join(WORKERS, "stream_consumer.py"), str(tmp_path), *args],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


def producer(tmp_path, shm, np_=2, check=True, **opts):
    args = [f"{k}={v}" for k, v in dict(opts, shm_dir=shm).items()]
    return mpirun(np_, os.path.join(WORKERS, "stream_producer.py"), str(tmp_path), *args, timeout=300, check=check,
                  env={"DEEPFREEZE_TOKEN": TOKEN})


def finish(proc, tmp_path, tag="c0", timeout=240):
    try:
        proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = open(tmp_path / f"consumer-{tag}.log").read()
    assert proc.returncode == 0, log[-4000:]
    with open(tmp_path / tag / "consumer.json") as f:
        return json.load(f)


def load(path):
    with np.load(path) as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


def same(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
                                    for x, y in zip(a, b))


def check_consumer(tmp_path, report, tag="c0"):
    """Every swapped-in version equals the producer's weights at that step; every prediction ran on
    exactly one version (its output equals that version's recomputed output)."""
    got = sorted(glob.glob(str(tmp_path / tag / "got" / "v*.npz")))
    assert got
    for g in got:
        ref = tmp_path / "expected" / os.path.basename(g)
        assert ref.exists(), f"{g}: the consumer has a version the producer never published"
        assert same(load(g), load(ref)), f"{g} differs from the producer's weights at that step"
    assert report["error"] is None
    for key, digests in report["outputs"].items():
        assert digests == [report["refs"][key]], f"predictions on version {key} do not all equal its output"
    return len(got)


def test_published_versions_are_bit_exact_and_no_prediction_mixes_versions(out):
    """2 producer ranks publish every step (64 versions) while a checkpoint callback on the same
    name checkpoints every 4 steps in the same fit; a consumer predicts in a loop through the swaps."""
    tmp_path, shm = out
    c = consumer(tmp_path, until=64, seconds=200)
    producer(tmp_path, shm, schedule=1, ckpt=4, samples=512, sleep=0.12, hold=3)
    report = finish(c, tmp_path)
    swaps = check_consumer(tmp_path, report)
    assert swaps >= 50, f"only {swaps} swaps"
    assert report["live"] == [0, 64]
    assert sum(1 for k, n in report["counts"].items() if n > 0) >= 10  # requests ran on many versions
    reps = [json.load(open(tmp_path / f"producer{r}.json")) for r in range(2)]
    # every rank, the same steps (not step 1: it precedes the Horovod broadcast of the weights)
    assert reps[0]["published"] == reps[1]["published"] == list(range(2, 65))
    # the checkpoint callback's versions: never skipped, each equal to the weights at its step
    from deepfreeze.loader import list_versions, load as df_load
    cfg = dict(mode="async", scratch=str(tmp_path / "node0" / "scratch"), persistent=str(tmp_path / "persistent"))
    from deepfreeze.config import Config
    config = Config(**cfg)
    versions = list_versions(config, "chan")
    for v in range(4, 65, 4):
        assert v in versions, f"checkpoint v{v} missing: {sorted(versions)}"
        ck = df_load(config, "chan", v)
        assert same(list(ck.model_arrays().values()), load(tmp_path / "expected_ckpt" / f"v{v}.npz"))


def test_tcp_tier_each_rank_sends_its_own_shard(out):
    tmp_path, shm = out
    c = consumer(tmp_path, until=24, seconds=200, tier="tcp")
    producer(tmp_path, shm, schedule=3, sleep=0.1, hold=3, epochs=2)
    report = finish(c, tmp_path)
    n = check_consumer(tmp_path, report)
    assert {u["tier"] for u in report["updates"]} == {"tcp"}
    reps = [json.load(open(tmp_path / f"producer{r}.json")) for r in range(2)]
    for rep in reps:  # no funnel: each rank sent its own model prefix once per version fetched
        assert rep["bytes_sent"] == rep["prefix"] * len(report["updates"]), rep
    assert n == len(report["updates"])


def test_restarted_consumer_catches_up_and_follows_a_new_generation(out):
    """A consumer killed mid-stream; a new one started after the producer's last publish gets the
    newest version at once; a producer that overwrites the channel (new generation, steps from 1)
    is followed; a second job on the name while the first runs is refused."""
    tmp_path, shm = out
    c1 = consumer(tmp_path, tag="c1", seconds=300)
    # the waits are bounded by the producer's progress, not by a wall clock a loaded machine outruns
    # (the producer's mpirun bound elsewhere: 300 s); it serves until the test is done with it
    # (hold_until, at most 300 s), however long the refused second job and c2 take to start
    deadline = time.monotonic() + 300
    release = tmp_path / "release-producer"
    p = subprocess.Popen(["mpirun", "--oversubscribe", "--allow-run-as-root", "-np", "2", "-x", "DEEPFREEZE_TOKEN",
                          sys.executable, os.path.join(WORKERS, "stream_producer.py"), str(tmp_path), "schedule=2",
                          "sleep=0.1", "hold=300", f"hold_until={release}", f"shm_dir={shm}"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", DEEPFREEZE_TOKEN=TOKEN))
    try:
        while not glob.glob(str(tmp_path / "c1" / "got" / "v*.npz")) and time.monotonic() < deadline \
                and p.poll() is None and c1.poll() is None:
            time.sleep(0.2)
        c1.send_signal(signal.SIGKILL)
        c1.wait()
        while not (tmp_path / "producer0.json").exists() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.2)
        assert (tmp_path / "producer0.json").exists(), "the producer did not finish"
        last = json.load(open(tmp_path / "producer0.json"))["published"][-1]
        # a second job on the same name while the first holds it: refused, naming the holder
        other = tmp_path / "other"
        other.mkdir()
        os.symlink(tmp_path / "persistent", other / "persistent")
        r = producer(other, shm, np_=1, check=False, schedule=2, epochs=1)
        assert r.returncode != 0 and "LeaseHeldError" in r.stderr + r.stdout, (r.stdout + r.stderr)[-3000:]
        # c2 runs until the test stops it (its file "stop"), after the second job below
        c2 = consumer(tmp_path, tag="c2", seconds=600, until=10 ** 6, first_timeout=180)
        t0 = time.monotonic()
        while not glob.glob(str(tmp_path / "c2" / "got" / "v*.npz")) and time.monotonic() - t0 < 180 \
                and c2.poll() is None:
            time.sleep(0.2)
        got = sorted(glob.glob(str(tmp_path / "c2" / "got" / "v*.npz")))
        assert got, open(tmp_path / "consumer-c2.log").read()[-3000:]
        assert os.path.basename(got[0]) == f"v{last}.npz"
    finally:
        release.touch()  # the producer closes now
        out_p, _ = p.communicate(timeout=200)
    assert p.returncode == 0, out_p[-4000:]
    # the channel overwritten by a new job: generation 1, steps restart; the running consumer follows
    os.rename(tmp_path / "expected", tmp_path / "expected_g0")
    os.remove(tmp_path / "producer0.json")
    producer(tmp_path, shm, schedule=5, sleep=0.05, hold=4, overwrite=1, epochs=1)
    (tmp_path / "c2" / "stop").touch()
    report = finish(c2, tmp_path, tag="c2")
    assert report["live"][0] == 1 and report["live"][1] == 15
    for key, digests in report["outputs"].items():
        g, s = map(int, key.split(":"))
        ref_dir = "expected" if g == 1 else "expected_g0"
        assert (tmp_path / ref_dir / f"v{s}.npz").exists()
    gens = [u["version"][0] for u in report["updates"]]
    assert gens[0] == 0 and gens[-1] == 1 and gens == sorted(gens)


def test_producer_killed_mid_publish_leaves_the_last_complete_version_live(out):
    tmp_path, shm = out
    # the consumer serves until the test stops it: 10 s after the producer is dead and the consumer
    # has swapped in the last complete version (12, or 14 once committed; the 10 s: what the torn v14
    # and the committed checkpoints may still bring it), not a fixed 25 s from its first version,
    # which a loaded machine's producer could outlast
    c = consumer(tmp_path, seconds=600, ref_wait=0)
    r = producer(tmp_path, shm, check=False, schedule=2, sleep=0.1, die_at=14, epochs=2)
    assert r.returncode != 0
    t0 = time.monotonic()
    while not [v for v in (12, 14) if (tmp_path / "c0" / "got" / f"v{v}.npz").exists()] \
            and time.monotonic() - t0 < 180 and c.poll() is None:
        time.sleep(0.2)
    time.sleep(10)
    (tmp_path / "c0" / "stop").touch()
    report = finish(c, tmp_path)
    # the consumer kept serving: its live version is the last one every rank completed (12) or, once
    # the producer is gone, the newest committed checkpoint (the node backends, which outlive the job,
    # may still commit 14 from both ranks' scratch shards); never a torn version
    assert report["live"] in ([0, 12], [0, 14]), report["live"]
    for g in glob.glob(str(tmp_path / "c0" / "got" / "v*.npz")):
        assert same(load(g), load(tmp_path / "expected" / os.path.basename(g)))
    assert report["error"] is None


@pytest.fixture(scope="module")
def planned(tmp_path_factory, module_runtime_dir):
    """The producers of both planned schedules, one after the other in one 2-rank mpirun
    (tests/workers/stream_producer.py: '+'-separated jobs), each with its own directory and its
    own /dev/shm directory: one TensorFlow and Horovod start-up for both."""
    root = tmp_path_factory.mktemp("planned")
    outs, shms, args = {}, [], []
    for schedule in ("fixed", "adaptive"):
        outs[schedule] = root / schedule
        outs[schedule].mkdir()
        shms.append(f"/dev/shm/dftest-{uuid.uuid4().hex[:8]}")
        os.makedirs(shms[-1])
        opts = dict(schedule=schedule, epochs=3, samples=320, horizon=3, interval=0.005, shm_dir=shms[-1])
        args += (["+"] if args else []) + [str(outs[schedule]), *[f"{k}={v}" for k, v in opts.items()]]
    try:
        p = mpirun(2, os.path.join(WORKERS, "stream_producer.py"), *args, timeout=600, check=False,
                   env={"DEEPFREEZE_TOKEN": TOKEN})
        yield outs, p
    finally:
        for shm in shms:
            shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.timeout(1200)  # the first of the two waits for both producers (:func:`planned`)
@pytest.mark.parametrize("schedule", ["fixed", "adaptive"])
def test_planned_schedules_publish_at_the_same_steps_on_every_rank(planned, schedule, monkeypatch):
    """Warm-up epoch, one publish at its end, then the plan rank 0 made from the all-reduced
    per-batch losses, broadcast: every rank publishes exactly the planned steps. The producers
    are the module's (:func:`planned`), this test reads its own."""
    monkeypatch.setenv("DEEPFREEZE_TOKEN", TOKEN)  # as the out fixture did
    outs, p = planned
    if p.returncode != 0:
        pytest.fail(f"{' '.join(p.args)} exited {p.returncode}\nstdout:\n{p.stdout[-4000:]}\n"
                    f"stderr:\n{p.stderr[-6000:]}")
    tmp_path = outs[schedule]
    reps = [json.load(open(tmp_path / f"producer{r}.json")) for r in range(2)]
    assert reps[0]["plan"] == reps[1]["plan"] and reps[0]["plan"] is not None
    plan = reps[0]["plan"]
    spe = reps[0]["steps_per_epoch"]
    assert spe == 20
    expected = [spe] + [s for s in plan["steps"] if s <= 3 * spe]
    assert reps[0]["published"] == reps[1]["published"] == expected
    assert all(spe < s <= 3 * spe for s in plan["steps"])
    if schedule == "fixed":
        assert len(plan["steps"]) >= 1 and plan["interval"] >= 1
    # the persistent copy: published versions only (dense ones may coalesce while the writer is
    # busy), each the weights at its step
    from deepfreeze.config import Config
    from deepfreeze.loader import list_versions, load as df_load
    config = Config(mode="async", scratch=str(tmp_path / "node0" / "scratch"), persistent=str(tmp_path / "persistent"))
    committed = sorted(list_versions(config, "chan"))
    assert committed and set(committed) <= set(expected) and spe in committed
    for v in (committed[0], committed[-1]):
        ck = df_load(config, "chan", v)
        assert same(list(ck.model_arrays().values()), load(tmp_path / "expected" / f"v{v}.npz"))


@pytest.mark.scratch_files("rank 1's writer is slowed in its scratch write (scratch_cls)")
def test_one_rank_with_a_slow_writer_never_leaves_the_checkpoint_stale(out):
    """Publish every step with a checkpoint every 8 steps on the same name, the scratch writer
    slowed on rank 1 only: the ranks share one skip decision per version (skip iff some rank's
    writer is busy), so every version is written by both ranks or by none: no half-written version
    directory, every committed version whole and equal to the weights at its step, and after
    wait() the newest published version is restorable."""
    tmp_path, shm = out
    producer(tmp_path, shm, schedule=1, ckpt=8, samples=496, slow_write=0.25, epochs=1)
    reps = [json.load(open(tmp_path / f"producer{r}.json")) for r in range(2)]
    published = reps[0]["published"]
    assert published == reps[1]["published"] == list(range(2, 32))  # the last one, 31, is no checkpoint's
    # one decision per version, the same on every rank: skipped iff some rank's writer was busy
    votes = [{v[0]: v[1] for v in rep["votes"]} for rep in reps]
    assert set(votes[0]) == set(votes[1]) == {s for s in published if s % 8}
    written = [set(rep["written"]) for rep in reps]
    assert written[0] == written[1], "the ranks wrote different versions"
    skipped = {s for s in votes[0] if s not in written[0]}
    for s in votes[0]:
        if s != published[-1]:  # a skipped newest version is written when fit ends (below)
            assert (s in skipped) == (votes[0][s] or votes[1][s]), (s, votes[0][s], votes[1][s])
    assert any(votes[1][s] and not votes[0][s] for s in skipped), "rank 1's busy writer never decided a skip"
    # the checkpoint's own versions always; the newest published one at the latest when fit ends
    assert written[0] >= {s for s in published if s % 8 == 0} | {published[-1]}
    # persistent: every version directory committed (none half-written), each equal to the weights then
    from deepfreeze.config import Config
    from deepfreeze.loader import list_versions, load as df_load
    config = Config(mode="async", scratch=str(tmp_path / "node0" / "scratch"), persistent=str(tmp_path / "persistent"))
    vdirs = sorted(glob.glob(str(tmp_path / "persistent" / "chan" / "v*")))
    half = [d for d in vdirs if not os.path.exists(os.path.join(d, "manifest.json"))]
    assert not half, f"half-written version directories: {half}"
    committed = sorted(list_versions(config, "chan"))
    assert committed and committed[-1] == published[-1], (committed, published[-1])
    for v in committed:
        ref = tmp_path / "expected" / f"v{v}.npz"
        assert same(list(df_load(config, "chan", v).model_arrays().values()), load(ref)), f"v{v} differs"
    # what the per-rank decision used to leave (one rank's done marker of a version the other rank
    # skipped), from an older run: `deepfreeze gc` removes it and keeps every committed version
    old = tmp_path / "persistent" / "chan" / "v000000000001"
    old.mkdir()
    (old / "decision").write_text(json.dumps({"decision": "flush", "nonce": "0" * 16, "run": "ab" * 8}))
    (old / ("done.r000000." + "0" * 16 + ".json")).write_text("{}")
    (old / ("model.dfz.partial." + "0" * 16)).write_bytes(b"x" * 100)
    p = subprocess.run([sys.executable, "-m", "deepfreeze.cli", "gc", "--name", "chan", "--set",
                        f"scratch={tmp_path / 'node0' / 'scratch'}", "--set", f"persistent={tmp_path / 'persistent'}"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert p.returncode == 0, p.stdout + p.stderr
    assert not old.exists() and "removed persistent v1" in p.stdout, p.stdout
    assert sorted(list_versions(config, "chan")) == committed


def test_a_misspelt_schedule_gets_a_did_you_mean(tmp_path):
    from deepfreeze.errors import ConfigError
    from deepfreeze.keras import PublishCallback
    kw = dict(scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"))
    for bad, hint in (("adaptve", "'adaptive'"), ("Fixed", "'fixed'"), ("epochs", "'epoch'")):
        with pytest.raises(ConfigError, match="Did you mean " + hint):
            PublishCallback("chan", schedule=bad, **kw)
    with pytest.raises(ConfigError) as e:
        PublishCallback("chan", schedule="sometimes", **kw)
    assert "Did you mean" not in str(e.value) and "'adaptive', 'fixed', 'epoch'" in str(e.value)


def test_subscriber_builds_an_unbuilt_model_from_a_spec_and_says_when_nobody_publishes(tmp_path):
    """build() returns a model without an Input layer: it is built from input_spec (the checkpoint
    callback's function) and serves a committed version bit-exact; on a channel nobody publishes,
    wait() says so, naming where it looked."""
    import tensorflow as tf
    from deepfreeze.config import Config
    from deepfreeze.engine import Engine
    from deepfreeze.errors import ConfigError, StreamTimeoutError
    from deepfreeze.fused import FusedLayout, FusedShard
    from deepfreeze.keras import ModelSubscriber
    from deepfreeze.shardplan import ShardPlan, TensorSpec

    def build():
        return tf.keras.Sequential([tf.keras.layers.Dense(4, activation="relu"), tf.keras.layers.Dense(3)])

    cfg = Config(mode="sync", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"))
    with ModelSubscriber("ghost", cfg, build=build, input_spec=(None, 8), warn_after=0.2) as sub:
        with pytest.raises(StreamTimeoutError) as e:
            sub.wait(0, timeout=1.0)
        assert "nobody publishes" in str(e.value) and os.path.join(cfg.persistent, "ghost", "stream") in str(e.value)
    with pytest.raises(ConfigError, match="input_spec"):
        ModelSubscriber("ghost", cfg, build=build)
    with pytest.raises(ConfigError, match=r"building the model from input_spec"):
        ModelSubscriber("ghost", cfg, build=build, input_spec=(None,))  # Dense needs rank >= 2
    # a committed version of the channel, served into replicas built from the spec
    ref = build()
    ref.build((None, 8))
    weights = [np.random.default_rng(i).standard_normal(w.shape).astype("float32") for i, w in enumerate(ref.weights)]
    specs = [TensorSpec(i, f"t{i}", "float32", tuple(w.shape)) for i, w in enumerate(weights)]
    plan = ShardPlan.build(specs, 1, min_shard_bytes=0)
    eng = Engine(cfg, "chan", 0, plan)
    lay = FusedLayout.build(plan, 0)
    pieces = [weights[s.piece.tensor_id].reshape(-1)[s.piece.start:s.piece.stop] for s in lay.segments]
    eng.checkpoint(5, FusedShard.from_arrays(lay, pieces, 5), step=5, epoch=0, extra={"model_tensors": len(specs)})
    eng.close()
    with ModelSubscriber("chan", cfg, build=build, input_spec=tf.TensorSpec((None, 8), tf.float32)) as sub:
        assert sub.wait(0, timeout=30).step == 5
        got, v = sub.get_weights()
        assert same(got, weights) and v.step == 5


def test_a_degenerate_plan_is_logged_with_its_reason(tmp_path, monkeypatch, caplog):
    """One process, no Horovod: a loss that cannot fall (learning rate 0, the same batch every step)
    gives a flat curve; the plan is logged once (its summary) and its degeneracy as a warning that
    says why; the callback publishes only the warm-up version."""
    import logging
    import tensorflow as tf
    from deepfreeze.keras import PublishCallback
    from deepfreeze.stream import StreamOptions
    monkeypatch.setenv("DEEPFREEZE_TOKEN", TOKEN)
    caplog.set_level(logging.INFO, logger="deepfreeze")
    tf.keras.utils.set_random_seed(3)
    model = tf.keras.Sequential([tf.keras.Input((6,)), tf.keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.0), loss="sparse_categorical_crossentropy")
    x = np.tile(np.linspace(0, 1, 6, dtype=np.float32), (64, 1))
    y = np.zeros(64, dtype=np.int64)
    shm = tmp_path / "shm"
    shm.mkdir()
    pub = PublishCallback("flat", schedule="adaptive", horizon_s=2.0, inference_interval_s=0.01, mode="sync",
                          scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"),
                          stream=StreamOptions(shm_dir=str(shm)))
    try:
        model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[pub])
    finally:
        pub.close()
    assert pub.publish_plan is not None and pub.publish_plan.steps == ()
    assert [v.step for v in pub.published] == [8]  # the warm-up version only
    msgs = [r.getMessage() for r in caplog.records]
    summaries = [m for m in msgs if "adaptive plan: 0 publishes expected in steps (8, " in m]
    assert len(summaries) == 1, msgs
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "does not do its job" in
              r.getMessage()]
    assert len(warned) == 1 and "no publish after the warm-up" in warned[0] and "'flat'" in warned[0], msgs
    assert "does not decrease" in warned[0] or "falls" in warned[0]


def test_the_ranks_vote_agrees_and_a_missing_rank_is_a_bounded_wait(tmp_path):
    """any_rank (the coalescing decision's all-reduce): every rank gets the OR of the votes, and a
    rank that never votes makes the others fail with StreamTimeoutError after the bound, not hang."""
    # check=False: the job ends without MPI_Finalize on purpose (a vote is left pending), which mpirun reports
    mpirun(2, os.path.join(WORKERS, "stream_vote.py"), str(tmp_path), timeout=120, check=False)
    reps = [json.load(open(tmp_path / f"vote{r}.json")) for r in range(2)]
    expect = [i % 2 == 0 or i % 3 == 0 for i in range(200)]
    assert reps[0]["got"] == reps[1]["got"] == expect
    t = reps[0]["timeout"]
    assert t is not None and "did not take part in the test's last vote within 2 s" in t["message"]
    assert "must exit" in t["message"]
