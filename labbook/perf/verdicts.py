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

**One rule for every speed verdict** (:func:`speed_call`), the one :mod:`labutils.stats` states: a Welch test, and a
side is called only when the 95% confidence interval clears the bar (:func:`labutils.stats.clears`). Runs on a
shared machine shift between them by more than their spread within a run (:data:`MARGIN`, issue 32), so a call
that rests on one run, or on recordings made in one sitting (:func:`separate_runs`), must clear the bar by that
margin as well; recordings from separate runs that agree need only the interval.
"""
from __future__ import annotations

import math

from .timing import quartiles

__all__ = ["round_ratios", "paired_speedup", "pooled_speedup", "noise_band", "classify", "find_row", "format_table",
           "compare_ratios", "target_verdict", "iqr_verdict", "MARGIN", "MIN_GAP_H", "speed_call", "separate_runs",
           "provenance"]

MARGIN = 0.25     # how far a paired ratio shifts between runs on a shared machine (issue 32): 25%
MIN_GAP_H = 1.0   # recordings less than an hour apart are one sitting, not separate runs


def speed_call(ratios, bar: float, *, margin: float = 0.0, alpha: float = 0.05) -> dict:
    """THE rule for a speed verdict: the per-round paired ratios (above 1: faster) against ``bar``.

    A Welch test of the rounds against the constant bar (:func:`labutils.stats.welch`, one-sample); the call is
    ``"ahead"`` when the 95% CI of the mean ratio clears ``bar * (1 + margin)`` (:func:`labutils.stats.clears`),
    ``"behind"`` when it lies wholly at or below ``bar / (1 + margin)``, else ``"inconclusive"`` (an untestable
    arm too). ``margin=0``: the test alone. Returns ``{"call", "mean", "ci", "p", "n", "margin", "bar"}``."""
    from labutils import stats

    r = [float(x) for x in ratios]
    c = stats.welch(r, [bar] * len(r), names=("ratio", "bar"), lower_is_better=False, alpha=alpha)
    ci = (bar + c.ci[0], bar + c.ci[1])
    call = "inconclusive"
    if all(math.isfinite(v) for v in ci):
        if stats.clears(ci, bar * (1 + margin)):
            call = "ahead"
        elif stats.clears(ci, bar / (1 + margin), higher_is_better=False):
            call = "behind"
    return {"call": call, "mean": c.mean_a, "ci": ci, "p": c.p, "n": len(r), "margin": margin, "bar": bar}


def separate_runs(provenance: list, min_gap_h: float = MIN_GAP_H) -> dict:
    """Are these recordings separate runs with every design interleaved? ``provenance``: one dict per recording,
    ``{"name", "date" (ISO), "load" (1-minute load), "cores", "interleaved" (bool, default True)}``.

    Returns ``{"ok", "why", "loads"}``: ``ok`` when there are at least two, each pair at least ``min_gap_h`` hours
    apart, each with its load and with every design interleaved in its rounds; ``why`` says what fails, generated
    from the metadata; ``loads`` is the line that states each one's date and load."""
    import datetime

    recs = sorted(provenance, key=lambda m: m["date"])
    when = [datetime.datetime.fromisoformat(m["date"]) for m in recs]
    loads = "; ".join(f"{m['name']}: {m['date']}, load " + ("unknown" if m.get("load") is None else f"{m['load']:.1f}")
                      + f" on {m.get('cores', '?')} cores" for m in recs)
    why = []
    if len(recs) < 2:
        why.append(f"{len(recs)} recording(s)")
    gaps = [(b - a).total_seconds() / 3600 for a, b in zip(when, when[1:])]
    if gaps and min(gaps) < min_gap_h:
        why.append(f"taken {60 * min(gaps):.0f} min apart (one sitting; separate runs are at least {min_gap_h:g} h "
                   "apart)")
    if any(m.get("load") is None for m in recs):
        why.append("a load not stated")
    if not all(m.get("interleaved", True) for m in recs):
        why.append("not every design interleaved in " + ", ".join(m["name"] for m in recs
                                                                 if not m.get("interleaved", True)))
    return {"ok": not why, "why": "; ".join(why) or "separate runs, every design interleaved", "loads": loads}


