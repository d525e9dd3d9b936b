"""Named presets: `tiny` for CI and the committed outputs, `full` for the book-scale run.

Select with the environment variable ``LAB_PRESET`` (``tiny`` by default; ``full`` or its alias ``book``).
Never edit constants to scale a chapter up: pass both sizes to :func:`select_preset`. (Taught in chapter 00.)
"""
from __future__ import annotations

import os
from types import SimpleNamespace

ALIASES = {"": "tiny", "tiny": "tiny", "default": "tiny", "ci": "tiny", "full": "full", "book": "full"}


def preset_name() -> str:
    """The active preset name, ``"tiny"`` or ``"full"``, from ``LAB_PRESET``."""
    raw = os.environ.get("LAB_PRESET", "").strip().lower()
    if raw not in ALIASES:
        raise ValueError(f"LAB_PRESET={raw!r} is not a preset; use one of: tiny, full (alias book)")
    return ALIASES[raw]


class Preset(SimpleNamespace):
    """A preset's knobs with attribute access; ``name`` says which one was chosen."""

    def as_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "name"}


def select_preset(*, tiny: dict, full: dict, verbose: bool = True) -> Preset:
    """Return the knobs of the active preset. Both dicts must have the same keys."""
    if set(tiny) != set(full):
        raise ValueError(f"presets disagree on knobs: only in tiny {set(tiny) - set(full)}, "
                         f"only in full {set(full) - set(tiny)}")
    name = preset_name()
    cfg = Preset(name=name, **(tiny if name == "tiny" else full))
    if verbose:
        knobs = ", ".join(f"{k}={v}" for k, v in cfg.as_dict().items())
        hint = " (LAB_PRESET=full for the book-scale run)" if name == "tiny" else ""
        print(f"preset: {name}{hint}: {knobs}")
    return cfg
