"""experiments/torch_dcp.py's CPU figure and verdicts (issue 34): the accounting of
experiments/cpuload.py on real threads and processes, and the report's comparisons. Short (~1 s idle);
the experiment itself is run by hand (``python -m experiments.torch_dcp --quick``)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments.cpuload import CkptCPU  # noqa: E402
from experiments.torch_dcp_report import ratio, verdict  # noqa: E402

_BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\ntime.sleep(60)\n"


def burn(seconds: float) -> None:
    t = time.thread_time()
    while time.thread_time() - t < seconds:
        pass


def test_cpu_of_checkpoint_threads_calls_and_processes():
    """A thread started after the training set counts even after it ended; the training thread's
    own CPU counts only as added in-call time; a child whose command line names a checkpointer
    counts from 0 when first seen in the window, another child (a DataLoader worker) does not."""
    cpu = CkptCPU()
    cpu.training_set()
    cpu.open(("multiprocessing",))
    ckpt_proc = subprocess.Popen([sys.executable, "-c", "# multiprocessing\n" + _BURN.format(s=0.2)],
                                 start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", _BURN.format(s=0.2)], start_new_session=True)
    try:
        t = threading.Thread(target=burn, args=(0.2,))
        t.start()
        t.join()  # ended before close: its CPU is in the process clock only
        burn(0.2)  # the training thread outside any call: not counted
        c = time.thread_time()
        burn(0.05)
        cpu.incall(time.thread_time() - c)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # both children done burning (CPU, not wall: load-proof)
            cpu.sample()
            if all(_cpu(p.pid) >= 0.19 for p in (ckpt_proc, other)):
                break
            time.sleep(0.05)
        got = cpu.close()
    finally:
        for p in (ckpt_proc, other):
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert 0.18 <= got["threads_s"] <= 0.4, got
    assert 0.04 <= got["incall_s"] <= 0.12, got
    assert 0.17 <= got["procs_s"] <= 0.45 and set(got["procs"]) == {"multiprocessing"}, got
    assert got["lost_training_threads"] == 0


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        v = f.read().rsplit(")", 1)[1].split()
    return (int(v[11]) + int(v[12])) / os.sysconf("SC_CLK_TCK")


def test_verdicts_within_one_se_are_not_resolvable():
    assert verdict({"mean": 0.5, "se": 0.1}, {"mean": 0.45, "se": 0.05}) == "not resolvable"
    assert verdict({"mean": 0.3, "se": 0.01}, {"mean": 0.5, "se": 0.01}) == "met"
    assert verdict({"mean": 0.7, "se": 0.01}, {"mean": 0.5, "se": 0.01}) == "missed"
    assert verdict({"mean": 0.7, "se": None}, {"mean": None, "se": None}) == "–"
    assert ratio({"mean": 1.3, "se": 0.2}, {"mean": 1.0, "se": 0.1}, 1.2).endswith("not resolvable")
    assert ratio({"mean": 1.0, "se": 0.01}, {"mean": 1.0, "se": 0.01}, 1.2).endswith("met")
    assert ratio({"mean": 2.0, "se": 0.01}, {"mean": 1.0, "se": 0.01}, 1.2).endswith("missed")
