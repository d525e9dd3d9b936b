"""Chapter 05's sentences, written from what the chapter measured (``R``, one plain dict). (Chapter 05.)

Each function is one paragraph (or table) of the chapter and returns Markdown; the chapter shows it with
``labbook.reports.show``. What ``R`` holds, key by key, is filled in by the chapter's measuring cells:

* ``preset``, ``steps`` (the live run's); ``split``: ``val_files``, ``val_chars``, ``covered`` (share of
  validation characters inside a window also in training), ``coverage`` (``{file: (characters, share covered)}``);
  ``repeats``: ``{preset: lm_study.window_coverage(...)}``;
* ``models``: ``{model: (total params, active params, analytic FLOPs per step, counted FLOPs)}``;
  ``flops_ratio``: ``{preset: {model: its training FLOPs over dense's}}``, ``ffn_ratio`` (dense-wide's feed-forward
  over dense's, full preset);
* ``summary`` and ``control_summary``: :func:`labbook.lm_study.summarize` of the live run and its data-limited
  control;
* the recorded full run (section 7): ``full`` (the record), ``full_preset`` (today's full preset, a ``StudyConfig``),
  ``full_summary``, ``curves`` (:func:`labbook.lm_study.curves` of the record), ``control_full`` (the record's
  data-limited control summarized, or None), ``busiest`` (``{model: busiest/mean per layer}``) and ``seed0``.
"""
from __future__ import annotations

from statistics import fmean

from labbook.lm_study.config import MAIN, epochs
from labbook.lm_study.summary import target_verdict

__all__ = ["busiest_per_layer", "control_verdict", "dense_wide_cost", "live_run_note", "model_table",
           "near_duplicates", "reading_full", "record_provenance", "regime", "repeats", "summary"]


def near_duplicates(R: dict) -> str:
    """How much of the validation text also occurs in training, and which files are near-twins."""
    s = R["split"]
    cov = s["coverage"]
    twins = {f: v for f, v in cov.items() if v[1] >= 0.3}
    ranked = sorted(cov.items(), key=lambda kv: -kv[1][1])[:5]
    return (f"**Near-duplicates across the split (measured, {s['val_files']} validation files).** "
            f"{s['covered']:.1%} of the validation characters lie inside a 64-character window that also occurs in "
            f"training. Most of that is shared idiom spread thinly; {len(twins)} files have 30% or more of their text "
            f"covered, {sum(n for n, _ in twins.values()) / s['val_chars']:.1%} of the validation text: "
            + ", ".join(f"`{f}` ({v[1]:.0%} of {v[0]:,} characters)" for f, v in ranked)
            + ". No file is copied whole (the check above). The chapter keeps these near-twins in the validation set "
            "and says so: they make every model's validation loss a little lower, and they favour no model over "
            "another by construction, since all models see the same split.")


def repeats(R: dict) -> str:
    """Each preset's run: epochs, the share of training characters it sees, and how many of those it sees twice."""
    return "\n".join(f"- **{name}** preset: {row['epochs']:.3f} epoch, {row['seen_share']:.1%} of the training "
                     f"characters seen, {row['twice_share']:.1%} of those seen twice or more (Poisson: "
                     f"{row['poisson_twice_share']:.1%})" for name, row in R["repeats"].items())


def model_table(R: dict) -> str:
    """Every model's parameters and training FLOPs per step, analytic beside counted by ``FlopCounterMode``."""
    rows = [f"| {name} | {total:,} | {active:,} | {flops / 1e9:.4f} | {counted / 1e9:.4f} |"
            for name, (total, active, flops, counted) in R["models"].items()]
    return "\n".join(["| model | total params | active/token | GFLOP/step analytic | counted |",
                      "|---|---:|---:|---:|---:|", *rows])


def dense_wide_cost(R: dict) -> str:
    """What dense-wide costs per training step, against dense and MoE."""
    ratio, live = R["flops_ratio"], R["preset"]
    return (f"**What dense-wide costs.** Its feed-forward is {R['ffn_ratio']:.0f}× dense's, but attention, embeddings "
            f"and the output layer are shared, so a whole training step costs {ratio['full']['dense-wide']:.2f}× "
            f"dense's on the full preset ({ratio[live]['dense-wide']:.2f}× on {live}), and MoE's "
            f"{ratio['full']['MoE']:.3f}× (the router). These are the analytic counts that `FlopCounterMode` "
            "matched above.")


