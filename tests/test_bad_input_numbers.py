"""Bad input, round four (issue 41): numbers that gave a silent wrong result (a dict of seeds averaged as its keys,
zero spread read as certainty, a NaN run, capacity formulas fed -1, NaN or E = -8, NaN router weights, a bias
hook that never moves a bias) and numbers that gave an obscure error deep inside torch now raise a clear error
before any work starts: its type, and a message naming the argument, the bad value and what is accepted.
The stats functions added since (holm, holm_adjust, t_interval, target_verdict, clears, all_pairs) are audited the
same way. Every refusal has a positive control beside it: the good input still gives the known value."""
import math
import re

import pytest
import torch

from labutils import stats
from labutils.moe import count_by_gate, limit_by_capacity
from labutils.moe.capacity import (
    deepspeed_capacity,
    deepspeed_dropless_capacity,
    drop_over_capacity,
    exact_capacity,
    expert_capacity,
    fastmoe_dc_capacity,
    fastmoe_gshard_capacity,
    fastmoe_switch_capacity,
    position_in_expert,
    token_choice_capacity,
)
from labutils.moe.fastmoe import api as fastmoe_api
from labutils.moe.layers import FMoE
from labutils.moe.modern.aux_free import attach_bias_update
from labutils.moe.modern.expert_choice import expert_choice_route
from labutils.moe.modern.layer import ModernMoE
from labutils.moe.modern.losses import balance_loss
from labutils.moe.modern.routers import TopKRouter

D = 8
NAN, INF = float("nan"), float("inf")
# chapter 05's recorded full run (as in tests/test_stats.py): final validation loss per seed, as {seed: loss}
MOE = {0: 1.41051062319317, 1: 1.4017574415229797, 2: 1.3774205088637423}
DENSE = {0: 1.4793448184983238, 1: 1.4887713565583465, 2: 1.4675742211499425}
DICT_HINT = r"iterating a dict gives its keys \(the seeds\?\), not its values: pass a sequence of values, e\.g\. " \
            r"list\(d\.values\(\)\)"


# -- labutils.stats: a dict of seeds --------------------------------------------------------------------------

@pytest.mark.parametrize("call, where", [
    (lambda: stats.welch(MOE, list(DENSE.values()), names=("MoE", "dense")), r"welch: a \(MoE\)"),
    (lambda: stats.welch(list(MOE.values()), DENSE, names=("MoE", "dense")), r"welch: b \(dense\)"),
    (lambda: stats.paired(MOE, list(DENSE.values())), r"paired: a \(A\)"),
    (lambda: stats.bootstrap_ci(MOE), r"bootstrap_ci: values"),
    (lambda: stats.all_pairs(MOE, [1.0], lambda a, b: a / b), r"all_pairs: a_values"),
    (lambda: stats.all_pairs([1.0], DENSE, lambda a, b: a / b), r"all_pairs: b_values"),
], ids=["welch-a", "welch-b", "paired", "bootstrap_ci", "all_pairs-a", "all_pairs-b"])
def test_stats_dict_of_seeds_is_refused(call, where):
    # seeds 0, 1, 2 as values gave "1.000 vs 1.000, inconclusive"
    with pytest.raises(TypeError, match=where + r" is a dict \(\{0: 1\.\d+, 1: 1\.\d+, 2: 1\.\d+\}\), and "
                       + DICT_HINT + "$"):
        call()


def test_stats_dict_of_seeds_control_its_values_give_the_recorded_verdict():
    c = stats.welch(list(MOE.values()), list(DENSE.values()), names=("MoE", "dense"))
    assert c.verdict == "ahead" and c.p == pytest.approx(0.004110104376199833, rel=1e-7)
    assert stats.paired(list(MOE.values()), list(DENSE.values())).verdict == "ahead"
    assert stats.all_pairs([2.0, 2.2], [1.0, 2.0], lambda a, b: a / b) == [2.0, 1.0, 2.2, 1.1]


# -- labutils.stats: zero spread ------------------------------------------------------------------------------

