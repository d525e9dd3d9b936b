"""Chapter 03's report functions (labbook/reports/ch03.py) on the results dict of the executed chapter (preset tiny,
recorded below as a literal) and on altered copies where a verdict flips: each sentence must follow its numbers."""
import copy
import math

import pytest

from labbook.reports import ch03
from labutils.stats import Comparison

NAMES = ("the cut alone (aux 0, cut 1.2)", "the loss alone (aux 0.01, no cut)")
FREE, RANDOM, LOSS = "NaiveGate: no loss, no cut", "GShard: aux 0, no cut", "GShard: aux 0.01, no cut"
CUT, BOTH = "GShard: aux 0, cut 1.2", "GShard: aux 0.01, cut 1.2 (default)"


def paired(mean_a, mean_b, ci, t, p, verdict, lower_is_better=True):
    """A recorded ``stats.paired`` result (3 vs 3 seeds), as the chapter's cut-vs-loss comparisons hold it."""
    return Comparison(names=NAMES, n_a=3, n_b=3, mean_a=mean_a, mean_b=mean_b, sd_a=0.03, sd_b=0.1,
                      diff=mean_a - mean_b, ci=ci, t=t, df=2, p=p, test="paired", verdict=verdict,
                      lower_is_better=lower_is_better, alpha=0.05, p_raw=math.nan)


def runs(busiest, quietest, kept):
    return {"busiest": busiest, "quietest": quietest, "kept_busiest": kept}


TINY = {FREE: runs([3.9987, 4.0, 4.0], [0.0, 0.0, 0.0], [3.9987, 4.0, 4.0]),
        RANDOM: runs([4.0, 4.0, 4.0], [0.0, 0.0, 0.0], [7.4608, 6.7378, 7.5723]),
        LOSS: runs([2.1302, 1.9160, 2.1647], [0.2194, 0.3561, 0.2663], [2.3416, 2.0762, 2.4228]),
        CUT: runs([1.3320, 1.2865, 1.3418], [0.0143, 0.0065, 0.0384], [1.3137, 1.2846, 1.3475]),
        BOTH: runs([1.1719, 1.2174, 1.2207], [0.2428, 0.1940, 0.4414], [1.1867, 1.2297, 1.2178])}
FULL = {FREE: runs([15.9958, 16.0, 16.0], [0.0, 0.0, 0.0], [15.9958, 16.0, 16.0]),
        RANDOM: runs([15.9604, 16.0, 16.0], [0.0, 0.0, 0.0], [16.2930, 19.1060, 18.6365]),
        LOSS: runs([1.6302, 1.5448, 1.8229], [0.6719, 0.6385, 0.6396], [1.6664, 1.5730, 1.8890]),
        CUT: runs([1.7823, 1.71875, 1.8], [0.0, 0.0052, 0.0073], [1.4963, 1.4905, 1.4751]),
        BOTH: runs([1.2740, 1.2125, 1.3083], [0.6927, 0.8135, 0.7719], [1.2037, 1.1630, 1.1743])}
