"""The grader's second line: identity by content. A solution whose code is the same code as a function of the
library (``labutils``, ``labbook``, DeepSpeed's ``deepspeed.moe``, fastmoe where installed) or of a chapter's own
cells, under any name and from any path, is refused. (Used by every chapter's exercises.)

Code is compared by its normalised bytecode: the instructions, with local variables by position (renaming them
changes nothing), constants by value, attribute names kept, global names other than modules and builtins blanked
(renaming a helper changes nothing), line numbers and docstrings ignored. Only code objects of at least
``MIN_INSTRUCTIONS`` instructions count: a function of three lines of arithmetic is written the same way honestly
(chapter 02's capacity, written from the formula in the exercise's argument order, is DeepSpeed's own formula
instruction for instruction), so pasting one is not told apart from writing it.
"""
from __future__ import annotations

import builtins
import dis
import functools
import hashlib
import importlib.util
import json
import pathlib
import types

MIN_INSTRUCTIONS = 36
_SKIP = frozenset({"RESUME", "NOP", "CACHE", "EXTENDED_ARG", "PRECALL", "COPY_FREE_VARS", "MAKE_CELL"})
_KEEP_GLOBALS = frozenset(dir(builtins)) | {"torch", "math", "nn", "F", "dist", "time"}
_FAST = frozenset({"LOAD_FAST", "STORE_FAST", "DELETE_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR",
                   "LOAD_DEREF", "STORE_DEREF", "DELETE_DEREF", "LOAD_CLOSURE", "LOAD_CLASSDEREF"})
_GLOBAL = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "STORE_NAME", "DELETE_GLOBAL", "DELETE_NAME"})

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _normalised(code: types.CodeType) -> list:
    ops = []
    for ins in dis.get_instructions(code):
        if ins.opname in _SKIP:
            continue
        if ins.opname == "LOAD_CONST":
            arg = fingerprint(ins.argval) if isinstance(ins.argval, types.CodeType) else repr(ins.argval)
        elif ins.opname in _FAST:
            arg = ins.arg
        elif ins.opname in _GLOBAL:
            arg = ins.argval if ins.argval in _KEEP_GLOBALS else "<global>"
        elif ins.opcode in dis.hasjrel or ins.opcode in dis.hasjabs:
            arg = None                                   # targets move with any edit elsewhere; the ops remain
        else:
            arg = ins.argval if isinstance(ins.argval, (str, int, float, type(None))) else repr(ins.argval)
        ops.append(("LOAD_ATTR" if ins.opname == "LOAD_METHOD" else ins.opname, arg))   # compiler's choice
    return ops


def fingerprint(code: types.CodeType) -> str:
    """A hash of ``code``'s normalised instructions (nested code objects by their own fingerprints)."""
    return hashlib.sha256(json.dumps(_normalised(code), default=repr).encode()).hexdigest()[:24]


def code_objects(code: types.CodeType):
    """``code`` and every code object nested in it (functions, lambdas, comprehensions, class bodies)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from code_objects(const)


def _size(code: types.CodeType) -> int:
    return sum(1 for ins in dis.get_instructions(code) if ins.opname not in _SKIP)


def prints(source: str, where: str) -> dict:
    """``{fingerprint: "where:name"}`` for every function of at least ``MIN_INSTRUCTIONS`` in ``source``."""
    try:
        top = compile(source, where, "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return {}
    return {fingerprint(c): f"{where}: {c.co_name}" for c in code_objects(top)
            if c is not top and c.co_name not in ("<module>",) and _size(c) >= MIN_INSTRUCTIONS}


def _package_dir(name: str) -> pathlib.Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def library_files() -> list:
    """``(label, path)`` of every Python file the bank holds: labutils, labbook, DeepSpeed's MoE, fastmoe."""
    files = []
    for pkg, sub in (("labutils", ""), ("labbook", ""), ("deepspeed", "moe"), ("fmoe", "")):
        base = _package_dir(pkg)
        if base is None:
            continue
        for path in sorted((base / sub).rglob("*.py")):
            files.append((f"{pkg}/{path.relative_to(base).as_posix()}", path))
    return files


def notebook_sources() -> list:
    """``(label, source)`` of the chapters' code cells that are not solutions (a chapter's own helpers)."""
    out = []
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        for i, cell in enumerate(cells):
            tags = cell.get("metadata", {}).get("tags", [])
            if cell["cell_type"] == "code" and "solution" not in tags:
                src = "".join(cell["source"])
                if not any(line.lstrip().startswith(("%", "!")) for line in src.splitlines()):
                    out.append((f"notebooks/{path.name} cell {i}", src))
    return out


@functools.lru_cache(maxsize=1)
def bank() -> dict:
    """Every library and chapter function's fingerprint, with where it lives."""
    found = {}
    for label, path in library_files():
        found.update(prints(path.read_text(errors="replace"), label))
    for label, src in notebook_sources():
        found.update(prints(src, label))
    return found


def matches(code: types.CodeType) -> list:
    """``[(solution function name, where the same code lives)]`` for every code object of the solution found in
    the bank."""
    known = bank()
    return [(c.co_name, known[fp]) for c in code_objects(code)
            if c.co_name != "<module>" and _size(c) >= MIN_INSTRUCTIONS and (fp := fingerprint(c)) in known]
