"""Chapter 09's sentences and tables, written from its results dict ``R`` (see ``labbook.reports``).

``R`` holds what the chapter measured: ``preset``, ``presets`` (each preset's knobs), ``bias`` (the aux-free bias
alone: busiest/mean over the last 50 steps, the largest update and its bound in units of γ), ``zloss`` (logit RMS
before and after), ``leaks`` (earlier positions changed, per layer and seed), ``grouped_diff``, ``pools`` (the three
layouts of section 7), ``train`` (the tiny preset's rows), ``record`` (the recorded full run's file, or None),
``full`` (per variant: the last evaluations, full forward and prefixes, whether it is evaluated causally, and its
Holm-corrected verdict against dense; the balance; the count without correction) or, for an older record, ``old``.
"""
from __future__ import annotations

import math
import statistics

KNOBS = {"d_model": "model width (chapter 05's `CharLM`)", "n_heads": "attention heads",
         "n_layers": "Transformer blocks", "block": "characters of context", "batch": "sequences per step",
         "steps": "optimiser steps per run", "eval_every": "validation interval (steps); the last one is the result",
         "seeds": "every variant is trained once per seed", "lr": "Adam learning rate",
         "bias_rate": "the aux-free bias step γ (DeepSeek-V3: 1e-3)"}
AUX_FREE = "top-2/8, sigmoid, aux-free"


def quoted(names) -> str:
    """Variant names (they contain commas) as a readable list: `a`, `b`."""
    return ", ".join(f"`{n}`" for n in names)


def _mean_sd(xs: list) -> str:
    return f"{statistics.mean(xs):.4f} ± {statistics.stdev(xs) if len(xs) > 1 else 0.0:.4f}"


def knob_table(R: dict) -> str:
    """The knobs of both presets, each with what it does."""
    tiny, full = R["presets"]["tiny"], R["presets"]["full"]
    return "\n".join(["| knob | tiny | full | meaning |", "|---|---|---|---|",
                      *(f"| `{k}` | {tiny[k]} | {full[k]} | {doc} |" for k, doc in KNOBS.items())])


def pool_table(R: dict) -> str:
    """Section 7's three layouts of the same expert budget, counted from the layers."""
    rows = [f"| {n} | {p['routed']} | {p['shared']} | {p['width']} | {p['k']} | {p['combinations']:,} | {p['total']:,} "
            f"| {p['active']:,} |" for n, p in R["pools"].items()]
    return "\n".join(["| layout | routed | shared | width | k | combinations C(E, k) | total expert params | active |",
                      "|---|---:|---:|---:|---:|---:|---:|---:|", *rows])


def variant_table(R: dict) -> str:
    """Section 9's live runs: the last evaluation (full forward and prefixes) and the balance of every variant."""
    t = R["train"]
    head = (f"Preset {R['preset']}: the last evaluation (step {t['last_step']}), mean ± std over seeds {t['seeds']}; "
            "MaxVio = busiest/mean - 1 of the load, per batch (mean over the last tenth of the steps) and summed over "
            f"the last window of {t['window']} steps.")
    rows = []
    for name, row in t["rows"].items():
        extra = (f"{row['batch_max_over_mean'] - 1:.3f} | {row['max_over_mean'] - 1:.3f} | {row['dropped']:.3f} | "
                 f"{row['lse2']:.2f}" if "entropy" in row else "- | - | - | -")
        rows.append(f"| {name} | {row['val']:.4f} ± {row['val_std']:.4f} | {row['val_prefix']:.4f} ± "
                    f"{row['val_prefix_std']:.4f} | {extra} |")
    return "\n".join([head, "", "| variant | val (full fwd) | val (prefixes) | MaxVio batch | MaxVio window | dropped "
                      "| lse² |", "|---|---:|---:|---:|---:|---:|---:|", *rows])


