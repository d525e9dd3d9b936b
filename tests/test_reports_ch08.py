"""Chapter 08's sentences (``labbook.reports.ch08``, issue 39): each function against a results dict recorded from
the executed chapter (trimmed), against a second dict where the verdict flips (the sentence must change with it),
and with a key missing (the error names it)."""
from __future__ import annotations

import copy

import pytest

from labbook.reports import ch08, gpu_layer

ONE_SITTING = "taken 14 min apart (one sitting; separate runs are at least 1 h apart)"
PROVISIONAL = {"verdict": "provisional", "why": "behind 0.9 in all 2 recordings, but within the 25% margin runs "
               "shift by, and taken 14 min apart (one sitting; separate runs are at least 1 h apart): a call needs "
               "separate runs", "calls": ["behind", "behind"], "lean": "NOT met"}
INCONCLUSIVE = {"verdict": "inconclusive", "why": "the recordings disagree or tie: inconclusive, inconclusive",
                "calls": ["inconclusive", "inconclusive"], "lean": None}

# recorded from notebooks/08_performance.ipynb (tiny preset), lists trimmed to a few entries
RECORDED = {
    "preset": "tiny", "margin": 0.25,
    "matmul": {"peak": 183.19906524704422, "best": 205.9010439851763, "shapes": 10, "above": 6},
    "live_conditions": "load 12.31 on 2 cores, 1 torch thread(s), thread CPU time (1 thread), 5 timed rounds "
                       "(minimum 5): OVERLOADED (load above the cores); CPU time still stands",
    "live": [
        {"design": "loop", "num_expert": 4, "tokens_per_expert": 256.0, "ratio": 0.5554, "kept": 1.0,
         "max_abs_diff": 0.0},
        {"design": "core", "num_expert": 4, "tokens_per_expert": 256.0, "ratio": 0.5467, "kept": 1.0,
         "max_abs_diff": 2.384185791015625e-07},
        {"design": "ds_cf1", "num_expert": 4, "tokens_per_expert": 256.0, "ratio": 0.49, "kept": 0.9931640625,
         "max_abs_diff": 2.6e-06},
        {"design": "core", "num_expert": 32, "tokens_per_expert": 32.0, "ratio": 0.2791, "kept": 1.0,
         "max_abs_diff": 2.6226043701171875e-06},
        {"design": "ds_cf1", "num_expert": 32, "tokens_per_expert": 32.0, "ratio": 0.24, "kept": 0.9296875,
         "max_abs_diff": 1e-06},
        {"design": "dense", "num_expert": 32, "tokens_per_expert": 32.0, "ratio": 1.0, "kept": 1.0,
         "max_abs_diff": None},
    ],
    "record_check": {"same_sizes": True, "same_cpu": True, "cpu": "Intel(R) Xeon(R) Processor",
                     "record_cpu": "Intel(R) Xeon(R) Processor"},
    "runs": {"ok": False, "why": ONE_SITTING, "loads": "dispatch_1thread_r1.json: 2026-11-25T13:30:29, load 18.2 on 2 "
             "cores; dispatch_1thread_r2.json: 2026-11-25T13:44:27, load 18.1 on 2 cores"},
    "roofline": {"above": [], "threads": 2},
    "live_overhead": {16: "too noisy", 128: "too noisy"},
    "comm": {"cores": 2, "fits": {
        2: {"latency_s": 0.00136048799, "bandwidth_gb_s": 1.04798723736, "max_rel_error": 0.568042316125163},
        8: {"latency_s": 0.0228988075719, "bandwidth_gb_s": 0.496356309767, "max_rel_error": 0.1686108384975}}},
    "core_targets": [
        {"sweep": "experts", "T": 1024, "E": 16, "k": 2, "tpe": 128.0,
         "dense": dict(PROVISIONAL, medians=[0.7454325012400622, 0.7748642943468493]),
         "separate": dict(INCONCLUSIVE, medians=[0.8722246228197432, 0.9184147106969255])},
        {"sweep": "experts", "T": 1024, "E": 4, "k": 2, "tpe": 512.0,
         "dense": dict(INCONCLUSIVE, medians=[0.89, 0.88]), "separate": dict(INCONCLUSIVE, medians=[0.92, 0.91])},
    ],
    "separate_big": [0.9595368904837704, 0.7932030437918110, 0.8819652212476671],
    "worst_small": {"ratio": 0.2916340273995974, "iqr": [0.2853813454058014, 0.32212274389397305], "tpe": 16.0,
                    "sweep": "experts", "separate": 0.29273951829201034},
    "fastest": {"experts": [[16.0, [["grouped_mm", 0.30600112106721733], ["core", 0.3142967908876319]]],
                            [32.0, [["core", 0.45217956291113415], ["core", 0.4819197346643309]]]],
                "tokens": [[512.0, [["core", 0.9086994811079858], ["core", 0.8578102364108021]]]]},
    "beaten": [],
    "maybe": [{"design": "grouped_mm", "ref": "separate", "tpe": 16.0, "sweep": "tokens",
               "medians": [1.151890760840569, 1.0822383937556925]}],
    "einsum": {"E": 128, "speed": 0.36791993401580186, "memory": 1.5584891324993895, "peak_mb": 224.35546875},
    "deepspeed": {"kept1": [0.9033203125, 0.99560546875], "kept2": 1.0, "rows2": 2.0,
                  "ratio2": [0.2534032073072353, 0.4628951634129974]},
    "recorded_profile": [[16, 0.05164970170672312, "too noisy"], [128, 0.06681113683314477, "too noisy"]],
    "memory": {"E": 128, "peak_mb": 143.95703125, "grad_mb": 128.0},
    "layer_memory": {"ours (FMoETransformerMLP)": {"peak_rss_mb": 839.79296875,
                                                   "peak_rss_mb_each": [839.79296875, 837.609375, 840.6640625]},
                     "DeepSpeed cf=1": {"peak_rss_mb": 800.15234375}, "repeats": 3,
                     "ratio_peak_rss": 1.049541347106752,
                     "status": "moe_layer_memory.json carries no code fingerprint"},
    "layer_runs": {"1 thread, CPU time": {"ok": False, "why": "taken 3 min apart (one sitting; separate runs are at "
                                          "least 1 h apart)", "loads": "moe_layer_1thread.json: 2026-11-25T19:22:31, "
                                          "load 2.0 on 2 cores; moe_layer_1thread_run2.json: 2026-11-25T19:25:55, load "
                                          "1.1 on 2 cores"}},
    "layer_verdicts": [
        {"verdict": "provisional", "why": "ahead of 1.0 in all 2 recordings, but within the 25% margin runs shift by, "
         "and taken 3 min apart (one sitting; separate runs are at least 1 h apart): a call needs separate runs",
         "calls": ["ahead", "ahead"], "lean": "met", "shape": {"T": 4096, "d": 512, "h": 2048, "E": 16, "top_k": 2},
         "what": "ours / DeepSpeed cf=1", "target": 1.0, "clock": "1 thread, CPU time",
         "medians": [1.0320699328867424, 1.034747542789764]},
        {"verdict": "met", "why": "ahead of 1.0 in all 3 recordings, by more than the 25% margin",
         "calls": ["ahead"] * 3,
         "lean": "met", "shape": {"T": 4096, "d": 512, "h": 2048, "E": 16, "top_k": 2}, "what": "ours / grouped_mm",
         "target": 1.0, "clock": "2 threads, wall clock", "medians": [1.352, 1.392, 1.353]},
    ],
    "fixed_cost": {"ms": {"ours (": 11.071209000000692, "grouped_mm": 2.920265999998506},
                   "recorded_ms": 167.66973899999016, "shape": {"T": 4096, "d": 256, "h": 512, "E": 64, "top_k": 2}},
    "tax": {"verdict": {"verdict": "inconclusive", "why": "1 recording(s); a verdict needs at least two",
                        "calls": ["behind"], "lean": None},
            "one": {"call": "inconclusive", "mean": 0.7083202515274523, "ci": [0.700034594447064, 0.7166059086078395],
                    "p": 1.4e-37, "n": 60, "margin": 0.25, "bar": 0.8333333333333334},
            "moe_over_dense": {"median": 1.4133615514264184, "q1": 1.3697939657122087, "q3": 1.4572727378657635},
            "preset": "full", "rounds": 60, "load": 0.66650390625, "cores": 2, "clock": "thread CPU time (1 thread)",
            "extra_ms": {"rest of the model": 2.2386389999997647, "router, top-k, aux loss": 3.8397649999994954,
                         "optimizer (Adam)": 0.46200799999951414},
            "step_ms": {"dense": 27.219344000000145, "MoE": 41.50520899999943}, "peak": 1.2438009506369752,
            "adam_ms": {"dense": {"default": 0.9087535000000813, "fused": 0.14007049999964494},
                        "MoE": {"default": 1.656470000000354, "fused": 0.39037600000035866}}},
    "cuts": {"config": {"tokens": 2048, "d_model": 64, "hidden": 128, "num_expert": 8, "top_k": 2, "rounds": 60,
                        "clock": "thread CPU time (1 thread)"}, "margin": 0.25,
             "wide": {"router matmul x @ w (d, E) in F.linear's layout": "inconclusive"},
             "cuts": {"router matmul x @ w (d, E) in F.linear's layout": {
                 "cut_over_plain": {"median": 0.8000326771759545, "q1": 0.7787000380354239, "q3": 0.8337072613233782},
                 "max_abs_diff": 7.62939453125e-06, "adopted": True},
                 "NoisyGate's two router matmuls as one": {
                     "cut_over_plain": {"median": 1.13238636682, "q1": 1.10362333425, "q3": 1.15947879609},
                     "max_abs_diff": 4.291534423828125e-06, "adopted": False}}},
}


