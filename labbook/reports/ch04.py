"""Chapter 04's sentences and figures, written from its results dict ``R`` (notebooks/04_transformer_deepspeed.ipynb).

The chapter measures and checks in its cells; these functions only narrate what ``R`` holds: the epoch losses
against the book's (:func:`epochs`), the memorisation hypothesis and its three predictions (:func:`hypothesis`), the
summary (:func:`summary`), and the two figures drawn from the measurements (:func:`loss_figure`, :func:`load_figure`).
Tested in tests/test_reports_ch04.py. A key missing from ``R`` raises ``KeyError`` naming it.
"""
from __future__ import annotations

BOOK = "1.784 → 1.001"  # the book's epoch averages, epochs 1 and 5 (6.4.4)


def _moved(first: float, last: float) -> str:
    return "falls" if last < first else "does not fall"


def epochs(R: dict) -> str:
    """Section 3: the epoch average from first to last epoch against the book's, and the held-out loss."""
    avg, held, book = R["epoch_avg"], R["held"], R["book"]
    book_fall = 1 - book[max(book)] / book[min(book)]
    return (f"On the {R['preset']} preset the epoch average {_moved(avg[0], avg[-1])} from {avg[0]:.3f} to "
            f"{avg[-1]:.3f} ({R['fall']:.0%}) in {R['epochs']} epochs of {R['batches_per_epoch']} batches; the book "
            f"reports {BOOK} ({book_fall:.0%}). The held-out loss goes from {held[0]:.3f} to {held[-1]:.3f}.")


def _welch_line(w: dict) -> str:
    return (f"- after {w['epochs']} epochs: training samples {w['mean_a']:.3f} vs held-out {w['mean_b']:.3f} "
            f"(difference {w['diff']:.3f}, 95% CI [{w['ci'][0]:.3f}, {w['ci'][1]:.3f}], Welch t = {w['t']:.1f}, "
            f"p = {w['p']:.2g}, {w['n_a']} vs {w['n_b']} samples): {w['verdict']}")


def hypothesis(R: dict) -> str:
    """Section 3's test of the memorisation hypothesis: both Welch tests, the three predictions, the verdict."""
    short, longer = R["welch"][0]["epochs"], R["welch"][-1]["epochs"]
    names = (f"(1) after {short} epochs, training samples' loss below held-out",
             "(2) held-out loss at or above the predict-zero floor (less 0.02)",
             f"(3) after {longer} epochs, the training average below the floor")
    if len(R["predictions"]) != len(names):
        raise ValueError(f"R['predictions'] holds {len(R['predictions'])} verdicts, the hypothesis makes {len(names)}")
    avg, held = R["epoch_avg"], R["held"]
    memorised = held[-1] - avg[-1]
    if all(R["predictions"]):
        verdict = (f"All three predictions hold, so the hypothesis is **supported** on this preset: of the epoch "
                   f"average's fall {avg[0]:.3f} → {avg[-1]:.3f}, the part down to the held-out loss ({held[-1]:.3f}) "
                   f"carries over to unseen samples and the remaining {memorised:.3f} "
                   f"({memorised / (avg[0] - avg[-1]):.0%} of the fall) is the model fitting its {R['samples']} fixed "
                   f"samples. A fall to 1.0 on such data shows that DeepSpeed's MoE trains and can fit noise, not that "
                   f"it generalises.")
    else:
        verdict = ("Not every prediction holds, so the hypothesis is **not supported** on this preset; the fall cannot "
                   "be read as memorisation from this run.")
    return "\n\n".join([f"**The hypothesis, tested** ({R['preset']} preset):",
                        "\n".join(_welch_line(w) for w in R["welch"]),
                        "\n".join(f"- {name}: {'yes' if ok else 'NO'}" for name, ok in zip(names, R["predictions"])),
                        verdict])


