"""PyTorch adapter of the model repository (deepfreeze.torch.repo): stable ids of hand-written
ResNet- and transformer-shaped modules, store_model / load_into against the real embedded
repository, and a property test of the ids on random module graphs against an independent
definition of what an id depends on (its upstream, and for twins the cut)."""
import random

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from deepfreeze.errors import ConfigError, ModelMismatchError, NameExistsError
from deepfreeze.repo.store import EmbeddedRepository
from deepfreeze.torch import LoadReport, load_into, store_model
from deepfreeze.torch.repo import module_graph

torch.set_num_threads(1)


@pytest.fixture
def repo(tmp_path):
    r = EmbeddedRepository(str(tmp_path / "repo"))
    yield r
    r.close()


def randomize(module, seed):
    """Fill every floating parameter and buffer with seeded values (> 0: BN variances too), and
    every integer buffer with a seeded count."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if t.is_floating_point():
                t.copy_(torch.rand(t.shape, generator=g, dtype=torch.float64).to(t.dtype) + 0.1)
            else:
                t.copy_(torch.randint(1, 1000, t.shape, generator=g).to(t.dtype))


def recorded(module):
    """Every state_dict entry, cloned: the values stored."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def ids_by_name(module, **kw):
    mg = module_graph(module, **kw)
    return {mg.names[k]: mg.ids[k] for k in mg.layer_keys}, mg


# -- hand-written modules (no torchvision)

class Names:
    """A construction plan: modules registered in ``order`` under renamed attributes."""

    def __init__(self, module, alt):
        self.m, self.alt = module, alt

    def add(self, parts):
        items = list(parts.items())
        if self.alt:
            items.reverse()
        for key, make in items:
            setattr(self.m, ("x_" + key[::-1]) if self.alt else key, make())

    def __call__(self, key):
        return getattr(self.m, ("x_" + key[::-1]) if self.alt else key)


class Block(nn.Module):
    def __init__(self, cin, cout, stride, alt=False):
        super().__init__()
        self._n = Names(self, alt)
        parts = {"conv1": lambda: nn.Conv2d(cin, cout, 3, stride, 1, bias=False), "bn1": lambda: nn.BatchNorm2d(cout),
                 "conv2": lambda: nn.Conv2d(cout, cout, 3, 1, 1, bias=False), "bn2": lambda: nn.BatchNorm2d(cout),
                 "relu": lambda: nn.ReLU(inplace=True)}
        if stride != 1 or cin != cout:
            parts["down"] = lambda: nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        self.has_down = "down" in parts
        self._n.add(parts)

    def forward(self, x):
        n = self._n
        out = n("relu")(n("bn1")(n("conv1")(x)))
        out = n("bn2")(n("conv2")(out))
        short = n("down")(x) if self.has_down else x
        return n("relu")(out + short)


class ResNetish(nn.Module):
    """A stem, two stages of two basic blocks (the second with a strided 1x1 shortcut), pool, head."""

    def __init__(self, classes=10, alt=False):
        super().__init__()
        self._n = Names(self, alt)
        self._n.add({"stem": lambda: nn.Conv2d(3, 8, 3, 1, 1, bias=False), "bn": lambda: nn.BatchNorm2d(8),
                     "stage1": lambda: nn.Sequential(Block(8, 8, 1, alt), Block(8, 8, 1, alt)),
                     "stage2": lambda: nn.Sequential(Block(8, 16, 2, alt), Block(16, 16, 1, alt)),
                     "pool": lambda: nn.AdaptiveAvgPool2d(1), "fc": lambda: nn.Linear(16, classes)})

    def forward(self, x):
        n = self._n
        x = F.relu(n("bn")(n("stem")(x)))
        x = n("stage2")(n("stage1")(x))
        return n("fc")(torch.flatten(n("pool")(x), 1))


