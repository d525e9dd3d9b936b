"""Chapter 05's verdict rules (issue 38): Holm's correction over a family of tests, the t-interval of a speed-up
whose values share seeds, and the target verdict that says "inconclusive" when the interval straddles the target.
Reference values are written out (scipy's t quantiles, Holm's step-down by hand), never computed by the code under
test."""
import math

import pytest

from labbook.lm_study import summary
from labutils import stats

T975_2 = 4.302652729749462      # scipy.stats.t.ppf(0.975, 2)
T975_8 = 2.306004135204166      # scipy.stats.t.ppf(0.975, 8)


def test_holm_adjust_is_the_step_down_by_hand():
    # sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1 = 0.02, 0.03, 0.06, 0.04 -> running max 0.02, 0.03, 0.06, 0.06
    assert stats.holm_adjust([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert stats.holm_adjust([0.5, 0.9]) == pytest.approx([1.0, 1.0])          # capped at 1
    assert stats.holm_adjust([0.02]) == [0.02] and stats.holm_adjust([]) == []
    # ties keep the same adjusted value; the order of the input is kept
    assert stats.holm_adjust([0.01, 0.01, 0.2]) == pytest.approx([0.03, 0.03, 0.2])
    for bad in ([0.1, float("nan")], [1.5], {"a": 0.1}):
        with pytest.raises((ValueError, TypeError)):
            stats.holm_adjust(bad)


def test_holm_recomputes_verdicts_and_says_so():
    a = stats.welch([1.0, 1.1, 0.9], [2.0, 2.1, 1.9], names=("A", "B"))       # p ~ 2e-4
    b = stats.welch([1.0, 1.2, 0.9], [1.2, 1.4, 1.1], names=("C", "B"))       # p ~ 0.1
    c = stats.welch([1.0, 1.1, 0.9], [1.05, 1.2, 1.0], names=("D", "B"))      # p ~ 0.4
    d = stats.welch([1.0, 1.05, 0.95], [1.12, 1.17, 1.07], names=("E", "B"))  # p ~ 0.04: dies under Holm
    assert d.verdict == "ahead" and 0.01 < d.p < 0.05
    out = stats.holm({"a": a, "b": b, "c": c, "d": d})
    want = stats.holm_adjust([a.p, b.p, c.p, d.p])
    assert [out[k].p for k in "abcd"] == pytest.approx(want)
    assert [out[k].p_raw for k in "abcd"] == [a.p, b.p, c.p, d.p] and {out[k].family for k in "abcd"} == {4}
    assert out["a"].verdict == "ahead" and out["d"].verdict == "inconclusive"
    assert "Holm over 4 tests; unadjusted" in out["d"].sentence() and "Holm p = " in out["d"].sentence()
    assert out["a"].ci == a.ci                                                 # intervals stay unadjusted
    assert [x.p for x in stats.holm([a, d])] == pytest.approx(stats.holm_adjust([a.p, d.p]))   # a list too
    with pytest.raises(ValueError, match="already Holm-adjusted"):
        stats.holm(out)
    with pytest.raises(TypeError, match="expected a Comparison"):
        stats.holm({"a": a, "x": 0.03})
    one = stats.welch([1.0], [2.0, 3.0])                                       # no p: left out of the family
    kept = stats.holm([a, one])
    assert kept[0].family == 1 and kept[0].p == a.p and math.isnan(kept[1].p)


def test_t_interval_by_the_formula():
    assert stats.t_interval([1.0, 2.0, 3.0]) == pytest.approx((2 - T975_2 / math.sqrt(3), 2 + T975_2 / math.sqrt(3)))
    nine = [1.3733, 1.4250, 1.6211, 1.4280, 1.4794, 1.6734, 1.3149, 1.3394, 1.5381]
    m = sum(nine) / 9
    sd = math.sqrt(sum((v - m) ** 2 for v in nine) / 8)
    assert stats.t_interval(nine) == pytest.approx((m - T975_8 * sd / 3, m + T975_8 * sd / 3))
    # the pairs of 3 + 3 seeds: 3 independent values, so the interval is the wider one
    lo, hi = stats.t_interval(nine, n=3)
    assert (lo, hi) == pytest.approx((m - T975_2 * sd / math.sqrt(3), m + T975_2 * sd / math.sqrt(3)))
    assert lo < 1.3 < hi
    for kwargs in ({"n": 1}, {"n": 10}, {"n": 3.0}, {"level": 1.0}):
        with pytest.raises(ValueError):
            stats.t_interval(nine, **kwargs)
    with pytest.raises(ValueError, match="at least 2"):
        stats.t_interval([1.0])


def test_target_verdict_says_inconclusive_when_the_interval_straddles():
    assert stats.target_verdict((1.35, 1.6), 1.3) == "met"
    assert stats.target_verdict((1.11, 1.82), 1.3) == "inconclusive"
    assert stats.target_verdict((1.0, 1.2), 1.3) == "NOT met"
    assert stats.target_verdict((0.5, 0.9), 1.0, higher_is_better=False) == "met"
    assert stats.target_verdict((0.9, 1.1), 1.0, higher_is_better=False) == "inconclusive"
    assert stats.target_verdict((1.1, 1.2), 1.0, higher_is_better=False) == "NOT met"


def fake_record(finals: dict) -> dict:
    """Runs evaluated at steps 100 and 200 ending at ``finals``: dense falls 1 nat, the others 0.3."""
    runs = [{"name": "dense", "seed": s, "val_steps": [100, 200], "val": [v + 1.0, v], "flops_per_step": 1,
             "train_seconds": [1.0, 2.0]} for s, v in enumerate(finals["dense"])]
    runs += [{"name": n, "seed": s, "val_steps": [100, 200], "val": [v + 0.3, v], "flops_per_step": 1,
              "train_seconds": [1.0, 2.0]} for n in ("MoE", "dense-wide") for s, v in enumerate(finals[n])]
    return {"runs": runs, "jobs": 1, "config": {"name": "test", "threads": 1}}


def test_speedup_verdict_comes_from_the_t_interval():
    rec = fake_record({"dense": [2.0, 2.05, 1.95], "MoE": [1.9, 1.7, 1.8], "dense-wide": [1.6, 1.61, 1.62]})
    s = summary.summarize(rec)
    sp = s["speedup"]
    m = sum(sp["values"]) / 9
    sd = math.sqrt(sum((v - m) ** 2 for v in sp["values"]) / 8)
    assert sp["t_n"] == 3 and sp["t_ci"] == pytest.approx((m - T975_2 * sd / math.sqrt(3),
                                                           m + T975_2 * sd / math.sqrt(3)))
    lo, hi = sp["t_ci"]
    for target, want in ((lo - 0.01, "met"), ((lo + hi) / 2, "inconclusive"), (hi + 0.01, "NOT met")):
        assert summary.target_verdict(sp, target) == want
        assert summary.target_met(sp, target) == (want == "met")
        assert f"target ≥ {target}: {want}" in "\n".join(summary.verdict_lines(s, target))
    two = summary.summarize(fake_record({"dense": [2.0, 2.05], "MoE": [1.9, 1.7], "dense-wide": [1.6, 1.61]}))
    assert summary.target_verdict(two["speedup"], 0.5) == "inconclusive"     # fewer than 3 seeds per arm


def test_summarize_holds_every_test_of_the_record_in_one_family():
    rec = fake_record({"dense": [2.0, 2.05, 1.95], "MoE": [1.9, 1.7, 1.8], "dense-wide": [1.6, 1.61, 1.62]})
    for name, finals in (("E=k=2", [2.1, 2.12, 2.08]), ("E=4", [1.85, 1.8, 1.9])):
        rec["runs"] += [{"name": name, "seed": s, "val_steps": [100, 200], "val": [v + 0.3, v],
                         "flops_per_step": 1, "train_seconds": [1.0, 2.0]} for s, v in enumerate(finals)]
    s = summary.summarize(rec)
    # 3 main tests + E=k=2 vs dense + equal time + 2 ablations vs MoE
    assert s["family"] == 7 and s["gated_vs_dense"].names == ("E=k=2", "dense")
    tests = [s["moe_vs_dense"], s["moe_vs_wide"], s["wide_vs_dense"], s["gated_vs_dense"],
             s["equal_time"]["comparison"], *s["ablations"].values()]
    assert [t.p for t in tests] == pytest.approx(stats.holm_adjust([t.p_raw for t in tests]))
    lines = "\n".join(summary.verdict_lines(s))
    assert "E=k=2" in lines and "the 7 tests on this record are one family" in lines
    assert summary.ablation_lines(s)[0] == s["ablations"]["E=k=2"].sentence("nats", "test")
