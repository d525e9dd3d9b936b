"""The exercise checkers' guard: a profile hook (``sys.setprofile``) that sees every call the student's code makes
into the book's own packages, DeepSpeed or fastmoe, however it is named or reached. (Used by every chapter's
exercises; the design is explained in chapter 00 and in :mod:`labbook.exercises`.)

:class:`Guard` records each call crossing into the library directories from outside them (and named C ops);
:func:`guarded_call` runs one call under it; :func:`trusted` marks checker code that calls the student's function;
:func:`forbid` forbids named functions or classes wherever their code lives.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
import types
from dataclasses import dataclass, field

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_GUARD_SWITCHES = frozenset({"setprofile", "settrace", "setprofile_all_threads", "settrace_all_threads"})
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
