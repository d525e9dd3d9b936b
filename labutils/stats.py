"""THE verdict over seeds: one routine for every comparison the book makes between runs. (Taught in chapter 05;
used by chapters 05, 08 and 09 and the benchmarks.)

A verdict is a test, never "the gap is bigger than twice the std":

* :func:`welch` (independent seeds, unequal variances) and :func:`paired` (seeds paired: same data order, same
  initial weights) give the difference of means, its 95% confidence interval, t, the degrees of freedom and the
  two-sided p-value;
* the verdict is "ahead", "behind" (A relative to B, in the direction that is better) or "inconclusive": p >= alpha,
  or fewer than ``min_n`` (3) values in an arm, whatever the means say;
* :func:`holm` corrects a family of comparisons for multiplicity (Holm's step-down method): every test the book
  makes on one record is one family, and a verdict stands only if its adjusted p is below alpha;
* :func:`t_interval` gives a Student-t interval of a mean (with an effective sample size when the values share
  seeds, e.g. "steps for dense / steps for MoE" over all seed pairs, :func:`all_pairs`); :func:`bootstrap_ci` a
  percentile bootstrap interval of any statistic; :func:`clears` says whether an interval clears a target ("target
  met" means its lower bound does) and :func:`target_verdict` says "met", "NOT met" or "inconclusive" (the interval
  straddles the target).

Refused, each with a message naming the argument, the value and what is accepted: a dict where values are
expected (``{seed: loss}`` would be read as its keys, the seeds: pass ``list(d.values())``), NaN or infinite
values, and a t-test whose spread is zero (every value of both arms the same up to rounding, or every paired
difference the same) when the means differ: a t-test cannot tell a real difference from one measured with no
noise (see :func:`welch`); a (high, low) interval given to :func:`clears`, and one Comparison alone given to
:func:`holm`. Deliberately accepted: a t-interval of values without spread is the point ``(v, v)``
(:func:`t_interval` says why).

Student's t distribution is computed here in plain Python (the regularised incomplete beta function by its continued
fraction), so the book needs no scipy; ``tests/test_stats.py`` checks it against scipy's values.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import overload

from ._stats_input import _finite, _finite_number, _is_number, _mean_sd, _not_a_dict, _preview, _real, _values  # noqa: F401
from ._stats_intervals import all_pairs, bootstrap_ci, clears, t_interval, target_verdict  # noqa: F401
from ._student_t import t_cdf, t_ppf

VERDICTS = ("ahead", "behind", "inconclusive")


# --- comparisons ------------------------------------------------------------------------------------------------

def _no_spread(xs: list) -> bool:
    """Every value the same up to float rounding (a few ulps of the largest magnitude)."""
    return max(xs) - min(xs) <= 16 * sys.float_info.epsilon * max(abs(x) for x in xs)


@dataclass(frozen=True)
class Comparison:
    """A compared with B: ``diff = mean_a - mean_b`` with its ``1 - alpha`` interval (95% by default), the test and
    the verdict."""
    names: tuple
    n_a: int
    n_b: int
    mean_a: float
    mean_b: float
    sd_a: float
    sd_b: float
    diff: float
    ci: tuple
    t: float
    df: float
    p: float
    test: str
    verdict: str
    lower_is_better: bool
    alpha: float
    min_n: int = 3
    family: int = 1           # tests in the family ``p`` is adjusted over (:func:`holm`); 1: unadjusted
    p_raw: float = float("nan")  # the unadjusted p when ``family`` > 1

    def relation(self) -> str:
        """The verdict as a phrase about the second arm: "ahead of dense", "behind dense" or "inconclusive against
        dense" (for a sentence such as "at equal CPU time MoE is ..." that must read right whatever the verdict)."""
        b = self.names[1]
        return {"ahead": f"ahead of {b}", "behind": f"behind {b}", "inconclusive": f"inconclusive against {b}"}[
            self.verdict]

    def sentence(self, unit: str = "", preset: str | None = None, digits: int = 3) -> str:
        """The verdict as a sentence generated from the numbers, e.g. "MoE is ahead of dense: 1.397 vs 1.479 nats
        (difference -0.082, 95% CI [-0.117, -0.047], Welch t = -7.0, p = 0.004; 3 vs 3 seeds; preset full)"."""
        a, b = self.names
        u = f" {unit}" if unit else ""
        f = f"{{:.{digits}f}}"
        verb = f"vs {b}: inconclusive" if self.verdict == "inconclusive" else f"is {self.relation()}"
        why = ""
        holm = "Holm " if self.family > 1 else ""
        if self.verdict == "inconclusive":
            why = (f" (fewer than {self.min_n} seeds in an arm)" if min(self.n_a, self.n_b) < self.min_n
                   else f" ({holm}p = {self.p:.3g} >= {self.alpha})")
        p_text = (f"p = {self.p:.3g} (Holm over {self.family} tests; unadjusted {self.p_raw:.3g})"
                  if self.family > 1 else f"p = {self.p:.3g}")
        level = f"{100 * (1 - self.alpha):.10g}% CI"                     # 95% for alpha = 0.05
        ci_text = f"{level} (unadjusted)" if self.family > 1 else level
        tested = "" if math.isnan(self.p) else (f", {ci_text} [{f.format(self.ci[0])}, {f.format(self.ci[1])}], "
                                                 f"{self.test} t = {self.t:.2f}, {p_text}")
        stats = (f"{f.format(self.mean_a)} vs {f.format(self.mean_b)}{u} (difference {f.format(self.diff)}{tested}; "
                 f"{self.n_a} vs {self.n_b} seeds" + (f"; preset {preset}" if preset else "") + ")")
        return f"{a} {verb}{why}: {stats}"


