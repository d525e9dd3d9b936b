"""labutils.stats: the one verdict routine. Reference values are scipy 1.16's (scipy.stats.t, ttest_ind with
equal_var=False, ttest_rel), written out so the book needs no scipy."""
import math
import re

import pytest

from labutils import stats

# chapter 05's recorded full run (benchmarks/results/moe_vs_dense_full.json): final validation loss per seed
MOE = [1.41051062319317, 1.4017574415229797, 1.3774205088637423]
DENSE = [1.4793448184983238, 1.4887713565583465, 1.4675742211499425]
WIDE = [1.3707387141466625, 1.3935305042770354, 1.3899060693508103]


@pytest.mark.parametrize("df,q,want", [(1, 0.975, 12.706204736174694), (2, 0.975, 4.302652729749462),
                                       (3.3377, 0.975, 3.0078209528470556), (10, 0.9, 1.372183641110336),
                                       (200, 0.6, 0.25368437919014747)])
def test_t_quantiles_match_scipy(df, q, want):
    assert stats.t_ppf(q, df) == pytest.approx(want, rel=1e-9)
    assert stats.t_ppf(1 - q, df) == pytest.approx(-want, rel=1e-9)


@pytest.mark.parametrize("t,df,want", [(-7.042167148670124, 3.3377362175617122, 0.0020550521880999166),
                                       (1.3, 4.5, 0.871901956027983), (0.2, 1, 0.562832958189001)])
def test_t_cdf_matches_scipy(t, df, want):
    assert stats.t_cdf(t, df) == pytest.approx(want, abs=1e-13)


def test_welch_matches_scipy_and_the_issue_figures():
    c = stats.welch(MOE, DENSE, names=("MoE", "dense"))
    assert c.t == pytest.approx(-7.042167148670124, rel=1e-9)
    assert c.p == pytest.approx(0.004110104376199833, rel=1e-7)
    assert c.df == pytest.approx(3.3377362175617122, rel=1e-9)
    assert c.ci == pytest.approx((-0.11702417596975517, -0.04697703911472511), rel=1e-7)
    assert c.verdict == "ahead"  # lower loss is better
    s = c.sentence("nats", preset="full")
    assert s.startswith("MoE is ahead of dense: 1.397 vs 1.479 nats") and "p = 0.00411" in s and "preset full" in s
    other = stats.welch([1.0, 1.2, 0.9, 1.1], [1.05, 1.3, 1.0, 1.25])
    assert (other.t, other.p, other.df) == pytest.approx((-1.021507836910497, 0.3470612531011045, 5.899628252788103))
    assert other.ci == pytest.approx((-0.3405305637374888, 0.14053056373748907))


def test_paired_matches_scipy():
    c = stats.paired([1.0, 1.2, 0.9, 1.1], [1.05, 1.3, 1.0, 1.25])
    assert (c.t, c.p) == pytest.approx((-4.898979485566363, 0.01627660345942849))
    assert c.ci == pytest.approx((-0.16496141318125546, -0.035038586818744555))
    assert c.verdict == "ahead" and c.test == "paired"


def test_inconclusive_cases():
    tie = stats.welch(MOE, WIDE, names=("MoE", "dense-wide"))  # p = 0.39: the issue's "they tie"
    assert tie.verdict == "inconclusive" and tie.p == pytest.approx(0.391, abs=1e-3)
    assert "inconclusive (p = 0.391" in tie.sentence("nats")
    few = stats.welch(MOE[:2], DENSE[:2])  # p = 0.007, but two seeds per arm are never a verdict
    assert few.p < 0.05 and few.verdict == "inconclusive" and "fewer than 3 seeds" in few.sentence()
    assert stats.welch([1.0], [2.0, 3.0]).verdict == "inconclusive"
    one = stats.welch([1.0], [2.0, 3.0])
    assert math.isnan(one.p) and "nan" not in one.sentence() and "fewer than 3 seeds" in one.sentence()
    behind = stats.welch(DENSE, MOE, names=("dense", "MoE"))
    assert behind.verdict == "behind"
    # relation(): a phrase that reads right after "A is" whatever the verdict
    assert (stats.welch(MOE, DENSE, names=("MoE", "dense")).relation(), behind.relation(), tie.relation()) == (
        "ahead of dense", "behind MoE", "inconclusive against dense-wide")
    assert stats.welch(MOE, DENSE, lower_is_better=False).verdict == "behind"  # e.g. tokens/s: higher is better


