"""Exercise checkers that a student cannot pass without doing the exercise. (Used by every chapter's exercises;
the design is explained in chapter 00.)

A chapter's exercise has a ``solution`` cell and a ``checker`` cell; the student build (``python tools/student.py``)
replaces the solution span with ``raise NotImplementedError``. A checker built on :func:`check_exercise`:

* **watches what the student's function calls** (:class:`Guard`, a ``sys.setprofile`` hook): any call that goes
  *from code outside the libraries into* the book's own package, DeepSpeed or fastmoe is a violation, whatever the
  function is called, however it was reached (an alias, a copied code object, ``functools.partial``, a class
  built from it), plus named torch ops that are the answer (``torch.chunk`` for a batch split). Calls the library
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

import contextlib
import importlib.util
import os
import secrets
import sys
import threading
import types
from dataclasses import dataclass, field

import torch

from labutils.compare import compare_tensors

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = 'raise NotImplementedError("exercise: write your solution here")'
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_GUARD_SWITCHES = frozenset({"setprofile", "settrace", "setprofile_all_threads", "settrace_all_threads"})
# Reading the checker's frames is never the exercise; sys._getframe itself is called by torch's own code (the
# distributed logger), so the defence is that no answer sits in any frame while the student's function runs.
_ALWAYS_OFF = frozenset({"_current_frames"})
_TRUSTED: set = set()  # code objects of checker code that calls the student's function (see trusted())


class OffLimits(RuntimeError):
    """Raised (and recorded) when an exercise calls code that implements the answer."""


def trusted(fn):
    """Mark a checker's own wrapper (a function that calls the student's function, e.g. to take gradients) as
    outside the libraries, so that the student's function, or a library function handed in as the answer, counts
    as called from outside. Only the decorated function's own code is trusted, not what it calls."""
    _TRUSTED.add(fn.__code__)
    return fn


def library_roots(extra=()) -> tuple:
    """Directories whose code an exercise may not call: this package (the book's machinery), ``labutils``, and
    DeepSpeed/fastmoe (where they are, imported or not)."""
    roots = [_PACKAGE_DIR]
    for mod in ("labutils", "deepspeed", "fmoe", "fmoe_cuda"):
        path = getattr(sys.modules.get(mod), "__file__", None)
        if path is None:  # not imported yet: where it would be, so an import inside the exercise is covered
            try:
                spec = importlib.util.find_spec(mod)
            except (ImportError, ValueError):
                spec = None
            path = spec.origin if spec is not None else None
        if path:
            roots.append(os.path.dirname(os.path.abspath(path)))
    roots.extend(os.path.abspath(str(r)) for r in extra)
    return tuple(r.rstrip(os.sep) + os.sep for r in roots)


@dataclass
class Guard:
    """A profile hook that records every call crossing into ``roots`` from outside them, and every C call named in
    ``ops`` made from outside them. Use as a context manager; ``violations`` lists what was seen (first 20).

    ``objects``: functions or classes (their methods) forbidden wherever their code lives. The hook also raises
    :class:`OffLimits` at the first violation so the student sees where; a student who catches it still fails,
    because the violation was recorded.
    """
    roots: tuple = field(default_factory=library_roots)
    ops: frozenset = frozenset()
    objects: tuple = ()
    violations: list = field(default_factory=list)

    def __post_init__(self):
        self.ops = frozenset(self.ops)
        self._codes = {}
        for obj in self.objects:
            for code, label in _codes_of(obj):
                self._codes[code] = label
        self._active = False

    def _inside(self, frame) -> bool:
        return (frame is not None and frame.f_code not in _TRUSTED
                and frame.f_code.co_filename.startswith(self.roots))

    def _record(self, what: str):
        if len(self.violations) < 20:
            self.violations.append(what)
        raise OffLimits(f"exercise: write it yourself; this {what}, which is off limits while the checker runs")

    def _hook(self, frame, event, arg):
        if not self._active:
            return
        if event == "call":
            code = frame.f_code
            if code in self._codes and not self._inside(frame.f_back):
                self._record(f"calls {self._codes[code]}")
            if self._inside(frame) and not self._inside(frame.f_back):
                mod = frame.f_globals.get("__name__", "?")
                self._record(f"calls {mod}.{code.co_qualname if hasattr(code, 'co_qualname') else code.co_name}")
        elif event == "c_call":
            name = getattr(arg, "__name__", "")
            if name in _GUARD_SWITCHES and getattr(arg, "__module__", "") in ("sys", "threading", None):
                self.violations.append(f"{name} (switching the checker's guard off)")
                return
            if name in self.ops and not self._inside(frame):
                self._record(f"calls torch op {name!r}")

    def __enter__(self):
        self._saved = (sys.getprofile(), threading.getprofile() if hasattr(threading, "getprofile") else None)
        self._active = True
        threading.setprofile(self._hook)
        sys.setprofile(self._hook)
        return self

    @trusted
    def __exit__(self, *exc):
        current = sys.getprofile()
        self._active = False
        sys.setprofile(self._saved[0])
        threading.setprofile(self._saved[1])  # type: ignore[arg-type]
        if current != self._hook and not self.violations:
            self.violations.append("the checker's guard was switched off")
        return False


def _codes_of(obj):
    """(code object, label) pairs of a function, or of every function defined on a class."""
    label = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', obj)}"
    if isinstance(obj, types.FunctionType):
        yield obj.__code__, label
    elif isinstance(obj, type):
        for klass in obj.__mro__:
            if klass.__module__.startswith(("torch", "builtins")):
                continue
            for attr in vars(klass).values():
                fn = getattr(attr, "__func__", attr)
                if isinstance(fn, types.FunctionType):
                    yield fn.__code__, f"{label}.{fn.__name__}"
    elif isinstance(obj, types.MethodType):
        yield obj.__func__.__code__, label
    else:
        raise TypeError(f"forbid() takes functions and classes, got {obj!r}")


@trusted
def guarded_call(fn, *args, ops=(), objects=(), roots=None, **kwargs):
    """Call ``fn(*args, **kwargs)`` under a :class:`Guard`; returns ``(result, violations)``. ``result`` is None
    when the call raised :class:`OffLimits`. Other exceptions propagate. Workers of a distributed exercise call
    this on every rank."""
    guard = Guard(roots=library_roots() if roots is None else roots, ops=frozenset(ops), objects=tuple(objects))
    result = None
    try:
        with guard:
            result = fn(*args, **kwargs)
    except OffLimits:
        pass
    return result, list(guard.violations)


@contextlib.contextmanager
def forbid(*targets):
    """Raise :class:`OffLimits` inside the block when code outside the libraries calls one of ``targets``
    (functions, or classes: any of their methods). Kept from 0.2 for notebooks that name what they forbid;
    :func:`check_exercise` forbids the whole of the book's package and DeepSpeed by default."""
    for t in targets:
        list(_codes_of(t))  # TypeError for anything else, before the block runs
    guard = Guard(roots=(), objects=targets)
    with guard:
        yield guard
    if guard.violations:
        raise OffLimits(f"exercise: write it yourself; {guard.violations[0]} is off limits while this checker runs")


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