def record_status(R: dict) -> str:
    """What the recorded full run holds, or that there is none (loud: section 9's recorded half needs it)."""
    rec = R["record"]
    if rec is None:
        return ("⚠ **NO RECORDED FULL RUN** at `benchmarks/results/modern_moe_full.json`: the rest of section 9 shows "
                "nothing from it. `python benchmarks/modern_moe.py` records one (about 20 minutes).")
    head = (f"`{rec['path']}`: {rec['variants']} variants x {rec['seeds']} seeds x {rec['steps']} steps, "
            f"{rec['jobs']} side by side, {rec['minutes']:.0f} minutes. ")
    if rec["lacks"] or rec["stale"]:
        return head + (f"This record predates the chapter's analysis: it lacks {rec['lacks'] or 'nothing'}; variants "
                       f"not in this code: {rec['stale'] or 'none'}. Re-record with `python benchmarks/modern_moe.py`; "
                       "what it does hold is read below.")
    return head + "The record holds every evaluation, the prefix evaluations and the per-batch balance of every seed."


def record_table(R: dict) -> str:
    """Every variant of the recorded run: the last evaluation, full forward and prefixes, whether it is evaluated
    causally, and its Holm-corrected verdict against dense."""
    f = R["full"]
    rows = []
    for n, v in f["variants"].items():
        vs = "" if "verdict" not in v else (f"{v['verdict']} (diff {v['diff']:+.4f}, p = {v['p']:.3g}, Holm "
                                            f"{v['holm']:.3g}{', on prefixes' if v['basis'] != 'final' else ''})")
        rows.append(f"| {n} | {_mean_sd(v['final'])} | {_mean_sd(v['prefix'])} | {v['gap']:.1e} | "
                    f"{'yes' if v['causal'] else 'NO'} | {vs} |")
    return "\n".join([f"Last evaluation at step {f['last_step']}; mean ± std over seeds {f['seeds']}.", "",
                      "| variant | val (full fwd) | val (prefixes) | max gap | causal | vs dense |",
                      "|---|---:|---:|---:|---|---|", *rows])


def balance_table(R: dict) -> str:
    """The recorded run's load balance per variant, per batch and per window, and the aux-free bias's two phases."""
    f, tail = R["full"], R["full"]["aux_tail"]
    rows = [f"| {n} | {b['batch']:.3f} | {b['window']:.3f} | {b['quietest']:.3f} |" for n, b in f["balance"].items()]
    return "\n".join(["| variant | MaxVio per batch | MaxVio per window | quietest/mean per batch |",
                      "|---|---:|---:|---:|", *rows, "",
                      f"Per batch: mean over the last {tail['window_steps']} steps of each batch's own busiest/mean - "
                      f"1; per window: the load of those {tail['window_steps']} steps summed first; means over seeds. "
                      f"Aux-free, seed 0, last {tail['steps']} steps: busiest/mean on even steps {tail['even']:.3f}, "
                      f"odd steps {tail['odd']:.3f}."])


def _verdicts(f: dict) -> tuple:
    """(leaky, causal, ahead, behind): the MoE variants of a recorded run not evaluated causally, those that are,
    and of those the ones ahead of and behind dense (Holm-corrected)."""
    vs = {n: v for n, v in f["variants"].items() if "verdict" in v}   # every variant but dense
    causal = [n for n, v in vs.items() if v["causal"]]
    return ([n for n in vs if n not in causal], causal, [n for n in causal if vs[n]["verdict"] == "ahead"],
            [n for n in causal if vs[n]["verdict"] == "behind"])


