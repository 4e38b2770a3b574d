"""The layer order of the package (docs/architecture.md, "Floor plan"), checked on the source.

Every module of ``deepfreeze`` and ``bindings`` has a layer in :data:`LAYERS`; a module imports
only modules of its own layer or below. Counted: every import statement anywhere in a file
(module level, inside functions and class bodies, under ``if TYPE_CHECKING:``), the dynamic
imports listed in :data:`DYNAMIC`, and what an import of a submodule runs first: its packages'
``__init__`` (their import-time imports count as imports of the importing module). Third-party
imports (TensorFlow, torch, lightning, transformers, numpy, ...) are not part of the graph.

Also checked: no import cycle (Tarjan's strongly connected components over the same graph);
no ``_private`` name imported or used across units (a unit is one module of the flat core, or
one subpackage); the adapters (``deepfreeze.keras``, ``deepfreeze.torch``) reach the write path
(engine, backend, VeloC engine, levels) only through :class:`deepfreeze.run.Run`; the table here
and the one in docs/architecture.md are the same; a new module fails until it is placed.

``python tests/test_layers.py`` prints the graph's findings (cycles, upward imports, private
names) without asserting, for working on them.
"""
from __future__ import annotations

import ast
import os
import re
import sys
from collections import defaultdict

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The packages and the directory each is in: bindings/ installs as deepfreeze.bindings (pyproject.toml).
PACKAGES = {"deepfreeze": "deepfreeze", "deepfreeze.bindings": "bindings"}

# The layer table, bottom to top (a prefix ending in "." places every module of that subpackage).
LAYERS: dict[int, tuple[str, ...]] = {
    0: ("deepfreeze.bindings.", "deepfreeze._lazy", "deepfreeze._native", "deepfreeze.errors", "deepfreeze.counters", "deepfreeze.crashpoints",
        "deepfreeze.jsonsafe", "deepfreeze.ownership", "deepfreeze.config", "deepfreeze.format",
        "deepfreeze.shardplan", "deepfreeze.fused", "deepfreeze.net", "deepfreeze.node", "deepfreeze.fsafe",
        "deepfreeze.comm", "deepfreeze.peerloss", "deepfreeze.priority"),
    1: ("deepfreeze.lease",),
    2: ("deepfreeze.memtier.", "deepfreeze.export"),
    3: ("deepfreeze.tiers.", "deepfreeze.redundancy"),
    4: ("deepfreeze.backend", "deepfreeze.engine", "deepfreeze.veloc_engine", "deepfreeze.veloc_daemon", "deepfreeze.loader",
        "deepfreeze.inventory"),
    5: ("deepfreeze.run",),
    6: ("deepfreeze.clone.", "deepfreeze.stream.", "deepfreeze.repo."),
    7: ("deepfreeze.keras.", "deepfreeze.torch."),
    8: ("deepfreeze.cli.", "deepfreeze.__main__", "deepfreeze"),
}
LAYER_NAMES = {0: "primitives", 1: "run identity and leases", 2: "memory tier, export", 3: "storage tiers, redundancy",
               4: "engines, backend, reading back", 5: "the run", 6: "siblings", 7: "adapters",
               8: "facade, CLI, entry points"}

# Imports the AST cannot see (importlib.import_module with a computed name): module -> our modules it
# may load that way. A package facade's table (deepfreeze._lazy.facade(__name__, {...})) is read from
# the source as imports of the package, so the facade machinery itself loads nothing of its own.
DYNAMIC: dict[str, tuple[str, ...]] = {
    "deepfreeze._lazy": (),  # facade(): the modules named in each package's table
    "deepfreeze.cli.repo": (),  # `deepfreeze repo import --model MODULE:FUNCTION`: the user's module
}

# The write path: the adapters reach it only through deepfreeze.run.Run.
WRITE_PATH = ("deepfreeze.engine", "deepfreeze.backend", "deepfreeze.veloc_engine", "deepfreeze.tiers")
ADAPTERS = ("deepfreeze.keras", "deepfreeze.torch")


def _modules() -> dict[str, str]:
    """Every module of the packages: dotted name -> file."""
    out = {}
    for pkg, top in PACKAGES.items():
        for d, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [x for x in dirs if not x.startswith(".") and x != "__pycache__"]
            sub = os.path.relpath(d, os.path.join(ROOT, top))
            rel = pkg if sub == "." else f"{pkg}.{sub.replace(os.sep, '.')}"
            for f in files:
                if f.endswith(".py"):
                    out[rel if f == "__init__.py" else f"{rel}.{f[:-3]}"] = os.path.join(d, f)
    return out


