"""A lease and ``commit.lock`` holder, and a newcomer that tries to take both (tests/test_node.py):

    python lease_holder.py hold OUT PERS   # takes the lease on "job" and v1's commit.lock, holds
                                           # both until OUT/stop exists, then checks it still holds
    python lease_holder.py try OUT PERS    # tries the lease (lease_wait 1 s) and the lock (1 s)

``hold`` writes ``OUT/ready`` once it holds both, and ``OUT/holder.json`` at the end:
``{"pid", "lost", "lease_run_is_mine", "lock_is_mine"}``. ``try`` writes ``OUT/try.json``:
``{"lease": "taken" | [error type, message], "lock": true (taken) | false}``. Both read their node
id from the environment (``DEEPFREEZE_NODE_ID``); the newcomer may run in another PID namespace
(``unshare --pid --fork --mount-proc``), where the holder's pid is not a process.
"""
import json
import os
import sys
import time

from deepfreeze.errors import DeepFreezeError
from deepfreeze.tiers.persistent import LOCK, PersistentLevel
from deepfreeze.lease import Lease, new_run_id, read_lease

mode, out, pers = sys.argv[1], sys.argv[2], sys.argv[3]
level = PersistentLevel(pers)
vdir = level.version_dir("job", 1)


def dump(name: str, obj: dict) -> None:
    with open(os.path.join(out, name + ".tmp"), "w") as f:
        json.dump(obj, f)
    os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))


if mode == "hold":
    lease = Lease(pers, "job", new_run_id(), timeout=3.0)  # heartbeat every second
    lease.acquire()
    os.makedirs(vdir, exist_ok=True)
    with level.locked(vdir, wait=5.0, stale_after=60.0) as taken:
        assert taken
        with open(os.path.join(vdir, LOCK), "rb") as f:
            mine = f.read()
        open(os.path.join(out, "ready"), "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(out, "stop")) and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(os.path.join(vdir, LOCK), "rb") as f:
            lock_is_mine = f.read() == mine
    got = read_lease(pers, "job")
    dump("holder.json", {"pid": os.getpid(), "lost": lease.lost, "lock_is_mine": lock_is_mine,
                         "lease_run_is_mine": got is not None and got[0].get("run") == lease.run})
    lease.release()
else:
    res: dict = {}
    newcomer = Lease(pers, "job", new_run_id(), timeout=3.0)
    try:
        newcomer.acquire(wait=1.0)
        res["lease"] = "taken"
        newcomer.release()
    except DeepFreezeError as e:
        res["lease"] = [type(e).__name__, str(e)]
    with level.locked(vdir, wait=1.0, stale_after=60.0) as taken:
        res["lock"] = taken
    dump("try.json", res)