@pytest.mark.parametrize("a, b", [([1.0, 1.0, 1.0], [1.2, 1.2, 1.2]),
                                  ([0.1, 0.1, 0.1], [0.2, 0.2, 0.2])],   # rounding gave sd 1.7e-17, p = 1.8e-46
                         ids=["exact", "rounding"])
def test_welch_zero_spread_in_both_arms_is_refused(a, b):
    with pytest.raises(ValueError, match=rf"^welch: zero spread in both arms: every value of a \(MoE\) is {a[0]} "
                                         rf"and every value of b \(dense\) is {b[0]}; a t-test cannot tell .*"
                                         r"Accepted: runs whose values vary in at least one arm"):
        stats.welch(a, b, names=("MoE", "dense"))


def test_paired_zero_spread_of_the_differences_is_refused():
    with pytest.raises(ValueError, match=r"^paired: zero spread of the differences: every difference a\[i\] - b\[i\] "
                                         r"\(A - B\) is 0\.1000000000000000\d; a t-test cannot tell .*Accepted: "
                                         r"pairs whose differences vary"):
        stats.paired([1.1, 2.1, 3.1], [1.0, 2.0, 3.0])


def test_zero_spread_control_identical_arms_are_inconclusive_and_one_constant_arm_is_tested():
    same = stats.welch([0.1] * 3, [0.1] * 3)
    assert (same.verdict, same.p, same.t, same.ci) == ("inconclusive", 1.0, 0.0, (0.0, 0.0))
    assert "inconclusive (p = 1 >= 0.05)" in same.sentence()
    assert stats.paired([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]).p == 1.0
    # a constant target (chapter 08's one-sample use) is still a test: df = 2 gives p = 1 - t / sqrt(2 + t^2)
    c = stats.welch([0.95, 0.96, 0.97], [0.9] * 3, lower_is_better=False)
    t = 0.06 / (0.01 / math.sqrt(3))
    assert c.verdict == "ahead" and c.t == pytest.approx(t) and c.p == pytest.approx(1 - t / math.sqrt(2 + t * t))


# -- labutils.stats: a NaN run ----------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [NAN, INF], ids=repr)
def test_bootstrap_ci_non_finite_value_is_refused(bad):
    with pytest.raises(ValueError, match=rf"^bootstrap_ci: values: every value must be finite, got \[{bad}\] at "
                                         rf"position\(s\) \[2\] of \[1\.0, 2\.0, {bad}\]"):
        stats.bootstrap_ci([1.0, 2.0, bad])


def test_bootstrap_ci_non_finite_number_among_runs_is_refused_before_any_draw():
    calls = []

    def stat(sample):
        calls.append(1)
        return 1.0

    with pytest.raises(ValueError, match=r"^bootstrap_ci: values: every value must be finite, got \[nan\] at "
                                         r"position\(s\) \[1\]"):
        stats.bootstrap_ci([{"run": 0}, NAN], stat)
    assert calls == [], "refused before the first resample"
    with pytest.raises(ValueError, match=r"^bootstrap_ci: stat returned nan on a resample; it must return a "
                                         r"finite number"):
        stats.bootstrap_ci([{"run": 0}, {"run": 1}], lambda sample: NAN)


def test_clears_nan_interval_is_refused():
    with pytest.raises(ValueError, match=r"^clears: ci must be a \(low, high\) pair of finite numbers, got "
                                         r"\(nan, nan\)"):
        stats.clears((NAN, NAN), 1.3)
    with pytest.raises(ValueError, match=r"^clears: target must be a finite number, got nan"):
        stats.clears((1.35, 1.8), NAN)


def test_t_cdf_nan_t_is_refused():
    with pytest.raises(ValueError, match=r"^t_cdf: t must be a number or \+-inf, got nan"):
        stats.t_cdf(NAN, 3)


def test_nan_run_control_finite_values_give_the_known_interval():
    assert stats.bootstrap_ci([1.0, 2.0, 3.0, 4.0], seed=0) == (1.5, 3.5)
    runs = [{"loss": 1.0}, {"loss": 3.0}]
    lo, hi = stats.bootstrap_ci(runs, lambda sample: sum(r["loss"] for r in sample) / len(sample), seed=0)
    assert 1.0 <= lo <= 2.0 <= hi <= 3.0
    assert stats.clears((1.35, 1.8), 1.3) and not stats.clears((1.14, 1.8), 1.3)
    assert stats.t_cdf(INF, 3) == 1.0 and stats.t_cdf(-1.3, 4.5) == pytest.approx(1 - 0.871901956027983)


