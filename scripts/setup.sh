#!/usr/bin/env bash
# Idempotent setup: installs what is missing, fast when everything is already there.
#   - OpenMPI from Debian packages (when root; else a clear message)
#   - .venv with tensorflow-cpu 2.15.1, numpy<2, isal (fast CRC32), mpi4py, h5py, pytest, matplotlib,
#     pytest 9.0.3 + pytest-xdist 3.8.0 (make test runs on several workers), scipy (the stream's learning-curve
#     fits), the redis client (the stream's optional notifier) and
#     safetensors (deepfreeze export / memtier dump to .safetensors) and cryptography (Poly1305, the
#     network payload MAC of deepfreeze.net)
#   - redis-server from Debian (when root; optional: the stream's Redis tests skip without it)
#   - Horovod 0.28.1 built from source against that TensorFlow (MPI only)
#   - DeepFreeze's fused-copy TensorFlow op, compiled against the same headers (optional: without
#     a compiler DeepFreeze warns and uses its pure-TensorFlow capture)
#   - PyTorch's CPU build (torch==2.13.0, pinned: an unpinned torch pulls a CUDA build of several GB),
#     installed with the numpy<2 constraint; only deepfreeze.torch imports it
#   - deepfreeze itself, editable
# TensorFlow is pinned to 2.15: Horovod 0.28.1 does not build against newer TF wheels
# (TF 2.21's wheel lacks headers Horovod's TF ops include).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-$PWD/.venv}
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
STAMP="$VENV/.deepfreeze-setup-v2"
TORCH_VERSION=2.13.0
TF_VERSION=2.15.1  # Horovod 0.28.1 builds against it (below)
PYTEST_VERSION=9.0.3 XDIST_VERSION=3.8.0  # pinned together: section 2b

say() { echo "setup: $*"; }

# The fused-copy op (deepfreeze/keras/_ops/_fused_copy.so). Idempotent: `build` recompiles only when
# the source is newer than the library, the library is missing or was built for another TensorFlow.
# Never fails the setup: without the op DeepFreeze falls back to its pure-TensorFlow capture.
native_op() {
  local src=deepfreeze/keras/_ops/fused_copy.cc lib=deepfreeze/keras/_ops/_fused_copy.so
  if [ "${1:-}" = quick ] && [ "$lib" -nt "$src" ] && [ -f "$lib.json" ]; then return 0; fi
  if ! PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TF_CPP_MIN_LOG_LEVEL=2 \
       "$VENV/bin/python" -m deepfreeze.keras.native build; then
    echo "setup: WARNING: the fused-copy op did not build (see above); DeepFreeze uses its" \
         "pure-TensorFlow capture. Install g++ (or set CXX) and run setup again." >&2
  fi
}