class Attention(nn.Module):
    def __init__(self, d, heads, alt=False):
        super().__init__()
        self.heads = heads
        self._n = Names(self, alt)
        self._n.add({k: (lambda: nn.Linear(d, d)) for k in ("q", "k", "v", "o")})

    def forward(self, x):
        n = self._n
        b, t, d = x.size(0), x.size(1), x.size(2)
        h = self.heads

        def split(y):
            return y.view(b, t, h, d // h).transpose(1, 2)
        q, k, v = split(n("q")(x)), split(n("k")(x)), split(n("v")(x))
        att = torch.softmax(q @ k.transpose(-2, -1) * (1.0 / 4.0), dim=-1)
        return n("o")((att @ v).transpose(1, 2).reshape(b, t, d))


class TBlock(nn.Module):
    def __init__(self, d, heads, alt=False):
        super().__init__()
        self._n = Names(self, alt)
        self._n.add({"ln1": lambda: nn.LayerNorm(d), "attn": lambda: Attention(d, heads, alt),
                     "ln2": lambda: nn.LayerNorm(d), "fc1": lambda: nn.Linear(d, 4 * d),
                     "drop": lambda: nn.Dropout(0.1), "fc2": lambda: nn.Linear(4 * d, d)})

    def forward(self, x):
        n = self._n
        x = x + n("attn")(n("ln1")(x))
        return x + n("drop")(n("fc2")(F.gelu(n("fc1")(n("ln2")(x)))))


class TinyLM(nn.Module):
    """Token embedding, a position table registered on the container (a non-leaf parameter), two
    blocks, a final norm, a head (optionally tied to the embedding)."""

    def __init__(self, vocab=32, d=16, heads=2, ctx=8, alt=False, tie=False, head_out=None):
        super().__init__()
        self._n = Names(self, alt)
        self._n.add({"embed": lambda: nn.Embedding(vocab, d),
                     "blocks": lambda: nn.Sequential(*[TBlock(d, heads, alt) for _ in range(2)]),
                     "ln_f": lambda: nn.LayerNorm(d),
                     "head": lambda: nn.Linear(d, head_out or vocab, bias=False)})
        self.pos = nn.Parameter(torch.zeros(1, ctx, d))
        if tie:
            self._n("head").weight = self._n("embed").weight

    def forward(self, idx):
        n = self._n
        x = n("embed")(idx) + self.pos[:, :idx.size(1)]
        return n("head")(n("ln_f")(n("blocks")(x)))


# -- ids

def test_resnet_ids_survive_new_head_renames_and_construction_order():
    a, _ = ids_by_name(ResNetish(10))
    b, mg = ids_by_name(ResNetish(5, alt=True))
    assert mg.kind == "fx"
    assert "fc" in a and "x_cf" in b and a["fc"] != b["x_cf"]
    trunk_a = sorted(v for k, v in a.items() if k != "fc")
    trunk_b = sorted(v for k, v in b.items() if k != "x_cf")
    assert trunk_a == trunk_b and len(trunk_a) == 2 + 4 * 4 + 2   # stem, bn, 4 blocks x 4, one shortcut
    assert len(set(a.values())) == len(a)   # unique ids


def test_transformer_twins_and_order():
    a, mga = ids_by_name(TinyLM())
    b, mgb = ids_by_name(TinyLM(alt=True, head_out=7))
    assert mga.kind == mgb.kind == "fx"
    # q, k and v are twins (the same Linear on the same input): told apart, and the same in both
    qkv = [a[f"blocks.0.attn.{x}"] for x in "qkv"]
    assert len(set(qkv)) == 3
    for x in "qkvo":
        assert a[f"blocks.1.attn.{x}"] == b[f"x_skcolb.1.x_ntta.x_{x}"]
    assert a["pos"] == b["pos"] and a["embed"] == b["x_debme"]
    assert a["head"] != b["x_daeh"]


# -- store and load

def test_resnet_store_and_load_under_new_head(repo):
    src = ResNetish(10)
    randomize(src, 1)
    values = recorded(src)
    res = store_model(repo, "resnet@1", src)
    assert res["bytes"] == sum(v.numel() * v.element_size() for v in values.values())
    with pytest.raises(NameExistsError):
        store_model(repo, "resnet@1", src)
    dst = ResNetish(5, alt=True)
    before_head = recorded(dst)["x_cf.weight"]
    r = load_into(repo, "resnet@1", dst)
    assert isinstance(r, LoadReport)
    assert r.missing == ["x_cf"]
    assert "x_loop" in r.skipped and r.mapped == {} and r.ambiguous == []
    assert len(r.loaded) == 2 + 2 * 4 + 2 * 4 + 2   # stem, bn, 4 blocks x 4, one shortcut (2 layers)
    # every trunk tensor bit-exact: compare through the renamed module tree
    alt_sd = dst.state_dict()
    src_mg = module_graph(src)
    dst_mg = module_graph(dst)
    by_id = {dst_mg.ids[k]: k for k in dst_mg.layer_keys}
    n = 0
    for k in src_mg.layer_keys:
        if src_mg.names[k] == "fc":
            continue
        for t_src, t_dst in zip(src_mg.tensors[k], dst_mg.tensors[by_id[src_mg.ids[k]]]):
            assert torch.equal(t_src, t_dst) and t_src.dtype == t_dst.dtype
            n += 1
    assert n == len(values) - 2
    assert torch.equal(alt_sd["x_cf.weight"], before_head)   # the new head untouched
    assert r.bytes == sum(v.numel() * v.element_size() for k, v in values.items() if not k.startswith("fc."))


def test_transformer_round_trip_bit_exact_and_partial_reads_fewer_bytes(repo):
    src = TinyLM()
    randomize(src, 2)
    values = recorded(src)
    store_model(repo, "lm@1", src)
    dst = TinyLM()
    r = load_into(repo, "lm@1", dst)
    assert r.missing == []
    for k, v in dst.state_dict().items():
        assert torch.equal(v, values[k]), k
    full = r.bytes
    assert full == sum(v.numel() * v.element_size() for v in values.values())
    part = TinyLM()
    before = recorded(part)
    read0 = repo.bytes_read
    r2 = load_into(repo, "lm@1", part, layers=["embed", "pos", part.blocks[0].attn.q])
    assert sorted(r2.loaded) == ["blocks.0.attn.q", "embed", "pos"]
    want = sum(values[k].numel() * values[k].element_size()
               for k in ("embed.weight", "pos", "blocks.0.attn.q.weight", "blocks.0.attn.q.bias"))
    assert r2.bytes == want < full
    assert want <= repo.bytes_read - read0 < full   # (gaps under 64 bytes between tensors are read through)
    for k, v in part.state_dict().items():
        loaded = k in ("embed.weight", "pos") or k.startswith("blocks.0.attn.q.")
        assert torch.equal(v, values[k] if loaded else before[k]), k
    # a container stands for every layer under it, by object or by name
    other = TinyLM()
    before2 = recorded(other)
    r3 = load_into(repo, "lm@1", other, layers=[other.blocks[1]])
    assert len(r3.loaded) == 8 and all(n.startswith("blocks.1.") for n in r3.loaded)
    for k, v in other.state_dict().items():
        assert torch.equal(v, values[k] if k.startswith("blocks.1.") else before2[k]), k
    assert sorted(load_into(repo, "lm@1", TinyLM(), layers=["blocks.1"]).loaded) == sorted(r3.loaded)
    with pytest.raises(ModelMismatchError, match="not a layer or a container"):
        load_into(repo, "lm@1", TinyLM(), layers=[other.blocks[0]])   # another module's block


def test_tied_weights_stored_once_and_stay_tied(repo):
    src = TinyLM(tie=True)
    randomize(src, 3)
    assert src.head.weight is src.embed.weight
    values = recorded(src)
    res = store_model(repo, "tied@1", src)
    w = src.embed.weight
    assert res["deduplicated"] == w.numel() * w.element_size()   # equal bytes: one blob
    dst = TinyLM(tie=True)
    r = load_into(repo, "tied@1", dst)
    assert "head" in r.loaded and "embed" in r.loaded and r.missing == []
    assert dst.head.weight is dst.embed.weight
    for k, v in dst.state_dict().items():
        assert torch.equal(v, values[k]), k
    # the tied tensor is read once
    assert r.bytes == sum(v.numel() * v.element_size() for k, v in values.items() if k != "head.weight")


class Twice(nn.Module):
    """A module called twice (the second call fed by the first) and registered under two names,
    and a function reading a layer's weight."""

    def __init__(self, alt=False):
        super().__init__()
        self._n = Names(self, alt)
        self._n.add({"inp": lambda: nn.Linear(4, 8), "shared": lambda: nn.Linear(8, 8),
                     "out": lambda: nn.Linear(8, 3)})
        self.alias = self._n("shared")

    def forward(self, x):
        n = self._n
        h = n("shared")(F.relu(n("inp")(x)))
        h = n("shared")(torch.tanh(h))
        return n("out")(h) + F.linear(h, n("inp").weight.t()).sum(-1, keepdim=True)


def test_module_called_twice_and_registered_twice(repo):
    src = Twice()
    randomize(src, 4)
    values = recorded(src)
    store_model(repo, "twice@1", src)
    dst = Twice(alt=True)
    r = load_into(repo, "twice@1", dst)
    assert sorted(r.loaded) == ["x_derahs", "x_pni", "x_tuo"] and r.missing == []
    assert torch.equal(dst.x_derahs.weight, values["shared.weight"])
    assert torch.equal(dst.x_pni.weight, values["inp.weight"])
    assert torch.equal(dst.x_tuo.bias, values["out.bias"])
    x = torch.rand(2, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(dst(x), src(x))
    # the module by its other name, or as an object
    part = Twice()
    r2 = load_into(repo, "twice@1", part, layers=["alias"])
    assert r2.loaded == ["shared"] and torch.equal(part.shared.bias, values["shared.bias"])


class Chain(nn.Module):
    """An MLP chain; ``act`` after its first layer, ``extra`` Linear(8, 8) layers before the head."""

    def __init__(self, act=F.relu, extra=0, head=3):
        super().__init__()
        self.act = act
        self.fc1, self.bn = nn.Linear(4, 8), nn.BatchNorm1d(8)
        self.mid = nn.Sequential(*[nn.Linear(8, 8) for _ in range(2 + extra)])
        self.fc = nn.Linear(8, head)

    def forward(self, x):
        return self.fc(self.mid(self.act(self.bn(self.fc1(x)))))


def test_match_shape_and_mapping(repo):
    src = Chain()
    randomize(src, 5)
    values = recorded(src)
    store_model(repo, "c@shape", src)
    dst = Chain(act=torch.tanh)   # another activation: every id downstream of it changes
    r = load_into(repo, "c@shape", dst)
    assert sorted(r.loaded) == ["bn", "fc1"] and sorted(r.missing) == ["fc", "mid.0", "mid.1"]
    dst = Chain(act=torch.tanh)
    r = load_into(repo, "c@shape", dst, match="shape")
    assert r.missing == [] and r.ambiguous == [] and sorted(r.mapped) == ["fc", "mid.0", "mid.1"]
    for k, v in dst.state_dict().items():
        assert torch.equal(v, values[k]), k
    # a signature that occurs a different number of times is left unmatched
    dst = Chain(act=torch.tanh, extra=1)
    r = load_into(repo, "c@shape", dst, match="shape")
    assert sorted(r.ambiguous) == ["mid.0", "mid.1", "mid.2"] and "fc" in r.mapped
    # mapping= names a stored layer for one layer whose id differs
    mg = module_graph(src)
    fc_id = next(mg.ids[k] for k in mg.layer_keys if mg.names[k] == "fc")
    dst = Chain(act=torch.tanh)
    r = load_into(repo, "c@shape", dst, mapping={"fc": fc_id})
    assert r.mapped == {"fc": fc_id} and torch.equal(dst.fc.weight, values["fc.weight"])
    before = recorded(dst)
    with pytest.raises(ModelMismatchError, match="has tensors"):
        load_into(repo, "c@shape", Chain(head=5), mapping={"fc": fc_id})   # a head of another shape
    with pytest.raises(ModelMismatchError, match="no layer 999"):
        load_into(repo, "c@shape", dst, mapping={"fc": 999})
    for k, v in dst.state_dict().items():
        assert torch.equal(v, before[k])


def test_mismatches_refused_before_anything_is_set(repo):
    src = TinyLM()
    randomize(src, 6)
    store_model(repo, "lm@m", src)
    dst = ResNetish()
    before = recorded(dst)
    with pytest.raises(ModelMismatchError, match="no layer"):
        load_into(repo, "lm@m", dst)
    with pytest.raises(ModelMismatchError, match="requested layers do not match"):
        load_into(repo, "lm@m", TinyLM(head_out=3), layers=["head"])
    with pytest.raises(ModelMismatchError, match="strict"):
        load_into(repo, "lm@m", TinyLM(head_out=3), strict=True)
    with pytest.raises(ModelMismatchError, match="no layer or container named"):
        load_into(repo, "lm@m", TinyLM(), layers=["nope"])
    for k, v in dst.state_dict().items():
        assert torch.equal(v, before[k])


# -- a load by name (issue 45: the layers the caller names, nothing traced)

class Counted(nn.Module):
    """``TinyLM``'s trunk under a new head, counting its ``forward`` calls (fx's trace runs ``forward``
    once on proxies; a load that does not trace leaves the count at 0)."""

    def __init__(self, head_out=3, tie=False):
        super().__init__()
        self.calls = 0
        self.embed, self.pos = nn.Embedding(32, 16), nn.Parameter(torch.zeros(1, 8, 16))
        self.blocks = nn.Sequential(*[TBlock(16, 2) for _ in range(2)])
        self.new_head = nn.Linear(16, head_out)

    def forward(self, idx):
        self.calls += 1
        return self.new_head(self.blocks(self.embed(idx) + self.pos[:, :idx.size(1)]))


def test_load_by_name_does_not_trace_and_loads_the_named_layers_bit_exact(repo):
    src = TinyLM()
    randomize(src, 11)
    values = recorded(src)
    store_model(repo, "lm@n", src)
    graph = repo.graph("lm@n")
    names = {layer["name"] for layer in graph["layers"] if "name" in layer}
    assert names >= {"embed", "pos", "blocks.0.attn.q", "head"}
    dst = Counted()
    head_before = recorded(dst)
    r = load_into(repo, "lm@n", dst, match="name")
    r_all = r.loaded
    assert dst.calls == 0   # not traced
    block = ("ln1", "attn.q", "attn.k", "attn.v", "attn.o", "ln2", "fc1", "fc2")
    assert sorted(r.loaded) == sorted(["embed", "pos"] + [f"blocks.{i}.{n}" for i in range(2) for n in block])
    assert r.missing == ["new_head"] and "blocks.0.drop" in r.skipped and r.mapped == {}
    got = dst.state_dict()
    for k, v in got.items():
        want = head_before[k] if k.startswith("new_head.") else values[k]
        assert torch.equal(v, want) and v.dtype == want.dtype, k
    assert r.bytes == sum(v.numel() * v.element_size() for k, v in values.items()
                          if not k.startswith(("head.", "ln_f.")))
    load_into(repo, "lm@n", Counted(), match="id")   # the id match traces: the count above could fail
    traced = Counted()
    load_into(repo, "lm@n", traced)
    assert traced.calls == 1
    # layers= by qualified name, container name and module object: only those read and set
    part = Counted()
    before = recorded(part)
    r = load_into(repo, "lm@n", part, match="name", layers=["pos", "blocks.1", part.blocks[0].fc1])
    assert sorted(r.loaded) == sorted(["pos", "blocks.0.fc1"] + [f"blocks.1.{n}" for n in
                                                                ("ln1", "attn.q", "attn.k", "attn.v", "attn.o", "ln2",
                                                                 "fc1", "fc2")])
    assert "embed" in r.skipped and "new_head" in r.skipped and r.missing == [] and part.calls == 0
    whole = Counted()   # the module itself names every layer under it, as for the id match: the new head too
    with pytest.raises(ModelMismatchError, match="not in 'lm@n' under their names: new_head"):
        load_into(repo, "lm@n", whole, match="name", layers=[whole])
    assert sorted(load_into(repo, "lm@n", whole, match="name", layers=[whole.embed, "pos", whole.blocks]).loaded) \
        == sorted(r_all)
    for k, v in part.state_dict().items():
        chosen = k == "pos" or k.startswith(("blocks.1.", "blocks.0.fc1."))
        assert torch.equal(v, values[k] if chosen else before[k]), k


def test_load_by_name_checks_type_shapes_dtypes_before_anything_is_set(repo):
    class Two(nn.Module):
        def __init__(self, norm, fc):
            super().__init__()
            self.norm, self.fc = norm, fc

        def forward(self, x):
            return self.fc(self.norm(x))

    src = Two(nn.LayerNorm(8), nn.Linear(8, 4))
    randomize(src, 12)
    store_model(repo, "two@1", src)
    cases = [(Two(nn.GroupNorm(1, 8), nn.Linear(8, 4)), "is a torch.GroupNorm, .* stores a torch.LayerNorm"),
             (Two(nn.LayerNorm(8), nn.Linear(8, 5)), "layer 'fc'.* stores weights"),
             (Two(nn.LayerNorm(8), nn.Linear(8, 4).double()), "layer 'fc'.* stores weights")]
    for dst, why in cases:
        before = recorded(dst)
        with pytest.raises(ModelMismatchError, match=why):
            load_into(repo, "two@1", dst, match="name")
        for k, v in dst.state_dict().items():
            assert torch.equal(v, before[k]), k
    ok = Two(nn.LayerNorm(8), nn.Linear(8, 5))   # leaving the mismatching layer out loads the rest
    assert load_into(repo, "two@1", ok, match="name", layers=["norm"]).loaded == ["norm"]
    assert torch.equal(ok.norm.weight, src.norm.weight)
    dst = Two(nn.LayerNorm(8), nn.Linear(8, 4))
    with pytest.raises(ModelMismatchError, match="not in 'two@1' under their names"):
        load_into(repo, "two@1", Counted(), match="name", layers=["new_head"])
    with pytest.raises(ModelMismatchError, match="strict load"):
        three = Two(nn.LayerNorm(8), nn.Linear(8, 4))
        three.extra = nn.Linear(2, 2)   # a layer the stored model has no name for
        load_into(repo, "two@1", three, match="name", strict=True)
    with pytest.raises(ModelMismatchError, match="no layer of module"):
        load_into(repo, "two@1", nn.Sequential(dst), match="name")   # names '0.norm', '0.fc': none stored
    with pytest.raises(ConfigError, match="mapping="):
        load_into(repo, "two@1", dst, match="name", mapping={"fc": 0})
    # a model stored without names (its graph as an older DeepFreeze wrote it) is refused by name, loads by id
    mg = module_graph(src)
    graph, _ = mg.graph()
    for layer in graph["layers"]:
        layer.pop("name", None)
    tensors = {f"{mg.ids[k]}/{j}": t.detach().numpy() for k in mg.layer_keys for j, t in enumerate(mg.tensors[k])}
    repo.put("two@old", tensors, graph=graph, meta=mg.meta())
    with pytest.raises(ModelMismatchError, match="without layer names"):
        load_into(repo, "two@old", dst, match="name")
    assert sorted(load_into(repo, "two@old", dst).loaded) == ["fc", "norm"]


class Branchy(nn.Module):
    """Data-dependent control flow: fx cannot trace it."""

    def __init__(self, head=3, alt=False):
        super().__init__()
        self._n = Names(self, alt)
        self._n.add({"a": lambda: nn.Linear(4, 8), "b": lambda: nn.Linear(8, 8), "head": lambda: nn.Linear(8, head)})

    def forward(self, x):
        n = self._n
        h = n("a")(x)
        if h.sum() > 0:
            h = F.relu(h)
        return n("head")(n("b")(h))


def test_fallbacks_where_fx_does_not_trace(repo):
    ex = torch.ones(2, 4)
    src = Branchy()
    randomize(src, 7)
    values = recorded(src)
    _ids, mg = ids_by_name(src, example_inputs=ex)
    assert mg.kind == "calls"
    store_model(repo, "br@1", src, example_inputs=ex)
    dst = Branchy(head=5, alt=True)
    r = load_into(repo, "br@1", dst, example_inputs=ex)
    assert sorted(r.loaded) == ["x_a", "x_b"] and r.missing == ["x_daeh"]
    assert torch.equal(dst.x_a.weight, values["a.weight"]) and torch.equal(dst.x_b.bias, values["b.bias"])
    # without example inputs: the registration-order chain (ids of another kind: no match)
    _ids, mg2 = ids_by_name(src)
    assert mg2.kind == "registration"
    with pytest.raises(ModelMismatchError, match="no layer"):
        load_into(repo, "br@1", Branchy())


def test_cross_framework_load_refused_and_bytes_shared(repo):
    tf = pytest.importorskip("tensorflow")
    from deepfreeze.keras import load_into as keras_load_into
    from deepfreeze.keras import store_model as keras_store_model
    inp = tf.keras.Input(shape=(4,))
    km = tf.keras.Model(inp, tf.keras.layers.Dense(3)(inp))
    bias = np.array([0.25, -1.5, 3.0], np.float32)
    km.layers[-1].bias.assign(bias)
    keras_store_model(repo, "k@1", km)
    lin = nn.Sequential(nn.Linear(4, 3))
    with torch.no_grad():
        lin[0].bias.copy_(torch.from_numpy(bias))
    res = store_model(repo, "t@1", lin)
    assert res["deduplicated"] == bias.nbytes   # the equal bias is one blob for both frameworks
    before = recorded(lin)
    with pytest.raises(ModelMismatchError, match="is a keras model"):
        load_into(repo, "k@1", lin, match="shape")
    with pytest.raises(ModelMismatchError, match="is a torch model"):
        keras_load_into(repo, "t@1", km, match="shape")
    for k, v in lin.state_dict().items():
        assert torch.equal(v, before[k])
    r = load_into(repo, "t@1", nn.Sequential(nn.Linear(4, 3)))
    assert r.loaded == ["0"]


# -- property: ids on random module graphs against an independent definition of what they depend on

class RandomNet(nn.Module):
    """Nodes ``spec[i] = (inputs, width)``: node i is a Linear on the concatenation of its inputs
    (-1 is the model input, of width 3); the outputs are the nodes nobody consumes."""

    def __init__(self, spec, perm, order):
        super().__init__()
        self.spec = [(list(ins), w) for ins, w in spec]
        self._attr = [f"m{perm[i]}" for i in range(len(spec))]
        widths = [w for _, w in spec]
        for i in order:
            ins, w = spec[i]
            setattr(self, self._attr[i], nn.Linear(sum(3 if j < 0 else widths[j] for j in ins), w))
        used = {j for ins, _ in spec for j in ins}
        self._outs = [i for i in range(len(spec)) if i not in used]

    def forward(self, x):
        vals = []
        for i, (ins, _) in enumerate(self.spec):
            xs = [x if j < 0 else vals[j] for j in ins]
            h = xs[0] if len(xs) == 1 else torch.cat(xs, dim=1)
            vals.append(getattr(self, self._attr[i])(h))
        return tuple(vals[i] for i in self._outs)


def random_spec(rng):
    """A random DAG of Linear layers with distinct widths (so no two are twins; two nodes never
    concatenate the same inputs, so no two concatenations are), plus one twin pair: two equal
    layers on one input, each with its own first consumer of a distinct width. Returns (spec,
    the twins' indices, fresh widths)."""
    widths = iter(rng.sample(range(4, 80), 60))
    spec: list = []
    multi: set = set()

    def grow(count):
        for _ in range(count):
            i = len(spec)
            while True:
                ins = tuple(sorted(rng.sample(range(-1, i), rng.randint(1, min(2, i + 1)))))
                if len(ins) == 1 or ins not in multi:
                    break
            if len(ins) > 1:
                multi.add(ins)
            spec.append((list(ins), next(widths)))
    grow(rng.randint(3, 6))
    at = rng.randint(-1, len(spec) - 1)
    tw = next(widths)
    a = len(spec)
    spec += [([at], tw), ([at], tw)]
    spec += [([a], next(widths)), ([a + 1], next(widths))]
    grow(rng.randint(1, 4))
    return spec, (a, a + 1), widths


def expected_dependence(spec, twins):
    """deps[L]: the nodes whose change changes L's id, by an independent definition of the cut:
    every node upstream of L (L included); and where a twin is among them, the other twin and
    what that twin's direct consumers (its first distinguishing consumers) are computed from:
    a Linear consumer's whole upstream, itself included, or, where it concatenates several
    inputs, the upstream of the concatenation (the Linear after it lies beyond the cut)."""
    a, b = twins
    up = []
    for i, (ins, _) in enumerate(spec):
        s = {i}
        for j in ins:
            if j >= 0:
                s |= up[j]
        up.append(s)
    cut = {a: {a, b}, b: {a, b}}   # a twin's id: its partner (which makes it a twin) and its own consumers
    for t in (a, b):
        for i, (ins, _) in enumerate(spec):
            if t in ins:
                cut[t] |= up[i] if len(ins) == 1 else up[i] - {i}
    return [up[i].union(*(cut[t] for t in (a, b) if t in up[i])) for i in range(len(spec))]


def layer_ids(net):
    mg = module_graph(net)
    assert mg.kind == "fx"
    by = {mg.names[k]: mg.ids[k] for k in mg.layer_keys}
    return [by[a] for a in net._attr]


@pytest.mark.parametrize("seed", range(12))
def test_random_graph_ids_depend_on_upstream_and_cut_only(seed):
    rng = random.Random(seed)
    spec, twins, widths = random_spec(rng)
    n = len(spec)
    base = layer_ids(RandomNet(spec, list(range(n)), list(range(n))))
    assert len(set(base)) == n
    perm = rng.sample(range(n), n)
    order = rng.sample(range(n), n)
    assert layer_ids(RandomNet(spec, perm, order)) == base   # names and declaration order never count
    dep = expected_dependence(spec, twins)
    for m in range(n):
        mutated = [(ins, w) for ins, w in spec]
        mutated[m] = (spec[m][0], next(widths))
        got = layer_ids(RandomNet(mutated, perm, order))
        changed = {i for i in range(n) if got[i] != base[i]}
        assert changed == {i for i in range(n) if m in dep[i]}, (seed, m, spec)