# -- labutils.stats: the functions added since (holm, holm_adjust, t_interval, target_verdict, clears, all_pairs) -----

ARM_A, ARM_B = [1.0, 1.1, 0.9], [2.0, 2.1, 1.9]


def test_holm_one_comparison_alone_is_refused():
    c = stats.welch(ARM_A, ARM_B)
    with pytest.raises(TypeError, match=r"^holm: comparisons must be a list or dict of every Comparison in the "
                                        r"family \(one Comparison alone is a family of one: nothing to adjust\), got "
                                        r"Comparison$"):   # was "'Comparison' object is not iterable"
        stats.holm(c)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"^holm: comparisons must be a list or dict .*, got NoneType$"):
        stats.holm(None)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"^holm: 1 is float, expected a Comparison \(from welch or paired\)$"):
        stats.holm([c, 0.03])


def test_holm_adjust_bad_p_values_are_refused():
    with pytest.raises(TypeError, match=r"^holm_adjust: pvalues is a dict"):
        stats.holm_adjust({"a": 0.01})
    with pytest.raises(TypeError, match=r"^holm_adjust: pvalues: expected a sequence of numbers, got 0\.03$"):
        stats.holm_adjust(0.03)
    with pytest.raises(ValueError, match=r"^holm_adjust: pvalues: every value must be finite, got \[nan\]"):
        stats.holm_adjust([0.01, NAN])
    with pytest.raises(ValueError, match=r"^holm_adjust: p-values must lie in \[0, 1\], got \[1\.5, -0\.1\]"):
        stats.holm_adjust([0.01, 1.5, -0.1])


def test_holm_control_a_list_of_comparisons_is_adjusted():
    a, b = stats.welch(ARM_A, ARM_B), stats.welch(ARM_A, [1.05, 1.2, 1.0])
    assert [c.p for c in stats.holm([a, b])] == pytest.approx(stats.holm_adjust([a.p, b.p]))
    assert stats.holm(()) == [] and stats.holm({}) == {}  # type: ignore[call-overload]


def test_t_interval_zero_spread_is_the_documented_point_interval():
    """Deliberate (t_interval's docstring): no spread gives the point (v, v), its zero width in plain sight, and
    target_verdict judges that point. Refusing it, as welch refuses zero spread, would stop chapter 05's summary
    whenever every seed pair reaches dense's loss at the same evaluation."""
    assert "deliberately NOT refused" in (stats.t_interval.__doc__ or "")
    assert stats.t_interval([2.0, 2.0, 2.0]) == (2.0, 2.0)
    assert stats.target_verdict(stats.t_interval([2.0, 2.0, 2.0], n=2), 1.3) == "met"


@pytest.mark.parametrize("kwargs, words", [
    (dict(level="0.9"), r"level must be a number in \(0, 1\), e\.g\. 0\.95, got '0\.9'"),
    (dict(level=NAN), r"level must be a number in \(0, 1\), e\.g\. 0\.95, got nan"),
    (dict(level=95), r"level must be a number in \(0, 1\), e\.g\. 0\.95, got 95"),
    (dict(n=True), r"n must be an int from 2 to len\(values\) = 3, got True"),
], ids=["str-level", "nan-level", "percent-level", "bool-n"])
def test_t_interval_bad_arguments_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=r"^t_interval: " + words + "$"):
        stats.t_interval([1.0, 2.0, 3.0], **kwargs)


def test_t_interval_control_values_that_vary():
    t975_2 = 4.302652729749462   # scipy.stats.t.ppf(0.975, 2)
    assert stats.t_interval([1.0, 2.0, 3.0]) == pytest.approx((2 - t975_2 / math.sqrt(3), 2 + t975_2 / math.sqrt(3)))