def flipped(**changes) -> dict:
    R = copy.deepcopy(RECORDED)
    for k, v in changes.items():
        R[k] = v
    return R


def test_provenance_and_layer_record_state_where_when_and_load():
    rec = {"machine": {"command": "python benchmarks/matmul.py", "date": "2026-11-21T16:23:18", "device": "cpu",
                       "cpu": "AMD EPYC", "cores": 2, "torch_threads": 2, "torch": "2.13.0+cpu",
                       "load_avg_1min": 2.875}}
    said = ch08.provenance("matmul.json", rec, "no fingerprint")
    assert said.startswith("matmul.json: `python benchmarks/matmul.py` on 2026-11-21T16:23:18, cpu, AMD EPYC")
    assert "wall clock" in said and "load 2.88 before)" in said and said.endswith("   no fingerprint")
    after = ch08.provenance("x.json", dict(rec, load_avg_1min_after=3.0), "s")
    assert "load 2.88 before, 3.00 after)" in after
    layer = {"machine_before": {"date": "2026-11-25T19:16:24", "torch_threads": 2, "load_avg_1min": 1.01},
             "machine_after": {"load_avg_1min": 1.88}, "allocator": "glibc defaults"}
    line = ch08.layer_record("moe_layer.json", layer, "status")
    assert line == ("== moe_layer.json (glibc defaults, 2 threads, a python process): 2026-11-25T19:16:24, glibc "
                    "defaults, 2 thread(s), load 1.01 before, 1.88 after; status")
    assert "(one thread, CPU time)" in ch08.layer_record("moe_layer_1thread_r9.json", layer, "status")
    with pytest.raises(KeyError, match="machine"):
        ch08.provenance("x.json", {}, "s")


