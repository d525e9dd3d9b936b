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

Student's t distribution is computed here in plain Python (the regularised incomplete beta function by its continued
fraction), so the book needs no scipy; ``tests/test_stats.py`` checks it against scipy's values.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

VERDICTS = ("ahead", "behind", "inconclusive")


# --- Student's t distribution ----------------------------------------------------------------------------------

def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz), converged to 1e-15."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        even = m * (b - m) * x / ((a + m2 - 1) * (a + m2))
        odd = -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1))
        for num in (even, odd):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom (df > 0, may be fractional: Welch)."""
    if not df > 0:
        raise ValueError(f"t_cdf: df must be > 0, got {df!r}")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_ppf(q: float, df: float) -> float:
    """The q-quantile of Student's t (0 < q < 1), by bisection on :func:`t_cdf` to 1e-12."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"t_ppf: q must be in (0, 1), got {q!r}")
    if q == 0.5:
        return 0.0
    lo, hi = -1.0, 1.0
    while t_cdf(lo, df) > q:
        lo *= 2.0
    while t_cdf(hi, df) < q:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < q:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, abs(mid)):
            break
    return 0.5 * (lo + hi)


# --- comparisons ------------------------------------------------------------------------------------------------

def _values(name: str, xs) -> list:
    try:
        out = [float(x) for x in xs]
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name}: expected a sequence of numbers, got {xs!r}") from exc
    if any(math.isnan(x) or math.isinf(x) for x in out):
        raise ValueError(f"{name}: every value must be finite, got {out}")
    return out


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
    elif se == 0:  # no spread at all: any difference is certain, none is none
        t, p, lo, hi = (math.copysign(math.inf, diff) if diff else 0.0), (0.0 if diff else 1.0), diff, diff
    else:
        t = diff / se
        p = 2.0 * t_cdf(-abs(t), df)
        half = t_ppf(1.0 - alpha / 2.0, df) * se
        lo, hi = diff - half, diff + half
    verdict = "inconclusive" if math.isnan(p) else _verdict(diff, p, len(a), len(b), lower_is_better, alpha, min_n)
    return Comparison(tuple(names), len(a), len(b), ma, mb, sa, sb, diff, (lo, hi), t, df, p, test, verdict,
                      lower_is_better, alpha, min_n)


def welch(a, b, *, names=("A", "B"), lower_is_better: bool = True, alpha: float = 0.05, min_n: int = 3) -> Comparison:
    """Welch's t-test of mean(a) vs mean(b) (independent samples, unequal variances), 95% CI of the difference.
    An arm with fewer than two values cannot be tested: the verdict is inconclusive and p is nan."""
    _check_common(alpha, min_n)
    a, b = _values(f"welch: {names[0]}", a), _values(f"welch: {names[1]}", b)
    (ma, sa), (mb, sb) = _mean_sd(a), _mean_sd(b)
    if len(a) < 2 or len(b) < 2:
        return _result(names, a, b, ma - mb, float("nan"), float("nan"), "Welch", lower_is_better, alpha, min_n)
    va, vb = sa * sa / len(a), sb * sb / len(b)
    denom = (va * va / (len(a) - 1)) + (vb * vb / (len(b) - 1))
    df = (va + vb) ** 2 / denom if denom else float("inf")
    return _result(names, a, b, ma - mb, math.sqrt(va + vb), df, "Welch", lower_is_better, alpha, min_n)


def paired(a, b, *, names=("A", "B"), lower_is_better: bool = True, alpha: float = 0.05,
           min_n: int = 3) -> Comparison:
    """Paired t-test: a[i] and b[i] come from the same seed. CI of the mean difference."""
    _check_common(alpha, min_n)
    a, b = _values(f"paired: {names[0]}", a), _values(f"paired: {names[1]}", b)
    if len(a) != len(b):
        raise ValueError(f"paired: {names[0]} has {len(a)} values and {names[1]} {len(b)}; pairs need equal lengths")
    md, sd = _mean_sd([x - y for x, y in zip(a, b)])
    se = sd / math.sqrt(len(a)) if len(a) > 1 else float("nan")
    return _result(names, a, b, md, se, len(a) - 1, "paired", lower_is_better, alpha, min_n)


# --- intervals of any statistic ---------------------------------------------------------------------------------

def all_pairs(a_values, b_values, fn) -> list:
    """``fn(a, b)`` for every pair (a from ``a_values``, b from ``b_values``): e.g. the steps dense needs over the
    steps MoE needs, for each dense seed and each MoE seed. Pairs where ``fn`` returns None are left out."""
    out = [fn(x, y) for x in a_values for y in b_values]
    return [float(v) for v in out if v is not None]


def bootstrap_ci(values, stat=None, *, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> tuple:
    """Percentile bootstrap interval of ``stat(sample)`` (default: the mean) resampling ``values`` with
    replacement ``n_boot`` times from a seeded generator: reproducible."""
    vals = list(values)
    if len(vals) < 2:
        raise ValueError(f"bootstrap_ci: needs at least 2 values, got {len(vals)}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"bootstrap_ci: level must be in (0, 1), got {level!r}")
    if not (isinstance(n_boot, int) and n_boot >= 100):
        raise ValueError(f"bootstrap_ci: n_boot must be an int >= 100, got {n_boot!r}")
    stat = stat or (lambda xs: sum(xs) / len(xs))
    rng = random.Random(seed)
    draws = sorted(stat([rng.choice(vals) for _ in vals]) for _ in range(n_boot))
    lo_i = int(math.floor((1.0 - level) / 2.0 * n_boot))
    hi_i = int(math.ceil((1.0 + level) / 2.0 * n_boot)) - 1
    return draws[lo_i], draws[min(hi_i, n_boot - 1)]


def clears(ci: tuple, target: float, higher_is_better: bool = True) -> bool:
    """Does the whole interval clear the target? "Target met" means this, not a point estimate past it."""
    lo, hi = ci
    return lo >= target if higher_is_better else hi <= target
