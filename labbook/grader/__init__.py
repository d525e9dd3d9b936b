"""The book's exercise grader: every exercise graded out of the student's process. (Used by every chapter's
exercises; chapter 00 explains it, the README's coursework section tells an instructor how to grade a folder.)

A solution is **source**: the text of the cell that defines the exercise's function, read from the notebook file
(instructors) or from the kernel's history (students' feedback), never a live object. The grader

1. checks it against the exercise's **static policy** (:mod:`~labbook.grader.policy`: imports allowed, no dynamic
   code or reflection, no private attributes, no doors out of torch, no patching, no answer functions);
2. refuses it when its code **is** a library or chapter function's code, under any name (:mod:`~.identity`);
3. forks a **sandboxed child** that loads it under an irrevocable audit hook (:mod:`~.sandbox`): no imports outside
   the list, no new code objects, threads, processes, sockets, ctypes or files;
4. only then draws the **hidden cases** in the parent, computes each **reference** there, sends the child plain
   tensors and compares its answers, which must be plain tensors or numbers of the right kind and shape, with
   integers exact and floats within the exercise's stated tolerance (:mod:`~.grading`, :mod:`~.answers`).

Distributed exercises run on ranks the grader starts, each rank's inputs drawn after the ranks exist. The same
grader gives a student feedback (:func:`grade`, called as ``grade("name")`` in a checker cell, not to shadow
the chapters' ``check``) and an instructor grades (``python -m labbook.grader grade``).
"""
from __future__ import annotations

import sys

from labbook.grader import catalog as _catalog


def grade(exercise: str, source: str | None = None, *, seed: int | None = None,
          n_hidden: int | None = None) -> None:
    """Grade your solution to ``exercise`` (the name of the function your solution cell defines) and print what the
    instructor's grader will say: one line per visible case, a count of the hidden cases, the verdict. Raises
    AssertionError when it fails; returns nothing (the report is printed). ``source``: the solution's text
    (default: the cell that defined the function, in this notebook). The grading runs in a separate, sandboxed
    process that never sees your kernel: this is the same verdict the instructor's ``python -m labbook.grader
    grade`` gives on your saved notebook."""
    from labbook.grader import service
    from labbook.grader import source as sources

    e = _catalog.entry(exercise)
    if source is None:
        source = sources.from_kernel(e.function)
    elif not isinstance(source, str):
        raise TypeError(f"source: the text of your solution (a str), got {type(source).__name__}")
    report = service.grade(e.function, source, seed, n_hidden)
    print(report.text())
    if not report.passed:
        raise AssertionError(f"{e.function}: {report.reason}")


__all__ = ["grade"]


def __getattr__(name: str):
    """``ENTRIES`` and ``entry`` moved to ``labbook.grader.catalog``: the deprecation table forwards them. It is
    imported on first use only, because the grading child imports this package and must not have ``labutils``
    in ``sys.modules`` (a cached module would be imported without the audit hook seeing an import)."""
    if name in ("ENTRIES", "entry"):
        from labutils._deprecate import forward_moved

        forward_moved(__name__)
        return getattr(sys.modules[__name__], name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
