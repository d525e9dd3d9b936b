"""The 0.1.0 module paths, kept working until 1.0.0 (see CHANGELOG.md, "Deprecated").

Each old path is registered in ``sys.modules`` when ``labutils`` is imported, as a small module whose every
name forwards to the new module with a ``DeprecationWarning``; no file is left at the old path, so the tree
shows only the current layout. (``labutils/entry.py`` stays a file: ``python -m labutils.entry`` needs one.)
"""
from __future__ import annotations

import sys
import types

from ._deprecate import moved_module

# old path -> new path(s), relative to the top package (a renamed copy of the package keeps working)
MOVED = {
    "launch": ("launcher",),
    "dist": ("collectives",),
    "parallel": ("data_parallel",),
    "comm": ("moe.traffic",),
    "ds_gating": ("ds.gating",),
    "roofline": ("perf.timing", "perf.sweep"),
    "dispatch": ("perf.dispatch",),
    "transformer": ("models",),
    "envreport": ("nbtools",),
    "moe.parallel": ("moe.expert_parallel",),
    "moe.bench": ("perf.layer_bench",),
}


def register(top: str) -> None:
    """Put every old path of package ``top`` into ``sys.modules`` (idempotent)."""
    for old, new in MOVED.items():
        name = f"{top}.{old}"
        if name in sys.modules:
            continue
        module = types.ModuleType(name, f"Deprecated since 0.2.0: moved to {' and '.join(new)} (goes in 1.0.0).")
        module.__getattr__ = moved_module(name, *new)
        sys.modules[name] = module
