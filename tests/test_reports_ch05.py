"""Chapter 05's report functions (labbook/reports/ch05.py) on the results dict of the executed chapter (the tiny
preset's live run and the recorded full run, written out below) and on altered copies where a verdict flips: each
sentence must follow its numbers."""
import copy

import pytest

from labbook.lm_study.config import StudyConfig
from labbook.lm_study.summary import Curve
from labbook.reports import ch05
from labutils.stats import Comparison


def welch(a, b, mean_a, mean_b, p, verdict, ci=(0.0, 0.0), n=3, family=11):
    """A recorded Welch comparison (Holm-adjusted over ``family`` tests) as ``lm_study.summary.summarize`` holds it."""
    return Comparison(names=(a, b), n_a=n, n_b=n, mean_a=mean_a, mean_b=mean_b, sd_a=0.01, sd_b=0.01,
                      diff=mean_a - mean_b, ci=ci, t=-7.5, df=3.8, p=p, test="Welch", verdict=verdict,
                      lower_is_better=True, alpha=0.05, family=family, p_raw=p / 9)


def live(n=2):
    """The tiny preset's live summary (2 seeds per arm: every verdict inconclusive by the seed rule)."""
    return {"preset": "tiny", "seeds": {"dense": n, "MoE": n, "dense-wide": n},
            "moe_vs_dense": welch("MoE", "dense", 2.457, 2.477, 0.405, "inconclusive", n=n, family=7),
            "wide_vs_dense": welch("dense-wide", "dense", 2.452, 2.477, 0.405, "inconclusive", n=n, family=7)}


SECONDS = {"dense": [47.95, 52.97, 51.33], "MoE": [73.66, 77.97, 74.88], "dense-wide": [117.93, 116.21, 118.58],
           "top-1": [69.38, 72.58, 72.49], "top-1 Switch": [70.15, 70.51, 70.51], "E=4": [65.07, 66.9, 67.77],
           "E=16": [86.25, 87.1, 87.18], "no balance loss": [88.15, 91.36, 90.14], "E=k=2": [65.36, 66.06, 65.48]}
