"""experiments/gpu.py, the project's GPU script, in its CPU smoke mode: tiny models, real
checkpoints (DeepFreeze's backend process, DCP's thread checkpointer with its stager), a real
restore into a fresh model and optimizer; the JSON it writes is what the device run leaves."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (scripts/setup.sh installs torch==2.13.0, CPU)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
APPROACHES = ["deepfreeze", "dcp-async-thread-staged"]


def test_gpu_script_cpu_smoke_restores_bit_exact_and_writes_every_phase(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, "experiments/gpu.py", "--device", "cpu", "--scale", "small", "--skip-tests",
           "--models", "gpt2", "--approaches", ",".join(APPROACHES), "--out", str(out), "--work", str(work)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    # the versions come first, before any measurement
    assert p.stdout.index("[gpu] versions: ") < p.stdout.index("[gpu] phase cuda_tests")
    doc = json.loads((out / "gpu.json").read_text())
    v = doc["versions"]
    for key in ("python", "torch", "numpy", "cpus", "device"):
        assert v[key], key
    assert v["device"] == "cpu"
    assert [ph["phase"] for ph in doc["phases"]] == ["versions", "cuda_tests", "stream",
                                                     *[f"gpt2/{a}" for a in APPROACHES], "gpt2"]
    assert all(ph["wall_s"] >= 0 for ph in doc["phases"])
    assert doc["cuda_tests"] == {"ran": False, "reason": "--skip-tests"}
    assert doc["errors"] == []
    # the stream phase: a Publisher here, a consumer process whose replicas are on the device
    st = doc["stream"]
    assert st["ran"] is True and st["device"] == st["consumer_device"] == "cpu", st
    assert st["served_steps"] == list(range(1, st["versions"] + 2)), st  # the warm-up version, then each measured
    assert st["bit_exact"] is True and st["mismatch"] == [], st  # digests of the served replica = recorded
    assert st["latency_s"]["n"] == st["versions"] == 4 and len(st["latency_all_s"]) == 4, st
    assert all(x > 0 for x in st["latency_all_s"]), st  # served after the step ended
    assert st["tiers"] and set(st["tiers"]) <= {"shm", "tcp", "persistent"}, st
    runs = {r["approach"]: r for r in doc["runs"]}
    assert sorted(runs) == sorted(APPROACHES)
    for a, r in runs.items():
        assert r["bit_exact"] is True and r["mismatch"] == [], (a, r.get("mismatch"))
        assert r["restored_version"] == r["final_version"] > 0, a
        assert "measured_cut" not in r, a
        assert r["stall_s"]["n"] == 3 and r["slowdown"]["n"] == 3, a
        # 3 measured + the final one; DeepFreeze's final is always timed (read after wait()), a
        # measured one only if its manifest was listed before the next commit removed it
        assert r["durable_s"]["n"] == 4 - len(r["durable_missing"]) >= 2, (a, r["durable_by_version"])
        assert r["final_version"] not in r["durable_missing"] and r["durable_s"]["mean"] > 0, a
        assert isinstance(r["cpu_s_per_ckpt"], float) and r["window_ckpts"] == 4, a
        # warm-up checkpoint and its interval (every iterations up to it, every - 1 after), 3 measured
        # intervals, the final checkpoint's iteration
        assert r["every"] >= 2 and len(r["iters"]) == (2 * r["every"] - 1) + 3 * r["every"] + 1, a
    assert runs["deepfreeze"]["scratch_why"]
    assert runs["dcp-async-thread-staged"]["stager_options"]["use_async_staging"] is True
    assert "| gpt2 | deepfreeze |" in doc["table_md"]
    assert not work.exists() or not any(work.iterdir())  # every approach's checkpoints removed
