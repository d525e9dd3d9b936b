"""Parity checks: compare tensors and models and print what differs. (Taught in chapters 01 and 07.)

Every parity check in the book goes through these helpers so that a failure always shows the same
readable table: which tensor, its shape, the largest absolute and relative difference, and whether it
is within tolerance.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Diff:
    """How two tensors differ."""
    name: str
    shape: tuple
    exact: bool
    close: bool
    max_abs: float
    max_rel: float

    def row(self) -> str:
        verdict = "exact" if self.exact else ("close" if self.close else "DIFFERENT")
        return f"{self.name:<40} {str(tuple(self.shape)):<18} {self.max_abs:>11.3e} {self.max_rel:>11.3e}  {verdict}"


def compare_tensors(name: str, got: torch.Tensor, expected: torch.Tensor, *, rtol: float = 1e-5,
                    atol: float = 1e-5) -> Diff:
    """Compare two tensors elementwise (``|got-expected| <= atol + rtol*|expected|``)."""
    got, expected = torch.as_tensor(got), torch.as_tensor(expected)
    if got.shape != expected.shape:
        raise ValueError(f"{name}: shapes differ, got {tuple(got.shape)} expected {tuple(expected.shape)}")
    g = got.detach().cpu().double()
    e = expected.detach().cpu().double()
    diff = (g - e).abs()
    max_abs = diff.max().item() if diff.numel() else 0.0
    max_rel = (diff / e.abs().clamp_min(1e-12)).max().item() if diff.numel() else 0.0
    exact = bool(torch.equal(got.detach().cpu(), expected.detach().cpu()))
    close = bool(torch.allclose(g, e, rtol=rtol, atol=atol))
    return Diff(name, tuple(got.shape), exact, close, max_abs, max_rel)


@dataclass
class ParityReport:
    """The differences between two sets of tensors, largest first."""
    what: str
    diffs: list = field(default_factory=list)
    missing: list = field(default_factory=list)
    rtol: float = 1e-5
    atol: float = 1e-5

    @property
    def ok(self) -> bool:
        return not self.missing and all(d.close for d in self.diffs)

    @property
    def max_abs(self) -> float:
        return max((d.max_abs for d in self.diffs), default=0.0)

    def table(self, top: int = 10) -> str:
        head = f"{'tensor':<40} {'shape':<18} {'max |diff|':>11} {'max rel':>11}  verdict"
        rows = [d.row() for d in sorted(self.diffs, key=lambda d: -d.max_abs)[:top]]
        more = len(self.diffs) - len(rows)
        lines = [f"{self.what}: {'OK' if self.ok else 'MISMATCH'} (rtol={self.rtol:g}, atol={self.atol:g}, "
                 f"{len(self.diffs)} tensors)", head, *rows]
        if more > 0:
            lines.append(f"... {more} more within the same or smaller difference")
        lines += [f"missing: {m}" for m in self.missing]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.table()

    def assert_ok(self) -> "ParityReport":
        if not self.ok:
            raise AssertionError(self.table())
        return self


def _named_tensors(obj, what: str) -> dict:
    if isinstance(obj, nn.Module):
        if what == "params":
            return {n: p.detach() for n, p in obj.named_parameters()}
        if what == "grads":
            return {n: p.grad for n, p in obj.named_parameters()}
        if what == "state_dict":
            return dict(obj.state_dict())
        raise ValueError(f"what must be 'params', 'grads' or 'state_dict', not {what!r}")
    if isinstance(obj, dict):
        return dict(obj)
    raise TypeError(f"expected an nn.Module or a dict of tensors, got {type(obj).__name__}")


def compare_models(a, b, what: str = "params", *, rtol: float = 1e-5, atol: float = 1e-5,
                   strict_names: bool = True) -> ParityReport:
    """Compare parameters, gradients or state_dicts of two models (or two dicts of tensors).

    Names must match when ``strict_names`` (DDP's ``module.`` prefix is stripped). A gradient that is
    ``None`` on one side and not the other counts as missing.
    """
    ta = {_strip(k): v for k, v in _named_tensors(a, what).items()}
    tb = {_strip(k): v for k, v in _named_tensors(b, what).items()}
    report = ParityReport(what, rtol=rtol, atol=atol)
    names = list(ta) if strict_names else [k for k in ta if k in tb]
    if strict_names:
        report.missing += [f"{k} (only in the second)" for k in tb if k not in ta]
    for k in names:
        if k not in tb:
            report.missing.append(f"{k} (only in the first)")
            continue
        va, vb = ta[k], tb[k]
        if va is None or vb is None:
            if (va is None) != (vb is None):
                report.missing.append(f"{k} (None on one side)")
            continue
        report.diffs.append(compare_tensors(k, va, vb, rtol=rtol, atol=atol))
    return report


def _strip(name: str) -> str:
    for prefix in ("module.", "_orig_mod."):
        while name.startswith(prefix):
            name = name[len(prefix):]
    return name


def cmp(name: str, got, expected, *, rtol: float = 1e-5, atol: float = 1e-5, verbose: bool = True) -> bool:
    """nn-zero-to-hero style one-liner: ``name | exact | approximate | max diff``. Returns True when close."""
    d = compare_tensors(name, got, expected, rtol=rtol, atol=atol)
    if verbose:
        print(f"{name:<28} | exact: {str(d.exact):<5} | approximate: {str(d.close):<5} | maxdiff: {d.max_abs:.3e}")
    return d.close


def check(name: str, ok: bool, detail: str = "") -> None:
    """Print a pass line, or raise AssertionError with ``detail`` when the check fails."""
    if not ok:
        raise AssertionError(f"FAILED: {name}" + (f"\n{detail}" if detail else ""))
    print(f"✅ {name}")


@contextlib.contextmanager
def must_fail(name: str, errors=AssertionError):
    """A negative control: the block must raise ``errors`` (a check that fails on a planted bug). Prints what it
    caught; raises AssertionError naming the control when the block ran through. (Chapter 00.)

    Refuses, before the block runs: a ``name`` that is not a non-empty str (``must_fail(ValueError)`` would
    catch only AssertionError and let the ValueError through) and ``errors`` that is not an exception class or a
    tuple of them (Python would only say so once the block raised)."""
    if not (isinstance(name, str) and name.strip()):
        hint = (f" (an exception class goes to errors=: must_fail('what the control shows', errors="
                f"{name.__name__}))" if isinstance(name, type) and issubclass(name, BaseException) else "")
        raise TypeError(f"must_fail: name must be a non-empty str naming the control, got {name!r}{hint}")
    classes: tuple = tuple(errors) if isinstance(errors, tuple) else (errors,)
    if not classes or not all(isinstance(e, type) and issubclass(e, BaseException) for e in classes):
        raise TypeError(f"must_fail({name!r}): errors must be an exception class or a tuple of them, e.g. "
                        f"errors=(AssertionError, ValueError), got {errors!r}")
    try:
        yield
    except classes as err:
        print(f"✅ {name}: the check fails as it should:", " | ".join(str(err).splitlines()[:2]))
        return
    raise AssertionError(f"FAILED: {name}: the block raised nothing, so the check it guards cannot fail")


def assert_close(name: str, got, expected, *, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """Raise with a readable message unless ``got`` is within tolerance of ``expected``; print a pass line."""
    d = compare_tensors(name, got, expected, rtol=rtol, atol=atol)
    check(f"{name} (max |diff| {d.max_abs:.1e} <= atol {atol:g} + rtol {rtol:g})", d.close,
          f"max |diff| {d.max_abs:.3e}, max rel {d.max_rel:.3e}")
