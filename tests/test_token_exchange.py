"""Chapter 06's three ways to move tokens (labbook.token_exchange): each design equals one process holding
every expert, outputs and gradients, and its bytes are counted on the wire."""
import pytest

from labbook import token_exchange as tx
from labutils import launch

pytestmark = pytest.mark.dist

KW = dict(experts=4, d=8, h=16, k=2, tokens=24, steps=2)


def _all_designs():
    return {d: tx.run_design(d, **KW) for d in tx.DESIGNS}


def test_every_design_equals_one_process_and_sends_bytes():
    results = launch(_all_designs, 2, timeout=240)
    for rank, res in enumerate(results):
        for design, r in res.items():
            assert max(r["errors"].values()) < 1e-5, (rank, design, r["errors"])
            assert min(r["sent"]) > 8 * 4, (rank, design, r["sent"])           # at least some rows crossed
    # DeepSpeed's dropping buffer is (E, C, d) whatever the routing: the same bytes on every rank
    assert results[0]["ds drop"]["sent_median"] == results[1]["ds drop"]["sent_median"]


def _faulty():
    return {d: tx.run_design(d, **{**KW, "steps": 1}, fault="router not summed") for d in tx.DESIGNS}


def test_negative_control_a_router_gradient_left_unsummed_fails_parity_in_every_design():
    for rank, res in enumerate(launch(_faulty, 2, timeout=240)):
        for design, r in res.items():
            assert r["errors"]["param grads"] > 1e-2, (rank, design, r["errors"])


def _bad(design, experts):
    return tx.run_design(design, **{**KW, "experts": experts})


def test_bad_input_is_refused_on_every_rank():
    with pytest.raises(Exception, match="design must be one of"):
        launch(_bad, 2, "nccl-magic", 4, timeout=60)
    with pytest.raises(Exception, match="experts=3 must be a multiple of the world size 2"):
        launch(_bad, 2, "fastmoe", 3, timeout=60)


def _paired():
    return tx.time_paired(("fastmoe", "ds drop"), **{**KW, "steps": 2}, rounds=3)


def test_time_paired_gives_each_design_a_block_of_steps_per_round_and_checks_parity():
    for rank, res in enumerate(launch(_paired, 2, timeout=240)):
        for design in ("fastmoe", "ds drop"):
            assert [len(block) for block in res[design]] == [2, 2, 2], (rank, design)
            assert all(s > 0 for block in res[design] for s in block)
            assert max(res["errors"][design].values()) < 1e-5, (rank, design, res["errors"])


def _paired_bad(designs):
    return tx.time_paired(designs, **KW)


def test_time_paired_refuses_anything_but_two_designs():
    with pytest.raises(Exception, match="time_paired compares two different designs"):
        launch(_paired_bad, 2, ("fastmoe", "fastmoe"), timeout=60)