# The fast path (every `make test` and `make demo` runs it): the stamp, then each package found and the
# pinned versions read from their metadata, without importing the frameworks (importing TensorFlow,
# Horovod, torch, Lightning and transformers here cost 8 s before every `make test`); Horovod's MPI
# library for TensorFlow must be there (its build is section 3's work).
if [ -f "$STAMP" ] && command -v mpirun >/dev/null 2>&1 \
   && (cd / && "$VENV/bin/python" -c "
import glob, importlib.metadata as m, importlib.util as u, os
for name in ('tensorflow', 'horovod.tensorflow', 'deepfreeze.keras', 'deepfreeze.bindings', 'isal', 'scipy', 'redis',
             'safetensors', 'cryptography', 'torch', 'pytorch_lightning', 'transformers', 'torchdata', 'hypothesis',
             'accelerate', 'mpi4py', 'h5py', 'matplotlib', 'xdist', 'pytest_timeout'):
    assert u.find_spec(name) is not None, name
assert glob.glob(os.path.join(u.find_spec('horovod.tensorflow').submodule_search_locations[0], 'mpi_lib*.so'))
assert m.version('tensorflow-cpu') == '$TF_VERSION' and int(m.version('numpy').split('.')[0]) < 2
assert m.version('torch').split('+')[0] == '$TORCH_VERSION'
assert (m.version('pytest'), m.version('pytest-xdist')) == ('$PYTEST_VERSION', '$XDIST_VERSION')
") >/dev/null 2>&1; then
  native_op quick  # skips importing TensorFlow when the library is newer than its source
  say "already done (remove $STAMP to redo)"
  exit 0
fi

# 1. OpenMPI
if ! command -v mpirun >/dev/null 2>&1 || ! command -v mpicc >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    say "installing OpenMPI from Debian packages"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq libopenmpi-dev openmpi-bin >/dev/null
  else
    echo "setup: OpenMPI is missing. Install it (e.g. 'sudo apt-get install libopenmpi-dev openmpi-bin'"
    echo "       or 'module load openmpi') and run this again." >&2
    exit 1
  fi
fi

# 1b. redis-server (optional: a real Redis for the stream's notifier; its tests skip without it)
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    say "installing redis-server from Debian packages (optional: the stream's Redis notifier)"
    export DEBIAN_FRONTEND=noninteractive
    (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null) \
      || echo "setup: WARNING: redis-server did not install; the Redis tests will skip" >&2
  else
    say "redis-server is not installed (optional; 'sudo apt-get install redis-server' to run the Redis tests)"
  fi
fi

# 1c. iproute2 and util-linux (optional: `ip`, `unshare`, `nsenter` for the namespaced test cluster,
#     tests/cluster/; its tests skip without them or without root)
if ! command -v ip >/dev/null 2>&1 || ! command -v nsenter >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    say "installing iproute2 and util-linux from Debian packages (optional: the test cluster)"
    export DEBIAN_FRONTEND=noninteractive
    (apt-get update -qq && apt-get install -y -qq iproute2 util-linux >/dev/null) \
      || echo "setup: WARNING: iproute2/util-linux did not install; the cluster tests will skip" >&2
  else
    say "ip/nsenter missing (optional; 'sudo apt-get install iproute2 util-linux' for the cluster tests, run as root)"
  fi
fi

# 2. venv + Python packages
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip wheel setuptools
fi
VPY="$VENV/bin/python"
if ! "$VPY" -c "import tensorflow as tf, numpy as np, mpi4py, h5py, pytest, matplotlib, isal, scipy, redis, safetensors, cryptography, hypothesis; assert tf.__version__=='$TF_VERSION'; assert int(np.__version__.split('.')[0])<2" >/dev/null 2>&1; then
  say "installing tensorflow-cpu==$TF_VERSION numpy<2 isal mpi4py h5py pytest matplotlib scipy redis safetensors cryptography hypothesis"
  "$VPY" -m pip install -q "tensorflow-cpu==$TF_VERSION" "numpy<2" isal mpi4py h5py pytest pytest-timeout matplotlib cmake \
    packaging "scipy<1.14" "redis>=5" safetensors cryptography "hypothesis==6.*"
fi

# 2b. pytest-xdist and pytest, pinned together: `make test` runs the suite on several workers (-n,
# --dist loadgroup; tests that share a module-scoped job, or a machine-wide name, are grouped with
# @pytest.mark.xdist_group). pytest 9.2 keeps a test's id in Node._id, where pytest-xdist 3.8 cannot
# add the group to it: every group was then split over the workers (each ran a shared job again).
if ! "$VPY" -c "import xdist, importlib.metadata as m; assert (m.version('pytest'), m.version('pytest-xdist')) == ('$PYTEST_VERSION', '$XDIST_VERSION')" >/dev/null 2>&1; then
  say "installing pytest==$PYTEST_VERSION pytest-xdist==$XDIST_VERSION"
  "$VPY" -m pip install -q "pytest==$PYTEST_VERSION" "pytest-xdist==$XDIST_VERSION"
fi

# 3. Horovod from source
if ! "$VPY" -c "import horovod.tensorflow as h; assert h.mpi_built()" >/dev/null 2>&1; then
  say "building horovod==0.28.1 against TensorFlow 2.15 with MPI (about 2-5 minutes)"
  HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_GLOO=1 \
  HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS=-j2 \
    "$VPY" -m pip install -q --no-cache-dir --no-build-isolation "horovod==0.28.1"
fi

# 3b. PyTorch, CPU build, pinned (deepfreeze.torch; the core never imports it). The numpy<2
# constraint keeps pip from upgrading the numpy TensorFlow 2.15 and Horovod were built against.
if ! "$VPY" -c "import torch, numpy as np; assert torch.__version__.split('+')[0] == '$TORCH_VERSION'; assert int(np.__version__.split('.')[0]) < 2" >/dev/null 2>&1; then
  say "installing torch==$TORCH_VERSION (CPU build) with numpy<2"
  "$VPY" -m pip install -q "torch==$TORCH_VERSION" "numpy<2"
  if "$VPY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" >/dev/null 2>&1; then
    echo "setup: WARNING: pip installed a CUDA build of torch $TORCH_VERSION (several GB); DeepFreeze's" \
         "tests need only the CPU build (install torch==$TORCH_VERSION from PyTorch's CPU-only wheel" \
         "index where it is reachable)" >&2
  fi
fi

# 3c. what the PyTorch integrations and their tests use, pinned beside torch and numpy<2 (only
# deepfreeze.torch.lightning / deepfreeze.torch.hf import the frameworks): Lightning, Hugging Face
# transformers and torchdata's StatefulDataLoader
if ! "$VPY" -c "import pytorch_lightning, transformers, torchdata" >/dev/null 2>&1; then
  say "installing pytorch-lightning==2.6.6 transformers==5.23.0 torchdata==0.11.0 (with torch==$TORCH_VERSION, numpy<2)"
  "$VPY" -m pip install -q "pytorch-lightning==2.6.6" "transformers==5.23.0" "torchdata==0.11.0" \
    "torch==$TORCH_VERSION" "numpy<2"
fi

# 3d. accelerate, which transformers.Trainer needs (deepfreeze.torch.hf's tests), pinned with the same
# constraints (transformers does not install it by itself)
if ! (cd / && "$VPY" -c "import accelerate, transformers.trainer") >/dev/null 2>&1; then
  say "installing accelerate==1.15.0 (transformers.Trainer) with torch==$TORCH_VERSION, numpy<2"
  "$VPY" -m pip install -q "accelerate==1.15.0" "torch==$TORCH_VERSION" "numpy<2"
fi

# 4. the fused-copy op, against the TensorFlow headers Horovod was built with
native_op

# 5. the package itself (checked from / so the checkout itself does not satisfy the import)
if ! (cd / && "$VPY" -c "import deepfreeze.bindings") >/dev/null 2>&1; then
  say "installing deepfreeze (editable)"
  "$VPY" -m pip install -q --no-build-isolation --no-deps -e . >/dev/null
fi

touch "$STAMP"
say "done"
