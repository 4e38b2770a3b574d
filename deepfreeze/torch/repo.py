"""PyTorch adapter of the model repository: :func:`store_model` and :func:`load_into`.

The graph of an ``nn.Module`` is read with ``torch.fx`` (symbolic tracing, in eval mode, nothing
run): every placeholder, call of a module, function or method, and read of a parameter is a node
of the framework-neutral graph of :mod:`deepfreeze.repo.ids`, which gives every node its stable
id, the same scheme every adapter uses. A *layer* is a module fx calls whole (a leaf module, or a ``torch.nn``
module fx does not trace into, such as ``MultiheadAttention``) holding parameters or persistent
buffers; its weights are its ``state_dict()`` entries, in their order. A parameter or buffer
registered directly on a container is a layer of its own (named by its FQN). Where fx cannot
trace the module (data-dependent control flow), a documented structural fallback is used
(:func:`module_graph`). A load matches layers by id, never by attribute name, or by an explicit
``mapping=`` or ``match="shape"``; or, asked for with ``match="name"``, by the qualified names the
stored graph records, without tracing the target (:func:`_walk_layers` finds its layers by the same
rule). Guide: docs/torch-siblings.md ("Model repository") and docs/repository.md.
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx

from ..errors import ConfigError, ModelMismatchError, RepositoryError
from ..format import numpy_dtype
from ..repo.graph import tensor_key
from ..repo.ids import Node, build_graph, build_meta, canonical_config, compute_ids
from ..repo.loading import (TORCH_CLASS_PREFIX, LoadReport, NamedKey, check_mapped_specs, mapping_target,
                            pair_by_shape, signature, stored_graph)
from ._state import as_tensor, dtype_of, unwrap

__all__ = ["ModuleGraph", "module_graph", "store_model", "load_into", "IGNORED_ATTRIBUTES"]

P = TORCH_CLASS_PREFIX
#: node class names of the graph kinds: a model input of a traced graph, of the call-order
#: fallback and of the registration-order fallback (so ids of different kinds never match)
INPUT_CLASSES = {"fx": P + "input", "calls": P + "input/calls", "registration": P + "input/registration"}

IGNORED_ATTRIBUTES = frozenset({"training", "inplace", "momentum"})
"""Module attributes left out of a layer's id: the mode, whether an op overwrites its input, and
how BatchNorm's running statistics are updated in training (none changes what the weights
compute). Attributes starting with ``_`` are left out too, and so are values that are not plain
(numbers, strings, booleans, None, dtypes, and lists, tuples and dicts of them)."""
_IGNORED_KWARGS = ("training", "inplace")   # call arguments left out of a call site's id


@dataclass
class ModuleGraph:
    """An ``nn.Module``'s neutral graph and ids (what :func:`module_graph` returns).

    ``nodes``/``outputs``/``inputs``/``ids``: the :func:`deepfreeze.repo.ids.compute_ids` graph
    (keys are ints); ``names[k]``: the name of node ``k`` (a module's qualified name, a direct
    parameter's FQN, else a label); ``tensors[k]``: the live parameters and buffers of the layer
    ``k`` in weight order (only layers are in it); ``layer_keys``: the keys of the layers, and
    ``modules``: (qualified name, key or None) of every module called whole, stateless ones with
    None, in graph order; ``aliases``: every qualified name of a layer (a module registered twice
    has two) -> its key; ``objects``: ``id()`` of a layer's module or a direct entry's tensor ->
    key; ``paths``: ``id()`` of every submodule -> its qualified names; ``kind``: ``"fx"``,
    ``"calls"`` or ``"registration"``."""
    nodes: dict[int, Node]
    outputs: list[int]
    inputs: list[int]
    ids: dict[int, str]
    names: dict[int, str]
    tensors: dict[int, list[torch.Tensor]]
    modules: list[tuple[str, int | None]]
    aliases: dict[str, int]
    objects: dict[int, int]
    kind: str = "fx"
    layer_keys: list[int] = field(default_factory=list)
    paths: dict[int, list[str]] = field(default_factory=dict)

    def graph(self) -> tuple[dict[str, Any], list[int]]:
        """The plain-data graph (each layer with weights named: a module's qualified name, a
        direct entry's FQN) and the node keys in its layer order."""
        return build_graph(self.nodes, self.outputs, self.ids,
                           {k: self.names[k] for k in self.layer_keys if self.names[k]})

    def meta(self) -> dict[str, dict[str, Any]]:
        """Layer metadata per id (:func:`deepfreeze.repo.ids.build_meta`)."""
        return build_meta(self.nodes, self.ids)


# -- plain values of attributes and call arguments

class _NotPlain(Exception):
    pass


def _plain(v: Any) -> Any:
    """``v`` as a JSON value, :class:`_NotPlain` when it has none."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"__float__": repr(v)}
    if isinstance(v, torch.dtype):
        return {"__dtype__": str(v)}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {k: _plain(x) for k, x in v.items()}
    raise _NotPlain


def _module_config(m: torch.nn.Module) -> dict[str, Any]:
    """The weight-relevant attributes of a module: its public plain attributes (``in_features``,
    ``kernel_size``, ``eps``, a custom module's ``scale``) less :data:`IGNORED_ATTRIBUTES`."""
    out = {}
    for k, v in vars(m).items():
        if k.startswith("_") or k in IGNORED_ATTRIBUTES:
            continue
        try:
            out[k] = _plain(v)
        except _NotPlain:
            continue
    return out


def _arg(v: Any, tensors: list[torch.fx.Node]) -> Any:
    """A call argument as a JSON value; an fx node (a tensor or a value computed in the graph)
    becomes ``{"__tensor__": i}`` and is appended to ``tensors``."""
    if isinstance(v, torch.fx.Node):
        tensors.append(v)
        return {"__tensor__": len(tensors) - 1}
    if isinstance(v, (list, tuple)):
        return [_arg(x, tensors) for x in v]
    if isinstance(v, dict):
        return {str(k): _arg(x, tensors) for k, x in v.items()}
    if isinstance(v, slice):
        return {"__slice__": [_arg(v.start, tensors), _arg(v.stop, tensors), _arg(v.step, tensors)]}
    if v is Ellipsis:
        return {"__ellipsis__": True}
    if isinstance(v, torch.device):
        return {"__device__": None}   # where a value lives, not what it is
    try:
        return _plain(v)
    except _NotPlain:
        return {"__object__": type(v).__qualname__}


def _site(args: tuple, kwargs: dict, always: bool) -> tuple[Any, list[torch.fx.Node]]:
    """(the call site's JSON form or None, its fx node inputs in order). A module call passing
    only nodes has no site (None) unless ``always``."""
    tensors: list[torch.fx.Node] = []
    a = _arg(list(args), tensors)
    kw = _arg({k: v for k, v in kwargs.items() if k not in _IGNORED_KWARGS}, tensors)
    if not always and all(isinstance(x, torch.fx.Node) for x in args) and not kw:
        return None, tensors
    return {"args": a, "kwargs": kw}, tensors


def _config(config: dict[str, Any], site: Any, where: str) -> bytes:
    try:
        return canonical_config(config, None if site is None else [site])
    except RepositoryError as e:
        raise RepositoryError(f"{where}: {e}") from e


# -- the graph

class _Tracer(torch.fx.Tracer):
    """fx's tracer, with every module without children a leaf (a custom layer holding its own
    parameters is called whole, as ``torch.nn``'s are)."""

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return next(m.children(), None) is None or super().is_leaf_module(m, module_qualified_name)


class _Builder:
    """Collects the nodes of one module's graph."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.root = root
        self.nodes: dict[int, Node] = {}
        self.names: dict[int, str] = {}
        self.tensors: dict[int, list[torch.Tensor]] = {}
        self.modules: list[tuple[str, int | None]] = []
        self.layer_of: dict[int, int] = {}         # id(module) -> key of its layer node
        self.param_of: dict[str, int] = {}         # direct entry FQN -> key
        self.entries = {fqn: t for fqn, t in root.state_dict(keep_vars=True).items()}
        self.first_name: dict[int, str] = {}      # id(module) -> its first qualified name
        self.names_of: dict[int, list[str]] = {}
        for q, m in root.named_modules(remove_duplicate=False):
            self.first_name.setdefault(id(m), q)
            self.names_of.setdefault(id(m), []).append(q)

    def add(self, class_name: str, config: bytes, weights: list[torch.Tensor], calls: list[list[int]],
            name: str) -> int:
        k = len(self.nodes)
        specs = [(tuple(int(d) for d in t.shape), dtype_of(t, f"{name} ({class_name})")) for t in weights]
        self.nodes[k] = Node(class_name, config, specs, calls)
        self.names[k] = name
        if weights:
            self.tensors[k] = list(weights)
        return k

    def state(self, m: torch.nn.Module) -> list[torch.Tensor]:
        sd = m.state_dict(keep_vars=True)
        for q, t in sd.items():
            if not isinstance(t, torch.Tensor):
                raise RepositoryError(f"module {self.first_name.get(id(m), '?')!r}: state {q!r} is a "
                                      f"{type(t).__name__}, not a tensor; store_model stores tensors only")
        return list(sd.values())

    def layer(self, m: torch.nn.Module, calls: list[list[int]], site: Any) -> int:
        """The node of a module's first call (or of a module never called: no calls)."""
        q = self.first_name.get(id(m), "?")
        cfg = _config(_module_config(m), site, f"module {q!r} ({type(m).__name__})")
        k = self.add(P + type(m).__name__, cfg, self.state(m), calls, q)
        self.layer_of[id(m)] = k
        return k

    def again(self, m: torch.nn.Module, first: int, calls: list[list[int]], site: Any) -> int:
        """A later call of a module with weights: a node without weights that takes the module's
        first call as one more input (so a module fed by its own output makes no cycle)."""
        q = self.first_name.get(id(m), "?")
        cfg = _config({"__again__": True, **_module_config(m)}, site, f"module {q!r}")
        site_inputs = [list(calls[0]) + [first]] if calls else [[first]]
        return self.add(P + type(m).__name__, cfg, [], site_inputs, f"{q} (call)")

    def unused(self) -> None:
        """Layers and direct entries the graph never reaches: nodes without inputs."""
        covered = {id(t) for ts in self.tensors.values() for t in ts}
        for q, m in self.root.named_modules():
            if id(m) in self.layer_of or next(m.children(), None) is not None:
                continue
            if any(id(t) not in covered for t in m.state_dict(keep_vars=True).values()):
                self.layer(m, [], None)
                covered.update(id(t) for t in self.tensors[self.layer_of[id(m)]])
        for fqn, t in self.entries.items():
            if id(t) not in covered:
                self.param(fqn, t)
                covered.add(id(t))

    def param(self, fqn: str, t: torch.Tensor) -> int:
        k = self.param_of.get(fqn)
        if k is None:
            kind = "parameter" if isinstance(t, torch.nn.Parameter) else "buffer"
            k = self.param_of[fqn] = self.add(P + kind, canonical_config({}), [t], [], fqn)
        return k


def _owner(root: torch.nn.Module, target: str) -> tuple[torch.nn.Module | None, str]:
    mod, _, attr = target.rpartition(".")
    try:
        return (root.get_submodule(mod) if mod else root), attr
    except AttributeError:
        return None, attr


def _fx_graph(b: _Builder, root: torch.nn.Module) -> tuple[list[int], list[int]]:
    """Nodes of the fx trace of ``root`` (in eval mode); returns (outputs, inputs)."""
    before = set(vars(root))
    modes = [(m, m.training) for m in root.modules()]
    root.eval()
    try:
        graph = _Tracer().trace(root)
    finally:
        for m, mode in modes:
            m.training = mode
        for extra in set(vars(root)) - before:  # constants fx attached to the module it traced
            delattr(root, extra)
    key: dict[torch.fx.Node, int] = {}
    inputs: list[int] = []
    outputs: list[int] = []
    for n in graph.nodes:
        if n.op == "placeholder":
            key[n] = b.add(INPUT_CLASSES["fx"], canonical_config({}), [], [], f"input {n.target}")
            inputs.append(key[n])
        elif n.op == "get_attr":
            key[n] = _get_attr(b, root, n)
        elif n.op == "call_module":
            m = root.get_submodule(n.target)
            site, ins = _site(n.args, n.kwargs, False)
            calls = [[key[i] for i in ins]]
            weights = b.state(m)
            q = b.first_name.get(id(m), n.target)
            if not weights:
                key[n] = b.add(P + type(m).__name__, _config(_module_config(m), site, f"module {q!r}"), [], calls,
                               f"{q} (call)")
                b.modules.append((q, None))
            elif id(m) in b.layer_of:
                first = b.layer_of[id(m)]
                if b.nodes[first].calls:
                    key[n] = b.again(m, first, calls, site)
                else:   # its weight was read before its first call: that node gets the call
                    key[n] = first
                    b.nodes[first] = b.nodes[first]._replace(calls=calls, config=_config(
                        _module_config(m), site, f"module {q!r}"))
                    b.modules.append((q, first))
            else:
                key[n] = b.layer(m, calls, site)
                b.modules.append((q, key[n]))
        elif n.op in ("call_function", "call_method"):
            site, ins = _site(n.args, n.kwargs, True)
            fn = n.target if n.op == "call_method" else getattr(n.target, "__name__", type(n.target).__name__)
            cls = P + ("method:" if n.op == "call_method" else "function:") + str(fn)
            key[n] = b.add(cls, _config({}, site, f"{n.op} {fn}"), [], [[key[i] for i in ins]], f"{fn} (call)")
        elif n.op == "output":
            _site_json, ins = _site(n.args, n.kwargs, True)
            outputs.extend(key[i] for i in ins)
    return outputs, inputs


def _get_attr(b: _Builder, root: torch.nn.Module, n: torch.fx.Node) -> int:
    """A read of a parameter or buffer: of a layer, a node taking the layer as input (which
    weight in the config); of a container, the entry's own node; any other tensor attribute, a
    constant node (its shape and dtype)."""
    owner, attr = _owner(root, n.target)
    t = getattr(owner, attr, None) if owner is not None else None
    if owner is not None and next(owner.children(), None) is None and isinstance(t, torch.Tensor):
        weights = b.state(owner)
        idx = next((j for j, w in enumerate(weights) if w is t), None)
        if idx is not None:
            lk = b.layer_of.get(id(owner))
            if lk is None:
                lk = b.layer(owner, [], None)
            cfg = canonical_config({"weight": idx})
            return b.add(P + "weight", cfg, [], [[lk]], f"{n.target} (read)")
    if n.target in b.entries:
        return b.param(n.target, b.entries[n.target])
    shape = list(t.shape) if isinstance(t, torch.Tensor) else None
    dt = str(t.dtype) if isinstance(t, torch.Tensor) else type(t).__qualname__
    return b.add(P + "constant", canonical_config({"shape": shape, "dtype": dt}), [], [], f"{n.target} (constant)")


def _flat_tensors(v: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(reversed(x))
        elif isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
    return out


def _hooks_graph(b: _Builder, root: torch.nn.Module, example_inputs: Any) -> tuple[list[int], list[int]]:
    """The call-order fallback: run ``root`` on ``example_inputs`` (eval mode, no grad) with a
    forward hook on every module without children; a call's inputs are the calls (or model
    inputs) that produced its input tensors (the same tensor objects), else the call just before
    it. Functions between modules are not seen."""
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    inputs = []
    producer: dict[int, int] = {}
    for t in _flat_tensors(args):
        k = b.add(INPUT_CLASSES["calls"], canonical_config({}), [], [], f"input {len(inputs)}")
        inputs.append(k)
        producer[id(t)] = k
    keep: list[Any] = list(args)   # every tensor seen stays alive: ids are never reused
    last = [inputs[-1] if inputs else None]

    def hook(m: torch.nn.Module, a: tuple, out: Any) -> None:
        ins = [producer[id(t)] for t in _flat_tensors(a) if id(t) in producer]
        if not ins and last[0] is not None:
            ins = [last[0]]
        calls = [list(dict.fromkeys(ins))]
        q = b.first_name.get(id(m), "?")
        weights = b.state(m)
        if not weights:
            k = b.add(P + type(m).__name__, _config(_module_config(m), None, f"module {q!r}"), [], calls,
                      f"{q} (call)")
            b.modules.append((q, None))
        elif id(m) in b.layer_of:
            k = b.again(m, b.layer_of[id(m)], calls, None)
        else:
            k = b.layer(m, calls, None)
            b.modules.append((q, k))
        keep.append(out)
        for t in _flat_tensors(out):
            producer[id(t)] = k
        last[0] = k

    modes = [(m, m.training) for m in root.modules()]
    handles = [m.register_forward_hook(hook) for m in root.modules() if next(m.children(), None) is None]
    root.eval()
    try:
        with torch.no_grad():
            out = root(*args)
    finally:
        for h in handles:
            h.remove()
        for m, mode in modes:
            m.training = mode
    outs = [producer[id(t)] for t in _flat_tensors(out) if id(t) in producer]
    keep.clear()
    if not outs and last[0] is not None:
        outs = [last[0]]
    return list(dict.fromkeys(outs)), inputs


def _registration_graph(b: _Builder, root: torch.nn.Module) -> tuple[list[int], list[int]]:
    """The registration-order fallback: the modules without children holding state, a chain in
    ``named_modules()`` order from one model input."""
    prev = b.add(INPUT_CLASSES["registration"], canonical_config({}), [], [], "input 0")
    inputs = [prev]
    for q, m in root.named_modules():
        if next(m.children(), None) is None and b.state(m) and id(m) not in b.layer_of:
            prev = b.layer(m, [[prev]], None)
            b.modules.append((q, prev))
    return [prev], inputs


def module_graph(module: torch.nn.Module, example_inputs: Any = None) -> ModuleGraph:
    """The neutral graph of ``module`` (DDP and ``torch.compile`` wrappers unwrapped) and its ids.

    ``torch.fx`` symbolic tracing in eval mode (nothing runs; the modes are restored). Where it
    cannot trace (a ``TraceError``, or any error of the module's ``forward`` under tracing) the
    fallback is structural: with ``example_inputs`` (a tensor or a tuple of the forward's
    arguments) the module runs once on them (eval mode, ``torch.no_grad()``) and a forward hook
    on every module without children records the calls in call order (a call's inputs are the
    calls that produced its input tensors, else the call before it); without them the layers
    form a chain in registration order. The kind used is ``ModuleGraph.kind``; ids of different
    kinds never match (their model inputs have other classes). Layers the graph never reaches
    (unused modules, parameters never read) are nodes without inputs.
    :class:`RepositoryError` when two layers cannot be told apart or the graph has a cycle."""
    root = unwrap(module)
    if not isinstance(root, torch.nn.Module):
        raise RepositoryError(f"expected a torch.nn.Module, got {type(module).__name__}")
    b = _Builder(root)
    try:
        outputs, inputs = _fx_graph(b, root)
        kind = "fx"
    except Exception:   # noqa: BLE001 - fx raises anything the forward raises on a Proxy
        b = _Builder(root)
        if example_inputs is not None:
            outputs, inputs = _hooks_graph(b, root, example_inputs)
            kind = "calls"
        else:
            outputs, inputs = _registration_graph(b, root)
            kind = "registration"
    b.unused()
    named = {NamedKey(k, b.names[k]): n for k, n in b.nodes.items()}
    try:
        ids = {int(k): v for k, v in compute_ids(named, outputs, inputs).items()}
    except RepositoryError as e:
        raise RepositoryError(f"module {type(root).__name__}: {e}") from e
    aliases: dict[str, int] = {}
    objects: dict[int, int] = {}
    for mid, k in b.layer_of.items():
        objects[mid] = k
        for q in b.names_of.get(mid, []):
            aliases[q] = k
    for fqn, k in b.param_of.items():
        aliases[fqn] = k
        objects[id(b.entries[fqn])] = k
    layer_keys = [k for k in b.nodes if k in b.tensors]
    return ModuleGraph(b.nodes, outputs, inputs, ids, b.names, b.tensors, b.modules, aliases, objects, kind,
                       layer_keys, b.names_of)


# -- store and load

def _numpy(t: torch.Tensor, what: str) -> np.ndarray:
    """A C-contiguous numpy array of ``t``'s values (a view of a contiguous CPU tensor's memory;
    bfloat16 as ml_dtypes' bfloat16)."""
    name = dtype_of(t, what)
    c = t.detach()
    if c.device.type != "cpu":
        c = c.cpu()
    c = c.contiguous()
    shape = tuple(c.shape)
    flat = c.reshape(-1).view(torch.uint8).numpy() if c.numel() else np.empty(0, np.uint8)
    return flat.view(numpy_dtype(name)).reshape(shape)


def store_model(repo: Any, name: str, module: torch.nn.Module, example_inputs: Any = None) -> dict:
    """Store every parameter and persistent buffer of ``module`` with its graph and layer
    metadata under ``name`` (``<model>[@<tag>]``, write-once).

    Weight ``k`` of the layer with id ``i`` (its ``state_dict()`` order) is stored under
    ``graph.tensor_key(i, k)``; tied parameters (one tensor under two names) are stored once
    per layer holding them and deduplicated by the repository (equal bytes are one blob).
    ``example_inputs`` is used only where fx cannot trace the module (:func:`module_graph`).
    Returns what ``repo.put`` returns (bytes, written, deduplicated). ``NameExistsError`` when
    the name exists or existed; :class:`RepositoryError` when the graph gives no stable ids."""
    mg = module_graph(module, example_inputs)
    graph, _order = mg.graph()
    tensors = {}
    for k in mg.layer_keys:
        for j, t in enumerate(mg.tensors[k]):
            tensors[tensor_key(mg.ids[k], j)] = _numpy(t, f"{mg.names[k]} weight {j}")
    try:
        return repo.put(name, tensors, graph=graph, meta=mg.meta())
    finally:
        tensors.clear()


def _requested(items: Iterable[Any], aliases: dict[str, Hashable], objects: dict[int, Hashable],
               paths: dict[int, list[str]], stateless: set[str]) -> set[Hashable]:
    """Layers of ``layers=`` items: qualified names or objects of layers (modules called whole
    with state, parameters registered on a container) or of containers (every layer under them).
    A module called whole without weights is accepted (it is skipped). ``aliases``: every name of a
    layer -> the layer (a graph key, or its name for a load by name); ``objects``: ``id()`` of a
    layer's module or a direct entry's tensor -> the layer; ``paths``: ``id()`` of every submodule
    -> its qualified names; ``stateless``: names of modules called whole without weights."""
    want: set[Hashable] = set()

    def under(prefix: str) -> set[Hashable]:
        return {k for q, k in aliases.items() if prefix == "" or q.startswith(prefix + ".")}

    for item in items:
        if isinstance(item, str):
            if item in aliases:
                want.add(aliases[item])
            elif item not in stateless:
                ks = under(item) if item else set()
                if not ks:
                    raise ModelMismatchError(f"layers=: the module has no layer or container named {item!r} (name "
                                             f"modules and parameters by their qualified names, as in "
                                             f"named_modules() and state_dict())")
                want |= ks
        elif isinstance(item, (torch.nn.Module, torch.Tensor)):
            k = objects.get(id(item))
            if k is not None:
                want.add(k)
                continue
            qs = paths.get(id(item), []) if isinstance(item, torch.nn.Module) else []
            ks = set().union(*(under(q) for q in qs)) if qs else set()
            if ks:
                want |= ks
            elif not any(q in stateless for q in qs):
                raise ModelMismatchError(f"layers=: a {type(item).__name__} that is not a layer or a container of "
                                         f"layers of the module loaded into")
        else:
            raise ConfigError(f"layers=: {item!r} is not a name, a module or a parameter")
    return want


_MATCHES = ("id", "shape", "name")


@dataclass
class _Layers:
    """The layers of a module found by walking it (no trace): what fx would call whole, as
    :func:`module_graph` defines a layer. ``tensors``: layer name -> its weights; ``classes``:
    layer name -> class name; ``stateless``: qualified names of leaf modules without weights;
    ``objects``: ``id()`` of a layer's module or a direct entry's tensor -> layer name;
    ``paths``: ``id()`` of every submodule -> its qualified names."""
    tensors: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    classes: dict[str, str] = field(default_factory=dict)
    stateless: list[str] = field(default_factory=list)
    objects: dict[int, str] = field(default_factory=dict)
    paths: dict[int, list[str]] = field(default_factory=dict)


def _walk_layers(root: torch.nn.Module) -> _Layers:
    """:class:`_Layers` of ``root``: a module fx treats as a leaf when called (``_Tracer``; not a
    ``ModuleList`` or ``ModuleDict``, which have no ``forward``) is one layer (all its state); a
    container's own parameters and persistent buffers are layers named by their
    FQNs; a module registered twice is walked once, under its first name (as the trace names it)."""
    out = _Layers()
    tracer = _Tracer()
    b = _Builder(root)   # the state checks and first names of the trace
    out.paths = b.names_of
    seen: set[int] = set()

    def walk(m: torch.nn.Module, q: str) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        if m is not root and tracer.is_leaf_module(m, q) and (next(m.children(), None) is None or callable_(m)):
            weights = b.state(m)
            if weights:
                out.tensors[q], out.classes[q] = weights, P + type(m).__name__
                out.objects[id(m)] = q
            else:
                out.stateless.append(q)
            return
        for attr, t in list(m._parameters.items()) + [(a, t) for a, t in m._buffers.items()
                                                      if a not in m._non_persistent_buffers_set]:
            fqn = f"{q}.{attr}" if q else attr
            if t is not None and fqn in b.entries:
                out.tensors[fqn] = [t]
                out.classes[fqn] = P + ("parameter" if isinstance(t, torch.nn.Parameter) else "buffer")
                out.objects.setdefault(id(t), fqn)
        for attr, c in m._modules.items():
            if c is not None:
                walk(c, f"{q}.{attr}" if q else attr)

    def callable_(m: torch.nn.Module) -> bool:   # a ModuleList or ModuleDict is never called: fx sees into it
        return type(m).forward is not torch.nn.Module.forward

    walk(root, "")
    return out


def _load_by_name(repo: Any, name: str, module: torch.nn.Module, graph: dict[str, Any],
                  layers: Iterable[Any] | None, strict: bool) -> LoadReport:
    """``load_into(..., match="name")``: the module walked, not traced; each considered layer
    paired with the stored layer of its name, checked, then every tensor read at once and set."""
    root = unwrap(module)
    if not isinstance(root, torch.nn.Module):
        raise RepositoryError(f"expected a torch.nn.Module, got {type(module).__name__}")
    lw = _walk_layers(root)
    aliases = {alias: q for obj, q in lw.objects.items() for alias in lw.paths.get(obj, [])}
    aliases.update((q, q) for q in lw.tensors)   # every name of a layer, its first (the stored one) the key
    considered = set(lw.tensors) if layers is None else \
        _requested(layers, aliases, lw.objects, lw.paths, set(lw.stateless))
    by_name = {layer["name"]: layer for layer in graph["layers"] if "name" in layer}
    pairs = {q: by_name[q] for q in lw.tensors if q in considered and q in by_name and by_name[q]["tensors"]}
    meta = repo.layer_meta([layer["id"] for layer in pairs.values()]) if pairs else {}
    specs = repo.specs(name) if pairs else {}
    for q, layer in pairs.items():   # type, number of weights, shapes and dtypes: before anything is read
        cls = meta.get(layer["id"], {}).get("class_name")
        if cls != lw.classes[q]:
            raise ModelMismatchError(f"layer {q!r} is a {lw.classes[q]}, {name!r} stores a {cls} under that name; "
                                     f"nothing loaded (leave it out with layers=, or match='id')")
        want = [(dtype_of(t, q), tuple(t.shape)) for t in lw.tensors[q]]
        got = [specs.get(tensor_key(layer["id"], j)) for j in range(layer["tensors"])]
        if len(got) != len(want) or any(g is None or (g[0], tuple(g[1])) != w for g, w in zip(got, want)):
            raise ModelMismatchError(f"layer {q!r}: {name!r} stores weights {got} under that name, the layer has "
                                     f"{want}; nothing loaded (leave it out with layers=)")
    report = LoadReport()
    report.skipped.extend(lw.stateless)
    for q in lw.tensors:
        (report.loaded if q in pairs else report.skipped if q not in considered else report.missing).append(q)
    if layers is not None and report.missing:
        raise ModelMismatchError(f"requested layers are not in {name!r} under their names: "
                                 f"{', '.join(report.missing)}; nothing loaded")
    if not pairs:
        raise ModelMismatchError(f"no layer of module {type(root).__name__} has a name that {name!r} stores; nothing "
                                 f"loaded (match='id' pairs layers by their place in the graph instead)")
    if strict and report.missing:
        raise ModelMismatchError(f"strict load of {name!r}: layers with weights not stored under their names: "
                                 f"{', '.join(report.missing)}; nothing loaded")
    return _read_and_set(repo, name, [(t, tensor_key(layer["id"], j)) for q, layer in pairs.items()
                                      for j, t in enumerate(lw.tensors[q])], specs, report)


def _read_and_set(repo: Any, name: str, pairs: list[tuple[torch.Tensor, str]], specs: dict,
                  report: LoadReport) -> LoadReport:
    """Read every stored tensor of ``pairs`` ((live tensor, stored key)) with one ``repo.get``
    (everything read and checked before anything is set; a tensor tied under two layers is read
    and set once) and copy each into its tensor."""
    targets: list[tuple[torch.Tensor, str]] = []
    seen: set[int] = set()
    for t, key in pairs:
        if id(t) not in seen:
            seen.add(id(t))
            targets.append((t, key))
    keys = list(dict.fromkeys(key for _, key in targets))
    got = repo.get(name, tensors=keys)
    with torch.no_grad():
        for t, key in targets:
            t.copy_(as_tensor(got[key], specs[key][0]).reshape(t.shape))
    report.bytes = sum(got[key].nbytes for key in keys)
    return report


def load_into(repo: Any, name: str, module: torch.nn.Module, layers: Iterable[Any] | None = None,
              strict: bool = False, mapping: dict | None = None, match: str = "id",
              example_inputs: Any = None) -> LoadReport:
    """Copy into the layers of ``module`` that match the stored model ``name`` their stored
    weights (in place: ``param.copy_``, on the parameter's device; bit-exact).

    The same rules as :func:`deepfreeze.keras.load_into`: a layer matches when its id is in the
    stored graph (the same layer on the same upstream, whatever the attribute names and the
    declaration order); ``layers=`` (qualified names, modules or parameters) restricts the
    load; ``mapping={layer (name, module or parameter): stored id or index}`` and
    ``match="shape"`` relax it; ``strict=True`` requires every considered layer to load.
    ``match="name"`` pairs layers by their qualified names instead (the stored graph records them)
    and does not trace ``module`` (what a load of named layers into a new model costs least):
    each pair must have the same class, number of weights, shapes and dtypes
    (:class:`ModelMismatchError` otherwise, before anything is set); ``mapped`` is then empty.
    :class:`ModelMismatchError` before anything is set when nothing matches, a requested layer
    does not, a shape or dtype differs, or ``name`` is a model stored by another framework's
    adapter. Reads only the loaded layers' tensors (one ``repo.get``); a tensor two layers share
    (tied) is read once. Returns a :class:`LoadReport` (names: qualified module names, direct
    entries' FQNs)."""
    if mapping is not None and not isinstance(mapping, dict):
        raise ConfigError(f"mapping= must be a dict {{layer or name: stored layer id or index}}, not "
                          f"{type(mapping).__name__}")
    if match == "name" and mapping:
        raise ConfigError("mapping= pairs layers with stored ids: use it with match='id' or 'shape', not 'name' "
                          "(which pairs them by their names)")
    graph, foreign = stored_graph(repo, name, "torch", match=match, mapping=mapping, matches=_MATCHES)
    if match == "name":
        return _load_by_name(repo, name, module, graph, layers, strict)
    stored = {layer["id"]: layer["tensors"] for layer in graph["layers"]}
    ids = [layer["id"] for layer in graph["layers"]]
    mg = module_graph(module, example_inputs)
    layer_set = set(mg.layer_keys)
    stateless = {q for q, k in mg.modules if k is None}
    considered = set(layer_set) if layers is None else _requested(layers, mg.aliases, mg.objects, mg.paths, stateless)
    maps: dict[int, str] = {}
    for item, target in (mapping or {}).items():
        label = item if isinstance(item, str) else type(item).__name__
        sid = mapping_target(label, target, ids, set(stored))
        for k in _requested([item], mg.aliases, mg.objects, mg.paths, stateless):
            maps[k] = sid
    considered |= set(maps)
    source: dict[int, str] = {}
    for k in mg.layer_keys:
        if k not in considered:
            continue
        if k in maps:
            source[k] = maps[k]
        elif mg.ids[k] in stored and not foreign:
            if stored[mg.ids[k]] != len(mg.tensors[k]):   # cannot happen unless the store is damaged
                raise ModelMismatchError(f"layer {mg.names[k]!r}: {name!r} has {stored[mg.ids[k]]} tensors for its "
                                         f"id, the layer has {len(mg.tensors[k])} weights")
            source[k] = mg.ids[k]
    specs = repo.specs(name)
    ambiguous: list[Hashable] = []
    if match == "shape":
        _g, order = mg.graph()
        mine: dict[tuple, list[int]] = {}
        for k in order:
            if k in considered and k in layer_set and k not in source:
                mine.setdefault(signature(mg.nodes[k].class_name, mg.nodes[k].weights), []).append(k)
        pairs, ambiguous = pair_by_shape(repo, graph, specs, mine, set(source.values()) | set(maps.values()))
        source.update(pairs)   # type: ignore[arg-type]
    for k, sid in source.items():   # every loaded layer must have the stored shapes and dtypes
        want = [(dtype_of(t, mg.names[k]), tuple(t.shape)) for t in mg.tensors[k]]
        check_mapped_specs(mg.names[k], sid, stored[sid], want, specs)
    report = LoadReport()
    unmatched: list[int] = []
    listed: set[str] = set()
    for q, k in mg.modules:
        if k is None and q not in listed:
            report.skipped.append(q)
            listed.add(q)
    for k in mg.layer_keys:
        n = mg.names[k]
        if k not in considered:
            report.skipped.append(n)
        elif k in source:
            report.loaded.append(n)
            if source[k] != mg.ids[k]:
                report.mapped[n] = source[k]
        else:
            report.missing.append(n)
            if layers is not None:
                unmatched.append(k)
    report.ambiguous = [mg.names[k] for k in ambiguous]   # type: ignore[index]
    if unmatched:
        raise ModelMismatchError(f"requested layers do not match {name!r} (their upstream differs from every "
                                 f"stored layer): {', '.join(mg.names[k] for k in unmatched)}; nothing loaded")
    if not source:
        some = report.missing[:10] + (["..."] if len(report.missing) > 10 else [])
        raise ModelMismatchError(f"no layer of module {type(unwrap(module)).__name__} matches {name!r} (not the "
                                 f"same layers on the same inputs): {', '.join(some) or 'it has no layer'} did not "
                                 f"match; nothing loaded (mapping= or match='shape' relax the match)")
    if strict and report.missing:
        raise ModelMismatchError(f"strict load of {name!r}: layers with weights that do not match: "
                                 f"{', '.join(report.missing)}; nothing loaded")
    return _read_and_set(repo, name, [(t, tensor_key(source[k], j)) for k in sorted(source)
                                      for j, t in enumerate(mg.tensors[k])], specs, report)
