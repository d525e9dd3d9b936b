"""Chapter 08 dispatch designs: every design computes the same outputs and gradients on identical weights and
routing (within 1e-5), DeepSpeed's layer included where it drops nothing; capacity designs keep exactly the
choices their capacity allows; the measuring helpers return what they promise. No timings are asserted."""
import math

import pytest
import torch
from torch import nn

from labbook.perf.breakdown import PHASES, core_breakdown
from labbook.perf.dispatch import DESIGNS, build_designs, dense, einsum, separate
from labbook.perf.problem import fwd_bwd, make_problem, route
from labbook.perf.real_layers import DeepSpeedMoE
from labbook.perf.sweep import measure_point
from labbook.perf.timing import peak_memory
from labutils.compare import compare_tensors
from labutils.moe import count_by_gate
from labutils.optional import available

TOL = 1e-5
HAVE_DS = available("deepspeed")


def run(fn, p):
    """Output and gradients (x, logits, expert weights) of one forward+backward, in the problem's layout."""
    out = fwd_bwd(fn, p)
    grads = {"x": p.x.grad.clone(), "logits": p.logits.grad.clone()}
    if isinstance(fn, nn.Module):  # DeepSpeedMoE and CoreMoE hold their own copies of the weights
        grads.update(fn.expert_grads())
    else:
        grads.update(w1=p.w1.grad.clone(), b1=p.b1.grad.clone(), w2=p.w2.grad.clone(), b2=p.b2.grad.clone())
    return out, grads


def assert_same(name, got, ref):
    out, grads = got
    ref_out, ref_grads = ref
    diffs = [compare_tensors(f"{name}: y", out.y, ref_out.y, rtol=TOL, atol=TOL)]
    diffs += [compare_tensors(f"{name}: grad {k}", grads[k], ref_grads[k], rtol=TOL, atol=TOL) for k in ref_grads]
    bad = [d.row() for d in diffs if not d.close]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_all_designs_agree_with_the_loop(top_k):
    p = make_problem(tokens=48, d_model=16, d_hidden=24, num_expert=6, top_k=top_k, seed=top_k, limits=False)
    names = [n for n in DESIGNS if HAVE_DS or not n.startswith("ds_")]
    designs = build_designs(p, names)
    ref = run(designs.pop("loop"), p)
    assert ref[0].kept == p.T * top_k
    for name, fn in designs.items():
        got = run(fn, p)
        if name == "ds_cf1":  # may drop: checked below against the capacity formula
            continue
        assert got[0].kept == p.T * top_k, f"{name} dropped choices on a dropless problem"
        assert_same(name, got, ref)


def test_core_is_the_lab_layer_unchanged():
    """`core` feeds the problem's tensors into labutils.moe.FMoETransformerMLP: same as running that layer."""
    from labbook.perf.real_layers import _LogitsGate, core
    from labutils.moe import FMoETransformerMLP

    p = make_problem(tokens=32, d_model=8, d_hidden=16, num_expert=4, top_k=2, limits=False)
    layer = FMoETransformerMLP(num_expert=4, d_model=8, d_hidden=16, top_k=2, gate=_LogitsGate)
    with torch.no_grad():
        for i, e in enumerate(layer.experts):
            pairs = ((e.htoh4.weight, p.w1), (e.htoh4.bias, p.b1), (e.h4toh.weight, p.w2), (e.h4toh.bias, p.b2))
            for dst, src in pairs:
                dst.copy_(src[i:i + 1])
    layer.gate.logits = p.logits
    assert compare_tensors("core vs layer", core(p).y, layer(p.x), rtol=0, atol=0).exact


def test_rows_count_padding():
    p = make_problem(tokens=64, d_model=8, d_hidden=8, num_expert=4, top_k=2, limits=False)
    _, counts = count_by_gate(route(p.logits, 2)[0], 4)
    d = build_designs(p, ["padded", "einsum", "core"])
    assert d["padded"](p).rows == 4 * int(counts.max())
    assert d["einsum"](p).rows == 4 * int(counts.max())
    assert d["core"](p).rows == 64 * 2