def test_matmul_says_whether_an_expert_shape_beat_the_square_matmul():
    said = ch08.matmul(RECORDED)
    assert "206 GFLOP/s vs the square matmul's 183" in said and "6 of 10 expert shapes ran faster" in said
    none = ch08.matmul(flipped(matmul=dict(RECORDED["matmul"], above=0, best=150.0)))
    assert "no expert shape beat the square matmul" in none and "ran faster" not in none


def test_evidence_and_unchecked_live_follow_the_records():
    said = ch08.evidence(RECORDED)
    assert ONE_SITTING in said and "only where both clear it by the 25% margin, else provisional" in said
    ok = ch08.evidence(flipped(runs=dict(RECORDED["runs"], ok=True, why="separate runs, every design interleaved")))
    assert "provisional" not in ok and "separate runs, every design interleaved" in ok
    other_cpu = flipped(record_check=dict(RECORDED["record_check"], same_cpu=False, cpu="AMD EPYC"))
    assert "this machine is AMD EPYC" in ch08.unchecked_live(other_cpu)
    no_record = flipped(record_check=dict(RECORDED["record_check"], same_sizes=False, same_cpu=False))
    assert ch08.unchecked_live(no_record).startswith("No record at the tiny preset's live sizes")


def test_roofline_names_points_above_the_roof():
    assert ch08.roofline(RECORDED).startswith("Points above the roof: none; the designs ran on one thread, the "
                                              "matmul sweep on 2")
    above = ch08.roofline(flipped(roofline={"above": [["grouped_mm", 512.0]], "threads": 2}))
    assert "grouped_mm at 512 tokens/expert" in above and "none" not in above


