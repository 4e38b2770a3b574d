"""``deepfreeze``: list, inspect, verify, export and clean up checkpoints; talk to the backend.

    deepfreeze --version
    deepfreeze ls       [--config FILE] [--name NAME] [--set KEY=VALUE ...] [--json]
    deepfreeze inspect  [...] [--version V] [--json]
    deepfreeze verify   [...] [--version V | --all] [--json]
    deepfreeze export   [...] [--version V] --format h5|npz|safetensors --output PATH [--force]
    deepfreeze gc       [...] [--dry-run]
    deepfreeze backend  status|stop [...]
    deepfreeze repo     ls|info|rm|gc|import|serve|token ...   (the model repository)
    deepfreeze memtier  create|view|dump|repack ...             (the memory tier)
    deepfreeze import   --format dcp DIR --name NAME --step S [...] (PyTorch: from a DCP checkpoint)

A package of thin command modules (``ls``, ``inspect``, ``verify``, ``export``,
``gc``, ``backend``, ``repo``, ``memtier``; shared helpers in ``_common``) over the core: scanning,
describing, verifying and gc planning live in :mod:`deepfreeze.inventory`,
reading in :mod:`deepfreeze.loader`. The configuration is built as the training
side builds it: ``Config.resolve(--config, **--set)``, so ``VELOC_<KEY>``
environment variables apply between the file and ``--set``. Imports no
TensorFlow. Exit codes: 0 success, 1 damaged / not found / I/O error, 2 usage
or configuration error; every error is one line on stderr, never a traceback.
Documented in docs/cli.md.
"""
from __future__ import annotations

import argparse
import os
import sys

from ..errors import ConfigError, DeepFreezeError
from . import backend, export, gc, inspect, ls, memtier, repo, verify
from . import importer
from ._common import (EXIT_FAIL, EXIT_OK, EXIT_USAGE, Parser, UsageError, err, load_config, package_version,
                      version_arg)

__all__ = ["main", "build_parser", "load_config", "EXIT_OK", "EXIT_FAIL", "EXIT_USAGE"]

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