@pytest.mark.parametrize("cf", [0.5, 1.0])
def test_einsum_capacity_keeps_first_choices_up_to_capacity(cf):
    p = make_problem(tokens=64, d_model=8, d_hidden=8, num_expert=4, top_k=2, seed=3, limits=False)
    out = einsum(p, capacity_factor=cf)
    C = math.ceil(cf * 64 * 2 / 4)
    idx, _ = route(p.logits, 2)
    kept = 0
    for e in range(4):  # choice-major: all first choices of expert e, then its second choices, up to C
        kept += min(C, int((idx == e).sum()))
    assert out.kept == kept and out.rows == 4 * C


@pytest.mark.skipif(not HAVE_DS, reason="deepspeed is not installed")
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_deepspeed_capacity_drops_match_its_formula(top_k):
    p = make_problem(tokens=64, d_model=8, d_hidden=16, num_expert=8, top_k=top_k, seed=5, limits=False)
    ds = DeepSpeedMoE(p, capacity_factor=1.0)
    out = ds(p)
    C = max(4, math.ceil(1.0 * top_k * 64 / 8))
    _, counts = count_by_gate(route(p.logits, top_k)[0], 8)
    assert out.rows == 8 * C
    assert out.kept == sum(min(C, c) for c in counts.tolist()) < 64 * top_k


def test_limits_do_the_same_flops():
    p = make_problem(tokens=40, d_model=8, d_hidden=12, num_expert=5, top_k=2)
    _, counts = count_by_gate(route(p.logits, 2)[0], 5)
    assert [x.shape[0] for x in p.sliced_x] == counts.tolist()
    assert dense(p).y.shape == (40, 8) and p.dense_w[0].shape == (2 * 12, 8)
    assert separate(p).kept == 40 * 2
    fwd_bwd(separate, p)
    assert all(x.grad is not None for x in p.sliced_x if x.shape[0])


def test_bad_arguments_are_explained():
    with pytest.raises(ValueError, match="top_k=5"):
        make_problem(tokens=8, d_model=4, d_hidden=4, num_expert=4, top_k=5)
    p = make_problem(tokens=8, d_model=4, d_hidden=4, num_expert=4, top_k=1, limits=False)
    with pytest.raises(ValueError, match="unknown designs"):
        build_designs(p, ["loop", "magic"])


def test_peak_memory_sees_a_temporary():
    n = 1 << 20  # a 4 MiB temporary that is freed before the function returns

    def fn():
        t = torch.ones(n)
        return float(t.sum())

    peak = peak_memory(fn)
    assert 4 * n <= peak < 4 * n + (1 << 20), peak


def test_measure_point_and_breakdown_report_every_design_and_phase():
    p = make_problem(tokens=64, d_model=8, d_hidden=16, num_expert=4, top_k=2)
    rows = measure_point(p, ["loop", "core", "padded"], reps=1, memory=True)
    names = [r["design"] for r in rows]
    assert names == ["loop", "core", "padded", "dense", "separate"]
    dense_row = rows[names.index("dense")]
    assert dense_row["ratio"] == 1.0 and all(r["kept"] == 1.0 and r["peak_mb"] > 0 for r in rows)
    b = core_breakdown(p, reps=1)
    assert set(PHASES) <= set(b["total"]) and all(b["forward"][ph] > 0 for ph in PHASES)
    assert b["backward"]["expert compute"] > 0


@pytest.mark.parametrize("threads", [1, 2])
def test_bench_clock_is_cpu_time_only_with_one_thread(threads):
    """With one torch thread the timings are the thread's CPU time, so a sleeping step costs ~0 s; with more
    threads they are wall clock and the sleep counts. (Both benchmark helpers share the rule.)"""
    import time

    from labbook.perf.timing import bench, clock, machine_info

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t = bench({"sleep": lambda: time.sleep(0.05)}, reps=2, warmup=0)["sleep"]
        recorded = machine_info()["clock"]
        moe_clock = clock()
    finally:
        torch.set_num_threads(before)
    if threads == 1:
        assert max(t) < 0.02 and recorded.startswith("thread CPU time") and moe_clock is time.thread_time
    else:
        assert min(t) >= 0.05 and recorded == "wall clock" and moe_clock is time.perf_counter


