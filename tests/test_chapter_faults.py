"""Every chapter's injected faults are caught by the check cell each names, and the unedited chapter passes the
same cells (issue 38). The fault lists: labbook/faults/chNN.py; the harness: labbook/faults/run.py."""
from __future__ import annotations

import os

import pytest

from labbook.faults import CHAPTERS, Edit, Fault, faults
from labbook.faults.run import apply_text, run, verdict

ALL = [(c, f) for c in CHAPTERS for f in faults(c)]


def first_per_chapter(cases: list) -> list:
    """The first fault of each chapter: what `make test` runs live (about 10 s each). LAB_FAULTS=all runs every
    fault here; `make faults` runs them all, two at a time, and records the verdicts in docs/faults.json."""
    seen, out = set(), []
    for chapter, fault in cases:
        if chapter not in seen:
            seen.add(chapter)
            out.append((chapter, fault))
    return out


EVERY = os.environ.get("LAB_FAULTS") == "all"
CASES = ALL if EVERY else first_per_chapter(ALL)
# The unedited control of each cell subset a fault runs: with LAB_FAULTS=all (and in `make faults`, which records
# it); `make test` leaves it to nbval, which runs every chapter unedited, to keep the suite near its budget.
SUBSETS = sorted({(c, f.cells) for c, f in CASES if f.cells})


@pytest.mark.kernel
@pytest.mark.parametrize(("chapter", "fault"), CASES, ids=[f"{c}: {f.name}" for c, f in CASES])
def test_the_fault_is_caught_by_its_check(chapter, fault):
    why = verdict(fault, run(chapter, fault))
    assert why is None, f"chapter {chapter}, fault {fault.name!r}: {why}"


if EVERY:  # defined only when it has cases (an empty parametrization would show as a skip)
    @pytest.mark.kernel
    @pytest.mark.parametrize(("chapter", "cells"), SUBSETS, ids=[f"{c}: {len(s)} cells" for c, s in SUBSETS])
    def test_the_unedited_chapter_passes_the_cells_a_fault_runs(chapter, cells):
        """The negative control: without the fault the same cells pass (the whole chapter is nbval's run)."""
        outcome = run(chapter, None, cells)
        assert outcome.failed is None, f"chapter {chapter}: unedited, cell {outcome.failed} failed:\n{outcome.error}"


def test_an_edit_that_no_longer_matches_is_an_error():
    with pytest.raises(LookupError, match="occurs 0 times"):
        apply_text("x = 1", Edit("cell", "y = 2", "y = 3"), "fault 'demo'")
    with pytest.raises(LookupError, match="occurs 2 times"):
        apply_text("x = 1; x = 1", Edit("cell", "x = 1", "x = 2"), "fault 'demo'")


def test_a_fault_must_change_something_and_run_its_check():
    with pytest.raises(ValueError, match="at least one edit"):
        Fault("nothing", check="c", expect="e")
    with pytest.raises(ValueError, match="changes nothing"):
        Fault("same", check="c", expect="e", edits=(Edit("c", "a", "a"),))
    with pytest.raises(ValueError, match="is not among cells"):
        Fault("elsewhere", check="c", expect="e", edits=(Edit("c", "a", "b"),), cells=("a", "b"))
    with pytest.raises(ValueError, match="chapter must be one of"):
        faults("10")


@pytest.mark.kernel
def test_a_check_that_passes_the_fault_is_reported_as_missed():
    """The harness's own negative control: a harmless edit (a comment) is not 'caught'."""
    harmless = Fault("a comment", check="d4c3dac5", expect="all_reduce",
                     edits=(Edit("d4c3dac5", "def hello(scale):", "def hello(scale):  # harmless"),),
                     cells=("e445fdb3", "d4c3dac5"))
    why = verdict(harmless, run("00", harmless))
    assert why is not None and why.startswith("NOT CAUGHT")
