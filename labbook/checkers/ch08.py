"""Chapter 08's exercise checkers: the combine written as one ``index_add`` (with its gradients and dtype), a
timing harness that compares two steps fairly, and the FLOP overhead of GShard's one-hot einsums. Serves
notebooks/08_performance.ipynb; red-teamed by tests/test_exercise_cheats_ch08.py.

The references are written for the checker and independent of the function under test: the combine and its
gradients by a loop over the sorted rows in float64; the timing harness against two steps of KNOWN cost (they
burn a hidden, seeded amount of CPU time and count their forward and backward calls); the einsum overhead by
torch's own FLOP counter (``torch.utils.flop_counter.FlopCounterMode``) run on meta tensors of each case's shapes.
The student's function runs under :class:`labbook.guard.Guard`: any call into labutils (``gather_combine``,
``MOEGatherCombine``, ``labutils.perf.timing.bench``, ``labutils.perf.dispatch.einsum``, ...), DeepSpeed or fastmoe
fails the case, and so does the FLOP counter itself in the einsum exercise.
"""
from __future__ import annotations

import math
import time

import torch

from labbook.exercises import check_exercise
from labbook.guard import trusted

# --- exercise 1: the combine as one index_add ----------------------------------------------------------------


def _combine_case(T: int, E: int, k: int, d: int, gen: torch.Generator, drop: float = 0.0,
                  y_dtype=torch.float32, score_dtype=torch.float32):
    """(y_sorted (N, d), pos (N,), score (T, k), grad_out (T, d)): a top-k routing of random logits, the kept
    (token, choice) pairs sorted by expert (``pos``: their flattened index ``t*k + j``), ``drop`` of them lost."""
    logits = torch.randn(T, E, generator=gen)                                # (T, E)
    idx = logits.topk(k, dim=-1).indices                                      # (T, k)
    flat = idx.reshape(-1)                                                    # (T*k,)
    kept = torch.rand(flat.numel(), generator=gen) >= drop                    # (T*k,) bool
    order = [i for e in range(E) for i in range(flat.numel()) if int(flat[i]) == e and bool(kept[i])]
    pos = torch.tensor(order, dtype=torch.int64)                              # (N,)
    score = torch.rand(T, k, generator=gen).to(score_dtype)                  # (T, k)
    y_sorted = torch.randn(len(order), d, generator=gen).to(y_dtype)          # (N, d)
    grad_out = torch.randn(T, d, generator=gen).to(y_dtype)                   # (T, d)
    return y_sorted, pos, score, grad_out


def combine_reference(y_sorted, pos, score, grad_out):
    """Row by row in float64: ``out[t] += score[t, j] * y_sorted[i]`` for sorted row ``i`` at ``pos[i] = t*k+j``,
    and the gradients of ``(out * grad_out).sum()`` w.r.t. ``y_sorted`` and ``score``. Cast to the inputs'
    dtypes: ``(out, grad y_sorted, grad score)``."""
    T, k = score.shape
    s = score.double().reshape(-1).tolist()
    Y, G = y_sorted.double(), grad_out.double()
    out = torch.zeros(T, y_sorted.shape[1], dtype=torch.float64)
    gy = torch.zeros_like(Y)
    gs = [0.0] * (T * k)
    for i, p in enumerate(pos.tolist()):
        t = p // k
        out[t] += s[p] * Y[i]
        gy[i] = s[p] * G[t]
        gs[p] += float(Y[i] @ G[t])
    gs_t = torch.tensor(gs, dtype=torch.float64).reshape(T, k)
    return out.to(y_sorted.dtype), gy.to(y_sorted.dtype), gs_t.to(score.dtype)


def _with_gradients(fn):
    """The student's combine run as training runs it: inputs that require grad, a backward of ``grad_out``.
    Returns ``(out, grad y_sorted, grad score)``; raises with a clear message when the output has the wrong
    dtype or shape, or no gradient path to either input."""

    @trusted
    def run(y_sorted, pos, score, grad_out):
        y = y_sorted.clone().requires_grad_()
        s = score.clone().requires_grad_()
        out = fn(y, pos, s)
        if not torch.is_tensor(out):
            raise AssertionError(f"combine_index_add must return a tensor, got {type(out).__name__}")
        if out.dtype != y_sorted.dtype:
            raise AssertionError(f"output dtype {out.dtype}, expected {y_sorted.dtype} (the dtype of y_sorted)")
        if tuple(out.shape) != tuple(grad_out.shape):
            raise AssertionError(f"output shape {tuple(out.shape)}, expected {tuple(grad_out.shape)} (T, d)")
        if not out.requires_grad:
            raise AssertionError("the output has no gradient path to y_sorted or score (detached, or computed "
                                 "under no_grad): training could not learn through it")
        out.backward(grad_out)
        if y.grad is None or s.grad is None:
            missing = [n for n, t in (("y_sorted", y), ("score", s)) if t.grad is None]
            raise AssertionError(f"no gradient reaches {', '.join(missing)}")
        return out.detach(), y.grad, s.grad

    return run