def test_save_result_writes_json_and_reports_a_relative_path(tmp_path):
    import json

    from labbook.perf.timing import save_result

    out = tmp_path / "results" / "x.json"
    assert save_result({"a": [1, 2.5]}, out, tmp_path) == "results/x.json"
    saved = json.loads(out.read_text())
    assert saved["a"] == [1, 2.5] and out.read_text().endswith("\n")
    from labbook import records
    assert saved["code"] == records.fingerprint() and "labbook/perf/timing.py" in saved["code"]
    assert records.changed(saved) == [] and "as it is now" in records.code_status(saved)
    saved["code"]["labbook/perf/timing.py"] = "0" * 16          # the code changed since: the record says so
    assert records.changed(saved) == ["labbook/perf/timing.py"] and "has changed since" in records.code_status(saved)
    assert "no code fingerprint" in records.code_status({"a": 1})
    assert save_result({}, out, tmp_path / "elsewhere") == str(out)


def test_latency_bandwidth_fit_recovers_a_known_line_and_says_when_it_does_not_fit():
    from labbook.perf.timing import fit_latency_bandwidth

    sizes = [2 ** p for p in range(10, 25, 2)]
    fit = fit_latency_bandwidth(sizes, [50e-6 + b / 3e9 for b in sizes])
    assert math.isclose(fit["latency_s"], 50e-6, rel_tol=1e-6)
    assert math.isclose(fit["bandwidth_gb_s"], 3.0, rel_tol=1e-6)
    assert fit["max_rel_error"] < 1e-9
    curved = fit_latency_bandwidth(sizes, [50e-6 + (b / 3e9) ** 1.5 for b in sizes])   # not a line: it says so
    assert curved["max_rel_error"] > 0.2
    with pytest.raises(ValueError, match="two different message sizes"):
        fit_latency_bandwidth([1024, 1024], [1e-3, 1e-3])


def test_core_reports_the_kept_share_its_routing_gives():
    """The core's kept count comes from the routing it used (a gate that drops shows fewer), not a constant."""
    from labbook.perf.real_layers import core

    p = make_problem(tokens=16, d_model=8, d_hidden=16, num_expert=4, top_k=2, limits=False)
    assert core(p).kept == 32
    import labbook.perf.real_layers as R  # the core's gate routes with the route() its module sees

    real_route = R.route
    try:
        def dropping(logits, top_k):
            idx, score = real_route(logits, top_k)
            return idx.masked_fill(torch.arange(idx.shape[0]).unsqueeze(1) < 3, -1), score
        R.route = dropping
        assert core(p).kept == 32 - 3 * 2
    finally:
        R.route = real_route


def test_timed_core_owns_its_parameters_and_matches_the_fed_core():
    """CoreMoE (the timed design) holds per-expert parameters copied from the problem, as a user's layer does:
    same output and gradients as feeding the problem's tensors (core), its gradients land in its own
    parameters, not in the problem's (negative control: after its step the problem's weights have no grad)."""
    from labbook.perf.real_layers import CoreMoE, core

    p = make_problem(tokens=40, d_model=8, d_hidden=12, num_expert=5, top_k=2, seed=4, limits=False)
    timed = CoreMoE(p)
    got = run(timed, p)
    assert p.w1.grad is None and all(e.htoh4.weight.grad is not None for e in timed.layer.experts)
    assert_same("CoreMoE vs core", got, run(core, p))
    assert len(list(timed.parameters())) == 4 * 5  # per-expert parameters, fastmoe's layout (the gate has none)



