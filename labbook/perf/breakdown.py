"""Where the core's time goes: its forward+backward profiled into routing, dispatch, expert compute and combine.
(Taught in chapter 08.)

* :func:`labelled_core_steps` labels each named step of ``FMoE.forward`` for the profiler (the core unedited).
* :func:`core_breakdown` profiles the timed core (:class:`~labbook.perf.real_layers.CoreMoE`) on a problem,
  with the profiler's overhead measured against plain steps in the same rounds.
* :func:`judge_overhead` says whether the shares describe the unprofiled layer; :func:`compare_phases` whether
  a live breakdown attributes time as its record did, :func:`shifted_phases` for every live size at once.
* :func:`format_breakdown`: one breakdown as the chapter prints it.
"""
from __future__ import annotations

import contextlib
import functools
import math

from .sweep import check_against_loop
from .timing import quartiles, run_conditions

__all__ = ["PHASES", "labelled_core_steps", "core_breakdown", "judge_overhead", "compare_phases", "shifted_phases",
           "format_breakdown"]

PHASES = ("routing", "dispatch", "expert compute", "combine")
# FMoE.forward's named steps (its methods in labutils/moe/layers.py, the rest called by the dispatcher,
# labutils/moe/dispatch.py) and the phase each belongs to
_CORE_STEPS = {"route": "routing", "count_by_gate": "routing", "scatter": "dispatch",
               "expert_exchange": "expert compute", "gather": "combine", "combine": "combine",
               "gather_combine": "combine"}


@contextlib.contextmanager
def labelled_core_steps():
    """Wrap each named step of the core's ``FMoE.forward`` in ``torch.profiler.record_function(phase)``.

    The core is not edited: the dispatcher's step functions and the layer's two step methods are swapped for
    labelled wrappers for the duration of the block, then restored.
    """
    from torch.profiler import record_function

    from labutils.moe import dispatch, layers

    def labelled(fn, phase):
        @functools.wraps(fn)
        def step(*args, **kwargs):
            with record_function(phase):
                return fn(*args, **kwargs)
        return step

    saved = {}
    for name, phase in _CORE_STEPS.items():
        owner = layers.FMoE if name in ("route", "expert_exchange") else dispatch
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


