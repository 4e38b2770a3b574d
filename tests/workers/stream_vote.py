"""The ranks' shared vote (deepfreeze.keras._dist.any_rank) under Horovod (run under mpirun).

    python tests/workers/stream_vote.py OUT

Each rank votes 200 times (rank r votes True at i when i % (r + 2) == 0) and records what the vote
returned; then rank 0 votes once more while the last rank never does (it waits for rank 0's file, then exits): rank
0 must get StreamTimeoutError within the bound. Per-rank results in OUT/vote<rank>.json.
"""
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402

from deepfreeze.errors import StreamTimeoutError  # noqa: E402
from deepfreeze.keras._dist import any_rank  # noqa: E402


def main() -> None:
    out = sys.argv[1]
    hvd.init()
    rank = hvd.rank()
    got, times = [], []
    for i in range(200):
        t0 = time.perf_counter()
        got.append(any_rank(i % (rank + 2) == 0))
        times.append(time.perf_counter() - t0)
    report = {"got": got, "median_s": sorted(times)[len(times) // 2], "timeout": None}
    if rank != 0:  # written first: mpirun ends the job once rank 0 leaves
        with open(os.path.join(out, f"vote{rank}.json"), "w") as f:
            json.dump(report, f)
    if rank == 0:
        t0 = time.monotonic()
        try:
            any_rank(True, timeout=2.0, what="the test's last vote")
        except StreamTimeoutError as e:
            report["timeout"] = {"message": str(e), "after_s": time.monotonic() - t0}
        with open(os.path.join(out, "vote0.json.tmp"), "w") as f:
            json.dump(report, f)
        os.replace(os.path.join(out, "vote0.json.tmp"), os.path.join(out, "vote0.json"))  # whole when seen
    else:  # never votes; leaves once rank 0 has its answer (a fixed 4 s ran out first on a loaded machine:
        # this rank's exit ends the job, rank 0 included, before it wrote its file)
        deadline = time.monotonic() + 100
        while not os.path.exists(os.path.join(out, "vote0.json")) and time.monotonic() < deadline:
            time.sleep(0.05)
    os._exit(0)  # rank 0's vote is still pending in MPI: leave without finalizing (mpirun reports it)


if __name__ == "__main__":
    main()