def test_speed_table_rows_are_the_dispatch_designs():
    """layer_bench's grouped_mm and naive-loop rows run dispatch's grouped_moe and loop_moe behind a NaiveGate:
    given the same gate and expert weights they compute the same layer (negative control: one expert's weight
    changed in the loop row makes them differ)."""
    from labbook.perf.layer_bench import GroupedMMMoE, NaiveLoopMoE

    torch.manual_seed(0)
    grouped, naive = GroupedMMMoE(8, 16, 4, 2), NaiveLoopMoE(8, 16, 4, 2)
    with torch.no_grad():
        naive.gate.load_state_dict(grouped.gate.state_dict())
        for e, mlp in enumerate(naive.experts):
            for lin, w, b in ((mlp[0], grouped.w1, grouped.b1), (mlp[2], grouped.w2, grouped.b2)):
                lin.weight.copy_(w[e])
                lin.bias.copy_(b[e])
    x = torch.randn(32, 8)
    assert compare_tensors("grouped row vs loop row", grouped(x), naive(x), rtol=TOL, atol=TOL).close
    with torch.no_grad():
        naive.experts[1][2].weight.add_(0.1)
    assert not compare_tensors("grouped row vs a changed loop row", grouped(x), naive(x), rtol=TOL, atol=TOL).close

# ---- property-based: every size, not one --------------------------------------------------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def problems(draw):
    E = draw(st.integers(1, 9))
    k = draw(st.integers(1, min(E, 3)))
    return dict(tokens=draw(st.integers(1, 40)), num_expert=E, top_k=k, d_model=draw(st.sampled_from([1, 2, 4, 8])),
                d_hidden=draw(st.sampled_from([1, 3, 4, 8, 12])), seed=draw(st.integers(0, 2 ** 16)))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_every_dropless_design_equals_the_loop_and_counts_what_it_computed(kw):
    """Over T, E, k, d and h: outputs and gradients equal the loop's, and the counts are what was computed
    (the core's after dispatch, the padded designs' E * busiest expert)."""
    p = make_problem(limits=False, **kw)
    T, E, k = kw["tokens"], kw["num_expert"], kw["top_k"]
    _, counts = count_by_gate(route(p.logits, k)[0], E)
    designs = build_designs(p, ["loop", "core", "padded", "grouped_mm", "einsum"])
    ref = run(designs.pop("loop"), p)
    if kw["d_model"] % 4 or kw["d_hidden"] % 4:  # torch._grouped_mm needs 16-byte aligned rows: a clear error
        with pytest.raises(ValueError, match="multiples of 4"):
            run(designs.pop("grouped_mm"), p)
    for name, fn in designs.items():
        got = run(fn, p)
        assert got[0].kept == T * k, f"{name} kept {got[0].kept} of {T * k}"
        want_rows = E * int(counts.max()) if name in ("padded", "einsum") else T * k
        assert got[0].rows == want_rows, f"{name} computed {got[0].rows} rows, expected {want_rows}"
        assert_same(name, got, ref)


# ---- fault injection: each fault must make the chapter's checks fail ---------------------------------------
def _drop_last_expert_above(layer_cls, tokens: int):
    """A core whose experts silently return zeros for the last expert's rows once the batch exceeds ``tokens``."""
    inner = layer_cls.expert_fn

    def expert_fn(self, inp, fwd_expert_count):
        out = inner(self, inp, fwd_expert_count)
        if inp.shape[0] > tokens * self.top_k and int(fwd_expert_count[-1]):
            out = out.clone()
            out[-int(fwd_expert_count[-1]):] = 0
        return out
    return expert_fn


def test_fault_silent_drop_above_a_size_fails_the_timed_sweep(monkeypatch):
    """The old equality check ran at T = 96 only; a core that drops an expert's rows above T = 200 passed it.
    measure_point checks every design against the loop at every size it times: the fault is caught at T = 256."""
    from labutils.moe.transformer import FMoETransformerMLP

    monkeypatch.setattr(FMoETransformerMLP, "expert_fn", _drop_last_expert_above(FMoETransformerMLP, 200))
    small = make_problem(tokens=96, d_model=8, d_hidden=16, num_expert=4, top_k=2)
    rows = measure_point(small, ["loop", "core"], reps=1, memory=False)          # below the size: still right
    assert all(r["equal_to_loop"] for r in rows if "equal_to_loop" in r)
    big = make_problem(tokens=256, d_model=8, d_hidden=16, num_expert=4, top_k=2)
    with pytest.raises(AssertionError, match="core"):
        measure_point(big, ["loop", "core"], reps=1, memory=False)
    with pytest.raises(AssertionError, match="profiled core differs"):
        core_breakdown(make_problem(tokens=256, d_model=8, d_hidden=16, num_expert=4, top_k=2, limits=False), reps=1)