def provenance(name: str, record: dict) -> dict:
    """A benchmark record's entry for :func:`separate_runs`: its name, date, cores, and the higher of its 1-minute
    loads before and after (a dispatch record's ``machine`` and ``load_avg_1min_after``, a layer record's
    ``machine_before`` and ``machine_after``). Every design of these records is interleaved in each round."""
    before = record.get("machine_before") or record["machine"]
    after = (record["machine_after"]["load_avg_1min"] if "machine_after" in record
             else record.get("load_avg_1min_after", 0))
    return {"name": name, "date": before["date"], "cores": before["cores"], "load": max(before["load_avg_1min"], after)}


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
def compare_ratios(live: list, recorded: list, *, slack: float = MARGIN, alpha: float = 0.05) -> dict:
    """Is a design's live paired ratio (per round, reference time / design time) consistent with the record's at
    the same size? :func:`speed_call`'s rule on the log ratios: a Welch test (:func:`labutils.stats.welch`), live
    rounds against recorded rounds, and since one live run against one record is two runs, the 95% CI of the
    shift must clear ``slack`` (:data:`MARGIN`: rounds on a shared machine shift between runs by more than their
    spread within a run, issue 32): ``"slower"`` when the whole CI says the live design is behind the record by
    more than a factor 1 + slack, ``"faster"`` likewise ahead, else ``"consistent"``. Returns ``{"call", "live",
    "recorded", "factor", "p", "comparison"}`` (factor: recorded / live mean ratio, above 1 = slower now)."""
    from labutils import stats

    a = [math.log(r) for r in live]
    b = [math.log(r) for r in recorded]
    cmp_ = stats.welch(a, b, names=("live", "record"), lower_is_better=False, alpha=alpha)
    factor = math.exp(-(cmp_.diff))
    call = "consistent"
    lo, hi = cmp_.ci
    if math.isfinite(hi) and hi <= -math.log(1 + slack):
        call = "slower"
    elif math.isfinite(lo) and lo >= math.log(1 + slack):
        call = "faster"
    return {"call": call, "live": math.exp(cmp_.mean_a), "recorded": math.exp(cmp_.mean_b), "factor": factor,
            "p": cmp_.p, "comparison": cmp_}


def target_verdict(recordings: list, target: float, *, alpha: float = 0.05, margin: float = MARGIN,
                   provenance: list | None = None) -> dict:
    """``"met"`` / ``"NOT met"`` / ``"provisional"`` / ``"inconclusive"`` for "the paired ratio is at least
    ``target``", from several recordings of the same point (``recordings``: one list of per-round ratios each).

    Each recording is tested on its own by :func:`speed_call` (the interval alone). At least two recordings, all
    ahead: the lean is "met"; all behind: "NOT met"; otherwise (one recording, a tie, recordings that disagree)
    "inconclusive". ``provenance`` (one dict per recording, see :func:`separate_runs`): where the recordings are not
    separate runs with every design interleaved, the lean stands only if every recording also clears the target by
    ``margin``; else the verdict is ``"provisional"``, with the lean and the reason, generated from the metadata.
    Without ``provenance`` the caller vouches that the recordings are separate runs. Returns ``{"verdict", "why",
    "calls", "lean"}``."""
    recs = [list(r) for r in recordings if r]
    calls = [speed_call(r, target, alpha=alpha)["call"] for r in recs]
    if len(recs) < 2:
        return {"verdict": "inconclusive", "why": f"{len(recs)} recording(s); a verdict needs at least two",
                "calls": calls, "lean": None}
    side = "ahead" if all(c == "ahead" for c in calls) else "behind" if all(c == "behind" for c in calls) else None
    if side is None:
        return {"verdict": "inconclusive", "why": "the recordings disagree or tie: " + ", ".join(calls),
                "calls": calls, "lean": None}
    lean = "met" if side == "ahead" else "NOT met"
    said = f"{'ahead of' if side == 'ahead' else 'behind'} {target} in all {len(recs)} recordings"
    runs = None if provenance is None else separate_runs(provenance)
    if runs is None or runs["ok"]:
        return {"verdict": lean, "why": said, "calls": calls, "lean": lean}
    wide = [speed_call(r, target, margin=margin, alpha=alpha)["call"] for r in recs]
    if all(w == side for w in wide):
        return {"verdict": lean, "why": f"{said}, by more than the {margin:.0%} margin (although {runs['why']})",
                "calls": calls, "lean": lean}
    return {"verdict": "provisional", "why": f"{said}, but within the {margin:.0%} margin runs shift by, "
            f"and {runs['why']}: a call needs separate runs", "calls": calls, "lean": lean}


def iqr_verdict(q1: float, q3: float, target: float) -> str:
    """A paired ratio's quartiles against an upper ``target``: ``"met"`` when the whole IQR is at or below it,
    ``"NOT met"`` when the whole IQR is above it, ``"inconclusive"`` when the target lies inside the IQR."""
    if not q1 <= q3:
        raise ValueError(f"iqr_verdict needs q1 <= q3, got q1={q1!r}, q3={q3!r}")
    return "met" if q3 <= target else "NOT met" if q1 > target else "inconclusive"
