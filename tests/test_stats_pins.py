"""labutils.stats: pins found by mutation testing (issue 38), the survivors left after tests/test_stats.py.

Every number here is a hand computation written out: Student's t with 1 degree of freedom is the Cauchy
distribution (cdf(t) = 1/2 + atan(t) / pi), with 2 it is cdf(t) = 1/2 + t / (2 sqrt(2 + t^2)), with 4
cdf(t) = 1/2 + (3/8) (t / sqrt(1 + t^2/4)) (1 - t^2 / (12 (1 + t^2/4))); quantiles are scipy 1.16's, as in
tests/test_stats.py. Thresholds are probed at the exact float on either side of them (EPS = 2**-52)."""
import math
import re
import sys

import pytest

from labutils import stats

EPS = sys.float_info.epsilon
assert EPS == 2.0 ** -52
MOE = [1.41051062319317, 1.4017574415229797, 1.3774205088637423]
DENSE = [1.4793448184983238, 1.4887713565583465, 1.4675742211499425]
P_T1_DF2 = 1.0 - 1.0 / math.sqrt(3.0)       # two-sided p of t = +-1 at df 2: 2 * (1/2 - 1 / (2 sqrt 3))


# ---- the sentence of a tested, unadjusted comparison: every character ------------------------------------------
def test_the_sentence_of_an_unadjusted_welch_test_in_full():
    c = stats.welch(MOE, DENSE, names=("MoE", "dense"))     # t -7.042, df 3.338, p 0.00411, CI [-0.1170, -0.0470]
    assert c.sentence("nats", preset="full") == (
        "MoE is ahead of dense: 1.397 vs 1.479 nats (difference -0.082, 95% CI [-0.117, -0.047], Welch t = -7.04, "
        "p = 0.00411; 3 vs 3 seeds; preset full)")
    assert c.sentence(digits=2) == ("MoE is ahead of dense: 1.40 vs 1.48 (difference -0.08, 95% CI [-0.12, -0.05], "
                                    "Welch t = -7.04, p = 0.00411; 3 vs 3 seeds)")


def test_the_sentence_of_an_unadjusted_paired_test_in_full():
    c = stats.paired([1.0, 1.2, 0.9, 1.1], [1.05, 1.3, 1.0, 1.25])  # t -4.899, p 0.01628, CI [-0.1650, -0.0350]
    assert c.sentence() == ("A is ahead of B: 1.050 vs 1.150 (difference -0.100, 95% CI [-0.165, -0.035], paired "
                            "t = -4.90, p = 0.0163; 4 vs 4 seeds)")


# ---- the verdict: p < alpha strictly; a difference of exactly 1 is a difference like any other -------------------
def test_p_equal_to_alpha_is_inconclusive_and_just_below_it_is_a_verdict():
    p = stats.welch(MOE, DENSE).p
    assert p == pytest.approx(0.004110104376199833, rel=1e-7)       # scipy's ttest_ind(equal_var=False)
    at = stats.welch(MOE, DENSE, names=("MoE", "dense"), alpha=p)   # p does not depend on alpha
    assert (at.p, at.verdict) == (p, "inconclusive")
    # (the interval in between is left out: it is computed at level 1 - alpha, not 95 %, reported as a bug)
    s = at.sentence()
    assert s.startswith(f"MoE vs dense: inconclusive (p = 0.00411 >= {p}): 1.397 vs 1.479 (difference -0.082, ")
    assert s.endswith(", Welch t = -7.04, p = 0.00411; 3 vs 3 seeds)")
    assert stats.welch(MOE, DENSE, alpha=math.nextafter(p, 1.0)).verdict == "ahead"


