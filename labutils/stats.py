"""THE verdict over seeds: one routine for every comparison the book makes between runs. (Taught in chapter 05;
used by chapters 05, 08 and 09 and the benchmarks.)

A verdict is a test, never "the gap is bigger than twice the std":

* :func:`welch` (independent seeds, unequal variances) and :func:`paired` (seeds paired: same data order, same
  initial weights) give the difference of means, its 95% confidence interval, t, the degrees of freedom and the
  two-sided p-value;
* the verdict is "ahead", "behind" (A relative to B, in the direction that is better) or "inconclusive": p >= alpha,
  or fewer than ``min_n`` (3) values in an arm, whatever the means say;
* :func:`bootstrap_ci` gives an interval for any statistic over seeds (e.g. "steps for dense / steps for MoE" over all
  seed pairs, :func:`all_pairs`), and :func:`clears` says whether an interval clears a target: "target met" means its
  lower bound does.

Refused, each with a message naming the argument, the value and what is accepted: a dict where values are
expected (``{seed: loss}`` would be read as its keys, the seeds: pass ``list(d.values())``), NaN or infinite
values, and a t-test whose spread is zero (every value of both arms the same up to rounding, or every paired
difference the same) when the means differ: a t-test cannot tell a real difference from one measured with no
noise (see :func:`welch`).

Student's t distribution is computed here in plain Python (the regularised incomplete beta function by its continued
fraction), so the book needs no scipy; ``tests/test_stats.py`` checks it against scipy's values.
"""
from __future__ import annotations

import math
import numbers
import random
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from ._student_t import t_cdf, t_ppf

VERDICTS = ("ahead", "behind", "inconclusive")


# --- comparisons ------------------------------------------------------------------------------------------------

def _preview(xs, limit: int = 80) -> str:
    text = repr(xs)
    return text if len(text) <= limit else text[:limit - 4] + " ..."


def _not_a_dict(where: str, arg: str, xs) -> None:
    """THE guard of every public function here that takes values: a dict (any Mapping) is refused, since
    iterating ``{seed: loss}`` gives the seeds, not the losses ("1.000 vs 1.000, inconclusive" over seeds 0, 1, 2)."""
    if isinstance(xs, Mapping):
        raise TypeError(f"{where}: {arg} is a dict ({_preview(xs)}), and iterating a dict gives its keys (the "
                        "seeds?), not its values: pass a sequence of values, e.g. list(d.values())")


def _values(where: str, arg: str, xs) -> list:
    """``xs`` as a list of finite floats, or an error naming ``where``, ``arg`` and the value: a dict, anything
    that is not a sequence of numbers, NaN and +-inf are refused."""
    _not_a_dict(where, arg, xs)
    try:
        out = [float(x) for x in xs]
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{where}: {arg}: expected a sequence of numbers, got {_preview(xs)}") from exc
    _finite(where, arg, out)
    return out


def _finite(where: str, arg: str, xs: list) -> None:
    """Refuse a NaN or an infinity among the numbers of ``xs`` (other items, e.g. runs, are not looked at)."""
    bad = [i for i, x in enumerate(xs) if _is_number(x) and not _finite_number(x)]
    if bad:
        raise ValueError(f"{where}: {arg}: every value must be finite, got {[xs[i] for i in bad]} at "
                         f"position(s) {bad} of {_preview(xs)} (a diverged run? leave it out and say so)")


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _finite_number(x) -> bool:
    """``x`` converts to a finite float (a Python or numpy number, a one-element tensor)."""
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def _no_spread(xs: list) -> bool:
    """Every value the same up to float rounding (a few ulps of the largest magnitude)."""
    return max(xs) - min(xs) <= 16 * sys.float_info.epsilon * max(abs(x) for x in xs)


def _mean_sd(xs: list) -> tuple:
    n = len(xs)
    m = sum(xs) / n if n else float("nan")
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)) if n > 1 else float("nan")
    return m, sd


