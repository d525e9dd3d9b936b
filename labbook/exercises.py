"""Exercise checkers that a student cannot pass without doing the exercise. (Used by every chapter's exercises;
the design is explained in chapter 00.)

A chapter's exercise has a ``solution`` cell and a ``checker`` cell; the student build (``python tools/student.py``)
replaces the solution span with ``raise NotImplementedError``. A checker built on :func:`check_exercise`:

* **watches what the student's function calls** (:class:`labbook.guard.Guard`, a ``sys.setprofile`` hook): any
  call that goes *from code outside the libraries into* the book's own package, DeepSpeed or fastmoe is a violation,
  whatever the function is called, however it was reached (an alias, a copied code object, ``functools.partial``, a
  class built from it), plus named torch ops that are the answer (``torch.chunk`` for a batch split). Calls the library
  makes internally, and calls the checker makes around the student's code, are not;
* runs **visible cases** (printed, reproducible) and **hidden cases** drawn from a seed the student never sees, so a
  lookup table of the visible answers fails;
* compares with a **reference that is not the function under test** (a brute-force loop, DeepSpeed's own code,
  literal values), computed inside the checker, never read from a notebook global;
* compares **integers exactly** (a capacity of 30 where the answer is 31 is wrong, whatever the tolerance).

``tests/test_exercise_cheats.py`` holds, for every exercise in the book, the honest solution (must pass) and the
shortcuts (the library function, a sibling that computes the same thing, a lookup table of the visible cases, a
notebook global): each must fail.
"""
from __future__ import annotations

import secrets

import torch

from labbook.guard import guarded_call
from labutils.compare import compare_tensors

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = 'raise NotImplementedError("exercise: write your solution here")'
# Reading the checker's frames is never the exercise; sys._getframe itself is called by torch's own code (the
# distributed logger), so the defence is that no answer sits in any frame while the student's function runs.
_ALWAYS_OFF = frozenset({"_current_frames"})


# --- comparing -----------------------------------------------------------------------------------------------

def _as_tuple(value):
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _differs(label: str, got, want, rtol: float, atol: float) -> tuple:
    """(line to print, ok). Integer and bool references are compared exactly, value by value."""
    want_t = torch.as_tensor(want)
    try:
        got_t = torch.as_tensor(got)
    except (TypeError, ValueError, RuntimeError) as exc:
        return f"{label:<28} | not a tensor or number: {type(got).__name__} ({exc})", False
    if got_t.shape != want_t.shape:
        return f"{label:<28} | wrong shape: got {tuple(got_t.shape)}, expected {tuple(want_t.shape)}", False
    if not (want_t.is_floating_point() or want_t.is_complex()):
        if got_t.is_floating_point() and not bool((got_t == got_t.round()).all()):
            return f"{label:<28} | integer answer expected, got non-integral values", False
        ok = bool(torch.equal(got_t.to(torch.int64).cpu(), want_t.to(torch.int64).cpu()))
        wrong = int((got_t.to(torch.int64).cpu() != want_t.to(torch.int64).cpu()).sum())
        return f"{label:<28} | exact: {str(ok):<5} | integers, compared exactly ({wrong} wrong)", ok
    d = compare_tensors(label, got_t, want_t, rtol=rtol, atol=atol)
    return (f"{label:<28} | exact: {str(d.exact):<5} | approximate: {str(d.close):<5} | maxdiff: {d.max_abs:.3e}",
            d.close)


def _is_blank(exc: BaseException) -> bool:
    # a blank exercise raises NotImplementedError, also inside launch() workers (WorkerError)
    return isinstance(exc, NotImplementedError) or "NotImplementedError" in str(exc)


def check_exercise(name: str, fn, reference, *cases, hidden=None, n_hidden: int = 8, seed: int | None = None,
                   rtol: float = 1e-5, atol: float = 1e-6, ops=(), forbidden=(), roots=None) -> None:
    """Check ``fn`` against ``reference`` on the visible ``cases`` and on ``n_hidden`` hidden ones.

    ``hidden(gen, i)`` returns the i-th hidden case, drawn with ``gen`` (a ``torch.Generator`` seeded from
    ``seed``, by default a fresh random seed the student never sees); hidden cases print only a count.
    ``fn`` runs under a :class:`Guard`: calling the book's package, DeepSpeed or fastmoe from the student's code
    fails the case, as does a C op named in ``ops``; ``forbidden`` adds functions/classes forbidden wherever their
    code lives. ``reference`` runs outside the guard and must not be the function under test. ``fn`` may return a
    tensor, a number or a tuple of them; integer references are compared exactly, floats with ``rtol``/``atol``.
    Prints one line per visible case and raises AssertionError naming the failed cases (a blank exercise fails).
    """
    ops = frozenset(ops)
    if hidden is None and n_hidden and not cases:
        raise ValueError(f"check_exercise({name!r}): give visible cases, hidden=, or both")
    if seed is None:
        seed = secrets.randbits(62)
    gen = torch.Generator().manual_seed(int(seed))
    all_cases = [(f"case {i}", c, True) for i, c in enumerate(cases)]
    if hidden is not None:
        all_cases += [(f"hidden {i}", hidden(gen, i), False) for i in range(n_hidden)]
    failures, hidden_n, hidden_problems = [], 0, []
    for label, case, visible in all_cases:
        args = case if isinstance(case, tuple) else (case,)
        lines, ok = _run_case(f"{name} {label}", fn, args, reference, rtol, atol, ops, forbidden, roots)
        if visible:
            print("\n".join(lines))
        else:
            hidden_n += 1
            if not ok:
                hidden_problems.append(lines[-1] if lines else label)
        if not ok:
            failures.append(label)
    if hidden_n:
        print(f"{name}: {hidden_n - len(hidden_problems)} of {hidden_n} hidden cases match"
              + (f"; first problem: {hidden_problems[0].strip()}" if hidden_problems else ""))
    if failures:
        shown = ", ".join(failures[:6]) + (" ..." if len(failures) > 6 else "")
        raise AssertionError(f"{name}: {len(failures)} of {len(all_cases)} cases wrong, missing or off limits "
                             f"({shown}); hidden seed {seed}")
    print(f"✅ {name}: all {len(all_cases)} cases match ({len(cases)} visible, {hidden_n} hidden)")


def _run_case(label, fn, args, reference, rtol, atol, ops, forbidden, roots) -> tuple:
    """(lines to print, ok) for one case: the student's call under the guard, THEN the reference (so no answer
    sits in a caller's frame while the student's code runs: ``sys._getframe(1).f_locals`` finds none, and calling
    the reference found there is a call into the package), then the comparison."""
    try:
        got, violations = guarded_call(fn, *args, ops=ops | _ALWAYS_OFF, objects=forbidden, roots=roots)
    except Exception as exc:  # a blank exercise, or the student's code failing on this case
        if _is_blank(exc):
            return [f"{label}: not written yet (NotImplementedError)"], False
        return [f"{label}: your function raised {type(exc).__name__}: {str(exc)[:200]}"], False
    if violations:
        return [f"{label}: OFF LIMITS: {violations[0]} (write it yourself)"], False
    got_t, want_t = _as_tuple(got), _as_tuple(reference(*args))
    if len(got_t) != len(want_t):
        return [f"{label}: returned {len(got_t)} values, expected {len(want_t)}"], False
    lines, ok = [], True
    for j, (g, w) in enumerate(zip(got_t, want_t)):
        line, good = _differs(label + (f" out {j}" if len(want_t) > 1 else ""), g, w, rtol, atol)
        lines.append(line)
        ok &= good
    return lines, ok


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