def test_a_difference_of_exactly_one_gets_a_verdict():
    """Arms 2 +- 0.25 and 1 +- 0.25 (exact in binary): diff 1, sd 0.25 each, se sqrt(1/24), t sqrt(24), df 4,
    p = 2 (1 - cdf_4(sqrt 24)) = 1 - (15/28) sqrt(24/7); half width t(0.975, 4) * se."""
    a, b = [2.0, 2.25, 1.75], [1.0, 1.25, 0.75]
    c = stats.welch(a, b)
    assert c.diff == 1.0 and c.verdict == "behind"                          # lower is better: a is behind
    assert stats.welch(a, b, lower_is_better=False).verdict == "ahead"
    assert (c.t, c.df) == pytest.approx((math.sqrt(24.0), 4.0))
    assert c.p == pytest.approx(1.0 - 15.0 / 28.0 * math.sqrt(24.0 / 7.0), rel=1e-9)
    half = 2.7764451051977987 * math.sqrt(1.0 / 24.0)                       # scipy t.ppf(0.975, 4)
    assert c.ci == pytest.approx((1.0 - half, 1.0 + half), rel=1e-9)
    assert c.sentence() == ("A is behind B: 2.000 vs 1.000 (difference 1.000, 95% CI [0.433, 1.567], Welch t = 4.90, "
                            "p = 0.00805; 3 vs 3 seeds)")
    p = stats.paired(a, [1.0, 1.0, 1.0])                                    # differences 1, 1.25, 0.75: mean 1
    assert p.diff == 1.0 and p.verdict == "behind"


# ---- welch: "no spread" is max - min <= 16 eps * max|x|, the bound included ---------------------------------------
def test_no_spread_bound_is_16_ulps_of_one_times_the_largest_magnitude():
    assert stats._no_spread([-1.0, -1.0 + 16 * EPS, -1.0])          # spread 16 eps, bound 16 eps * 1: on the bound
    assert not stats._no_spread([-1.0, -1.0 + 17 * EPS, -1.0])      # 17 eps: past it
    big = 2.0 ** 20                                                 # bound 16 eps * 2**20 = 2**-28
    assert stats._no_spread([big, big + 2.0 ** -28, big])           # the bound scales with the magnitude
    assert not stats._no_spread([big, big + 2.0 ** -27, big])
    assert stats._no_spread([0.0, 0.0])                             # 0 <= 0


def _tested_against_a_constant(c):
    """a = [x, x + d, x] against b = [x, x, x]: diff d/3, sd_a d/sqrt(3), se d/3, so t = 1 and df = 2 (up to the
    rounding of a mean of values a few ulps apart: t 0.97 for d = 17 ulps of 1)."""
    assert c.df == pytest.approx(2.0) and (c.t, c.p) == pytest.approx((1.0, P_T1_DF2), rel=0.05)
    assert c.verdict == "inconclusive" and c.test == "Welch"


def _untested(c):
    """No test: t 0, df inf, p 1, the interval the point diff (a rounding error, mean_a - mean_b)."""
    d = c.mean_a - c.mean_b
    assert 0.0 < d < 1e-8 and c.diff == d
    assert (c.t, c.df, c.p, c.ci, c.verdict) == (0.0, math.inf, 1.0, (d, d), "inconclusive")


def test_welch_on_the_no_spread_bound_is_no_test_and_past_it_a_test():
    _untested(stats.welch([-1.0, -1.0 + 16 * EPS, -1.0], [-1.0] * 3))
    _tested_against_a_constant(stats.welch([-1.0, -1.0 + 17 * EPS, -1.0], [-1.0] * 3))
    big = 2.0 ** 20
    _untested(stats.welch([big, big + 2.0 ** -30, big], [big] * 3))
    _tested_against_a_constant(stats.welch([big, big + 2.0 ** -27, big], [big] * 3))


def test_welch_zero_spread_error_names_the_first_value_of_each_arm():
    a, b = [1.0, 1.0 + 2 * EPS, 1.0], [3.0, 3.0 + 4 * EPS, 3.0]    # each arm within rounding; the arms differ
    with pytest.raises(ValueError, match=r"^welch: zero spread in both arms: every value of a \(M\) is 1.0 and every "
                                         r"value of b \(D\) is 3.0; a t-test cannot tell whether that difference is "
                                         r"real \(it would read the zero spread as certainty, p = 0\). Accepted: runs "
                                         r"whose values vary in at least one arm; or compare the constant values "
                                         r"directly$"):
        stats.welch(a, b, names=("M", "D"))