RECORDED = {
    "preset": "tiny", "aux_coef": 0.01, "adam_gb": 4.365353472, "floor": 1.002027988433838,
    "counts": {"standard": {"attention": 4198400, "moe experts": 268599296, "router/gate": 32800, "norms": 4096},
               "hypothesis": {"attention": 5242880, "moe experts": 268599296, "router/gate": 32800, "norms": 4096}},
    "train": {"steps": 120, "first": 2.0508127, "last10": 1.0520818, "val_start": 2.0446436, "val_end": 1.0491759},
    "balance": {"E": 8, "d_model": 64, "steps": 120, "seeds": [0, 1, 2], "record": "balance_cut_vs_loss_full.json",
                "roles": {"free": FREE, "random": RANDOM, "loss": LOSS, "cut": CUT, "both": BOTH}, "runs": TINY,
                "init": {"busiest": [1.5, 1.34375, 1.25], "quietest": [0.578125, 0.65625, 0.75],
                         "random_busiest": 1.1742969, "random_quietest": 0.8389844},
                "kept_share": [0.5361328, 0.5936686, 0.5282390], "busiest_kept": [1.0, 1.0, 1.0]},
    "cmp": {"tiny": (paired(1.3201, 2.0703, (-1.0116, -0.4888), -12.349, 0.0064936, "ahead"),
                     paired(0.019748, 0.28060, (-0.4539, -0.0678), -5.8142, 0.02833, "behind", False)),
            "full": (paired(1.7670, 1.6660, (-0.1670, 0.3691), 1.6219, 0.24629, "inconclusive"),
                     paired(0.0041667, 0.65, (-0.7019, -0.5898), -49.587, 0.00040645, "behind", False))},
    "full": {"preset": "full", "num_expert": 32, "d_model": 128, "steps": 300, "seeds": [0, 1, 2], "runs": FULL},
    "full_scale": {"parameters": 273879072, "tokens_per_step": 64, "threads": 2, "steps": [8.1, 8.4, 8.6],
                   "median_step_seconds": 8.422430686, "sizes": {"num_expert": 32},
                   "median_phase_seconds": {"forward": 0.9014216, "backward": 2.7398417, "adam": 4.9734362},
                   "peak_rss_bytes": 5868830720, "baseline_rss_bytes": 264949760, "peak_over_theory": 1.3392842,
                   "theory_bytes": {"total": 4382065152}},
}


@pytest.fixture
def R():
    return copy.deepcopy(RECORDED)


def test_count_table_sets_the_book_beside_both_counts(R):
    md = ch03.count_table(R)
    assert "| attention | ~5.24M | 4,198,400 | 5,242,880 |" in md
    assert "| MoE layer (experts + router) | ~268M | 268,632,096 | 268,632,096 |" in md
    assert "| total | ~273M | 272,834,592 | 273,879,072 |" in md
    R["counts"]["hypothesis"]["attention"] = 5248000          # the hypothesis with biases: the row follows
    assert "| attention | ~5.24M | 4,198,400 | 5,248,000 |" in ch03.count_table(R)


def test_balance_table_writes_each_run_mean_and_range(R):
    md = ch03.balance_table(R)
    assert "**5 runs × 3 seeds × 120 steps** (E = 8, d = 64;" in md
    assert f"| {RANDOM} | 4.00 [4.00, 4.00] | 0.00 [0.00, 0.00] | 7.26 [6.74, 7.57] |" in md
    assert f"| {CUT} | 1.32 [1.29, 1.34] | 0.02 [0.01, 0.04] | 1.32 [1.28, 1.35] |" in md


def test_kept_vs_demand_explains_7_26_against_4_00(R):
    md = ch03.kept_vs_demand(R)
    assert "busiest/mean 1.36 [1.25, 1.50] and quietest/mean 0.66 [0.58, 0.75]" in md
    assert "uniformly at random give 1.17 and 0.84" in md
    assert "nearer to a random draw than to the collapse" in md and "a little more uneven than chance" in md
    assert "the demand's busiest/mean is 4.00, yet the kept load's is 7.26" in md
    assert "kept 0.55 [0.53, 0.59] of the router's choices" in md and "kept all of its own" in md
    assert "seed 0: 4.00 × 1.00 / 0.536 = 7.46; seed 1: 4.00 × 1.00 / 0.594 = 6.74" in md
    # flipped: a router that starts as even as chance and already half collapsed; a busiest expert losing 10%
    R["balance"]["init"]["busiest"] = [3.0, 3.1, 2.9]
    R["balance"]["busiest_kept"] = [0.9, 1.0, 1.0]
    md = ch03.kept_vs_demand(R)
    assert "already close to the collapse" in md and "nearer to a random draw" not in md
    R["balance"]["init"]["busiest"] = [1.1, 1.1, 1.1]
    md = ch03.kept_vs_demand(R)
    assert "more uneven than chance" not in md and "at least 90% of its own" in md and "all of its own" not in md


