"""``deepfreeze repo``: the model repository (ls, info, rm, gc, import, serve, token).

    deepfreeze repo ls     REPO [--json]
    deepfreeze repo info   REPO [NAME] [--json]
    deepfreeze repo rm     REPO NAME
    deepfreeze repo gc     REPO [--json] [--quarantine-days DAYS] [--restore PACK]
    deepfreeze repo import REPO NAME [--config F] [--name CKPT] [--set K=V] [--version V] [--model MODULE:FN]
    deepfreeze repo serve  --dir DIR [--listen HOST:PORT] [--allow-remote] [--token-file F] [--arena-size BYTES] [--fsync]
    deepfreeze repo token  [--file F]

``REPO`` is a directory (embedded) or ``dstore://host:port[,host:port...]`` (providers). Thin over
:mod:`deepfreeze.repo` (the repository), :mod:`deepfreeze.repo.importer` and
:mod:`deepfreeze.repo.provider`; TensorFlow is imported only by ``import --model``.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import sys
from typing import Any

from ..errors import ConfigError
from ._common import EXIT_FAIL, EXIT_OK, UsageError, emit_json, err, load_config, mb, resolve_name, table, version_arg

__all__ = ["add_parser", "run"]


def _size(text: str) -> int:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    num, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "")
    try:
        n = int(float(num) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 512M, 2G)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be positive")
    return n


def _days(text: str) -> float:
    try:
        d = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of days") from None
    if not d >= 0 or d == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of days >= 0")
    return d


def add_parser(sub: Any, parents: dict[str, argparse.ArgumentParser]) -> None:
    p = sub.add_parser("repo", help="the model repository: ls, info, rm, gc, import, serve, token",
                       description="Manage a DeepFreeze model repository (docs/repository.md). REPO is a "
                                   "directory or dstore://host:port[,host:port...].")
    rs = p.add_subparsers(dest="repo_command", metavar="SUBCOMMAND", parser_class=type(p))
    rs.required = True
    repo_arg = argparse.ArgumentParser(add_help=False)
    repo_arg.add_argument("repo", metavar="REPO", help="repository directory or dstore://host:port,...")

    q = rs.add_parser("ls", parents=[repo_arg, parents["json"]], help="models and their names")
    q.set_defaults(func=_ls)
    q = rs.add_parser("info", parents=[repo_arg, parents["json"]],
                      help="a stored model (or the repository's totals, de-duplication savings)")
    q.add_argument("model", metavar="NAME", nargs="?", help="<model>[@<tag>]")
    q.set_defaults(func=_info)
    q = rs.add_parser("rm", parents=[repo_arg], help="delete a stored model (its name is never reused)")
    q.add_argument("model", metavar="NAME")
    q.set_defaults(func=_rm)
    q = rs.add_parser("gc", parents=[repo_arg, parents["json"]],
                      help="compact: drop unreferenced tensors and what crashed stores left",
                      description="Compact the repository. The packs it removes are moved into REPO/quarantine "
                                  "and unlinked by a later gc after the quarantine period (7 days); it lists them. "
                                  "Any damaged row: it removes no pack and says why.")
    q.add_argument("--quarantine-days", type=_days, metavar="DAYS",
                   help="unlink the quarantined packs older than DAYS (default: the repository's 7 days; "
                        "0: all those there before this gc); a repository directory only")
    q.add_argument("--restore", metavar="PACK",
                   help="instead of a gc: move PACK (a pack name or quarantine entry it lists) back into "
                        "REPO/packs; a repository directory only")
    q.set_defaults(func=_gc)
    q = rs.add_parser("import", parents=[repo_arg, parents["common"], parents["trust"]],
                      help="a DeepFreeze checkpoint version as a repository model, without re-serializing",
                      description="Import a committed checkpoint version (default: the newest restorable) as "
                                  "model NAME. Checkpoints written by this DeepFreeze record their layer graph; "
                                  "for older ones give --model MODULE:FUNCTION returning the same Keras model.")
    q.add_argument("model", metavar="NAME", help="repository name <model>[@<tag>]")
    q.add_argument("--version", type=version_arg, metavar="V", help="checkpoint version (default: newest)")
    q.add_argument("--model", dest="builder", metavar="MODULE:FUNCTION",
                   help="build the model to compute the layer graph (checkpoints that record none)")
    q.set_defaults(func=_import)
    q = rs.add_parser("serve", help="run a provider process (one per node and port)",
                      description="Serve the repository directory DIR to dstore:// clients. Clients present "
                                  "the token: DEEPFREEZE_TOKEN (the token text itself), else the file "
                                  "DEEPFREEZE_TOKEN_FILE names, else ~/.deepfreeze/token (deepfreeze repo token).")
    q.add_argument("--dir", required=True, metavar="DIR", help="the provider's storage directory")
    q.add_argument("--listen", default="127.0.0.1:7000", metavar="HOST:PORT",
                   help="address to listen on (default 127.0.0.1:7000; port 0 picks a free one)")
    q.add_argument("--allow-remote", action="store_true",
                   help="allow a non-loopback --listen address (clients on other nodes; token still required)")
    q.add_argument("--token-file", metavar="FILE", help="token file (0600); default DEEPFREEZE_TOKEN (the "
                   "token text itself), else the file DEEPFREEZE_TOKEN_FILE names, else ~/.deepfreeze/token")
    q.add_argument("--arena-size", type=_size, metavar="BYTES",
                   help="shared-memory staging arena for same-node clients (default 1G)")
    q.add_argument("--fsync", action="store_true", help="fsync every stored pack and commit durably")
    q.set_defaults(func=_serve)
    q = rs.add_parser("token", help="create the token file clients and providers share")
    q.add_argument("--file", metavar="FILE", help="where (default ~/.deepfreeze/token)")
    q.set_defaults(func=_token)


def _open(args: argparse.Namespace, create: bool = False) -> Any:
    """The repository of REPO; a directory is created only by commands that store (import)."""
    from ..repo import SCHEME, Repository
    return Repository(args.repo) if args.repo.startswith(SCHEME) else Repository(args.repo, create=create)


def _when(t: float | None) -> str:
    if t is None:
        return "-"
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _ls(args: argparse.Namespace) -> int:
    with _open(args) as repo:
        models = repo.list()
        if args.json:
            emit_json({"repository": args.repo, "models": models})
            return EXIT_OK
        if not models:
            print(f"no models in {args.repo}")
            return EXIT_OK
        rows = []
        for model, names in models.items():
            for n in names:
                i = repo.info(n)
                rows.append([model, n, i.get("tensors"), mb(i.get("bytes", 0)), _when(i.get("created"))])
        print("\n".join(table(["MODEL", "NAME", "TENSORS", "SIZE", "STORED"], rows, right=(2, 3))))
    return EXIT_OK


def _info(args: argparse.Namespace) -> int:
    with _open(args) as repo:
        info = repo.info(args.model)
    if args.json:
        emit_json(info)
        return EXIT_OK
    for k, v in info.items():
        if k == "per_provider":
            continue
        if isinstance(v, int) and ("bytes" in k or k in ("deduplicated", "savings")):
            v = f"{v} ({mb(v)})"
        elif k == "created":
            v = _when(v)
        elif isinstance(v, (list, tuple)):
            v = ", ".join(map(str, v)) or "-"
        elif v is None:
            v = "-"
        print(f"{k}: {v}")
    return EXIT_OK


def _rm(args: argparse.Namespace) -> int:
    with _open(args) as repo:
        out = repo.delete(args.model)
    if out:  # what was freed (embedded and remote repositories alike)
        print(f"deleted {args.model}: freed {mb(out['freed'])} (the name stays reserved; tensors shared with other "
              "models stay, and 'deepfreeze repo gc' compacts packs they share)")
    else:
        print(f"deleted {args.model} (the name stays reserved; 'deepfreeze repo gc' frees its space)")
    return EXIT_OK


def _plural(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def gc_summary(out: dict) -> list[str]:
    """The lines ``deepfreeze repo gc`` prints for a gc result: only what it removed or repaired."""
    done = []
    for key, what in (("blobs_removed", "unused tensor"), ("packs_removed", "empty pack"),
                      ("orphans_removed", "file left by a crashed store")):
        if out.get(key):
            done.append(f"removed {_plural(out[key], what)}")
    if out.get("packs_rewritten"):
        done.append(f"compacted {_plural(out['packs_rewritten'], 'pack')}")
    freed = f": freed {mb(out['freed'])}" if out.get("freed") else ""
    lines = [f"{', '.join(done)}{freed}" if done else "nothing to remove"]
    if out.get("refs_repaired"):
        lines.append(f"repaired {_plural(out['refs_repaired'], 'stored reference count')} (recounted from the "
                     "models' rows)")
    if out.get("quarantined"):
        lines.append(f"moved {mb(out['quarantined'])} into the quarantine (unlinked by a later gc after the "
                     "quarantine period; --restore PACK takes one back)")
    if out.get("purged"):
        lines.append(f"unlinked {_plural(out['purged'], 'quarantined pack')} older than the quarantine period"
                     f"{'' if done else freed}")
    held = out.get("quarantine") or []
    if held:
        lines.append(f"quarantine: {_plural(len(held), 'pack')}, {mb(sum(e.get('bytes', 0) for e in held))}:")
        lines += table(["PACK", "SIZE", "MOVED", "UNLINKED AFTER"],
                       [[e.get("file"), mb(e.get("bytes", 0)), _when(e.get("since")), _when(e.get("purge_after"))]
                        for e in held], right=(1,))
    return lines


def _gc(args: argparse.Namespace) -> int:
    from ..repo import SCHEME
    if (args.restore is not None or args.quarantine_days is not None) and args.repo.startswith(SCHEME):
        raise UsageError("--restore and --quarantine-days work on a repository directory: run them on the "
                         "provider's node with the directory it serves (deepfreeze repo serve --dir)")
    if args.restore is not None:
        with _open(args) as repo:
            got = repo.restore_pack(args.restore)
        if args.json:
            emit_json(got)
            return EXIT_OK
        print(f"restored {got['file']} from the quarantine ({got['entry']}) into {args.repo}/packs")
        if not got["referenced"]:
            sys.stderr.write(f"deepfreeze: warning: no row of {args.repo}/meta.db names {got['file']}: repair the row "
                             "or restore meta.db from a backup before the next gc (after its grace period it would "
                             "move the pack into the quarantine again)\n")
        return EXIT_OK
    with _open(args) as repo:
        if args.quarantine_days is not None:
            out = repo.gc(quarantine_period=args.quarantine_days * 86400.0)
        else:
            out = repo.gc()
    damaged = out.get("damaged") or []
    if args.json:
        emit_json(out)
    else:
        print("\n".join(gc_summary(out)))
        for msg in out.get("warnings") or []:
            sys.stderr.write(f"deepfreeze: warning: {msg}\n")
        for msg in damaged:
            err(f"damaged (left as it is): {msg}")
        if damaged:
            err(f"{_plural(len(damaged), 'problem')} found and left as they are: see above for what to do")
    return EXIT_FAIL if damaged else EXIT_OK


def _builder(spec: str) -> Any:
    mod, sep, fn = spec.partition(":")
    if not sep or not mod or not fn:
        raise UsageError(f"--model {spec!r}: expected MODULE:FUNCTION (a function returning the Keras model)")
    try:
        f = getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"--model {spec!r}: cannot import it ({e})") from e
    return f


def _import(args: argparse.Namespace) -> int:
    from ..repo.importer import import_checkpoint
    cfg = load_config(args.config, args.overrides)
    ckpt = resolve_name(args, cfg)
    layers = None
    if args.builder:
        from ..keras.repo import layer_record  # TensorFlow: only on this path
        layers = layer_record(_builder(args.builder)())
    with _open(args, create=True) as repo:
        out = import_checkpoint(repo, args.model, cfg, ckpt, version=args.version, layers=layers,
                                trust_owners=args.trust_owners)
    how = {"linked": "its assembled file hard-linked as a pack (no copy)",
           "copied": "its assembled file copied as a pack (another file system)"}.get(out["how"], "read and stored")
    print(f"imported checkpoint {ckpt!r} v{out['version']} (step {out['step']}) as {args.model}: "
          f"{mb(out['bytes'])} of weights, {how}")
    return EXIT_OK


def _serve(args: argparse.Namespace) -> int:
    from ..repo import provider
    argv = ["--dir", args.dir, "--listen", args.listen]
    if args.allow_remote:
        argv.append("--allow-remote")
    if args.token_file:
        argv += ["--token-file", args.token_file]
    if args.arena_size:
        argv += ["--arena-size", str(args.arena_size)]
    if args.fsync:
        argv.append("--fsync")
    return provider.main(argv)


def _token(args: argparse.Namespace) -> int:
    from .. import net
    path = args.file
    try:
        net.create_token(path)
    except FileExistsError as e:
        raise ConfigError(f"token file {e.filename or path} exists: keep it (clients and providers share it) "
                          "or remove it first") from e
    print(f"created token file {path or net.default_token_path()} (0600)")
    return EXIT_OK


def run(args: argparse.Namespace) -> int:
    return args.func(args)