@dataclass(frozen=True)
class Comparison:
    """A compared with B: ``diff = mean_a - mean_b`` with its 95% interval, the test and the verdict."""
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
        if self.verdict == "inconclusive":
            why = (f" (fewer than {self.min_n} seeds in an arm)" if min(self.n_a, self.n_b) < self.min_n
                   else f" (p = {self.p:.3g} >= {self.alpha})")
        tested = "" if math.isnan(self.p) else (f", 95% CI [{f.format(self.ci[0])}, {f.format(self.ci[1])}], "
                                                 f"{self.test} t = {self.t:.2f}, p = {self.p:.3g}")
        stats = (f"{f.format(self.mean_a)} vs {f.format(self.mean_b)}{u} (difference {f.format(self.diff)}{tested}; "
                 f"{self.n_a} vs {self.n_b} seeds" + (f"; preset {preset}" if preset else "") + ")")
        return f"{a} {verb}{why}: {stats}"


def _verdict(diff: float, p: float, n_a: int, n_b: int, lower_is_better: bool, alpha: float, min_n: int) -> str:
    if min(n_a, n_b) < min_n or not p < alpha or diff == 0:
        return "inconclusive"
    better = diff < 0 if lower_is_better else diff > 0
    return "ahead" if better else "behind"


def _check_common(alpha: float, min_n: int):
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    if not (isinstance(min_n, int) and min_n >= 2):
        raise ValueError(f"min_n must be an int >= 2 (a t-test needs two values per arm), got {min_n!r}")


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
    """Welch's t-test of mean(a) vs mean(b) (independent samples, unequal variances), 95% CI of the difference.
    An arm with fewer than two values cannot be tested: the verdict is inconclusive and p is nan.

    Zero spread in BOTH arms (every value of each arm the same, up to float rounding): with equal means the
    verdict is "inconclusive" with t = 0 and p = 1 (nothing differs); with different means a ValueError
    "zero spread in both arms": a t-test cannot tell (it would say p = 0, or 1e-28 from rounding noise). One
    arm without spread is fine (e.g. a constant target: a one-sample test).

    Refuses (before computing anything), naming the argument and the value: a dict for ``a`` or ``b`` (pass
    ``list(d.values())``), values that are not numbers, NaN or +-inf, the zero spread above, ``alpha`` outside
    (0, 1) and ``min_n`` < 2."""
    _check_common(alpha, min_n)
    a, b = _values("welch", f"a ({names[0]})", a), _values("welch", f"b ({names[1]})", b)
    (ma, sa), (mb, sb) = _mean_sd(a), _mean_sd(b)
    if len(a) < 2 or len(b) < 2:
        return _result(names, a, b, ma - mb, float("nan"), float("nan"), "Welch", lower_is_better, alpha, min_n)
    if _no_spread(a) and _no_spread(b):
        what = f"every value of a ({names[0]}) is {a[0]!r} and every value of b ({names[1]}) is {b[0]!r}"
        _zero_spread("welch", "in both arms", what, _no_spread(a + b), "runs whose values vary in at least one arm")
        return _no_test(names, a, b, ma - mb, float("inf"), "Welch", lower_is_better, alpha, min_n)
    va, vb = sa * sa / len(a), sb * sb / len(b)
    denom = (va * va / (len(a) - 1)) + (vb * vb / (len(b) - 1))
    df = (va + vb) ** 2 / denom if denom else float("inf")
    return _result(names, a, b, ma - mb, math.sqrt(va + vb), df, "Welch", lower_is_better, alpha, min_n)


