"""Chapter 08 dispatch designs: every design computes the same outputs and gradients on identical weights and
routing (within 1e-5), DeepSpeed's layer included where it drops nothing; capacity designs keep exactly the
choices their capacity allows; the measuring helpers return what they promise. No timings are asserted."""
import math

import pytest
import torch
from torch import nn

from labutils.compare import compare_tensors
from labutils.moe import count_by_gate
from labutils.optional import available
from labutils.perf.dispatch import (
    DESIGNS,
    DeepSpeedMoE,
    build_designs,
    dense,
    einsum,
    fwd_bwd,
    make_problem,
    route,
    separate,
)
from labutils.perf.sweep import PHASES, core_breakdown, measure_point
from labutils.perf.timing import peak_memory

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
    from labutils.moe import FMoETransformerMLP
    from labutils.perf.dispatch import _LogitsGate, core

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

    from labutils.perf.timing import bench, clock, machine_info

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

    from labutils.perf.timing import save_result

    out = tmp_path / "results" / "x.json"
    assert save_result({"a": [1, 2.5]}, out, tmp_path) == "results/x.json"
    assert json.loads(out.read_text()) == {"a": [1, 2.5]} and out.read_text().endswith("\n")
    assert save_result({}, out, tmp_path / "elsewhere") == str(out)


def test_latency_bandwidth_fit_recovers_a_known_line_and_says_when_it_does_not_fit():
    from labutils.perf.timing import fit_latency_bandwidth

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
    from labutils.perf.dispatch import core

    p = make_problem(tokens=16, d_model=8, d_hidden=16, num_expert=4, top_k=2, limits=False)
    assert core(p).kept == 32
    import labutils.perf.dispatch as D

    real_route = D.route
    try:
        def dropping(logits, top_k):
            idx, score = real_route(logits, top_k)
            return idx.masked_fill(torch.arange(idx.shape[0]).unsqueeze(1) < 3, -1), score
        D.route = dropping
        assert core(p).kept == 32 - 3 * 2
    finally:
        D.route = real_route


def test_timed_core_owns_its_parameters_and_matches_the_fed_core():
    """CoreMoE (the timed design) holds per-expert parameters copied from the problem, as a user's layer does:
    same output and gradients as feeding the problem's tensors (core), its gradients land in its own
    parameters, not in the problem's (negative control: after its step the problem's weights have no grad)."""
    from labutils.perf.dispatch import CoreMoE, core

    p = make_problem(tokens=40, d_model=8, d_hidden=12, num_expert=5, top_k=2, seed=4, limits=False)
    timed = CoreMoE(p)
    got = run(timed, p)
    assert p.w1.grad is None and all(e.htoh4.weight.grad is not None for e in timed.layer.experts)
    assert_same("CoreMoE vs core", got, run(core, p))
    assert len(list(timed.parameters())) == 4 * 5  # per-expert parameters, fastmoe's layout (the gate has none)