def summary(R: dict) -> str:
    """The chapter's summary, one bullet per section."""
    avg, cf, S = R["epoch_avg"], R["capacity_factor"], R["S"]
    longer = R["welch"][-1]["epochs"]
    return "\n".join([
        f"- `DeepSpeedFFN` turns DeepSpeed's `(out, l_aux, exp_counts)` into a plain feed-forward; the block's output "
        f"was recomputed by hand as x + attention + the MoE output. The {R['preset']} preset's model has "
        f"{R['n_params'] / 1e6:.1f}M parameters, {R['expert_params'] / R['n_params']:.0%} of them in "
        f"{R['num_experts']} experts.",
        f"- `deepspeed.initialize` trained it on CPU with a torch Adam and the MoE parameter groups {R['groups']}.",
        f"- The `(32, 8, 512)` experiment: epoch average {avg[0]:.3f} → {avg[-1]:.3f} in {R['epochs']} epochs "
        f"(book: {BOOK}); held-out {R['held'][0]:.3f} → {R['held'][-1]:.3f}, and after {longer} epochs training "
        f"{R['more_avg'][-1]:.3f} vs held-out {R['more_held'][-1]:.3f} against a predict-zero floor of "
        f"{R['floor']:.3f}. The hypothesis that the fall is memorising a fixed random set is "
        f"{'supported' if all(R['predictions']) else 'not supported'} on this preset.",
        f"- DeepSpeed's top-2 gate at capacity factor {cf}: C = {R['C']} slots per expert, {R['dropped']} of {2 * S} "
        f"choices dropped, {R['one_left']} tokens lost one choice and put weight 1.0 on the survivor, "
        f"{R['lost_both'][cf]} lost both; at factor 0.5, {R['lost_both'][0.5]} of {S} lost both and got exactly 0 "
        f"from the layer (the residual connection carries them). Over the whole run the cut dropped "
        f"{R['over']['mean']:.1%} of each step's choices on average.",
        f"- First choices take slots before second choices: the gate's experts and slots are a literal loop's, choice "
        f"for choice, for all {2 * S} choices of a training batch.",
        f"- `l_aux` recomputed by hand from first choices only: {R['l_aux_mine']:.6f} vs DeepSpeed's {R['l_aux']:.6f}; "
        f"counting both choices would give {R['l_aux_both']:.4f}. It reaches the loss: with coefficient "
        f"{R['aux_coef']} the router's gradient moves by {R['grad_moved']:.3e}, {R['aux_coef']} × the formula's "
        f"gradient ({R['grad_want']:.3e}).",
    ])


# --- figures: drawn without pyplot, so a cell that ends with one shows it once ------------------------------------

def loss_figure(losses: list, R: dict, batches_per_epoch: int):
    """Section 3's figure: the loss of every step, each epoch's average at the middle of its steps, the held-out loss
    at each epoch's end, the book's epochs (``R["book"]``: epoch -> loss) and the predict-zero floor on unseen data."""
    from matplotlib.figure import Figure

    n = batches_per_epoch
    middle = lambda e: (e - 0.5) * n + 0.5                                  # epoch e (from 1), middle of its steps
    fig = Figure(figsize=(6.4, 3.6), dpi=100)
    ax = fig.subplots()
    ax.plot(range(1, len(losses) + 1), losses, lw=2, label="per step")
    ax.plot([middle(e) for e in range(1, len(R["epoch_avg"]) + 1)], R["epoch_avg"], "ks-",
            label="epoch average (at its middle)")
    ax.plot([e * n for e in range(1, len(R["held"]) + 1)], R["held"], "o--", color="tab:green",
            label="held-out, end of epoch")
    ax.plot([middle(e) for e in R["book"]], list(R["book"].values()), "r^", ms=8, label="book, epochs 1 and 5")
    ax.axhline(1.0, color="gray", ls="--", lw=1, label="floor on unseen data: Var(target) = 1")
    ax.set(xlabel="optimiser step (32 samples each)", ylabel="MSE loss", title="DeepSpeed MoE layer on random data")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    return fig


def load_figure(load, capacity_share: float, first_run: int):
    """Section 4's heatmap: each expert's share of each step's choices before the cut, ``load`` ``(steps, E)``,
    coloured around the balanced share 1/E, with the capacity as a share (C / 2S) marked on the colour bar and a
    dotted line after the first ``first_run`` steps."""
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure

    share = (load.float() / load.sum(1, keepdim=True)).T                     # (E, steps)
    experts, steps = share.shape
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1 / experts, vmax=max(share.max().item(), capacity_share) * 1.05)
    fig = Figure(figsize=(9, 2.6), dpi=100)
    ax = fig.subplots()
    im = ax.imshow(share.numpy(), aspect="auto", cmap="RdBu_r", norm=norm, interpolation="nearest",
                   extent=(0.5, steps + 0.5, experts - 0.5, -0.5))           # columns are steps 1..steps
    ax.axvline(first_run + 0.5, color="k", ls=":", lw=1)
    ax.set(xlabel="training step (dotted: start of the longer run)", ylabel="expert", yticks=range(experts),
           title="share of each step's choices per expert, before the cut")
    bar = fig.colorbar(im, ax=ax, label="share of 2S choices")
    bar.ax.axhline(capacity_share, color="k", lw=2)
    bar.ax.text(1.05, capacity_share, " C/2S", transform=bar.ax.get_yaxis_transform(), va="center", fontsize=8)
    fig.tight_layout()
    return fig