STEPS = [125 * i for i in range(1, 17)]
RECORDED = {
    "preset": "tiny", "steps": 150,
    "split": {"val_files": 26, "val_chars": 346711, "covered": 0.10438377,
              "coverage": {"lib2to3/fixes/fix_nonzero.py": (633, 0.7172196), "email/mime/image.py": (3759, 0.7134876),
                           "lib2to3/pgen2/tokenize.py": (21158, 0.5353531),
                           "multiprocessing/popen_forkserver.py": (2279, 0.4695042),
                           "asyncio/events.py": (28458, 0.2006817), "idlelib/delegator.py": (1078, 0.1512059)}},
    "repeats": {"tiny": {"epochs": 0.0079834, "seen_share": 0.0081958, "twice_share": 0.0042490,
                         "poisson_twice_share": 0.0041108},
                "full": {"epochs": 0.4257827, "seen_share": 0.3512110, "twice_share": 0.2006535,
                         "poisson_twice_share": 0.2006840}},
    "models": {"dense": (32736, 32736, 97517568, 97517568), "MoE": (84128, 33824, 100663296, 100663296),
               "dense-wide": (82656, 82656, 248512512, 248512512),
               "top-1 Switch": (150192, 33264, 99090432, 92012544)},
    "flops_ratio": {"full": {"dense": 1.0, "MoE": 1.0169492, "dense-wide": 2.6271186},
                    "tiny": {"dense": 1.0, "MoE": 1.0322581, "dense-wide": 2.5483871}},
    "ffn_ratio": 4.0,
    "summary": live(), "control_summary": live(),
    "full_preset": StudyConfig(name="full"),
    "full": {"jobs": 2, "wall_seconds": 1531.8575, "config": {"fused_adam": True, "seeds": [0, 1, 2]},
             "corpus": {"train_chars": 9619930},
             "machine": {"date": "2026-11-25T18:56:27", "cpu": "AMD EPYC", "cores": 2, "torch": "2.13.0+cpu"},
             "runs": [{"name": n, "seed": s, "train_seconds": [t / 2, t], "clock": "process_time"}
                      for n, ts in SECONDS.items() for s, t in enumerate(ts)],
             "data_limited": {}},
    "full_summary": {
        "preset": "full", "family": 11, "target_speedup": 1.3,
        "moe_vs_dense": welch("MoE", "dense", 1.396875, 1.478563, 0.0240533, "ahead", ci=(-0.1134138, -0.0499627)),
        "moe_vs_wide": welch("MoE", "dense-wide", 1.396875, 1.384725, 1.0, "inconclusive"),
        "wide_vs_dense": welch("dense-wide", "dense", 1.384725, 1.478563, 0.0061434, "ahead"),
        "gated_vs_dense": welch("E=k=2", "dense", 1.492416, 1.478563, 0.7203367, "inconclusive"),
        "flops_ratio": {"dense": 1.0, "MoE": 1.0169492, "dense-wide": 2.6271186},
        "speedup": {"values": [1.3733, 1.4250, 1.6211, 1.4280, 1.4794, 1.6734, 1.3149, 1.3394, 1.5381], "pairs": 9,
                    "reached": 9, "seeds": (3, 3), "mean": 1.4658445, "ci": (1.3525885, 1.6087152),
                    "t_ci": (1.1578272, 1.7738617), "t_n": 3},
        "equal_time": {"seconds": 47.951371, "comparison": welch("MoE", "dense", 1.4949272, 1.4879997, 1.0,
                                                                  "inconclusive"),
                       "time_ratio": {"mean": 0.9950011}, "jobs": 2, "threads": 1, "clock": "process_time",
                       "train_seconds": {"dense": 50.750767, "MoE": 75.505096, "dense-wide": 117.57422}}},
    "curves": {"dense": Curve(STEPS, [2.412, 2.2316, 2.0669, 1.9375, 1.8326, 1.7546, 1.6993, 1.6539, 1.612, 1.5841,
                                      1.5611, 1.5388, 1.5263, 1.4989, 1.4876, 1.4786], [], [1.47934, 1.48877, 1.46757]),
               "MoE": Curve(STEPS, [2.4104, 2.2213, 2.0462, 1.9007, 1.7816, 1.6981, 1.6283, 1.5762, 1.5322, 1.4987,
                                    1.4774, 1.4596, 1.4359, 1.4182, 1.4062, 1.3969], [], [1.40785, 1.40363, 1.37915])},
    "control_full": {"wide_vs_dense": welch("dense-wide", "dense", 1.563025, 1.635730, 0.0025491, "ahead", family=4),
                     "moe_vs_dense": welch("MoE", "dense", 1.579376, 1.635730, 0.0038834, "ahead", family=4)},
    "busiest": {"MoE": [1.085146, 1.014971], "no balance loss": [1.813525, 1.491938], "top-1": [1.002881, 1.005947]},
    "seed0": 0,
}


@pytest.fixture
def R():
    return copy.deepcopy(RECORDED)


def test_near_duplicates_counts_the_twins(R):
    md = ch05.near_duplicates(R)
    assert "(measured, 26 validation files).** 10.4% of the validation characters" in md
    assert "4 files have 30% or more of their text covered, 8.0% of the validation text" in md
    assert "`lib2to3/fixes/fix_nonzero.py` (72% of 633 characters), `email/mime/image.py` (71% of 3,759" in md
    assert "`asyncio/events.py` (20% of 28,458 characters)." in md and "delegator" not in md
    R["split"]["coverage"]["idlelib/delegator.py"] = (1078, 0.31)           # a fifth near-twin
    assert "5 files have 30% or more of their text covered, 8.3% of the validation text" in ch05.near_duplicates(R)


def test_repeats_writes_each_preset(R):
    md = ch05.repeats(R)
    assert "- **tiny** preset: 0.008 epoch, 0.8% of the training characters seen, 0.4% of those" in md
    assert "- **full** preset: 0.426 epoch, 35.1% of the training characters seen, 20.1% of those seen twice or " \
           "more (Poisson: 20.1%)" in md
    R["repeats"]["full"]["twice_share"] = 0.62
    assert "62.0% of those seen twice or more (Poisson: 20.1%)" in ch05.repeats(R)