@pytest.mark.parametrize("call", [lambda: stats.clears((1.8, 1.14), 1.3),
                                  lambda: stats.target_verdict((1.8, 1.14), 1.3)], ids=["clears", "target_verdict"])
def test_clears_swapped_bounds_are_refused(call):
    # (high, low) was judged by its high bound: "met" for an interval that straddles the target
    with pytest.raises(ValueError, match=r"^clears: ci must be a \(low, high\) pair with low <= high, got "
                                         r"\(1\.8, 1\.14\): swapped bounds\? pass \(1\.14, 1\.8\)$"):
        call()


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(target="1.3"), ValueError, r"target must be a finite number, got '1\.3'"),
    (dict(target=True), ValueError, r"target must be a finite number, got True"),
    (dict(ci=("1.35", 1.8)), ValueError, r"ci must be a \(low, high\) pair of finite numbers, got \('1\.35', 1\.8\)"),
    (dict(ci=1.5), ValueError, r"ci must be a \(low, high\) pair of finite numbers, got 1\.5"),
    (dict(higher_is_better="no"), TypeError, r"higher_is_better must be True or False, got 'no'"),
], ids=["str-target", "bool-target", "str-bound", "one-number", "str-direction"])
def test_clears_and_target_verdict_bad_arguments_are_refused(kwargs, error, words):
    args = {"ci": (1.35, 1.8), "target": 1.3, **kwargs}
    for fn in (stats.clears, stats.target_verdict):
        with pytest.raises(error, match=r"^clears: " + words + "$"):
            fn(**args)


def test_clears_control_a_point_interval_and_tensor_bounds():
    assert stats.clears((1.3, 1.3), 1.3) and stats.target_verdict((1.0, 1.2), 1.3) == "NOT met"
    assert stats.clears((torch.tensor(1.35), torch.tensor(1.8)), 1.3)


@pytest.mark.parametrize("call, error, words", [
    (lambda: stats.all_pairs([1.0], [2.0], 3), TypeError, r"fn must be a function of a pair \(a, b\), got 3"),
    (lambda: stats.all_pairs(3, [2.0], lambda a, b: a), TypeError,
     r"a_values must be a sequence \(of runs or values\), got 3"),
    (lambda: stats.all_pairs([1.0], "ab", lambda a, b: a), TypeError,
     r"b_values must be a sequence \(of runs or values\), got 'ab'"),
    (lambda: stats.all_pairs([1.0, 2.0], [2.0], lambda a, b: NAN if a == 2.0 else a / b), ValueError,
     r"fn returned nan for the pair a_values\[1\], b_values\[0\]; it must return a finite number, or None to "
     r"leave the pair out"),
    (lambda: stats.all_pairs([1.0], [2.0], lambda a, b: "x"), ValueError, r"fn returned 'x' for the pair"),
], ids=["fn-not-callable", "a-not-a-sequence", "b-a-str", "nan-result", "str-result"])
def test_all_pairs_bad_arguments_are_refused(call, error, words):
    with pytest.raises(error, match=r"^all_pairs: " + words):
        call()


def test_bootstrap_ci_stat_not_callable_is_refused():
    with pytest.raises(TypeError, match=r"^bootstrap_ci: stat must be a function of a resample \(a list\), or None "
                                        r"for the mean, got 3$"):   # was "'int' object is not callable"
        stats.bootstrap_ci([1.0, 2.0], 3)
    with pytest.raises(ValueError, match=r"^bootstrap_ci: level must be a number in \(0, 1\), e\.g\. 0\.95, got "
                                         r"'0\.9'$"):
        stats.bootstrap_ci([1.0, 2.0], level="0.9")  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs, words", [
    (dict(names=("MoE",)), r"names must be a pair \(the name of a, the name of b\), e\.g\. \('MoE', 'dense'\), got "
                           r"\('MoE',\)"),   # was IndexError: tuple index out of range
    (dict(names="MoE"), r"names must be a pair .*, got 'MoE'"),
    (dict(alpha="0.05"), r"alpha must be a number in \(0, 1\), e\.g\. 0\.05, got '0\.05'"),
    (dict(min_n=True), r"min_n must be an int >= 2 \(a t-test needs two values per arm\), got True"),
], ids=["one-name", "str-names", "str-alpha", "bool-min_n"])
def test_welch_and_paired_bad_arguments_are_refused(kwargs, words):
    for name, fn in (("welch", stats.welch), ("paired", stats.paired)):
        with pytest.raises(ValueError, match=rf"^{name}: " + words + "$"):
            fn(ARM_A, ARM_B, **kwargs)


