"""Chapter 08's sentences, written from its results dict ``R`` (issue 39). (Chapter 08.)

One function per paragraph, each ``f(R) -> str`` (Markdown): the chapter measures and checks in its cells, gathers
what it measured into ``R``, and shows these. :func:`provenance` and :func:`layer_record` are the lines a chapter
prints above a benchmark record (where, when, under what load, by which code). A key missing from ``R`` is named,
with the section that sets it.
"""
from __future__ import annotations

from labbook.perf.timing import describe_conditions

__all__ = ["provenance", "layer_record", "unchecked_live", "matmul", "evidence", "roofline", "core_targets",
           "designs", "costs", "layer_memory", "layer_verdicts", "fixed_cost", "tax", "cuts", "summary"]

_SET_BY = {"preset": "the setup", "live": "section 4's sweep", "live_conditions": "section 4's sweep",
           "record_check": "section 4's comparison with the record", "matmul": "section 3", "runs": "section 5",
           "margin": "the setup", "roofline": "section 5's roofline", "live_overhead": "section 6",
           "comm": "section 7", "core_targets": "section 8", "separate_big": "section 8",
           "worst_small": "section 8", "fastest": "section 8", "beaten": "section 8", "maybe": "section 8",
           "deepspeed": "section 8", "recorded_profile": "section 8", "memory": "section 8",
           "layer_memory": "section 9", "layer_runs": "section 9", "layer_verdicts": "section 9",
           "fixed_cost": "section 9", "tax": "section 10", "cuts": "section 10"}
VERDICT_WORDS = ("met", "NOT met", "provisional", "inconclusive")


def _need(R: dict, who: str, *keys: str) -> list:
    if not isinstance(R, dict):
        raise TypeError(f"ch08.{who}(R) takes the chapter's results dict, got {type(R).__name__}")
    missing = [k for k in keys if k not in R]
    if missing:
        raise KeyError(f"ch08.{who} needs R[{missing[0]!r}] (set by {_SET_BY.get(missing[0], 'the chapter')})")
    return [R[k] for k in keys]


def _said(v: dict) -> str:
    return v["verdict"] + (f" (leans {v['lean']})" if v["verdict"] == "provisional" else "")


def _slash(values, fmt=".2f") -> str:
    return "/".join(f"{m:{fmt}}" for m in values)


def _tally(verdicts) -> dict:
    verdicts = list(verdicts)
    return {w: verdicts.count(w) for w in VERDICT_WORDS}


def provenance(name: str, data: dict, status: str) -> str:
    """Where, when and under what load a benchmark record was measured (``data["machine"]``, its
    ``conditions`` if any), and ``status``: whether today's code made it (:func:`labbook.records.code_status`)."""
    m = data["machine"]
    after = f", {data['load_avg_1min_after']:.2f} after" if "load_avg_1min_after" in data else ""
    lines = [f"{name}: `{m['command']}` on {m['date']}, {m['device']}, {m['cpu']} ({m['cores']} cores, "
             f"{m['torch_threads']} torch threads, {m.get('clock', 'wall clock')}, torch {m['torch']}, "
             f"load {m['load_avg_1min']:.2f} before{after})"]
    if "conditions" in data:
        lines.append("   " + describe_conditions(data["conditions"]))
    return "\n".join(lines + ["   " + status])


LAYER_LABELS = {"moe_layer.json": "glibc defaults, 2 threads, a python process",
                "moe_layer_run2.json": "the same, again", "moe_layer_kernel.json": "the same, inside a Jupyter kernel",
                "moe_layer_tuned.json": "TUNED allocator (labelled)"}


def layer_record(name: str, data: dict, status: str) -> str:
    """The line above one layer speed-table record: its label, date, allocator, threads, loads, code status."""
    before = data["machine_before"]
    return (f"== {name} ({LAYER_LABELS.get(name, 'one thread, CPU time')}): {before['date']}, {data['allocator']}, "
            f"{before['torch_threads']} thread(s), load {before['load_avg_1min']:.2f} before, "
            f"{data['machine_after']['load_avg_1min']:.2f} after; {status}")


