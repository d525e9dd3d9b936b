"""Chapter 01's sentences, written from its results dict ``R`` (see :mod:`labbook.reports`).

Keys the chapter fills: ``preset``; ``buffers`` (``named``/``fused``: ``(T*k, d)`` buffers made in forward, in
backward, kept from one to the other); ``switch`` (``stored``, ``after_drop``, ``definition``, ``kept``, ``tokens``);
``parity_gates``; and, once section 8 has trained the reader's layer, ``build`` (``seeds``, ``steps``, ``experts``),
``arms`` (per arm, per seed: ``loss``, ``busiest``, ``dead``) and ``first_step`` (the busiest share at step 1).
"""
from __future__ import annotations

from labutils.stats import paired

__all__ = ["buffers", "switch_losses", "arms_table", "training", "summary"]

ONE_BUFFER_MIB = 512 * 2 * 128 * 4 / 2**20      # one (T*k, d) fp32 buffer at T = 512, d = 128, k = 2


def _made(counts: list) -> int:
    """Buffers made in one step: forward + backward."""
    return counts[0] + counts[1]


def buffers(R: dict) -> str:
    """What fusing gather and combine saved, in ``(T*k, d)`` buffers made per step and kept for backward."""
    named, fused = R["buffers"]["named"], R["buffers"]["fused"]
    saved = _made(named) - _made(fused)
    fewer = f"{saved} fewer" if saved > 0 else ("as many" if saved == 0 else f"{-saved} more")
    return (f"Measured here: `gather_combine` makes **{_made(fused)}** `(T*k, d)` buffers per step against "
            f"**{_made(named)}** for the two named steps ({fewer}), and keeps **{fused[2]}** from forward to backward "
            f"against **{named[2]}**. At T = 512, d = 128, k = 2 one such buffer is {ONE_BUFFER_MIB:.2f} MiB.")


def switch_losses(R: dict) -> str:
    """fastmoe's after-drop Switch loss against section 0's definition on the same batch."""
    s = R["switch"]
    if s["kept"] == s["tokens"]:
        return (f"Nothing was dropped on this batch (all {s['tokens']} tokens kept), so fastmoe's number "
                f"({s['after_drop']:.3f}) and §0's ({s['definition']:.3f}) are the same formula.")
    relation = "exceeds" if s["after_drop"] > s["definition"] else "differs from"
    return (f"Dividing by the {s['kept']} kept tokens instead of all {s['tokens']} inflates both factors, so "
            f"fastmoe's number ({s['after_drop']:.3f}) {relation} §0's ({s['definition']:.3f}) on this batch; with "
            "nothing dropped the two are equal.")


def arms_table(R: dict) -> str:
    """Section 8's runs per arm and seed: the training loss, the busiest expert's share, the experts under 1%."""
    seeds, experts = R["build"]["seeds"], R["build"]["experts"]
    rows = ["| arm | loss (last 20 steps) | busiest expert's share | experts < 1% |", "|---|---|---|---|"]
    for arm, a in R["arms"].items():
        rows.append(f"| {arm} | {', '.join(f'{v:.3f}' for v in a['loss'])} | "
                    f"{', '.join(f'{v:.3f}' for v in a['busiest'])} | {', '.join(str(v) for v in a['dead'])} |")
    first = ", ".join(f"{v:.3f}" for v in R["first_step"])
    return "\n".join(rows) + (f"\n\nPer seed {list(seeds)}, each over the last 20 steps. Uniform share: 1/E = "
                              f"{1 / experts:.3f}; busiest share at step 1: {first}.")


def _collapse(R: dict):
    arms = R["arms"]
    return paired(arms["balancing loss"]["busiest"], arms["no balancing loss"]["busiest"],
                  names=("with the balancing loss", "without it"), lower_is_better=True)


def _learn(R: dict):
    arms = R["arms"]
    return paired(arms["balancing loss"]["loss"], arms["zero-output control"]["loss"],
                  names=("your layer", "the zero-output control"), lower_is_better=True)


def training(R: dict) -> str:
    """Section 8's verdicts (paired t-tests over the seeds): balance with and without the loss, and learning."""
    preset, n = R["preset"], len(R["build"]["seeds"])
    return (f"**Busiest expert's share of top-1 choices** (mean of the last 20 steps, {n} seeds, preset `{preset}`): "
            f"{_collapse(R).sentence(unit='of tokens', preset=preset)}\n\n"
            f"**Training loss** (nats/char, last 20 steps): {_learn(R).sentence(unit='nats', preset=preset)}")


def summary(R: dict) -> str:
    """The chapter's summary list; section 8's line once the reader's layer has trained (``arms`` in ``R``)."""
    s, named, fused = R["switch"], R["buffers"]["named"], R["buffers"]["fused"]
    bullets = [
        "An MoE layer is six steps: gate → `count_by_gate` → scatter → experts → gather → combine. `pos` sorted by "
        "expert is all the bookkeeping there is; dropped choices are absent from it and contribute exactly zero.",
        f"The four gates differ in routing and balancing loss; on this batch fastmoe's after-drop Switch loss was "
        f"{s['after_drop']:.3f} against §0's definition {s['definition']:.3f} ({s['kept']} of {s['tokens']} tokens "
        "kept).",
        f"Outputs and every gradient match a per-token loop within 1e-5 in fp32 for all {R['parity_gates']} gates.",
        f"Fusing gather and combine made {_made(fused)} `(T*k, d)` buffers per step instead of {_made(named)} and "
        f"kept {fused[2]} for backward instead of {named[2]}; speed and memory at scale are chapter 08's.",
    ]
    if "arms" in R:
        b, collapse, learn = R["build"], _collapse(R), _learn(R)
        bullets.append(f"Your layer in a char LM ({len(b['seeds'])} seeds, {b['steps']} steps, E = {b['experts']}): "
                       f"busiest expert {collapse.mean_b:.3f} of top-1 choices without the balancing loss vs "
                       f"{collapse.mean_a:.3f} with it ({collapse.verdict}, p = {collapse.p:.3g}); loss "
                       f"{learn.mean_a:.3f} vs {learn.mean_b:.3f} nats for the zero-output control ({learn.verdict}).")
    else:
        bullets.append("§8's training result appears here once your `my_moe_forward` and `my_switch_loss` pass.")
    return ("\n".join(f"- {t}" for t in bullets) + f"\n\n(preset `{R['preset']}`; the committed outputs are the tiny "
            "preset's; the full preset has not been recorded for this chapter.)")