def test_bootstrap_and_clears():
    ratios = stats.all_pairs([2.0, 2.2, 2.4], [1.0, 1.1], lambda a, b: a / b)
    assert len(ratios) == 6
    lo, hi = stats.bootstrap_ci(ratios, seed=1)
    assert lo <= sum(ratios) / 6 <= hi and (lo, hi) == stats.bootstrap_ci(ratios, seed=1)  # seeded: reproducible
    assert stats.clears((1.35, 1.8), 1.3) and not stats.clears((1.14, 1.8), 1.3)
    assert stats.clears((0.5, 0.9), 1.0, higher_is_better=False)
    assert stats.all_pairs([1, 2], [3], lambda a, b: None) == []


def test_bad_input_is_refused_with_the_argument_named():
    with pytest.raises(ValueError, match="pairs need equal lengths"):
        stats.paired([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="finite"):
        stats.welch([1, float("nan"), 2], [1, 2, 3])
    with pytest.raises(TypeError, match="sequence of numbers"):
        stats.welch("abc", [1, 2])
    with pytest.raises(ValueError, match="alpha"):
        stats.welch([1, 2, 3], [1, 2, 3], alpha=1.5)
    with pytest.raises(ValueError, match="min_n"):
        stats.welch([1, 2, 3], [1, 2, 3], min_n=1)
    with pytest.raises(ValueError, match="at least 2 values"):
        stats.bootstrap_ci([1.0])
    with pytest.raises(ValueError, match="q must be in"):
        stats.t_ppf(1.0, 3)
    with pytest.raises(ValueError, match="df must be > 0"):
        stats.t_cdf(1.0, 0)


# ---- pins found by mutation testing (labutils/_stats_input.py, labutils/_stats_intervals.py) -----------------
@pytest.mark.parametrize("level", [0, 0.0, 1, 1.0, 1.5, -0.5, [0.95], None, "0.95", True])
@pytest.mark.parametrize("fn", ["t_interval", "bootstrap_ci"])
def test_level_is_a_number_strictly_between_0_and_1(fn, level):
    with pytest.raises(ValueError, match=r"^" + fn + r": level must be a number in \(0, 1\), e.g. 0.95, got "
                       + re.escape(repr(level)) + "$"):
        getattr(stats, fn)([1.0, 2.0, 3.0], level=level)


def test_t_interval_by_hand_from_two_values_and_its_errors_name_it():
    lo, hi = stats.t_interval([1.0, 3.0])                      # mean 2, sd sqrt(2), n 2: half = t(0.975, 1)
    assert lo == pytest.approx(2 - 12.706204736174694) and hi == pytest.approx(2 + 12.706204736174694)
    assert stats.t_interval([1.0, 3.0], level=0.5) == pytest.approx((1.0, 3.0))    # t(0.75, 1) = 1
    with pytest.raises(ValueError, match=r"^t_interval: needs at least 2 values, got 1$"):
        stats.t_interval([1.0])
    with pytest.raises(TypeError, match=r"^t_interval: values: expected a sequence of numbers, got \['a', 1\]$"):
        stats.t_interval(["a", 1])
    with pytest.raises(ValueError, match=r"^t_interval: values: every value must be finite, got \[inf\] at "):
        stats.t_interval([1.0, math.inf])


def test_a_dict_is_refused_with_a_preview_cut_at_80_characters():
    short = {"k": "x" * 71}                                              # repr: exactly 80 characters
    assert len(repr(short)) == 80
    with pytest.raises(TypeError, match=r"^t_interval: values is a dict \(" + re.escape(repr(short)) + r"\), and "):
        stats.t_interval(short)
    long = {"k": "x" * 72}                                               # 81: cut to 76 and " ..."
    with pytest.raises(TypeError) as err:
        stats.t_interval(long)
    assert str(err.value).startswith("t_interval: values is a dict ({'k': '" + "x" * 69 + " ...), and iterating")
    # bootstrap_ci refuses it also when a stat is given (which would otherwise resample the keys)
    with pytest.raises(TypeError, match=r"^bootstrap_ci: values is a dict \(\{0: 1.0, 1: 2.0\}\)"):
        stats.bootstrap_ci({0: 1.0, 1: 2.0}, stat=max)


def test_mean_sd_of_no_value_and_of_one_value_is_nan_where_undefined():
    m, sd = stats._mean_sd([])
    assert math.isnan(m) and math.isnan(sd)
    m, sd = stats._mean_sd([2.5])
    assert m == 2.5 and math.isnan(sd)


def test_bootstrap_ci_takes_the_percentile_draws_by_index():
    """A stat that returns 0, 1, 2, ... whatever the resample: the sorted draws are their own indices, so the
    interval IS the pair of indices: floor((1 - level) / 2 * n_boot) and ceil((1 + level) / 2 * n_boot) - 1."""
    def counter():                                                # 0, 1, 2, ... one per call
        it = iter(range(10**6))
        return lambda xs: next(it)
    assert stats.bootstrap_ci([1.0, 2.0], counter(), n_boot=200, level=0.5) == (50, 149)
    assert stats.bootstrap_ci([1.0, 2.0], counter(), n_boot=100, level=0.99) == (0, 99)   # the last draw
    assert stats.bootstrap_ci([1.0, 2.0], counter(), n_boot=100, level=0.5) == (25, 74)   # n_boot 100 is allowed


def test_bootstrap_ci_defaults_are_2000_draws_from_seed_0():
    vals = [1.0, 2.5, 4.0, 7.5, 0.3, 9.1, 3.3, 5.2]
    assert stats.bootstrap_ci(vals) == stats.bootstrap_ci(vals, seed=0)
    assert stats.bootstrap_ci(vals) != stats.bootstrap_ci(vals, seed=1)                  # the seed matters here
    it = iter(range(10**6))
    assert stats.bootstrap_ci(vals, lambda xs: next(it)) == (50, 1949)                   # 2000 draws, 95 %


@pytest.mark.parametrize("n_boot", [99, 50, 0, True, 100.0, "2000"])
def test_bootstrap_ci_n_boot_is_an_int_of_at_least_100(n_boot):
    with pytest.raises(ValueError, match=r"^bootstrap_ci: n_boot must be an int >= 100, got "
                       + re.escape(repr(n_boot)) + "$"):
        stats.bootstrap_ci([1.0, 2.0], n_boot=n_boot)


def test_all_pairs_leaves_out_only_the_pairs_fn_returns_none_for():
    assert stats.all_pairs([1, 10], [0, 2, 3], lambda a, b: None if b == 0 else a + b) == [3.0, 4.0, 12.0, 13.0]


def test_a_bound_on_the_target_clears_it_and_is_not_a_miss():
    assert stats.clears((0.5, 1.0), 1.0, higher_is_better=False)             # hi == target: cleared
    assert stats.clears((1.0, 1.5), 1.0)                                     # lo == target: cleared
    assert stats.target_verdict((0.5, 1.0), 1.0) == "inconclusive"           # hi == target: not a miss
    assert stats.target_verdict((1.0, 1.5), 1.0, higher_is_better=False) == "inconclusive"
    assert stats.target_verdict((0.5, 0.9), 1.0) == "NOT met"
    assert stats.target_verdict((1.1, 1.5), 1.0, higher_is_better=False) == "NOT met"


# ---- labutils/stats.py: every field of the Comparison on the paths that skip the t-test --------------------------
def _fields(c) -> dict:
    """The Comparison as a dict, NaN written "nan" (NaN != NaN would fail any comparison)."""
    def plain(v):
        if isinstance(v, tuple):
            return tuple(plain(x) for x in v)
        return "nan" if isinstance(v, float) and math.isnan(v) else v
    return {k: plain(v) for k, v in vars(c).items()}


def test_welch_identical_constant_arms_are_a_full_no_test_comparison():
    c = stats.welch([2.0, 2.0, 2.0], [2.0, 2.0], names=("M", "D"), lower_is_better=False, alpha=0.1, min_n=2)
    assert _fields(c) == dict(names=("M", "D"), n_a=3, n_b=2, mean_a=2.0, mean_b=2.0, sd_a=0.0, sd_b=0.0, diff=0.0,
                              ci=(0.0, 0.0), t=0.0, df=math.inf, p=1.0, test="Welch", verdict="inconclusive",
                              lower_is_better=False, alpha=0.1, min_n=2, family=1, p_raw="nan")


def test_welch_with_one_value_in_an_arm_is_untested_and_says_so():
    c = stats.welch([1.0], [2.0, 4.0], names=("M", "D"), lower_is_better=False, alpha=0.1, min_n=2)
    assert _fields(c) == dict(names=("M", "D"), n_a=1, n_b=2, mean_a=1.0, mean_b=3.0, sd_a="nan", sd_b=math.sqrt(2),
                              diff=-2.0, ci=("nan", "nan"), t="nan", df="nan", p="nan", test="Welch",
                              verdict="inconclusive", lower_is_better=False, alpha=0.1, min_n=2, family=1,
                              p_raw="nan")
    assert c.sentence() == "M vs D: inconclusive (fewer than 2 seeds in an arm): 1.000 vs 3.000 (difference -2.000; " \
                           "1 vs 2 seeds)"


def test_welch_names_its_test_and_tests_against_one_constant_arm():
    c = stats.welch([1.0, 2.0, 3.0], [5.0, 5.0, 5.0])
    assert c.test == "Welch" and c.df == pytest.approx(2.0) and c.sd_b == 0.0


def test_paired_equal_pairs_are_a_full_no_test_comparison():
    a, b = [0.3, 1.0, 2.0], [0.1 + 0.2, 1.0, 2.0]              # one difference of a rounding error, -5.6e-17
    c = stats.paired(a, b, names=("M", "D"), lower_is_better=False, alpha=0.1, min_n=2)
    assert _fields(c) == dict(names=("M", "D"), n_a=3, n_b=3, mean_a=sum(a) / 3, mean_b=sum(b) / 3,
                              sd_a=stats._mean_sd(a)[1], sd_b=stats._mean_sd(b)[1], diff=(0.3 - (0.1 + 0.2)) / 3,
                              ci=((0.3 - (0.1 + 0.2)) / 3,) * 2, t=0.0, df=2, p=1.0, test="paired",
                              verdict="inconclusive", lower_is_better=False, alpha=0.1, min_n=2, family=1,
                              p_raw="nan")


def test_paired_with_one_pair_is_untested():
    c = stats.paired([1.0], [3.0], names=("M", "D"))
    assert (c.test, c.df, c.diff, c.verdict) == ("paired", 0, -2.0, "inconclusive")
    assert math.isnan(c.p) and math.isnan(c.t) and math.isnan(c.ci[0])


def test_paired_errors_name_the_function_and_each_arm():
    with pytest.raises(ValueError, match=r"^paired: M has 3 values and D 2; pairs need equal lengths$"):
        stats.paired([1, 2, 3], [1, 2], names=("M", "D"))
    with pytest.raises(TypeError, match=r"^paired: b \(D\): expected a sequence of numbers, got 'xy'$"):
        stats.paired([1, 2], "xy", names=("M", "D"))
    with pytest.raises(ValueError, match=r"^paired: zero spread of the differences: every difference a\[i\] - b\[i\] "
                                         r"\(M - D\) is 1.0; a t-test cannot tell"):
        stats.paired([2.0, 3.0, 4.0], [1.0, 2.0, 3.0], names=("M", "D"))
    with pytest.raises(ValueError, match=r"or compare the constant values directly$"):
        stats.welch([2.0, 2.0], [3.0, 3.0])


@pytest.mark.parametrize("alpha", [0, 0.0, 1, 1.0])
def test_alpha_is_strictly_between_0_and_1(alpha):
    with pytest.raises(ValueError, match=r"^welch: alpha must be a number in \(0, 1\), e.g. 0.05, got "):
        stats.welch([1, 2, 3], [1, 2, 4], alpha=alpha)


def test_min_n_2_is_allowed():
    assert stats.welch([1.0, 2.0], [5.0, 6.0], min_n=2).min_n == 2
    assert stats.paired([1.0, 2.0], [5.0, 7.0], min_n=2).min_n == 2


def test_holm_adjust_by_hand_at_the_bounds():
    assert stats.holm_adjust([0.0, 1.0]) == [0.0, 1.0]                       # 0 and 1 are p-values
    assert stats.holm_adjust([0.6, 0.7]) == [1.0, 1.0]                       # 1.2 capped at 1
    with pytest.raises(ValueError, match=r"^holm_adjust: p-values must lie in \[0, 1\], got \[1.5\] in \[0.5, 1.5\]$"):
        stats.holm_adjust([0.5, 1.5])


def test_holm_over_two_tests_says_so_and_refuses_to_adjust_twice():
    c1 = stats.welch([1.0, 1.1, 1.2], [2.0, 2.1, 2.3], names=("M", "D"))
    c2 = stats.welch([1.0, 1.1, 1.2], [1.05, 1.2, 1.1], names=("M", "W"))
    h1, h2 = stats.holm([c1, c2])
    assert (h1.family, h2.family, h1.p_raw) == (2, 2, c1.p)
    assert "(Holm over 2 tests; unadjusted" in h1.sentence() and "95% CI (unadjusted) [" in h1.sentence()
    assert "(Holm p = " in h2.sentence()
    with pytest.raises(ValueError, match=r"^holm: 0 is already Holm-adjusted over 2 tests; pass unadjusted ones$"):
        stats.holm([h1, c2])
    # one tested comparison and one without a p: a family of one, left as it was
    alone, untested = stats.holm([c1, stats.welch([1.0], [2.0, 3.0])])
    assert alone.family == 1 and math.isnan(alone.p_raw) and alone.p == c1.p
    with pytest.raises(TypeError, match=r"^holm: comparisons must be a list or dict of every Comparison in the "
                                        r"family, got int$"):
        stats.holm(3)
