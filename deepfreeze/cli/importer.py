"""``deepfreeze import --format dcp DIR --name NAME --step S``: make version S of NAME from a
``torch.distributed.checkpoint`` directory (:func:`deepfreeze.torch.import_dcp`)."""
from __future__ import annotations

import argparse
from typing import Any

from ._common import EXIT_OK, Progress, UsageError, load_config

__all__ = ["add_parser", "run"]


def _count_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid group counts {text!r}: e.g. 1,1") from None
    if not out or any(n < 1 for n in out):
        raise argparse.ArgumentTypeError(f"invalid group counts {text!r}: positive integers, e.g. 1,1")
    return out


def add_parser(sub: Any, parents: dict[str, argparse.ArgumentParser]) -> None:
    p = sub.add_parser("import", parents=[parents["common"]],
                       help="make a version from a PyTorch DCP checkpoint directory",
                       description="Read a torch.distributed.checkpoint directory (dcp.save with FileSystemWriter: "
                                   "model and get_state_dict's optimizer dict; .metadata through an allow-list "
                                   "unpickler) and write it as version --step of --name, so that "
                                   "Checkpointer(..., resume=True) continues from that step.")
    p.add_argument("dir", metavar="DIR", help="the DCP checkpoint directory (it holds .metadata)")
    p.add_argument("--format", choices=["dcp"], default="dcp", help="input format (dcp)")
    p.add_argument("--step", type=int, required=True, metavar="S",
                   help="the training step the DCP checkpoint was saved at: the version written")
    p.add_argument("--model-prefix", default="model", metavar="KEY",
                   help="DCP key of the model's state dict (default: model; '' for a model at the top level; "
                        "app.model for {'app': AppState})")
    p.add_argument("--optim-prefix", default="optim", metavar="KEY",
                   help="DCP key of get_state_dict's optimizer dict (default: optim; app.optim for an AppState)")
    p.add_argument("--optimizer-groups", type=_count_list, metavar="N,N", default=None,
                   help="param groups of each optimizer, in order (default: one optimizer holding them all)")
    p.add_argument("--state", action="append", default=[], metavar="NAME=KEY",
                   help="a state= object NAME restored from the dict at DCP key KEY (e.g. sched=sched; repeatable)")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new generation of --name (its committed versions are retired)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.name is None:
        raise UsageError("import needs --name NAME: the checkpoint name to write")
    if args.step < 0:
        raise UsageError(f"--step {args.step}: the step the DCP checkpoint was saved at (an integer >= 0)")
    state = {}
    for item in args.state:
        k, sep, v = item.partition("=")
        if not sep or not k or not v:
            raise UsageError(f"--state {item!r}: expected NAME=KEY, e.g. --state sched=sched")
        state[k] = v
    try:  # the adapter (imports PyTorch and DCP)
        from ..torch.dcp_import import import_dcp
    except ImportError as e:
        raise UsageError(f"import --format dcp needs PyTorch ({e}): pip install 'deepfreeze[torch]'") from e
    cfg = load_config(args.config, args.overrides)
    progress = Progress()
    progress.update(f"importing {args.dir}", force=True)
    try:
        r = import_dcp(args.dir, cfg, args.name, args.step, model_prefix=args.model_prefix,
                       optim_prefix=args.optim_prefix, optimizer_groups=args.optimizer_groups, state=state,
                       overwrite=args.overwrite)
    finally:
        progress.done()
    print(f"imported {args.dir} as {r.name!r} v{r.version} (step {r.version}): {r.model_tensors} model tensors, "
          f"{r.optimizer_tensors} optimizer tensors, param groups {r.param_groups}, state objects {r.state or '-'}"
          + (f"; not imported: {r.ignored}" if r.ignored else ""))
    return EXIT_OK
