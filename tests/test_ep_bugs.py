"""Chapter 06's expert-parallel bug classes (labbook.ep_bugs): the W-workers == 1-process gradient check
passes the correct synchronisation at 1e-5 and fails each bug naming the parameter group that is wrong."""
import pytest

from labbook import ep_bugs
from labutils import launch

pytestmark = pytest.mark.dist

EXPECTED = {"correct": [], "experts x EP": ["experts"], "router unreduced": ["router"],
            "router twice": ["router"], "DP mixes experts": ["experts"]}


def _all_bugs(world, ep):
    return {b: ep_bugs.grad_check(b, world=world, ep=ep) for b in ep_bugs.BUGS}


def test_each_bug_fails_the_gradient_check_in_its_group_and_the_correct_sync_passes():
    results = launch(_all_bugs, 4, 4, 2, timeout=120)                      # DP x EP = 2 x 2
    for rank, res in enumerate(results):
        for bug, failed in EXPECTED.items():
            assert res[bug]["grads"]["failed"] == failed, (rank, bug, res[bug]["grads"])
        assert max(res["correct"]["grads"][g]["rel"] for g in ep_bugs.GROUPS) < 1e-5
        assert res["experts x EP"]["grads"]["experts"]["rel"] == pytest.approx(1.0, abs=1e-4)  # exactly 2x
        assert res["router twice"]["grads"]["router"]["rel"] == pytest.approx(3.0, abs=1e-4)   # 4x on 4 ranks
        # the weaker check on one Adam update misses the router reduced twice (Adam divides the scale out)
        assert res["router twice"]["adam"]["failed"] == [] and res["correct"]["adam"]["failed"] == []


def _curves(steps):
    return {b: ep_bugs.train_curves(b, steps=steps, world=2, ep=2) for b in ("correct", "experts x EP")}


def test_loss_curves_hide_the_scale_bug_and_are_the_same_on_every_rank():
    results = launch(_curves, 2, 20, timeout=120)
    assert results[0] == results[1]                                        # the global loss, all-reduced
    correct, buggy = results[0]["correct"], results[0]["experts x EP"]
    assert correct[0] == buggy[0]                                          # the forward is right at step 0
    assert max(abs(a - b) for a, b in zip(correct, buggy)) < 1e-3 and correct[-1] < correct[0]


def _bad_layout():
    return ep_bugs.layout(2, 3)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="bug must be one of"):
        ep_bugs.sync_grads(None, "typo", {})  # type: ignore[arg-type]
    with pytest.raises(Exception, match="ep=3 must divide the world size 2"):
        launch(_bad_layout, 2, timeout=60)
