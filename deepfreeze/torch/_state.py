"""The training state of a PyTorch model and its optimizers as a tensor list, and the per-rank
state record (no pickling).

Tensor list, in this order (one definition for the checkpointer, ``load`` and ``restore``):

1. the model's ``state_dict`` (DDP's ``module.`` and ``torch.compile``'s ``_orig_mod.``
   prefixes removed: the keys of ``torch.distributed.checkpoint.state_dict.get_state_dict``),
   named by their FQN. Parameters are *replicated* (every DDP rank holds them bit-identical
   after each step) and split across ranks; buffers (BatchNorm running statistics) are updated
   by each rank's forward pass and broadcast from rank 0 by DDP at the next one, so they are
   *pinned*: taken whole from rank 0;
2. every tensor of every optimizer's state, ``optim.state.<fqn>.<key>`` (DCP's flattened name
   of ``get_state_dict``'s optimizer state), replicated, in the optimizers' parameter order;
3. per rank ``r``, ``_deepfreeze/rank<r>`` (uint8, a reserved capacity), written whole by rank
   ``r``: its *state record*: the optimizers' ``param_groups`` and non-tensor state, the
   schedulers, the GradScaler, the ``state=`` objects and the rank's RNG states.

State record: ``DFTS0001``, a little-endian uint64 JSON length, the JSON tree, then the raw
bytes of the tensors and arrays it refers to; zero padding up to the reserved capacity. The
tree tags every non-JSON value: ``{"d": [[key, value], ...]}`` a dict (any keys), ``{"t":
[...]}`` a tuple, ``{"T": [dtype, shape, offset, nbytes]}`` a CPU tensor, ``{"N": [...]}`` a
numpy array, ``{"b": [offset, nbytes]}`` bytes, ``{"f": "inf"|"-inf"|"nan"}`` a non-finite
float; lists, strings, ints, finite floats, booleans and null are JSON's. Decoding checks the
magic, every length and every (offset, nbytes) against the record before it reads a byte.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import struct
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import ConfigError, CorruptCheckpointError, ModelMismatchError
from ..shardplan import TensorSpec

__all__ = ["TrainState", "train_state", "unwrap", "model_entries", "encode", "decode", "dtype_of", "torch_dtype",
           "RANK_PREFIX", "rng_state", "set_rng_state", "as_tensor"]

RANK_PREFIX = "_deepfreeze/rank"
MAGIC = b"DFTS0001"
_MAX_JSON = 64 << 20

_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16", torch.bfloat16: "bfloat16",
           torch.int8: "int8", torch.int16: "int16", torch.int32: "int32", torch.int64: "int64",
           torch.uint8: "uint8", torch.bool: "bool", torch.complex64: "complex64", torch.complex128: "complex128"}
for _n in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _n):
        _DTYPES[getattr(torch, _n)] = _n
_TORCH = {v: k for k, v in _DTYPES.items()}


def dtype_of(t: torch.Tensor, what: str) -> str:
    try:
        return _DTYPES[t.dtype]
    except KeyError:
        raise ConfigError(f"{what} has dtype {t.dtype}, which DeepFreeze cannot store "
                          f"(supported: {', '.join(sorted(_TORCH))})") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _TORCH[name]
    except KeyError:
        raise CorruptCheckpointError(f"unsupported dtype {name!r} in a checkpoint") from None


def as_tensor(a: np.ndarray, dtype: str) -> torch.Tensor:
    """A CPU tensor of the numpy array ``a`` (any dtype, bfloat16 included), sharing its memory
    when it is writable, else a copy."""
    shape = np.shape(a)  # (ascontiguousarray makes a 0-d array 1-d)
    a = np.ascontiguousarray(a)
    if not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(a.reshape(-1).view(np.uint8)).view(torch_dtype(dtype)).reshape(shape)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    from torch.nn.parallel import DistributedDataParallel
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def model_entries(model: torch.nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """(FQN, live tensor, is a parameter) of every entry of the model's state dict, in its order."""
    out = []
    for fqn, t in unwrap(model).state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"model state {fqn!r} is a {type(t).__name__}, not a tensor: DeepFreeze checkpoints "
                              "tensors (keep other module state in a Stateful object passed as state=)")
        out.append((fqn, t, isinstance(t, torch.nn.Parameter)))
    return out