def unchecked_live(R: dict) -> str:
    """Why the live sweep is shown and not checked against a record (none at these sizes, or another CPU)."""
    preset, rc = _need(R, "unchecked_live", "preset", "record_check")
    if rc["same_sizes"] and not rc["same_cpu"]:
        return (f"The record was taken on {rc['record_cpu']}, this machine is {rc['cpu']}: each design's cost relative "
                "to dense depends on the CPU, so the live run is shown, not checked against it (record one here: "
                f"`benchmarks/dispatch.py --threads 1 --config live-{preset}`).")
    return (f"No record at the {preset} preset's live sizes (`benchmarks/dispatch.py --threads 1 --config "
            f"live-{preset}`): on this preset the live relative costs are shown, not checked against a record.")


def matmul(R: dict) -> str:
    """The recorded matmul sweep: the fastest expert-shape matmul against the square matmul."""
    (m,) = _need(R, "matmul", "matmul")
    said = (f"{m['above']} of {m['shapes']} expert shapes ran faster than the square matmul in this recording, so "
            "the square matmul is a reference, not a peak" if m["above"] else "no expert shape beat the square matmul")
    return f"Highest expert-shape matmul {m['best']:.0f} GFLOP/s vs the square matmul's {m['peak']:.0f}: {said}."


def evidence(R: dict) -> str:
    """Are the primary recordings separate runs? What a verdict on them may then claim."""
    runs, margin = _need(R, "evidence", "runs", "margin")
    tail = ("" if runs["ok"] else f"; so a target is called met or NOT met only where both clear it by the "
            f"{margin:.0%} margin, else provisional")
    return f"As evidence for a verdict: {runs['loads']}: {runs['why']}{tail}."


def roofline(R: dict) -> str:
    """Which recorded points lie above the measured roof, and why the roof is generous."""
    (r,) = _need(R, "roofline", "roofline")
    above = ", ".join(f"{d} at {t:g} tokens/expert" for d, t in r["above"]) or "none"
    return (f"Points above the roof: {above}; the designs ran on one thread, the matmul sweep on {r['threads']}: "
            "the roof is generous.")


def core_targets(R: dict) -> str:
    """Items 1 and 2 of "what the numbers say": the core against 0.9 of dense and of the separate MLPs at >= 128
    tokens per expert, point by point, and how far it fell below that."""
    pts, runs, sep, worst, preset = _need(R, "core_targets", "core_targets", "runs", "separate_big", "worst_small",
                                          "preset")
    n_rec = max((len(p["dense"]["medians"]) for p in pts), default=0)
    counts = {ref: ", ".join(f"{w} at {n}" for w, n in _tally(p[ref]["verdict"] for p in pts).items())
              for ref in ("dense", "separate")}
    lines = [f"1. With >= 128 tokens per expert ({len(pts)} points, {n_rec} recordings, the {preset} chapter reading "
             f"the recorded full-size sweeps) the core against 0.9 of the dense reference: {counts['dense']}; against "
             f"0.9 of the E separate MLPs: {counts['separate']}." + ("" if runs["ok"] else
                                                                      f" Provisional: {runs['why']}.")]
    lines += [f"    - {p['sweep']} T={p['T']} E={p['E']} k={p['k']} ({p['tpe']:g}/expert): vs dense "
              f"{_slash(p['dense']['medians'])} -> {_said(p['dense'])}; vs separate "
              f"{_slash(p['separate']['medians'])} -> {_said(p['separate'])}" for p in pts]
    if sep:
        lines.append(f"    - The separate MLPs themselves (matmuls only, no dispatch) reached {min(sep):.2f}-"
                     f"{max(sep):.2f} of the dense reference there (medians over the recordings): short per-expert "
                     "matmuls cost that much before any dispatch.")
    lines.append(f"2. Below 128 tokens per expert the core fell to {worst['ratio']:.2f} [IQR {worst['iqr'][0]:.2f}-"
                 f"{worst['iqr'][1]:.2f}] of the dense reference (at {worst['tpe']:g} tokens/expert, {worst['sweep']} "
                 f"sweep, r1), where the separate MLPs reached {worst['separate']:.2f}.")
    return "\n".join(lines)