# -- labutils.moe.capacity: every formula ---------------------------------------------------------------------

FORMULAS = {  # name -> (function, good keyword arguments, the name of its factor)
    "deepspeed_capacity": (deepspeed_capacity, dict(num_tokens=100, num_experts=4, capacity_factor=1.2),
                           "capacity_factor"),
    "exact_capacity": (exact_capacity, dict(num_tokens=100, num_experts=4, capacity_factor=1.2), "capacity_factor"),
    "token_choice_capacity": (token_choice_capacity, dict(num_tokens=6, num_experts=3, capacity_factor=0.5, k=2),
                              "capacity_factor"),
    "expert_capacity": (expert_capacity, dict(num_tokens=512, num_experts=8, capacity_factor=2.0), "capacity_factor"),
    "fastmoe_gshard_capacity": (fastmoe_gshard_capacity, dict(num_tokens=64, factor=1.2, top_k=2, tot_expert=8),
                                "factor"),
    "fastmoe_switch_capacity": (fastmoe_switch_capacity, dict(num_tokens=64, factor=1.2, num_expert=4), "factor"),
    "fastmoe_dc_capacity": (fastmoe_dc_capacity, dict(num_tokens=64, factor=1.2), "factor"),
}
KNOWN = {"deepspeed_capacity": 31, "exact_capacity": 30, "token_choice_capacity": 2, "expert_capacity": 128,
         "fastmoe_gshard_capacity": 19, "fastmoe_switch_capacity": 20, "fastmoe_dc_capacity": 77}


def _with(name, **change):
    fn, kw, _ = FORMULAS[name]
    return lambda: fn(**{**kw, **change})


@pytest.mark.parametrize("bad", [-1, -0.5, NAN, INF, -INF], ids=repr)
@pytest.mark.parametrize("name", FORMULAS)
def test_capacity_factor_negative_or_non_finite_is_refused(name, bad):
    factor = FORMULAS[name][2]
    bound = "> 0" if name == "expert_capacity" else ">= 0"
    with pytest.raises(ValueError, match=rf"^{name}: {factor} must be a finite number {bound}, got "
                                         rf"{re.escape(repr(bad))}$"):
        _with(name, **{factor: bad})()


@pytest.mark.parametrize("bad", [0, -8, 4.0], ids=repr)
@pytest.mark.parametrize("name", [n for n in FORMULAS if n != "fastmoe_dc_capacity"])
def test_capacity_number_of_experts_below_one_is_refused(name, bad):
    arg = next(a for a in FORMULAS[name][1] if a in ("num_experts", "num_expert", "tot_expert"))
    with pytest.raises(ValueError, match=rf"^{name}: {arg} must be an int >= 1, got {re.escape(repr(bad))}$"):
        _with(name, **{arg: bad})()


@pytest.mark.parametrize("bad", [-1, 10.0], ids=repr)
@pytest.mark.parametrize("name", FORMULAS)
def test_capacity_negative_token_count_is_refused(name, bad):
    with pytest.raises(ValueError, match=rf"^{name}: num_tokens must be an int >= 0, got {re.escape(repr(bad))}$"):
        _with(name, num_tokens=bad)()


@pytest.mark.parametrize("name, arg", [("deepspeed_capacity", "k"), ("exact_capacity", "k"),
                                       ("token_choice_capacity", "k"), ("fastmoe_gshard_capacity", "top_k")])
def test_capacity_k_below_one_is_refused(name, arg):
    with pytest.raises(ValueError, match=rf"^{name}: {arg} must be an int >= 1, got -2$"):
        _with(name, **{arg: -2})()


