"""Chapter 05's study, the record reduced to verdicts: mean curves over seeds (:func:`curves`), every verdict a
test from :mod:`labutils.stats` (:func:`summarize`, :func:`ablation_comparisons`), Holm-adjusted over every test on
the record, the speed-up's target judged by a t-interval (:func:`target_verdict`), the summary sentences written
*from those numbers* (:func:`verdict_lines`, :func:`ablation_lines`). (Taught in chapter 05.)
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import torch

from labbook.lm_study.config import MAIN
from labbook.study import versus
from labutils import stats


@dataclass
class Curve:
    """One model over its seeds: mean and standard deviation of the validation loss at each evaluation."""
    steps: list
    mean: list
    std: list
    finals: list              # final validation loss per seed
    flops: list = field(default_factory=list)   # training FLOPs at each evaluation
    seconds: list = field(default_factory=list)  # mean training seconds at each evaluation

    @property
    def final(self) -> float:
        return statistics.fmean(self.finals)

    @property
    def final_std(self) -> float:
        return statistics.stdev(self.finals) if len(self.finals) > 1 else float("nan")


def curves(record: dict) -> dict:
    """``{model: Curve}`` over the seeds each model ran."""
    out = {}
    for name in dict.fromkeys(r["name"] for r in record["runs"]):
        runs = [r for r in record["runs"] if r["name"] == name]
        vals = torch.tensor([r["val"] for r in runs], dtype=torch.float64)  # (seeds, evaluations)
        std = vals.std(0) if len(runs) > 1 else torch.full_like(vals[0], float("nan"))
        steps = runs[0]["val_steps"]
        out[name] = Curve(steps, vals.mean(0).tolist(), std.tolist(), vals[:, -1].tolist(),
                          [s * runs[0]["flops_per_step"] for s in steps],
                          torch.tensor([r["train_seconds"] for r in runs]).mean(0).tolist())
    return out


def steps_to_reach(steps: list, losses: list, target: float) -> float | None:
    """First step at which the curve reaches ``target`` (linear between evaluations), or None if it never does."""
    prev_s, prev_v = 0, math.inf
    for s, v in zip(steps, losses):
        if v <= target:
            if not math.isfinite(prev_v):
                return float(s)
            return prev_s + (s - prev_s) * (prev_v - target) / (prev_v - v)
        prev_s, prev_v = s, v
    return None


def _runs(record: dict, name: str) -> list:
    return [r for r in record["runs"] if r["name"] == name]


def _finals(record: dict, name: str) -> list:
    return [r["val"][-1] for r in _runs(record, name)]


def seed_bootstrap(a_runs: list, b_runs: list, fn, *, n_boot: int = 2000, seed: int = 0) -> dict:
    """``fn(a, b)`` over every (a, b) pair of runs (``stats.all_pairs``), its mean, its 95% t-interval ``t_ci``
    (``stats.t_interval`` with ``t_n`` = the smaller arm's seeds: the pairs share seeds, so they are not
    independent values; the verdict on a target comes from this interval, :func:`target_verdict`), and a 95%
    bootstrap interval ``ci`` that resamples the seeds of **each arm** independently (shown for comparison: with
    3 seeds per arm a percentile bootstrap cannot reach beyond the observed pairs). ``reached``: pairs where
    ``fn`` is not None, of ``pairs``."""
    values = stats.all_pairs(a_runs, b_runs, fn)
    out = {"values": values, "pairs": len(a_runs) * len(b_runs), "reached": len(values),
           "seeds": (len(a_runs), len(b_runs)),
           "mean": statistics.fmean(values) if values else None, "ci": None, "t_ci": None, "t_n": None}
    if len(values) == out["pairs"] and len(a_runs) > 1 and len(b_runs) > 1:
        # the pairs share seeds: count the smaller arm's seeds as the independent values (stats.t_interval)
        out["t_n"] = min(len(a_runs), len(b_runs))
        out["t_ci"] = stats.t_interval(values, n=out["t_n"])
        import random
        rng = random.Random(seed + 1)

        def mean_over_pairs(a_sample):
            b_sample = [rng.choice(b_runs) for _ in b_runs]
            return statistics.fmean(stats.all_pairs(a_sample, b_sample, fn))

        out["ci"] = stats.bootstrap_ci(a_runs, mean_over_pairs, n_boot=n_boot, seed=seed)
    return out


def _steps_ratio(dense_run: dict, moe_run: dict) -> float | None:
    reach = steps_to_reach(moe_run["val_steps"], moe_run["val"], dense_run["val"][-1])
    return dense_run["val_steps"][-1] / reach if reach else None


def _time_ratio(dense_run: dict, moe_run: dict) -> float | None:
    reach = steps_to_reach(moe_run["train_seconds"], moe_run["val"], dense_run["val"][-1])
    return dense_run["train_seconds"][-1] / reach if reach else None


def summarize(record: dict, target_speedup: float = 1.3) -> dict:
    """The verdicts, each a test from :mod:`labutils.stats` on the record's final validation losses (Welch: the
    seeds of two models are independent runs): MoE vs dense, MoE vs dense-wide, dense-wide vs dense (the regime
    check), E=k=2 vs dense when the record has it, the same at equal CPU time, and every ablation against MoE
    (``ablations``). Every test on the record is one family: its p-values are Holm-adjusted together
    (``stats.holm``; ``family``: how many). The steps speed-up over all seed pairs has a t-interval
    (:func:`seed_bootstrap`), judged against ``target_speedup`` by :func:`target_verdict`."""
    c = curves(record)
    missing = [name for name in MAIN if name not in c]
    if missing:
        raise ValueError(f"the record has no run of {missing}: summarize compares {list(MAIN)}")
    f = {n: _finals(record, n) for n in MAIN}
    dense_runs, moe_runs = _runs(record, "dense"), _runs(record, "MoE")
    # equal CPU time: every dense and MoE run at the shortest of their training times, each interpolated
    t_eq = min(r["train_seconds"][-1] for r in dense_runs + moe_runs)
    at_t = {n: [loss_at(r["train_seconds"], r["val"], t_eq) for r in _runs(record, n)] for n in ("dense", "MoE")}
    unreached = sum(v is None for vals in at_t.values() for v in vals)
    eq = (stats.welch([v for v in at_t["MoE"] if v is not None], [v for v in at_t["dense"] if v is not None],
                      names=("MoE", "dense")) if not unreached else None)
    flops = {n: _runs(record, n)[0]["flops_per_step"] for n in MAIN}
    tests = {"moe_vs_dense": stats.welch(f["MoE"], f["dense"], names=("MoE", "dense")),
             "moe_vs_wide": stats.welch(f["MoE"], f["dense-wide"], names=("MoE", "dense-wide")),
             "wide_vs_dense": stats.welch(f["dense-wide"], f["dense"], names=("dense-wide", "dense"))}
    if "E=k=2" in c:   # the gated dense model (MoE's FLOPs, dense's parameters) against dense itself
        tests["gated_vs_dense"] = stats.welch(_finals(record, "E=k=2"), f["dense"], names=("E=k=2", "dense"))
    if eq is not None:
        tests["equal_time"] = eq
    tests.update({("ablation", n): cmp for n, cmp in ablation_comparisons(record).items()})
    tests = stats.holm(tests)   # every test on this record is one family
    family = max(cmp.family for cmp in tests.values())
    return {
        "preset": record["config"]["name"],
        "final": {name: (cv.final, cv.final_std, len(cv.finals)) for name, cv in c.items()},
        "seeds": {n: len(v) for n, v in f.items()},
        "moe_vs_dense": tests["moe_vs_dense"], "moe_vs_wide": tests["moe_vs_wide"],
        "wide_vs_dense": tests["wide_vs_dense"], "gated_vs_dense": tests.get("gated_vs_dense"),
        "ablations": {k[1]: cmp for k, cmp in tests.items() if isinstance(k, tuple)}, "family": family,
        "flops_ratio": {n: flops[n] / flops["dense"] for n in MAIN},
        "speedup": seed_bootstrap(dense_runs, moe_runs, _steps_ratio), "target_speedup": target_speedup,
        "equal_time": {"seconds": t_eq, "comparison": tests.get("equal_time"), "unreached": unreached,
                       "time_ratio": seed_bootstrap(dense_runs, moe_runs, _time_ratio),
                       "train_seconds": {n: c[n].seconds[-1] for n in MAIN},
                       "jobs": record.get("jobs", 1), "threads": record["config"].get("threads", 1),
                       "clock": dense_runs[0].get("clock", "perf_counter")},
    }


def target_verdict(boot: dict, target: float) -> str:
    """"met" / "NOT met" / "inconclusive" for a speed-up target, from the t-interval (``stats.target_verdict``):
    inconclusive as well when a pair never reached the loss or an arm has fewer than 3 seeds (the rule of
    ``stats``' verdicts), since then there is no interval to judge by."""
    if boot["t_ci"] is None or boot["reached"] != boot["pairs"] or min(boot["seeds"]) < 3:
        return "inconclusive"
    return stats.target_verdict(boot["t_ci"], target)


def target_met(boot: dict, target: float) -> bool:
    """"Target met" only when every seed pair reached the loss, each arm has 3 seeds or more and the t-interval's
    lower bound clears ``target`` (:func:`target_verdict`)."""
    return target_verdict(boot, target) == "met"


WHY_TARGET = {"met": "met (the interval's lower bound clears it)",
              "NOT met": "NOT met (the whole interval lies below it)",
              "inconclusive": "inconclusive (the interval straddles it)"}


def _ratio_sentence(what: str, boot: dict, target: float | None) -> str:
    if not boot["values"]:
        return f"{what}: no MoE seed reached dense's final loss"
    line = (f"{what}: {boot['mean']:.2f}× on average over {boot['reached']} of {boot['pairs']} (dense seed, MoE "
            f"seed) pairs that reached it (pairs range {min(boot['values']):.2f}–{max(boot['values']):.2f}")
    line += (f"; 95% t-interval [{boot['t_ci'][0]:.2f}, {boot['t_ci'][1]:.2f}], counting {boot['t_n']} independent "
             f"values since the pairs share seeds)" if boot["t_ci"] is not None
             else "; no interval: every pair must reach it, with 2 seeds or more per arm)")
    if target is not None:
        verdict = target_verdict(boot, target)
        few = boot["t_ci"] is None or min(boot["seeds"]) < 3
        line += f"; target ≥ {target}: " + ("inconclusive (an interval needs every pair reaching and 3 seeds or "
                                             "more per arm)" if few and verdict == "inconclusive"
                                             else WHY_TARGET[verdict])
    return line


def verdict_lines(summary: dict, target_speedup: float | None = None) -> list:
    """The chapter's verdicts, written from the numbers (never in advance), naming the preset."""
    s, preset = summary, summary["preset"]
    target = s["target_speedup"] if target_speedup is None else target_speedup
    lines = [f"{name:<16} final validation loss {m:.4f} " + (f"± {sd:.4f} (seed std, {n} seeds)" if n > 1
                                                             else "(one seed)")
             for name, (m, sd, n) in s["final"].items()]
    w = s["wide_vs_dense"]
    lines.append("regime check: " + w.sentence("nats", preset) + ": " + (
        "extra parameters help here (capacity-limited), so MoE's extra parameters can show"
        if w.verdict == "ahead" else "NOT shown that extra parameters help here, so MoE cannot be expected to"))
    lines.append(s["moe_vs_dense"].sentence("nats", preset))
    mw = s["moe_vs_wide"]
    gain_wide = s["final"]["dense"][0] - s["final"]["dense-wide"][0]
    share = (s["final"]["dense"][0] - s["final"]["MoE"][0]) / gain_wide if gain_wide > 0 else None
    cost = s["flops_ratio"]["MoE"] / s["flops_ratio"]["dense-wide"]
    lines.append(mw.sentence("nats", preset) + (
        f"; MoE has {share:.0%} of dense-wide's gain over dense at {cost:.0%} of its FLOPs per step"
        if share is not None else ""))
    if s.get("gated_vs_dense") is not None:
        lines.append(s["gated_vs_dense"].sentence("nats", preset) + ": the gated dense model (MoE's FLOPs, dense's "
                                                                       "parameters) against dense")
    lines.append(_ratio_sentence("steps for dense / steps for MoE to reach dense's final loss", s["speedup"], target))
    e = s["equal_time"]
    what = "CPU seconds of each process" if e.get("clock") == "process_time" else "wall-clock seconds"
    how = (f"{e['jobs']} run(s) side by side, {e['threads']} thread each; training clocks count {what} and "
           f"exclude evaluations")
    if e["comparison"] is None:
        lines.append(f"at equal CPU time ({e['seconds']:.0f} s of training): {e['unreached']} run(s) had no "
                     f"evaluation by then: no verdict ({how})")
    else:
        lines.append(f"at equal CPU time ({e['seconds']:.0f} s of training, the shortest run's; {how}): "
                     + e["comparison"].sentence("nats", preset))
    lines.append(_ratio_sentence("training seconds for dense / for MoE to reach dense's final loss",
                                 e["time_ratio"], None))
    if s.get("family", 1) > 1:
        lines.append(f"multiple comparisons: the {s['family']} tests on this record are one family; every p above "
                     "is Holm-adjusted over it and every verdict comes from the adjusted p (confidence intervals "
                     "are the unadjusted 95% ones)")
    return lines


def loss_at(xs: list, ys: list, x: float) -> float | None:
    """The curve's value at ``x`` (linear between points), None before its first point."""
    if x < xs[0]:
        return None
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1] if x == xs[-1] else None


def ablation_comparisons(record: dict) -> dict:
    """``{ablation: stats.welch(its final losses, MoE's)}`` over all seeds of each (fewer than 3: inconclusive),
    unadjusted: :func:`summarize` adjusts them with the record's other tests, :func:`ablation_lines` says which."""
    ablations = [name for name in dict.fromkeys(r["name"] for r in record["runs"]) if name not in MAIN]
    return versus({name: _finals(record, name) for name in ablations}, "MoE", _finals(record, "MoE"))


def ablation_lines(record_or_summary: dict) -> list:
    """Each ablation against the MoE mean by Welch's test, as generated sentences naming the preset. Given a
    :func:`summarize` result: its ablations, Holm-adjusted over every test on the record; given a record: the
    ablations Holm-adjusted among themselves."""
    if "ablations" in record_or_summary:
        comps, preset = record_or_summary["ablations"], record_or_summary["preset"]
    else:
        comps, preset = stats.holm(ablation_comparisons(record_or_summary)), record_or_summary["config"]["name"]
    return [c.sentence("nats", preset) for c in comps.values()]