def test_core_targets_counts_each_verdict_and_lists_every_point():
    said = ch08.core_targets(RECORDED)
    assert ("the core against 0.9 of the dense reference: met at 0, NOT met at 0, provisional at 1, inconclusive "
            "at 1; against 0.9 of the E separate MLPs: met at 0, NOT met at 0, provisional at 0, inconclusive at 2"
            in said)
    assert f"Provisional: {ONE_SITTING}." in said
    assert "experts T=1024 E=16 k=2 (128/expert): vs dense 0.75/0.77 -> provisional (leans NOT met)" in said
    assert "reached 0.79-0.96 of the dense reference" in said
    assert "fell to 0.29 [IQR 0.29-0.32] of the dense reference (at 16 tokens/expert" in said
    met = flipped(core_targets=[dict(p, dense=dict(p["dense"], verdict="met", lean="met"))
                                for p in RECORDED["core_targets"]],
                  runs=dict(RECORDED["runs"], ok=True))
    said_met = ch08.core_targets(met)
    assert "dense reference: met at 2, NOT met at 0, provisional at 0" in said_met
    assert "Provisional:" not in said_met and "-> met;" in said_met


def test_designs_says_when_the_recordings_disagree_and_what_beat_a_reference():
    said = ch08.designs(RECORDED)
    assert "(experts sweep, paired median vs dense, r1 and r2): 16: grouped_mm (0.31) / core (0.31) (the recordings " \
           "disagree); 32: core (0.45)" in said
    assert "References beaten (ahead of 1.0 in both recordings" in said and "): none; provisionally" in said
    assert "grouped_mm beats separate at 16 tokens/expert (tokens sweep, 1.15/1.08)" in said
    assert "GShard's einsum at E=128: 0.37x the core's speed (medians) and 1.6x its peak memory (224 MB)" in said
    beaten = ch08.designs(flipped(beaten=RECORDED["maybe"], maybe=[]))
    assert "): none" not in beaten and "provisionally" not in beaten
    assert "4. GShard" not in ch08.designs(flipped(einsum=None))