def paired(a, b, *, names=("A", "B"), lower_is_better: bool = True, alpha: float = 0.05,
           min_n: int = 3) -> Comparison:
    """Paired t-test: a[i] and b[i] come from the same seed. CI of the mean difference.

    Zero spread of the differences (every ``a[i] - b[i]`` the same, up to float rounding; both arms constant is
    one case): all differences 0 gives "inconclusive" with t = 0 and p = 1; the same nonzero difference for every
    pair is a ValueError (a t-test cannot tell: it would say p = 0).

    Refuses (before computing anything), naming the argument and the value: a dict for ``a`` or ``b`` (pass
    ``list(d.values())``), values that are not numbers, NaN or +-inf, arms of different lengths, the zero
    spread above, ``alpha`` outside (0, 1) and ``min_n`` < 2."""
    _check_common(alpha, min_n)
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
    se = sd / math.sqrt(len(a)) if len(a) > 1 else float("nan")
    return _result(names, a, b, md, se, len(a) - 1, "paired", lower_is_better, alpha, min_n)


# --- intervals of any statistic ---------------------------------------------------------------------------------

def all_pairs(a_values, b_values, fn) -> list:
    """``fn(a, b)`` for every pair (a from ``a_values``, b from ``b_values``): e.g. the steps dense needs over the
    steps MoE needs, for each dense seed and each MoE seed. Pairs where ``fn`` returns None are left out.
    Refuses a dict for ``a_values`` or ``b_values`` (pass ``list(d.values())``)."""
    _not_a_dict("all_pairs", "a_values", a_values)
    _not_a_dict("all_pairs", "b_values", b_values)
    out = [fn(x, y) for x in a_values for y in b_values]
    return [float(v) for v in out if v is not None]


def bootstrap_ci(values, stat=None, *, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> tuple:
    """Percentile bootstrap interval of ``stat(sample)`` (default: the mean) resampling ``values`` with
    replacement ``n_boot`` times from a seeded generator: reproducible. ``values`` may be any items (e.g. runs)
    when ``stat`` is given; the default mean needs numbers.

    Refuses (before drawing), naming the argument and the value: a dict (pass ``list(d.values())``), a NaN or
    +-inf among the values (as :func:`welch` does: one diverged run would make the interval NaN and
    :func:`clears` False), non-numbers with the default mean, fewer than 2 values, ``level`` outside (0, 1),
    ``n_boot`` not an int >= 100; and, after drawing, a ``stat`` that returns NaN or +-inf."""
    _not_a_dict("bootstrap_ci", "values", values)
    if stat is None:
        vals = _values("bootstrap_ci", "values", values)
    else:
        vals = list(values)
        _finite("bootstrap_ci", "values", vals)
    if len(vals) < 2:
        raise ValueError(f"bootstrap_ci: needs at least 2 values, got {len(vals)}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"bootstrap_ci: level must be in (0, 1), got {level!r}")
    if not (isinstance(n_boot, int) and n_boot >= 100):
        raise ValueError(f"bootstrap_ci: n_boot must be an int >= 100, got {n_boot!r}")
    stat = stat or (lambda xs: sum(xs) / len(xs))
    rng = random.Random(seed)
    draws = [stat([rng.choice(vals) for _ in vals]) for _ in range(n_boot)]
    bad = next((d for d in draws if not _finite_number(d)), None)
    if bad is not None:
        raise ValueError(f"bootstrap_ci: stat returned {bad!r} on a resample; it must return a finite number")
    draws.sort()
    lo_i = int(math.floor((1.0 - level) / 2.0 * n_boot))
    hi_i = int(math.ceil((1.0 + level) / 2.0 * n_boot)) - 1
    return draws[lo_i], draws[min(hi_i, n_boot - 1)]


def clears(ci: tuple, target: float, higher_is_better: bool = True) -> bool:
    """Does the whole interval clear the target? "Target met" means this, not a point estimate past it.
    Refuses a ``ci`` that is not a pair of finite numbers (a NaN bound would say "not met" whatever the runs) and
    a non-finite ``target``."""
    if isinstance(ci, Mapping) or not (isinstance(ci, (tuple, list)) and len(ci) == 2
                                       and all(_finite_number(c) for c in ci)):
        raise ValueError(f"clears: ci must be a (low, high) pair of finite numbers, got {ci!r}")
    if not _finite_number(target):
        raise ValueError(f"clears: target must be a finite number, got {target!r}")
    lo, hi = ci
    return lo >= target if higher_is_better else hi <= target
