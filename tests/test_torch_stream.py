"""The PyTorch stream: deepfreeze.torch.Publisher in a 2-rank DDP job (torchrun, gloo) and
deepfreeze.torch.Subscriber in a plain consumer process serving predictions.

Every check is against state the run recorded: the producer ranks write the module's state dict
after each published step (tests/workers/torch_stream_pub.py); the consumer records (version,
input, output) of each request (tests/workers/torch_stream_serve.py); the outputs are recomputed
here from the recorded weights of the version the consumer reported, bit for bit.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (scripts/setup.sh installs torch, CPU)")

from _util import ROOT, WORKERS  # noqa: E402

sys.path.insert(0, WORKERS)
from torch_stream_pub import CHANNEL, Net, inputs  # noqa: E402

PUB = os.path.join(WORKERS, "torch_stream_pub.py")
SERVE = os.path.join(WORKERS, "torch_stream_serve.py")
TOKEN = "7" * 64


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", TORCHELASTIC_ERROR_FILE="",
                PYTHONWARNINGS="ignore", DEEPFREEZE_TOKEN=TOKEN)


@pytest.fixture
def out(tmp_path):
    shm = f"/dev/shm/dftorch-{uuid.uuid4().hex[:8]}"
    os.makedirs(shm)
    yield str(tmp_path), shm
    shutil.rmtree(shm, ignore_errors=True)


def torchrun_cmd(out: str, shm: str, *args: str) -> list[str]:
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    return [exe or sys.executable, *([] if exe else ["-m", "torch.distributed.run"]), "--standalone",
            "--nproc-per-node", "2", PUB, out, f"shm_dir={shm}", *args]


def torchrun(out: str, shm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = torchrun_cmd(out, shm, *args)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env())
    if check and p.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-6000:]}")
    return p


def consumer(out: str, *args: str) -> subprocess.Popen:
    log = open(os.path.join(out, "consumer.log"), "w")
    return subprocess.Popen([sys.executable, SERVE, out, *args], stdout=log, stderr=subprocess.STDOUT, env=_env())


def finish(proc: subprocess.Popen, out: str) -> None:
    """Wait (bounded) for a consumer to end; its log (``out``/consumer.log) in the failure."""
    try:
        rc = proc.wait(240)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = "killed after 240 s"
    if rc != 0:
        with open(os.path.join(out, "consumer.log")) as f:
            pytest.fail(f"the consumer exited {rc}:\n{f.read()[-6000:]}")


def stop(proc: subprocess.Popen) -> None:
    """A consumer left running by a failed producer: ended, never left behind."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def weights(out: str, rank: int, step: int) -> dict[str, np.ndarray]:
    with np.load(os.path.join(out, f"r{rank}", f"v{step}.npz"), allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def optim_state(out: str, rank: int, step: int) -> dict[str, np.ndarray]:
    with np.load(os.path.join(out, f"r{rank}", f"o{step}.npz"), allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def check_served(out: str, served: str | None = None) -> np.ndarray:
    """Every prediction the consumer (its output directory ``served``, default ``out``) made equals
    the output of the version it reported (recomputed from the producer's recorded weights in
    ``out``, bit for bit); returns the steps served."""
    with np.load(os.path.join(served or out, "serve.npz"), allow_pickle=False) as f:
        steps, rows, outputs = f["steps"], f["rows"], f["outputs"]
    assert len(steps) > 0 and np.all(np.diff(steps) >= 0), f"versions served out of order: {steps}"
    x = inputs()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the consumer
    try:
        for step in sorted(set(steps.tolist())):
            w0, w1 = weights(out, 0, step), weights(out, 1, step)
            assert all(w0[k].tobytes() == w1[k].tobytes() for k in w0), f"v{step}: the ranks' weights differ"
            net = Net().eval()
            net.load_state_dict({k: torch.from_numpy(v) for k, v in w0.items()})
            with torch.no_grad():  # one row per call, as the consumer ran them
                want = [net(x[r:r + 1]).numpy()[0] for r in range(len(x))]
            for i in np.flatnonzero(steps == step):
                got = outputs[i]
                assert got.tobytes() == want[rows[i]].tobytes(), \
                    f"request {i} (row {rows[i]}) served as v{step}: {got} is not v{step}'s output {want[rows[i]]}"
    finally:
        torch.set_num_threads(threads)
    return steps


def test_ddp_publisher_to_serving_consumer(out):
    """2-rank DDP publishing every 2 steps; two plain consumer processes serving predictions, one
    reading the rings in shared memory, one (tier='tcp') reading each rank's shard over the
    authenticated TCP wire on loopback (deepfreeze.stream.wire, the token of $DEEPFREEZE_TOKEN)."""
    out, shm = out
    tcp = os.path.join(out, "tcp")
    os.makedirs(tcp)
    c = consumer(out, "until=8")
    t = consumer(tcp, "until=8", "tier=tcp", f"pdir={out}")
    try:
        torchrun(out, shm, "steps=8", "every=2", "sync_at=4,8", f"watch={out},{tcp}")
        finish(c, out)
        finish(t, tcp)
    finally:
        stop(c)
        stop(t)
    for served in (out, tcp):
        steps = check_served(out, served)
        assert {4, 8} <= set(steps.tolist()) <= {2, 4, 6, 8}, (served, steps)
    with open(os.path.join(tcp, "serve.json")) as f:
        assert json.load(f)["tiers"] == ["tcp"]  # every version over the wire, none from shared memory
    for r in (0, 1):  # each rank published its own share of every version
        with open(os.path.join(out, f"r{r}", "info.json")) as f:
            info = json.load(f)
        assert info["published"] == [2, 4, 6, 8] and info["prefix"] > 0, info
    with open(os.path.join(out, "serve.json")) as f:
        updates = json.load(f)["updates"]  # the same node: the rings; only a first version may come from the
    assert all(tier == "shm" for _, tier in updates[1:]), updates  # persistent copy (looked before both
    assert updates[0][1] in ("shm", "persistent"), updates  # ranks' endpoints were written)


def test_fsdp2_publisher_to_serving_consumer(out):
    """2-rank FSDP2 (``fully_shard`` per submodule and root, gloo, CPU) publishing every 2 steps:
    each rank publishes its local rows of every parameter (DTensor shards; fc2.weight's 3 rows are
    2 + 1); plain consumer processes (a plain ``Net``, no torch.distributed), one on the rings in
    shared memory, one over the TCP wire, serve versions equal, bit for bit, to the full state each
    rank gathered with get_model_state_dict(full_state_dict=True) at that step."""
    out, shm = out
    tcp = os.path.join(out, "tcp")
    os.makedirs(tcp)
    c = consumer(out, "until=6")
    t = consumer(tcp, "until=6", "tier=tcp", f"pdir={out}")
    try:
        torchrun(out, shm, "fsdp=1", "steps=6", "every=2", "sync_at=4,6", f"watch={out},{tcp}")
        finish(c, out)
        finish(t, tcp)
    finally:
        stop(c)
        stop(t)
    for served in (out, tcp):
        steps = check_served(out, served)  # also: both ranks gathered the same full state
        assert {4, 6} <= set(steps.tolist()) <= {2, 4, 6}, (served, steps)
    with open(os.path.join(tcp, "serve.json")) as f:
        assert json.load(f)["tiers"] == ["tcp"]
    full = sum(a.nbytes for a in weights(out, 0, 6).values())
    prefixes = []
    for r in (0, 1):
        with open(os.path.join(out, f"r{r}", "info.json")) as f:
            info = json.load(f)
        assert info["published"] == [2, 4, 6] and info["prefix"] > 0, info
        prefixes.append(info["prefix"])
    # each rank its local rows (r0: 16 + 16 + 16 + 2 rows, r1: 16 + 16 + 16 + 1), together the model once
    assert sum(prefixes) == full and max(prefixes) < full, (prefixes, full)


def test_publisher_beside_checkpointer_one_capture(out):
    """A Checkpointer (every 3 steps) and a Publisher riding on it (every 2 steps) in a 2-rank DDP
    job: the Checkpointer captures its own steps only (3 and 6; the Publisher copies the live
    weights of 2, 4, 6, 8 straight into its slots: no checkpoint capture, nothing written for
    them); the consumer serves versions equal to the recorded weights; the committed versions are
    the Checkpointer's only (3, 6 and 8, its last step at close), each restoring bit-exact, model
    and optimizer state: the persistent fallback tier serves checkpoint versions only; a consumer
    started after the job ended reads the newest one from the checkpoint."""
    from deepfreeze.loader import list_versions
    from deepfreeze.config import Config
    from deepfreeze.torch import load
    out, shm = out
    c = consumer(out, "until=8")
    try:
        torchrun(out, shm, "steps=8", "every=2", "ck=3", "sync_at=4,8")
        finish(c, out)
    finally:
        stop(c)
    steps = check_served(out)
    # published steps, and the Checkpointer's 3 or 6 where the consumer's persistent tier found it
    # committed before the next publish (written once, the shipped default on one disk, a version
    # commits sooner than through scratch); each served version equals its recorded weights
    assert {4, 8} <= set(steps.tolist()) <= {2, 3, 4, 6, 8}, steps
    for r in (0, 1):
        with open(os.path.join(out, f"r{r}", "info.json")) as f:
            info = json.load(f)
        assert info["published"] == [2, 4, 6, 8] and info["torn"] == 0, info
        assert info["captures"] == 2 and info["sinks"] == 1, info  # 3 and 6; the Publisher's live capture left
        assert info["owner_open_after_publisher"], info  # closing the Publisher left the Checkpointer running
    persistent = os.path.join(out, "persistent")
    cfg = Config.resolve(None, scratch=os.path.join(out, "noscratch"), persistent=persistent, mode="async")
    committed = sorted(v for v, levels in list_versions(cfg, CHANNEL).items() if "persistent" in levels)
    assert committed == [3, 6, 8], committed  # published 2 and 4 never reach persistent; 8: the close's
    for v in committed:
        got = load(cfg, name=CHANNEL, version=v)
        want = {**weights(out, 0, v), **optim_state(out, 0, v)}
        assert sorted(got) == sorted(want), (v, sorted(got), sorted(want))
        for k, a in want.items():
            assert got[k].numpy().tobytes() == a.tobytes(), f"v{v} {k} does not restore bit-exact"
    late = consumer(out, "until=8")  # no producer any more: the persistent tier
    try:
        finish(late, out)
    finally:
        stop(late)
    steps = check_served(out)
    assert set(steps.tolist()) == {8}, steps
    with open(os.path.join(out, "serve.json")) as f:
        assert json.load(f)["tiers"] == ["persistent"]


def test_publisher_killed_mid_transfer_consumer_keeps_last_version(out):
    """Rank 1 is SIGKILLed in the middle of copying v6 into its shared-memory slot (injected by
    subclassing its ring: after its slot was marked as being written, before its record is
    complete), after the consumer served v5; v6 is not a checkpoint step (publish-only versions never
    reach persistent), so only the stream could deliver it. v6 is never complete (rank 1's slot stays odd
    and is never announced), so the consumer keeps serving v5, a bounded wait for a
    newer one ends with StreamTimeoutError (no hang), and nothing served mixes versions."""
    out, shm = out
    c = consumer(out, "until=5", "dead=1")
    try:
        p = torchrun(out, shm, "steps=10", "every=1", "sync_at=5", "die_mid=6", check=False)
        assert p.returncode != 0
        finish(c, out)
    finally:
        stop(c)
    with open(os.path.join(out, "died_mid6")) as f:
        done, total = map(int, f.read().split("/"))
    assert 0 < done <= total, (done, total)  # it died inside the copy of v6, after the slot went odd
    # (the copy into the slot starts in v6's optimizer step, before the loop records v6's weights)
    assert os.path.exists(os.path.join(out, "r1", "v5.npz")) and not glob.glob(os.path.join(out, "r1", "v7.npz"))
    steps = check_served(out)
    assert steps[-1] == 5 and set(steps.tolist()) <= set(range(1, 6))
    with open(os.path.join(out, "serve.json")) as f:
        info = json.load(f)
    assert info["after_death"] == "StreamTimeoutError", info


def test_consumer_killed_mid_transfer_publisher_goes_on(out):
    """A consumer SIGKILLed while it copies a version out of the producer's rings (each rank's slot
    pinned, half copied; injected by subclassing the ring it reads): the 2-rank producer, which
    kept publishing while the slots were pinned, goes on to the end (exit 0, every version
    published on both ranks, no error surfaced to training), and another consumer serves only
    complete versions, bit-exact against the recorded weights."""
    out, shm = out
    stalled = os.path.join(out, "stalled")
    os.makedirs(stalled)
    s = consumer(stalled, "until=10", "tier=shm", "stall=1", f"pdir={out}")
    c = consumer(out, "until=10")
    prod = subprocess.Popen(torchrun_cmd(out, shm, "steps=10", "every=1", "gate_at=3,6", "sync_at=10"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    try:
        deadline = time.monotonic() + 120
        while not glob.glob(os.path.join(stalled, "stalled.*")):  # the stalled consumer holds its pins
            assert time.monotonic() < deadline and s.poll() is None and prod.poll() is None, \
                f"the consumer did not stall within 120 s (consumer {s.poll()}, producer {prod.poll()})"
            time.sleep(0.05)
        open(os.path.join(out, "gate3"), "w").close()  # the producer publishes v4..v6 while the pins are held
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(out, "r0", "v6.npz")):
            assert time.monotonic() < deadline and prod.poll() is None, "the producer did not reach v6"
            time.sleep(0.05)
        s.kill()  # SIGKILL, mid-transfer: its copy of a version never completes
        assert s.wait(30) == -9
        open(os.path.join(out, "gate6"), "w").close()
        try:
            log, _ = prod.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            prod.kill()
            log, _ = prod.communicate()
            pytest.fail(f"the producer hung after the consumer was killed:\n{log[-6000:]}")
        assert prod.returncode == 0, f"the producer failed after the consumer was killed:\n{log[-6000:]}"
        finish(c, out)
    finally:
        stop(s)
        stop(c)
        if prod.poll() is None:
            prod.kill()
            prod.wait()
    for r in (0, 1):
        with open(os.path.join(out, f"r{r}", "info.json")) as f:
            info = json.load(f)
        assert info["published"] == list(range(1, 11)), info
    steps = check_served(out)
    assert steps[-1] == 10, steps


# ---------------------------------------------------------------- one process, no torch.distributed
def _solo(tmp_path, monkeypatch) -> tuple:
    """One process's producer setting: the token, a private shm directory for the rings, scratch and
    persistent under ``tmp_path``, a seeded Net and its SGD (momentum) optimizer."""
    monkeypatch.setenv("DEEPFREEZE_TOKEN", TOKEN)
    shm = f"/dev/shm/dftorch-{uuid.uuid4().hex[:8]}"
    os.makedirs(shm)
    dirs = dict(scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"), mode="async")
    torch.manual_seed(0)
    net = Net()
    return shm, dirs, net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


def _train(pub, net, opt, g, n: int, states: dict) -> None:
    for _ in range(n):
        loss = torch.nn.functional.mse_loss(net(torch.randn(4, 8, generator=g)), torch.randn(4, 3, generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()
        states[pub.step] = {k: v.detach().clone() for k, v in net.state_dict().items()}
        pub.end_iteration()


def _same(module: torch.nn.Module, state: dict) -> bool:
    return all(torch.equal(v, state[k]) for k, v in module.state_dict().items())


@pytest.mark.parametrize("kw,named", [
    ({"persistent": "P", "scratch": "S"}, "persistent= cannot be taken with scratch="),
    ({"persistent": "P", "config": "x.ini"}, "persistent= cannot be taken with config="),
    ({"persistent": "P", "mode": "async", "scratch": "S"}, "persistent= cannot be taken with mode=, scratch="),
    ({"redis": "redis://h:1", "scratch": "S"}, "redis= cannot be taken with scratch="),
    ({"redis": "redis://h:1"}, "redis= needs persistent=")])
def test_subscriber_refusal_names_the_keyword_it_cannot_take(kw, named):
    """Issue 41, item 6: Subscriber(..., persistent=P, scratch=S) names the keyword it cannot take
    with the others. Before: "or a config (...), not both" though no config was given."""
    from deepfreeze.errors import ConfigError
    from deepfreeze.torch import Subscriber
    with pytest.raises(ConfigError, match=re.escape(named)) as e:
        Subscriber(Net(), channel="c", **kw)
    assert "not both" not in str(e.value)


def test_single_process_pinned_replica_is_never_reloaded(tmp_path, monkeypatch):
    """A plain process: a pinned replica keeps its version while newer ones are published; the
    next version waits for the pin to end; a module of another architecture is refused."""
    from deepfreeze.errors import ConfigError, ModelMismatchError, StreamError, StreamTimeoutError
    from deepfreeze.stream import StreamOptions
    from deepfreeze.torch import Publisher, Subscriber
    shm, dirs, net, opt = _solo(tmp_path, monkeypatch)
    with pytest.raises(ConfigError, match="schedule"):
        Publisher(net, opt, channel="solo", schedule="sometimes", **dirs)
    with pytest.raises(ConfigError, match="horizon_s"):
        Publisher(net, opt, channel="solo", schedule="adaptive", **dirs)
    pub = Publisher(net, opt, channel="solo", schedule=2, overwrite=True, stream=StreamOptions(shm_dir=shm), **dirs)
    sub = Subscriber(Net(), channel="solo", persistent=dirs["persistent"])
    try:
        with pytest.raises(StreamError, match="wait"):
            with sub.current():
                pass
        g = torch.Generator().manual_seed(3)
        states: dict = {}
        _train(pub, net, opt, g, 2, states)
        assert sub.wait(2, timeout=60).step == 2
        with sub.current() as m:
            assert m.step == 2 and _same(m.module, states[2])
            _train(pub, net, opt, g, 2, states)  # v4 goes into the other replica
            assert sub.wait(4, timeout=60).step == 4
            _train(pub, net, opt, g, 2, states)  # v6 needs the pinned replica: it waits for this block
            with pytest.raises(StreamTimeoutError):
                sub.wait(6, timeout=1.5)
            assert m.step == 2 and _same(m.module, states[2])
            with sub.current() as m4:
                assert m4.step == 4 and _same(m4.module, states[4])
        assert sub.wait(6, timeout=60).step == 6
        y, v = sub.predict(inputs())
        net6 = Net()
        net6.load_state_dict(states[6])
        with torch.no_grad():
            assert v.step == 6 and torch.equal(y, net6(inputs()))
        assert [v.step for v in pub.published] == [2, 4, 6]
    finally:
        sub.close()
        pub.close()
    other = torch.nn.Sequential(torch.nn.Linear(8, 3))
    bad = Subscriber(other, channel="solo", persistent=dirs["persistent"])  # falls back to the persistent copy
    try:
        with pytest.raises(StreamError) as e:
            bad.wait(0, timeout=30)
        assert isinstance(e.value.__cause__, ModelMismatchError)
    finally:
        bad.close()
        shutil.rmtree(shm, ignore_errors=True)


def test_torn_copy_into_a_slot_is_never_served(tmp_path, monkeypatch):
    """A tensor changed in place while the Publisher copies v3 straight into its slot (injected by
    subclassing SlotCopy: after the first chunk, a parameter grows by one): v3 is torn (the slot is
    never completed, nothing announced: pub.torn == 1), the consumer never serves it, and the
    versions before and after it are served bit-exact against the weights recorded in the run."""
    from deepfreeze.lease import Version
    from deepfreeze.stream import StreamOptions
    from deepfreeze.torch import Publisher, Subscriber
    from deepfreeze.torch.slot_copy import SlotCopy
    shm, dirs, net, opt = _solo(tmp_path, monkeypatch)

    class Tearing(SlotCopy):  # fault injected by subclassing: a write outside the optimizer mid-copy
        def _copied_chunk(self, done: int) -> None:
            if self.step == 3:
                with torch.no_grad():
                    net.fc1.weight.add_(1.0)

    class TearingPublisher(Publisher):
        copy_cls = Tearing

    pub = TearingPublisher(net, opt, channel="torn", schedule=1, overwrite=True, stream=StreamOptions(shm_dir=shm),
                           **dirs)
    sub = Subscriber(Net(), channel="torn", persistent=dirs["persistent"], tier="shm")
    served: list = []
    sub.on_update(lambda v: served.append(v.step))
    try:
        g = torch.Generator().manual_seed(3)
        states: dict = {}
        for step in range(1, 6):
            _train(pub, net, opt, g, 1, states)
            pub.wait(60)  # the copy and its notification are done
            if step == 3:
                assert pub.torn == 1
                continue
            v = sub.wait(Version(pub.publisher.run.generation, step), timeout=60)
            with sub.current() as m:
                assert v.step == m.step == step and _same(m.module, states[step]), step
        assert [v.step for v in pub.published] == [1, 2, 3, 4, 5]  # handed to the publisher; 3 torn there
        assert 3 not in served and {1, 2, 4, 5} <= set(served), served
        assert pub.publisher.ring.torn == 1
    finally:
        sub.close()
        pub.close()
        shutil.rmtree(shm, ignore_errors=True)


def test_a_process_on_one_cpu_copies_in_the_post_hook(tmp_path, monkeypatch):
    """Confined to one CPU (the training thread's affinity), the Publisher copies each version in
    the post-hook itself, on the training thread (a publish thread could only take turns with it),
    announced when optimizer.step() returns; on two CPUs, on its publish thread. Both bit-exact."""
    from deepfreeze.lease import Version
    from deepfreeze.stream import StreamOptions
    from deepfreeze.torch import Publisher, Subscriber
    from deepfreeze.torch.slot_copy import SlotCopy
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs to compare the two ways")
    shm, dirs, net, opt = _solo(tmp_path, monkeypatch)
    threads: list = []

    class Noting(SlotCopy):  # records which thread copies
        def _copied_chunk(self, done: int) -> None:
            threads.append(threading.current_thread() is threading.main_thread())

    class NotingPublisher(Publisher):
        copy_cls = Noting

    pub = NotingPublisher(net, opt, channel="onecpu", schedule=1, overwrite=True, stream=StreamOptions(shm_dir=shm),
                          **dirs)
    sub = Subscriber(Net(), channel="onecpu", persistent=dirs["persistent"], tier="shm")
    cpus = os.sched_getaffinity(0)
    try:
        g = torch.Generator().manual_seed(3)
        states: dict = {}
        _train(pub, net, opt, g, 1, states)  # two CPUs: the publish thread
        pub.wait(60)
        os.sched_setaffinity(0, {min(cpus)})  # this (the training) thread only
        try:
            _train(pub, net, opt, g, 2, states)
            assert pub.publisher.published[-1].step == 3  # announced before optimizer.step() returned
        finally:
            os.sched_setaffinity(0, cpus)
        assert threads == [False, True, True], threads
        for step in (1, 3):
            v = sub.wait(Version(pub.publisher.run.generation, step), timeout=60)
            if v.step == step:
                with sub.current() as m:
                    assert m.step == step and _same(m.module, states[step])
        assert sub.version.step == 3
    finally:
        sub.close()
        pub.close()
        shutil.rmtree(shm, ignore_errors=True)


def test_single_process_plan_schedule_and_checkpoint_versions_only(tmp_path, monkeypatch):
    """schedule='fixed': one version at the end of the warm-up, then the plan's steps; without
    report(loss) a ConfigError names the call. A Publisher riding on a Checkpointer (every 3
    steps) publishes every step from the live tensors (one sink more on the hook while it runs,
    none after its close): the Checkpointer captures and writes its own steps only (and its last
    at close), never a publish-only version: the persistent fallback serves checkpoint versions."""
    from deepfreeze.errors import ConfigError
    from deepfreeze.loader import list_versions
    from deepfreeze.stream import StreamOptions
    from deepfreeze.torch import Checkpointer, Publisher
    monkeypatch.setenv("DEEPFREEZE_TOKEN", TOKEN)
    shm = f"/dev/shm/dftorch-{uuid.uuid4().hex[:8]}"
    os.makedirs(shm)
    dirs = dict(scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"), mode="async",
                stream=StreamOptions(shm_dir=shm))
    g = torch.Generator().manual_seed(4)
    try:
        torch.manual_seed(0)
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        pub = Publisher(net, opt, channel="planned", schedule="fixed", warmup_steps=6, horizon_s=5.0,
                        inference_interval_s=0.01, overwrite=True, **dirs)
        try:
            for _ in range(20):
                loss = torch.nn.functional.mse_loss(net(torch.randn(4, 8, generator=g)),
                                                    torch.randn(4, 3, generator=g))
                opt.zero_grad()
                loss.backward()
                opt.step()
                pub.report(loss)
                pub.end_iteration()
            assert pub.publish_plan is not None and pub.published[0].step == 6
            assert all(v.step in pub.publish_plan.steps for v in pub.published[1:])
        finally:
            pub.close()

        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        shm_opts = dirs.pop("stream")
        ck = Checkpointer(net, opt, name="busy", every_n_steps=3, overwrite=True, **dirs)
        dirs["stream"] = shm_opts
        pub = Publisher(net, opt, checkpointer=ck, schedule=1, stream=shm_opts)
        try:
            _train(pub, net, opt, g, 7, {})
            assert [v.step for v in pub.published] == list(range(1, 8)) and pub.torn == 0
            assert len(ck.timings) == 2 and ck.hook.sinks == [ck, pub.capture]  # 3 and 6: its own only
            assert [t["version"] for t in pub.publish_timings] == list(range(1, 8))
        finally:
            pub.close()
        assert not ck._closed and ck.hook.sinks == [ck] and ck.coalesced == 0
        ck.wait(60)
        committed = sorted(v for v, levels in list_versions(ck.config, "busy").items() if "persistent" in levels)
        assert committed == [3, 6], committed  # no publish-only version reaches persistent
        with pytest.raises(ConfigError, match="checkpointer="):  # the channel's Checkpointer runs: say so
            Publisher(net, opt, channel="busy", schedule=1, overwrite=True, **dirs)
        with pytest.raises(ConfigError, match="no Checkpointer arguments"):
            Publisher(net, opt, checkpointer=ck, every_n_steps=2)
        with pytest.raises(ConfigError, match="channel is the checkpoint name"):
            Publisher(net, opt, channel="other", checkpointer=ck)
        pub = Publisher(net, opt, checkpointer=ck, schedule=1, stream=shm_opts)  # the Checkpointer went on
        _train(pub, net, opt, g, 3, {})  # v9 the Checkpointer's
        assert [v.step for v in pub.published] == [8, 9, 10]
        ck.close()  # writes v10 (its last step) and closes the Publisher riding on it
        assert pub._closed and pub.publisher is None and ck.hook.sinks == []
        committed = sorted(v for v, levels in list_versions(ck.config, "busy").items() if "persistent" in levels)
        assert committed == [3, 6, 9, 10], committed

        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        pub = Publisher(net, opt, channel="noreport", schedule="adaptive", warmup_steps=3, horizon_s=5.0,
                        inference_interval_s=0.01, overwrite=True, **dirs)
        try:
            with pytest.raises(ConfigError, match=r"report\(loss\)"):
                _train(pub, net, opt, g, 6, {})
        finally:
            pub.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
