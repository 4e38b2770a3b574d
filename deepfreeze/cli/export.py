"""``deepfreeze export``: write a committed version as h5, npz, safetensors or (PyTorch) torch or
a DCP checkpoint directory (``--format dcp``)."""
from __future__ import annotations

import argparse
import os
from typing import Any

from ..loader import load
from ._common import EXIT_OK, Progress, UsageError, load_config, resolve_name

__all__ = ["add_parser", "run"]


def add_parser(sub: Any, parents: dict[str, argparse.ArgumentParser]) -> None:
    p = sub.add_parser("export", parents=[parents["common"], parents["version"], parents["trust"]],
                       help="write a version as h5, npz, safetensors, torch or dcp",
                       description="Load a committed version (checksums verified) and write it as a Keras HDF5 "
                                   "weights file, a NumPy .npz or a safetensors file, or (a PyTorch checkpoint) a "
                                   "torch.save file or a torch.distributed.checkpoint directory.")
    p.add_argument("--format", choices=["h5", "npz", "safetensors", "torch", "dcp"],
                   help="output format (default: from the --output suffix); dcp: a torch.distributed.checkpoint "
                        "directory at --output")
    p.add_argument("--output", "-o", required=True, metavar="PATH", help="output file (a directory for --format dcp)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .. import export as ex
    fmt_name = args.format or ex.format_from_path(args.output)
    if fmt_name is None:
        raise UsageError(f"cannot tell the format from {args.output!r}: pass --format h5|npz|safetensors|torch|dcp")
    if fmt_name in ("torch", "dcp"):
        try:  # the adapter (imports PyTorch), only for these formats
            from ..torch.export import write_torch
            if fmt_name == "dcp":
                from ..torch.dcp import write_dcp
        except ImportError as e:
            raise UsageError(f"--format {fmt_name} needs PyTorch ({e}): pip install 'deepfreeze[torch]'") from e
    cfg = load_config(args.config, args.overrides)
    name = resolve_name(args, cfg)
    progress = Progress()
    progress.update(f"loading {name}" + (f" v{args.version}" if args.version is not None else ""), force=True)
    try:
        # deepfreeze.load: regular files only, sizes checked before allocating, falls back on damage
        ck = load(cfg, name, args.version, verify=True, trust_owners=args.trust_owners)
        progress.update(f"writing {args.output}", force=True)
        meta = {"name": ck.name, "version": ck.version, "step": ck.step, "epoch": ck.epoch, "format": "deepfreeze"}
        # a Keras weights file holds the model's weights only; npz/safetensors also the optimizer state
        arrays = ck.model_arrays() if fmt_name == "h5" else ck.arrays
        if ck.manifest.get("framework") == "torch":  # the per-rank state records are DeepFreeze's own
            arrays = {k: a for k, a in arrays.items() if not k.startswith("_deepfreeze/")}
        if fmt_name == "torch":
            size = write_torch(ck, args.output, force=args.force, shared_group=cfg.shared_group)
        elif fmt_name == "dcp":
            size = write_dcp(ck, args.output, force=args.force, shared_group=cfg.shared_group)
        else:
            size = ex.export(arrays, fmt_name, args.output, metadata=meta, force=args.force,
                             shared_group=cfg.shared_group)
    finally:
        progress.done()
    print(f"exported {name!r} v{ck.version} (step {ck.step}, {len(arrays)} tensors, read from {ck.level}) "
          f"to {os.path.abspath(args.output)} ({fmt_name}, {size} bytes)")
    return EXIT_OK
