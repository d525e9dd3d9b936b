"""Chapter 07's slices check (``labbook.toys.ch07_ddp.slices_partition``) checks a property, not one layout
(issue 38): any split that puts every row of the global batch on exactly one rank passes; a row twice, a row
dropped or a row from elsewhere fails. No workers: the ranks' inputs are built by hand."""
from __future__ import annotations

import torch

from labbook.toys.ch07_ddp import slices_partition


def run_of(batch, pieces):
    """A train_side_by_side-like result: one step whose ranks received ``pieces`` of ``batch``."""
    return {"seen": [pieces], "batches": [batch]}


BATCH = torch.arange(16.0).view(8, 2)  # (8, 2): 8 distinct rows


def test_contiguous_interleaved_and_shuffled_splits_pass():
    perm = torch.tensor([5, 2, 7, 0, 1, 6, 3, 4])
    for pieces in ([BATCH[:4], BATCH[4:]],              # contiguous slices (batch_rows)
                   [BATCH[0::2], BATCH[1::2]],          # interleaved, DistributedSampler's rank::world
                   [BATCH[perm[:4]], BATCH[perm[4:]]],  # any permutation
                   [BATCH[:3], BATCH[3:]]):             # unequal shares are still a partition
        ok, detail = slices_partition(run_of(BATCH, pieces))
        assert ok, detail


def test_duplicated_dropped_and_foreign_rows_fail():
    ok, detail = slices_partition(run_of(BATCH, [BATCH, BATCH]))  # every rank the whole batch
    assert not ok and "a row twice" in detail
    ok, detail = slices_partition(run_of(BATCH, [BATCH[:4], BATCH[5:]]))  # row 4 reaches nobody
    assert not ok and "rows [4]" in detail
    ok, detail = slices_partition(run_of(BATCH, [BATCH[:4], BATCH[4:] + 100]))
    assert not ok and "not in the batch" in detail
    ok, detail = slices_partition(run_of(BATCH, [BATCH[:5], BATCH[4:]]))  # overlapping slices
    assert not ok and "a row twice" in detail


def test_duplicate_rows_in_the_batch_must_each_reach_a_rank():
    batch = torch.zeros(4, 2)  # four equal rows: the check counts them, it does not only look them up
    assert slices_partition(run_of(batch, [batch[:2], batch[2:]]))[0]
    ok, detail = slices_partition(run_of(batch, [batch[:2], batch[2:3]]))
    assert not ok and "rows [3]" in detail