def full_run(R: dict) -> str:
    """The recorded run's verdict: which causally evaluated variants are ahead of dense, what the leaky ones score
    generating, what an uncorrected count would have said, and the aux-free bias's balance by both measures."""
    f = R["full"]
    n_seeds, comparisons, leaky, causal, ahead, behind = len(f["seeds"]), len(f["variants"]) - 1, *_verdicts(f)
    dense = statistics.mean(f["variants"]["dense"]["final"])
    md = [f"**The recorded full run** (preset full: {f['steps']} steps, {n_seeds} seeds, last evaluation). Of the "
          f"{len(causal)} MoE variants evaluated causally, **{len(ahead)} are ahead of dense** by Welch's t-test, "
          f"Holm-corrected over the {comparisons} comparisons with dense (α = 0.05)"
          + _counted(ahead, behind)
          + f"; the other {len(causal) - len(ahead) - len(behind)} are inconclusive against dense with {n_seeds} "
          f"seeds. Dense: {dense:.4f} nats/char."]
    for n in leaky:
        v = f["variants"][n]
        md.append(f"**{n}** is not evaluated causally: its prefix evaluation differs from its full-forward evaluation "
                  f"by up to {v['gap']:.3f} nats (full forward {statistics.mean(v['final']):.4f}, prefixes "
                  f"{statistics.mean(v['prefix']):.4f}). On prefixes, as it would generate, it is {v['verdict']} "
                  f"against dense ({v['sentence']}).")
    md.append(f"Counting every variant on its full-forward evaluation without a correction, as this chapter once did, "
              f"gives {len(f['uncorrected_ahead'])} of {comparisons} ahead of dense; the leaky variants do not belong "
              "in that count, and nine uncorrected tests overstate it.")
    aux = f["balance"][AUX_FREE]
    md.append(f"**Balance.** The aux-free bias's MaxVio is {aux['window']:.3f} summed over "
              f"{f['aux_tail']['window_steps']}-step windows but {aux['batch']:.3f} per batch (the paper's measure): "
              + ("the windowed figure averages overloads away." if aux["window"] < aux["batch"] else
                 "here the windowed figure hides nothing."))
    md.append("Between MoE variants the ranking above gives each one's Welch test against the best; with "
              f"{n_seeds} seeds most gaps among them are not distinguishable, so their order is a hypothesis.")
    return "\n\n".join(md)


def _counted(ahead: list, behind: list) -> str:
    """"(`a`, `b`); 1 behind (`c`)" after a count of variants ahead."""
    return (f" ({quoted(ahead)})" if ahead else "") + (f"; {len(behind)} behind ({quoted(behind)})" if behind else "")


def old_record(R: dict) -> str:
    """An older record (before the prefix evaluation and per-batch balance), read only as far as it goes."""
    o = R["old"]
    rows = []
    for n, v in o["variants"].items():
        vs = "" if v["verdict"] is None else f"{v['verdict']}, Holm p = {v['holm']:.3g}"
        mv = "-" if math.isnan(v["maxvio"]) else f"{v['maxvio']:.3f}"
        rows.append(f"| {n} | {v['final']:.4f} ± {v['sd']:.4f} | {vs} | {mv} |"
                    + (" leaks: not counted |" if n in o["leaky"] else " |"))
    counted = {n: v["verdict"] for n, v in o["variants"].items() if v["verdict"] and n not in o["leaky"]}
    ahead, behind = ([n for n, v in counted.items() if v == verdict] for verdict in ("ahead", "behind"))
    return "\n\n".join([
        "\n".join(["| variant | val (mean of steps 750, 1000) | vs dense (Welch) | MaxVio per 100-step window | |",
                   "|---|---:|---|---:|---|", *rows]),
        f"**The recorded full run, read as far as it goes** (preset full, {o['steps']} steps, {o['seeds']} seeds, "
        f"recorded before this chapter's analysis). Of the {len(counted)} MoE variants whose routing is causal, "
        f"**{len(ahead)} are ahead of dense** by Welch's t-test, Holm-corrected over the {o['comparisons']} "
        "comparisons (α = 0.05)" + _counted(ahead, behind)
        + f"; the rest are inconclusive. {quoted(o['leaky'])} are not counted: their routing ranks tokens over the "
        "whole batch, and section 5 showed both change earlier outputs when a later token changes.",
        "**What this record lacks**, so what these numbers are not: its per-seed value is the *mean of the step-750 "
        "and step-1000 evaluations*, not the last evaluation; it holds no generation-style (prefix) evaluation, so the "
        "leaky variants cannot be scored as they would generate; its balance is summed over 100-step windows only, "
        "which hides per-batch imbalance (section 3's oscillation is invisible to it); and its shared variant is 1 "
        "shared + top-1 of **8** routed, one expert more in total than the others (section 7 carves the shared expert "
        "out of the pool instead). `python benchmarks/modern_moe.py` records all of it."])


