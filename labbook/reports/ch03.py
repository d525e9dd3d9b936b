"""Chapter 03's sentences, written from what the chapter measured (``R``, one plain dict). (Chapter 03.)

Each function is one paragraph (or table) of the chapter and returns Markdown; the chapter shows it with
``labbook.reports.show``. What ``R`` holds, key by key, is filled in by the chapter's measuring cells:

* ``preset``; ``counts``: ``{"standard": {category: n}, "hypothesis": {category: n}}`` (the meta-device counts of
  the book's model with standard attention and with the 5 d^2 attention hypothesis); ``adam_gb``;
* ``train``: the random-data run (``steps``, ``first``, ``last10``, ``val_start``, ``val_end``), ``floor`` (the
  loss of predicting 0 on the held-out pairs), ``aux_coef``;
* ``balance``: section 5 (``E``, ``d_model``, ``steps``, ``seeds``, ``record``, ``roles`` (``free``, ``random``,
  ``loss``, ``cut``, ``both``: the run names), ``runs``: ``{run: {"busiest": [...], "quietest": [...],
  "kept_busiest": [...]}}`` per seed), ``init`` (step 1 of the free run, and random pairs), ``kept_share`` and
  ``busiest_kept`` (the run without a loss or a cut, per seed);
* ``cmp``: ``{preset: (busiest comparison, quietest comparison)}`` (``stats.paired``, the cut alone vs the loss
  alone), ``full``: the full preset's record of section 5 or None; ``full_scale``: ``benchmarks/full_scale.py``'s
  record (the appendix).
"""
from __future__ import annotations

from statistics import fmean

__all__ = ["balance_findings", "balance_headline", "balance_table", "count_table", "full_scale", "kept_vs_demand",
           "summary"]

BOOK = {"MoE layer (experts + router)": "~268M", "attention": "~5.24M", "norms": "~0.2M", "total": "~273M"}
WHO = {"ahead": "the cut spreads the demand more than the loss",
       "behind": "the loss spreads the demand more than the cut",
       "inconclusive": "neither spreads the demand measurably more"}
QWHO = {"ahead": "the cut keeps the quietest expert busier than the loss does",
        "behind": "the loss keeps the quietest expert busier than the cut does",
        "inconclusive": "neither keeps the quietest expert measurably busier"}


def _parts(counts: dict) -> dict:
    """The four rows the book gives figures for, from one ``count_params`` breakdown (a category it does not hold
    counts 0, as ``ParamCounts`` reads it)."""
    n = {k: counts.get(k, 0) for k in ("moe experts", "router/gate", "attention", "norms")}
    return {"MoE layer (experts + router)": n["moe experts"] + n["router/gate"], "attention": n["attention"],
            "norms": n["norms"], "total": sum(counts.values())}


def count_table(R: dict) -> str:
    """The book's rounded figures beside the two counts: standard multi-head attention and the 5 d^2 hypothesis."""
    std, hyp = _parts(R["counts"]["standard"]), _parts(R["counts"]["hypothesis"])
    rows = [f"| {part} | {BOOK[part]} | {std[part]:,} | {hyp[part]:,} |" for part in BOOK]
    return "\n".join(["| part | book | standard MHA | hypothesis 5 d² |", "|---|---:|---:|---:|", *rows])


def _spread(values: list, digits: int = 2) -> str:
    return f"{fmean(values):.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def balance_table(R: dict) -> str:
    """Section 5's five runs: demand busiest/mean and quietest/mean, kept busiest/mean, mean [lowest, highest]."""
    b = R["balance"]
    head = (f"**{len(b['runs'])} runs × {len(b['seeds'])} seeds × {b['steps']} steps** (E = {b['E']}, d = "
            f"{b['d_model']}; demand and kept load summed over the last 20% of the steps; mean over seeds "
            "[lowest, highest])\n\n| run | demand busiest/mean | demand quietest/mean | kept busiest/mean |\n"
            "|---|---:|---:|---:|")
    rows = [f"| {name} | {_spread(v['busiest'])} | {_spread(v['quietest'])} | {_spread(v['kept_busiest'])} |"
            for name, v in b["runs"].items()]
    return "\n".join([head, *rows])


