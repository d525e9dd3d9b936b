"""Chapter 01's report functions (labbook.reports.ch01) on the results dict the executed chapter recorded, and on
dicts where a verdict flips: the sentence must change with it. A missing key is named."""
import copy

import pytest

from labbook.reports import ch01

# R as notebooks/01_fastmoe_core.ipynb recorded it (preset tiny)
RECORDED = {
    "preset": "tiny", "buffers": {"named": [1, 3, 1], "fused": [1, 2, 0]},
    "switch": {"stored": 1.196027159690857, "after_drop": 1.196027159690857, "definition": 1.0204154253005981,
               "kept": 27, "tokens": 32},
    "parity_gates": 4, "build": {"seeds": [0, 1, 2], "steps": 200, "experts": 16},
    "arms": {
        "balancing loss": {"loss": [2.452432942390442, 2.3970324397087097, 2.3539828181266786],
                           "busiest": [0.11582031100988388, 0.11933593451976776, 0.11660156399011612],
                           "dead": [1, 2, 0]},
        "no balancing loss": {"loss": [2.4465985178947447, 2.39967200756073, 2.3557530760765077],
                              "busiest": [0.29365235567092896, 0.30244141817092896, 0.22685547173023224],
                              "dead": [5, 5, 5]},
        "zero-output control": {"loss": [2.581569457054138, 2.539764201641083, 2.501180040836334],
                                "busiest": [0.06591796875, 0.06533203274011612, 0.06591796875], "dead": [0, 0, 0]},
    },
    "first_step": [0.1796875, 0.17578125, 0.2421875],
}


def changed(**paths):
    """RECORDED with ``a__b=value`` set at R["a"]["b"]."""
    R = copy.deepcopy(RECORDED)
    for path, value in paths.items():
        *keys, last = path.split("__")
        d = R
        for k in keys:
            d = d[k]
        d[last] = value
    return R


def test_buffers_recorded_and_flipped():
    text = ch01.buffers(RECORDED)
    assert "makes **3** `(T*k, d)` buffers per step against **4**" in text and "(1 fewer)" in text
    assert "keeps **0** from forward to backward against **1**" in text and "0.50 MiB" in text
    same = ch01.buffers(changed(buffers__fused=[1, 3, 1]))
    assert "(as many)" in same and "fewer" not in same
    assert "(2 more)" in ch01.buffers(changed(buffers__fused=[2, 4, 1]))


def test_switch_losses_recorded_and_flipped():
    text = ch01.switch_losses(RECORDED)
    assert "Dividing by the 27 kept tokens instead of all 32" in text
    assert "fastmoe's number (1.196) exceeds §0's (1.020)" in text
    below = ch01.switch_losses(changed(switch__definition=1.3))
    assert "(1.196) differs from §0's (1.300)" in below and "exceeds" not in below
    none_dropped = ch01.switch_losses(changed(switch__kept=32))
    assert "Nothing was dropped" in none_dropped and "Dividing" not in none_dropped


def test_arms_table_has_every_seed():
    text = ch01.arms_table(RECORDED)
    assert "| balancing loss | 2.452, 2.397, 2.354 | 0.116, 0.119, 0.117 | 1, 2, 0 |" in text
    assert "| no balancing loss | 2.447, 2.400, 2.356 | 0.294, 0.302, 0.227 | 5, 5, 5 |" in text
    assert "| zero-output control | 2.582, 2.540, 2.501 | 0.066, 0.065, 0.066 | 0, 0, 0 |" in text
    assert "Per seed [0, 1, 2]" in text and "1/E = 0.062" in text and "step 1: 0.180, 0.176, 0.242" in text


def test_training_verdicts_recorded_and_flipped():
    text = ch01.training(RECORDED)
    assert "with the balancing loss is ahead of without it: 0.117 vs 0.274 of tokens" in text and "p = 0.0216" in text
    assert "your layer is ahead of the zero-output control: 2.401 vs 2.541 nats" in text and "p = 0.00151" in text
    # no collapse without the loss (its busiest shares those of the balanced runs, a little noisier)
    flat = changed(**{"arms__no balancing loss__busiest": [0.1162, 0.1190, 0.1170]})
    flipped = ch01.training(flat)
    assert "with the balancing loss vs without it: inconclusive" in flipped and "is ahead of without it" not in flipped
    worse = changed(**{"arms__zero-output control__loss": [2.40, 2.35, 2.30]})
    assert "your layer is behind the zero-output control" in ch01.training(worse)


def test_summary_recorded_flipped_and_before_training():
    text = ch01.summary(RECORDED)
    assert "after-drop Switch loss was 1.196 against §0's definition 1.020 (27 of 32 tokens kept)" in text
    assert "for all 4 gates" in text and "made 3 `(T*k, d)` buffers per step instead of 4" in text
    assert "busiest expert 0.274 of top-1 choices without the balancing loss vs 0.117 with it (ahead" in text
    assert "loss 2.401 vs 2.541 nats for the zero-output control (ahead)" in text and "preset `tiny`" in text
    flat = ch01.summary(changed(**{"arms__no balancing loss__busiest": [0.1162, 0.1190, 0.1170]}))
    assert "with it (inconclusive" in flat
    student = {k: v for k, v in RECORDED.items() if k not in ("build", "arms", "first_step")}
    early = ch01.summary(student)
    assert "appears here once your `my_moe_forward` and `my_switch_loss` pass" in early and "char LM" not in early


@pytest.mark.parametrize(("fn", "key"), [(ch01.buffers, "buffers"), (ch01.switch_losses, "switch"),
                                         (ch01.arms_table, "build"), (ch01.training, "arms"),
                                         (ch01.summary, "parity_gates")])
def test_a_missing_key_is_named(fn, key):
    R = {k: v for k, v in RECORDED.items() if k != key}
    with pytest.raises(KeyError, match=key):
        fn(R)
