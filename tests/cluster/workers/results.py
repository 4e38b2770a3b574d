"""What the cluster's numpy workers write: result files, replaced whole, and SHA-256 digests."""
import hashlib
import json
import os

import numpy as np


def atomic_json(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def digests(arrays) -> dict:
    return {k: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() for k, a in arrays.items()}
