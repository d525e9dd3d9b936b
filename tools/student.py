"""Student copies of the chapters: solutions stripped, outputs cleared.

    python tools/student.py              # build/student/NN_slug.ipynb for every chapter
    python tools/student.py --check      # ... then execute every copy (the whole book: minutes)
    python tools/student.py notebooks/00_setup.ipynb --out /tmp/student --check

In each cell tagged ``solution`` the lines between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` become
``raise NotImplementedError(...)`` (``labbook.exercises.strip_solution``); every output and execution count
is cleared. ``--check`` executes each copy and requires: no error before the first ``checker`` cell (a
solution cell may only raise NotImplementedError), every ``checker`` cell raises AssertionError or
NotImplementedError on the blank solution (or an error that names it, as ``launch``'s WorkerError does when
a worker hit the stub), and every other cell runs. One line per chapter; exit status 1 if
any chapter fails. (The exercises' conventions are in DEVELOPING.md; the test is tests/test_student.py.)
"""
from __future__ import annotations

import argparse
import copy
import os
import pathlib
import sys
import time

import nbformat

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this script runs from a checkout; labutils is the one next to it

from labbook.exercises import BEGIN, END, STUB, strip_solution  # noqa: E402

__all__ = ["BEGIN", "END", "STUB", "chapters", "tags", "student_copy", "build", "problems", "execute"]
CHECKER_ERRORS = ("AssertionError", "NotImplementedError")  # what a checker may raise on a blank exercise


def chapters() -> list:
    return sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def tags(cell) -> list:
    return cell.get("metadata", {}).get("tags", [])


def student_copy(nb):
    """A copy of ``nb`` with every solution span stripped and every output cleared."""
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if "solution" in tags(cell):
            if BEGIN not in cell.source:
                raise ValueError(f"a solution cell has no {BEGIN!r} marker:\n{cell.source}")
            cell.source = strip_solution(cell.source)
        cell.outputs, cell.execution_count = [], None
        cell.metadata.pop("execution", None)
    return nb


def build(paths, out: pathlib.Path) -> list:
    """Write the student copy of every notebook in ``paths`` under ``out``; returns the written paths."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in paths:
        dest = out / path.name
        nbformat.write(student_copy(nbformat.read(path, as_version=4)), dest)
        written.append(dest)
    return written


def _error(cell):
    """``(ename, evalue)`` of the error a cell raised when executed, or None."""
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return out.get("ename", "?"), out.get("evalue", "")
    return None


def problems(executed) -> list:
    """What is wrong with an executed student copy (empty: it behaves as a student copy should)."""
    found, seen_checker = [], False
    checkers = [i for i, c in enumerate(executed.cells) if "checker" in tags(c)]
    if not checkers:
        found.append("no checker cell: every chapter ends with exercises")
    for i, cell in enumerate(executed.cells):
        if cell.cell_type != "code":
            continue
        err, kind = _error(cell), tags(cell)
        if "checker" in kind:
            seen_checker = True
            if err is None:
                found.append(f"cell {i} (checker) passed on a blank solution")
            elif err[0] not in CHECKER_ERRORS and "NotImplementedError" not in err[1]:  # e.g. WorkerError
                found.append(f"cell {i} (checker) failed for the wrong reason: {err[0]}: {err[1][:200]}")
        elif err is None:
            continue
        elif "solution" in kind and err[0] == "NotImplementedError":
            continue  # a solution span at the top level of its cell: the stub raises right away
        else:
            where = "before the first checker" if not seen_checker else "after the exercises began"
            found.append(f"cell {i} raised {where}: {err[0]}: {err[1][:200]}")
    return found


def execute(path: pathlib.Path, timeout: int = 900):
    """Execute a student copy with errors allowed (checkers are meant to fail); returns the executed notebook."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    return nb


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="*", type=pathlib.Path, help="default: every notebooks/NN_*.ipynb")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "build" / "student")
    ap.add_argument("--check", action="store_true", help="execute every student copy and check its exercises")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per cell with --check")
    args = ap.parse_args()
    paths = args.notebooks or chapters()
    if not paths:
        ap.error("no notebooks found")
    written = build(paths, args.out)
    print(f"{len(written)} student copies under {args.out}")
    if not args.check:
        return 0
    os.environ.pop("MPLBACKEND", None)
    failed = 0
    for path in written:
        t0 = time.perf_counter()
        try:
            found = problems(execute(path, args.timeout))
        except Exception as exc:  # kernel died, timeout
            found = [f"{type(exc).__name__}: {exc}"]
        status = "PASS" if not found else "FAIL"
        print(f"{path.stem:<28} {time.perf_counter() - t0:7.1f} s  {status}", flush=True)
        for line in found:
            print(f"    {line}")
        failed += bool(found)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