COMBINE_VISIBLE = [(64, 8, 2, 16, 0.0), (33, 4, 1, 8, 0.0), (50, 16, 4, 32, 0.1)]  # T, E, k, d, share dropped


def _combine_hidden(gen: torch.Generator, i: int):
    T = int(torch.randint(1, 48, (1,), generator=gen))
    E = int(torch.randint(1, 10, (1,), generator=gen))
    k = int(torch.randint(1, min(E, 4) + 1, (1,), generator=gen))
    d = int(torch.randint(1, 24, (1,), generator=gen))
    drop = [0.0, 0.0, 0.25][i % 3]
    dtypes = [(torch.float32, torch.float32), (torch.float64, torch.float32), (torch.float32, torch.float64)]
    y_dtype, score_dtype = dtypes[i % 3]
    return _combine_case(T, E, k, d, gen, drop, y_dtype, score_dtype)


def check_combine_index_add(fn, seed=None) -> None:
    """``fn(y_sorted (N, d), pos (N,), score (T, k)) -> (T, d)``: output, gradients w.r.t. ``y_sorted`` and
    ``score``, and the output's dtype (that of ``y_sorted``), on 3 visible and 8 hidden routings (some with
    dropped choices, some float64)."""
    gen = torch.Generator().manual_seed(8)
    visible = [_combine_case(T, E, k, d, gen, drop) for T, E, k, d, drop in COMBINE_VISIBLE]
    check_exercise("combine_index_add", _with_gradients(fn), combine_reference, *visible, hidden=_combine_hidden,
                   seed=seed, rtol=1e-5, atol=1e-5)


# --- exercise 1b: timing two steps fairly ---------------------------------------------------------------------


class _KnownCost:
    """A step of known cost: its forward burns ``fwd_s`` of this thread's CPU time, its backward ``bwd_s``;
    every call is logged (name, "fwd"/"bwd") so the checker sees the order and that backward ran."""

    def __init__(self, name: str, fwd_s: float, bwd_s: float, log: list):
        self.name, self.fwd_s, self.bwd_s, self.log = name, fwd_s, bwd_s, log
        outer = self

        class Step(torch.autograd.Function):
            @staticmethod
            @trusted
            def forward(ctx, x):
                outer.log.append((outer.name, "fwd"))
                _burn(outer.fwd_s)
                return x * 1.0

            @staticmethod
            @trusted
            def backward(ctx, g):
                outer.log.append((outer.name, "bwd"))
                _burn(outer.bwd_s)
                return g

        self._step = Step

    @trusted
    def __call__(self, x):
        return self._step.apply(x)


