"""Plots a reader would rather see than read: losses, parameter breakdowns, expert load. (Chapter 00.)

Each function returns the matplotlib Figure (display it, save it with ``fig.savefig``) and never calls
``plt.show()``, so notebooks and scripts behave the same.
"""
from __future__ import annotations

import matplotlib
import matplotlib.pyplot as plt
import torch

COLORS = plt.rcParams["axes.prop_cycle"].by_key()["color"]


def _as_runs(runs) -> dict:
    if isinstance(runs, dict):
        return {str(k): [float(v) for v in vals] for k, vals in runs.items()}
    return {"loss": [float(v) for v in runs]}


def _smooth(values: list, weight: float) -> list:
    """Exponential moving average (TensorBoard style); weight 0 leaves values unchanged."""
    out, last = [], None
    for v in values:
        last = v if last is None else weight * last + (1 - weight) * v
        out.append(last)
    return out


def plot_losses(runs, *, smooth: float = 0.0, logy: bool = False, xlabel: str = "step", ylabel: str = "loss",
                title: str | None = None, steps: dict | None = None, figsize=(6.4, 3.6)):
    """Loss curves of one run (a list) or several named runs (a dict name -> list).

    ``smooth`` in [0, 1) draws an exponential moving average over the faint raw curve.
    ``steps`` optionally maps a run name to its x values (e.g. validation every 50 steps).
    """
    if not 0 <= smooth < 1:
        raise ValueError(f"smooth must be in [0, 1), got {smooth}")
    runs = _as_runs(runs)
    fig, ax = plt.subplots(figsize=figsize, dpi=100)
    for i, (name, values) in enumerate(runs.items()):
        xs = (steps or {}).get(name, list(range(1, len(values) + 1)))
        color = COLORS[i % len(COLORS)]
        if smooth:
            ax.plot(xs, values, color=color, alpha=0.25, linewidth=1)
            ax.plot(xs, _smooth(values, smooth), color=color, label=name, linewidth=2)
        else:
            ax.plot(xs, values, color=color, label=name, linewidth=2, marker="o" if len(values) <= 12 else None)
    if logy:
        ax.set_yscale("log")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title or "")
    ax.grid(alpha=0.3)
    if len(runs) > 1 or smooth:
        ax.legend(frameon=False)
    fig.tight_layout()
    return fig


def _human(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def plot_param_counts(counts, *, title: str | None = None, log: bool = False, figsize=(6.4, 3.0)):
    """Horizontal bars of a parameter breakdown (a ParamCounts or a dict category -> count)."""
    data = dict(getattr(counts, "by_category", counts))
    if not data:
        raise ValueError("no parameters to plot")
    total = sum(data.values())
    fig, ax = plt.subplots(figsize=figsize, dpi=100)
    names = list(data)[::-1]
    values = [data[n] for n in names]
    bars = ax.barh(names, values, color=[COLORS[i % len(COLORS)] for i in range(len(names))][::-1])
    for bar, v in zip(bars, values):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f"  {_human(v)} ({v / total:.1%})",
                va="center", fontsize=9)
    if log:
        ax.set_xscale("log")
    ax.set_xlim(right=max(values) * (3 if log else 1.35))
    ax.set(xlabel="parameters", title=title or f"parameters by category (total {_human(total)})")
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


def plot_expert_load(load, *, title: str | None = None, ylabel: str = "step", normalize: bool = False,
                     annotate: bool | None = None, figsize=None):
    """Tokens per expert: bars for one vector (E,), a heatmap for (steps or layers, E).

    ``normalize`` divides each row by its total (shares instead of counts), which makes imbalance
    comparable across rows of different sizes.
    """
    load = torch.as_tensor(load).detach().float().cpu()
    if load.ndim == 1:
        fig, ax = plt.subplots(figsize=figsize or (6.4, 3.0), dpi=100)
        values = load / load.sum().clamp_min(1) if normalize else load
        ax.bar(range(len(values)), values.tolist(), color=COLORS[0])
        ax.axhline(values.mean().item(), color="k", linestyle="--", linewidth=1, label="balanced")
        ax.set(xlabel="expert", ylabel="share of tokens" if normalize else "tokens", title=title or "")
        ax.legend(frameon=False)
        ax.spines[["top", "right"]].set_visible(False)
        fig.tight_layout()
        return fig
    if load.ndim != 2:
        raise ValueError(f"load must be (E,) or (rows, E), got shape {tuple(load.shape)}")
    values = load / load.sum(1, keepdim=True).clamp_min(1) if normalize else load
    rows, experts = values.shape
    fig, ax = plt.subplots(figsize=figsize or (min(12, 2 + 0.45 * experts), min(8, 1.5 + 0.35 * rows)), dpi=100)
    im = ax.imshow(values.numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
    if annotate if annotate is not None else rows * experts <= 150:
        fmt = "{:.2f}" if normalize else "{:.0f}"
        vmax = values.max().item() or 1
        for i in range(rows):
            for j in range(experts):
                v = values[i, j].item()
                ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=8,
                        color="white" if v < 0.6 * vmax else "black")
    ax.set(xlabel="expert", ylabel=ylabel, title=title or "")
    fig.colorbar(im, ax=ax, label="share of tokens" if normalize else "tokens")
    fig.tight_layout()
    return fig


__all__ = ["plot_losses", "plot_param_counts", "plot_expert_load"]
_ = matplotlib  # the backend is chosen by the caller (MPLBACKEND / notebook)