def _verdict(diff: float, p: float, n_a: int, n_b: int, lower_is_better: bool, alpha: float, min_n: int) -> str:
    if min(n_a, n_b) < min_n or not p < alpha or diff == 0:
        return "inconclusive"
    better = diff < 0 if lower_is_better else diff > 0
    return "ahead" if better else "behind"


def _check_common(where: str, alpha: float, min_n: int, names) -> None:
    if not (_real(alpha) and 0.0 < float(alpha) < 1.0):
        raise ValueError(f"{where}: alpha must be a number in (0, 1), e.g. 0.05, got {alpha!r}")
    if not (isinstance(min_n, int) and not isinstance(min_n, bool) and min_n >= 2):
        raise ValueError(f"{where}: min_n must be an int >= 2 (a t-test needs two values per arm), got {min_n!r}")
    if isinstance(names, (str, bytes, Mapping)) or not (isinstance(names, (tuple, list)) and len(names) == 2):
        raise ValueError(f"{where}: names must be a pair (the name of a, the name of b), e.g. ('MoE', 'dense'), got "
                         f"{names!r}")


def _result(names, a: list, b: list, diff: float, se: float, df: float, test: str, lower_is_better: bool,
            alpha: float, min_n: int) -> Comparison:
    """Fill a Comparison from the difference, its standard error and the degrees of freedom."""
    (ma, sa), (mb, sb) = _mean_sd(a), _mean_sd(b)
    if math.isnan(se):  # an arm with fewer than two values: nothing to test
        t = p = lo = hi = float("nan")
    else:  # se > 0: zero spread never gets here (welch and paired decide it first, see their docstrings)
        t = diff / se
        p = 2.0 * t_cdf(-abs(t), df)
        half = t_ppf(1.0 - alpha / 2.0, df) * se
        lo, hi = diff - half, diff + half
    verdict = "inconclusive" if math.isnan(p) else _verdict(diff, p, len(a), len(b), lower_is_better, alpha, min_n)
    return Comparison(tuple(names), len(a), len(b), ma, mb, sa, sb, diff, (lo, hi), t, df, p, test, verdict,
                      lower_is_better, alpha, min_n)


def _zero_spread(where: str, in_what: str, what: str, equal: bool, accepted: str) -> bool:
    """Zero spread: True (no difference, nothing to test: inconclusive with p = 1) when ``equal``, else the error."""
    if equal:
        return True
    raise ValueError(f"{where}: zero spread {in_what}: {what}; a t-test cannot tell whether that difference is "
                     f"real (it would read the zero spread as certainty, p = 0). Accepted: {accepted}; or compare "
                     "the constant values directly")