@pytest.mark.parametrize("counts", [torch.tensor([3, -1]), torch.tensor([[1.5, 2.0]]), torch.tensor([]),
                                    torch.tensor([1.0, NAN])], ids=["negative", "fraction", "empty", "nan"])
def test_dropless_capacity_bad_counts_are_refused(counts):
    with pytest.raises(ValueError, match=r"^deepspeed_dropless_capacity: local_expert_counts must be a non-empty "
                                         r"\(W, E\) or \(E,\) tensor of counts \(whole numbers >= 0\), got tensor"):
        deepspeed_dropless_capacity(counts)


@pytest.mark.parametrize("name", FORMULAS)
def test_capacity_control_known_values(name):
    assert _with(name)() == KNOWN[name]


def test_capacity_control_zero_tokens_is_an_empty_batch():
    """T = 0 is legitimate (an empty batch): every formula gives 0 slots (DeepSpeed: its min_capacity floor);
    expert choice gave 1, a token that does not exist."""
    assert deepspeed_capacity(0, 4, 1.2) == exact_capacity(0, 4, 1.2) == 0
    assert deepspeed_capacity(0, 4, 1.2, min_capacity=4) == 4
    assert token_choice_capacity(0, 4, 1.2, 2) == expert_capacity(0, 4, 2.0) == 0
    assert fastmoe_gshard_capacity(0, 1.2, 2, 8) == fastmoe_switch_capacity(0, 1.2, 4) == 0
    assert fastmoe_dc_capacity(0, 1.2) == 0
    assert deepspeed_dropless_capacity(torch.zeros(2, 4, dtype=torch.long)) == 0
    assert deepspeed_dropless_capacity(torch.tensor([[1, 5], [2, 0]])) == 5
    assert expert_capacity(3, 8, 0.5) == 1   # at least one token per expert when there are tokens
    tok, gates = expert_choice_route(torch.zeros(0, 4), expert_capacity(0, 4, 2.0))
    assert tok.shape == gates.shape == (4, 0)


# -- fastmoe's limit_by_capacity and count_by_gate: num_expert = 0 --------------------------------------------

GATE_IDX = torch.tensor([[0, 1], [1, 0], [1, -1]])   # (T=3, k=2)


@pytest.mark.parametrize("call, message", [
    (lambda: limit_by_capacity(GATE_IDX, 0, world_size=1, capacity=2),
     r"^limit_by_capacity: num_expert must be an int >= 1, got 0$"),
    (lambda: fastmoe_api.limit_by_capacity(GATE_IDX, 0, 1, 2),
     r"^limit_by_capacity: num_expert must be an int >= 1, got 0$"),
    (lambda: limit_by_capacity(GATE_IDX, 2, world_size=0, capacity=2),
     r"^limit_by_capacity: world_size must be an int >= 1, got 0$"),
    (lambda: drop_over_capacity(GATE_IDX, 0, 2), r"^drop_over_capacity: tot_expert must be an int >= 1, got 0$"),
], ids=["core", "fastmoe-face", "world_size", "drop_over_capacity"])
def test_limit_by_capacity_no_expert_is_refused(call, message):
    with pytest.raises(ValueError, match=message):   # was torch's "shape '[1, 0]' is invalid for input of size 2"
        call()


@pytest.mark.parametrize("call, message", [
    (lambda: count_by_gate(GATE_IDX, 0), r"^count_by_gate: num_expert must be an int >= 1, got 0$"),
    (lambda: count_by_gate(GATE_IDX, -2), r"^count_by_gate: num_expert must be an int >= 1, got -2$"),
    (lambda: count_by_gate(GATE_IDX, 2, 0), r"^count_by_gate: world_size must be an int >= 1, got 0$"),
    (lambda: fastmoe_api.count_by_gate(GATE_IDX, 0, 1),
     r"^the gate: num_expert \* world_size = 0: there is no expert to route to; num_expert and world_size must "
     r"each be an int >= 1$"),
], ids=["core", "negative", "world_size", "fastmoe-face"])
def test_count_by_gate_no_expert_is_refused(call, message):
    with pytest.raises(ValueError, match=message):   # 0 experts gave empty counts, silently
        call()


