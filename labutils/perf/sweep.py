"""One MoE problem, every dispatch design side by side, and where the core's time goes. (Chapter 08.)

* :func:`measure_point` times a forward+backward of each design of :mod:`labutils.perf.dispatch` on the same
  problem, interleaved, with its peak memory and the share of choices it kept.
* :func:`core_breakdown` profiles the core's forward+backward into routing, dispatch, expert compute, combine.
"""
from __future__ import annotations

import contextlib
import functools

from .timing import bench, paired_ratio, peak_memory, summarize

__all__ = ["measure_point", "core_breakdown", "labelled_core_steps", "PHASES"]


def measure_point(p, names=None, reps: int = 5, memory: bool = True, device="cpu", budget_s: float | None = None,
                  limit: str = "dense") -> list:
    """Time one forward+backward of each design on problem ``p`` (interleaved) and measure its peak memory.

    Returns one dict per design: median (with IQR) and best seconds, tokens/s and useful GFLOP/s at the median,
    ``ratio`` (the paired median over interleaved rounds of reference time / design time, so 1.0 = as fast as
    the ``limit`` row, a dense MLP of the same FLOPs by default; ``ratio_iqr`` its IQR; a reference, which
    designs may beat), ``ratio_separate`` (the same against the E separate MLPs),
    ``kept`` (share of the T*k choices that reached an expert), ``rows`` (rows computed / (T*k): above 1 is
    padding) and ``peak_mb``. A design that raises is reported as ``{"design", "error"}`` instead.
    """
    from .dispatch import build_designs, fwd_bwd

    designs = build_designs(p, names)
    for extra in ("dense", "separate"):
        if extra not in designs:
            designs.update(build_designs(p, [extra]))
    outs, failed = {}, []
    for n, fn in list(designs.items()):  # warm-up, and the kept/rows counts
        try:
            outs[n] = fwd_bwd(fn, p)
        except Exception as exc:  # e.g. a kernel this device lacks: reported, not fatal
            if n in ("dense", "separate"):
                raise
            failed.append({"design": n, "error": f"{type(exc).__name__}: {exc}"[:300]})
            del designs[n]
    times = bench({n: (lambda fn=fn: fwd_bwd(fn, p)) for n, fn in designs.items()}, reps=reps, warmup=0,
                  device=device, budget_s=budget_s)
    rows = []
    for n in designs:
        s = summarize(times[n])
        ratio, ratio_iqr = paired_ratio(times[limit], times[n])
        row = {"design": n, **s, "tokens_per_s": p.T / s["median_s"], "gflops": p.flops() / s["median_s"] / 1e9,
               "ratio": ratio, "ratio_iqr": ratio_iqr, "ratio_separate": paired_ratio(times["separate"], times[n])[0],
               "kept": outs[n].kept / (p.T * p.top_k), "rows": outs[n].rows / (p.T * p.top_k)}
        if memory:
            p.zero_grad()  # free the previous design's gradients before the measurement starts
            row["peak_mb"] = peak_memory(lambda fn=designs[n]: fwd_bwd(fn, p), device) / 2 ** 20
        rows.append(row)
    return rows + failed


# ---- where the core's time goes ------------------------------------------------------------------
PHASES = ("routing", "dispatch", "expert compute", "combine")
# FMoE.forward's named steps (labutils/moe/layers.py) and the phase each belongs to
_CORE_STEPS = {"route": "routing", "count_by_gate": "routing", "scatter": "dispatch",
               "expert_exchange": "expert compute", "gather": "combine", "combine": "combine",
               "gather_combine": "combine"}


@contextlib.contextmanager
def labelled_core_steps():
    """Wrap each named step of the core's ``FMoE.forward`` in ``torch.profiler.record_function(phase)``.

    The core is not edited: its module-level step functions and its two step methods are swapped for labelled
    wrappers for the duration of the block, then restored.
    """
    from torch.profiler import record_function

    from ..moe import layers

    def labelled(fn, phase):
        @functools.wraps(fn)
        def step(*args, **kwargs):
            with record_function(phase):
                return fn(*args, **kwargs)
        return step

    saved = {}
    for name, phase in _CORE_STEPS.items():
        owner = layers.FMoE if name in ("route", "expert_exchange") else layers
        saved[(owner, name)] = getattr(owner, name)
        setattr(owner, name, labelled(getattr(owner, name), phase))
    try:
        yield
    finally:
        for (owner, name), fn in saved.items():
            setattr(owner, name, fn)


def _phase_times(events) -> dict:
    """Forward: time inside each phase's labels. Backward: each autograd node's time, charged to the phase
    whose forward op created it (matched by the op's sequence number)."""
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in events if e.name in PHASES]
    walls = {e.name: e.time_range.elapsed_us() for e in events if e.name in ("forward", "backward")}
    seq_phase = {}
    for e in events:
        if e.sequence_nr >= 0 and not e.name.startswith("autograd::engine"):
            for start, end, phase in spans:
                if start <= e.time_range.start <= end:
                    seq_phase[e.sequence_nr] = phase
    fwd: dict[str, float] = dict.fromkeys(PHASES, 0.0)
    bwd: dict[str, float] = dict.fromkeys(PHASES, 0.0)
    for start, end, phase in spans:
        fwd[phase] += (end - start) / 1e6
    for e in events:
        if e.name.startswith("autograd::engine::evaluate_function") and e.sequence_nr in seq_phase:
            bwd[seq_phase[e.sequence_nr]] += e.time_range.elapsed_us() / 1e6
    fwd["other"] = walls["forward"] / 1e6 - sum(fwd.values())
    bwd["other"] = walls["backward"] / 1e6 - sum(bwd.values())
    return {"forward": fwd, "backward": bwd}


def core_breakdown(p, reps: int = 3) -> dict:
    """Profile the core's forward+backward on problem ``p`` into routing, dispatch, expert compute, combine.

    Returns ``{"forward": {phase: s}, "backward": {phase: s}, "total": {phase: s}, "profiled_s",
    "unprofiled_s"}``: phases averaged over ``reps`` profiled steps ("other": autograd bookkeeping, reshapes,
    hooks), ``unprofiled_s`` the best of ``reps`` plain steps and
    ``profiler_overhead`` = profiled / unprofiled - 1: the profiler adds a few microseconds per op, so shares are
    what to read, and a large overhead says the shares of short phases are inflated.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    from ..nbtools import quiet
    from .dispatch import CoreMoE, fwd_bwd

    core = CoreMoE(p)

    fwd_bwd(core, p)                                                       # warm-up
    unprofiled = min(bench({"core": lambda: fwd_bwd(core, p)}, reps=reps, warmup=0)["core"])
    runs = []
    with quiet(), labelled_core_steps():
        for _ in range(reps):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                p.zero_grad()
                core.zero_grad(set_to_none=True)
                with record_function("forward"):
                    y = core(p).y
                with record_function("backward"):
                    y.backward(p.grad_y)
            runs.append(_phase_times(prof.events()))
    out = {part: {k: sum(r[part][k] for r in runs) / reps for k in runs[0][part]} for part in ("forward", "backward")}
    out["total"] = {k: out["forward"][k] + out["backward"][k] for k in out["forward"]}
    out["profiled_s"] = sum(out["total"].values())
    out["unprofiled_s"] = unprofiled
    out["profiler_overhead"] = out["profiled_s"] / unprofiled - 1.0   # stated next to every breakdown
    return out
