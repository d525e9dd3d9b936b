"""labutils.stats: the one verdict routine. Reference values are scipy 1.16's (scipy.stats.t, ttest_ind with
equal_var=False, ttest_rel), written out so the book needs no scipy."""
import math

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
