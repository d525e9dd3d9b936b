"""Optional dependencies (DeepSpeed, fastmoe; matplotlib for plots, cloudpickle for ``launch``) with clear
messages when they are missing. The hints are plain pip commands with the versions the book pins: they work
in a copy of the package outside this repository. (Taught in chapter 00.)"""
from __future__ import annotations

import importlib
import importlib.util

HINTS = {
    "deepspeed": "pip install deepspeed==0.19.8 (it runs on CPU, no GPU needed)",
    "matplotlib": "pip install matplotlib==3.11.2 (matplotlib==3.10.8 on Python < 3.11)",
    "cloudpickle": "pip install cloudpickle==3.1.2",
    "fmoe": "fastmoe needs CUDA: build it from https://github.com/laekov/fastmoe on a GPU machine (see README)",
}


def available(name: str) -> bool:
    """True when ``name`` can be imported (without importing it; fmoe is probed by a real import)."""
    if importlib.util.find_spec(name) is None:
        return False
    if name == "fmoe":  # fastmoe imports its CUDA extension at import time: only a real import tells
        try:
            importlib.import_module(name)
        except Exception:
            return False
    return True


def require(name: str, feature: str = ""):
    """Import and return the optional module ``name`` or raise ImportError saying how to get it."""
    try:
        return importlib.import_module(name)
    except Exception as exc:  # fmoe raises OSError/ImportError when its CUDA extension is missing
        what = f" for {feature}" if feature else ""
        raise ImportError(f"{name} is needed{what} but cannot be imported ({exc}). {HINTS.get(name, '')}") from exc


def missing_hint(exc: ImportError, feature: str) -> ImportError | None:
    """An ImportError saying how to install the optional package whose absence caused ``exc``, or None when
    ``exc`` is about something else (then re-raise ``exc``)."""
    name = (getattr(exc, "name", None) or "").split(".")[0]
    if name not in HINTS:
        return None
    return ImportError(f"{feature} needs {name}, which cannot be imported ({exc}): {HINTS[name]}")
