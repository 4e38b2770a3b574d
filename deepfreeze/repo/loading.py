"""What the framework adapters' ``load_into`` share (framework-neutral, no TensorFlow, no torch).

:class:`LoadReport` (what a load did), :func:`stored_graph` (the stored graph a load starts from,
checked), :func:`check_framework` (a model stored by one framework's adapter is never loaded by
another's), :func:`mapping_target` (a ``mapping=`` value as a stored
layer id), :func:`check_mapped_specs` (a mapped layer must have the stored shapes and dtypes) and
:func:`pair_by_shape` (``match="shape"``). Used by :mod:`deepfreeze.keras.repo` and
:mod:`deepfreeze.torch.repo`; docs/repository.md is the reference.
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, ModelMismatchError
from .graph import ID_HEX_RE, tensor_key
from .ids import ID_SCHEME

__all__ = ["LoadReport", "NamedKey", "FRAMEWORKS", "TORCH_CLASS_PREFIX", "layer_framework", "stored_framework",
           "check_framework", "stored_graph", "mapping_target", "signature", "check_mapped_specs", "pair_by_shape"]

#: the frameworks whose adapters store models
FRAMEWORKS = ("keras", "torch")
#: every class name the torch adapter gives a node starts so (``torch.Linear``, ``torch.input``);
#: a Keras class name is a Python identifier, never with a dot
TORCH_CLASS_PREFIX = "torch."
#: at most this many source layers (layers without inputs) are looked up to tell a stored model's framework
_PROBE = 8


@dataclass
class LoadReport:
    """What ``load_into`` did, as layer names of the model loaded into.

    ``loaded``: layers with weights whose id is in the stored graph; all their weights were set.
    ``missing``: layers with weights (among those considered) whose id is not in the stored
    graph; left untouched. ``skipped``: the other leaf layers: layers without weights, and the
    layers not asked for when ``layers=`` is given; left untouched. ``bytes``: tensor bytes read
    from the repository. ``mapped``: layer name -> stored layer id of the loaded layers that did
    not match by id (``mapping=`` or ``match="shape"``; they are in ``loaded`` too).
    ``ambiguous``: layers ``match="shape"`` left unmatched because their weight shapes occur a
    different number of times among the unmatched layers of the two models (in ``missing``)."""
    loaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    bytes: int = 0
    mapped: dict[str, str] = field(default_factory=dict)
    ambiguous: list[str] = field(default_factory=list)


class NamedKey(int):
    """A node key (an int) whose repr is its layer's name, so an error of
    :func:`deepfreeze.repo.ids.compute_ids` names the layers."""
    name: str

    def __new__(cls, k: int, name: str) -> "NamedKey":
        key = super().__new__(cls, k)
        key.name = name
        return key

    def __repr__(self) -> str:
        return repr(self.name)


def layer_framework(class_name: Any) -> str:
    """The framework of a stored layer, from its metadata's class name."""
    return "torch" if isinstance(class_name, str) and class_name.startswith(TORCH_CLASS_PREFIX) else "keras"


def stored_framework(repo: Any, graph: Mapping[str, Any]) -> str | None:
    """The framework whose adapter stored the model of ``graph`` ("keras" or "torch"), from the
    metadata of a few of its source layers (the model's inputs); None when the repository has no
    metadata for them (a model stored without any: nothing to tell)."""
    sources = [layer["id"] for layer in graph["layers"] if not layer["inputs"]][:_PROBE]
    meta = repo.layer_meta(sources) if sources else {}
    kinds = {layer_framework(m.get("class_name")) for m in meta.values()}
    if not kinds:
        return None
    return "torch" if "torch" in kinds else "keras"


def check_framework(repo: Any, name: str, graph: Mapping[str, Any], framework: str) -> None:
    """:class:`ModelMismatchError` when ``name`` was stored by another framework's adapter than
    ``framework``'s (before anything is read or set)."""
    found = stored_framework(repo, graph)
    if found is not None and found != framework:
        raise ModelMismatchError(
            f"{name!r} is a {found} model (stored by deepfreeze.{found}.store_model); deepfreeze.{framework}.load_into "
            f"loads {framework} models only: layer ids of two frameworks never match and their tensors have other "
            f"layouts (a Keras Dense kernel is the transpose of a torch Linear weight); nothing loaded. Load it with "
            f"deepfreeze.{found}.load_into, or read its tensors with repo.get(name) and convert them yourself")


