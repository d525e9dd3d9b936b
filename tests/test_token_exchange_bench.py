"""``benchmarks/token_exchange.py``'s verdict (issue 40: is the lab's FastMoE-style exchange at least as fast per
step as DeepSpeed's?): the paired round medians take the slowest rank of each step, and the verdict is "yes" or
"NO" only when the paired difference's 95% interval excludes 0, "inconclusive" when it does not (negative
controls: the same rounds with the arms swapped say "NO", noisy rounds say "inconclusive")."""
from __future__ import annotations

import pathlib

import pytest
from script_loader import load_script

from labutils.stats import holm, paired

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "token_exchange.py"


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT, "token_exchange_bench")


def test_paired_medians_take_the_slowest_rank_per_step_then_the_median_per_round(bench):
    rank0 = {"fastmoe": [[1.0, 5.0, 3.0], [2.0, 2.0, 2.0]], "ds drop": [[4.0, 4.0, 4.0], [1.0, 9.0, 1.0]]}
    rank1 = {"fastmoe": [[2.0, 1.0, 1.0], [3.0, 1.0, 7.0]], "ds drop": [[5.0, 1.0, 1.0], [1.0, 1.0, 1.0]]}
    got = bench.paired_medians([rank0, rank1])
    assert got == {"fastmoe": [3.0, 3.0], "ds drop": [4.0, 1.0]}     # max over ranks: [2,5,3] and [3,2,7]


def _line(bench, a, b):
    c = paired(a, b, names=bench.PAIR, lower_is_better=True)
    return bench.verdict_line("8", c, {"fastmoe": a, "ds drop": b})


def test_the_verdict_says_yes_no_or_inconclusive_from_the_paired_interval(bench):
    fast = [0.040, 0.042, 0.039, 0.041, 0.043, 0.040]
    slow = [0.050, 0.049, 0.052, 0.051, 0.050, 0.053]
    yes = _line(bench, fast, slow)
    assert yes.startswith("W=8: is fastmoe at least as fast as ds drop? yes, fastmoe is faster: median of 6 paired "
                          "rounds 40.5 ms"), yes
    assert "95% CI [-" in yes and "ms, p = " in yes
    no = _line(bench, slow, fast)                                     # negative control: the arms swapped
    assert "? NO, fastmoe is slower: " in no, no
    noisy = [0.030, 0.060, 0.041, 0.055, 0.035, 0.052]                 # the same means, no clear sign
    maybe = _line(bench, noisy, [0.045, 0.044, 0.046, 0.045, 0.044, 0.046])
    assert "? inconclusive (the difference's 95% CI includes 0): " in maybe, maybe


def test_the_verdicts_over_world_sizes_are_one_holm_family(bench):
    fast = [0.040, 0.042, 0.039, 0.041, 0.043, 0.040]
    slow = [0.050, 0.049, 0.052, 0.051, 0.050, 0.053]
    family = holm({w: paired(fast, slow, names=bench.PAIR) for w in ("2", "4", "8")})
    line = bench.verdict_line("2", family["2"], {"fastmoe": fast, "ds drop": slow})
    assert "yes, fastmoe is faster" in line
    noisy = holm({"2": paired([0.03, 0.06, 0.041, 0.055], [0.045, 0.044, 0.046, 0.045], names=bench.PAIR),
                  "4": paired(fast, slow, names=bench.PAIR)})
    line = bench.verdict_line("2", noisy["2"], {"fastmoe": [0.03, 0.06, 0.041, 0.055],
                                                "ds drop": [0.045, 0.044, 0.046, 0.045]})
    assert "inconclusive (the difference's 95% CI includes 0 after Holm over 2 world sizes)" in line, line
