"""Red team for chapter 05's exercise checkers (labbook.checkers.ch05): each honest solution passes, and the
library function, a sibling that computes the same thing, a lookup table of the visible cases, the notebook's
global record, and the chapter's likely wrong answers all fail."""
import math

import pytest
import torch
from cheats import must_fail, must_pass

from labbook import lm_study, train_modern
from labbook.checkers import ch05

# --- exercise 1: balance_entropy ------------------------------------------------------------------------------


def honest_entropy(load):
    share = load.sum(0).double()
    share = share / share.sum()
    nz = share[share > 0]
    return -(nz * nz.log()).sum() / math.log(load.shape[1])


_ENTROPY_TABLE = {str(case[0].tolist()): ch05._entropy_reference(*case) for case in ch05.ENTROPY_VISIBLE}


def per_window_mean(load):
    """Wrong: the mean of each window's entropy, not the entropy of the total share."""
    out = []
    for row in load.double():
        p = row / row.sum() if row.sum() > 0 else row
        out.append(torch.special.entr(p).sum() / math.log(load.shape[1]))
    return torch.stack(out).mean()


def over_live_experts(load):
    """Wrong: divided by log(number of experts that got tokens) instead of log(E)."""
    share = load.sum(0).double()
    share = share / share.sum()
    live = int((share > 0).sum())
    return torch.special.entr(share).sum() / math.log(max(live, 2))


def test_honest_balance_entropy_passes():
    must_pass(ch05.check_balance_entropy, honest_entropy)
    must_pass(ch05.check_balance_entropy, lambda load: honest_entropy(load).float())  # float32 is close enough


@pytest.mark.parametrize("cheat", [
    lambda load: train_modern.balance_stats(load.sum(0))[1],                     # the book's own entropy
    lambda load: torch.tensor(train_modern.balance_stats(load.sum(0))).select(0, 1),  # the same, repackaged
    lambda load: _ENTROPY_TABLE[str(load.tolist())],                             # a lookup table
    per_window_mean,
    over_live_experts,
], ids=["library-balance_stats", "sibling-repackaged", "lookup-table", "per-window-mean", "log-live-experts"])
def test_balance_entropy_cheats_fail(cheat):
    must_fail(ch05.check_balance_entropy, cheat)


# --- exercise 2: my_steps_to_reach ----------------------------------------------------------------------------


def honest_reach(steps, losses, target):
    for i, (s, v) in enumerate(zip(steps, losses)):
        if v <= target:
            if i == 0:
                return float(s)
            s0, v0 = steps[i - 1], losses[i - 1]
            return s0 + (s - s0) * (v0 - target) / (v0 - v)
    return None


_REACH_TABLE = {repr(case): ch05._reach_reference(*case) for case in ch05.REACH_VISIBLE}

# the notebook's globals after its run: `record` (the live tiny study) and `summary`; a student could read them
record = {"runs": [{"name": "MoE", "seed": 0, "val_steps": [30, 60, 90], "val": [3.0, 2.7, 2.5]}]}
summary = {"speedup": {"values": [1.1, 1.2]}}


def lookup_reach(steps, losses, target):
    """Cheat: the visible cases' answers, copied."""
    reached, step = _REACH_TABLE[repr((steps, losses, target))]
    return step if reached else None


def from_notebook_globals(steps, losses, target):
    """Cheat: find the curve in the notebook's record and read the answer off the summary's speed-ups."""
    for run in record["runs"]:
        if run["val"] == list(losses):
            return run["val_steps"][-1] / summary["speedup"]["values"][0]
    return None


def inverted_loss_at(steps, losses, target):
    """Sibling: the book's own interpolation (lm_study.loss_at) with the axes swapped."""
    return lm_study.loss_at(list(reversed(losses)), list(reversed(steps)), target)


def strict_below(steps, losses, target):
    """Wrong: '<' where the definition says 'at or below'."""
    for i, (s, v) in enumerate(zip(steps, losses)):
        if v < target:
            return float(s) if i == 0 else steps[i - 1] + (s - steps[i - 1]) * (losses[i - 1] - target) / (
                losses[i - 1] - v)
    return None


def first_evaluation_at_or_below(steps, losses, target):
    """Wrong: no interpolation, the first evaluation at or below the target."""
    return next((float(s) for s, v in zip(steps, losses) if v <= target), None)


def test_honest_my_steps_to_reach_passes():
    must_pass(ch05.check_my_steps_to_reach, honest_reach)


@pytest.mark.parametrize("cheat", [
    lm_study.steps_to_reach,                                                      # the library function
    lambda s, v, t: lm_study.steps_to_reach(s, v, t),                             # called from the student
    inverted_loss_at,                                                             # a sibling
    lookup_reach,                                                                 # a lookup table
    from_notebook_globals,                                                        # the notebook's record
    strict_below,
    first_evaluation_at_or_below,
    lambda s, v, t: -1.0 if honest_reach(s, v, t) is None else honest_reach(s, v, t),  # -1 is not None
], ids=["library", "library-called", "sibling-loss_at", "lookup-table", "notebook-record", "strict-below",
        "no-interpolation", "minus-one-for-never"])
def test_my_steps_to_reach_cheats_fail(cheat):
    must_fail(ch05.check_my_steps_to_reach, cheat)
