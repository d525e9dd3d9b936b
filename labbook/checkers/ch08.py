"""Chapter 08's exercise cases for the grader (:mod:`labbook.grader`): the combine written as one ``index_add``
(with its gradients and dtype), a timing harness that compares two steps fairly, and the FLOP overhead of GShard's
one-hot einsums. Serves notebooks/08_performance.ipynb; red-teamed by tests/test_grader_ch08.py.

The references are written for the grader and independent of the function under test: the combine and its
gradients by a loop over the sorted rows in float64 (the sandbox runs the student's combine with gradients:
``labbook.grader.adapters.with_gradients``); the timing harness against two steps of KNOWN cost, built in the
sandbox from a hidden factor (``adapters.known_cost_steps``), judged here from its timings and the steps' call log;
the einsum overhead by torch's own FLOP counter (``torch.utils.flop_counter.FlopCounterMode``) on meta tensors of
each case's shapes, which the exercise's policy refuses to the student.
"""
from __future__ import annotations

import math

import torch

from labbook.grader.answers import Cases

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


def _combine_visible() -> list:
    gen = torch.Generator().manual_seed(8)
    return [_combine_case(T, E, k, d, gen, drop) for T, E, k, d, drop in COMBINE_VISIBLE]


# --- exercise 1b: timing two steps fairly ---------------------------------------------------------------------


TIMING_VISIBLE = [(3, 0.004, 2.0), (5, 0.002, 3.0)]  # rounds, step A's cost (s), B's cost / A's


def _timing_hidden(gen: torch.Generator, i: int):
    reps = int(torch.randint(3, 7, (1,), generator=gen))
    base = 0.002 + 0.002 * float(torch.rand(1, generator=gen))
    factor = [1.5, 2.5, 4.0][int(torch.randint(0, 3, (1,), generator=gen))]
    return reps, base, factor


def judge_timing(got, args) -> tuple:
    """What a correct harness must have done, from its timings and the steps' call log (``"A fwd"``, ...):
    (rounds timed per step, every forward followed at once by the same step's backward, rounds interleaved, median
    paired ratio B/A within a factor 1.6 of the truth: CPU-time burns, a right harness lands near it; the median of
    A's timings is A's real cost, ``base`` seconds of CPU time, give or take: at least base / 1.6, at most 50 base
    (a wall clock on a busy machine runs on while the step waits), so made-up numbers fail even when the steps ran)."""
    reps, base, factor = args
    times, log = got["times"], got["log"]
    if not (isinstance(times, dict) and set(times) == {"a", "b"}):
        raise AssertionError(f"time_pair must return {{'a': [...], 'b': [...]}}, got {type(times).__name__}")
    ta, tb = list(times["a"]), list(times["b"])
    if not all(isinstance(t, (int, float)) for t in ta + tb):
        raise AssertionError("the timings must be numbers of seconds")
    if any(t <= 0 for t in ta):
        raise AssertionError(f"a timing of {min(ta)} s: the clock did not see the step run")
    ratios = sorted(float(y) / float(x) for x, y in zip(ta, tb))
    pairs_ok = len(log) % 2 == 0 and all(
        log[i].endswith("fwd") and log[i + 1] == log[i][0] + " bwd" for i in range(0, len(log) - 1, 2))
    fwd = [log[i][0] for i in range(0, len(log) - 1, 2)]
    switches = sum(x != y for x, y in zip(fwd, fwd[1:]))
    interleaved = len(fwd) >= 2 and switches >= len(fwd) // 2 - 1        # A B A B ... (after any warm-up)
    ratio = ratios[len(ratios) // 2] if ratios else float("nan")
    in_band = factor / 1.6 <= ratio <= factor * 1.6
    a_median = sorted(ta)[len(ta) // 2] if ta else float("nan")
    real = base / 1.6 <= a_median <= 50 * base
    return (torch.tensor([len(ta), len(tb)]), torch.tensor(int(pairs_ok)), torch.tensor(int(interleaved)),
            torch.tensor(int(in_band)), torch.tensor(int(real)))


def _timing_reference(reps, base, factor):
    return torch.tensor([reps, reps]), torch.tensor(1), torch.tensor(1), torch.tensor(1), torch.tensor(1)


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


CASES = {
    "combine_index_add": lambda: Cases(combine_reference, _combine_visible(), _combine_hidden, rtol=1e-5, atol=1e-5),
    "time_pair": lambda: Cases(_timing_reference, TIMING_VISIBLE, _timing_hidden, n_hidden=3, reduce=judge_timing),
    "einsum_overhead": lambda: Cases(einsum_overhead_reference, EINSUM_VISIBLE, _einsum_hidden, rtol=1e-6, atol=0.0),
}
