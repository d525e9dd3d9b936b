"""Chapter 00's sentences, written from its results dict ``R`` (see :mod:`labbook.reports`).

Keys the chapter fills: ``stacks`` (rank -> the Python stack ``launch`` reported for a stuck rank at its deadline,
``WorkerError.stacks``).
"""
from __future__ import annotations

import os
import re

__all__ = ["where_stuck"]

FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<fn>\w+)')


def _place(m: re.Match) -> str:
    """A frame as ``name (file)``: file names only, a notebook cell (a temporary ipykernel file) as ``this cell``."""
    return f"`{m['fn']}` ({'this cell' if 'ipykernel' in m['file'] else os.path.basename(m['file'])})"


def where_stuck(R: dict, functions=("straggler", "all_reduce")) -> str:
    """Where each stuck rank waits, read from its stack: its frames in ``functions`` (the worker's own, the
    collective), in the stack's order, at most two, joined by ``<-``; a rank in none of them says so."""
    lines = []
    for rank, stack in sorted(R["stacks"].items()):
        here = [_place(m) for m in FRAME.finditer(stack) if m["fn"] in functions][:2]
        lines.append(f"- rank {rank} is in: " + (" <- ".join(here) if here else f"none of {', '.join(functions)}"))
    return "\n".join(lines)
