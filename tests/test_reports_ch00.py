"""Chapter 00's report functions (labbook.reports.ch00) on the results dict the executed chapter recorded, and on
stacks where the ranks wait elsewhere: the sentence must change with them. A missing key is named."""
import pytest

from labbook.reports import ch00

HEAD = "Current thread 0x00007f581d7c8b80 (most recent call first):\n"
WORKER = ('  File "/work/main/labutils/_worker.py", line 141 in run_rank\n'
          '  File "/work/main/labutils/_worker.py", line 210 in main\n'
          '  File "<frozen runpy>", line 88 in _run_code\n')
CELL = '  File "/tmp/ipykernel_12705/1594064196.py", line {} in straggler\n'
TORCH = "/work/main/.venv/lib/python3.11/site-packages/torch/distributed"
ALL_REDUCE = (f'  File "{TORCH}/distributed_c10d.py", line 3252 in all_reduce\n'
              f'  File "{TORCH}/c10d_logger.py", line 83 in wrapper\n'
              '  File "<launch collective watch>", line 29 in collective\n')
# R as notebooks/00_setup.ipynb recorded it (the straggler: rank 1 sleeps, rank 0 waits in all_reduce)
RECORDED = {"stacks": {0: HEAD + ALL_REDUCE + CELL.format(4) + WORKER, 1: HEAD + CELL.format(3) + WORKER}}


def test_where_stuck_recorded():
    text = ch00.where_stuck(RECORDED)
    assert text.splitlines() == ["- rank 0 is in: `all_reduce` (distributed_c10d.py) <- `straggler` (this cell)",
                                 "- rank 1 is in: `straggler` (this cell)"]


def test_where_stuck_changes_with_the_stacks():
    both_waiting = {"stacks": {r: HEAD + ALL_REDUCE + CELL.format(4) + WORKER for r in (0, 1)}}
    assert ch00.where_stuck(both_waiting).count("`all_reduce` (distributed_c10d.py) <- `straggler`") == 2
    elsewhere = {"stacks": {0: RECORDED["stacks"][0], 1: HEAD + WORKER}}
    text = ch00.where_stuck(elsewhere)
    assert text.splitlines() == [ch00.where_stuck(RECORDED).splitlines()[0],
                                 "- rank 1 is in: none of straggler, all_reduce"]
    assert "- rank 1 is in: `run_rank` (_worker.py)" in ch00.where_stuck(elsewhere, functions=("run_rank",))


def test_a_missing_key_is_named():
    with pytest.raises(KeyError, match="stacks"):
        ch00.where_stuck({})
