"""Exercise checkers. A chapter's exercise has a `solution` cell and a `checker` cell; the student build
(`python tools/student.py`) replaces the solution span with ``raise NotImplementedError``.
(Used by every chapter's exercises.)
"""
from __future__ import annotations

import torch

from .compare import compare_tensors

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = 'raise NotImplementedError("exercise: write your solution here")'


def check_exercise(name: str, fn, reference, *cases, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Run ``fn`` and ``reference`` on every case and print exact / approximate / max-diff per case.

    ``fn`` may return a tensor or a tuple of tensors. Raises AssertionError when any case differs or the
    exercise is not written yet (``NotImplementedError``), so a blank exercise fails loudly.
    """
    if not cases:
        cases = ((),)
    failures = []
    for i, case in enumerate(cases):
        args = case if isinstance(case, tuple) else (case,)
        try:
            got = fn(*args)
        except Exception as exc:
            # a blank exercise raises NotImplementedError, also inside launch() workers (WorkerError)
            if not isinstance(exc, NotImplementedError) and "NotImplementedError" not in str(exc):
                raise
            print(f"{name} case {i}: not written yet (NotImplementedError)")
            failures.append(i)
            continue
        want = reference(*args)
        got_t = got if isinstance(got, (tuple, list)) else (got,)
        want_t = want if isinstance(want, (tuple, list)) else (want,)
        if len(got_t) != len(want_t):
            print(f"{name} case {i}: returned {len(got_t)} values, expected {len(want_t)}")
            failures.append(i)
            continue
        for j, (g, w) in enumerate(zip(got_t, want_t)):
            label = f"{name} case {i}" + (f" out {j}" if len(want_t) > 1 else "")
            try:
                d = compare_tensors(label, torch.as_tensor(g), torch.as_tensor(w), rtol=rtol, atol=atol)
            except (ValueError, TypeError, RuntimeError) as exc:
                print(f"{label:<28} | wrong result: {exc}")
                failures.append(i)
                continue
            print(f"{label:<28} | exact: {str(d.exact):<5} | approximate: {str(d.close):<5} | maxdiff: {d.max_abs:.3e}")
            if not d.close:
                failures.append(i)
    if failures:
        raise AssertionError(f"{name}: {len(set(failures))} of {len(cases)} cases wrong or missing")
    print(f"✅ {name}: all {len(cases)} cases match")


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
