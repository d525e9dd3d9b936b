"""Load a script that is not a package module (``benchmarks/*.py``, ``tools/*.py``) as a module, for its tests."""
from __future__ import annotations

import importlib.util
import pathlib
import types


def load_script(path: pathlib.Path, name: str) -> types.ModuleType:
    """Execute ``path`` as a fresh module called ``name`` and return it."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