def live_run_note(R: dict) -> str:
    """What this page's live run can and cannot conclude, by the seed rule."""
    s = R["summary"]
    note = f"This live run is the **{s['preset']}** preset: {s['seeds']['MoE']} seeds per model and {R['steps']} steps"
    if min(s["seeds"].values()) < 3:
        return note + (", so by the book's rule every verdict above is *inconclusive* (fewer than 3 seeds per arm), "
                       "whatever the means say; the run demonstrates the method. Section 7 has the full preset's "
                       "record.")
    return note + "; the verdicts above are tests at 95%."


def record_provenance(R: dict) -> str:
    """Which numbers of section 7 come from which run: the record's machine, arms, seeds and clock."""
    full, today = R["full"], R["full_preset"]
    held = sorted({r["name"] for r in full["runs"]} - set(MAIN))
    missing = [a for a in today.ablations if a not in held]
    seeds = {a: sum(r["name"] == a for r in full["runs"]) for a in held}
    cpu = {}
    for r in full["runs"]:                                          # CPU seconds of each run, by arm
        cpu.setdefault(r["name"], []).append(r["train_seconds"][-1])
    spread, arm = max((max(v) / min(v) - 1, n) for n, v in cpu.items())   # the widest seed spread of one arm
    twin = fmean(cpu["no balance loss"]) / fmean(cpu["MoE"]) - 1 if "no balance loss" in cpu else 0
    m = full["machine"]
    text = (f"**Which numbers come from which run.** The record was made on {m.get('date', '?')[:10]} "
            f"({m.get('cpu', '?')}, {m.get('cores', '?')} cores, torch {m.get('torch', '?')}): {len(full['runs'])} "
            f"runs, {full['jobs']} side by side, **{full['wall_seconds'] / 60:.1f} minutes** wall-clock. Its main arms "
            "match today's full preset (checked above). Its ablations are "
            + ", ".join(f"{a} ({n} seed{'s' if n > 1 else ''})" for a, n in seeds.items()))
    if missing or any(n < 3 for n in seeds.values()):
        text += (f"; today's preset also runs {', '.join(missing)}, and every ablation on all {len(today.seeds)} "
                 "seeds, which this record does **not** hold yet: the ablation verdicts below are inconclusive by the "
                 "seed rule, not evidence")
    text += ". The data-limited control was not recorded on the full preset yet." if "data_limited" not in full else "."
    if full["runs"][0].get("clock") != "process_time":
        return text + (" Its time axis is wall-clock seconds of each run, so other work sharing the machine counts as "
                       "training time; re-record it (`python benchmarks/moe_vs_dense.py`) for CPU seconds.")
    text += (" Each run's time axis counts that process's own CPU seconds (`time.process_time`, evaluations left "
             "out). CPU seconds are not immune to the machine's other work (a shared core's caches, memory bandwidth "
             f"and clock): the seeds of one arm differ by up to {spread:.0%} ({arm})")
    if twin:
        text += f", and *no balance loss*, which does MoE's work, took {twin:+.0%} of MoE's CPU seconds"
    if max(spread, abs(twin)) > 0.05:
        return text + ", so the CPU-time panel carries that much noise beyond the seeds' own."
    return text + ": runs that do the same work took the same CPU seconds within 5%."


