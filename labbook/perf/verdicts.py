"""Verdicts from timed rounds: is a row ahead, tied or behind, is a live run what the record says, is a target met.
(Taught in chapter 08.)

Every ratio here is paired: taken within one round (both rows timed back to back), then summarised over rounds
by its median and IQR, so a drift of the machine between rounds hits both sides of each ratio alike.

* The layer speed table (:mod:`labbook.perf.layer_bench`): :func:`round_ratios`, :func:`paired_speedup`,
  :func:`pooled_speedup` (rounds of several runs), :func:`noise_band` and :func:`classify` (ahead / tie /
  behind against the run's own repeat spread), :func:`find_row` and :func:`format_table`.
* A live run against its record (:func:`compare_ratios`, a Welch test of the rounds' log ratios) and a target
  over several recordings (:func:`target_verdict`), as chapter 08 states them; one recording's paired quartiles
  against an upper target (:func:`iqr_verdict`).
"""
from __future__ import annotations

import math

from .timing import quartiles

__all__ = ["round_ratios", "paired_speedup", "pooled_speedup", "noise_band", "classify", "find_row", "format_table",
           "compare_ratios", "target_verdict", "iqr_verdict"]


# ---- the layer speed table ------------------------------------------------------------------------------------
def round_ratios(a: dict, b: dict) -> list:
    """Per round, a's kept tokens/s over b's (rows ``a`` and ``b`` of one run): above 1, ``a`` is faster."""
    return [(a["share"] / ta) / (b["share"] / tb) for ta, tb in zip(a["times_ms"], b["times_ms"])]


def paired_speedup(a: dict, b: dict) -> tuple:
    """Median and IQR over rounds of (a's kept tokens/s / b's kept tokens/s): above 1, ``a`` is faster."""
    q1, med, q3 = quartiles(round_ratios(a, b))
    return med, (q1, q3)


def pooled_speedup(results: list, a: str, b: str) -> tuple:
    """Paired speed-up of row ``a`` over row ``b`` (prefixes) with the rounds of several runs of ONE shape
    pooled: ``(median, (q1, q3), rounds)``. Each round's ratio is still taken within its own round."""
    ratios = []
    for result in results:
        ratios += round_ratios(find_row(result, a), find_row(result, b))
    if not ratios:
        raise ValueError("pooled_speedup needs at least one run with timed rounds")
    q1, med, q3 = quartiles(ratios)
    return med, (q1, q3), len(ratios)


def noise_band(spread: dict) -> float:
    """How far from 1.0 a paired ratio can land by chance in this run: the larger of the repeat row's
    distance from 1 (``ours / ours again`` should be exactly 1) and half its IQR. ``spread``: a verdict
    entry ``{"paired_median", "iqr"}`` of the same layer timed twice."""
    lo, hi = spread["iqr"]
    return max(abs(spread["paired_median"] - 1.0), (hi - lo) / 2)


def classify(ratio: float, band: float, target: float = 1.0) -> str:
    """``"ahead"``, ``"tie"`` or ``"behind"``: a paired ratio against ``target`` with the run's noise band.
    A target met by less than the band is a tie, and so is one missed by less than it."""
    if ratio > target + band:
        return "ahead"
    if ratio < target - band:
        return "behind"
    return "tie"


def find_row(result: dict, prefix: str) -> dict:
    return next(r for r in result["rows"] if r["row"].startswith(prefix))


def format_table(result: dict) -> str:
    s = result["shape"]
    head = (f"T={s['T']} d={s['d']} h={s['h']} E={s['E']} top_k={s['top_k']}, fwd+bwd fp32, "
            f"{result['repeats']} interleaved rounds, {result.get('threads', '?')} thread(s), "
            f"{result.get('clock', 'wall clock')} (timings are not reproducible)")
    cols = (f"{'row':<26} {'median ms':>10} {'IQR':>6} {'share':>6} {'kept tok/s':>11} {'faults MB':>9} "
            f"{'vs dense (paired median, IQR)':>30}")
    lines = [head, cols]
    for r in result["rows"]:
        lo, hi = r["ratio_paired_iqr"]
        faults = r.get("faults_mb_per_step")
        faults = f"{faults:>9.0f}" if faults is not None else f"{'-':>9}"
        lines.append(f"{r['row']:<26} {r['median_ms']:>10.1f} {r['iqr_pct']:>5.0f}% {r['share']:>6.3f} "
                     f"{r['kept_tokens_per_s']:>11.0f} {faults} {r['ratio_paired_median']:>12.3f} [{lo:.3f}, {hi:.3f}]")
    return "\n".join(lines)


# ---- is the live run what the record says? ------------------------------------------------------
def compare_ratios(live: list, recorded: list, *, slack: float = 0.25, alpha: float = 0.05) -> dict:
    """Is a design's live paired ratio (per round, reference time / design time) consistent with the record's at
    the same size? A Welch test (:func:`labutils.stats.welch`) of the log ratios, live rounds against recorded
    rounds: the tolerance is the two runs' own spread. ``"slower"`` when the live design is behind the record
    at p < ``alpha`` AND by more than ``slack`` (a factor of 1 + slack: rounds on a shared machine shift
    between runs by more than their spread within a run, issue 32), ``"faster"`` likewise ahead, else
    ``"consistent"``. Returns ``{"call", "live", "recorded", "factor", "p", "comparison"}`` (factor:
    recorded / live median ratio, above 1 = slower now)."""
    from labutils import stats

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
    from labutils import stats

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


def iqr_verdict(q1: float, q3: float, target: float) -> str:
    """A paired ratio's quartiles against an upper ``target``: ``"met"`` when the whole IQR is at or below it,
    ``"NOT met"`` when the whole IQR is above it, ``"inconclusive"`` when the target lies inside the IQR."""
    if not q1 <= q3:
        raise ValueError(f"iqr_verdict needs q1 <= q3, got q1={q1!r}, q3={q3!r}")
    return "met" if q3 <= target else "NOT met" if q1 > target else "inconclusive"