def designs(R: dict) -> str:
    """Items 3 and 4: the fastest dropless design per tokens per expert (and whether the recordings agree), the
    references beaten, and GShard's einsum against the core."""
    fastest, beaten, maybe, runs = _need(R, "designs", "fastest", "beaten", "maybe", "runs")
    lines = []
    for sweep, points in fastest.items():
        said = []
        for x, best in points:
            agree = len({d for d, _ in best}) == 1
            said.append(f"{x:g}: " + (f"{best[0][0]} ({best[0][1]:.2f})" if agree else
                                      " / ".join(f"{d} ({r:.2f})" for d, r in best) + " (the recordings disagree)"))
        recs = " and ".join(f"r{i + 1}" for i in range(max(len(b) for _, b in points)))
        lines.append(f"3. Fastest dropless design per tokens/expert ({sweep} sweep, paired median vs dense, {recs}): "
                     + "; ".join(said))

    def pair(b):
        return (f"{b['design']} beats {b['ref']} at {b['tpe']:g} tokens/expert ({b['sweep']} sweep, "
                f"{_slash(b['medians'])})")

    lines.append("    - References beaten (ahead of 1.0 in both recordings, and by the margin where they are one "
                 "sitting): " + ("; ".join(map(pair, beaten)) or "none")
                 + (f"; provisionally ({runs['why']}): " + "; ".join(map(pair, maybe)) if maybe else ""))
    if R.get("einsum"):
        e = R["einsum"]
        lines.append(f"4. GShard's einsum at E={e['E']}: {e['speed']:.2f}x the core's speed (medians) and "
                     f"{e['memory']:.1f}x its peak memory ({e['peak_mb']:.0f} MB): its one-hot tensors cost O(T*E*C).")
    return "\n".join(lines)


def costs(R: dict) -> str:
    """Items 5 to 8: DeepSpeed's drops and padding, the recorded profile's share outside expert compute, the
    all-to-all's fitted latency and bandwidth, and what the memory is at many experts."""
    ds, prof, comm, mem = _need(R, "costs", "deepspeed", "recorded_profile", "comm", "memory")
    good = [t for t, _, call in prof if call == "ok"]
    fits = comm["fits"]
    w_max = max(fits)
    return "\n".join([
        f"5. DeepSpeed, capacity factor 1.0: kept {ds['kept1'][0]:.2f}-{ds['kept1'][1]:.2f} of the choices; factor 2.0 "
        f"kept {ds['kept2']:.2f} but computed {ds['rows2']:.2f}x the rows (padding), at {ds['ratio2'][0]:.2f}-"
        f"{ds['ratio2'][1]:.2f} of the dense reference.",
        "6. Profiled share of the core's time NOT in expert compute (r1): "
        + ", ".join(f"{t} tokens/expert {s:.0%} ({call})" for t, s, call in prof)
        + (f"; judged well-conditioned at {', '.join(str(t) for t in good)} tokens/expert" if good else
           "; no recorded profile is well-conditioned enough to read (see section 6), so no share is claimed") + ".",
        f"7. gloo all-to-all, fitted over all sizes: latency {fits[2]['latency_s'] * 1e3:.2f} ms and "
        f"{fits[2]['bandwidth_gb_s']:.2f} GB/s per rank on 2 workers; {fits[w_max]['latency_s'] * 1e3:.2f} ms and "
        f"{fits[w_max]['bandwidth_gb_s']:.2f} GB/s on {w_max} workers time-sharing {comm['cores']} cores "
        "(not a network figure).",
        f"8. Memory at E={mem['E']}: the core peaks at {mem['peak_mb']:.0f} MB, of which the expert weight gradients "
        f"alone are {mem['grad_mb']:.0f} MB" + (": with many experts, memory is parameters, not dispatch."
                                               if mem["grad_mb"] >= mem["peak_mb"] / 2 else
                                               ": here dispatch, not parameters, holds most of it."),
    ])


def layer_memory(R: dict) -> str:
    """The layer's peak RSS against DeepSpeed's, each row alone in fresh processes, and issue 15's 1.1 bar."""
    (mem,) = _need(R, "layer_memory", "layer_memory")
    ours, ds = (next(v for k, v in mem.items() if k.startswith(p)) for p in ("ours (", "DeepSpeed"))
    return (f"Peak RSS of 3 forward+backward steps, first shape, each row alone in a fresh process: ours "
            f"{ours['peak_rss_mb']:.0f} MB, DeepSpeed cf=1 {ds['peak_rss_mb']:.0f} MB: ratio "
            f"{mem['ratio_peak_rss']:.3f}, "
            + ("within" if mem["ratio_peak_rss"] <= 1.1 else "ABOVE")
            + f" the target of 1.1 (median of {mem.get('repeats', 1)} fresh processes per row: each "
            f"{', '.join(f'{x:.0f}' for x in ours['peak_rss_mb_each'])} MB for ours); {mem['status']}.")


