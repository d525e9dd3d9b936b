"""Chapter 00's faults: each names the check cell that must catch it. (See ``labbook.faults``.)

The cell ``UNLUCKY`` defines ``launch_error`` (a launch that must raise ``WorkerError``), which the crash and straggler
cells use, so their faults run it too."""
from labbook.faults import Edit, Fault

SETUP, HELLO, BROKEN, SHARDS, UNLUCKY, CRASH, STRAGGLER = (
    "e445fdb3", "d4c3dac5", "d0bea567", "457d391f", "048b7270", "96b2a6c4", "61d1035c")
COUNTS, VERIFY = "51e2a56a", "a996d26b"

FAULTS = [
    Fault("the worker's all_reduce takes the MAX instead of the SUM", check=HELLO, expect="all_reduce over 2 ranks",
          edits=(Edit(HELLO, "dist.all_reduce(t)  ", "dist.all_reduce(t, op=dist.ReduceOp.MAX)  "),),
          cells=(SETUP, HELLO)),
    Fault("check() never raises, so every check passes", check=BROKEN, expect="the block raised nothing",
          library=(Edit("labutils/compare.py", "    if not ok:\n        raise AssertionError(f\"FAILED",
                        "    if False:\n        raise AssertionError(f\"FAILED"),),
          cells=(SETUP, BROKEN)),
    Fault("launch returns the ranks' results in reverse order", check=SHARDS, expect="rank order",
          library=(Edit("labutils/launcher/_failures.py", "        return out\n\n    def _error_record",
                        "        return out[::-1]\n\n    def _error_record"),),
          cells=(SETUP, SHARDS)),
    Fault("launch returns the results although a rank failed", check=UNLUCKY, expect="launch raised WorkerError",
          library=(Edit("labutils/launcher/_run.py", "                raise self.failure_error()",
                        "                return [None] * self.world_size"),),
          cells=(SETUP, UNLUCKY)),
    Fault("launch names the last failing rank, not the first", check=UNLUCKY, expect="the first failing rank",
          library=(Edit("labutils/launcher/_failures.py", "        _, _, rank, what, tb, code = reports[0]",
                        "        _, _, rank, what, tb, code = reports[-1]"),),
          cells=(SETUP, UNLUCKY)),
    Fault("a rank killed by a signal is reported as exit code 1", check=CRASH, expect="exit code -9",
          library=(Edit("labutils/launcher/_procs.py", "return -os.WTERMSIG(status) if", "return 1 if"),),
          cells=(SETUP, UNLUCKY, CRASH)),
    Fault("a timeout's report keeps only rank 0's stack", check=STRAGGLER, expect="both stuck ranks",
          library=(Edit("labutils/launcher/_failures.py", "        for rank in ranks:\n            path = os.path.join",
                        "        for rank in ranks[:1]:\n            path = os.path.join"),),
          cells=(SETUP, UNLUCKY, STRAGGLER)),
    Fault("count_params files expert parameters under 'other'", check=COUNTS, expect="experts: 32 x",
          library=(Edit("labutils/params.py", '            return "moe experts"', '            return "other"'),),
          cells=(SETUP, COUNTS)),
    Fault("count_params' total counts one parameter too many", check=COUNTS, expect="the categories add up",
          library=(Edit("labutils/params.py", "        return sum(self.by_category.values())",
                        "        return 1 + sum(self.by_category.values())"),),
          cells=(SETUP, COUNTS)),
]
