"""The project as a user installs it: a wheel built from the source, installed into a fresh venv.

Catches what an editable install hides: a package missing from ``[tool.setuptools] packages``
(e.g. ``deepfreeze.cli`` after ``cli.py`` became a package) or a broken ``[project.scripts]``
entry point. Offline and fast: the wheel is built with the running interpreter's setuptools
(``--no-build-isolation``), installed with ``--no-deps``; the venv borrows the running
interpreter's dependencies (numpy, isal) through a ``.pth`` line naming their directories,
so nothing is downloaded and nothing of the source tree is on the venv's path.
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _source_packages():
    """Every Python package of the source tree that ships (deepfreeze/**, bindings/ as deepfreeze.bindings)."""
    out = {"deepfreeze/bindings"}
    for d, _, files in os.walk(os.path.join(ROOT, "deepfreeze")):
        if "__init__.py" in files and "__pycache__" not in d:
            out.add(os.path.relpath(d, ROOT))
    return out


@pytest.mark.timeout(300)
def test_wheel_in_a_fresh_venv_runs_deepfreeze_version(tmp_path):
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    for name in ("deepfreeze", "bindings"):  # a copy: the build writes build/ and *.egg-info beside the sources
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}
    env["PIP_NO_INPUT"] = "1"
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=240,
                       env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (wheel,) = glob.glob(str(tmp_path / "dist" / "deepfreeze-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        shipped = {os.path.dirname(n) for n in z.namelist() if n.endswith("/__init__.py")}
        entry_points = next(z.read(n).decode() for n in z.namelist() if n.endswith("entry_points.txt"))
        names = set(z.namelist())
    # the fused-copy op's source ships (`python -m deepfreeze.keras.native build` compiles it where
    # installed); a library built in the source tree does not
    assert "deepfreeze/keras/_ops/fused_copy.cc" in names
    assert not [n for n in names if n.endswith(".so") or "_fused_copy" in n], sorted(names)
    assert _source_packages() <= shipped, f"packages missing from the wheel: {_source_packages() - shipped}"
    assert "deepfreeze = deepfreeze.cli:main" in entry_points

    home = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(home)
    py = str(home / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, env=env).stdout.strip()
    import isal
    import numpy
    deps = {os.path.dirname(os.path.dirname(m.__file__)) for m in (numpy, isal)}
    with open(os.path.join(site, "_borrowed_deps.pth"), "w") as f:
        f.write("\n".join(sorted(deps)) + "\n")  # plain lines: those dirs' own .pth files are not run
    p = subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", wheel],
                       capture_output=True, text=True, timeout=240, env=env)
    if p.returncode != 0 and "no such option: --python" in p.stderr:  # pip < 22.3
        p = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", site, wheel],
                           capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]

    exe = home / "bin" / "deepfreeze"
    p = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    version = re.search(r'(?m)^version = "([^"]+)"', open(os.path.join(ROOT, "pyproject.toml")).read()).group(1)
    assert p.returncode == 0 and p.stdout.strip() == f"deepfreeze {version}", p.stdout + p.stderr
    # the command and the core come from the wheel, not from the source tree
    p = subprocess.run([py, "-c", "import deepfreeze.cli, deepfreeze.inventory as i; print(i.__file__)"],
                       capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert p.returncode == 0 and p.stdout.strip().startswith(site), p.stdout + p.stderr
    p = subprocess.run([str(exe), "ls", "--set", f"scratch={tmp_path / 's'}", "--set", f"persistent={tmp_path / 'p'}"],
                       capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert p.returncode == 0 and p.stdout.startswith("no checkpoints in scratch"), p.stdout + p.stderr
