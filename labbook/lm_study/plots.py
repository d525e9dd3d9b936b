"""Chapter 05's study, the figures of a record: validation curves (:func:`plot_study`), final losses
(:func:`plot_ablations`), the load of every MoE layer (:func:`plot_layer_load`, :func:`load_shares`,
:func:`busiest_over_mean`). (Taught in chapter 05.)
"""
from __future__ import annotations

import math

import torch

from labbook.lm_study.config import MAIN
from labbook.lm_study.summary import _runs, curves
from labutils import stats


def plot_study(record: dict):
    """Validation loss (mean ± std over seeds, as a band) against steps, training FLOPs and CPU seconds."""
    from labutils.plotting import COLORS, plt

    c = curves(record)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), dpi=100, sharey=True)
    xs = {"steps": lambda cv: cv.steps, "training FLOPs (10^12)": lambda cv: [f / 1e12 for f in cv.flops],
          f"training time, s (CPU: {record['config']['threads']} thread per run, {record['jobs']} side by side)":
          lambda cv: cv.seconds}
    for ax, (label, x) in zip(axes, xs.items()):
        for color, name in zip(COLORS, MAIN):
            cv = c[name]
            mean, std = torch.tensor(cv.mean), torch.tensor(cv.std).nan_to_num(0.0)
            ax.plot(x(cv), mean.tolist(), color=color, label=f"{name} ({len(cv.finals)} seeds)")
            ax.fill_between(x(cv), (mean - std).tolist(), (mean + std).tolist(), color=color, alpha=0.25, lw=0)
        ax.set(xlabel=label)
        ax.spines[["top", "right"]].set_visible(False)
    axes[0].set_ylabel("validation loss (nats/char)")
    axes[0].axhline(c["dense"].final, color="k", lw=0.8, ls=":", label="dense's final loss")
    axes[0].legend(frameon=False)
    low = min(min(c[n].mean) for n in MAIN)
    axes[0].set_ylim(low - 0.05, min(c["dense"].mean[0], low + 1.0))
    fig.suptitle(f"{record['config']['name']} preset: validation loss on held-out stdlib files, mean ± std over seeds")
    fig.tight_layout()
    return fig


def plot_ablations(record: dict):
    """Final validation loss of each model as its mean with a 95% t-interval (seeds as dots); a model with one
    seed has no interval and is drawn hollow. The y axis starts at zero."""
    from labutils.plotting import COLORS, plt

    c = curves(record)
    names = list(c)
    fig, ax = plt.subplots(figsize=(9, 3.4), dpi=100)
    for i, name in enumerate(names):
        cv, color = c[name], COLORS[i % len(COLORS)]
        n = len(cv.finals)
        ax.plot([i] * n, cv.finals, ".", color="0.4", ms=5)
        if n > 1:
            half = stats.t_ppf(0.975, n - 1) * cv.final_std / math.sqrt(n)
            ax.errorbar(i, cv.final, yerr=half, fmt="o", color=color, capsize=4, ms=7)
        else:
            ax.plot(i, cv.final, "o", mfc="none", color=color, ms=7)
    ax.axhline(c["dense"].final, color="k", lw=0.8, ls=":", label="dense mean")
    ax.set_xticks(range(len(names)), [f"{n}\n({len(c[n].finals)} seed{'s' if len(c[n].finals) > 1 else ''})"
                                      for n in names], fontsize=8)
    ax.set_ylim(0, max(max(cv.finals) for cv in c.values()) * 1.08)
    ax.set(ylabel="final validation loss (nats)",
           title=f"{record['config']['name']} preset: final loss, mean with 95% t-interval (dots: seeds)")
    ax.legend(frameon=False, loc="lower right")
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


def _run(record: dict, name: str, seed: int | None):
    for r in record["runs"]:
        if r["name"] == name and (seed is None or r["seed"] == seed):
            return r
    raise ValueError(f"the record has no run of {name!r}" + (f" with seed {seed}" if seed is not None else ""))


def load_shares(record: dict, name: str = "MoE", seed: int | None = None, layer: int | None = None) -> torch.Tensor:
    """``(windows, experts)`` share of routed tokens per expert over training: one ``layer``, or summed over layers
    (None). A record made before per-layer load (key ``load``) has only the sum."""
    run = _run(record, name, seed)
    if "load_layers" in run:
        load = torch.tensor(run["load_layers"], dtype=torch.float64)           # (windows, layers, experts)
        load = load.sum(1) if layer is None else load[:, layer]
    elif layer is None:
        load = torch.tensor(run["load"], dtype=torch.float64)                  # (windows, experts)
    else:
        raise ValueError(f"this record's {name!r} run has its load summed over layers only (no 'load_layers')")
    return load / load.sum(1, keepdim=True)


def plot_layer_load(record: dict, name: str = "MoE", seed: int | None = None):
    """Each MoE layer's share of routed tokens per expert over training, one heatmap per layer (a collapse in
    one layer cannot hide in the sum)."""
    from labutils.plotting import plt

    run = _run(record, name, seed)
    n_layers = len(run["load_layers"][0])
    fig, axes = plt.subplots(1, n_layers, figsize=(4.2 * n_layers, 3.2), dpi=100, squeeze=False)
    for layer, ax in enumerate(axes[0]):
        share = load_shares(record, name, run["seed"], layer)                  # (windows, experts)
        im = ax.imshow(share.numpy(), aspect="auto", cmap="viridis", vmin=0, interpolation="nearest")
        ax.set(title=f"layer {layer}", xlabel="expert", ylabel=f"training window ({run['window']} steps)")
        fig.colorbar(im, ax=ax, label="share of routed tokens")
    fig.suptitle(f"{record['config']['name']} preset, {name} seed {run['seed']}: load per layer")
    fig.tight_layout()
    return fig


def busiest_over_mean(record: dict, name: str = "MoE", last: float = 0.2) -> list:
    """Per run of ``name`` (seeds in order) and per layer: the busiest expert's share over the balanced share,
    over the last ``last`` fraction of training windows."""
    out = []
    for r in _runs(record, name):
        load = torch.tensor(r["load_layers"], dtype=torch.float64)             # (windows, layers, experts)
        tail = load[-max(1, int(len(load) * last)):].sum(0)                   # (layers, experts)
        out.append((tail.max(1).values / tail.mean(1)).tolist())
    return out
