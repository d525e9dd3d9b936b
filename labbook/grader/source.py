"""Where a solution's source comes from: the cell that defines the exercise's function, read from the notebook
file an instructor grades, or from the student's own kernel (feedback: IPython's copy of the cell's text). The
grader only ever takes this text, never an object from the student's kernel. (Part of the grader.)"""
from __future__ import annotations

import json
import pathlib
import re


def defines(cell: str, function: str) -> bool:
    """Whether ``cell`` defines ``function`` at its top level (``def function(``)."""
    return re.search(rf"^(?:async\s+)?def\s+{re.escape(function)}\s*\(", cell, re.M) is not None


def from_notebook(path, function: str) -> str | None:
    """The last code cell of the notebook at ``path`` that defines ``function`` (None when none does)."""
    nb = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    found = None
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            text = cell.get("source", "")
            text = "".join(text) if isinstance(text, list) else str(text)
            if defines(text, function):
                found = text
    return found


def from_kernel(function: str) -> str:
    """The text of the cell that defined the function now bound to ``function`` in this IPython kernel (IPython
    keeps every cell's text for its tracebacks, under the file name its code carries), else the last cell in the
    kernel's history that defines it (the cell running now excepted). Only the text is used: it is graded, not the
    object."""
    import linecache

    try:
        from IPython import get_ipython
    except ImportError:
        get_ipython = None
    ip = get_ipython() if get_ipython is not None else None
    if ip is None:
        raise ValueError(f"grade({function!r}) outside a notebook: pass source= (the text of your solution, e.g. "
                         "open('my_solution.py').read())")
    code = getattr(ip.user_ns.get(function), "__code__", None)
    if code is not None:
        cell = "".join(linecache.getlines(code.co_filename))
        if defines(cell, function):
            return cell
    history = list(ip.history_manager.input_hist_raw)[:-1]    # the last entry is the cell running now
    for cell in reversed(history):
        if defines(cell, function):
            return cell
    raise LookupError(f"no cell defining `def {function}(...)` has run in this kernel: run your solution cell, then "
                      "this one")
