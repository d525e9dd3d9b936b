"""One MoE problem, every dispatch design side by side, and where the core's time goes. (Chapter 08.)

* :func:`measure_point` times a forward+backward of each design of :mod:`labutils.perf.dispatch` on the same
  problem, interleaved, with its peak memory and the share of choices it kept.
* :func:`core_breakdown` profiles the core's forward+backward into routing, dispatch, expert compute, combine.
"""
from __future__ import annotations

import contextlib
import functools
import math

from .timing import MIN_ROUNDS, bench, paired_ratio, peak_memory, quartiles, run_conditions, summarize

__all__ = ["measure_point", "check_against_loop", "compare_ratios", "target_verdict", "core_breakdown",
           "judge_overhead", "compare_phases", "labelled_core_steps", "PHASES"]


LOOP_RTOL, LOOP_ATOL = 1e-4, 1e-5  # float32 sums in another order; a lost expert's rows miss by O(1)


def check_against_loop(p, outs: dict, grads: dict, rtol: float = LOOP_RTOL, atol: float = LOOP_ATOL) -> dict:
    """Each design's output and input/logit gradients against the naive loop's on the SAME problem:
    ``{name: {"equal_to_loop": bool, "max_abs_diff": float, "compared_tokens": int}}``.

    ``outs[name]`` is the design's :class:`~labutils.perf.dispatch.DispatchOut`, ``grads[name]`` its
    ``(x.grad, logits.grad)`` (None for the references, which run other weights and are not compared). A design
    that drops choices (``out.dropped``) is compared on the tokens it kept whole, its gradients not at all.
    """
    from ..compare import compare_tensors

    ref, (ref_gx, ref_gl) = outs["loop"], grads["loop"]
    res = {}
    for name, out in outs.items():
        if grads.get(name) is None:
            continue
        if out.dropped is not None and bool(out.dropped.any()):
            whole = ~out.dropped                                           # (T,) tokens with every choice kept
            diffs = [compare_tensors(f"{name} y", out.y[whole], ref.y[whole], rtol=rtol, atol=atol)]
            n = int(whole.sum())
        else:
            gx, gl = grads[name]
            diffs = [compare_tensors(f"{name} y", out.y, ref.y, rtol=rtol, atol=atol),
                     compare_tensors(f"{name} x.grad", gx, ref_gx, rtol=rtol, atol=atol),
                     compare_tensors(f"{name} logits.grad", gl, ref_gl, rtol=rtol, atol=atol)]
            n = p.T
        res[name] = {"equal_to_loop": all(d.close for d in diffs), "max_abs_diff": max(d.max_abs for d in diffs),
                     "compared_tokens": n}
    return res


def measure_point(p, names=None, reps: int = 5, memory: bool = True, device="cpu", budget_s: float | None = None,
                  limit: str = "dense", designs: dict | None = None, strict: bool = True,
                  min_rounds: int = MIN_ROUNDS) -> list:
    """Time one forward+backward of each design on problem ``p`` (interleaved) and measure its peak memory.

    Before timing, every design's output and gradients are checked against the naive loop's on this very problem
    (:func:`check_against_loop`: the loop runs once even when it is not timed): ``strict`` raises AssertionError
    naming the design and the size when one differs, so no timed size goes unchecked.

    Returns one dict per design: median (with IQR) and best seconds, tokens/s and useful GFLOP/s at the median,
    ``ratio`` (the paired median over interleaved rounds of reference time / design time, so 1.0 = as fast as
    the ``limit`` row, a dense MLP of the same FLOPs by default; ``ratio_iqr`` its IQR; ``ratios`` every
    round's; a reference, which designs may beat), ``ratio_separate`` (the same against the E separate MLPs),
    ``kept`` (share of the T*k choices the experts received), ``rows`` (rows computed / (T*k): above 1 is
    padding), ``equal_to_loop``/``max_abs_diff``, ``wait_share`` (median over rounds of 1 - clock time / wall
    time: with one thread, time the step spent not running, e.g. sleeping), ``peak_mb`` and ``conditions``
    (:func:`~labutils.perf.timing.run_conditions`). ``designs`` passes prebuilt designs (e.g. a patched one).
    A design that raises is reported as ``{"design", "error"}`` instead.
    """
    from .dispatch import build_designs, fwd_bwd

    designs = dict(build_designs(p, names) if designs is None else designs)
    for extra in ("dense", "separate"):
        if extra not in designs:
            designs.update(build_designs(p, [extra]))
    outs, grads, failed = {}, {}, []
    checked = dict(designs)
    if "loop" not in checked:
        checked["loop"] = build_designs(p, ["loop"])["loop"]
    for n, fn in checked.items():  # warm-up, the kept/rows counts, and the outputs checked against the loop
        try:
            outs[n] = fwd_bwd(fn, p)
        except Exception as exc:  # e.g. a kernel this device lacks: reported, not fatal
            if n in ("dense", "separate", "loop"):
                raise
            failed.append({"design": n, "error": f"{type(exc).__name__}: {exc}"[:300]})
            designs.pop(n, None)
            continue
        grads[n] = None if n in ("dense", "separate") else (p.x.grad.clone(), p.logits.grad.clone())
    equal = check_against_loop(p, outs, grads)
    wrong = [f"{n} (max |diff| {v['max_abs_diff']:.3g})" for n, v in equal.items() if not v["equal_to_loop"]]
    if wrong and strict:
        raise AssertionError(f"at T={p.T} E={p.E} k={p.top_k} d={p.d} h={p.h}, these designs differ from the naive "
                             f"loop: {', '.join(wrong)}")
    wall: dict = {}
    times = bench({n: (lambda fn=fn: fwd_bwd(fn, p)) for n, fn in designs.items()}, reps=reps, warmup=0,
                  device=device, budget_s=budget_s, wall=wall)
    cond = run_conditions(len(times[limit]), min_rounds, device)
    rows = []
    for n in designs:
        s = summarize(times[n])
        ratio, ratio_iqr = paired_ratio(times[limit], times[n])
        row = {"design": n, **s, "tokens_per_s": p.T / s["median_s"], "gflops": p.flops() / s["median_s"] / 1e9,
               "ratio": ratio, "ratio_iqr": ratio_iqr, "ratios": [r / t for r, t in zip(times[limit], times[n])],
               "ratio_separate": paired_ratio(times["separate"], times[n])[0],
               "kept": outs[n].kept / (p.T * p.top_k), "rows": outs[n].rows / (p.T * p.top_k),
               "wait_share": quartiles([max(0.0, 1.0 - c / w) if w > 0 else 0.0
                                        for c, w in zip(times[n], wall[n])])[1],
               "conditions": cond, **equal.get(n, {})}
        if memory:
            p.zero_grad()  # free the previous design's gradients before the measurement starts
            row["peak_mb"] = peak_memory(lambda fn=designs[n]: fwd_bwd(fn, p), device) / 2 ** 20
        rows.append(row)
    return rows + failed