# ---- paired: the differences' tolerance is 16 eps * max|x| over both arms, the bound included ----------------------
def test_paired_differences_on_the_tolerance_are_all_zero_and_past_it_tested():
    """One pair 1 vs 1 - k eps, two pairs 1 vs 1: differences k eps, 0, 0; tolerance 16 eps (max|x| = 1)."""
    on = stats.paired([1.0, 1.0, 1.0], [1.0 - 16 * EPS, 1.0, 1.0])   # spread 16 eps, |difference| 16 eps: on both
    assert (on.t, on.df, on.p, on.ci, on.diff, on.verdict) == (0.0, 2, 1.0, (16 * EPS / 3,) * 2, 16 * EPS / 3,
                                                               "inconclusive")
    past = stats.paired([1.0, 1.0, 1.0], [1.0 - 17 * EPS, 1.0, 1.0])  # differences d, 0, 0: t = 1 at df 2
    assert (past.t, past.df, past.p) == pytest.approx((1.0, 2, P_T1_DF2), rel=1e-6)
    assert past.test == "paired" and past.verdict == "inconclusive"


def test_paired_tolerance_scales_with_the_largest_value_and_the_error_names_the_first_difference():
    # differences 0.09999999997671694 (rounded at 1e6), 0.10000000000000009, 0.10000000000000009: spread 2.3e-11,
    # below 16 eps * 1e6 = 3.6e-9, so the same nonzero difference for every pair: refused
    with pytest.raises(ValueError, match=r"^paired: zero spread of the differences: every difference a\[i\] - b\[i\] "
                                         r"\(M - D\) is 0\.09999999997671694; a t-test cannot tell whether that "
                                         r"difference is real \(it would read the zero spread as certainty, p = 0\)\. "
                                         r"Accepted: pairs whose differences vary; or compare the constant values "
                                         r"directly$"):
        stats.paired([1000000.1, 1.1, 2.1], [1000000.0, 1.0, 2.0], names=("M", "D"))


def test_paired_two_pairs_are_tested_and_two_equal_pairs_are_not():
    """Differences -4, -5: mean -4.5, sd sqrt(1/2), se 1/2, t = -9 at df 1: p = 1 - 2 atan(9) / pi."""
    c = stats.paired([1.0, 2.0], [5.0, 7.0], min_n=2)
    assert (c.t, c.df, c.diff) == (-9.0, 1, -4.5)
    assert c.p == pytest.approx(1.0 - 2.0 * math.atan(9.0) / math.pi, rel=1e-9)
    assert c.ci == pytest.approx((-4.5 - 12.706204736174694 / 2, -4.5 + 12.706204736174694 / 2), rel=1e-9)
    assert c.verdict == "inconclusive"                                         # p 0.070 >= 0.05
    same = stats.paired([1.0, 2.0], [1.0, 2.0])                                # differences 0, 0
    assert (same.t, same.df, same.p, same.ci, same.verdict) == (0.0, 1, 1.0, (0.0, 0.0), "inconclusive")
    with pytest.raises(ValueError, match=r"^paired: zero spread of the differences: every difference a\[i\] - b\[i\] "
                                         r"\(A - B\) is 1\.0; "):
        stats.paired([2.0, 3.0], [1.0, 2.0])


def test_paired_with_no_pairs_is_untested():
    c = stats.paired([], [])
    assert (c.n_a, c.n_b, c.verdict) == (0, 0, "inconclusive")
    assert math.isnan(c.p) and math.isnan(c.t) and math.isnan(c.diff)


# ---- _zero_spread's documented return ------------------------------------------------------------------------------
def test_zero_spread_with_equal_values_returns_true_and_otherwise_raises_the_text_it_is_given():
    assert stats._zero_spread("welch", "in both arms", "w", True, "acc") is True
    with pytest.raises(ValueError, match="^" + re.escape(
            "f: zero spread in X: W; a t-test cannot tell whether that difference is real (it would read the zero "
            "spread as certainty, p = 0). Accepted: ACC; or compare the constant values directly") + "$"):
        stats._zero_spread("f", "in X", "W", False, "ACC")


# ---- bugs the mutants pointed at (issue 38) --------------------------------------------------------------------
@pytest.mark.parametrize("scale", [1.0, 1e-160, 1e-200, 1e150, 1e200])
def test_welch_is_scale_free_down_to_spreads_whose_squares_underflow(scale):
    # (1, 2, 3) vs (0, 0, 0): t = 2 / (1 / sqrt 3) = 2 sqrt 3, df = 2 (all the variance in the first arm), and
    # at df 2 the two-sided p is 1 - t / sqrt(2 + t^2). At 1e-160 the variances (1e-320) used to underflow to a
    # zero denominator: df = inf, p = nan and a reversed interval.
    c = stats.welch([1 * scale, 2 * scale, 3 * scale], [0.0, 0.0, 0.0])
    t = 2 * math.sqrt(3)
    assert c.t == pytest.approx(t, rel=1e-12) and c.df == pytest.approx(2.0, rel=1e-12)
    assert c.p == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-9)
    half = 4.302652729749464 * scale / math.sqrt(3)                      # t_0.975 at df 2 (scipy) x se
    assert c.ci == pytest.approx((2 * scale - half, 2 * scale + half), rel=1e-9, abs=0)  # abs=0: approx's
    # default abs=1e-12 would pass any interval at 1e-160
    assert c.ci[0] < c.diff < c.ci[1]


