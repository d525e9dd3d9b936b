"""Exercise checkers. A chapter's exercise has a `solution` cell and a `checker` cell; the student build
(`python tools/student.py`) replaces the solution span with ``raise NotImplementedError``.
(Used by every chapter's exercises.)
"""
from __future__ import annotations

import contextlib
import types

import torch

from .compare import compare_tensors

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = 'raise NotImplementedError("exercise: write your solution here")'


class OffLimits(RuntimeError):
    """Raised when an exercise calls a library function it is meant to write itself."""


def _off_limits(name: str):
    def stub(*args, **kwargs):
        raise OffLimits(f"exercise: write it yourself; {name} is off limits while this checker runs")
    return stub


@contextlib.contextmanager
def forbid(*targets):
    """Make library functions and modules raise :class:`OffLimits` inside the block, wherever they are referenced.

    A function's code object is swapped (so ``from labutils.moe import count_by_gate`` in a notebook is caught
    too); for a class (an ``nn.Module`` or an autograd ``Function``) its ``forward`` is. Restored on exit.
    """
    saved = []
    try:
        for t in targets:
            name = f"{getattr(t, '__module__', '?')}.{getattr(t, '__qualname__', t)}"
            if isinstance(t, types.FunctionType) and not t.__closure__:
                saved.append((t, "__code__", t.__code__))
                t.__code__ = _raise_code(name)
            elif isinstance(t, type) and hasattr(t, "forward"):
                saved.append((t, "forward", t.__dict__.get("forward")))
                t.forward = staticmethod(_off_limits(name)) if _is_static(t) else _off_limits(name)
            else:
                raise TypeError(f"forbid() takes plain functions and classes with a forward, got {t!r}")
        yield
    finally:
        for obj, attr, value in reversed(saved):
            if value is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, value)


def _is_static(cls) -> bool:
    return isinstance(cls.__dict__.get("forward"), staticmethod) or issubclass(cls, torch.autograd.Function)


def _raise_code(name: str):
    """A code object that raises OffLimits naming ``name`` (usable as any closure-free function's ``__code__``)."""
    message = f"exercise: write it yourself; {name} is off limits while this checker runs"
    # the code runs with the forbidden function's own globals: import OffLimits by this module's name
    namespace: dict = {}
    exec(f"def stub(*args, **kwargs):\n    raise __import__({__name__!r}, fromlist=['_']).OffLimits({message!r})",
         namespace)
    return namespace["stub"].__code__


def check_exercise(name: str, fn, reference, *cases, rtol: float = 1e-5, atol: float = 1e-6,
                   forbidden=()) -> None:
    """Run ``fn`` and ``reference`` on every case and print exact / approximate / max-diff per case.

    ``fn`` may return a tensor or a tuple of tensors. Raises AssertionError when any case differs or the
    exercise is not written yet (``NotImplementedError``), so a blank exercise fails loudly. ``forbidden``:
    library functions/classes the student's ``fn`` may not call (see :func:`forbid`); the reference runs first,
    outside that block, so it may be the library itself.
    """
    if not cases:
        cases = ((),)
    failures = []
    for i, case in enumerate(cases):
        args = case if isinstance(case, tuple) else (case,)
        want = reference(*args)
        try:
            with forbid(*forbidden):
                got = fn(*args)
        except OffLimits as exc:
            print(f"{name} case {i}: {exc}")
            failures.append(i)
            continue
        except Exception as exc:
            # a blank exercise raises NotImplementedError, also inside launch() workers (WorkerError)
            if not isinstance(exc, NotImplementedError) and "NotImplementedError" not in str(exc):
                raise
            print(f"{name} case {i}: not written yet (NotImplementedError)")
            failures.append(i)
            continue
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
