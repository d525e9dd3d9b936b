"""Optional dependencies (DeepSpeed, fastmoe) with clear messages when they are missing."""
from __future__ import annotations

import importlib
import importlib.util

HINTS = {
    "deepspeed": "pip install deepspeed==0.19.8 (it runs on CPU; `make venv` installs it)",
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
