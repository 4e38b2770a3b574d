"""A repository client on a node of the test cluster (numpy only).

    repo_job.py store SHARED LOCATION
    repo_job.py load SHARED LOCATION TIMEOUT

LOCATION: ``dstore://a:p,b:p`` (providers on other nodes; the token from ``$DEEPFREEZE_TOKEN``).

*store*: stores one model on each provider (``m0`` on provider 0, ``m1`` on provider 1, by
:func:`deepfreeze.repo.provider.placement`), ~8 MB each, of bytes seeded from ``os.urandom``,
and records the SHA-256 of every tensor in ``SHARED/repo-expected.json``.

*load* (every request bounded by TIMEOUT seconds; every step's outcome rewritten to
``SHARED/repo-load.json``: tensors' SHA-256 or the error's type and message, with the seconds
it took):

1. ``SHARED/repo-loading`` is written, then ``m0`` is loaded from provider 0 (the test cuts
   provider 0's node off while the bytes flow);
2. ``m1`` from provider 1 (the one not cut off);
3. a new client is made while provider 0 is still cut off (it starts with provider 1 alone),
   loads ``m1`` and tries ``m0``;
4. once ``SHARED/repo-healed`` exists, ``m0`` again.
"""
import os
import sys
import time

import numpy as np

from results import atomic_json, digests  # tests/cluster/workers/results.py

from deepfreeze.errors import DeepFreezeError
from deepfreeze.repo.client import RemoteRepository
from deepfreeze.repo.provider import placement


def names(n: int = 2) -> list:
    """``m<i>``: a model name placed on provider i."""
    out, j = [], 0
    for i in range(n):
        while placement(f"model{j}@v1", n) != i:
            j += 1
        out.append(f"model{j}@v1")
        j += 1
    return out


def store(shared: str, location: str) -> None:
    repo = RemoteRepository(location, timeout=60)
    expected = {}
    for i, name in enumerate(names()):
        rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))
        t = {"dense/kernel": rng.standard_normal((1024, 2000)).astype(np.float32),
             "dense/bias": rng.standard_normal(2000).astype(np.float64),
             "emb": rng.integers(-1 << 40, 1 << 40, (100, 7)).astype(np.int64)}
        repo.put(name, t)
        expected[name] = digests(t)
    atomic_json(f"{shared}/repo-expected.json", {"names": names(), "digests": expected, "staging": repo.staging})
    repo.close()


def load(shared: str, location: str, timeout: float) -> None:
    repo = RemoteRepository(location, timeout=timeout)
    m0, m1 = names()
    report = {"staging": repo.staging, "steps": []}

    def step(what: str, name: str) -> None:
        t0 = time.monotonic()
        try:
            got = repo.get(name)
            report["steps"].append({"what": what, "name": name, "digests": digests(got),
                                    "seconds": time.monotonic() - t0})
        except DeepFreezeError as e:
            report["steps"].append({"what": what, "name": name, "error": [type(e).__name__, str(e)],
                                    "seconds": time.monotonic() - t0})
        atomic_json(f"{shared}/repo-load.json", report)

    with open(f"{shared}/repo-loading", "w") as f:
        f.write("m0")
    step("cut", m0)
    step("other", m1)
    t0 = time.monotonic()  # a new client while provider 0 is still cut off
    try:
        fresh = RemoteRepository(location, timeout=timeout)
    except DeepFreezeError as e:
        report["steps"].append({"what": "open", "error": [type(e).__name__, str(e)], "seconds": time.monotonic() - t0})
    else:
        entry = {"what": "open", "opened": True, "seconds": time.monotonic() - t0, "unreachable": fresh.unreachable}
        for key, name in (("m1", m1), ("m0", m0)):
            t1 = time.monotonic()
            try:
                entry[key] = {"digests": digests(fresh.get(name))}
            except DeepFreezeError as e:
                entry[key] = {"error": [type(e).__name__, str(e)]}
            entry[key]["seconds"] = time.monotonic() - t1
        fresh.close()
        report["steps"].append(entry)
    atomic_json(f"{shared}/repo-load.json", report)
    deadline = time.monotonic() + 120
    while not os.path.exists(f"{shared}/repo-healed") and time.monotonic() < deadline:
        time.sleep(0.1)
    step("healed", m0)
    repo.close()
    report["closed"] = True
    atomic_json(f"{shared}/repo-load.json", report)


if __name__ == "__main__":
    if sys.argv[1] == "store":
        store(sys.argv[2], sys.argv[3])
    else:
        load(sys.argv[2], sys.argv[3], float(sys.argv[4]))