def kept_vs_demand(R: dict) -> str:
    """Why routing starts out random, and why the kept load can be less balanced than the demand."""
    b = R["balance"]
    roles, init, runs = b["roles"], b["init"], b["runs"]
    free, rnd = runs[roles["free"]], runs[roles["random"]]
    share, whole = b["kept_share"], min(b["busiest_kept"])
    start, rand_b, end = fmean(init["busiest"]), init["random_busiest"], fmean(free["busiest"])
    near = "nearer to a random draw than to" if abs(start - rand_b) < abs(start - end) else "already close to"
    return (
        f"**Measured.** At step 1 (seeds {', '.join(map(str, b['seeds']))}) the router's demand has busiest/mean "
        f"{_spread(init['busiest'])} and quietest/mean {_spread(init['quietest'])}; top-2 pairs drawn uniformly at "
        f"random give {rand_b:.2f} and {init['random_quietest']:.2f}: the untrained router is {near} the collapse "
        f"that follows"
        + (", a little more uneven than chance because its random weights favour some experts" if start > rand_b
           else "") + f". In the last 20% of the steps *{roles['free']}* has busiest/mean {end:.2f} and quietest/mean "
        f"{fmean(free['quietest']):.2f}.\n\n"
        f"In *{roles['random']}* the demand's busiest/mean is {fmean(rnd['busiest']):.2f}, yet the kept load's is "
        f"{fmean(rnd['kept_busiest']):.2f}. Random routing kept {_spread(share)} of the router's choices, while "
        "the busiest expert kept " + ("all of its own" if whole == 1 else f"at least {whole:.0%} of its own")
        + ". The ratio divides by the mean expert, and the mean shrank to the kept share: "
        + "; ".join(f"seed {s}: {d:.2f} × {k:.2f} / {sh:.3f} = {kb:.2f}" for s, d, k, sh, kb in
                    zip(b["seeds"], rnd["busiest"], b["busiest_kept"], share, rnd["kept_busiest"]))
        + " (demand busiest/mean × the busiest expert's kept share / the kept share of all choices = the kept "
        "busiest/mean measured)."
    )


def balance_headline(R: dict) -> str:
    """The title of section 5's bar chart: the busiest/mean verdict of this preset."""
    b, (b_cmp, _) = R["balance"], R["cmp"][R["preset"]]
    return (f"preset {R['preset']} (E = {b['E']}, mean and range over {len(b['seeds'])} seeds, last 20% of the "
            f"steps): {WHO[b_cmp.verdict]} ({b_cmp.mean_a:.2f} vs {b_cmp.mean_b:.2f} busiest/mean)")


def _findings(runs: dict, roles: dict, cmps: tuple, preset: str, n_exp: int) -> list:
    """One preset's result as sentences: the free router, the two verdicts, both together, dead experts."""
    b_cmp, q_cmp = cmps
    free, both = runs[roles["free"]], runs[roles["both"]]
    out = [f"With neither a balancing loss nor a cut, the router's demand has busiest/mean "
           f"{fmean(free['busiest']):.2f} (k experts taking every choice would give E/k = {n_exp / 2:.0f}) and "
           f"quietest/mean {fmean(free['quietest']):.2f}.",
           f"Busiest/mean: {WHO[b_cmp.verdict]} ({b_cmp.sentence(digits=2, preset=preset)}).",
           f"Quietest/mean: {QWHO[q_cmp.verdict]} ({q_cmp.sentence(digits=2, preset=preset)}).",
           f"Both together (GShard's default): busiest/mean {fmean(both['busiest']):.2f}, quietest/mean "
           f"{fmean(both['quietest']):.2f}."]
    dead = [n for n in runs if min(runs[n]["quietest"]) < 0.05 and n in (roles["cut"], roles["loss"], roles["both"])]
    if dead:
        out.append(f"An expert the router has all but stopped picking (quietest/mean below 0.05 in at least one "
                   f"seed) appears under: {', '.join(dead)}; busiest/mean alone does not show it.")
    return out


def balance_findings(R: dict) -> str:
    """Section 5's result for this preset, and where the full preset's record agrees or disagrees."""
    b, preset, full = R["balance"], R["preset"], R["full"]
    mine = R["cmp"][preset]
    md = [f"**What the runs show** (preset **{preset}**: E = {b['E']}, {b['steps']} steps, seeds {list(b['seeds'])}; "
          "demand = the router's top-2 before any drop, summed over the last 20% of the steps). "
          + " ".join(_findings(b["runs"], b["roles"], mine, preset, b["E"]))]
    if full is not None:
        theirs = R["cmp"]["full"]
        same = [c.verdict for c in theirs] == [c.verdict for c in mine]
        md.append(f"**The full preset** (E = {full['num_expert']}, d = {full['d_model']}, {full['steps']} steps; "
                  f"recorded in `benchmarks/results/{b['record']}` by this section under `LAB_PRESET=full`) "
                  f"{'agrees with' if same else '**disagrees** with'} the {preset} preset's verdicts (busiest, "
                  f"quietest: {theirs[0].verdict}, {theirs[1].verdict} there; {mine[0].verdict}, {mine[1].verdict} "
                  "here). " + " ".join(_findings(full["runs"], b["roles"], theirs, "full", full["num_expert"])[1:]))
        if not same:
            md.append("So which mechanism spreads the demand more depends on the setting (number of experts, width, "
                      "steps): neither preset's order is a general result.")
    elif preset == "full":
        md.append(f"This preset's runs were written to `benchmarks/results/{b['record']}`; the tiny preset reads "
                  "them and says where the two presets agree.")
    else:
        md.append("No full-preset record of this section was found, so this verdict is the tiny preset's only, and "
                  "the full preset may flip it: a reader's run at E = 32 (seed 0) found the loss alone ahead of the "
                  "cut alone on busiest/mean, and the cut alone leaving an expert at about 1% of the mean demand. "
                  "Running this chapter with `LAB_PRESET=full` writes the record that settles it.")
    return "\n\n".join(md)


