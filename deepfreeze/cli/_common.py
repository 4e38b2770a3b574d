"""Shared pieces of the ``deepfreeze`` command modules: configuration, names, output."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Iterable, NoReturn

from ..config import KEYS, NO_FILE, Config, validate_name
from ..errors import CheckpointNotFoundError, ConfigError
from ..inventory import checkpoint_names

__all__ = ["EXIT_OK", "EXIT_FAIL", "EXIT_USAGE", "UsageError", "err", "emit_json", "table", "mb", "Progress",
           "load_config", "resolve_name", "version_arg", "Parser", "package_version"]

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A command-line mistake: exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse that raises :class:`UsageError` instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def package_version() -> str:
    """The installed distribution's version (``importlib.metadata``), else ``deepfreeze.__version__``."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        try:
            return version("deepfreeze")
        except PackageNotFoundError:
            pass
    except ImportError:  # pragma: no cover - Python < 3.8
        pass
    from .. import __version__
    return __version__


# ============================================================================ output helpers

def err(msg: Any) -> None:
    """One line on stderr: ``deepfreeze: error: <msg>`` (whitespace folded)."""
    sys.stderr.write("deepfreeze: error: " + " ".join(str(msg).split()) + "\n")


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=1, sort_keys=False) + "\n")


def table(headers: list[str], rows: list[list[Any]], right: Iterable[int] = ()) -> list[str]:
    """Aligned columns (``right``: indices of right-aligned columns); None prints as ``-``."""
    right = set(right)
    cells = [headers] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = []
    for r in cells:
        parts = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(r)]
        out.append("  ".join(parts).rstrip())
    return out


def mb(n: int) -> str:
    """``"2.8 MB"``."""
    return f"{n / 1e6:.1f} MB"


def mb_number(n: int) -> str:
    """Megabytes (10**6 bytes) for a table column: two decimals below 10 MB, one above."""
    return f"{n / 1e6:.2f}" if n < 10_000_000 else f"{n / 1e6:.1f}"


class Progress:
    """One self-overwriting status line on stderr, only when stderr is a terminal."""

    def __init__(self) -> None:
        try:
            self.enabled = sys.stderr.isatty()
        except (AttributeError, ValueError):
            self.enabled = False
        self._last = 0.0
        self._shown = False

    def update(self, text: str, *, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and self._shown and now - self._last < 0.1:
            return
        self._last, self._shown = now, True
        sys.stderr.write("\r\033[K" + text)
        sys.stderr.flush()

    def bytes_fn(self, verb: str) -> Any:
        """A ``progress(label, done, total)`` callback for :mod:`deepfreeze.inventory`."""
        return lambda label, done, total: self.update(f"{verb} {label}: {mb(done)} of {mb(total)}")

    def done(self) -> None:
        if self.enabled and self._shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self._shown = False


# ============================================================================ configuration

def _overrides(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"--set {item!r}: expected KEY=VALUE, e.g. --set scratch=/local/ssd/ckpt")
        if key not in KEYS:
            raise ConfigError(f"--set {key}=...: unknown key {key!r}. Known keys: {', '.join(sorted(KEYS))} "
                              "(see docs/configuration.md)")
        out[key] = value.strip()
    return out


def _file_sets_mode(path: str | None) -> bool:
    if path is None:
        return False
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(1 << 20)
    except (OSError, ValueError):
        return True  # let Config.load report the file problem itself
    return any(line.split("#", 1)[0].split("=", 1)[0].strip() == "mode"
               for line in text.splitlines() if "=" in line.split("#", 1)[0])


def load_config(config: str | None, sets: list[str]) -> Config:
    """``Config.resolve(config, **overrides)``. The tool never writes checkpoints, so when no
    source sets the mandatory ``mode`` it is taken as ``sync`` instead of failing."""
    overrides = _overrides(sets)
    if "mode" not in overrides and "VELOC_MODE" not in os.environ and not _file_sets_mode(config):
        overrides["mode"] = "sync"
    try:
        return Config.resolve(config, **overrides)
    except ConfigError as e:
        msg = str(e).replace("keyword override", "--set")
        if msg.startswith(NO_FILE + ": "):  # no file: the value had to come from VELOC_<KEY> or --set
            msg = "configuration (no --config file): " + msg[len(NO_FILE) + 2:] + " (--set KEY=VALUE or VELOC_<KEY>)"
        raise ConfigError(msg) from None


def resolve_name(args: argparse.Namespace, cfg: Config) -> str:
    """``--name``, else the only checkpoint name found on the levels."""
    if args.name is not None:
        return validate_name(args.name)
    names = checkpoint_names(cfg)
    if len(names) == 1:
        return names[0]
    if not names:
        raise CheckpointNotFoundError(f"no checkpoints in scratch {cfg.scratch} or persistent {cfg.persistent}: "
                                      "check --config / --set, or pass --name")
    raise UsageError(f"several checkpoints under scratch {cfg.scratch} and persistent {cfg.persistent} "
                     f"({', '.join(names)}): pick one with --name")


def version_arg(text: str) -> int:
    """argparse type of ``--version V``: an integer in [0, 10**12)."""
    try:
        if len(text) > 20:
            raise ValueError(text)
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid version {text!r}: an integer >= 0") from None
    if not 0 <= v < 10 ** 12:
        raise argparse.ArgumentTypeError(f"invalid version {text!r}: an integer >= 0")
    return v