def reading_full(R: dict) -> str:
    """The recorded full run read panel by panel: per step, per FLOP, per CPU second."""
    fs, full, c = R["full_summary"], R["full"], R["curves"]
    dn, mo = c["dense"], c["MoE"]
    late = [i for i, s in enumerate(dn.steps) if s >= 0.6 * dn.steps[-1]]
    gaps = [dn.mean[i] - mo.mean[i] for i in late]
    sp, eq, fr = fs["speedup"], fs["equal_time"], fs["flops_ratio"]
    e_cmp, ts = eq["comparison"], eq["train_seconds"]
    few = min(len(dn.finals), len(mo.finals))
    step_cost = ts["MoE"] / mo.steps[-1] / (ts["dense"] / dn.steps[-1])
    tail = {"behind": "the per-step lead does not pay for it: equal FLOPs are not equal time on a CPU, where the MoE "
                      "step routes, sorts and runs 8 small matmuls instead of one (chapter 08 §10 times each phase).",
            "ahead": "the per-step lead is worth more than the step's extra cost (chapter 08 §10 times each phase)."}
    return (
        f"**Reading the full record** (preset {fs['preset']}). Per step (left panel, the Switch paper's view), MoE "
        f"ends {dn.final - mo.final:.3f} nats below dense: {fs['moe_vs_dense'].verdict}, p = "
        f"{fs['moe_vs_dense'].p:.3g} after Holm's correction over the {fs['family']} tests on the record. Neither has "
        f"converged: dense still falls {dn.mean[-2] - dn.mean[-1]:.3f} nats over its last "
        f"{dn.steps[-1] - dn.steps[-2]} steps, while the gap stays between {min(gaps):.3f} and {max(gaps):.3f} nats "
        f"from step {dn.steps[late[0]]:,} on, so the lead is not closing within this run. Against dense-wide, MoE is "
        f"{fs['moe_vs_wide'].verdict} (difference {fs['moe_vs_wide'].diff:+.3f}, p = {fs['moe_vs_wide'].p:.2f}): it "
        f"keeps most of dense-wide's gain at {fr['MoE'] / fr['dense-wide']:.0%} of its FLOPs per step (middle panel: "
        f"dense-wide costs {fr['dense-wide']:.2f}× dense per step). The speed-up target (≥ {fs['target_speedup']}) is "
        f"judged by the t-interval [{sp['t_ci'][0]:.2f}, {sp['t_ci'][1]:.2f}] of the mean over {sp['pairs']} seed "
        f"pairs, counted as {sp['t_n']} independent values because the pairs share seeds: "
        f"**{target_verdict(sp, fs['target_speedup'])}**. A percentile bootstrap says [{sp['ci'][0]:.2f}, "
        f"{sp['ci'][1]:.2f}], but with {few} seeds per arm it cannot reach beyond the observed pairs "
        f"({min(sp['values']):.2f}–{max(sp['values']):.2f}), so the book does not judge by it. In CPU time (right "
        f"panel; {eq['jobs']} runs side by side, {eq['threads']} thread each on a {full['machine'].get('cores', '?')}-"
        f"core machine; each run's clock counts "
        f"{'its own CPU seconds' if eq.get('clock') == 'process_time' else 'wall-clock seconds'}, evaluations "
        f"excluded), MoE is **{e_cmp.relation()}** at {eq['seconds']:.0f} s ({e_cmp.mean_a:.3f} vs "
        f"{e_cmp.mean_b:.3f} nats, p = {e_cmp.p:.3g}) and needs {1 / eq['time_ratio']['mean']:.2f}× dense's "
        f"training time to reach dense's final loss. Its {mo.steps[-1]:,} steps took {ts['MoE']:.0f} s against "
        f"dense's {dn.steps[-1]:,} in {ts['dense']:.0f} s (Adam "
        f"{'fused' if full['config'].get('fused_adam') else 'as a loop over tensors'}): a step costs "
        f"{step_cost:.2f}× dense's, so "
        + tail.get(e_cmp.verdict, f"the per-step lead and the step's extra cost cancel within what {few} seeds can "
                                  "tell apart (chapter 08 §10 times each phase)."))


def regime(R: dict) -> str:
    """Where the full run sits, parameters- or data-limited, and what the data-limited control was run on."""
    full, today, fs = R["full"], R["full_preset"], R["full_summary"]
    n_train, w = full["corpus"]["train_chars"], fs["wide_vs_dense"]
    return (
        f"This chapter's full run draws {today.steps * today.batch * today.block / 1e6:.1f}M characters "
        f"from {n_train / 1e6:.1f}M ({epochs(today, n_train):.2f} epoch; {R['repeats']['full']['twice_share']:.0%} of "
        f"the characters it sees are seen twice or more), and dense-wide is {w.relation()} (p = {w.p:.3g})"
        + (": the runs are limited by parameters, not data, which is where extra parameters (MoE's included) can "
           "show." if w.verdict == "ahead" else ": extra parameters are not shown to help, so the run may be limited "
           "by data or steps rather than parameters.")
        + f" **Hypothesis:** a run that sees a small corpus for many epochs is limited by data instead; there extra "
        f"parameters mostly memorise and the MoE gain shrinks toward a tie like NNfS-MoE's. The data-limited control "
        f"(same models on {today.control_chars:,} characters, {epochs(today, today.control_chars):.1f} "
        f"epochs) tests it; on this page it ran on the {R['preset']} preset only (section 5: MoE vs dense "
        f"{R['control_summary']['moe_vs_dense'].verdict}), "
        + ("and the full-preset record holds it." if "data_limited" in full else
           "and it has **not** been recorded on the full preset yet, so the hypothesis stands untested here."))


