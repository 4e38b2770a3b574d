"""A repository client process for tests/test_repo_provider.py: stores its models on the providers
at ``location`` and loads them back (full and partial), bit-exact, while other clients do the same.

    python repo_client.py LOCATION CLIENT_ID STAGING N_MODELS

The token comes from $DEEPFREEZE_TOKEN. Prints one JSON line: {"stored": [...], "staging": [...]}.
"""
import json
import sys

import numpy as np

from deepfreeze.repo.client import RemoteRepository


def make_tensors(seed: int) -> dict:
    """The tensors of model ``seed``: a few dtypes and shapes, one of ~1.2 MB."""
    rng = np.random.default_rng(seed)
    return {
        "dense/kernel": rng.standard_normal((300, 1000)).astype(np.float32),
        "dense/bias": rng.standard_normal(1000).astype(np.float32),
        "emb": rng.integers(-2**40, 2**40, size=(50, 7)).astype(np.int64),
        "scalar": np.array(seed, dtype=np.float64),
        "half": rng.standard_normal((3, 5, 7)).astype(np.float16),
        "empty": np.zeros((0, 4), np.float32),
    }


def model_name(client: int, j: int) -> str:
    return f"client{client}@m{j}"


def main() -> int:
    location, client, staging, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    repo = RemoteRepository(location, staging=None if staging == "auto" else staging, timeout=60)
    stored = []
    for j in range(n):
        name = model_name(client, j)
        t = make_tensors(100 * client + j)
        res = repo.put(name, t)
        assert res["bytes"] == sum(a.nbytes for a in t.values()), res
        stored.append(name)
        got = repo.get(name)
        assert set(got) == set(t)
        for k in t:
            assert got[k].dtype == t[k].dtype and got[k].shape == t[k].shape, k
            assert got[k].tobytes() == t[k].tobytes(), (name, k)
        out = {"dense/bias": np.empty(1000, np.float32)}
        part = repo.get(name, ["dense/bias", "scalar"], out=out)
        assert part["dense/bias"] is out["dense/bias"] and set(part) == {"dense/bias", "scalar"}
        assert out["dense/bias"].tobytes() == t["dense/bias"].tobytes()
        assert part["scalar"] == t["scalar"]
    print(json.dumps({"stored": stored, "staging": repo.staging, "bytes_read": repo.bytes_read}), flush=True)
    repo.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