def test_balance_headline_follows_the_verdict(R):
    want = "the cut spreads the demand more than the loss (1.32 vs 2.07 busiest/mean)"
    assert ch03.balance_headline(R).endswith(want)
    R["cmp"]["tiny"] = R["cmp"]["full"]
    assert "neither spreads the demand measurably more (1.77 vs 1.67" in ch03.balance_headline(R)


def test_balance_findings_say_where_the_presets_disagree(R):
    md = ch03.balance_findings(R)
    assert "busiest/mean 4.00 (k experts taking every choice would give E/k = 4)" in md
    assert "Busiest/mean: the cut spreads the demand more than the loss (the cut alone" in md
    assert "Quietest/mean: the loss keeps the quietest expert busier than the cut does" in md
    assert "Both together (GShard's default): busiest/mean 1.20, quietest/mean 0.29." in md
    assert f"appears under: {CUT};" in md
    assert "**disagrees** with the tiny preset's verdicts (busiest, quietest: inconclusive, behind there; ahead, " \
           "behind here)" in md and "neither preset's order is a general result" in md
    R["cmp"]["full"] = R["cmp"]["tiny"]                      # the record now agrees
    md = ch03.balance_findings(R)
    assert "agrees with the tiny preset's verdicts" in md and "general result" not in md
    R["full"] = None
    assert "No full-preset record of this section was found" in ch03.balance_findings(R)
    R["preset"], R["cmp"] = "full", {"full": R["cmp"]["tiny"]}
    assert "This preset's runs were written to `benchmarks/results/balance_cut_vs_loss_full.json`" in \
        ch03.balance_findings(R)


def test_summary_follows_the_numbers_and_the_record(R):
    md = ch03.summary(R)
    assert "268.63M parameters in the MoE layer (268.60M experts + 32.8K router), 4,096 in the norms" in md
    assert "4,198,400 in attention: 272.8M in all" in md and "(5,242,880), a hypothesis" in md
    assert "costs 4.37 GB of fp32 state" in md
    assert "train loss went 2.051 → 1.052 (book: 2.04 → 1.11) and the held-out loss 2.045 → 1.049" in md
    assert "floor of 1.00 for predicting 0: the block learned to output the targets' mean" in md
    assert "on the busiest expert the cut spreads the demand more than the loss (1.32 vs 2.07, p = 0.00649)" in md
    assert "The recorded full preset (E = 32) DISAGREES: busiest 1.77 vs 1.67 (inconclusive for the cut)" in md
    R["cmp"]["full"] = R["cmp"]["tiny"]
    assert "The recorded full preset (E = 32) agrees" in ch03.summary(R)
    R["full"] = None
    assert "No full-preset record of section 5 was found" in ch03.summary(R)
    R["preset"], R["cmp"] = "full", {"full": R["cmp"]["tiny"]}
    md = ch03.summary(R)
    assert "the full preset's few steps only start the fall" in md and "smoke test" not in md


def test_full_scale_names_the_largest_phase(R):
    md = ch03.full_scale(R)
    assert "273.9M parameters (+1.0M against the model trained here), 64 tokens per step, 2 threads" in md
    assert "**8.4 s per step** (median of 3: forward 0.9 s, backward 2.7 s, Adam 5.0 s)" in md
    assert "**peak RSS of 5.87 GB** against **4.38 GB**" in md and "(1.34×)" in md
    assert "The largest phase is **adam**: the optimiser, not the MoE arithmetic" in md and "all 32 experts" in md
    R["full_scale"]["median_phase_seconds"]["backward"] = 6.0
    md = ch03.full_scale(R)
    assert md.endswith("The largest phase is **backward**.") and "optimiser" not in md


@pytest.mark.parametrize(("fn", "key"), [(ch03.summary, "floor"), (ch03.count_table, "counts"),
                                         (ch03.kept_vs_demand, "balance"), (ch03.full_scale, "full_scale"),
                                         (ch03.balance_findings, "full")])
def test_a_missing_key_names_the_key(R, fn, key):
    del R[key]
    with pytest.raises(KeyError, match=key):
        fn(R)