def layer_verdicts(R: dict) -> str:
    """Section 9's verdicts: per clock whether its recordings are separate runs, then per shape, comparison and
    target each clock's per-recording medians, verdict and reason."""
    runs, vs = _need(R, "layer_verdicts", "layer_runs", "layer_verdicts")
    lines = [f"- **{clock}**: {sr['loads']}: {sr['why']}" for clock, sr in runs.items()]
    lines.append("- verdicts, paired per-round ratios (ours over the row, kept tokens/s), one Welch test per "
                 "recording:")
    rows: dict = {}
    for v in vs:
        s = v["shape"]
        rows.setdefault((f"T{s['T']} d{s['d']} E{s['E']}", v["what"], v["target"]), []).append(
            f"{v['clock']} [{_slash(v['medians'], '.3f')}] {_said(v)} ({v['why']})")
    lines += [f"    - {shape} {what}, target {target}: " + "; ".join(said)
              for (shape, what, target), said in rows.items()]
    return "\n".join(lines)


def fixed_cost(R: dict) -> str:
    """The core's fixed cost per step (measured at d = h = 8, 64 experts) as a share of the recorded step."""
    (f,) = _need(R, "fixed_cost", "fixed_cost")
    extra = f["ms"]["ours ("] - f["ms"]["grouped_mm"]
    s = f["shape"]
    return (f"At the recorded 64-expert shape (T{s['T']} d{s['d']}, one thread) the core's step took "
            f"{f['recorded_ms']:.0f} ms: the fixed cost measured here ({extra:.1f} ms more than grouped_mm's) is "
            f"{extra / f['recorded_ms']:.1%} of it.")


def tax(R: dict) -> str:
    """Section 10's paragraph: MoE's training step against dense's from the record, issue 26's 1.20x target, where
    the extra milliseconds go, Adam's step and peak memory."""
    (t,) = _need(R, "tax", "tax")
    r, v, one, adam = t["moe_over_dense"], t["verdict"], t["one"], t["adam_ms"]
    order = sorted(t["extra_ms"], key=lambda k: -t["extra_ms"][k])
    return (
        f"**The tax, from the record** (preset {t['preset']}, load {t['load']:.1f} on {t['cores']} cores when it was "
        f"taken; {t['clock']}). MoE's training step costs **{r['median']:.2f}×** dense's (paired median over "
        f"{t['rounds']} rounds, IQR {r['q1']:.2f}–{r['q3']:.2f}); issue 26's target of 1.20× is {v['verdict']} "
        f"({v['why']}; this one recording's dense/MoE speed, mean {one['mean']:.3f}, 95% CI [{one['ci'][0]:.3f}, "
        f"{one['ci'][1]:.3f}], against 1/1.20 = {1 / 1.2:.3f} by the {one['margin']:.0%} margin one run needs: "
        f"{one['call']}). Of the instrumented step's extra {t['step_ms']['MoE'] - t['step_ms']['dense']:.1f} ms, "
        + ", ".join(f"{k} {t['extra_ms'][k]:+.1f} ms" for k in order)
        + f". Adam's step alone (timed apart): torch's default loop (one update per parameter tensor, and MoE has one "
        f"set per expert) MoE {adam['MoE']['default']:.2f} ms vs dense {adam['dense']['default']:.2f} ms; fused, which "
        f"chapter 05's study now trains with (`lm_study.optimizer`: the same update up to float rounding, tested), "
        f"MoE {adam['MoE']['fused']:.2f} ms vs dense {adam['dense']['fused']:.2f} ms. Peak memory of a step: MoE "
        f"{t['peak']:.2f}× dense's.")


