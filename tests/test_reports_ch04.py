"""Chapter 04's report functions (labbook/reports/ch04.py): on the results dict recorded from the executed chapter
(tiny preset) they write the chapter's sentences; where a verdict flips, the sentence flips with it; a missing key is
named."""
from __future__ import annotations

import copy

import pytest
import torch

from labbook.reports import ch04


def _welch(epochs, mean_a, mean_b, diff, ci, t, p, verdict="ahead"):
    return {"epochs": epochs, "mean_a": mean_a, "mean_b": mean_b, "diff": diff, "ci": ci, "t": t, "p": p,
            "n_a": 64, "n_b": 64, "verdict": verdict}


RECORDED = {  # R at the end of notebooks/04_transformer_deepspeed.ipynb, tiny preset (Welch fields the report reads)
    "preset": "tiny", "num_experts": 4, "capacity_factor": 1.0, "n_params": 5255168, "expert_params": 4200448,
    "groups": ["all", "ep_size_1"], "samples": 256, "epochs": 5, "batches_per_epoch": 8,
    "epoch_avg": [2.0137363374233246, 1.7487020790576935, 1.524615615606308, 1.2840966582298279, 1.0328689888119698],
    "held": [1.960333526134491, 1.8801650404930115, 1.8029983043670654, 1.7194043397903442, 1.6429595351219177],
    "book": {1: 1.784354, 5: 1.00071}, "fall": 0.48708826989059706,
    "welch": [_welch(5, 0.8571207160130143, 1.6430740654468536, -0.7859533494338393,
                     (-0.8069795815018302, -0.7649271173658484), -74.19189439522407, 5.337010765501465e-87),
              _welch(10, 0.3276379187591374, 1.5937443561851978, -1.2661064374260604,
                     (-1.2792520736191366, -1.2529608012329843), -190.67725930501507, 6.002524638785078e-152)],
    "more_avg": [0.8118339404463768, 0.6683823987841606, 0.5466533303260803, 0.45529427379369736,
                 0.37921373546123505],
    "more_held": [1.6078563332557678, 1.5936644077301025, 1.586814820766449, 1.5895402431488037, 1.5919886827468872],
    "floor": 0.9988844394683838, "floor_ok": True, "predictions": [True, True, True],
    "C": 128, "S": 256, "dropped": 13, "one_left": 13, "lost_both": {1.0: 0, 0.5: 10},
    "l_aux": 1.0104889869689941, "l_aux_mine": 1.0104889869689941, "l_aux_both": 2.0078835487365723,
    "aux_coef": 0.01, "grad_moved": 0.00019219591922592372, "grad_want": 0.00019219615205656737,
    "over": {"first": 0.017578125, "last": 0.013671875, "mean": 0.02788085862994194},
}


def _with(**changes) -> dict:
    R = copy.deepcopy(RECORDED)
    R.update(changes)
    return R


def test_epochs_says_what_the_recorded_run_measured():
    text = ch04.epochs(RECORDED)
    assert "On the tiny preset the epoch average falls from 2.014 to 1.033 (49%) in 5 epochs of 8 batches" in text
    assert "the book reports 1.784 → 1.001 (44%)" in text
    assert "The held-out loss goes from 1.960 to 1.643." in text


def test_epochs_follows_the_direction_of_the_loss():
    text = ch04.epochs(_with(epoch_avg=[1.0, 1.1, 1.2, 1.3, 1.4], fall=-0.4))
    assert "does not fall from 1.000 to 1.400 (-40%)" in text and "average falls" not in text


def test_hypothesis_supported_on_the_recorded_run():
    text = ch04.hypothesis(RECORDED)
    assert text.startswith("**The hypothesis, tested** (tiny preset):")
    assert ("- after 5 epochs: training samples 0.857 vs held-out 1.643 (difference -0.786, 95% CI [-0.807, -0.765], "
            "Welch t = -74.2, p = 5.3e-87, 64 vs 64 samples): ahead") in text
    assert "- after 10 epochs: training samples 0.328 vs held-out 1.594" in text
    assert "- (1) after 5 epochs, training samples' loss below held-out: yes" in text
    assert "- (3) after 10 epochs, the training average below the floor: yes" in text
    assert "the hypothesis is **supported** on this preset" in text
    assert "the remaining 0.610 (62% of the fall) is the model fitting its 256 fixed samples" in text


def test_hypothesis_not_supported_when_a_prediction_fails():
    text = ch04.hypothesis(_with(predictions=[True, False, True]))
    assert "- (2) held-out loss at or above the predict-zero floor (less 0.02): NO" in text
    assert "the hypothesis is **not supported** on this preset" in text
    assert "**supported**" not in text and "62% of the fall" not in text


def test_hypothesis_wants_three_verdicts():
    with pytest.raises(ValueError, match="holds 2 verdicts, the hypothesis makes 3"):
        ch04.hypothesis(_with(predictions=[True, True]))


def test_summary_on_the_recorded_run():
    text = ch04.summary(RECORDED)
    assert "The tiny preset's model has 5.3M parameters, 80% of them in 4 experts." in text
    assert "the MoE parameter groups ['all', 'ep_size_1']" in text
    assert ("epoch average 2.014 → 1.033 in 5 epochs (book: 1.784 → 1.001); held-out 1.960 → 1.643, and after 10 "
            "epochs training 0.379 vs held-out 1.592 against a predict-zero floor of 0.999") in text
    assert "memorising a fixed random set is supported on this preset" in text
    assert ("at capacity factor 1.0: C = 128 slots per expert, 13 of 512 choices dropped, 13 tokens lost one choice "
            "and put weight 1.0 on the survivor, 0 lost both; at factor 0.5, 10 of 256 lost both") in text
    assert "dropped 2.8% of each step's choices on average" in text
    assert "1.010489 vs DeepSpeed's 1.010489; counting both choices would give 2.0079" in text
    assert "moves by 1.922e-04, 0.01 × the formula's gradient (1.922e-04)" in text


def test_summary_follows_the_verdict():
    text = ch04.summary(_with(predictions=[False, True, True]))
    assert "memorising a fixed random set is not supported on this preset" in text


@pytest.mark.parametrize("fn, key", [(ch04.epochs, "fall"), (ch04.hypothesis, "welch"), (ch04.summary, "groups"),
                                     (ch04.summary, "lost_both")])
def test_a_missing_key_is_named(fn, key):
    R = copy.deepcopy(RECORDED)
    del R[key]
    with pytest.raises(KeyError, match=key):
        fn(R)


def test_the_figures_draw_what_they_are_given():
    fig = ch04.loss_figure([2.0 - 0.025 * i for i in range(40)], RECORDED, 8)
    ax = fig.axes[0]
    assert [ln.get_label() for ln in ax.get_lines()][:4] == [
        "per step", "epoch average (at its middle)", "held-out, end of epoch", "book, epochs 1 and 5"]
    assert list(ax.get_lines()[1].get_xdata()) == [4.5, 12.5, 20.5, 28.5, 36.5]      # the middle of each epoch
    assert list(ax.get_lines()[3].get_xdata()) == [4.5, 36.5]                         # the book's epochs 1 and 5
    load = torch.tensor([[30, 10, 10, 14], [16, 16, 16, 16]])                         # (steps, E)
    fig = ch04.load_figure(load, capacity_share=0.25, first_run=1)
    image = fig.axes[0].get_images()[0].get_array()
    assert image.shape == (4, 2) and abs(float(image[0, 0]) - 30 / 64) < 1e-6        # (E, steps) shares
    assert len(fig.axes) == 2                                                           # the colour bar