def test_costs_reads_deepspeed_profile_comm_and_memory():
    said = ch08.costs(RECORDED)
    assert "kept 0.90-1.00 of the choices; factor 2.0 kept 1.00 but computed 2.00x the rows" in said
    assert "16 tokens/expert 5% (too noisy)" in said and "no recorded profile is well-conditioned" in said
    assert "latency 1.36 ms and 1.05 GB/s per rank on 2 workers; 22.90 ms and 0.50 GB/s on 8 workers" in said
    assert "peaks at 144 MB, of which the expert weight gradients alone are 128 MB: with many experts, memory is " \
           "parameters" in said
    good = flipped(recorded_profile=[[128, 0.067, "ok"]], memory={"E": 4, "peak_mb": 40.0, "grad_mb": 4.0})
    said_good = ch08.costs(good)
    assert "judged well-conditioned at 128 tokens/expert" in said_good
    assert "here dispatch, not parameters, holds most of it" in said_good


def test_layer_memory_and_fixed_cost():
    said = ch08.layer_memory(RECORDED)
    assert "ours 840 MB, DeepSpeed cf=1 800 MB: ratio 1.050, within the target of 1.1" in said
    assert "each 840, 838, 841 MB for ours" in said
    over = flipped(layer_memory=dict(RECORDED["layer_memory"], ratio_peak_rss=1.2))
    assert "ratio 1.200, ABOVE the target" in ch08.layer_memory(over)
    fixed = ch08.fixed_cost(RECORDED)
    assert "(T4096 d256, one thread) the core's step took 168 ms" in fixed and "(8.2 ms more" in fixed
    assert "is 4.9% of it" in fixed
    less = flipped(fixed_cost=dict(RECORDED["fixed_cost"], recorded_ms=81.51))
    assert "is 10.0% of it" in ch08.fixed_cost(less)


def test_layer_verdicts_one_line_per_shape_and_target():
    said = ch08.layer_verdicts(RECORDED)
    assert "- **1 thread, CPU time**: moe_layer_1thread.json" in said
    assert ("T4096 d512 E16 ours / DeepSpeed cf=1, target 1.0: 1 thread, CPU time [1.032/1.035] provisional "
            "(leans met)") in said
    assert "ours / grouped_mm, target 1.0: 2 threads, wall clock [1.352/1.392/1.353] met (" in said
    vs = copy.deepcopy(RECORDED["layer_verdicts"])
    vs[0].update(verdict="NOT met", lean="NOT met")
    assert "[1.032/1.035] NOT met (" in ch08.layer_verdicts(flipped(layer_verdicts=vs))


def test_tax_paragraph_from_the_record():
    said = ch08.tax(RECORDED)
    assert "MoE's training step costs **1.41×** dense's (paired median over 60 rounds, IQR 1.37–1.46)" in said
    assert "issue 26's target of 1.20× is inconclusive (1 recording(s)" in said
    assert "mean 0.708, 95% CI [0.700, 0.717], against 1/1.20 = 0.833 by the 25% margin one run needs: inconclusive" \
        in said
    assert "extra 14.3 ms, router, top-k, aux loss +3.8 ms, rest of the model +2.2 ms, optimizer (Adam) +0.5 ms" in said
    assert "MoE 1.66 ms vs dense 0.91 ms" in said and "MoE 0.39 ms vs dense 0.14 ms" in said
    assert "MoE 1.24× dense's" in said
    met = copy.deepcopy(RECORDED["tax"])
    met["verdict"].update(verdict="NOT met", why="behind 0.833 in all 2 recordings")
    assert "target of 1.20× is NOT met (behind 0.833 in all 2 recordings;" in ch08.tax(flipped(tax=met))


def test_cuts_table_and_the_margin():
    said = ch08.cuts(RECORDED)
    assert "2,048 tokens, d 64, 8 experts of 128, top-2" in said
    assert "| router matmul x @ w (d, E) in F.linear's layout | 0.80 (0.78–0.83) | 8e-06 | yes |" in said
    assert "| NoisyGate's two router matmuls as one | 1.13 (1.10–1.16) | 4e-06 | no |" in said
    assert "(router matmul x @ w (d, E) in F.linear's layout: provisional)" in said
    clears = flipped(cuts=dict(RECORDED["cuts"], wide={"router matmul x @ w (d, E) in F.linear's layout": "ahead"}))
    assert "in F.linear's layout: clears it)" in ch08.cuts(clears)