def cuts(R: dict) -> str:
    """The cuts tried on the tax (``benchmarks/step_cuts.py``): each cut / plain ratio, its largest difference, and
    whether labutils adopted it; an adopted cut's lead from one recording is provisional unless it clears the margin."""
    (c,) = _need(R, "cuts", "cuts")
    cfg = c["config"]
    rows = [f"| {n} | {r['cut_over_plain']['median']:.2f} ({r['cut_over_plain']['q1']:.2f}–"
            f"{r['cut_over_plain']['q3']:.2f}) | {r['max_abs_diff']:.0e} | {'yes' if r['adopted'] else 'no'} |"
            for n, r in c["cuts"].items()]
    wide = "; ".join(f"{n}: {'clears it' if call == 'ahead' else 'provisional'}" for n, call in c["wide"].items())
    return (f"**Cuts tried on the tax** (`benchmarks/step_cuts.py`: one MoE layer of chapter 05's full configuration, "
            f"{cfg['tokens']:,} tokens, d {cfg['d_model']}, {cfg['num_expert']} experts of {cfg['hidden']}, "
            f"top-{cfg['top_k']}; forward + backward, {cfg['rounds']} paired rounds, {cfg['clock']}). Cut / plain "
            "form: below 1, the cut is faster. Each cut computes what the plain form does (largest difference in "
            "outputs and gradients shown). An adopted cut's lead rests on one recording: provisional unless its "
            f"95% CI also clears the {c['margin']:.0%} margin ({wide or 'no cut adopted'}).\n\n"
            "| cut | cut / plain (IQR) | max diff | in labutils |\n|---|---|---|---|\n" + "\n".join(rows))


def summary(R: dict) -> str:
    """The chapter's summary: the live run's conditions and checks, the core live and recorded, references
    beaten, the live profile, the layer's target verdicts, and the all-to-all."""
    preset, cond, live, pts, runs, beaten, maybe, over, lv, comm = _need(
        R, "summary", "preset", "live_conditions", "live", "core_targets", "runs", "beaten", "maybe", "live_overhead",
        "layer_verdicts", "comm")
    compared = [r for r in live if r["design"] not in ("dense", "separate", "ds_cf1")]
    ds1 = [r["kept"] for r in live if r["design"] == "ds_cf1"]
    core = [r["ratio"] for r in live if r["design"] == "core"]
    tpe = [r["tokens_per_expert"] for r in live if r["design"] == "core"]
    t, lt, f2 = _tally(p["dense"]["verdict"] for p in pts), _tally(v["verdict"] for v in lv), comm["fits"][2]
    return "\n".join([
        f"- *Preset {preset}; live timings on one thread in CPU time; {cond}.*",
        f"- Every design equalled the naive loop (output, input and logit gradients) at every live timed size: "
        f"{len(compared)} design-size pairs, largest difference {max(r['max_abs_diff'] for r in compared):.1e}; "
        f"DeepSpeed at capacity factor 1.0 kept {min(ds1):.2f}-{max(ds1):.2f} of the choices live.",
        f"- Live, the core ran at {min(core):.2f}-{max(core):.2f} of the dense reference (paired medians) from "
        f"{min(tpe):g} to {max(tpe):g} tokens per expert; in the recordings, against 0.9 of dense at >= 128 tokens "
        f"per expert: met at {t['met']}, NOT met at {t['NOT met']}, provisional at {t['provisional']}, inconclusive "
        f"at {t['inconclusive']} of {len(pts)} points" + ("." if runs["ok"] else f" (the recordings: {runs['why']})."),
        f"- References beaten in both recordings: {len(beaten)} design-point pairs"
        + (f" (e.g. {beaten[0]['design']} beats {beaten[0]['ref']} at {beaten[0]['tpe']:g} tokens/expert)"
           if beaten else "") + f"; provisionally, {len(maybe)} more.",
        "- The live profile's overhead: " + "; ".join(f"{t_} tokens/expert: {call}" for t_, call in over.items()) + ".",
        f"- The chapter-01 layer's targets: met {lt['met']}, NOT met {lt['NOT met']}, provisional {lt['provisional']}, "
        f"inconclusive {lt['inconclusive']} (verdict lines above, by clock; every one restated and checked).",
        f"- A gloo all-to-all on 2 workers: {f2['latency_s'] * 1e3:.2f} ms + bytes / {f2['bandwidth_gb_s']:.2f} GB/s "
        f"(worst miss {f2['max_rel_error']:.0%}); more workers than cores measure time-sharing, not the network.",
    ])
