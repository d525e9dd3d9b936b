"""Run a chapter with a fault injected, in a copy of the repository. (Issue 38; see ``labbook.faults``.)"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import tempfile
import time
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[2]
COPIED = ("labutils", "labbook", "benchmarks", "notebooks")
# The editable install's finder would still serve the checkout's labutils to a process whose current directory is
# not the copy: drop it, in the kernel and in every worker it launches (they inherit PYTHONPATH).
SITECUSTOMIZE = ('import sys\nsys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in '
                 'type(f).__module__ and "__editable__" not in getattr(f, "__module__", "")]\n')


ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Outcome:
    """What a run did: the id of the first cell that failed (None: none did), its error's last lines, seconds."""

    failed: str | None
    error: str
    seconds: float


def chapter_path(chapter: str, root: pathlib.Path = ROOT) -> pathlib.Path:
    found = sorted((root / "notebooks").glob(f"{chapter}_*.ipynb"))
    if len(found) != 1:
        raise FileNotFoundError(f"chapter {chapter!r}: expected one notebooks/{chapter}_*.ipynb, found {found}")
    return found[0]


def copy_repo(dest: pathlib.Path) -> pathlib.Path:
    ignore = shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints", "*.pyc")
    for name in COPIED:
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    (dest / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return dest


def apply_text(text: str, edit, what: str) -> str:
    n = text.count(edit.old)
    if n != 1:
        raise LookupError(f"{what}: the edit's text occurs {n} times (it must occur once): {edit.old[:80]!r}")
    return text.replace(edit.old, edit.new)


def select_cells(nb, fault=None, cells: tuple = ()) -> list:
    """The code cells to run: ``cells`` by id (chapter order), or every code cell up to ``fault.check``."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    ids = [c.get("id") for c in code]
    wanted = cells or (fault.cells if fault is not None else ())
    if wanted:
        missing = [w for w in wanted if w not in ids]
        if missing:
            raise LookupError(f"cells {missing} are not code cells of this chapter")
        return [c for c in code if c.get("id") in wanted]
    if fault is None:
        return code
    if fault.check not in ids:
        raise LookupError(f"fault {fault.name!r}: its check cell {fault.check!r} is not a code cell of this chapter")
    return code[: ids.index(fault.check) + 1]


def execute(nb_cells: list, cwd: pathlib.Path, pythonpath: pathlib.Path, timeout: int = 600) -> Outcome:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c.source, id=c.get("id")) for c in nb_cells]
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "MPLBACKEND": "agg", "LAB_PRESET": "tiny"}
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(cwd)}})
    t0 = time.perf_counter()
    with client.setup_kernel(env=env, cwd=str(cwd)):
        for index, cell in enumerate(nb.cells):
            try:
                client.execute_cell(cell, index)
            except CellExecutionError as exc:
                tail = "\n".join(ANSI.sub("", str(exc)).strip().splitlines()[-6:])
                return Outcome(cell.get("id"), tail, time.perf_counter() - t0)
    return Outcome(None, "", time.perf_counter() - t0)


def run(chapter: str, fault=None, cells: tuple = (), timeout: int = 600) -> Outcome:
    """Execute ``chapter`` with ``fault`` injected (None: unedited) in a fresh copy of the repository."""
    import nbformat

    with tempfile.TemporaryDirectory(prefix=f"labfault{chapter}_") as tmp:
        root = copy_repo(pathlib.Path(tmp))
        name = fault.name if fault is not None else ""
        for edit in fault.library if fault is not None else ():
            path = root / edit.where
            path.write_text(apply_text(path.read_text(), edit, f"fault {name!r}, {edit.where}"))
        nb = nbformat.read(chapter_path(chapter, root), as_version=4)
        by_id = {c.get("id"): c for c in nb.cells}
        for edit in fault.edits if fault is not None else ():
            if edit.where not in by_id:
                raise LookupError(f"fault {name!r}: no cell with id {edit.where!r} in chapter {chapter}")
            cell = by_id[edit.where]
            cell.source = apply_text(cell.source, edit, f"fault {name!r}, cell {edit.where}")
        chosen = select_cells(nb, fault, cells)
        if fault is not None:
            ran = {c.get("id") for c in chosen}
            skipped = [e.where for e in fault.edits if e.where not in ran]
            if skipped:
                raise LookupError(f"fault {fault.name!r}: it edits cells {skipped} that its run does not execute")
        return execute(chosen, root / "notebooks", root, timeout)


def verdict(fault, outcome: Outcome) -> str | None:
    """None when ``fault`` was caught as it names; else why not."""
    if outcome.failed is None:
        return f"NOT CAUGHT: every cell passed with {fault.name!r} injected"
    if outcome.failed != fault.check:
        return (f"caught by cell {outcome.failed}, not by its check cell {fault.check}:\n{outcome.error}")
    if fault.expect not in outcome.error:
        return f"cell {fault.check} failed, but its error does not say {fault.expect!r}:\n{outcome.error}"
    return None