def test_summary_counts_and_flips():
    said = ch08.summary(RECORDED)
    assert said.startswith("- *Preset tiny; live timings on one thread in CPU time; load 12.31 on 2 cores")
    assert "at every live timed size: 3 design-size pairs, largest difference 2.6e-06" in said
    assert "DeepSpeed at capacity factor 1.0 kept 0.93-0.99 of the choices live" in said
    assert "the core ran at 0.28-0.55 of the dense reference (paired medians) from 32 to 256 tokens per expert" in said
    assert "met at 0, NOT met at 0, provisional at 1, inconclusive at 1 of 2 points (the recordings: taken 14 min" \
        in said
    assert "References beaten in both recordings: 0 design-point pairs; provisionally, 1 more." in said
    assert "16 tokens/expert: too noisy; 128 tokens/expert: too noisy." in said
    assert "met 1, NOT met 0, provisional 1, inconclusive 0" in said
    assert "1.36 ms + bytes / 1.05 GB/s (worst miss 57%)" in said
    beaten = ch08.summary(flipped(beaten=RECORDED["maybe"], maybe=[], runs=dict(RECORDED["runs"], ok=True)))
    assert "1 design-point pairs (e.g. grouped_mm beats separate at 16 tokens/expert); provisionally, 0 more." in beaten
    assert "of 2 points." in beaten and "the recordings: taken" not in beaten


@pytest.mark.parametrize("fn, key", [(ch08.summary, "layer_verdicts"), (ch08.tax, "tax"), (ch08.cuts, "cuts"),
                                     (ch08.core_targets, "worst_small"), (ch08.designs, "fastest"),
                                     (ch08.costs, "comm"), (ch08.matmul, "matmul"), (ch08.evidence, "runs")])
def test_a_missing_key_is_named(fn, key):
    R = copy.deepcopy(RECORDED)
    del R[key]
    with pytest.raises(KeyError, match=f"needs R\\['{key}'\\]"):
        fn(R)
    with pytest.raises(TypeError, match="results dict"):
        fn([])


# benchmarks/gpu_layer.py's record, trimmed to what chapter 08 shows (synthetic: no GPU has written one here)
GPU_RECORD = {
    "benchmark": "gpu_layer", "preset": "issue", "device": "cuda:0", "gpu": "NVIDIA H100 80GB HBM3", "smoke": False,
    "versions": {"torch": "2.13.0+cu128", "cuda": "12.8",
                 "fastmoe": {"available": True, "commit": "a1b2c3d", "version": "1.1.0", "why": None}},
    "machine": {"date": "2026-12-01T10:00:00"},
    "timing": {"clock": "CUDA events", "warmup": 3, "rounds": 7},
    "target": {"speed": 0.8, "lab_row": "lab FMoETransformerMLP", "grouped_row": "grouped GEMM, pre-grouped (limit)"},
    "results": [
        {"shape": {"T": 16384, "d": 1024, "h": 4096, "E": 8, "k": 2}, "dtype": "bf16", "grouped_ms": 4.0,
         "lab_ms": 4.5, "lab_over_grouped": 1.125,
         "verdict": {"speed": 0.8888888888888888, "lab_over_grouped": 1.125, "target": 0.8, "met": True,
                     "verdict": "met"},
         "parity": {"max_abs_diff": 0.0078125, "max_abs_output": 3.1}},
        {"shape": {"T": 32768, "d": 2048, "h": 1408, "E": 64, "k": 6}, "dtype": "fp32", "grouped_ms": 40.0,
         "lab_ms": 45.0, "lab_over_grouped": 1.125,
         "verdict": {"speed": 0.8888888888888888, "lab_over_grouped": 1.125, "target": 0.8, "met": True,
                     "verdict": "met"},
         "parity": {"max_abs_diff": 2.4e-06, "max_abs_output": 3.0}},
        {"shape": {"T": 4096, "d": 512, "h": 2048, "E": 16, "k": 2}, "dtype": "bf16", "grouped_ms": None,
         "lab_ms": None, "lab_over_grouped": None, "verdict": None,
         "why_no_verdict": "lab FMoETransformerMLP: OutOfMemoryError: CUDA out of memory",
         "parity": {"max_abs_diff": None, "why": "not compared"}},
    ],
}


