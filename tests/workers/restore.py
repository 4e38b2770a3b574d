"""Multi-rank restore worker: every rank restores and compares with the reference.

    python tests/workers/restore.py OUT VERSION|newest [+ OUT2 VERSION2|newest ...]

Under several ranks the restore is collective: the ranks pool their nodes' scratch. Each rank
prints one line per restore (``restore rank R/N vV step S bitexact=B``) and writes it to
OUT/restore-np<N>-r<R>.txt too (what a test of that checkpoint reads). Several targets
(``+``-separated) are restored one after another by the same ranks, into a fresh model each; a
target that raises then writes its error to that file and the next target is still restored.
"""
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import horovod.tensorflow.keras as hvd  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import build  # noqa: E402
import deepfreeze  # noqa: E402


def restore(out: str, version: int | None) -> tuple[str, bool]:
    model = build("small")
    v, step = deepfreeze.restore(model, name="job", mode="async", scratch=f"{out}/node{hvd.rank()}/scratch",
                                 persistent=f"{out}/persistent", version=version)
    with np.load(f"{out}/expected/v{v}.npz", allow_pickle=False) as ref:
        same = all(ref[f"arr_{i}"].tobytes() == w.tobytes() for i, w in enumerate(model.get_weights()))
    return f"restore rank {hvd.rank()}/{hvd.size()} v{v} step {step} bitexact={same}", same


args = sys.argv[1:]
targets = [args[i:i + 2] for i in range(0, len(args), 3)]  # OUT VERSION, then "+" before each next one
assert all(args[i] == "+" for i in range(2, len(args), 3)) and all(len(t) == 2 for t in targets), args
hvd.init()
ok = True
for i, (out, version) in enumerate(targets):
    if i:
        tf.keras.backend.clear_session()  # the next model's layers are named as in a fresh process
    try:
        line, same = restore(out, None if version == "newest" else int(version))
    except Exception:
        if len(targets) == 1:
            raise
        line, same = f"restore rank {hvd.rank()}/{hvd.size()} failed:\n{traceback.format_exc()}", False
    with open(f"{out}/restore-np{hvd.size()}-r{hvd.rank()}.txt", "w") as f:
        f.write(line + "\n")
    print(line, flush=True)
    ok = ok and same
sys.exit(0 if ok else 3)