def test_core_counts_rows_where_the_experts_run(monkeypatch):
    """kept/rows come from expert_fn's input and output, not the gate: rows lost between the gate and the
    experts show (negative control: a scatter that loses the last row)."""
    import labutils.moe.dispatch as dispatcher

    p = make_problem(tokens=32, d_model=8, d_hidden=16, num_expert=4, top_k=2, limits=False)
    assert build_designs(p, ["core"])["core"](p)[1:3] == (64, 64)
    real_count = dispatcher.count_by_gate

    def losing(idx, E, world_size=1, keep_dropped=False):
        pos, counts = real_count(idx, E, world_size, keep_dropped)
        counts = counts.clone()
        counts[-1] -= 1                                                           # the last expert loses a row
        return pos[:-1], counts
    monkeypatch.setattr(dispatcher, "count_by_gate", losing)
    out = build_designs(p, ["core"])["core"](p)
    assert out.kept == 63 and out.rows == 63


def _slowed_grouped_mm(p):
    """grouped_mm doing its matmuls four times (the result of the last): a slowed design."""
    from labbook.perf import dispatch as D
    for _ in range(3):
        with torch.no_grad():
            D.grouped_mm(p)
    return D.grouped_mm(p)


def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    return before


def test_fault_slowed_design_is_caught_against_the_record():
    """The live paired ratios of a design are tested against a record of the same size (Welch on the rounds,
    beyond a 25% slack): a clean re-run is consistent, grouped_mm doing its matmuls four times is slower."""
    from labbook.perf.verdicts import compare_ratios

    before = _one_thread()
    try:
        p = make_problem(tokens=256, d_model=64, d_hidden=128, num_expert=4, top_k=2, seed=2)
        record = {r["design"]: r for r in measure_point(p, ["grouped_mm"], reps=7, memory=False)}
        clean = {r["design"]: r for r in measure_point(p, ["grouped_mm"], reps=7, memory=False)}
        designs = {"grouped_mm": _slowed_grouped_mm}
        slowed = {r["design"]: r for r in measure_point(p, reps=7, memory=False, designs=designs)}
    finally:
        torch.set_num_threads(before)
    assert compare_ratios(clean["grouped_mm"]["ratios"], record["grouped_mm"]["ratios"])["call"] != "slower"
    call = compare_ratios(slowed["grouped_mm"]["ratios"], record["grouped_mm"]["ratios"])
    assert call["call"] == "slower", call


def test_fault_mislabelled_phase_is_caught_against_the_record(monkeypatch):
    """The combine charged to expert compute: its share drops to 0, outside the band the record spans."""
    import labbook.perf.breakdown as S

    before = _one_thread()
    try:
        p = make_problem(tokens=128, d_model=16, d_hidden=32, num_expert=4, top_k=2, limits=False)
        record = core_breakdown(p, reps=5)
        clean = core_breakdown(p, reps=5)
        monkeypatch.setitem(S._CORE_STEPS, "gather_combine", "expert compute")
        wrong = core_breakdown(p, reps=5)
    finally:
        torch.set_num_threads(before)
    assert S.compare_phases(clean, record)["combine"]["call"] != "vanished"
    assert S.compare_phases(wrong, record)["combine"]["call"] == "vanished"
    assert S.compare_phases(wrong, {k: v for k, v in record.items() if k != "runs"})["combine"]["call"] == "untestable"


