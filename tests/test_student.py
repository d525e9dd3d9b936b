"""Student copies (``tools/student.py``): solutions stripped by cell tag, outputs cleared, checkers fail.

What this covers, over every ``notebooks/NN_*.ipynb`` that exists:

* the command builds one copy per chapter under ``--out``;
* (a) no solution survives: no BEGIN/END marker is left, and every distinctive line between the markers
  (one that does not also appear outside the solution spans) is gone from the whole copy; outputs and
  execution counts are cleared; every other cell is unchanged;
* statically, each chapter has exercises: every ``solution`` cell has markers, still compiles when stripped
  and keeps its stub inside a function (so the cell runs and defines the name), and is followed by a
  ``checker`` cell that calls ``check_exercise``;
* (b) and (c) by execution for chapter 00 only (~20 s): no error before the first checker, and every checker
  raises on the blank solutions;
* ``problems()``, which judges an executed copy, flags what it should (synthetic notebooks, no kernel).

Executing every chapter's copy is the whole book (~4-5 min): ``python tools/student.py --check`` does it.
"""
from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import nbformat
import pytest
from script_loader import load_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
student = load_script(ROOT / "tools" / "student.py", "student_tool")

CHAPTERS = student.chapters()
IDS = [p.stem for p in CHAPTERS]
BEGIN, END = student.BEGIN, student.END


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "student.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def _spans(source: str) -> tuple:
    """(lines inside BEGIN/END spans, lines outside them), stripped, blank lines and comments dropped."""
    inside, outside, on = [], [], False
    for line in source.splitlines():
        s = line.strip()
        if s.startswith(BEGIN):
            on = True
        elif s.startswith(END):
            on = False
        elif s and not s.startswith("#"):
            (inside if on else outside).append(s)
    return inside, outside


def test_every_chapter_gets_a_copy(built):
    assert CHAPTERS, "no chapters found"
    assert sorted(p.name for p in built.glob("*.ipynb")) == [p.name for p in CHAPTERS]


@pytest.mark.parametrize("path", CHAPTERS, ids=IDS)
def test_no_solution_survives(built, path):
    original = nbformat.read(path, as_version=4)
    copy = nbformat.read(built / path.name, as_version=4)
    assert len(copy.cells) == len(original.cells)
    inside, outside = [], []
    for cell in original.cells:
        i, o = _spans(cell.source) if "solution" in student.tags(cell) else ([], cell.source.splitlines())
        inside += i
        outside += [line.strip() for line in o]
    distinctive = set(inside) - set(outside)
    assert distinctive, f"{path.name}: no solution lines found"
    copy_lines = {line.strip() for cell in copy.cells for line in cell.source.splitlines()}
    leaked = sorted(distinctive & copy_lines)
    assert not leaked, f"{path.name}: solution lines left in the student copy: {leaked}"
    for before, after in zip(original.cells, copy.cells):
        assert BEGIN not in after.source and END not in after.source
        if after.cell_type == "code":
            assert after.outputs == [] and after.execution_count is None
        if "solution" not in student.tags(before):
            assert after.source == before.source


def _stub_outside_function(tree: ast.AST) -> bool:
    """True if a ``raise NotImplementedError`` sits at the top level of the cell (not inside a def)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.Raise) or _stub_outside_function(node):
            return True
    return False


@pytest.mark.parametrize("path", CHAPTERS, ids=IDS)
def test_exercises_are_well_formed(built, path):
    copy = nbformat.read(built / path.name, as_version=4)
    code = [c for c in copy.cells if c.cell_type == "code"]
    solutions = [i for i, c in enumerate(code) if "solution" in student.tags(c)]
    assert solutions, f"{path.name}: no exercises (cells tagged 'solution')"
    for i in solutions:
        stripped = code[i].source
        assert student.STUB in stripped, f"{path.name}: a solution cell was not stripped:\n{stripped}"
        tree = ast.parse(stripped)  # a syntax error here means the stub broke the cell
        assert not _stub_outside_function(tree), \
            f"{path.name}: keep the solution inside a function so the cell runs blank:\n{stripped}"
        nxt = code[i + 1] if i + 1 < len(code) else None
        assert nxt is not None and "checker" in student.tags(nxt), \
            f"{path.name}: the code cell after a solution must be tagged 'checker':\n{stripped}"
        assert re.search(r"\bgrade\(\"\w+\"\)", nxt.source), \
            f"{path.name}: a checker cell must call labbook.grader's grade(\"name\")"


@pytest.mark.skipif(not (ROOT / "notebooks" / "00_setup.ipynb").exists(), reason="chapter 00 not written")
def test_chapter_00_copy_runs_and_its_checkers_fail(built):
    executed = student.execute(built / "00_setup.ipynb", timeout=300)
    assert student.problems(executed) == []
    checkers = [c for c in executed.cells if "checker" in student.tags(c)]
    assert checkers and all(student._error(c) for c in checkers)
    printed = "".join(o.get("text", "") for c in checkers for o in c.outputs if o.get("output_type") == "stream")
    assert "not written yet" in printed or "NotImplementedError" in str([c.outputs for c in checkers])


def _executed(*cells):
    """A fake executed notebook: each cell is (tags, ename or None)."""
    nb = nbformat.v4.new_notebook()
    for tags, ename in cells:
        cell = nbformat.v4.new_code_cell("pass", metadata={"tags": tags})
        if ename:
            cell.outputs = [nbformat.v4.new_output("error", ename=ename, evalue="x", traceback=[])]
        nb.cells.append(cell)
    return nb


def test_problems_flags_what_it_should():
    good = _executed(([], None), (["solution"], None), (["checker"], "AssertionError"),
                     (["solution"], "NotImplementedError"), (["checker"], "NotImplementedError"))
    assert student.problems(good) == []
    assert "passed on a blank solution" in student.problems(_executed((["checker"], None)))[0]
    early = _executed(([], "NameError"), (["checker"], "AssertionError"))
    assert "before the first checker" in student.problems(early)[0]
    assert "wrong reason: NameError" in student.problems(_executed((["checker"], "NameError")))[0]
    assert "no checker cell" in student.problems(_executed(([], None)))[0]