# ---- is the live run what the record says? ------------------------------------------------------
def compare_ratios(live: list, recorded: list, *, slack: float = 0.25, alpha: float = 0.05) -> dict:
    """Is a design's live paired ratio (per round, reference time / design time) consistent with the record's at
    the same size? A Welch test (:func:`labutils.stats.welch`) of the log ratios, live rounds against recorded
    rounds: the tolerance is the two runs' own spread. ``"slower"`` when the live design is behind the record
    at p < ``alpha`` AND by more than ``slack`` (a factor of 1 + slack: rounds on a shared machine shift
    between runs by more than their spread within a run, issue 32), ``"faster"`` likewise ahead, else
    ``"consistent"``. Returns ``{"call", "live", "recorded", "factor", "p", "comparison"}`` (factor:
    recorded / live median ratio, above 1 = slower now)."""
    from .. import stats

    a = [math.log(r) for r in live]
    b = [math.log(r) for r in recorded]
    cmp_ = stats.welch(a, b, names=("live", "record"), lower_is_better=False, alpha=alpha)
    factor = math.exp(-(cmp_.diff))
    call = "consistent"
    if cmp_.verdict == "behind" and factor > 1 + slack:
        call = "slower"
    elif cmp_.verdict == "ahead" and 1 / factor > 1 + slack:
        call = "faster"
    return {"call": call, "live": math.exp(cmp_.mean_a), "recorded": math.exp(cmp_.mean_b), "factor": factor,
            "p": cmp_.p, "comparison": cmp_}


def target_verdict(recordings: list, target: float, *, alpha: float = 0.05) -> dict:
    """``"met"`` / ``"NOT met"`` / ``"inconclusive"`` for "the paired ratio is at least ``target``", from
    several recordings of the same point (``recordings``: one list of per-round ratios per recording).

    Each recording is tested on its own (:func:`labutils.stats.welch` of its rounds against the target:
    a one-sample t-test); "met" only when at least two recordings exist and every one is ahead of the
    target, "NOT met" when every one is behind it; otherwise (one recording, a tie, or recordings that
    disagree) "inconclusive", with the reason."""
    from .. import stats

    recs = [list(r) for r in recordings if r]
    per = [stats.welch(r, [target] * len(r), names=("ratio", "target"), lower_is_better=False, alpha=alpha)
           for r in recs]
    calls = [c.verdict for c in per]
    if len(recs) < 2:
        return {"verdict": "inconclusive", "why": f"{len(recs)} recording(s); a verdict needs at least two",
                "calls": calls}
    if all(c == "ahead" for c in calls):
        return {"verdict": "met", "why": f"ahead of {target} in all {len(recs)} recordings", "calls": calls}
    if all(c == "behind" for c in calls):
        return {"verdict": "NOT met", "why": f"behind {target} in all {len(recs)} recordings", "calls": calls}
    return {"verdict": "inconclusive", "why": "the recordings disagree or tie: " + ", ".join(calls), "calls": calls}


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


def core_breakdown(p, reps: int = 3, core=None, check: bool = True) -> dict:
    """Profile the core's forward+backward on problem ``p`` into routing, dispatch, expert compute, combine.

    Returns ``{"forward": {phase: s}, "backward": {phase: s}, "total": {phase: s}, "profiled_s",
    "unprofiled_s", "runs", "profiler_overhead", "overhead_iqr", "unprofiled_iqr_pct", "reps", "conditions"}``:
    each phase's median over ``reps`` profiled steps ("other": autograd bookkeeping, reshapes, hooks), ``runs``
    each profiled step's phase totals (their spread is what :func:`compare_phases` tests against).

    Like is compared with like: each round times one plain step and then one profiled step with THE clock
    (:func:`~labutils.perf.timing.clock`), and ``profiler_overhead`` is the median over rounds of profiled /
    plain - 1 (``overhead_iqr`` its IQR); ``unprofiled_s`` is the plain steps' median. :func:`judge_overhead`
    says whether the shares describe the unprofiled layer. ``core``: a prebuilt core (e.g. a patched one);
    ``check``: first compare its output and gradients with the naive loop on ``p`` (AssertionError if not).
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    from ..nbtools import quiet
    from .dispatch import CoreMoE, build_designs, fwd_bwd
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
    res = {part: {k: quartiles([r[part][k] for r in runs])[1] for k in runs[0][part]}
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