def test_no_expert_control_known_counts_and_drops():
    pos, counts = count_by_gate(GATE_IDX, 2)
    assert counts.tolist() == [2, 3] and pos.tolist() == [0, 3, 1, 2, 4]
    _, lec, gec = fastmoe_api.count_by_gate(GATE_IDX, 2, 1)
    assert lec.tolist() == gec.tolist() == [2, 3]
    new_lec, new_gec, idx = limit_by_capacity(GATE_IDX, 2, world_size=1, capacity=2)
    assert new_lec.tolist() == new_gec.tolist() == [2, 2]
    assert idx.tolist() == [[0, -1], [1, 0], [1, -1]]   # first choices first: expert 1 is full before token 0's 2nd
    assert fastmoe_api.limit_by_capacity(GATE_IDX, 2, 1, 2)[2].tolist() == idx.tolist()


# -- the modern router and layer ------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [NAN, INF, 0.0, -1.0], ids=repr)
def test_router_route_scale_non_finite_is_refused(bad):
    with pytest.raises(ValueError, match=rf"^TopKRouter: route_scale must be a finite number > 0, got "
                                         rf"{re.escape(repr(bad))}$"):
        TopKRouter(D, 4, 2, route_scale=bad)   # NaN made every routing weight NaN


@pytest.mark.parametrize("arg", ["balance_coef", "z_coef"])
@pytest.mark.parametrize("bad", [NAN, INF, -0.01], ids=repr)
def test_router_loss_weight_non_finite_is_refused(arg, bad):
    with pytest.raises(ValueError, match=rf"^TopKRouter: {arg} must be a finite number >= 0, got "
                                         rf"{re.escape(repr(bad))}$"):
        ModernMoE(D, 16, 4, 2, balance="batch", **{arg: bad})   # NaN made the aux loss NaN


def test_router_bias_rate_infinite_is_refused():
    with pytest.raises(ValueError, match=r"^bias_rate must be None or a finite number > 0, got inf$"):
        TopKRouter(D, 4, 2, bias_rate=INF)


def test_router_top_k_float_is_refused():
    with pytest.raises(TypeError, match=r"^TopKRouter: top_k must be an int between 1 and num_experts=4, got 2\.0 "
                                        r"\(float\)$"):   # was torch's topk() TypeError at the first forward
        TopKRouter(D, 4, 2.0)
    with pytest.raises(TypeError, match=r"top_k must be an int between 1 and num_experts=4, got 2\.0"):
        ModernMoE(D, 16, 4, 2.0)


def test_router_control_scale_and_coefficients_give_the_known_weights_and_loss():
    torch.manual_seed(0)
    r = TopKRouter(D, 4, 2, route_scale=2.5, balance="batch", balance_coef=0.01)
    x = torch.randn(6, D)
    idx, w, s = r(x)
    want = torch.softmax(x @ r.gate.weight.t(), -1)
    assert torch.allclose(s, want) and torch.allclose(w, 2.5 * want.gather(1, idx))
    loss = r.get_loss()
    assert torch.isfinite(loss) and torch.allclose(loss, 0.01 * balance_loss(s, idx, None))


@pytest.mark.parametrize("bad", [INF, NAN, -1.0, 0], ids=repr)
def test_modern_moe_capacity_factor_infinite_is_refused(bad):
    with pytest.raises(ValueError, match=rf"^capacity_factor must be None \(dropless\) or a finite number > 0, got "
                                         rf"{re.escape(repr(bad))}$"):   # inf was an OverflowError at forward
        ModernMoE(D, 16, 4, 2, capacity_factor=bad)


def test_modern_moe_capacity_control_a_finite_factor_drops_the_known_share():
    torch.manual_seed(0)
    layer = ModernMoE(D, 16, 4, 2, capacity_factor=1.0).eval()
    x = torch.randn(10, D)
    assert layer(x).shape == (10, D)
    idx, _, _ = layer.router(x)                                                   # (10, 2)
    kept = (position_in_expert(idx, 4) < token_choice_capacity(10, 4, 1.0, 2)).float().mean().item()
    assert token_choice_capacity(10, 4, 1.0, 2) == 5 and float(layer.route(x, None)[2]) == pytest.approx(1 - kept)


