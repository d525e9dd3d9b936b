"""The exercises' cell conventions, and a quick in-kernel self-check that does NOT grade. (Used by
``tools/student.py`` and every chapter's exercises; grading is :mod:`labbook.grader`.)

A chapter's exercise has a ``solution`` cell (the answer between ``### BEGIN SOLUTION`` and ``### END SOLUTION``)
and a ``checker`` cell that calls ``labbook.grader.grade("name")``: the grader takes the solution cell's text and
grades it in a separate, sandboxed process (see :mod:`labbook.grader`). The student build replaces each solution span
with a stub that raises (:func:`strip_solution`).

:func:`check_exercise` (``labutils.check_exercise`` in 0.2.0, kept until 1.0.0) runs a function against a reference
on some cases inside your own kernel: handy for your own exercises, but anything in the kernel can change its
verdict, so it says on every run that it is feedback, not a grade.
"""
from __future__ import annotations

import secrets

import torch

from labbook.grader.answers import compare

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = 'raise NotImplementedError("exercise: write your solution here")'
NOT_GRADING = "(feedback in this kernel, not a grade: the book's exercises are graded by labbook.grader.grade)"


def check_exercise(name: str, fn, reference, *cases, hidden=None, n_hidden: int = 8, seed: int | None = None,
                   rtol: float = 1e-5, atol: float = 1e-6, **_ignored) -> None:
    """Run ``fn`` against ``reference`` on the visible ``cases`` and on ``n_hidden`` cases ``hidden(gen, i)`` (a
    ``torch.Generator`` seeded from ``seed``), in this process; print a line per visible case and raise
    AssertionError naming the failed cases. Integer references are compared exactly, floats with
    ``rtol``/``atol``. Feedback only: it runs in the caller's kernel (older keyword arguments such as ``ops=`` and
    ``forbidden=``, which fed the removed in-kernel guard, are accepted and ignored)."""
    if hidden is None and n_hidden and not cases:
        raise ValueError(f"check_exercise({name!r}): give visible cases, hidden=, or both")
    seed = secrets.randbits(62) if seed is None else int(seed)
    gen = torch.Generator().manual_seed(seed)
    drawn = [(f"case {i}", c, True) for i, c in enumerate(cases)]
    if hidden is not None:
        drawn += [(f"hidden {i}", hidden(gen, i), False) for i in range(n_hidden)]
    failures, hidden_bad = [], 0
    for label, case, visible in drawn:
        args = case if isinstance(case, tuple) else (case,)
        try:
            lines, ok = compare(f"{name} {label}", fn(*args), reference(*args), rtol, atol)
        except NotImplementedError:
            lines, ok = [f"{name} {label}: not written yet (NotImplementedError)"], False
        except Exception as exc:  # noqa: BLE001 - the function under test may raise anything
            lines, ok = [f"{name} {label}: your function raised {type(exc).__name__}: {str(exc)[:200]}"], False
        if visible:
            print("\n".join(lines))
        hidden_bad += (not ok) and not visible
        if not ok:
            failures.append(label)
    n_hid = len(drawn) - len(cases)
    if n_hid:
        print(f"{name}: {n_hid - hidden_bad} of {n_hid} hidden cases match")
    if failures:
        raise AssertionError(f"{name}: {len(failures)} of {len(drawn)} cases wrong ({', '.join(failures[:6])}); "
                             f"hidden seed {seed} {NOT_GRADING}")
    print(f"✅ {name}: all {len(drawn)} cases match {NOT_GRADING}")


def strip_solution(source: str) -> str:
    """Replace every BEGIN/END SOLUTION span with a stub that raises, keeping indentation."""
    out, skipping = [], False
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            indent = line[: len(line) - len(line.lstrip())]
            out.append(indent + STUB)
            skipping = True
        elif stripped.startswith(END):
            skipping = False
        elif not skipping:
            out.append(line)
    if skipping:
        raise ValueError("a BEGIN SOLUTION marker has no END SOLUTION")
    return "\n".join(out)
