"""ctypes bindings to VeloC: library lookup, typed symbols, errors, and VeloC's memory API.

The lookup tests run everywhere; the rest need a VeloC install (DEEPFREEZE_VELOC_PREFIX)
and skip with the reason otherwise. Each VeloC session runs in its own process: VeloC 1.8
can be initialized once per process.
"""
import json
import os
import subprocess
import sys

import pytest

from deepfreeze.bindings import veloc as vb
from deepfreeze.errors import DeepFreezeError, VelocNotFoundError

from _util import WORKERS

# the one VeloC daemon of a user on this machine: its tests run on one xdist worker, one at a time
pytestmark = pytest.mark.xdist_group("veloc")

WHY = vb.available()
needs_veloc = pytest.mark.skipif(WHY is not None, reason=f"VeloC not found: {WHY}")


def test_lookup_order():
    assert vb.find_library({"VELOC_LIB": "/x/libveloc-client.so", "DEEPFREEZE_VELOC_PREFIX": "/y"}) == \
        "/x/libveloc-client.so"
    assert vb.find_library({"DEEPFREEZE_VELOC_PREFIX": "/nowhere"}) == "/nowhere/lib/libveloc-client.so"


def test_missing_library_says_how_to_point_to_an_install(tmp_path):
    code = ("from deepfreeze.bindings.veloc import Veloc\n"
            "try:\n    Veloc()\nexcept ImportError as e:\n    print(type(e).__name__, e)\n")
    env = dict(os.environ, DEEPFREEZE_VELOC_PREFIX=str(tmp_path))
    env.pop("VELOC_LIB", None)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert p.stdout.startswith("VelocNotFoundError"), p.stdout + p.stderr
    assert "DEEPFREEZE_VELOC_PREFIX" in p.stdout and str(tmp_path) in p.stdout
    assert issubclass(VelocNotFoundError, DeepFreezeError) and issubclass(VelocNotFoundError, ImportError)


def test_engine_veloc_without_veloc_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPFREEZE_VELOC_PREFIX", str(tmp_path))
    monkeypatch.delenv("VELOC_LIB", raising=False)
    monkeypatch.setattr(vb, "_LIB", None)
    from deepfreeze.tiers import resolve_engine
    with pytest.raises(VelocNotFoundError, match="DEEPFREEZE_VELOC_PREFIX"):
        resolve_engine("veloc")
    assert resolve_engine("auto") == "builtin"
    with pytest.raises(ValueError, match="engine = 'velox'"):
        resolve_engine("velox")


@needs_veloc
def test_every_symbol_is_typed():
    lib = vb._load()
    for name, (args, res) in vb._SIGNATURES.items():
        fn = getattr(lib, name)
        assert fn.restype is res and len(fn.argtypes) == len(args), name


@needs_veloc
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_memory_api_round_trip(tmp_path, mode):
    from deepfreeze.veloc_daemon import stop_backend
    stop_backend()
    try:
        p = subprocess.run([sys.executable, os.path.join(WORKERS, "veloc_api.py"), str(tmp_path), mode],
                           capture_output=True, text=True, timeout=120)
    finally:
        stop_backend()
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["restart_test"] == 2 and out["restart_test_none"] is None
    assert out["recover_size"] == [8000, 28, 0]
    assert out["a_restored"] and out["b_untouched"]  # selective recovery read region 0 only
    assert out["error"].startswith("VELOC_Checkpoint_begin(bad-name, 3) failed")
    assert "once per process" in out["second_init"]
