"""How the sandbox calls a student's function, one case at a time, and what it sends back. (Part of the grader;
runs in the sandboxed child, see :mod:`labbook.grader.sandbox`.)

* ``call``: ``fn(*args)``; ``distributed``: the same on every rank, once per input the rank holds;
* ``gradients``: as training runs it: inputs that require grad, a backward of the given ``grad_out``, the output
  and both gradients sent back (chapter 08's combine);
* ``timing``: the student's timing harness run on two steps of known cost built here from the case's
  parameters; their call log goes back with the harness's timings, and the parent judges both (chapter 08).

Every answer is checked before it leaves: a plain ``torch.Tensor`` (not a subclass), ``int``, ``float``, ``bool``,
``None``, or lists, tuples and string-keyed dicts of those; inputs must come back unchanged.
"""
from __future__ import annotations

import time
import traceback

import torch

MAX_ELEMENTS = 50_000_000


class Wrong(Exception):
    """The student's function broke a condition of the exercise (dtype, shape, no gradient path, ...); ``rule``
    names which: ``plain-answers`` (what may come back) or ``exercise`` (the exercise's own conditions)."""

    def __init__(self, message: str, rule: str = "exercise"):
        super().__init__(message)
        self.rule = rule


def _snapshot(value):
    if type(value) is torch.Tensor:
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v) for v in value)
    return value


def _same(before, after) -> bool:
    if type(before) is torch.Tensor:
        return (type(after) is torch.Tensor and before.shape == after.shape and before.dtype == after.dtype
                and bool(torch.equal(before, after.detach())))
    if isinstance(before, (list, tuple)):
        return (isinstance(after, (list, tuple)) and len(before) == len(after)
                and all(_same(b, a) for b, a in zip(before, after)))
    return before == after


def plain(value, depth: int = 0, budget: list | None = None):
    """``value`` as plain data for the parent, or :class:`Wrong` naming what is not allowed."""
    budget = [MAX_ELEMENTS] if budget is None else budget
    if depth > 4:
        raise Wrong("the answer is nested more than 4 levels deep", "plain-answers")
    kind = type(value)
    if kind is torch.Tensor:
        budget[0] -= value.numel()
        if budget[0] < 0:
            raise Wrong(f"the answer holds more than {MAX_ELEMENTS:,} elements", "plain-answers")
        return value.detach().cpu().clone()
    if isinstance(value, torch.Tensor):
        raise Wrong(f"returned a {kind.__name__}, a subclass of torch.Tensor: return a plain torch.Tensor",
                    "plain-answers")
    if kind in (int, float, bool, type(None)):
        return value
    if kind is str:
        if len(value) > 10_000:
            raise Wrong("the answer holds a string of over 10,000 characters", "plain-answers")
        return value
    if kind in (list, tuple):
        return kind(plain(v, depth + 1, budget) for v in value)
    if kind is dict:
        if not all(type(k) is str for k in value):
            raise Wrong("returned a dict whose keys are not all strings", "plain-answers")
        return {k: plain(v, depth + 1, budget) for k, v in value.items()}
    raise Wrong(f"returned a {kind.__module__}.{kind.__qualname__}; expected a torch.Tensor, a number, "
                "or a tuple of them", "plain-answers")


def solution_line(exc: BaseException) -> int | None:
    """The last line of the solution cell in ``exc``'s traceback (None when the error arose elsewhere)."""
    frames = traceback.StackSummary.extract(traceback.walk_tb(exc.__traceback__), lookup_lines=False)
    lines = [f.lineno for f in frames if f.filename == "<solution>"]
    return lines[-1] if lines else None


# --- the adapters --------------------------------------------------------------------------------------------

def with_gradients(fn, y_sorted, pos, score, grad_out):
    y = y_sorted.clone().requires_grad_()
    s = score.clone().requires_grad_()
    pos_before = pos.clone()
    out = fn(y, pos, s)
    if not torch.equal(pos, pos_before):             # before backward, which would trip over it less clearly
        raise Wrong("your function changed its input `pos` in place: copy an input before changing it",
                    "read-only-inputs")
    if type(out) is not torch.Tensor:
        plain(out)                                   # a Tensor subclass or an odd type: named as such
        raise Wrong(f"must return a torch.Tensor, got {type(out).__name__}")
    if out.dtype != y_sorted.dtype:
        raise Wrong(f"output dtype {out.dtype}, expected {y_sorted.dtype} (the dtype of y_sorted)")
    if tuple(out.shape) != tuple(grad_out.shape):
        raise Wrong(f"output shape {tuple(out.shape)}, expected {tuple(grad_out.shape)} (T, d)")
    if not out.requires_grad:
        raise Wrong("the output has no gradient path to y_sorted or score (detached, or computed under no_grad): "
                    "training could not learn through it")
    out.backward(grad_out)
    missing = [n for n, t in (("y_sorted", y), ("score", s)) if t.grad is None]
    if missing:
        raise Wrong(f"no gradient reaches {', '.join(missing)}")
    return out.detach(), y.grad, s.grad


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def known_cost_steps(base: float, factor: float):
    """Steps A and B and their call log: A's forward and backward each burn ``base / 2`` of CPU time; B costs
    ``factor`` times A, its extra all in its backward (a harness timing forwards only sees 1x). Plain functions:
    nothing about their cost can be read from them."""
    log = []

    def make(name, fwd_s, bwd_s):
        class Step(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                log.append(name + " fwd")
                _burn(fwd_s)
                return x * 1.0

            @staticmethod
            def backward(ctx, g):
                log.append(name + " bwd")
                _burn(bwd_s)
                return g

        def step(x):
            return Step.apply(x)
        return step

    return make("A", base / 2, base / 2), make("B", base / 2, factor * base - base / 2), log


def timing(fn, reps: int, base: float, factor: float):
    step_a, step_b, log = known_cost_steps(base, factor)
    times = fn(step_a, step_b, lambda: torch.ones(4, requires_grad=True), reps)
    return {"times": plain(times), "log": list(log)}


def run(adapter: str, fn, args: tuple) -> dict:
    """One case: the reply the parent reads (``kind``: answer, blank, raised, wrong, mutated)."""
    before = _snapshot(args)
    t0 = time.perf_counter()
    try:
        if adapter in ("call", "distributed"):
            value = fn(*args) if adapter == "call" else [fn(x) for x in args[0]]
        elif adapter == "gradients":
            value = with_gradients(fn, *args)
        elif adapter == "timing":
            value = timing(fn, *args)
        else:
            raise ValueError(f"unknown adapter {adapter!r}")
        value = plain(value)
    except NotImplementedError:
        return {"kind": "blank"}
    except Wrong as exc:
        return {"kind": "wrong", "message": str(exc), "rule": exc.rule}
    except BaseException as exc:  # noqa: BLE001 - the student's code may raise anything, SystemExit included
        return {"kind": "raised", "type": type(exc).__name__, "message": str(exc)[:400],
                "line": solution_line(exc)}
    if not _same(before, args):
        return {"kind": "mutated"}
    return {"kind": "answer", "value": value, "seconds": time.perf_counter() - t0}