def test_model_table_sets_counted_beside_analytic(R):
    md = ch05.model_table(R)
    assert "| dense | 32,736 | 32,736 | 0.0975 | 0.0975 |" in md
    assert "| top-1 Switch | 150,192 | 33,264 | 0.0991 | 0.0920 |" in md
    R["models"]["MoE"] = (84128, 33824, 100663296, 50331648)
    assert "| MoE | 84,128 | 33,824 | 0.1007 | 0.0503 |" in ch05.model_table(R)


def test_dense_wide_cost_names_both_presets(R):
    md = ch05.dense_wide_cost(R)
    assert "Its feed-forward is 4× dense's" in md and "costs 2.63× dense's on the full preset (2.55× on tiny)" in md
    assert "and MoE's 1.017× (the router)" in md


def test_live_run_note_follows_the_seed_rule(R):
    md = ch05.live_run_note(R)
    assert "the **tiny** preset: 2 seeds per model and 150 steps, so by the book's rule every verdict" in md
    R["summary"] = live(3)
    md = ch05.live_run_note(R)
    assert "3 seeds per model" in md and md.endswith("the verdicts above are tests at 95%.")
    assert "*inconclusive*" not in md


def test_record_provenance_says_which_run_made_which_number(R):
    md = ch05.record_provenance(R)
    assert "made on 2026-11-25 (AMD EPYC, 2 cores, torch 2.13.0+cpu): 27 runs, 2 side by side, **25.5 minutes**" in md
    assert "Its ablations are E=16 (3 seeds), E=4 (3 seeds), E=k=2 (3 seeds), no balance loss (3 seeds), top-1 " \
           "(3 seeds), top-1 Switch (3 seeds)." in md
    assert "differ by up to 10% (dense), and *no balance loss*, which does MoE's work, took +19% of MoE's" in md
    assert md.endswith("so the CPU-time panel carries that much noise beyond the seeds' own.")
    R["full"]["runs"] = [r for r in R["full"]["runs"] if r["name"] != "E=16" or r["seed"] == 0]
    del R["full"]["data_limited"]
    md = ch05.record_provenance(R)
    assert "E=16 (1 seed)" in md and "every ablation on all 3 seeds, which this record does **not** hold" in md
    assert "The data-limited control was not recorded on the full preset yet." in md
    for r in R["full"]["runs"]:
        r["clock"] = "perf_counter"
    assert "Its time axis is wall-clock seconds of each run" in ch05.record_provenance(R)


def test_reading_full_follows_each_verdict(R):
    md = ch05.reading_full(R)
    assert "MoE ends 0.082 nats below dense: ahead, p = 0.0241 after Holm's correction over the 11 tests" in md
    assert "dense still falls 0.009 nats over its last 125 steps, while the gap stays between 0.079 and 0.090 " \
           "nats from step 1,250 on" in md
    assert "Against dense-wide, MoE is inconclusive (difference +0.012, p = 1.00): it keeps most of dense-wide's " \
           "gain at 39% of its FLOPs per step (middle panel: dense-wide costs 2.63× dense per step)" in md
    assert "t-interval [1.16, 1.77] of the mean over 9 seed pairs, counted as 3 independent values" in md
    assert "**inconclusive**. A percentile bootstrap says [1.35, 1.61]" in md and "(1.31–1.67)" in md
    assert "MoE is **inconclusive against dense** at 48 s (1.495 vs 1.488 nats, p = 1) and needs 1.01×" in md
    assert "Its 2,000 steps took 76 s against dense's 2,000 in 51 s (Adam fused): a step costs 1.49× dense's" in md
    assert "cancel within what 3 seeds can tell apart" in md
    eq = R["full_summary"]["equal_time"]
    eq["comparison"] = welch("MoE", "dense", 1.52, 1.48, 0.01, "behind")
    md = ch05.reading_full(R)
    assert "MoE is **behind dense** at 48 s" in md and "the per-step lead does not pay for it" in md
    R["full_summary"]["speedup"]["t_ci"] = (1.35, 1.6)
    assert "counted as 3 independent values because the pairs share seeds: **met**" in ch05.reading_full(R)


