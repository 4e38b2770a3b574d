"""Multi-rank restore worker: every rank restores and compares with the reference.

    python tests/workers/restore.py OUT VERSION|newest

Under several ranks the restore is collective: the ranks pool their nodes' scratch.
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import horovod.tensorflow.keras as hvd  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import build  # noqa: E402
import deepfreeze  # noqa: E402

out, version = sys.argv[1], (None if sys.argv[2] == "newest" else int(sys.argv[2]))
hvd.init()
model = build("small")
v, step = deepfreeze.restore(model, name="job", mode="async", scratch=f"{out}/node{hvd.rank()}/scratch",
                             persistent=f"{out}/persistent", version=version)
with np.load(f"{out}/expected/v{v}.npz", allow_pickle=False) as ref:
    same = all(ref[f"arr_{i}"].tobytes() == w.tobytes() for i, w in enumerate(model.get_weights()))
print(f"restore rank {hvd.rank()}/{hvd.size()} v{v} step {step} bitexact={same}", flush=True)
sys.exit(0 if same else 3)
