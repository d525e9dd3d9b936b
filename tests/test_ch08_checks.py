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
    from labbook.perf.problem import make_problem
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


# ---- the chapter's helpers moved into labbook/perf (issue 39) ------------------------------------------------------
def _phases(**over):
    ph = {"rest fwd": 0.002, "experts fwd": 0.004, "router fwd": 0.001, "rest bwd": 0.004, "experts bwd": 0.008,
          "router bwd": 0.002, "optimizer (Adam)": 0.001, "forward total": 0.007, "backward total": 0.015,
          "instrumented step": 0.023}
    ph.update(over)
    return ph


def test_phase_sums_hold_and_a_missing_phase_fails():
    from labbook.perf.step_phases import UNNAMED, grouped, phase_sums_hold

    ph = _phases()
    assert phase_sums_hold(ph)
    assert not phase_sums_hold({k: v for k, v in ph.items() if k != "experts fwd"})
    assert phase_sums_hold({k: v for k, v in ph.items() if k != "experts fwd"}, tol=0.6)   # a loose check passes it
    g = grouped(ph)
    assert g["experts / FFN"] == pytest.approx(12.0) and g["rest of the model"] == pytest.approx(6.0)
    assert g[UNNAMED] == pytest.approx(23.0 - sum(v for k, v in g.items() if k != UNNAMED))


def test_adopted_cuts_are_judged_by_the_one_rule():
    from labbook.perf.step_phases import adopted_cuts_pay, cut_calls

    plain = [1.0, 1.01, 0.99, 1.0, 1.02, 0.98]
    fast = {"seconds": {"plain": plain, "cut": [0.8 * p for p in plain[:3]] + [0.81 * p for p in plain[3:]]},
            "adopted": True}
    slow = {"seconds": {"plain": plain, "cut": [1.1 * p for p in plain[:3]] + [1.12 * p for p in plain[3:]]},
            "adopted": False}
    record = {"cuts": {"fast": fast, "slow": slow}}
    assert list(cut_calls(record)) == ["fast"] and adopted_cuts_pay(record)
    assert cut_calls(record, margin=MARGIN)["fast"]["call"] == "inconclusive"           # 25% is not cleared
    assert not adopted_cuts_pay({"cuts": {"slow": dict(slow, adopted=True)}})


def test_provenance_of_both_record_layouts():
    from labbook.perf.verdicts import provenance

    disp = {"machine": {"date": "2026-11-25T13:30:29", "cores": 2, "load_avg_1min": 13.6}, "load_avg_1min_after": 18.2}
    assert provenance("r1", disp) == {"name": "r1", "date": "2026-11-25T13:30:29", "cores": 2, "load": 18.2}
    layer = {"machine_before": {"date": "2026-11-25T19:22:31", "cores": 2, "load_avg_1min": 2.0},
             "machine_after": {"load_avg_1min": 1.1}}
    assert provenance("l", layer)["load"] == 2.0
    assert provenance("x", {"machine": {"date": "d", "cores": 2, "load_avg_1min": 0.5}})["load"] == 0.5


def _bd(tpe, shares, reps=4, overhead=0.1):
    runs = [{**shares, "other": shares.get("other", 0.0)} for _ in range(reps)]
    total = dict(runs[0])
    return {"tokens_per_expert": tpe, "runs": runs, "total": total, "profiled_s": sum(total.values()),
            "profiler_overhead": overhead, "overhead_iqr": (overhead, overhead), "reps": reps,
            "unprofiled_s": sum(total.values()), "unprofiled_iqr_pct": 1.0}


def test_shifted_phases_counts_a_vanished_phase_at_any_load():
    from labbook.perf.breakdown import format_breakdown, shifted_phases

    shares = {"routing": 0.1, "dispatch": 0.1, "expert compute": 0.6, "combine": 0.1, "other": 0.1}
    rec = {16: _bd(16, shares)}
    lines, shifted = shifted_phases([_bd(16, shares)], rec)
    assert shifted == [] and "combine 10.0%/10.0% consistent" in lines[0]
    gone = dict(shares, combine=0.0, **{"expert compute": 0.7})
    noisy = _bd(16, gone, overhead=0.6)                                   # too high: shifted shares are not judged
    lines, shifted = shifted_phases([noisy], rec)
    assert shifted == ["combine at 16 (vanished)"] and "not judged here" in lines[1]
    assert "16 tokens/expert: routing 100.00 ms" in format_breakdown(_bd(16, shares), "live")


def test_format_rows_and_waits_and_output_and_grads(one_thread):
    from labbook.perf.dispatch import build_designs
    from labbook.perf.problem import make_problem
    from labbook.perf.sweep import format_rows, format_waits, measure_point, output_and_grads

    p = make_problem(tokens=64, d_model=8, d_hidden=16, num_expert=4, top_k=2, seed=3)
    rows = [dict(r, num_expert=4) for r in measure_point(p, ["loop", "core"], reps=3)]
    table = format_rows(rows).splitlines()
    assert table[0].split()[:3] == ["design", "median", "ms"] and [t.split()[0] for t in table[1:]] == [
        "loop", "core", "separate", "dense"]
    assert format_waits(rows, "test").startswith("   test, E=4: wait ms / voluntary / involuntary")
    d = build_designs(p, ["loop", "core"])
    (_, g_loop), (_, g_core) = output_and_grads(d["loop"], p), output_and_grads(d["core"], p)
    assert list(g_loop) == ["x", "logits", "w1", "b1", "w2", "b2"] and list(g_core) == list(g_loop)
    assert all(torch.allclose(g_loop[k], g_core[k], atol=1e-5) for k in g_loop)


def test_chapter_figures_draw():
    import matplotlib

    matplotlib.use("Agg")
    from labbook.perf import plots

    rows = [{"design": n, "num_expert": E, "ratio": r, "ratio_iqr": (r - 0.01, r + 0.01)}
            for n in ("core", "loop") for E, r in ((4, 0.5), (32, 0.3))]
    fig = plots.live_sweep(rows, "t")
    assert fig.axes[0].get_xscale() == "log"
    plots.plt.close(fig)
    g = plots.step_phases({"dense": {"a": 3.0, "b": 1.0}, "MoE": {"a": 4.0, "b": 2.5}}, "title")
    assert [t.get_text() for t in g.axes[0].texts] == ["3.0", "4.0", "2.5"]
    plots.plt.close(g)