def summary(R: dict) -> str:
    """The chapter's summary list, one line per section."""
    std, hyp = R["counts"]["standard"], R["counts"]["hypothesis"]
    parts, tr, b = _parts(std), R["train"], R["balance"]
    b_cmp, q_cmp = R["cmp"][R["preset"]]
    lines = [
        f"The book's layer is one pre-norm block around `FMoETransformerMLP(32, 1024, 4096)`: "
        f"{parts['MoE layer (experts + router)'] / 1e6:.2f}M parameters in the MoE layer "
        f"({std['moe experts'] / 1e6:.2f}M experts + {std['router/gate'] / 1e3:.1f}K router), {std['norms']:,} in "
        f"the norms and, with standard multi-head attention, {std['attention']:,} in attention: "
        f"{parts['total'] / 1e6:.1f}M in all. The book's 5.24M attention fits five bias-free 1024² matrices "
        f"({hyp['attention']:,}), a hypothesis; its \"0.2M of norms\" matches no count.",
        f"Counting on the meta device costs no memory; training it costs {R['adam_gb']:.2f} GB of fp32 state "
        f"(parameters, gradients, two Adam moments) before activations.",
        f"On random targets (preset {R['preset']}, {tr['steps']} steps) the train loss went {tr['first']:.3f} → "
        f"{tr['last10']:.3f} (book: 2.04 → 1.11) and the held-out loss {tr['val_start']:.3f} → {tr['val_end']:.3f}, "
        f"against a floor of {R['floor']:.2f} for predicting 0: "
        + ("the block learned to output the targets' mean. A smoke test of the plumbing, not evidence of learning."
           if R["preset"] == "tiny" else "the full preset's few steps only start the fall; the tiny preset runs it "
           "to the floor."),
        f"The aux loss enters as `loss = task + {R['aux_coef']} · Σ gate losses`, and it trains the router: one step "
        f"moves the router's gradient by exactly {R['aux_coef']} × the gradient of E · Σ c_e m_e (checked in section "
        f"5). Section 5 (preset {R['preset']}, E = {b['E']}, {len(b['seeds'])} seeds, paired t-test): on the busiest "
        f"expert {WHO[b_cmp.verdict]} ({b_cmp.mean_a:.2f} vs {b_cmp.mean_b:.2f}, p = {b_cmp.p:.3g}); on the "
        f"quietest {QWHO[q_cmp.verdict]} ({q_cmp.mean_a:.2f} vs {q_cmp.mean_b:.2f}, p = {q_cmp.p:.3g}).",
        "Checkpoints are atomic, weights-only, and resume bit-exactly (checked above).",
    ]
    if R["full"] is not None:
        fb, fq = R["cmp"]["full"]
        same = (fb.verdict, fq.verdict) == (b_cmp.verdict, q_cmp.verdict)
        lines[3] += (f" The recorded full preset (E = {R['full']['num_expert']}) {'agrees' if same else 'DISAGREES'}:"
                     f" busiest {fb.mean_a:.2f} vs {fb.mean_b:.2f} ({fb.verdict} for the cut), quietest "
                     f"{fq.mean_a:.2f} vs {fq.mean_b:.2f} ({fq.verdict} for the cut).")
    elif R["preset"] == "tiny":
        lines[3] += " No full-preset record of section 5 was found; at E = 32 the order may flip (section 5)."
    return "\n".join(f"- {line}" for line in lines)


def full_scale(R: dict) -> str:
    """The appendix: what one full-scale step cost on a CPU, from ``benchmarks/full_scale.py``'s record."""
    fs = R["full_scale"]
    ph, th = fs["median_phase_seconds"], fs["theory_bytes"]
    extra = fs["parameters"] - sum(R["counts"]["standard"].values())
    biggest = max(ph, key=ph.get)
    return (f"{fs['parameters'] / 1e6:.1f}M parameters ({extra / 1e6:+.1f}M against the model trained here), "
            f"{fs['tokens_per_step']} tokens per step, {fs['threads']} threads: **{fs['median_step_seconds']:.1f} s "
            f"per step** (median of {len(fs['steps'])}: forward {ph['forward']:.1f} s, backward {ph['backward']:.1f} "
            f"s, Adam {ph['adam']:.1f} s) and a **peak RSS of {fs['peak_rss_bytes'] / 1e9:.2f} GB** against "
            f"**{th['total'] / 1e9:.2f} GB** of parameters + gradients + Adam moments in theory "
            f"({fs['peak_over_theory']:.2f}×); PyTorch itself holds {fs['baseline_rss_bytes'] / 1e9:.2f} GB. "
            f"The largest phase is **{biggest}**"
            + (": the optimiser, not the MoE arithmetic, dominates the step; it rewrites all "
               f"{fs['sizes']['num_expert']} experts although each token used only 2 of them."
               if biggest == "adam" else "."))