def test_fault_a_sleeping_step_shows_as_waiting():
    """On one thread the clock is CPU time, which a sleep does not use: the wait share (1 - CPU / wall) shows it."""
    import time

    from labbook.perf import dispatch as D

    def sleepy_loop(p):
        time.sleep(0.25)                                                          # far above any preemption here
        return D.loop(p)

    before = _one_thread()
    try:
        p = make_problem(tokens=64, d_model=8, d_hidden=16, num_expert=4, top_k=2)
        rows = {r["design"]: r for r in measure_point(p, reps=3, memory=False, designs={"loop": sleepy_loop})}
    finally:
        torch.set_num_threads(before)
    # What the sleep is, is told by the voluntary switches (a sleep gives up the core; preemption by a busy machine
    # is involuntary); the wait share only has to exceed dense's: its size depends on the loop's own CPU time,
    # which load and mutmut's trampolines stretch (0.94 seen under mutmut, against a fixed 0.95 bar)
    loop, dense = rows["loop"], rows["dense"]
    assert loop["voluntary_switches"] > dense["voluntary_switches"], (loop, dense)
    assert loop["wait_share"] > max(0.5, dense["wait_share"]), (loop["wait_share"], dense["wait_share"])


def test_judge_overhead_reads_the_live_figure():
    from labbook.perf.breakdown import judge_overhead

    assert judge_overhead({"profiler_overhead": 0.83, "overhead_iqr": (0.78, 0.88), "reps": 5})["call"] == "too high"
    assert judge_overhead({"profiler_overhead": 0.3, "overhead_iqr": (0.25, 0.35), "reps": 5})["call"] == "ok"
    noisy = judge_overhead({"profiler_overhead": 0.45, "overhead_iqr": (0.3, 0.9), "reps": 5})
    assert noisy["call"] == "too noisy" and "too noisy to judge" in noisy["sentence"]
    assert judge_overhead({"profiler_overhead": 0.1, "overhead_iqr": (0.1, 0.1), "reps": 2})["call"] == "too noisy"


def test_breakdown_overhead_compares_like_with_like():
    """Both halves of the overhead are per-round times on one clock: a median and an IQR over the same rounds."""
    p = make_problem(tokens=64, d_model=8, d_hidden=16, num_expert=4, top_k=2, limits=False)
    b = core_breakdown(p, reps=3)
    lo, hi = b["overhead_iqr"]
    assert lo <= b["profiler_overhead"] <= hi and b["reps"] == 3 and len(b["runs"]) == 3


def test_target_verdict_needs_two_recordings_that_agree():
    from labbook.perf.verdicts import target_verdict

    ahead = [0.95, 0.96, 0.97, 0.95, 0.96]
    behind = [0.80, 0.82, 0.81, 0.79, 0.80]
    assert target_verdict([ahead], 0.9)["verdict"] == "inconclusive"           # one recording is not enough
    assert target_verdict([ahead, ahead], 0.9)["verdict"] == "met"
    assert target_verdict([behind, behind], 0.9)["verdict"] == "NOT met"
    assert target_verdict([ahead, behind], 0.9)["verdict"] == "inconclusive"   # recordings disagree
    assert target_verdict([[0.89, 0.91, 0.9], ahead], 0.9)["verdict"] == "inconclusive"


def test_run_conditions_flag_overload_and_too_few_rounds(monkeypatch):
    import os

    from labbook.perf.timing import describe_conditions, run_conditions

    monkeypatch.setattr(os, "getloadavg", lambda: (99.0, 0.0, 0.0))
    c = run_conditions(rounds=2, min_rounds=5)
    assert c["flags"] == ["overloaded", "too few rounds"]
    assert "OVERLOADED" in describe_conditions(c) and "TOO FEW ROUNDS" in describe_conditions(c)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert run_conditions(rounds=5, min_rounds=5)["flags"] == []


def test_iqr_verdict_judges_the_whole_iqr_against_the_target():
    from labbook.perf.verdicts import iqr_verdict

    assert iqr_verdict(1.44, 1.54, 1.20) == "NOT met"
    assert iqr_verdict(1.05, 1.20, 1.20) == "met"
    assert iqr_verdict(1.10, 1.30, 1.20) == "inconclusive"   # the target inside the IQR: no verdict
    with pytest.raises(ValueError, match="q1 <= q3"):
        iqr_verdict(1.5, 1.4, 1.2)