def core_breakdown(p, reps: int = 3, core=None, check: bool = True) -> dict:
    """Profile the core's forward+backward on problem ``p`` into routing, dispatch, expert compute, combine.

    Returns ``{"forward": {phase: s}, "backward": {phase: s}, "total": {phase: s}, "profiled_s",
    "unprofiled_s", "runs", "profiler_overhead", "overhead_iqr", "unprofiled_iqr_pct", "reps", "conditions"}``:
    each phase's median over ``reps`` profiled steps ("other": autograd bookkeeping, reshapes, hooks), ``runs``
    each profiled step's phase totals (their spread is what :func:`compare_phases` tests against).

    Like is compared with like: each round times one plain step and then one profiled step with THE clock
    (:func:`~labbook.perf.timing.clock`), and ``profiler_overhead`` is the median over rounds of profiled /
    plain - 1 (``overhead_iqr`` its IQR); ``unprofiled_s`` is the plain steps' median. :func:`judge_overhead`
    says whether the shares describe the unprofiled layer. ``core``: a prebuilt core (e.g. a patched one);
    ``check``: first compare its output and gradients with the naive loop on ``p`` (AssertionError if not).
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    from labutils.nbtools import quiet

    from .dispatch import build_designs
    from .problem import fwd_bwd
    from .real_layers import CoreMoE
    from .timing import clock

    core = CoreMoE(p) if core is None else core
    out = fwd_bwd(core, p)                                                 # warm-up
    if check:
        got = {"core": out}
        grads = {"core": (p.x.grad.clone(), p.logits.grad.clone())}
        got["loop"] = fwd_bwd(build_designs(p, ["loop"])["loop"], p)
        grads["loop"] = (p.x.grad.clone(), p.logits.grad.clone())
        eq = check_against_loop(p, got, grads)["core"]
        if not eq["equal_to_loop"]:
            raise AssertionError(f"at T={p.T} E={p.E} k={p.top_k} d={p.d} h={p.h} the profiled core differs from "
                                 f"the naive loop (max |diff| {eq['max_abs_diff']:.3g})")
    now = clock()
    plain, profiled, runs = [], [], []
    with quiet(), labelled_core_steps():
        for _ in range(reps):
            t0 = now()
            fwd_bwd(core, p)
            plain.append(now() - t0)
            t0 = now()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                p.zero_grad()
                core.zero_grad(set_to_none=True)
                with record_function("forward"):
                    y = core(p).y
                with record_function("backward"):
                    y.backward(p.grad_y)
            profiled.append(now() - t0)
            runs.append(_phase_times(prof.events()))
    # per phase the MEDIAN over the profiled steps: the profiler's spans are wall clock, and a step preempted by
    # another process charges that pause to whichever phase it hit (the mean would carry it)
    res: dict = {part: {k: quartiles([r[part][k] for r in runs])[1] for k in runs[0][part]}
                 for part in ("forward", "backward")}
    res["total"] = {k: res["forward"][k] + res["backward"][k] for k in res["forward"]}
    res["runs"] = [{k: r["forward"][k] + r["backward"][k] for k in r["forward"]} for r in runs]
    res["profiled_s"] = sum(res["total"].values())
    q1, med, q3 = quartiles(plain)
    res["unprofiled_s"] = med
    res["unprofiled_iqr_pct"] = 100 * (q3 - q1) / med
    o1, omed, o3 = quartiles([pr / pl - 1.0 for pr, pl in zip(profiled, plain)])
    res["profiler_overhead"], res["overhead_iqr"] = omed, (o1, o3)
    res["profiled_clock_s"] = quartiles(profiled)[1]  # the profiled step on THE clock (CPU time on one thread)
    res["reps"] = reps
    res["conditions"] = run_conditions(reps)
    return res


def judge_overhead(b: dict, limit: float = 0.5, preempted: float = 1.5) -> dict:
    """Do a breakdown's shares describe the unprofiled layer? From its LIVE overhead (median and IQR over rounds,
    see :func:`core_breakdown`): ``"ok"`` when the whole IQR is at or below ``limit``, ``"too high"`` when the
    whole IQR is above it (the shares of short phases are inflated: a check must fail), ``"too noisy"`` when the
    IQR straddles the limit or the run had too few rounds (say so; do not claim either). Also ``"too noisy"``
    when the profiler's spans (wall clock) add up to more than ``preempted`` times the profiled step's time on
    THE clock (CPU time on one thread): other processes paused the step, and the pauses landed in whichever
    phase they hit. Returns ``{"call", "sentence"}``, the sentence generated from the numbers."""
    lo, hi = b.get("overhead_iqr", (b["profiler_overhead"], b["profiler_overhead"]))
    med, reps = b["profiler_overhead"], b.get("reps", 0)
    what = f"profiler overhead {med:.0%} (IQR {lo:.0%} to {hi:.0%} over {reps} rounds, limit {limit:.0%})"
    if reps < 3:
        return {"call": "too noisy", "sentence": f"{what}: too few rounds to judge"}
    on_clock = b.get("profiled_clock_s") or b.get("unprofiled_s", 0.0) * (1.0 + med)  # older records: from overhead
    stretch = b["profiled_s"] / on_clock if on_clock and "profiled_s" in b else 1.0
    if stretch > preempted:
        return {"call": "too noisy", "sentence": f"{what}; but the profiler's wall-clock spans add up to "
                                                 f"{stretch:.1f}x the step on THE clock: other processes preempted "
                                                 "it, so the shares are distorted and not judged"}
    if hi <= limit:
        return {"call": "ok", "sentence": f"{what}: the shares describe the unprofiled layer"}
    if lo > limit:
        return {"call": "too high", "sentence": f"{what}: ABOVE the limit, the shares of short phases are inflated"}
    return {"call": "too noisy", "sentence": f"{what}: the run was too noisy to judge (its IQR straddles the limit)"}


def compare_phases(live: dict, recorded: dict, *, factor: float = 3.0) -> dict:
    """Is the live breakdown's attribution what the record says at the same size? Per phase, the live share
    (each phase's FASTEST profiled step over the sum of those: the profiler's spans are wall clock, and a pause
    from another process only ever adds time) against the band the recorded steps' shares spanned (lowest and
    highest), widened by ``factor``: ``"moved"`` when the live share lies outside it, ``"vanished"`` when the
    phase had no time in any live step but some in every recorded one (its time went elsewhere, e.g. the
    combine charged to expert compute: unambiguous even on a loaded machine, where a wall-clock share can move
    by chance). The tolerance is the record's own spread. Returns ``{phase: {"live", "recorded", "band",
    "call"}}``; a record without per-step phase totals (``runs``) cannot be tested: ``"untestable"``."""
    phases = (*PHASES, "other")
    runs = live.get("runs", [])
    if runs:
        fastest = {ph: min(max(r[ph], 0.0) for r in runs) for ph in phases}
    else:
        fastest = {ph: max(live["total"][ph], 0.0) for ph in phases}
    live_share = {ph: fastest[ph] / sum(fastest.values()) for ph in phases}
    rec = [{ph: r[ph] / sum(r.values()) for ph in phases} for r in recorded.get("runs", [])]
    out = {}
    for ph in phases:
        vals = [x[ph] for x in rec]
        rec_med = quartiles(vals)[1] if vals else recorded["total"][ph] / recorded["profiled_s"]
        if len(runs) < 2 or len(vals) < 2:
            out[ph] = {"live": live_share[ph], "recorded": rec_med, "band": None, "call": "untestable"}
            continue
        lo, hi = min(vals), max(vals)
        band = (lo / factor if lo > 0 else -math.inf, hi * factor if hi > 0 else math.inf)
        call = "consistent" if band[0] <= live_share[ph] <= band[1] else "moved"
        if lo > 0 and all(r[ph] <= 0 for r in runs):
            call = "vanished"
        out[ph] = {"live": live_share[ph], "recorded": rec_med, "band": band, "call": call}
    return out


def shifted_phases(live: list, recorded: dict, *, factor: float = 3.0) -> tuple:
    """Every live breakdown against the record's at its tokens per expert (``recorded``: {tokens per expert:
    breakdown}) by :func:`compare_phases`. Returns ``(lines, shifted)``: per size a line with each phase's live share
    / recorded median share and call, and both profiles' :func:`judge_overhead` calls; and the phases that vanished
    (at any load) or moved outside the record's band where both profiles are well-conditioned ("ok" both)."""
    lines, shifted = [], []
    for b in live:
        t = b["tokens_per_expert"]
        calls = (judge_overhead(b)["call"], judge_overhead(recorded[t])["call"])
        cmp_ = compare_phases(b, recorded[t], factor=factor)
        lines.append(f"{t:>4} tokens/expert, live share / recorded median share: " + ", ".join(
            f"{ph} {v['live']:.1%}/{v['recorded']:.1%} {v['call']}" for ph, v in cmp_.items())
            + f" (live profile: {calls[0]}, recorded: {calls[1]})")
        both_ok = calls == ("ok", "ok")
        if not both_ok:
            lines.append("      shifted shares not judged here: a profile was preempted (its wall-clock spans are "
                         "distorted); a phase that vanished still is")
        shifted += [f"{ph} at {t} ({v['call']})" for ph, v in cmp_.items()
                    if v["call"] == "vanished" or (v["call"] == "moved" and both_ok)]
    return lines, shifted


def format_breakdown(b: dict, label: str) -> str:
    """Each phase's ms, the plain step's median and IQR, and :func:`judge_overhead`'s sentence."""
    return (f"{label}, {b['tokens_per_expert']:>4} tokens/expert: "
            + ", ".join(f"{ph} {b['total'][ph] * 1e3:.2f} ms" for ph in (*PHASES, "other"))
            + f"\n      plain step {b['unprofiled_s'] * 1e3:.1f} ms (IQR {b['unprofiled_iqr_pct']:.0f}%); "
            + judge_overhead(b)["sentence"])
