"""The ``deepfreeze`` command: its parser and :func:`main` (re-exported by :mod:`deepfreeze.cli`,
which documents the commands)."""
from __future__ import annotations

import argparse
import os
import sys

from ..errors import ConfigError, DeepFreezeError
from . import backend, export, gc, inspect, ls, memtier, repo, verify
from . import importer
from ._common import (EXIT_FAIL, EXIT_OK, EXIT_USAGE, Parser, UsageError, err, package_version,
                      version_arg)

__all__ = ["main", "build_parser"]

_COMMANDS = (ls, inspect, verify, export, gc, backend, repo, memtier, importer)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command (each command module adds its own subparser)."""
    common = Parser(add_help=False)
    g = common.add_argument_group("configuration (as in training)")
    g.add_argument("--config", metavar="FILE",
                   help="VeloC INI file (optional; VELOC_<KEY> environment variables apply on top)")
    g.add_argument("--name", metavar="NAME",
                   help="checkpoint name (as DeepFreezeCheckpoint(name=...) or Checkpointer(name=...)); "
                        "default: the only one found")
    g.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
                   help="override an INI key, e.g. --set scratch=/local/ssd/ckpt (repeatable)")
    as_json = Parser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print machine-readable JSON")
    version = Parser(add_help=False)
    version.add_argument("--version", type=version_arg, metavar="V",
                         help="checkpoint version (default: the newest committed one)")

    ap = Parser(prog="deepfreeze", description="Inspect and manage DeepFreeze checkpoints (see docs/cli.md).",
                epilog="exit codes: 0 success, 1 damaged / not found / I/O error, 2 usage or configuration error")
    ap.add_argument("--version", action="version", version=f"deepfreeze {package_version()}",
                    help="print the installed DeepFreeze version and exit")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    trust = Parser(add_help=False)
    trust.add_argument("--trust-owner", metavar="USER", action="append", default=None, dest="trust_owners",
                       help="also read persistent files owned by USER (name or uid; repeatable); by default only "
                            "your own and root's are read")
    parents = {"common": common, "json": as_json, "version": version, "trust": trust}
    for module in _COMMANDS:
        module.add_parser(sub, parents)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit code (errors: one line on stderr)."""
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else EXIT_OK
    except (UsageError, ConfigError) as e:
        err(e)
        return EXIT_USAGE
    except DeepFreezeError as e:
        from ..export import ExportError  # the output or format refused: a usage error
        err(e)
        return EXIT_USAGE if isinstance(e, ExportError) else EXIT_FAIL
    except BrokenPipeError:
        try:
            sys.stdout = open(os.devnull, "w")  # the reader went away (e.g. `| head`): no second error
        except OSError:
            pass
        return EXIT_FAIL
    except OSError as e:
        err(e)
        return EXIT_FAIL
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        return 130
    except (ValueError, KeyError, IndexError, TypeError, RecursionError, AttributeError, RuntimeError) as e:
        # a damaged or hostile file that slipped past the readers' checks: still one line, no traceback
        err(f"unexpected {type(e).__name__}: {e} (please report this, with the command, as a DeepFreeze bug)")
        return EXIT_FAIL
