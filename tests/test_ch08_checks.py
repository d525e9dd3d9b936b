"""Chapter 08's checks (issue 38): one rule for every speed verdict, provisional verdicts from one sitting's
recordings, waiting told from preemption, and the live sweep's rows carrying what the chapter recomputes."""
from __future__ import annotations

import statistics
import time

import pytest
import torch

from labbook.perf.verdicts import MARGIN, compare_ratios, separate_runs, speed_call, target_verdict

AHEAD = [0.95, 0.96, 0.97, 0.95, 0.96]
BEHIND = [0.80, 0.82, 0.81, 0.79, 0.80]


def _prov(*dates, load=1.0):
    return [{"name": f"r{i}", "date": d, "load": load, "cores": 2} for i, d in enumerate(dates)]


def test_speed_call_is_the_welch_interval_against_the_bar_and_the_margin():
    assert speed_call(AHEAD, 0.9)["call"] == "ahead"
    assert speed_call(BEHIND, 0.9)["call"] == "behind"
    assert speed_call(AHEAD, 0.9, margin=MARGIN)["call"] == "inconclusive"     # 6% is inside a 25% margin
    assert speed_call([1.6, 1.7, 1.65, 1.62], 1.0, margin=MARGIN)["call"] == "ahead"
    assert speed_call([1.0], 0.9)["call"] == "inconclusive"                     # one round: nothing to test
    lo, hi = speed_call(AHEAD, 0.9)["ci"]
    assert lo < statistics.mean(AHEAD) < hi


def test_separate_runs_reads_dates_and_loads():
    one_sitting = separate_runs(_prov("2026-11-25T13:30:29", "2026-11-25T13:44:27"))
    assert not one_sitting["ok"] and "14 min apart" in one_sitting["why"]
    assert "load 1.0 on 2 cores" in one_sitting["loads"]
    assert separate_runs(_prov("2026-11-25T13:30:29", "2026-11-25T18:44:27"))["ok"]
    assert not separate_runs(_prov("2026-11-25T13:30:29"))["ok"]
    no_load = separate_runs([{"name": "a", "date": "2026-11-25T10:00:00", "load": None, "cores": 2},
                             {"name": "b", "date": "2026-11-25T14:00:00", "load": 1.0, "cores": 2}])
    assert not no_load["ok"] and "load not stated" in no_load["why"]


def test_one_sitting_makes_a_verdict_provisional_unless_it_clears_the_margin():
    sitting = _prov("2026-11-25T19:22:31", "2026-11-25T19:25:55")
    v = target_verdict([AHEAD, AHEAD], 0.9, provenance=sitting)
    assert v["verdict"] == "provisional" and v["lean"] == "met" and "3 min apart" in v["why"]
    assert target_verdict([BEHIND, BEHIND], 0.9, provenance=sitting)["lean"] == "NOT met"
    far = [[1.35, 1.39, 1.36, 1.37], [1.35, 1.38, 1.36, 1.34]]
    assert target_verdict(far, 1.0, provenance=sitting)["verdict"] == "met"        # clears 1.25 as well
    apart = _prov("2026-11-25T09:00:00", "2026-11-25T19:25:55")
    assert target_verdict([AHEAD, AHEAD], 0.9, provenance=apart)["verdict"] == "met"
    assert target_verdict([AHEAD, BEHIND], 0.9, provenance=apart)["verdict"] == "inconclusive"


def test_compare_ratios_needs_the_whole_interval_beyond_the_margin():
    rec = [0.60, 0.62, 0.61, 0.63, 0.60]
    assert compare_ratios([0.50, 0.51, 0.52, 0.50, 0.49], rec)["call"] == "consistent"   # 20% slower: within 25%
    assert compare_ratios([0.26, 0.27, 0.25, 0.26, 0.27], rec)["call"] == "slower"
    assert compare_ratios([0.90, 0.92, 0.91, 0.93], rec)["call"] == "faster"


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_bench_tells_a_sleep_from_work_by_voluntary_switches(one_thread):
    """On one torch thread (the chapter's clock): with more, the caller waits for its pool, voluntarily."""
    from labbook.perf.timing import bench

    x = torch.randn(64, 64)
    switches: dict = {}
    bench({"sleep": lambda: time.sleep(0.003), "work": lambda: x @ x}, reps=5, warmup=1, switches=switches)
    assert all(v >= 1 for v, _ in switches["sleep"])
    assert statistics.median(v for v, _ in switches["work"]) == 0


def test_measure_point_rows_carry_what_the_chapter_recomputes(one_thread):
    from labbook.perf.dispatch import make_problem
    from labbook.perf.sweep import measure_point

    p = make_problem(tokens=64, d_model=8, d_hidden=16, num_expert=4, top_k=2, seed=3)
    rows = {r["design"]: r for r in measure_point(p, ["loop", "core"], reps=3, memory=False)}
    dense = rows["dense"]["times_s"]
    for r in rows.values():
        assert len(r["times_s"]) == len(r["walls_s"]) == 3
        assert r["ratio"] == pytest.approx(statistics.median(d / t for d, t in zip(dense, r["times_s"])), rel=1e-12)
        assert r["gflops"] == pytest.approx(12 * 64 * 2 * 8 * 16 / statistics.median(r["times_s"]) / 1e9, rel=1e-12)
        assert r["voluntary_switches"] >= 0 and r["involuntary_switches"] >= 0
    assert rows["core"]["y_sum"] == pytest.approx(rows["loop"]["y_sum"], rel=1e-4, abs=1e-3)
    assert rows["dense"]["y_sum"] is None