@trusted
def _burn(seconds: float) -> None:
    """Spin for ``seconds`` of this thread's CPU time (sleeping would cost no CPU time)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@trusted
def _fresh_input():
    return torch.ones(4, requires_grad=True)


class _Pair:
    """One timing case: steps A and B (B costs ``factor`` times A, its extra cost all in its backward: a harness
    that times forwards only sees a ratio of 1), the shared call log, and the rounds asked for. Built outside the
    guard (the checker's own code), handed to the student's harness inside it."""

    def __init__(self, reps: int, base: float, factor: float):
        self.reps, self.base, self.factor, self.log = reps, base, factor, []
        self.a = _KnownCost("A", base / 2, base / 2, self.log)
        self.b = _KnownCost("B", base / 2, factor * base - base / 2, self.log)


TIMING_VISIBLE = [(3, 0.004, 2.0), (5, 0.002, 3.0)]  # rounds, step A's cost (s), B's cost / A's


def _timing_hidden(gen: torch.Generator, i: int):
    reps = int(torch.randint(3, 7, (1,), generator=gen))
    base = 0.002 + 0.002 * float(torch.rand(1, generator=gen))
    factor = [1.5, 2.5, 4.0][int(torch.randint(0, 3, (1,), generator=gen))]
    return (_Pair(reps, base, factor),)


def _timing_run(fn):
    """Run the student's harness on two steps of known cost; returns what a correct harness must observe:
    (rounds timed per step, every step's forward followed by its backward, interleaved, B/A ratio in band)."""

    @trusted
    def run(pair):  # no comprehensions here: each is a frame of its own, inside the package, hence off limits
        reps, factor, log = pair.reps, pair.factor, pair.log
        times = fn(pair.a, pair.b, _fresh_input, reps)
        if not (isinstance(times, dict) and set(times) == {"a", "b"}):
            raise AssertionError(f"time_pair must return {{'a': [...], 'b': [...]}}, got {type(times).__name__}")
        ta, tb, ratios = list(times["a"]), list(times["b"]), []
        for x, y in zip(ta, tb):
            if float(x) <= 0:
                raise AssertionError(f"a timing of {float(x)} s: the clock did not see the step run")
            ratios.append(float(y) / float(x))
        pairs_ok, fwd = len(log) % 2 == 0, []
        for i in range(0, len(log) - 1, 2):   # every forward followed at once by the same step's backward
            pairs_ok = pairs_ok and log[i][1] == "fwd" and log[i + 1] == (log[i][0], "bwd")
            fwd.append(log[i][0])
        switches = 0
        for x, y in zip(fwd, fwd[1:]):
            switches += x != y
        interleaved = len(fwd) >= 2 and switches >= len(fwd) // 2 - 1   # A B A B ... (after any warm-up)
        ratio = sorted(ratios)[len(ratios) // 2] if ratios else float("nan")
        in_band = factor / 1.6 <= ratio <= factor * 1.6          # CPU-time burns: a right harness lands near it
        return (torch.tensor([len(ta), len(tb)]), torch.tensor(int(pairs_ok)), torch.tensor(int(interleaved)),
                torch.tensor(int(in_band)))

    return run


def _timing_reference(pair):
    return torch.tensor([pair.reps, pair.reps]), torch.tensor(1), torch.tensor(1), torch.tensor(1)


def check_time_pair(fn, seed=None) -> None:
    """``fn(step_a, step_b, make_input, reps) -> {"a": [s, ...], "b": [s, ...]}``: ``reps`` rounds, each timing one
    forward+backward of A then of B (interleaved), with a clock that counts their work. Checked on steps whose
    cost the checker knows (B costs a hidden multiple of A): every forward followed by its backward, rounds
    interleaved, ``reps`` times per step, and the median paired ratio B/A within a factor 1.6 of the truth."""
    from torch.utils.benchmark import Timer

    visible = [(_Pair(*c),) for c in TIMING_VISIBLE]
    check_exercise("time_pair", _timing_run(fn), _timing_reference, *visible, hidden=_timing_hidden,
                   n_hidden=3, seed=seed, forbidden=[Timer.__init__])  # torch's classes: name the function


# --- exercise 2: the one-hot einsums' FLOPs ------------------------------------------------------------------


def einsum_overhead_reference(T, E, C, d, h, k):
    """Counted, not derived: torch's FLOP counter over the two one-hot einsums (dispatch ``tec,td->ecd`` and
    combine ``tec,ecd->td``, forward and a backward with gradients for both operands) and over the expert MLP's
    two linears (forward and backward, gradients for input and weight), on meta tensors of the case's shapes."""
    from torch.utils.flop_counter import FlopCounterMode

    def counted(step) -> int:
        with torch.device("meta"), FlopCounterMode(display=False) as fc:
            step()
        return fc.get_total_flops()

    def einsums():
        mask = torch.empty(T, E, C, requires_grad=True)
        x = torch.empty(T, d, requires_grad=True)
        out_e = torch.empty(E, C, d, requires_grad=True)
        dispatched = torch.einsum("tec,td->ecd", mask, x)                     # (E, C, d)
        combined = torch.einsum("tec,ecd->td", mask, out_e)                  # (T, d)
        torch.autograd.backward([dispatched, combined], [torch.empty_like(dispatched), torch.empty_like(combined)])

    def experts():
        rows = torch.empty(T * k, d, requires_grad=True)
        w1, w2 = torch.empty(h, d, requires_grad=True), torch.empty(d, h, requires_grad=True)
        y = torch.nn.functional.linear(torch.nn.functional.linear(rows, w1), w2)   # (T*k, d)
        y.backward(torch.empty_like(y))

    return torch.tensor(counted(einsums) / counted(experts), dtype=torch.float64)


EINSUM_VISIBLE = [(1024, 4, 600, 256, 512, 2), (1024, 128, 30, 256, 512, 2), (64, 8, 20, 16, 32, 1)]


def _einsum_hidden(gen: torch.Generator, i: int):
    def pick(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=gen))

    E = pick(2, 200)
    k = pick(1, min(E, 8) + 1)
    T = pick(8, 5000)
    C = max(1, math.ceil(T * k / E * (1.0 + float(torch.rand(1, generator=gen)))))
    return T, E, C, pick(4, 1024), pick(4, 4096), k


def check_einsum_overhead(fn, seed=None) -> None:
    """``fn(T, E, C, d, h, k)``: the one-hot einsums' FLOPs over the expert FLOPs of one training step, against
    torch's FLOP counter on 3 visible and 8 hidden shapes."""
    from torch.utils.flop_counter import FlopCounterMode

    check_exercise("einsum_overhead", fn, einsum_overhead_reference, *EINSUM_VISIBLE, hidden=_einsum_hidden,
                   seed=seed, rtol=1e-6, atol=0.0, forbidden=[FlopCounterMode.__init__])