def _no_test(names, a: list, b: list, diff: float, df: float, test: str, lower_is_better: bool, alpha: float,
             min_n: int) -> Comparison:
    """Identical arms (zero spread, no difference): t = 0, p = 1, the CI the point 0, inconclusive."""
    (ma, sa), (mb, sb) = _mean_sd(a), _mean_sd(b)
    return Comparison(tuple(names), len(a), len(b), ma, mb, sa, sb, diff, (diff, diff), 0.0, df, 1.0, test,
                      "inconclusive", lower_is_better, alpha, min_n)


def welch(a, b, *, names=("A", "B"), lower_is_better: bool = True, alpha: float = 0.05, min_n: int = 3) -> Comparison:
    """Welch's t-test of mean(a) vs mean(b) (independent samples, unequal variances), the ``1 - alpha`` CI of the
    difference (95% by default; the sentence names its level).
    An arm with fewer than two values cannot be tested: the verdict is inconclusive and p is nan.

    Zero spread in BOTH arms (every value of each arm the same, up to float rounding): with equal means the
    verdict is "inconclusive" with t = 0 and p = 1 (nothing differs); with different means a ValueError
    "zero spread in both arms": a t-test cannot tell (it would say p = 0, or 1e-28 from rounding noise). One
    arm without spread is fine (e.g. a constant target: a one-sample test).

    Refuses (before computing anything), naming the argument and the value: a dict for ``a`` or ``b`` (pass
    ``list(d.values())``), values that are not numbers, NaN or +-inf, the zero spread above, ``alpha`` outside
    (0, 1), ``min_n`` < 2 and ``names`` that is not a pair."""
    _check_common("welch", alpha, min_n, names)
    a, b = _values("welch", f"a ({names[0]})", a), _values("welch", f"b ({names[1]})", b)
    (ma, sa), (mb, sb) = _mean_sd(a), _mean_sd(b)
    if len(a) < 2 or len(b) < 2:
        return _result(names, a, b, ma - mb, float("nan"), float("nan"), "Welch", lower_is_better, alpha, min_n)
    if _no_spread(a) and _no_spread(b):
        what = f"every value of a ({names[0]}) is {a[0]!r} and every value of b ({names[1]}) is {b[0]!r}"
        _zero_spread("welch", "in both arms", what, _no_spread(a + b), "runs whose values vary in at least one arm")
        return _no_test(names, a, b, ma - mb, float("inf"), "Welch", lower_is_better, alpha, min_n)
    # the two standard errors over the larger one, so that neither squares to 0 for tiny spreads (1e-170)
    ea, eb = sa / math.sqrt(len(a)), sb / math.sqrt(len(b))
    scale = max(ea, eb)                                                  # > 0: not both arms without spread
    va, vb = (ea / scale) ** 2, (eb / scale) ** 2                        # in [0, 1], one of them 1
    df = (va + vb) ** 2 / (va * va / (len(a) - 1) + vb * vb / (len(b) - 1))   # Welch-Satterthwaite
    return _result(names, a, b, ma - mb, scale * math.sqrt(va + vb), df, "Welch", lower_is_better, alpha, min_n)


