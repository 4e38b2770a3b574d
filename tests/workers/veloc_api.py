"""Exercise VeloC's memory API through deepfreeze.bindings.veloc in one process.

    veloc_api.py ROOT MODE     prints one JSON line with what it observed
"""
import json
import os
import sys

import numpy as np

from deepfreeze.bindings.veloc import VELOC_RECOVER_SOME, Veloc
from deepfreeze.errors import VelocError

root, mode = sys.argv[1], sys.argv[2]
os.makedirs(f"{root}/scratch", exist_ok=True)
os.makedirs(f"{root}/persistent", exist_ok=True)
cfg = f"{root}/veloc.cfg"
with open(cfg, "w") as f:
    f.write(f"mode = {mode}\nscratch = {root}/scratch\npersistent = {root}/persistent\n")
out = {}
v = Veloc()
if mode == "async":  # started by DeepFreeze with no inherited pipes (else the caller waits on them)
    from deepfreeze.veloc_daemon import start_backend
    start_backend(cfg)
v.init_single(0, cfg)
a = np.arange(1000, dtype=np.float64)
b = np.full(7, 3, dtype=np.int32)
for version in (1, 2):
    a += version
    # regions per name: VeloC 1.8 ignores Mem_protect changes after a name's first checkpoint
    v.region_protect(0, a, "mem")
    v.region_protect(1, b, "mem")
    v.checkpoint_wait()
    v.checkpoint_begin("mem", version)
    v.checkpoint_mem()
    v.checkpoint_end(True)
v.checkpoint_wait()
saved = a.copy()
a[:] = -1
b[:] = -1
out["restart_test"] = v.restart_test("mem", 0)
out["restart_test_none"] = v.restart_test("nothing", 0)
v.restart_begin("mem", out["restart_test"])
out["recover_size"] = [v.recover_size(0), v.recover_size(1), v.recover_size(9)]
v.region_protect(0, a, "mem")
v.recover_selective(VELOC_RECOVER_SOME, [0])
v.restart_end(True)
out["a_restored"] = bool((a == saved).all())
out["b_untouched"] = bool((b == -1).all())
try:
    v.checkpoint_begin("bad-name", 3)
except VelocError as e:
    out["error"] = str(e)
try:
    v.init_single(0, cfg)
except VelocError as e:
    out["second_init"] = str(e)
v.finalize(True)
print(json.dumps(out), flush=True)
