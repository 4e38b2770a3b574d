"""The training state of a PyTorch model and its optimizers as a tensor list, and the per-rank
state record (no pickling).

Tensor list, in this order (one definition for the checkpointer, ``load`` and ``restore``):

1. the model's ``state_dict`` (DDP's ``module.`` and ``torch.compile``'s ``_orig_mod.``
   prefixes removed: the keys of ``torch.distributed.checkpoint.state_dict.get_state_dict``),
   named by their FQN, with global shapes; a tensor the state dict holds under several FQNs (tied
   weights: ``lm_head.weight`` is ``wte.weight``) is stored once, under its first FQN, and the
   state record's ``a.aliases`` maps each other FQN to it (:attr:`TrainState.aliases`). Parameters are *replicated* (every DDP rank holds them bit-identical
   after each step) and split across ranks; buffers (BatchNorm running statistics) are updated
   by each rank's forward pass and broadcast from rank 0 by DDP at the next one, so they are
   *pinned*: taken whole from rank 0. Under FSDP2 (``fully_shard``) parameters are DTensors
   sharded on dim 0 by ``torch.chunk`` over a 1-D mesh of every rank: each rank captures its
   own local shard, whose flat element range in the global tensor is given to the shard plan
   (:attr:`TrainState.bounds`); HSDP (a 2-D mesh) and tensor parallelism (any other placement)
   are refused with a :class:`~deepfreeze.errors.ConfigError`;
2. every tensor of every optimizer's state, ``optim.state.<fqn>.<key>`` (DCP's flattened name
   of ``get_state_dict``'s optimizer state), replicated (DDP) or sharded as its parameter
   (FSDP2), in the optimizers' parameter order;
3. per rank ``r``, ``_deepfreeze/rank<r>`` (uint8, a reserved capacity), written whole by rank
   ``r``: its *state record*: the optimizers' ``param_groups`` and non-tensor state, the
   schedulers, the GradScaler, the ``state=`` objects and the rank's RNG states.

State record: ``DFTS0001``, a little-endian uint64 JSON length, the JSON tree, then the raw
bytes of the tensors and arrays it refers to; zero padding up to the reserved capacity. The
tree tags every non-JSON value: ``{"d": [[key, value], ...]}`` a dict (any keys), ``{"t":
[...]}`` a tuple, ``{"T": [dtype, shape, offset, nbytes]}`` a CPU tensor, ``{"N": [...]}`` a
numpy array, ``{"b": [offset, nbytes]}`` bytes, ``{"f": "inf"|"-inf"|"nan"}`` a non-finite
float, ``{"dt": name}`` a torch dtype (one of torch's ``torch.dtype`` objects by canonical name:
a fixed allow-list, never another attribute of ``torch``); lists, strings, ints, finite floats,
booleans and null are JSON's. Decoding checks the magic, every length and every (offset,
nbytes) against the record before it reads a byte, the JSON's size and nesting (at most 100
levels) before parsing it, and each tag's shape; any failure is a CorruptCheckpointError.
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

from ..errors import ConfigError, CorruptCheckpointError, DeepFreezeError, ModelMismatchError
from ..jsonsafe import json_depth, loads as bounded_loads
from ..shardplan import TensorSpec

__all__ = ["TrainState", "train_state", "unwrap", "model_entries", "encode", "decode", "dtype_of", "torch_dtype",
           "RANK_PREFIX", "rng_state", "set_rng_state", "as_tensor", "dim0_rows", "local_rows", "is_dtensor",
           "check_layout", "optimizer_groups", "class_name", "check_model",
           "decode_record", "check_groups", "torch_stateful", "check_stateful", "check_recorded_groups"]

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
# the ``{"dt": NAME}`` tag: every real torch dtype by its canonical name (str(dtype) without "torch."),
# a fixed allow-list: never getattr(torch, NAME) of a name read from a record
_ALL_DTYPES = {str(v).replace("torch.", ""): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
_MAX_DEPTH = 100  # nesting of a record's JSON tree (a dict costs 3 levels: {"d": [[k, v]]})


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


# -- FSDP2: DTensors sharded on dim 0

_DTENSOR: "list[Any]" = []  # [DTensor class or None], imported once (an import per tensor cost 2 us each)


def is_dtensor(t: Any) -> bool:
    if not _DTENSOR:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # a torch without distributed
            DTensor = None
        _DTENSOR.append(DTensor)
    return _DTENSOR[0] is not None and isinstance(t, _DTENSOR[0])


def dim0_rows(n: int, world_size: int) -> list[int]:
    """Row bounds of ``torch.chunk(n rows, world_size)`` as FSDP2 shards dim 0: rank r holds rows
    ``[b[r], b[r + 1])`` (chunks of ``ceil(n / world_size)`` rows; trailing ranks may hold none)."""
    c = -(-n // world_size) if n else 0
    return [min(r * c, n) for r in range(world_size)] + [n]


def local_rows(t: torch.Tensor, what: str) -> "tuple[int, int] | None":
    """This rank's dim-0 row range of ``t`` when it is a DTensor FSDP2 shards (``Shard(0)`` on a
    1-D mesh of every rank in order, local shard as ``torch.chunk`` cuts it); None for a plain
    tensor. ConfigError (what, why, what to do) for a layout DeepFreeze does not capture yet."""
    if not is_dtensor(t):
        return None
    from torch.distributed.tensor import Shard
    import torch.distributed as dist
    mesh, placements = t.device_mesh, tuple(t.placements)
    if mesh.ndim != 1:
        raise ConfigError(f"{what} is a DTensor on a {mesh.ndim}-D device mesh {tuple(mesh.shape)} (HSDP or a "
                          "multi-dimensional parallelism): DeepFreeze captures FSDP2 shards on a 1-D mesh of every "
                          "rank only, not yet replicated shard groups. Use fully_shard with a 1-D mesh "
                          "(init_device_mesh(device, (world_size,))) or checkpoint this model with DCP")
    if placements != (Shard(0),):
        raise ConfigError(f"{what} is a DTensor placed {placements}: DeepFreeze captures FSDP2's dim-0 shards "
                          "(Shard(0)) only, not tensor parallelism or other placements yet. Shard the model with "
                          "fully_shard alone (no parallelize_module, no shard_placement_fn) or checkpoint it with DCP")
    world = dist.get_world_size() if dist.is_initialized() else 1
    ranks = mesh.mesh.reshape(-1).tolist()
    if ranks != list(range(world)):
        raise ConfigError(f"{what} is sharded over ranks {ranks[:8]} of a job of {world}: DeepFreeze captures "
                          "shards over a mesh of every rank in order (init_device_mesh(device, (world_size,)))")
    if t.dim() == 0:
        raise ConfigError(f"{what} is a 0-d DTensor sharded on dim 0")
    b = dim0_rows(t.shape[0], world)
    r = mesh.get_local_rank()
    local = t.to_local()
    if tuple(local.shape) != (b[r + 1] - b[r], *t.shape[1:]):
        raise ConfigError(f"{what}: the local shard of rank {r} is {tuple(local.shape)}, not rows [{b[r]}, "
                          f"{b[r + 1]}) of {tuple(t.shape)} as torch.chunk cuts dim 0: DeepFreeze captures "
                          "FSDP2's even chunking only (no shard_placement_fn, no uneven custom sharding)")
    return b[r], b[r + 1]


def _dtensor_buffer(fqn: str) -> ConfigError:
    return ConfigError(f"model buffer {fqn!r} is a DTensor: DeepFreeze captures sharded parameters (and their "
                       "optimizer state) and takes buffers whole from rank 0; keep buffers plain tensors")


def check_layout(model: torch.nn.Module) -> int:
    """ConfigError for a model tensor DeepFreeze cannot capture as laid out (HSDP, tensor
    parallelism: :func:`local_rows`); returns how many are FSDP2-sharded."""
    n = 0
    for fqn, t, is_param in model_entries(model):
        if not is_param and is_dtensor(t):
            raise _dtensor_buffer(fqn)
        n += local_rows(t, f"model tensor {fqn!r}") is not None
    return n


@dataclasses.dataclass
class TrainState:
    """``tensors[i]`` is tensor ``specs[i]`` (for a DTensor: this rank's local shard, a plain
    tensor); ``pinned``: ids taken whole from rank 0; ``model_tensors``: how many leading tensors
    are the model's; ``groups[k]``: optimizer k's param_groups with FQNs for params; ``extra[k]``:
    its non-tensor state, by FQN; ``bounds``: id -> flat element bounds of every rank's shard of
    a DTensor (the shard plan's ``given``); ``dtensors``: id -> the DTensor itself (its
    ``_version`` counts the optimizer's in-place updates); ``fqn_of``: id() of a parameter ->
    its FQN."""

    tensors: list[torch.Tensor]
    specs: list[TensorSpec]
    pinned: list[int]
    model_tensors: int
    groups: list[list[dict[str, Any]]]
    extra: list[dict[str, dict[str, Any]]]
    bounds: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    dtensors: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    fqn_of: dict[int, str] = dataclasses.field(default_factory=dict)
    #: FQN of a tied tensor's other name -> the FQN it is stored under (:func:`_tied`)
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)
    _key: "bytes | None" = dataclasses.field(default=None, repr=False, compare=False)
    #: the optimizer state keys, and the ids, data_ptrs, shapes and dtypes of every live tensor walked,
    #: in order (:func:`_seen`: what :func:`train_state` compares before it reuses this list)
    _seen: "list | None" = dataclasses.field(default=None, repr=False, compare=False)

    def key(self) -> bytes:
        """16 bytes naming the tensor list (names, dtypes, shapes, pinned, sharded): equal on every rank.
        Computed once per tensor list (the list is not changed after :func:`train_state`)."""
        if self._key is None:  # (columns, not a list per tensor: 4x less CPU with 1000s of tensors)
            specs = self.specs
            obj = [[s.name for s in specs], [s.dtype for s in specs], [s.shape for s in specs],
                   sorted(self.pinned), sorted(self.bounds)]
            self._key = hashlib.sha256(json.dumps(obj).encode()).digest()[:16]
        return self._key


def _seen(entries: list[tuple[str, torch.Tensor, bool]], optimizers: Sequence[torch.optim.Optimizer]) -> list:
    """The ids, data_ptrs, shapes and dtypes of the model's state-dict tensors, then of every optimizer
    state tensor in param-group order (and those tensors' state keys): what must be unchanged for a
    tensor list to be reused."""
    ts = [t for _, t, _ in entries]
    keys = []
    tensor = torch.Tensor
    for opt in optimizers:
        state = opt.state
        for g in opt.param_groups:
            for p in g["params"]:
                s = state.get(p)
                if s:
                    for key, v in s.items():
                        if isinstance(v, tensor):
                            ts.append(v)
                            keys.append(key)
    # (columns: one comprehension per attribute costs a third of a tuple per tensor)
    return [keys, list(map(id, ts)), [t.data_ptr() for t in ts], [t.shape for t in ts], [t.dtype for t in ts]]


def train_state(model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                previous: "TrainState | None" = None) -> TrainState:
    """The tensor list (module docstring) of ``model`` and ``optimizers``, with live tensors.
    Call it while the model's parameters are sharded (outside forward and backward: FSDP2 swaps
    unsharded parameters in during them).

    ``previous``: the list this returned last time. When every tensor walked is still the same
    object on the same memory with the same shape and dtype (and no DTensor is involved), its
    tensors, specs and key are reused and only the optimizer groups are taken anew: the checks
    and specs per tensor were most of a capture's CPU with 1000s of tensors. ``previous`` keeps
    those tensors referenced, so their ids cannot be reused by other objects."""
    entries = model_entries(model)
    seen = _seen(entries, optimizers)
    if previous is not None and not previous.dtensors and previous._seen == seen:
        st = dataclasses.replace(previous)  # (a shallow copy: the same lists, never mutated after)
        st.groups, st.extra = optimizer_groups(optimizers, st.fqn_of)
        return st
    st = TrainState([], [], [], 0, [], [])
    st._seen = seen
    st.aliases = _tied(entries)
    for fqn, t, is_param in entries:
        if fqn in st.aliases:  # tied weights: stored once, under the first FQN
            continue
        if t.layout != torch.strided:
            raise ConfigError(f"model tensor {fqn!r} is {t.layout}: DeepFreeze checkpoints dense tensors")
        if not is_param:
            if is_dtensor(t):
                raise _dtensor_buffer(fqn)
            st.pinned.append(len(st.specs))
        st.fqn_of.setdefault(id(t), fqn)
        _add(st, fqn, t, f"model tensor {fqn!r}")
    st.model_tensors = len(st.specs)
    st.groups, st.extra = optimizer_groups(optimizers, st.fqn_of, st)
    return st


def _tied(entries: list[tuple[str, torch.Tensor, bool]]) -> dict[str, str]:
    """Tied weights among a model's state-dict ``entries``: ``{FQN: the FQN it is stored under}``
    for every entry that is the same tensor object as an earlier one (``lm_head.weight`` ->
    ``wte.weight``). The first FQN in ``state_dict`` order is also the name ``get_state_dict``
    gives the parameter's optimizer state (``named_parameters`` order)."""
    first: dict[int, str] = {}
    out = {}
    for fqn, t, _ in entries:
        f = first.setdefault(id(t), fqn)
        if f != fqn:
            out[fqn] = f
    return out


def statefuls(state: "dict[str, Any] | None") -> dict[str, Any]:
    """``state=`` of a Checkpointer or CloneServer, checked: str keys, each value a Stateful
    (``state_dict()`` and ``load_state_dict()``); a copy of the dict."""
    out = dict(state or {})
    for k, obj in out.items():
        if not isinstance(k, str) or not callable(getattr(obj, "state_dict", None)) \
                or not callable(getattr(obj, "load_state_dict", None)):
            raise ConfigError(f"state[{k!r}] must have state_dict() and load_state_dict() (a Stateful), "
                              f"got {type(obj).__name__}")
    return out


def class_name(obj: Any) -> str:
    """The module-qualified class name of ``obj`` (``torch.optim.adamw.AdamW``)."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _add(st: TrainState, name: str, t: torch.Tensor, what: str) -> None:
    tid = len(st.specs)
    rows = local_rows(t, what)
    st.specs.append(TensorSpec(tid, name, dtype_of(t, what), tuple(t.shape)))
    if rows is None:
        st.tensors.append(t)
        return
    import torch.distributed as dist
    per_row = math.prod(t.shape[1:])
    st.bounds[tid] = [b * per_row for b in dim0_rows(t.shape[0], dist.get_world_size())]
    st.dtensors[tid] = t
    with torch.no_grad():
        st.tensors.append(t.to_local())


def optimizer_groups(optimizers: Sequence[torch.optim.Optimizer], fqn_of: dict[int, str],
                     st: "TrainState | None" = None
                     ) -> tuple[list[list[dict[str, Any]]], list[dict[str, dict[str, Any]]]]:
    """Every optimizer's ``param_groups`` with FQNs for params, and its non-tensor state by FQN;
    with ``st``, its state tensors are added to ``st``'s tensor list. ``fqn_of``: id() of a
    parameter -> FQN (from :func:`train_state`: the model's ``state_dict`` is not called here,
    so this runs inside FSDP2's forward too)."""
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
                        if st is not None:
                            name = f"optim.state.{fqn}.{key}"
                            _add(st, name, v, f"optimizer state {name!r}")
                    else:
                        ex.setdefault(fqn, {})[str(key)] = v
            gs.append({**{k2: v for k2, v in g.items() if k2 != "params"}, "params": names})
        groups.append(gs)
        extra.append(ex)
    return groups, extra


# -- RNG states of this process

def rng_state() -> dict[str, Any]:
    """torch's CPU, numpy's and Python's RNG states, and every CUDA device's when this process
    has initialized CUDA (dropout on a GPU draws from those)."""
    st = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    """Set the RNG states :func:`rng_state` took; a state of the wrong kind (a damaged record)
    raises :class:`CorruptCheckpointError` (the states set before it stay set)."""
    try:
        torch.set_rng_state(st["torch"])
        np.random.set_state(st["numpy"])
        random.setstate(st["python"])
        cuda = st.get("cuda")  # (restored only onto as many CUDA devices as it was taken from)
        if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:
        raise CorruptCheckpointError(f"the recorded RNG states are malformed ({type(e).__name__}: "
                                     f"{str(e)[:200]}); the state record is damaged: restore without rng=True "
                                     "or another version") from e


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
        if isinstance(v, torch.dtype) and str(v).replace("torch.", "") in _ALL_DTYPES:
            return {"dt": str(v).replace("torch.", "")}
        raise ConfigError(f"{path} is a {type(v).__name__}, which DeepFreeze does not store (no pickling): a "
                          "state_dict may hold tensors, numpy arrays, numbers, strings, bytes, None, and lists, "
                          "tuples and dicts of them")

    tree = enc(obj, where)
    js = json.dumps(tree, separators=(",", ":"), allow_nan=False).encode()
    if len(js) > _MAX_JSON or json_depth(js) > _MAX_DEPTH:  # never write what decode refuses
        raise ConfigError(f"{where}: the state is nested more than {_MAX_DEPTH} JSON levels deep or its structure "
                          f"takes more than {_MAX_JSON} bytes of JSON: DeepFreeze would not read it back")
    return MAGIC + struct.pack("<Q", len(js)) + js + b"".join(payload)


def decode(data: "bytes | np.ndarray", what: str = "state record") -> Any:
    """Inverse of :func:`encode` (trailing zero padding allowed); every length is checked."""
    buf = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
    if len(buf) < 16 or buf[:8] != MAGIC:
        raise CorruptCheckpointError(f"{what}: not a DeepFreeze state record (bad magic)")
    (n,) = struct.unpack_from("<Q", buf, 8)
    if n > min(_MAX_JSON, len(buf) - 16):
        raise CorruptCheckpointError(f"{what}: JSON length {n} exceeds the record ({len(buf)} bytes)")
    tree = bounded_loads(buf[16:16 + n], f"{what}: the JSON tree", max_bytes=_MAX_JSON, max_depth=_MAX_DEPTH,
                         advice="the state record is damaged: restore another version")
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
            if not (isinstance(x, list) and all(isinstance(kv, list) and len(kv) == 2 for kv in x)):
                raise CorruptCheckpointError(f"{what}: a dict is not a list of [key, value] pairs")
            return {_hashable(dec(k)): dec(val) for k, val in x}
        if tag == "t":
            if not isinstance(x, list):
                raise CorruptCheckpointError(f"{what}: a tuple is not a list")
            return tuple(dec(e) for e in x)
        if tag == "f":
            if x not in ("inf", "-inf", "nan"):
                raise CorruptCheckpointError(f"{what}: bad float {x!r}")
            return float(x)
        if tag == "b":
            if not (isinstance(x, list) and len(x) == 2):
                raise CorruptCheckpointError(f"{what}: bytes are not [offset, nbytes]")
            return bytes(span(*x))
        if tag == "dt":  # a real torch dtype only (never another attribute of torch)
            if type(x) is not str or x not in _ALL_DTYPES:
                raise CorruptCheckpointError(f"{what}: {str(x)[:40]!r} is not a torch dtype")
            return _ALL_DTYPES[x]
        if tag in ("T", "N"):
            if not (isinstance(x, list) and len(x) == 4 and type(x[0]) is str):
                raise CorruptCheckpointError(f"{what}: an array is not [dtype, shape, offset, nbytes]")
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
    except DeepFreezeError:
        raise
    except Exception as e:  # TypeError (an unhashable key), ValueError, RuntimeError (torch's view/reshape)
        raise CorruptCheckpointError(f"{what}: malformed value ({type(e).__name__}: {str(e)[:200]})") from e


def decode_record(data: "bytes | np.ndarray", what: str = "state record") -> dict[str, Any]:
    """A rank's state record (:func:`decode`), its schema checked: a dict whose ``param_groups``
    (a list per optimizer of groups, each a dict with string keys and a ``params`` list of FQNs),
    ``optim_extra`` (a list per optimizer of ``{fqn: {key: value}}``), ``state`` (a dict by
    name) and ``a`` (a dict: ``rank``, ``world_size``, ``rng``, ``state``; ``optimizers`` a list
    of class names, ``aliases`` a dict of FQN to FQN, ``buffers`` a dict of FQN to tensor,
    ``loop`` and ``imported`` dicts, each checked further where it is used) have those types.
    Anything else is a :class:`CorruptCheckpointError`, before a reader trips over it."""
    rec = decode(data, what)

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{what}: {why}; the state record is damaged: restore another version")

    def str_keys(d: Any) -> bool:
        return isinstance(d, dict) and all(isinstance(k, str) for k in d)
    if not str_keys(rec):
        raise bad(f"a {type(rec).__name__}, not a dict with string keys")
    pg = rec.get("param_groups", [])
    if not (isinstance(pg, list) and all(
            isinstance(gs, list) and all(str_keys(g) and isinstance(g.get("params"), list)
                                         and all(isinstance(p, str) for p in g["params"]) for g in gs) for gs in pg)):
        raise bad("'param_groups' is not a list of lists of groups with a 'params' list of names")
    ex = rec.get("optim_extra", [])
    if not (isinstance(ex, list) and all(str_keys(e) and all(str_keys(kv) for kv in e.values()) for e in ex)):
        raise bad("'optim_extra' is not a list of {fqn: {key: value}}")
    a = rec.get("a", {})
    if not str_keys(a):
        raise bad("'a' is not a dict")
    for part in (rec, a):
        if not str_keys(part.get("state", {})):
            raise bad("'state' is not a dict by name")
        if not isinstance(part.get("rng", {}), dict):
            raise bad("'rng' is not a dict")
    opts = a.get("optimizers", [])
    if not (isinstance(opts, list) and all(isinstance(c, str) for c in opts)):
        raise bad("'a.optimizers' is not a list of class names")
    al = a.get("aliases", {})
    if not (str_keys(al) and all(isinstance(v, str) for v in al.values())):
        raise bad("'a.aliases' is not a dict of FQN to FQN")
    buffers = a.get("buffers", {})
    if not (str_keys(buffers) and all(isinstance(v, torch.Tensor) for v in buffers.values())):
        raise bad("'a.buffers' is not a dict of FQN to tensor")
    for key in ("loop", "imported"):
        if not isinstance(a.get(key, {}), dict):
            raise bad(f"'a.{key}' is not a dict")
    return rec


def _hashable(k: Any) -> Any:
    if isinstance(k, list):
        return tuple(_hashable(x) for x in k)
    return k


def check_model(model: torch.nn.Module, manifest_tensors: list[dict], n_model: int, where: str,
                aliases: "dict[str, str] | None" = None, strict: bool = True) -> list[str]:
    """Compare the model's state dict (every FQN, tied ones too) with the checkpoint's model
    tensors (``manifest_tensors[:n_model]``, each alias of ``aliases`` standing for the tensor it
    names). ``strict``: ModelMismatchError naming the first difference; else the sorted FQNs of
    the model that cannot be loaded (absent from the checkpoint, or another dtype or shape)."""
    mine = {f: (dtype_of(t, f), tuple(t.shape)) for f, t, _ in model_entries(model)}
    saved = {t["name"]: (t["dtype"], tuple(t["shape"])) for t in manifest_tensors[:n_model]}
    for alias, target in (aliases or {}).items():
        if target in saved:
            saved[alias] = saved[target]
    if mine == saved:
        return []
    if not strict:
        return sorted(f for f, spec in mine.items() if saved.get(f) != spec)
    if set(mine) != set(saved):
        missing, extra = sorted(set(saved) - set(mine)), sorted(set(mine) - set(saved))
        raise ModelMismatchError(f"{where}: the model's state dict does not match: the checkpoint has "
                                 f"{len(saved)} model tensors, the model {len(mine)}; not in the model: {missing[:5]}; "
                                 f"not in the checkpoint: {extra[:5]}. Build the architecture that was trained "
                                 "(or pass strict=False to load the tensors that match).")
    for f, m in mine.items():
        s = saved[f]
        if m != s:
            raise ModelMismatchError(f"{where}: model tensor {f!r} is {m[0]}{list(m[1])} in the model, "
                                     f"{s[0]}{list(s[1])} in the checkpoint (strict=False loads the tensors that "
                                     "match)")
    return []


# -- kinds of the values a restore hands to torch (issue 41: typed all the way to the optimizer)
#
# A state record that decodes is not yet one torch can use: a learning rate of "0.01", None or a
# dtype, or a scheduler state with an extra ``optimizer`` entry, loads without a word and breaks the
# user's next ``opt.step()``/``sched.step()`` with a raw TypeError or AttributeError from inside
# torch. Before anything is set, every value torch will take is compared with the kind of what it
# replaces (:func:`check_groups`, :func:`check_stateful`; :func:`check_recorded_groups` where no
# optimizer is live: export, ``hf.checkpoint_dir``).

_ABSENT = object()  # a saved dict key the reference lacks
#: None, a bool and a string are one kind where either side is None: torch's optional flags
#: (``foreach``, ``fused``: None or a bool; LBFGS's ``line_search_fn``: None or a name)
_OPTIONAL = ("None", "a bool", "a str")


def _kind(v: Any) -> str:
    """The kind of ``v`` as the checks compare it (and messages name it): a tensor's or array's
    kind includes its dtype and shape, a tuple's or list's its length; an int and a float are
    one kind, "a number" (a bool is not one)."""
    if v is None:
        return "None"
    if isinstance(v, (bool, np.bool_)):
        return "a bool"
    if isinstance(v, torch.Tensor):
        return f"a tensor {str(v.dtype).replace('torch.', '')}{list(v.shape)}"
    if isinstance(v, np.ndarray):
        return f"a numpy array {v.dtype}{list(v.shape)}"
    if isinstance(v, (int, float, np.integer, np.floating)):
        return "a number"
    if isinstance(v, str):
        return "a str"
    if isinstance(v, (tuple, list)):
        return f"a {type(v).__name__} of {len(v)}"
    if isinstance(v, dict):
        return "a dict"
    if isinstance(v, torch.dtype):
        return "a torch dtype"
    if isinstance(v, (bytes, bytearray)):
        return "bytes"
    return f"a {type(v).__name__}"


def _shown(v: Any) -> str:
    """:func:`_kind` of ``v``, with the value when it is short (a scalar, a dtype)."""
    k = _kind(v)
    if v is None or isinstance(v, (tuple, list, dict, torch.Tensor, np.ndarray, bytes, bytearray)):
        return k
    return f"{k} ({str(v)[:40]!r})" if isinstance(v, str) else f"{k} ({str(v)[:40]})"


def _mismatch(saved: Any, ref: Any, path: str, defaults: bool) -> "tuple[str, Any, Any] | None":
    """The first place where ``saved`` is not of ``ref``'s kind: ``(path, saved value, reference
    value)`` (the reference :data:`_ABSENT` for a dict key it lacks), None when all match.
    Tuples and lists of the same length match element by element; a dict's keys must be among
    the reference's, each value of its kind. ``defaults``: ``ref`` is a fresh optimizer's
    default, which is looser: a None default takes any scalar (it is computed later, or optional),
    a number a one-element floating tensor (torch's ``lr``, ``betas`` may be tensors)."""
    if isinstance(ref, (tuple, list)):
        if not isinstance(saved, (tuple, list)) or len(saved) != len(ref):
            return path, saved, ref
        for i, (s, r) in enumerate(zip(saved, ref)):
            m = _mismatch(s, r, f"{path}[{i}]", defaults)
            if m is not None:
                return m
        return None
    if isinstance(ref, dict):
        if not isinstance(saved, dict):
            return path, saved, ref
        for k, s in saved.items():
            if k not in ref:
                return f"{path}[{k!r}]", s, _ABSENT
            m = _mismatch(s, ref[k], f"{path}[{k!r}]", defaults)
            if m is not None:
                return m
        return None
    ks, kr = _kind(saved), _kind(ref)
    if ks == kr or (ks in _OPTIONAL and kr in _OPTIONAL and "None" in (ks, kr)):
        return None
    if defaults and kr == "None" and ks in (*_OPTIONAL, "a number"):
        return None
    if defaults and kr == "a number" and isinstance(saved, torch.Tensor) and saved.numel() == 1 \
            and saved.is_floating_point():
        return None
    return path, saved, ref


def _refuse(where: str, what: str, m: "tuple[str, Any, Any]", reference: str, advice: str) -> CorruptCheckpointError:
    path, saved, ref = m
    if ref is _ABSENT:
        why = f"{path} is {_shown(saved)} in the checkpoint and not a key of {reference}"
    else:
        why = f"{path} is {_shown(saved)} in the checkpoint, {_shown(ref)} in {reference}"
    return CorruptCheckpointError(f"{where}: {what}: {why}, which torch cannot use (the next step would fail "
                                  f"inside torch): the state record is damaged or was edited. {advice}")


def check_groups(saved: Sequence[dict[str, Any]], reference: Sequence[dict[str, Any]], what: str, where: str, *,
                 defaults: bool = False) -> None:
    """The one check of an optimizer's saved ``param_groups`` (restore, the Checkpointer's resume,
    ``clone.receive``: against the live optimizer's groups; export and ``hf.checkpoint_dir``:
    against a fresh optimizer's defaults, ``defaults=True``): each saved value whose key the
    reference group also has is of the reference value's kind (:func:`_mismatch`); keys the
    reference lacks, and ``params``, are not checked. ``what`` names the optimizer;
    CorruptCheckpointError naming it, the group, the key and both kinds."""
    for i, (g, r) in enumerate(zip(saved, reference)):
        for key, v in g.items():
            if key == "params" or key not in r:
                continue
            m = _mismatch(v, r[key], repr(key), defaults)
            if m is not None:
                raise _refuse(where, f"{what}, parameter group {i}", m,
                              "a fresh optimizer of its class (its default)" if defaults else "this run's optimizer",
                              "Nothing was written: use another version" if defaults else
                              "Nothing was changed: restore another version (or build the optimizer as it was "
                              "trained)")


def torch_stateful(obj: Any) -> bool:
    """Whether ``obj`` is one of torch's LR schedulers (``ReduceLROnPlateau`` too) or a
    ``torch.amp.GradScaler`` (``torch.cuda.amp``'s too): what the loop updates after
    ``optimizer.step()``, and whose saved state :func:`check_stateful` checks."""
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
    from torch.amp import GradScaler
    return isinstance(obj, (LRScheduler, ReduceLROnPlateau, GradScaler))


def check_stateful(obj: Any, saved: Any, what: str, where: str) -> None:
    """Before ``obj.load_state_dict(saved)`` of a torch LR scheduler or GradScaler
    (:func:`torch_stateful`): ``saved`` is a dict whose keys are among the live
    ``obj.state_dict()``'s, each value of the live value's kind (:func:`_mismatch`: nested
    dicts, e.g. ``SequentialLR``'s schedulers, alike). A disabled GradScaler loads nothing and
    is not checked. A DeepFreeze object that carries such states inside its own (Lightning's
    state object, :mod:`deepfreeze.torch.lightning`) checks them with its
    ``_deepfreeze_check(saved, what, where)``, which calls this function. Any other object is the user's and passes. CorruptCheckpointError naming
    ``what``, the key and both kinds."""
    if not torch_stateful(obj):
        own = getattr(type(obj), "_deepfreeze_check", None)
        if callable(own):
            own(obj, saved, what, where)
        return
    from torch.amp import GradScaler
    if isinstance(obj, GradScaler) and not obj.is_enabled():
        return
    m = _mismatch(saved, obj.state_dict(), "its state", False)
    if m is not None:
        raise _refuse(where, f"{what} ({class_name(obj)})", m, "this run's state_dict()",
                      "Nothing was changed: restore another version (or build it as it was trained)")


_OPTIMIZERS: "dict[str, type]" = {}  # class_name -> class of every optimizer torch.optim defines (an allow-list)


def _fresh_defaults(name: str) -> "dict[str, Any] | None":
    """The parameter group of a fresh instance of the ``torch.optim`` class recorded as ``name``
    (:func:`class_name`), ``params`` left out; None for a class torch.optim does not define (the
    user's own: its defaults are unknown) or one that cannot be built on a 2-D parameter."""
    if not _OPTIMIZERS:
        _OPTIMIZERS.update({f"{c.__module__}.{c.__qualname__}": c for c in vars(torch.optim).values()
                            if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)
                            and c is not torch.optim.Optimizer})
    cls = _OPTIMIZERS.get(name)
    if cls is None:
        return None
    try:
        group = cls([torch.nn.Parameter(torch.zeros(2, 2))]).param_groups[0]
    except Exception:  # (an optimizer whose constructor needs more than parameters)
        return None
    return {k: v for k, v in group.items() if k != "params"}


def check_recorded_groups(record: dict[str, Any], where: str) -> None:
    """Where no optimizer is live (``export --format torch|dcp``, ``hf.checkpoint_dir``, the DCP
    :class:`~deepfreeze.torch.Reader`): every optimizer's saved ``param_groups`` in a state
    record (:func:`decode_record`) against the defaults of a fresh instance of its recorded
    ``torch.optim`` class (:func:`check_groups` with ``defaults=True``); optimizers of another
    class, or of a version that recorded none, pass as before."""
    classes = record.get("a", {}).get("optimizers") or []
    for k, (name, groups) in enumerate(zip(classes, record.get("param_groups", []))):
        defaults = _fresh_defaults(name)
        if defaults is not None:
            check_groups(groups, [defaults] * len(groups), f"optimizer {k} ({name})", where, defaults=True)