@dataclasses.dataclass
class TrainState:
    """``tensors[i]`` is tensor ``specs[i]``; ``pinned``: ids taken whole from rank 0;
    ``model_tensors``: how many leading tensors are the model's; ``groups[k]``: optimizer k's
    param_groups with FQNs for params; ``extra[k]``: its non-tensor state, by FQN."""

    tensors: list[torch.Tensor]
    specs: list[TensorSpec]
    pinned: list[int]
    model_tensors: int
    groups: list[list[dict[str, Any]]]
    extra: list[dict[str, dict[str, Any]]]

    def key(self) -> bytes:
        """16 bytes naming the tensor list (names, dtypes, shapes, pinned): equal on every rank."""
        obj = [[s.name, s.dtype, list(s.shape)] for s in self.specs] + [sorted(self.pinned)]
        return hashlib.sha256(json.dumps(obj).encode()).digest()[:16]


def train_state(model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> TrainState:
    """The tensor list (module docstring) of ``model`` and ``optimizers``, with live tensors."""
    tensors, specs, pinned = [], [], []
    fqn_of: dict[int, str] = {}
    for fqn, t, is_param in model_entries(model):
        if t.layout != torch.strided:
            raise ConfigError(f"model tensor {fqn!r} is {t.layout}: DeepFreeze checkpoints dense tensors")
        if not is_param:
            pinned.append(len(specs))
        fqn_of.setdefault(id(t), fqn)
        specs.append(TensorSpec(len(specs), fqn, dtype_of(t, f"model tensor {fqn!r}"), tuple(t.shape)))
        tensors.append(t)
    n_model = len(specs)
    groups, extra = [], []
    for k, opt in enumerate(optimizers):
        gs, ex = [], {}
        for g in opt.param_groups:
            names = []
            for p in g["params"]:
                fqn = fqn_of.get(id(p))
                if fqn is None:
                    raise ConfigError(f"optimizer {k} ({type(opt).__name__}) updates a tensor of shape {tuple(p.shape)} "
                                      "that is not a parameter of the model: give the Checkpointer the model whose "
                                      "parameters the optimizer updates")
                names.append(fqn)
                for key, v in opt.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        name = f"optim.state.{fqn}.{key}"
                        specs.append(TensorSpec(len(specs), name, dtype_of(v, f"optimizer state {name!r}"),
                                                tuple(v.shape)))
                        tensors.append(v)
                    else:
                        ex.setdefault(fqn, {})[str(key)] = v
            gs.append({**{k2: v for k2, v in g.items() if k2 != "params"}, "params": names})
        groups.append(gs)
        extra.append(ex)
    return TrainState(tensors, specs, pinned, n_model, groups, extra)


# -- RNG states of this process

def rng_state() -> dict[str, Any]:
    """torch's CPU, numpy's and Python's RNG states, and every CUDA device's when this process
    has initialized CUDA (dropout on a GPU draws from those)."""
    st = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    cuda = st.get("cuda")  # (restored only onto as many CUDA devices as it was taken from)
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


# -- the state record codec

def encode(obj: Any, where: str = "state") -> bytes:
    """The state record of ``obj`` (module docstring). ConfigError naming the path of a value
    that cannot be stored (a function, an arbitrary object)."""
    payload: list[bytes] = []
    pos = [0]

    def blob(data: bytes) -> list[int]:
        off = pos[0]
        payload.append(data)
        pos[0] += len(data)
        return [off, len(data)]

    def enc(v: Any, path: str) -> Any:
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            return int(v)
        if isinstance(v, float):
            return v if math.isfinite(v) else {"f": repr(v)}
        if isinstance(v, torch.Tensor):
            t = v.detach()
            if t.layout != torch.strided:
                raise ConfigError(f"{path}: a {t.layout} tensor cannot be stored")
            t = t.cpu().contiguous()
            d = dtype_of(t, path)
            data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            return {"T": [d, list(t.shape), *blob(data)]}
        if isinstance(v, np.ndarray):
            a = np.ascontiguousarray(v)
            from ..format import dtype_name
            try:
                d = dtype_name(a.dtype)
            except Exception:
                raise ConfigError(f"{path}: a numpy array of dtype {a.dtype} cannot be stored") from None
            return {"N": [d, list(a.shape), *blob(a.tobytes())]}
        if isinstance(v, np.generic):
            return enc(v.item(), path)
        if isinstance(v, (bytes, bytearray)):
            return {"b": blob(bytes(v))}
        if isinstance(v, tuple):
            return {"t": [enc(x, f"{path}[{i}]") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [enc(x, f"{path}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, dict):
            return {"d": [[enc(k, f"{path} key"), enc(x, f"{path}[{k!r}]")] for k, x in v.items()]}
        if isinstance(v, torch.dtype):
            return {"dt": str(v).replace("torch.", "")}
        raise ConfigError(f"{path} is a {type(v).__name__}, which DeepFreeze does not store (no pickling): a "
                          "state_dict may hold tensors, numpy arrays, numbers, strings, bytes, None, and lists, "
                          "tuples and dicts of them")

    tree = enc(obj, where)
    js = json.dumps(tree, separators=(",", ":"), allow_nan=False).encode()
    return MAGIC + struct.pack("<Q", len(js)) + js + b"".join(payload)


def decode(data: "bytes | np.ndarray", what: str = "state record") -> Any:
    """Inverse of :func:`encode` (trailing zero padding allowed); every length is checked."""
    buf = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
    if len(buf) < 16 or buf[:8] != MAGIC:
        raise CorruptCheckpointError(f"{what}: not a DeepFreeze state record (bad magic)")
    (n,) = struct.unpack_from("<Q", buf, 8)
    if n > min(_MAX_JSON, len(buf) - 16):
        raise CorruptCheckpointError(f"{what}: JSON length {n} exceeds the record ({len(buf)} bytes)")
    try:
        tree = json.loads(buf[16:16 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpointError(f"{what}: malformed JSON: {e}") from e
    payload = memoryview(buf)[16 + n:]

    def span(off: Any, nb: Any) -> memoryview:
        if not (type(off) is int and type(nb) is int and 0 <= off and 0 <= nb and off + nb <= len(payload)):
            raise CorruptCheckpointError(f"{what}: a value at offset {off!r}, {nb!r} bytes lies outside the record")
        return payload[off:off + nb]

    def shape_of(s: Any, itemsize: int, nb: int) -> tuple[int, ...]:
        if not (isinstance(s, list) and all(type(x) is int and x >= 0 for x in s)):
            raise CorruptCheckpointError(f"{what}: bad shape {s!r}")
        if math.prod(s) * itemsize != nb:
            raise CorruptCheckpointError(f"{what}: shape {s} does not match {nb} bytes")
        return tuple(s)

    def dec(v: Any) -> Any:
        if isinstance(v, list):
            return [dec(x) for x in v]
        if not isinstance(v, dict):
            return v
        if len(v) != 1:
            raise CorruptCheckpointError(f"{what}: malformed value {str(v)[:80]}")
        (tag, x), = v.items()
        if tag == "d":
            return {_hashable(dec(k)): dec(val) for k, val in x}
        if tag == "t":
            return tuple(dec(e) for e in x)
        if tag == "f":
            if x not in ("inf", "-inf", "nan"):
                raise CorruptCheckpointError(f"{what}: bad float {x!r}")
            return float(x)
        if tag == "b":
            return bytes(span(*x))
        if tag == "dt":
            return torch_dtype(x) if x in _TORCH else getattr(torch, str(x))
        if tag in ("T", "N"):
            d, s, off, nb = x
            from ..format import dtype_itemsize, numpy_dtype
            raw = span(off, nb)
            shape = shape_of(s, dtype_itemsize(d), nb)
            arr = np.frombuffer(raw, dtype=np.uint8).copy()
            if tag == "N":
                return arr.view(numpy_dtype(d)).reshape(shape)
            return torch.from_numpy(arr).view(torch_dtype(d)).reshape(shape)
        raise CorruptCheckpointError(f"{what}: unknown tag {tag!r}")

    try:
        return dec(tree)
    except (TypeError, ValueError) as e:
        if isinstance(e, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(f"{what}: malformed value: {e}") from e


def _hashable(k: Any) -> Any:
    if isinstance(k, list):
        return tuple(_hashable(x) for x in k)
    return k


def check_model(model: torch.nn.Module, manifest_tensors: list[dict], n_model: int, where: str) -> None:
    """ModelMismatchError naming the first model tensor that differs from the checkpoint's."""
    mine = [(f, dtype_of(t, f), tuple(t.shape)) for f, t, _ in model_entries(model)]
    saved = [(t["name"], t["dtype"], tuple(t["shape"])) for t in manifest_tensors[:n_model]]
    if mine == saved:
        return
    names = {m[0] for m in mine}, {s[0] for s in saved}
    if names[0] != names[1]:
        missing, extra = sorted(names[1] - names[0]), sorted(names[0] - names[1])
        raise ModelMismatchError(f"{where}: the model's state dict does not match: the checkpoint has "
                                 f"{len(saved)} model tensors, the model {len(mine)}; not in the model: {missing[:5]}; "
                                 f"not in the checkpoint: {extra[:5]}. Build the architecture that was trained.")
    for m, s in zip(mine, sorted(saved, key=lambda s: [x[0] for x in mine].index(s[0]))):
        if m != s:
            raise ModelMismatchError(f"{where}: model tensor {m[0]!r} is {m[1]}{list(m[2])} in the model, "
                                     f"{s[1]}{list(s[2])} in the checkpoint")