def test_the_sentence_names_the_intervals_level():
    a, b = [1.0, 1.1, 0.9, 1.05], [1.3, 1.45, 1.2, 1.3]
    assert "95% CI [" in stats.welch(a, b).sentence()
    assert "99% CI [" in stats.welch(a, b, alpha=0.01).sentence()
    assert "90% CI [" in stats.paired(a, b, alpha=0.1).sentence()
    assert "99.9% CI [" in stats.welch(a, b, alpha=0.001).sentence()
    wide, narrow = stats.welch(a, b, alpha=0.01).ci, stats.welch(a, b).ci
    assert wide[0] < narrow[0] and narrow[1] < wide[1]                   # the 99% interval is the wider one


def test_paired_with_no_pair_has_no_degrees_of_freedom():
    c = stats.paired([], [])
    assert math.isnan(c.df) and math.isnan(c.p) and c.verdict == "inconclusive"      # was df = -1
    one = stats.paired([1.0], [0.5])
    assert one.df == 0 and math.isnan(one.p) and one.verdict == "inconclusive"
    for c in (stats.paired([1.0], [0.5], alpha=0.01, min_n=5), stats.paired([], [], alpha=0.01, min_n=5)):
        assert (c.alpha, c.min_n) == (0.01, 5), c                           # the settings asked for, kept
        assert "fewer than 5 seeds in an arm" in c.sentence()


# ---- _mean_sd's two paths (issue 38: survivors of the scale fix) ------------------------------------------------
def _exact_sd(xs: list) -> float:
    """The sample sd in 60-digit decimals (their exponent range holds 1e-320 as well as 1e400)."""
    import decimal

    with decimal.localcontext(decimal.Context(prec=60, Emin=-9999, Emax=9999)):
        d = [decimal.Decimal(x) for x in xs]                                  # each float exactly
        m = sum(d) / len(d)
        return float((sum((x - m) ** 2 for x in d) / (len(d) - 1)).sqrt())


@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e-160, 1e-200, 1e150, 1e200])
def test_mean_sd_is_the_sample_sd_at_every_scale(scale):
    xs = [v * scale for v in (1.0, 2.0, 4.0, 8.0)]                           # deviations of unequal size
    m, sd = stats._mean_sd(xs)
    assert m == pytest.approx(3.75 * scale, rel=1e-15, abs=0)     # abs=0: no absolute slack at 1e-200
    assert sd == pytest.approx(_exact_sd(xs), rel=1e-12, abs=0) and sd > 0


def test_mean_sd_scales_by_the_spread_not_by_the_values():
    # values near 1e-150 (in range) that spread by ~2e-160 (out of range): the spread is what decides. Squared
    # directly, the deviations (~1e-320) are subnormals with a few digits left: 8e-5 off the exact sd, against 8e-13
    # for the scaled sum (the float mean, half an ulp of 1e-150 off, bounds both)
    xs = [1e-150 + k * 3e-161 for k in (1, 2, 4, 8)]
    sd = stats._mean_sd(xs)[1]
    assert sd == pytest.approx(_exact_sd(xs), rel=1e-9, abs=0)


@pytest.mark.parametrize("xs", [[0.1, 0.2, 0.4], [0.013, 0.017, 0.011, 0.019], [1.5, 2.25, 3.125],
                                [0.3, 0.30000000000000004, 0.29999999999999993], [120.0, 80.5, 99.25, 101.0]])
def test_mean_sd_of_ordinary_data_is_the_direct_formula_bit_for_bit(xs):
    # the scaled sum is kept for spreads outside 1e-150..1e150: ordinary data give the sd they gave before it
    m = sum(xs) / len(xs)
    assert stats._mean_sd(xs) == (m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)))