def test_regime_and_control_verdict_follow_the_regime_check(R):
    md = ch05.regime(R)
    assert "draws 4.1M characters from 9.6M (0.43 epoch; 20% of the characters it sees are seen twice or more), " \
           "and dense-wide is ahead of dense (p = 0.00614): the runs are limited by parameters, not data" in md
    assert "(same models on 1,000,000 characters, 4.1 epochs) tests it; on this page it ran on the tiny preset " \
           "only (section 5: MoE vs dense inconclusive), and the full-preset record holds it." in md
    md = ch05.control_verdict(R)
    assert "On 1,000,000 characters (4.1 epochs) dense-wide is ahead of dense (p = 0.00255): extra parameters " \
           "still help, so this control is **not** data-limited yet" in md
    assert "MoE vs dense there: ahead (gap 0.056 nats, p = 0.00388) against 0.082 nats on the whole corpus." in md
    assert md.endswith("where extra parameters stop helping.")
    R["full_summary"]["wide_vs_dense"] = welch("dense-wide", "dense", 1.47, 1.478563, 0.3, "inconclusive")
    del R["full"]["data_limited"]
    md = ch05.regime(R)
    assert "dense-wide is inconclusive against dense (p = 0.3): extra parameters are not shown to help" in md
    assert "has **not** been recorded on the full preset yet" in md
    R["control_full"]["wide_vs_dense"] = welch("dense-wide", "dense", 1.63, 1.635730, 0.5, "inconclusive", family=4)
    assert ch05.control_verdict(R).endswith("MoE keeps a gain even here: the hypothesis is not supported at this size.")
    R["control_full"]["moe_vs_dense"] = welch("MoE", "dense", 1.63, 1.635730, 0.5, "inconclusive", family=4)
    md = ch05.control_verdict(R)
    assert "so the control is data-limited" in md and md.endswith("shrinks toward a tie, as the hypothesis predicts.")


def test_busiest_per_layer_writes_each_layer(R):
    md = ch05.busiest_per_layer(R)
    assert "(last 20% of training, seed 0, layer 0 / layer 1): MoE with the balancing loss 1.09 / 1.01, without " \
           "it 1.81 / 1.49, NoisyGate top-1 1.003 / 1.006" in md
    R["busiest"]["no balance loss"] = [3.5, 1.2]
    assert "without it 3.50 / 1.20" in ch05.busiest_per_layer(R)


def test_summary_says_where_the_presets_disagree(R):
    md = ch05.summary(R)
    assert "- **This page's live run** (tiny preset): MoE vs dense inconclusive, dense-wide vs dense inconclusive, " \
           "data-limited MoE vs dense inconclusive." in md
    assert "MoE vs dense **ahead** (-0.082 nats, 95% CI [-0.113, -0.050]), dense-wide vs dense **ahead**, MoE vs " \
           "dense-wide **inconclusive**, E = k = 2 vs dense **inconclusive**; steps speed-up 1.47× (t-interval " \
           "[1.16, 1.77], target 1.3: **inconclusive**); at equal CPU time MoE is **inconclusive against dense**." in md
    assert md.endswith("- Where the presets disagree: the tiny preset cannot give a verdict (2 seeds), the full "
                       "one can.")
    R["summary"] = {**live(3), "moe_vs_dense": welch("MoE", "dense", 2.457, 2.477, 0.2, "inconclusive", family=7)}
    assert ch05.summary(R).endswith("the tiny preset and the full one reach different verdicts on MoE vs dense (3 "
                                    "seeds per arm here).")
    R["summary"] = live()
    R["summary"]["moe_vs_dense"] = R["full_summary"]["moe_vs_dense"]
    R["full_summary"]["gated_vs_dense"] = None
    md = ch05.summary(R)
    assert "Where the presets disagree" not in md and "E = k = 2" not in md and "MoE vs dense ahead, dense-wide" in md


@pytest.mark.parametrize(("fn", "key"), [(ch05.summary, "full_summary"), (ch05.near_duplicates, "split"),
                                         (ch05.reading_full, "curves"), (ch05.regime, "repeats"),
                                         (ch05.control_verdict, "control_full"), (ch05.live_run_note, "steps"),
                                         (ch05.busiest_per_layer, "seed0"), (ch05.record_provenance, "full_preset")])
def test_a_missing_key_names_the_key(R, fn, key):
    del R[key]
    with pytest.raises(KeyError, match=key):
        fn(R)
