"""Load a repository model into a fresh model and compare it with recorded weights.

    python tests/workers/repo_load.py REPO NAME EXPECTED.npz

Builds ``models.build("small")`` with other auto-names (throwaway layers first), calls
``load_into(..., strict=True)`` and exits 0 when every weight equals the recorded one bit for bit.
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import build  # noqa: E402
from deepfreeze.keras import load_into  # noqa: E402
from deepfreeze.repo import Repository  # noqa: E402


def main() -> None:
    repo, name, expected = sys.argv[1:4]
    for _ in range(3):
        tf.keras.layers.Dense(1)  # shift Keras' auto-names: ids must not depend on them
    model = build("small")
    for v in model.weights:
        v.assign(tf.zeros_like(v))
    with Repository(repo) as r:
        report = load_into(r, name, model, strict=True)
    want = np.load(expected)
    got = model.get_weights()
    same = len(got) == len(want.files) and all(
        a.dtype == want[f"arr_{i}"].dtype and a.tobytes() == want[f"arr_{i}"].tobytes() for i, a in enumerate(got))
    print(json.dumps({"loaded": report.loaded, "missing": report.missing, "bytes": report.bytes, "same": same}))
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
