"""nbgrader (0.9.x) integration: a preprocessor for nbgrader's ``autograde`` that grades each exercise with this
grader, in nbgrader's own process, after the student's kernel has run. (Part of the grader; the README's grading
section shows the configuration.)

nbgrader's ``Execute`` runs the submission in the student's kernel, where student code could change what a checker
cell prints. :class:`LabGrader` comes after it: for every autograded cell that calls ``grade("name")``, it grades the
notebook's solution cell (its text, the last cell that defines the function) with :mod:`labbook.grader`, and replaces
that cell's outputs with the grader's report, plus an error output when it fails, which nbgrader's ``SaveAutoGrades``
scores as no credit. In ``nbgrader_config.py``::

    from nbconvert.preprocessors import ClearMetadataPreprocessor
    from nbgrader.preprocessors import (AssignLatePenalties, CheckCellMetadata, Execute, IgnorePattern,
                                        LimitOutput, SaveAutoGrades)
    from labbook.grader.nbgrader import LabGrader

    c.Autograde.autograde_preprocessors = [Execute, LabGrader, IgnorePattern, ClearMetadataPreprocessor,
                                           LimitOutput, SaveAutoGrades, AssignLatePenalties, CheckCellMetadata]
"""
from __future__ import annotations

import re

from nbconvert.preprocessors import Preprocessor
from nbformat import NotebookNode

from labbook.grader import catalog, source

CHECK = re.compile(r"""\bgrade\(\s*["'](\w+)["']\s*\)""")


def _is_autograded(cell) -> bool:
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return bool(meta.get("grade")) and not meta.get("solution")


def solution_text(cells, function: str) -> str | None:
    """The last code cell's text that defines ``function`` (None when none does)."""
    found = None
    for cell in cells:
        if cell.get("cell_type") == "code" and source.defines(cell.get("source", ""), function):
            found = cell["source"]
    return found


class LabGrader(Preprocessor):
    """Replace each autograded ``grade("name")`` cell's outputs with this grader's verdict on the notebook's
    solution text; a failure becomes an ``error`` output (no credit in nbgrader)."""

    def preprocess(self, nb, resources):
        from labbook.grader import service

        for cell in nb.cells:
            if cell.get("cell_type") != "code" or not _is_autograded(cell):
                continue
            m = CHECK.search(cell.get("source", ""))
            if m is None or m.group(1) not in catalog.ENTRIES:
                continue
            name = m.group(1)
            text = solution_text(nb.cells, name)
            if text is None:
                passed, report, reason = False, f"no cell defines `def {name}(`", f"no cell defines `def {name}(`"
            else:
                rep = service.grade(name, text)
                passed, report, reason = rep.passed, rep.text(), rep.reason
            cell.outputs = [NotebookNode(output_type="stream", name="stdout", text=report + "\n")]
            if not passed:
                cell.outputs.append(NotebookNode(output_type="error", ename="AssertionError",
                                                 evalue=f"{name}: {reason}", traceback=[f"{name}: {reason}"]))
        return nb, resources