def control_verdict(R: dict) -> str:
    """What the full preset's data-limited control says about the hypothesis."""
    today, dl, fs = R["full_preset"], R["control_full"], R["full_summary"]
    w, m = dl["wide_vs_dense"], dl["moe_vs_dense"]
    still_capacity = w.verdict == "ahead"
    text = (f"**What the full-preset control says.** On {today.control_chars:,} characters "
            f"({epochs(today, today.control_chars):.1f} epochs) dense-wide is {w.relation()} (p = {w.p:.3g})"
            + (": extra parameters still help, so this control is **not** data-limited yet and cannot test the "
               "hypothesis; " if still_capacity else ": extra parameters no longer help, so the control is "
               "data-limited; ")
            + f"MoE vs dense there: {m.verdict} (gap {-m.diff:.3f} nats, p = {m.p:.3g}) against "
            f"{-fs['moe_vs_dense'].diff:.3f} nats on the whole corpus. ")
    if still_capacity:
        return text + ("The hypothesis stays untested: a smaller corpus or more epochs would be needed to reach the "
                       "regime where extra parameters stop helping.")
    if m.verdict != "ahead":
        return text + "The MoE gain shrinks toward a tie, as the hypothesis predicts."
    return text + "MoE keeps a gain even here: the hypothesis is not supported at this size."


def busiest_per_layer(R: dict) -> str:
    """The busiest expert over the balanced share per layer, with and without the balancing loss, and top-1."""
    b = R["busiest"]
    layers = " / ".join(f"layer {i}" for i in range(len(b["MoE"])))
    return (f"Busiest expert over the balanced share at the end of the recorded run (last 20% of training, seed "
            f"{R['seed0']}, {layers}): MoE with the balancing loss {' / '.join(f'{x:.2f}' for x in b['MoE'])}, "
            f"without it {' / '.join(f'{x:.2f}' for x in b['no balance loss'])}, NoisyGate top-1 "
            f"{' / '.join(f'{x:.3f}' for x in b['top-1'])} (its router is trained by the balancing loss alone, "
            f"section 8, so near-perfect balance is what it optimises). Single-seed ablations are drawn hollow: one "
            f"run has no interval and the seed rule makes its verdict inconclusive.")


def summary(R: dict) -> str:
    """The chapter's verdicts in two lines: this page's live run and the recorded full run."""
    s, fs, c = R["summary"], R["full_summary"], R["control_summary"]
    m, sp = fs["moe_vs_dense"], fs["speedup"]
    lines = [f"**This page's live run** ({s['preset']} preset): MoE vs dense {s['moe_vs_dense'].verdict}, dense-wide "
             f"vs dense {s['wide_vs_dense'].verdict}, data-limited MoE vs dense {c['moe_vs_dense'].verdict}.",
             f"**The recorded full run** (preset {fs['preset']}, main arms; verdicts Holm-corrected over the "
             f"{fs['family']} tests on the record): MoE vs dense **{m.verdict}** ({m.diff:+.3f} nats, 95% CI "
             f"[{m.ci[0]:+.3f}, {m.ci[1]:+.3f}]), dense-wide vs dense **{fs['wide_vs_dense'].verdict}**, MoE vs "
             f"dense-wide **{fs['moe_vs_wide'].verdict}**"
             + (f", E = k = 2 vs dense **{fs['gated_vs_dense'].verdict}**" if fs["gated_vs_dense"] is not None else "")
             + f"; steps speed-up {sp['mean']:.2f}× (t-interval [{sp['t_ci'][0]:.2f}, {sp['t_ci'][1]:.2f}], target "
             f"{fs['target_speedup']}: **{target_verdict(sp, fs['target_speedup'])}**); at equal CPU time MoE is "
             f"**{fs['equal_time']['comparison'].relation()}**."]
    if s["moe_vs_dense"].verdict != m.verdict:
        n = min(s["seeds"].values())
        lines.append(f"Where the presets disagree: the {s['preset']} preset "
                     + (f"cannot give a verdict ({n} seeds), the full one can." if n < 3 else
                        f"and the full one reach different verdicts on MoE vs dense ({n} seeds per arm here)."))
    return "\n".join(f"- {line}" for line in lines)