def summary(R: dict) -> str:
    """The chapter's summary list, generated from this run's numbers."""
    b, z, rows, pools = R["bias"], R["zloss"], R["train"]["rows"], R["pools"]
    fine, top2 = pools["fine-grained top-8/32"], pools["top-2/8, batch loss"]
    moved = {name: sum(n > 0 for n in per_seed) for name, per_seed in R["leaks"].items()}  # seeds with a leak
    balanced = b["worst"] < 2   # busiest/mean < E/2 = 2: the busiest expert took under half the tokens (E = 4)
    lines = [
        f"The aux-free bias alone took a router that sent all {b['tokens']} tokens to one expert to busiest/mean "
        f"{b['worst']:.2f} at worst over the last 50 steps (even steps {b['even']:.2f}, odd {b['odd']:.2f}), without a "
        f"gradient{'' if balanced else ', still far from balanced'}; one update moved a bias up to {b['move']:.2f} γ "
        f"(bound 2(1 - 1/E) γ = {b['bound']:.2f} γ).",
        f"The z-loss alone took the router's logit RMS from {z['before']:.1f} to {z['after']:.1f} in {z['steps']} steps"
        + ("; it lowers logit magnitude and does not balance." if z["after"] < z["before"] else
           "; it did not lower the logits here."),
        f"Changing only the last character moved earlier outputs in {moved['expert choice, c = 2']} of 5 seeds with "
        f"expert choice, {moved['token choice, dropping cf = 1']} of 5 with a cf = 1 capacity cut, and "
        f"{moved['token choice, dropless']} of 5 with dropless token choice.",
        f"One grouped GEMM matched the per-expert loop to {R['grouped_diff']:.1e}, gradients included.",
        f"Fine-grained top-8 of 32 offers {fine['combinations']:,} expert combinations against top-2 of 8's "
        f"{top2['combinations']}, at the same active and total expert parameters "
        + ("(checked)." if (fine["total"], fine["active"]) == (top2["total"], top2["active"]) else
           "(NOT equal in this run)."),
        f"Tiny preset ({R['train']['steps']} steps, {len(R['train']['seeds'])} seeds): the ten validation losses span "
        f"{min(r['val'] for r in rows.values()):.3f} to {max(r['val'] for r in rows.values()):.3f} nats with seed std "
        f"up to {max(r['val_std'] for r in rows.values()):.3f}: the mechanics are shown, not a ranking.",
    ]
    if R.get("full"):
        f = R["full"]
        leaky, causal, ahead, _ = _verdicts(f)
        lines.append(f"Recorded full run: {len(ahead)} of {len(causal)} causally evaluated MoE variants ahead of dense "
                     f"(Welch, Holm-corrected over {len(f['variants']) - 1} comparisons, {len(f['seeds'])} seeds, last "
                     "evaluation); " + (quoted(leaky) + " excluded: evaluated with the future." if leaky else
                                        "none excluded."))
    elif R.get("old"):
        o = R["old"]
        ahead = [n for n, v in o["variants"].items() if v["verdict"] == "ahead" and n not in o["leaky"]]
        lines.append(f"Recorded full run (an older record; see what it lacks above): {len(ahead)} of "
                     f"{o['comparisons'] - len(o['leaky'])} MoE variants with causal routing ahead of dense (Welch, "
                     f"Holm-corrected, {o['seeds']} seeds, mean of the last two evaluations); {quoted(o['leaky'])} not "
                     "counted.")
    return "\n".join(f"- {line}" for line in lines)