def stored_graph(repo: Any, name: str, framework: str, *, match: str, mapping: Any,
                 matches: Sequence[str] = ("id", "shape")) -> tuple[dict[str, Any], bool]:
    """The checks every adapter's ``load_into`` starts with, before anything is read or set:
    ``match`` is one of the adapter's ``matches`` (:class:`ConfigError`); ``name`` has a layer
    graph, was stored by ``framework``'s adapter (:func:`check_framework`), has layer names when
    ``match="name"`` and, unless ``mapping``, ``match="shape"`` or ``match="name"`` pairs its layers
    otherwise, has ids of this DeepFreeze's scheme (:class:`ModelMismatchError`). Returns the graph
    and whether its ids are of another scheme."""
    if match not in matches:
        raise ConfigError(f"match={match!r}: use {' or '.join(repr(m) for m in matches)} ('id' is the default)")
    graph = repo.graph(name)
    if graph is None:
        raise ModelMismatchError(f"{name!r} was stored without a layer graph; read its tensors with repo.get")
    check_framework(repo, name, graph, framework)
    if match == "name" and not any("name" in layer for layer in graph["layers"]):
        raise ModelMismatchError(f"{name!r} was stored without layer names (by a DeepFreeze before they were "
                                 f"recorded, or imported from a checkpoint); match='name' finds layers by them: "
                                 f"load it with match='id' (the default) or 'shape'")
    foreign = graph.get("scheme") != ID_SCHEME
    if foreign and not mapping and match not in ("shape", "name"):
        raise ModelMismatchError(f"{name!r} has layer ids of scheme {graph.get('scheme')}, this DeepFreeze "
                                 f"computes scheme {ID_SCHEME}; ids of different schemes never match (load it "
                                 f"with mapping= or match='shape')")
    return graph, foreign


def mapping_target(label: Any, target: Any, ids: Sequence[str], known: set[str] | frozenset[str]) -> str:
    """The stored layer id a ``mapping=`` value names: a stored layer id, or an index into the
    stored graph's ``"layers"`` (``ids``, in graph order). ``label`` names the layer in errors."""
    if isinstance(target, int) and not isinstance(target, bool):
        if not 0 <= target < len(ids):
            raise ModelMismatchError(f"mapping= {label!r}: the stored graph has no layer {target} (it has "
                                     f"{len(ids)}); nothing loaded")
        target = ids[target]
    if not isinstance(target, str) or not ID_HEX_RE.fullmatch(target):
        raise ConfigError(f"mapping= {label!r}: {target!r} is not a stored layer id (32 hex digits, "
                          f"repo.graph(name)['layers'][i]['id']) or a layer index")
    if target not in known:
        raise ModelMismatchError(f"mapping= {label!r}: the stored model has no layer {target}; nothing loaded")
    return target


def signature(class_name: str, specs: Sequence[tuple[Sequence[int], str]]) -> tuple:
    """What ``match="shape"`` pairs layers by: the class name and each weight's shape and dtype."""
    return (class_name, tuple((tuple(int(d) for d in shape), str(dt)) for shape, dt in specs))


def check_mapped_specs(label: str, sid: str, n_tensors: int, want: Sequence[tuple[str, Sequence[int]]],
                       specs: Mapping[str, tuple[str, Sequence[int]]]) -> None:
    """:class:`ModelMismatchError` unless stored layer ``sid`` (``n_tensors`` tensors) has exactly
    the ``want`` ``(dtype, shape)`` of the layer ``label`` it is loaded into."""
    got = [specs.get(tensor_key(sid, j)) for j in range(n_tensors)]
    if len(got) != len(want) or any(g is None or g[0] != w[0] or tuple(g[1]) != tuple(w[1])
                                    for g, w in zip(got, want)):
        raise ModelMismatchError(f"mapping= {label!r}: stored layer {sid} has tensors {got}, the layer has "
                                 f"weights {[(w[0], tuple(w[1])) for w in want]}; nothing loaded")


def pair_by_shape(repo: Any, graph: Mapping[str, Any], specs: Mapping[str, tuple[str, Sequence[int]]],
                  mine: Mapping[tuple, Sequence[Hashable]], used: set[str]
                  ) -> tuple[dict[Hashable, str], list[Hashable]]:
    """``match="shape"``: pair the unmatched layers with weights ``mine`` (signature -> node keys,
    in topological order) with the stored layers with tensors not in ``used``, by
    :func:`signature`, in topological order. Returns ``({node key: stored id}, ambiguous keys)``:
    a signature whose count differs between the two models leaves its layers unmatched."""
    stored = {layer["id"]: layer["tensors"] for layer in graph["layers"]}
    free = [layer["id"] for layer in graph["layers"] if layer["tensors"] and layer["id"] not in used]
    meta = repo.layer_meta(free) if free else {}
    theirs: dict[tuple, list[str]] = {}
    for sid in free:
        cls = meta.get(sid, {}).get("class_name")
        sig = signature(str(cls), [(specs[tensor_key(sid, j)][1], specs[tensor_key(sid, j)][0])
                                   for j in range(stored[sid])])
        theirs.setdefault(sig, []).append(sid)
    pairs: dict[Hashable, str] = {}
    ambiguous: list[Hashable] = []
    for sig, ks in mine.items():
        cands = theirs.get(sig, [])
        if len(cands) == len(ks):
            pairs.update(zip(ks, cands))
        elif cands:
            ambiguous.extend(ks)
    return pairs, ambiguous