def paired(a, b, *, names=("A", "B"), lower_is_better: bool = True, alpha: float = 0.05,
           min_n: int = 3) -> Comparison:
    """Paired t-test: a[i] and b[i] come from the same seed. CI of the mean difference.

    Zero spread of the differences (every ``a[i] - b[i]`` the same, up to float rounding; both arms constant is
    one case): all differences 0 gives "inconclusive" with t = 0 and p = 1; the same nonzero difference for every
    pair is a ValueError (a t-test cannot tell: it would say p = 0).

    Refuses (before computing anything), naming the argument and the value: a dict for ``a`` or ``b`` (pass
    ``list(d.values())``), values that are not numbers, NaN or +-inf, arms of different lengths, the zero
    spread above, ``alpha`` outside (0, 1), ``min_n`` < 2 and ``names`` that is not a pair."""
    _check_common("paired", alpha, min_n, names)
    a, b = _values("paired", f"a ({names[0]})", a), _values("paired", f"b ({names[1]})", b)
    if len(a) != len(b):
        raise ValueError(f"paired: {names[0]} has {len(a)} values and {names[1]} {len(b)}; pairs need equal lengths")
    diffs = [x - y for x, y in zip(a, b)]
    tol = 16 * sys.float_info.epsilon * max([abs(x) for x in a + b] or [0.0])   # float rounding of a difference
    if len(a) > 1 and max(diffs) - min(diffs) <= tol:
        what = f"every difference a[i] - b[i] ({names[0]} - {names[1]}) is {diffs[0]!r}"
        _zero_spread("paired", "of the differences", what, all(abs(d) <= tol for d in diffs),
                     "pairs whose differences vary")
        return _no_test(names, a, b, sum(diffs) / len(diffs), len(a) - 1, "paired", lower_is_better, alpha, min_n)
    md, sd = _mean_sd(diffs)
    if len(a) < 2:  # one pair (df 0) or none (df nan, not -1): nothing to test
        return _result(names, a, b, md, float("nan"), float(len(a) - 1) if a else float("nan"), "paired",
                       lower_is_better, alpha, min_n)
    return _result(names, a, b, md, sd / math.sqrt(len(a)), len(a) - 1, "paired", lower_is_better, alpha, min_n)


# --- a family of tests ------------------------------------------------------------------------------------------

def holm_adjust(pvalues) -> list:
    """Holm's step-down adjusted p-values, in the order given: sort the m p-values ascending, multiply the i-th
    smallest (i = 1..m) by m - i + 1, carry the running maximum (an adjusted p never falls below an earlier one) and
    cap at 1. Rejecting where the adjusted p < alpha controls the family-wise error rate at alpha (Holm 1979).
    Refuses a dict, NaN, and values outside [0, 1]."""
    ps = _values("holm_adjust", "pvalues", pvalues)
    bad = [x for x in ps if not 0.0 <= x <= 1.0]
    if bad:
        raise ValueError(f"holm_adjust: p-values must lie in [0, 1], got {bad} in {_preview(ps)}")
    m = len(ps)
    order = sorted(range(m), key=lambda i: ps[i])
    out, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * ps[i]))
        out[i] = running
    return out


@overload
def holm(comparisons: Mapping) -> dict: ...
@overload
def holm(comparisons: list) -> list: ...
def holm(comparisons):
    """The comparisons (a dict ``{key: Comparison}`` or a list) with p adjusted by Holm's method over the family of
    every one that has a p-value (an arm with one value has none and is left as it is), each verdict recomputed
    from its adjusted p (seed rule and alpha unchanged); ``family`` and ``p_raw`` say what was done and the
    sentence says so. Confidence intervals stay the unadjusted 95% ones. Refuses one Comparison alone (the family
    is every test made on the record: pass them all, as a list or a dict), anything that is not a Comparison, and a
    comparison already adjusted (``family`` > 1): adjusting twice would be wrong."""
    if not isinstance(comparisons, (Mapping, list, tuple)):
        one = " (one Comparison alone is a family of one: nothing to adjust)" if isinstance(comparisons,
                                                                                          Comparison) else ""
        raise TypeError(f"holm: comparisons must be a list or dict of every Comparison in the family{one}, got "
                        f"{type(comparisons).__name__}")
    items = list(comparisons.items()) if isinstance(comparisons, Mapping) else list(enumerate(comparisons))
    for key, c in items:
        if not isinstance(c, Comparison):
            raise TypeError(f"holm: {key!r} is {type(c).__name__}, expected a Comparison (from welch or paired)")
        if c.family > 1:
            raise ValueError(f"holm: {key!r} is already Holm-adjusted over {c.family} tests; pass unadjusted ones")
    tested = [(key, c) for key, c in items if not math.isnan(c.p)]
    adjusted = dict(zip([key for key, _ in tested], holm_adjust([c.p for _, c in tested])))
    out = {}
    for key, c in items:
        if key in adjusted and len(tested) > 1:
            p = adjusted[key]
            c = replace(c, p=p, p_raw=c.p, family=len(tested),
                        verdict=_verdict(c.diff, p, c.n_a, c.n_b, c.lower_is_better, c.alpha, c.min_n))
        out[key] = c
    return out if isinstance(comparisons, Mapping) else list(out.values())