def test_gpu_record_says_plainly_when_there_is_none():
    said = gpu_layer.gpu_record(None)
    assert said == ("No GPU record yet: run `python benchmarks/gpu_layer.py` on a machine with a CUDA GPU; the book "
                    "has not measured the GPU rows.")
    assert "|" not in said
    with pytest.raises(TypeError, match="or None"):
        gpu_layer.gpu_record([])
    with pytest.raises(KeyError, match="results"):
        gpu_layer.gpu_record({k: v for k, v in GPU_RECORD.items() if k != "results"})


def test_gpu_record_table_names_device_and_versions():
    said = gpu_layer.gpu_record(GPU_RECORD)
    assert said.startswith("**The layer on a GPU** (`benchmarks/gpu_layer.py --preset issue`, 2026-12-01T10:00:00): "
                           "NVIDIA H100 80GB HBM3, torch 2.13.0+cu128, CUDA 12.8, fastmoe a1b2c3d.")
    assert "median of 7 interleaved rounds (CUDA events)" in said and "at >= 0.80 of the grouped-GEMM limit" in said
    assert "| shape | dtype | grouped ms | lab ms | grouped / lab | verdict |" in said
    assert "| T16384 d1024 h4096 E8 k2 | bf16 | 4.00 | 4.50 | 0.89 | met |" in said
    assert "| T32768 d2048 h1408 E64 k6 | fp32 | 40.00 | 45.00 | 0.89 | met |" in said
    assert "| T4096 d512 h2048 E16 k2 | bf16 | - | - | - | not measured (lab FMoETransformerMLP: OutOfMemoryError" \
        in said
    assert "Met at 2 of 3 shape/dtype pairs, NOT met at 0." in said
    assert "largest output difference: 7.8e-03 (bf16), 2.4e-06 (fp32)." in said
    assert "smoke run" not in said and "No GPU record" not in said


def test_gpu_record_flipped_verdict_and_smoke_run():
    flip = copy.deepcopy(GPU_RECORD)
    flip["results"][0].update(lab_ms=8.0, lab_over_grouped=2.0)
    flip["results"][0]["verdict"].update(speed=0.5, lab_over_grouped=2.0, met=False, verdict="NOT met")
    said = gpu_layer.gpu_record(flip)
    assert "| T16384 d1024 h4096 E8 k2 | bf16 | 4.00 | 8.00 | 0.50 | NOT met |" in said
    assert "Met at 1 of 3 shape/dtype pairs, NOT met at 1." in said
    smoke = copy.deepcopy(GPU_RECORD)
    smoke.update(smoke=True, gpu=None, device="cpu")
    smoke["versions"].update(cuda=None, fastmoe={"available": False, "commit": None})
    for e in smoke["results"]:
        e["parity"] = {"max_abs_diff": None, "why": "fastmoe not importable: no fmoe"}
    said = gpu_layer.gpu_record(smoke)
    assert "): cpu, torch 2.13.0+cu128, CUDA none, fastmoe not installed." in said
    assert "**This record is a CPU smoke run of the machinery, not a GPU measurement.**" in said
    assert "Real fastmoe was not compared (fastmoe not importable: no fmoe)." in said
