"""Only the adapters import their framework: no module outside ``deepfreeze/keras`` and
``deepfreeze/torch`` imports torch or TensorFlow (a static scan of every import statement and
``import_module`` call, and a fresh interpreter that imports every core module)."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADAPTERS = ("keras", "torch")
FRAMEWORKS = ("torch", "tensorflow", "keras", "tf_keras")


def _core_files() -> list[str]:
    out = []
    for base in (os.path.join(ROOT, "deepfreeze"), os.path.join(ROOT, "bindings")):
        for d, dirs, files in os.walk(base):
            rel = os.path.relpath(d, os.path.join(ROOT, "deepfreeze"))
            if rel.split(os.sep)[0] in ADAPTERS:
                dirs[:] = []
                continue
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            out += [os.path.join(d, f) for f in files if f.endswith(".py")]
    return sorted(out)


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].split(os.sep)
    if rel[0] == "bindings":
        rel = ["deepfreeze", *rel]
    if rel[-1] == "__init__":
        rel = rel[:-1]
    return ".".join(rel)


def _framework(name: "str | None") -> bool:
    return bool(name) and name.split(".")[0] in FRAMEWORKS


def test_core_files_found():
    files = _core_files()
    names = {_module_name(f) for f in files}
    assert {"deepfreeze.engine", "deepfreeze.loader", "deepfreeze.run", "deepfreeze.cli"} <= names
    assert not any(n.startswith(("deepfreeze.keras", "deepfreeze.torch")) for n in names)


def test_no_core_module_imports_a_framework_statically():
    bad = []
    for path in _core_files():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                  and isinstance(node.args[0].value, str)
                  and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("import_module", "__import__")):
                names = [node.args[0].value]
            bad += [f"{os.path.relpath(path, ROOT)}:{node.lineno}: {n}" for n in names if _framework(n)]
    assert not bad, "core modules import a framework (only deepfreeze/keras and deepfreeze/torch may):\n" + \
        "\n".join(bad)


def test_importing_every_core_module_loads_no_framework():
    mods = sorted({_module_name(f) for f in _core_files()} - {"deepfreeze.__main__", "deepfreeze.cli.__main__"})
    # a module needing an optional package that is not installed (or deepfreeze.bindings without the
    # editable install) is left out and listed; a framework missing would be a failure
    code = ("import importlib, sys\n"
            "skipped = []\n"
            f"for m in {mods!r}:\n"
            "    try:\n"
            "        importlib.import_module(m)\n"
            "    except ModuleNotFoundError as e:\n"
            f"        if (e.name or '').split('.')[0] in {FRAMEWORKS!r}:\n"
            "            raise\n"
            "        skipped.append(m)\n"
            f"loaded = sorted(k for k in sys.modules if k.split('.')[0] in {FRAMEWORKS!r})\n"
            "print(','.join(loaded))\n"
            "print(','.join(skipped))\n")
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    loaded, skipped = (r.stdout.split("\n") + ["", ""])[:2]
    assert loaded == "", f"importing the core loaded {loaded}"
    assert not {"deepfreeze.engine", "deepfreeze.loader", "deepfreeze.run", "deepfreeze.cli"} & set(skipped.split(","))
