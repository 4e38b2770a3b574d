"""Model names in a repository: ``<model>[@<tag>]``, each part ``[A-Za-z0-9_.-]{1,200}``.

A name is never a path: ``.`` and ``..`` alone are refused as parts, so a name cannot
climb out of a directory even where one is used to build a file name.
"""
from __future__ import annotations

import re

from ..errors import RepositoryError

__all__ = ["PART_RE", "parse_name", "check_name"]

#: one part of a name (the model, or the tag)
PART_RE = re.compile(r"[A-Za-z0-9_.\-]{1,200}")


def parse_name(name: object) -> tuple[str, str | None]:
    """``(model, tag)`` of a valid name (``tag`` None without ``@``); :class:`RepositoryError` otherwise."""
    if not isinstance(name, str):
        raise RepositoryError(f"model name {name!r}: expected a string '<model>[@<tag>]'")
    model, sep, tag = name.partition("@")
    parts = [model] + ([tag] if sep else [])
    for part in parts:
        if not PART_RE.fullmatch(part) or part in (".", ".."):
            raise RepositoryError(
                f"model name {name!r}: each part of '<model>[@<tag>]' must match [A-Za-z0-9_.-]{{1,200}} "
                f"and not be '.' or '..' (e.g. 'resnet50@step1200')")
    return model, (tag if sep else None)


def check_name(name: object) -> str:
    """``name`` itself when valid (see :func:`parse_name`)."""
    parse_name(name)
    return name  # type: ignore[return-value]
