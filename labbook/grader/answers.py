"""Comparing an answer with the reference, in the grading parent: what kind of value is expected (integers exactly,
as integers; floats within the exercise's stated tolerance), its shape, and one line saying so. Also the case
container the chapters' checker modules fill (:class:`Cases`). (Part of the grader.)"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

INT_KINDS = (int, bool)


@dataclass
class Cases:
    """One exercise's cases, kept by the grading parent. ``reference(*args)`` computes the expected answer (never
    the function the exercise re-implements); ``visible`` are printed, ``hidden(gen, i)`` draws the i-th hidden
    case from a ``torch.Generator`` seeded with a seed only the parent knows. Floats are compared with
    ``rtol``/``atol``, or with ``tolerance(*args) -> (rtol, atol)`` when the right tolerance depends on the case;
    ``reduce(answer, args)`` maps the raw answer to what is compared (e.g. None -> "never reached").
    Distributed exercises also give ``inputs(gen, *structure)``: each rank's inputs for a case's structure."""
    reference: Callable
    visible: Sequence = ()
    hidden: Callable | None = None
    n_hidden: int = 8
    rtol: float = 1e-5
    atol: float = 1e-6
    tolerance: Callable | None = None
    reduce: Callable | None = None
    inputs: Callable | None = None


def _kind(value) -> str:
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or not (value.is_floating_point() or value.is_complex()):
            return "integer"
        return "float"
    if isinstance(value, INT_KINDS):
        return "integer"
    if isinstance(value, float):
        return "float"
    return "other"


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).replace('torch.', '')} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _tensor(value) -> torch.Tensor:
    """``value`` as a tensor without losing precision: Python floats in float64 (``torch.as_tensor`` would round
    them to float32, finer than some exercises' tolerance), Python ints in int64."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64)
    return torch.as_tensor(value)


def compare_one(label: str, got: Any, want: Any, rtol: float, atol: float) -> tuple:
    """(line, ok) for one value. Integer references want an integer answer (a Python int or an integer tensor) equal
    value by value; float references want a float or int, or a floating tensor, within ``rtol``/``atol``."""
    want_t = _tensor(want)
    kind = _kind(want)
    got_kind = _kind(got)
    if got_kind == "other":
        return f"{label:<28} | not a tensor or number: {_describe(got)}", False
    if kind == "integer" and got_kind != "integer":
        return f"{label:<28} | an integer answer expected (int or an integer tensor), got {_describe(got)}", False
    got_t = _tensor(got)
    if got_t.shape != want_t.shape:
        return f"{label:<28} | wrong shape: got {tuple(got_t.shape)}, expected {tuple(want_t.shape)}", False
    if kind == "integer":
        wrong = int((got_t.to(torch.int64) != want_t.to(torch.int64)).sum())
        ok = wrong == 0
        return f"{label:<28} | exact: {str(ok):<5} | integers, compared exactly ({wrong} wrong)", ok
    g, w = got_t.double(), want_t.double()
    exact = bool(torch.equal(g, w))
    diff = (g - w).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    close = bool(torch.isfinite(g).all()) and bool((diff <= atol + rtol * w.abs()).all())
    return (f"{label:<28} | exact: {str(exact):<5} | approximate: {str(close):<5} | maxdiff: {max_abs:.3e}", close)


def compare(label: str, got: Any, want: Any, rtol: float, atol: float) -> tuple:
    """(lines, ok): ``want`` a value or a tuple of values; ``got`` must have the same structure."""
    if isinstance(want, (tuple, list)):
        if not isinstance(got, (tuple, list)):
            return [f"{label}: returned {_describe(got)}, expected a tuple of {len(want)} values"], False
        if len(got) != len(want):
            return [f"{label}: returned {len(got)} values, expected {len(want)}"], False
        lines, ok = [], True
        for j, (g, w) in enumerate(zip(got, want)):
            line, good = compare_one(f"{label} out {j}", g, w, rtol, atol)
            lines.append(line)
            ok &= good
        return lines, ok
    line, ok = compare_one(label, got, want, rtol, atol)
    return [line], ok