MODULES = _modules()


def layer_of(mod: str) -> int | None:
    best, length = None, -1
    for layer, names in LAYERS.items():
        for n in names:
            if (mod == n or (n.endswith(".") and (mod + ".").startswith(n))) and len(n) > length:
                best, length = layer, len(n)
    return best


def _is_pkg(mod: str) -> bool:
    return MODULES.get(mod, "").endswith("__init__.py")


def _resolve(mod: str, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = mod.split(".") if _is_pkg(mod) else mod.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


class _Imports(ast.NodeVisitor):
    """Every import of one module: (target module, names, line, module level?, type checking?)."""

    def __init__(self, mod: str):
        self.mod, self.found, self.depth, self.typing = mod, [], 0, 0
        self.dynamic = []

    def _add(self, target: str, names: list[str], line: int, lazy: bool = False) -> None:
        if target.split(".")[0] == "deepfreeze":  # (top: runs when the module is imported)
            self.found.append((target, names, line, self.depth == 0 and not lazy, self.typing > 0))

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self._add(a.name, [], node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self._add(_resolve(self.mod, node.level, node.module), [a.name for a in node.names], node.lineno)

    def _scope(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _scope

    def visit_If(self, node: ast.If) -> None:
        t = node.test
        tc = (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
            isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")
        if tc:
            self.typing += 1
            for n in node.body:
                self.visit(n)
            self.typing -= 1
            for n in node.orelse:
                self.visit(n)
        else:
            self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name in ("import_module", "__import__"):
            self.dynamic.append(node.lineno)
        if name == "facade":  # a lazy package facade (deepfreeze._lazy): its table's modules are imports
            for c in ast.walk(node):
                if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value.startswith("."):
                    module = c.value.partition(":")[0]
                    level = len(module) - len(module.lstrip("."))
                    self._add(_resolve(self.mod, level, module.lstrip(".") or None), [], node.lineno, lazy=True)
        self.generic_visit(node)


def _parse(mod: str) -> _Imports:
    with open(MODULES[mod]) as f:
        tree = ast.parse(f.read(), MODULES[mod])
    v = _Imports(mod)
    v.visit(tree)
    v.tree = tree
    return v


PARSED = {m: _parse(m) for m in MODULES}


def _targets(target: str, names: list[str]) -> list[str]:
    """The modules an import statement loads: ``from pkg import sub`` loads pkg.sub."""
    out = []
    subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
    if target in MODULES and (len(subs) < len(names) or not names):
        out.append(target)
    out.extend(subs)
    if not out and target not in MODULES:  # a name that is not a module of ours: its nearest package
        parts = target.split(".")
        while parts and ".".join(parts) not in MODULES:
            parts.pop()
        if parts:
            out.append(".".join(parts))
    return out


def _parents(mod: str) -> list[str]:
    parts = mod.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _init_time(pkg: str) -> set[str]:
    """What a package's ``__init__`` imports when it runs (module level, outside TYPE_CHECKING)."""
    return {t for target, names, _, top, typing in PARSED[pkg].found if top and not typing
            for t in _targets(target, names)}


def graph() -> dict[str, dict[str, tuple[int, str]]]:
    """module -> {imported module: (line, how)}; how is "import", "dynamic" or "package <p>"."""
    g: dict[str, dict[str, tuple[int, str]]] = defaultdict(dict)
    for mod, v in PARSED.items():
        for target, names, line, _, _ in v.found:
            for t in _targets(target, names):
                if t != mod:
                    g[mod].setdefault(t, (line, "import"))
        for t in DYNAMIC.get(mod, ()):
            g[mod].setdefault(t, (0, "dynamic"))
        for p in _parents(mod):  # importing mod runs its packages' __init__ first
            for t in _init_time(p):
                if t != mod and not mod.startswith(t + "."):
                    g[mod].setdefault(t, (0, f"package {p}"))
        g.setdefault(mod, {})
    return g


def tarjan(g: dict[str, dict[str, object]]) -> list[list[str]]:
    """Strongly connected components with more than one member (iterative Tarjan)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in g:
                    continue
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def unit_of(mod: str) -> str:
    """A subpackage of deepfreeze is one unit; each module of the flat core is its own."""
    parts = mod.split(".")
    if len(parts) >= 2 and _is_pkg(".".join(parts[:2])):
        return ".".join(parts[:2])
    return mod


def upward() -> list[str]:
    out = []
    for mod, edges in graph().items():
        lm = layer_of(mod)
        for t, (line, how) in sorted(edges.items()):
            lt = layer_of(t)
            if lm is not None and lt is not None and lt > lm:
                out.append(f"{mod} (L{lm}) imports {t} (L{lt}) at line {line} ({how})")
    return out


def private_crossings() -> list[str]:
    out = []
    for mod, v in PARSED.items():
        bound = {}  # local name -> our module it is bound to
        for node in ast.walk(v.tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(mod, node.level, node.module)
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    if sub in MODULES:
                        bound[a.asname or a.name] = sub
                        if a.name.startswith("_") and unit_of(sub) != unit_of(mod) and unit_of(target) != unit_of(mod):
                            out.append(f"{mod}:{node.lineno} imports the private module {sub}")
                    elif target in MODULES and a.name.startswith("_") and not a.name.startswith("__") \
                            and unit_of(target) != unit_of(mod):
                        out.append(f"{mod}:{node.lineno} imports {target}.{a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in MODULES and a.asname:
                        bound[a.asname] = a.name
        for node in ast.walk(v.tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                t = bound[node.value.id]
                if unit_of(t) != unit_of(mod):
                    out.append(f"{mod}:{node.lineno} uses {t}.{node.attr}")
    return sorted(set(out))


def adapter_write_path() -> list[str]:
    return [f"{mod} imports {t} at line {line} ({how})" for mod, edges in graph().items()
            if mod.startswith(ADAPTERS) for t, (line, how) in edges.items()
            if t in WRITE_PATH or t.startswith("deepfreeze.tiers.")]


def unplaced() -> list[str]:
    return sorted(m for m in MODULES if layer_of(m) is None)


def undeclared_dynamic() -> list[str]:
    return [f"{m}:{line}" for m, v in PARSED.items() for line in v.dynamic if m not in DYNAMIC]


# ----------------------------------------------------------------------------------- the tests

def test_every_module_is_placed_in_a_layer():
    assert not unplaced(), f"place these modules in LAYERS (and in docs/architecture.md's table): {unplaced()}"


def test_imports_go_only_down_or_sideways():
    assert not upward(), "\n".join(upward())


def test_no_import_cycle():
    cycles = tarjan(graph())
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_no_private_name_crosses_a_unit():
    assert not private_crossings(), "\n".join(private_crossings())


def test_adapters_reach_the_write_path_only_through_run():
    assert not adapter_write_path(), "\n".join(adapter_write_path())


def test_dynamic_imports_are_declared():
    assert not undeclared_dynamic(), f"list these dynamic imports in DYNAMIC: {undeclared_dynamic()}"


def test_the_docs_table_is_this_table():
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        text = f.read()
    rows = re.findall(r"^\| L(\d) \| [^|]+ \| ([^|]+) \|", text, re.M)
    assert rows, "docs/architecture.md has no layer table (rows '| L<n> | name | `module`, ... |')"
    doc = {int(n): tuple(sorted(re.findall(r"`([\w.]+)`", mods))) for n, mods in rows}
    ours = {n: tuple(sorted(names)) for n, names in LAYERS.items()}
    assert doc == ours


def test_the_graph_sees_function_local_and_package_imports():
    """The checker itself: a function-local import and a package's import-time import are edges."""
    g = graph()
    assert "deepfreeze.config" in g["deepfreeze"]  # the facade's lazy import (read from its table)
    local = [m for m, v in PARSED.items() if any(not top for _, _, _, top, _ in v.found)]
    assert local, "no function-local import found: the visitor is broken"
    m = local[0]
    t = next(t for t, names, _, top, _ in PARSED[m].found if not top)
    assert any(x in g[m] for x in _targets(t, next(n for tt, n, _, top, _ in PARSED[m].found if tt == t)))
    assert tarjan({"a": {"b": 1}, "b": {"a": 1}, "c": {}}) == [["a", "b"]]


def _facade_names(pkg: str) -> set[str]:
    """The public names of a package's facade table (``facade(__name__, {name: module})``)."""
    out = set()
    for node in ast.walk(PARSED[pkg].tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "facade":
            for d in ast.walk(node):
                if isinstance(d, ast.Dict):
                    out |= {k.value for k in d.keys if isinstance(k, ast.Constant)}
                if isinstance(d, ast.DictComp) and isinstance(d.generators[0].iter, ast.Tuple):
                    out |= {e.value for e in d.generators[0].iter.elts if isinstance(e, ast.Constant)}
    return out


def _module_all(mod: str) -> set[str] | None:
    """A module's ``__all__`` (a literal list at module level), or None."""
    for node in PARSED[mod].tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return None


def _type_checking_names(pkg: str) -> set[str]:
    """The names a package binds under ``if TYPE_CHECKING:`` (``from .m import a as b`` binds ``b``)."""
    out = set()
    for node in PARSED[pkg].tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            for s in ast.walk(node):
                if isinstance(s, ast.ImportFrom):
                    out |= {a.asname or a.name for a in s.names}
    return out


def _defined_names(mod: str) -> set[str]:
    """The public functions, classes and constants a module defines at its top level."""
    body = PARSED[mod].tree.body
    names = {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    names |= {t.id for n in body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    return {n for n in names if not n.startswith("_")}


def name_clashes() -> list[str]:
    """Package names that are both a facade name (or a function the package defines) and a submodule:
    which one ``pkg.name`` is would depend on what was imported first."""
    return [f"{pkg}.{name}" for pkg in MODULES if _is_pkg(pkg)
            for name in sorted(_facade_names(pkg) | _defined_names(pkg)) if f"{pkg}.{name}" in MODULES]


def test_no_name_is_both_a_module_and_a_function():
    """One address for every name: modules are named as roles, functions as verbs, so no package
    attribute is a module or a function depending on what was imported first, and no module is
    made callable (no ``callable_module``, no module class with ``__call__``)."""
    assert not name_clashes(), f"rename these modules (a role, not the function's verb): {name_clashes()}"
    callable_mods = [m for m, v in PARSED.items() for n in ast.walk(v.tree)
                     if (isinstance(n, ast.Name) and n.id in ("callable_module", "_CallableModule"))
                     or (isinstance(n, ast.Attribute) and n.attr == "__class__" and isinstance(n.ctx, ast.Store))
                     or (isinstance(n, ast.FunctionDef) and n.name == "__call__"
                         and m.endswith("_lazy"))]
    assert not callable_mods, f"modules made callable: {sorted(set(callable_mods))}"


def test_the_public_functions_are_functions_whatever_was_imported_first():
    """After their modules were imported, ``deepfreeze.torch.restore`` & co. are still the functions
    (with their own signatures), and the modules keep their names."""
    import subprocess
    pytest.importorskip("torch")
    pytest.importorskip("tensorflow")
    code = ("import inspect, types, deepfreeze, deepfreeze.memtier, deepfreeze.torch, deepfreeze.keras\n"
            "import deepfreeze.memtier.dumper as d\n"
            "assert isinstance(deepfreeze.memtier.dump, types.FunctionType), deepfreeze.memtier.dump\n"
            "assert deepfreeze.memtier.dump is d.dump and d.weights_only\n"
            "assert 'out_path' in inspect.signature(deepfreeze.memtier.dump).parameters\n"
            "assert isinstance(deepfreeze.restore, types.FunctionType)\n"
            "assert 'input_spec' in inspect.signature(deepfreeze.restore).parameters\n"
            "import deepfreeze.torch.state_loader, deepfreeze.keras.state_loader\n"
            "assert isinstance(deepfreeze.keras.restore, types.FunctionType) and isinstance(\n"
            "    deepfreeze.torch.restore, types.FunctionType), (deepfreeze.keras.restore, deepfreeze.torch.restore)\n"
            "assert 'optimizer' in inspect.signature(deepfreeze.torch.restore).parameters\n"
            "print('ok')\n")
    # (the modules are gone from this tree: an editable install of another checkout may still find them)
    assert not {"deepfreeze.restore", "deepfreeze.memtier.dump", "deepfreeze.keras.restore",
                "deepfreeze.torch.restore"} & set(MODULES)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr


def test_root_restore_into_a_torch_model_never_imports_tensorflow():
    """``deepfreeze.restore(torch_module, ...)`` is ``deepfreeze.torch.restore`` (weights only): a
    round trip in a fresh interpreter, after which TensorFlow and Keras are not in ``sys.modules``;
    something neither torch nor Keras is a TypeError, also without importing TensorFlow."""
    pytest.importorskip("torch")
    import subprocess
    import tempfile
    code = ("import sys, torch, deepfreeze\n"
            "from deepfreeze.torch import Checkpointer\n"
            "d = sys.argv[1]; where = dict(mode='sync', scratch=d + '/s', persistent=d + '/p')\n"
            "torch.manual_seed(0); net = torch.nn.Linear(4, 2); opt = torch.optim.SGD(net.parameters(), lr=0.1)\n"
            "ck = Checkpointer(net, opt, name='r', every_n_steps=2, **where)\n"
            "for _ in range(2):\n"
            "    net(torch.ones(3, 4)).sum().backward(); opt.step(); opt.zero_grad()\n"
            "ck.close()\n"
            "fresh = torch.nn.Linear(4, 2)\n"
            "got = deepfreeze.restore(fresh, name='r', **where)\n"
            "assert got == (2, 2) and type(got) is tuple, got\n"
            "assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), fresh.state_dict().values()))\n"
            "try:\n    deepfreeze.restore(object(), name='r', **where)\n"
            "except TypeError as e:\n    print('type error:', e)\n"
            "try:\n    deepfreeze.restore(fresh, name='r', input_spec=object(), **where)\n"
            "except deepfreeze.ConfigError as e:\n    print('config error:', e)\n"
            "print('loaded', sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras', 'tf_keras')))\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run([sys.executable, "-c", code, d], capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "type error: deepfreeze.restore: builtins.object is neither" in out.stdout, out.stdout
    assert "config error: input_spec is for Keras models" in out.stdout, out.stdout
    assert "loaded []" in out.stdout, out.stdout


def test_facade_all_and_type_checking_name_the_same_set():
    """Each package facade's ``__all__``, its lazy table (plus the functions it defines itself) and its
    ``if TYPE_CHECKING:`` imports (plus those functions) name the same public names."""
    bad = []
    for pkg in sorted(m for m in MODULES if _is_pkg(m)):
        table = _facade_names(pkg)
        if not table:
            continue
        exported, own = _module_all(pkg), _defined_names(pkg)
        if exported is not None:  # a submodule in __all__ (``from deepfreeze.torch import clone``) is no facade name
            exported = {n for n in exported if f"{pkg}.{n}" not in MODULES}
        typed = _type_checking_names(pkg)
        if exported is None or table | own != exported or typed | own != exported:
            bad.append(f"{pkg}: __all__ - table {sorted((exported or set()) - table - own)}, "
                       f"table - __all__ {sorted(table - (exported or set()))}, "
                       f"__all__ - TYPE_CHECKING {sorted((exported or set()) - typed - own)}, "
                       f"TYPE_CHECKING - __all__ {sorted(typed - (exported or set()))}")
    assert not bad, "\n".join(bad)
    assert {"deepfreeze", "deepfreeze.torch", "deepfreeze.keras", "deepfreeze.memtier"} <= {
        m for m in MODULES if _is_pkg(m) and _facade_names(m)}  # the checker sees the facades


def reexports() -> list[str]:
    """Names a module (not a package ``__init__`` facade) imports from another of our modules only to
    offer them again: listed in its ``__all__``, or never used in it (a compatibility re-export)."""
    out = []
    for mod, v in PARSED.items():
        if _is_pkg(mod):
            continue
        imported: dict[str, int] = {}
        for node in v.tree.body:
            stmts = [node]
            if isinstance(node, ast.If):
                stmts = node.body + node.orelse
            elif isinstance(node, ast.Try):
                stmts = node.body + [s for h in node.handlers for s in h.body]
            for s in stmts:
                if isinstance(s, ast.ImportFrom) and _resolve(mod, s.level, s.module).split(".")[0] == "deepfreeze":
                    imported.update({a.asname or a.name: s.lineno for a in s.names})
        exported = _module_all(mod) or set()
        used = {n.id for n in ast.walk(v.tree) if isinstance(n, ast.Name)}
        words = set(re.findall(r"\w+", " ".join(  # names in string annotations ("Config | None")
            n.value for n in ast.walk(v.tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and len(n.value) < 200)))
        out += [f"{mod}:{line}: {name}" for name, line in imported.items()
                if name == "*" or name in exported or (name not in used and name not in words)]
    return sorted(out)


# Re-exports found when this rule came (issue 43 item 3 removed those of run, redundancy, engine,
# veloc_engine, lease, format, levels and memtier.copy):
# each is to go (its callers importing from the home); the list may only shrink.
KNOWN_REEXPORTS: dict[str, tuple[str, ...]] = {
}


def test_no_module_re_exports_another_modules_names():
    """One home per name: only a package ``__init__`` (a lazy facade) offers names of other modules;
    every caller imports a name from the module that defines it."""
    known = {(m, n) for m, names in KNOWN_REEXPORTS.items() for n in names}
    found = {(f.split(":")[0], f.split(": ")[1]) for f in reexports()}
    assert not found - known, "import these from their home instead:\n" + "\n".join(
        f for f in reexports() if (f.split(":")[0], f.split(": ")[1]) not in known)
    assert not known - found, f"gone: remove them from KNOWN_REEXPORTS: {sorted(known - found)}"
    for m in ("deepfreeze.run", "deepfreeze.redundancy", "deepfreeze.engine", "deepfreeze.veloc_engine"):
        assert m not in KNOWN_REEXPORTS


#: Only the tiers (deepfreeze.tiers: the memory tier as a tier of the write path and as a restore level)
#: and the command line (``deepfreeze memtier ...``) import the memory tier's package.
MEMTIER_USERS = ("deepfreeze.memtier", "deepfreeze.tiers", "deepfreeze.cli")


def memtier_importers() -> list[str]:
    return [f"{mod} imports {t} at line {line} ({how})" for mod, edges in graph().items()
            if unit_of(mod) not in MEMTIER_USERS for t, (line, how) in sorted(edges.items())
            if t == "deepfreeze.memtier" or t.startswith("deepfreeze.memtier.")]


def test_only_the_tiers_and_the_cli_import_the_memory_tier():
    """No module outside ``deepfreeze/tiers/`` and ``deepfreeze/cli/`` imports ``deepfreeze.memtier``:
    the engine, backend, loader and inventory reach it through :mod:`deepfreeze.tiers.memtier`."""
    assert not memtier_importers(), "\n".join(memtier_importers())


#: The most lines a module may have without saying why.
MAX_LINES = 800
#: The modules allowed over MAX_LINES; each opens its docstring with a "Long because:" line naming the
#: one protocol or class it holds. A new one fails until it is listed (and says why); one that shrank
#: below the bound leaves the list.
LONG_MODULES = ("deepfreeze.backend", "deepfreeze.net", "deepfreeze.memtier.device", "deepfreeze.repo.store",
                "deepfreeze.stream.core", "deepfreeze.stream.predict", "deepfreeze.torch.dcp_import")


def long_modules() -> dict[str, int]:
    out = {}
    for mod, path in MODULES.items():
        with open(path) as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES:
            out[mod] = n
    return out


def test_long_modules_are_listed_and_say_why_first():
    found = long_modules()
    assert not set(found) - set(LONG_MODULES), (
        f"over {MAX_LINES} lines: {sorted(set(found) - set(LONG_MODULES))}: split it, or list it in LONG_MODULES and "
        "open its docstring with a 'Long because:' line naming the one protocol or class it holds")
    assert not set(LONG_MODULES) - set(found), f"now at most {MAX_LINES} lines: remove from LONG_MODULES: " \
        f"{sorted(set(LONG_MODULES) - set(found))}"
    silent = [m for m in found if not (ast.get_docstring(PARSED[m].tree) or "").startswith("Long because: ")]
    assert not silent, f"open the docstring with 'Long because: <the one protocol or class it holds>': {silent}"
    assert "deepfreeze.engine" not in LONG_MODULES and "deepfreeze.loader" not in LONG_MODULES
    assert not any(m.startswith("deepfreeze.tiers") for m in LONG_MODULES)


def test_importing_a_low_module_runs_nothing_above_it():
    """``import deepfreeze.errors`` loads only the facade (with its L0 helper) and errors."""
    import subprocess
    code = "import sys, deepfreeze.errors; print(sorted(m for m in sys.modules if m.startswith('deepfreeze')))"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.strip() == "['deepfreeze', 'deepfreeze._lazy', 'deepfreeze.errors']", out.stdout + out.stderr


if __name__ == "__main__":
    g = graph()
    print("modules:", len(MODULES), "edges:", sum(len(e) for e in g.values()))
    print("unplaced:", unplaced())
    cyc = tarjan(g)
    print(f"cycles: {len(cyc)}")
    for c in cyc:
        print("  ", len(c), c)
    up = upward()
    print(f"upward imports: {len(up)}")
    for u in up:
        print("  ", u)
    pv = private_crossings()
    print(f"private crossings: {len(pv)}")
    for p in pv:
        print("  ", p)
    print("memtier importers:", memtier_importers())
    print("over", MAX_LINES, "lines:", long_modules())
    aw = adapter_write_path()
    print(f"adapter write-path imports: {len(aw)}")
    for a in aw:
        print("  ", a)
    print("undeclared dynamic:", undeclared_dynamic())