def test_expert_choice_route_fractional_capacity_is_refused():
    with pytest.raises(TypeError, match=r"^expert_choice_route: capacity must be an int between 1 and the number "
                                        r"of tokens 6 \(expert_capacity\(T, E, capacity_factor\) gives it\), got "
                                        r"2\.5 \(float\)$"):   # was a TypeError inside the slicing
        expert_choice_route(torch.rand(6, 3), 2.5)


def test_expert_choice_route_control_known_tokens():
    scores = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.5, 0.5]])
    tok, gates = expert_choice_route(scores, 2)
    assert tok.tolist() == [[1, 2], [0, 2]] and gates.tolist() == [pytest.approx([0.8, 0.5]), pytest.approx([0.9, 0.5])]


# -- attach_bias_update on a model without a biased router ----------------------------------------------------

@pytest.mark.parametrize("model, found", [
    (torch.nn.Linear(D, D), r"it holds no router"),
    (ModernMoE(D, 16, 4, 2), r"its router\(s\) \['router'\] have no bias \(built with bias_rate=None\)"),
], ids=["no-router", "router-without-bias"])
def test_attach_bias_update_without_a_biased_router_is_refused(model, found):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=rf"^attach_bias_update: model \({type(model).__name__}\) has no router with "
                                         rf"an auxiliary-loss-free bias: {found}, so the hook would never move a "
                                         r"bias\. Expected a module holding a TopKRouter built with bias_rate=\.\.\."):
        attach_bias_update(opt, model)
    assert not opt._optimizer_step_pre_hooks, "refused before the hook is registered"


def test_attach_bias_update_wrong_argument_is_refused():
    model = ModernMoE(D, 16, 4, 2, bias_rate=1e-2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"^attach_bias_update: model must be an nn\.Module holding the router\(s\), "
                                        r"got SGD$"):
        attach_bias_update(model, opt)   # arguments swapped


def test_attach_bias_update_control_the_bias_moves_and_allow_none_attaches_to_a_dense_model():
    torch.manual_seed(0)
    model = ModernMoE(D, 16, 4, 2, bias_rate=1e-2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    handle = attach_bias_update(opt, model)
    assert model.router.expert_bias is not None
    model(torch.randn(12, D)).sum().backward()
    counts = model.router.tokens_per_expert.clone()
    opt.step()
    handle.remove()
    delta = 1e-2 * torch.sign(counts.mean() - counts)
    assert torch.allclose(model.router.expert_bias, delta - delta.mean())
    dense = torch.nn.Linear(D, D)
    attach_bias_update(torch.optim.SGD(dense.parameters(), lr=0.1), dense, allow_none=True).remove()


# -- fastmoe's mask_dict --------------------------------------------------------------------------------------

def _masked(value):
    torch.manual_seed(0)
    return FMoE(4, D, top_k=2, expert=lambda d: torch.nn.Linear(d, d), mask=torch.tensor([0, 1, 0, 0]),
                mask_dict={1: value})


@pytest.mark.parametrize("value, shape", [(torch.ones(D + 1), r"\(9,\)"), (torch.ones(3, D), r"\(3, 8\)")],
                         ids=["d_model+1", "3-choices"])
def test_mask_dict_value_of_the_wrong_shape_is_refused(value, shape):
    with pytest.raises(ValueError, match=rf"^mask_dict\[1\] has shape {shape}, which does not fit a masked row's "
                                         r"output: expected \(8,\) \(d, the experts' output width\) or \(2, 8\) "
                                         r"\(top_k, d\)$"):   # was torch's "shape mismatch: value tensor ..."
        _masked(value)(torch.randn(4, D))


@pytest.mark.parametrize("value", [torch.full((D,), 3.0), torch.full((2, D), 3.0), 3.0], ids=["d", "k-d", "number"])
def test_mask_dict_control_a_masked_row_takes_its_value(value):
    y = _masked(value)(torch.randn(4, D))
    assert torch.allclose(y[1], torch.full((D,), 3.0))   # the k gate scores of a row sum to 1
