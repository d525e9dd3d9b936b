"""Diagrams drawn with matplotlib from the lab's own tensors: what a layer does, not a picture of it.
(Taught in chapters 01, 02, 06 and 07.)"""
from __future__ import annotations


def plot_moe_flow(gate_idx, num_expert: int, title: str = "one MoE layer: tokens -> experts -> tokens"):
    """Draw what one MoE forward does with a batch: every token's ``k`` choices leave the token column, are
    sorted into expert-contiguous groups (scatter), run through their expert, and come back to their token
    (gather) where the ``k`` outputs are added with the gate's weights (combine). ``gate_idx``: ``(T, k)``
    expert ids, ``-1`` for a dropped choice (drawn grey, it never reaches an expert). (Chapter 01.)
    """
    import matplotlib.pyplot as plt
    import torch
    from matplotlib.patches import Rectangle

    idx = torch.as_tensor(gate_idx).reshape(len(gate_idx), -1)
    T, k = idx.shape
    colors = plt.get_cmap("tab10")
    flat = idx.reshape(-1)
    order = torch.argsort(torch.where(flat >= 0, flat, num_expert), stable=True)
    kept = order[flat[order] >= 0]
    fig, ax = plt.subplots(figsize=(8.5, 0.35 * max(T * k, T) + 1.2), dpi=100)
    x_tok, x_sort, x_exp, x_out = 0.0, 3.0, 5.0, 8.0
    tok_y = {t: T * k - 1 - t * k - (k - 1) / 2 for t in range(T)}
    for t in range(T):
        for x in (x_tok, x_out):
            ax.add_patch(Rectangle((x - 0.4, tok_y[t] - 0.3), 0.8, 0.6, fc="white", ec="black"))
            ax.text(x, tok_y[t], f"t{t}", ha="center", va="center", fontsize=8)
    for row, choice in enumerate(kept.tolist()):
        t, e = choice // k, int(flat[choice])
        y = T * k - 1 - row
        ax.add_patch(Rectangle((x_sort - 0.4, y - 0.3), 0.8, 0.6, fc=colors(e % 10), alpha=0.5, ec="none"))
        ax.text(x_sort, y, f"t{t}", ha="center", va="center", fontsize=7)
        ax.annotate("", (x_sort - 0.45, y), (x_tok + 0.45, tok_y[t]), arrowprops=dict(arrowstyle="->", lw=0.6,
                    color=colors(e % 10)))
        ax.annotate("", (x_out - 0.45, tok_y[t]), (x_exp + 0.95, y), arrowprops=dict(arrowstyle="->", lw=0.6,
                    color=colors(e % 10)))
    start = T * k - 1
    for e in range(num_expert):
        n = int((flat[kept] == e).sum())
        if n:
            ax.add_patch(Rectangle((x_exp - 0.45, start - n + 0.6), 1.4, n - 0.2, fc=colors(e % 10), alpha=0.8))
            ax.text(x_exp + 0.25, start - (n - 1) / 2, f"expert {e}\n{n} row{'s' * (n > 1)}", ha="center",
                    va="center", fontsize=7, color="white")
            start -= n
    dropped = int((flat < 0).sum())
    for x, label in ((x_tok, "tokens x\n(T, d)"), (x_sort, "scatter: sorted\nby expert (N, d)"),
                     (x_exp + 0.25, "experts\n(one matmul each)"), (x_out, "gather + combine\ny (T, d)")):
        ax.text(x, T * k + 0.4, label, ha="center", va="bottom", fontsize=8)
    if dropped:
        ax.text(x_sort, -1.2, f"{dropped} dropped choice(s): no expert, add 0", ha="center", fontsize=8, color="grey")
    ax.set_xlim(-0.8, x_out + 0.8)
    ax.set_ylim(-1.8, T * k + 1.6)
    ax.axis("off")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def _as_rows(gate_idx):
    import torch

    idx = torch.as_tensor(gate_idx)
    return idx.reshape(len(idx), -1) if idx.dim() else idx.reshape(0, 1)


def plot_capacity_dispatch(indices, locations, capacity: int, num_experts: int, chosen=None,
                           title: str = "capacity dispatch: tokens -> (S, E, C) mask -> [E, C, d] buffer"):
    """Draw DeepSpeed's dispatch from one real gating decision: each kept route of token ``t`` lands in slot
    ``locations[j, t]`` of expert ``indices[j, t]``'s ``capacity`` slots (the ``[E, C, d]`` buffer the experts
    run on); empty slots are padding; a route dropped for lack of a slot (``indices == -1``) is drawn as a
    dashed red arrow to the full expert named by ``chosen`` (the expert it was routed to before dropping).
    ``indices``, ``locations``, ``chosen``: ``(k, S)``. (Chapter 02.)
    """
    import matplotlib.pyplot as plt
    import torch
    from matplotlib.patches import Rectangle

    idx, loc = torch.as_tensor(indices), torch.as_tensor(locations)
    if idx.dim() != 2 or loc.shape != idx.shape:
        raise ValueError(f"indices and locations must both be (k, S); got {tuple(idx.shape)} and {tuple(loc.shape)}")
    kept = idx >= 0
    if kept.any() and (int(idx.max()) >= num_experts or int(loc[kept].max()) >= capacity or int(loc[kept].min()) < 0):
        raise ValueError(f"a kept route points outside the buffer [E={num_experts}, C={capacity}]")
    pre = torch.as_tensor(chosen) if chosen is not None else None
    if pre is not None and pre.shape != idx.shape:
        raise ValueError(f"chosen must be (k, S) like indices, got {tuple(pre.shape)}")
    k, S = idx.shape
    colors = plt.get_cmap("tab10")
    height = max(S, 2 * num_experts)
    tok_y = [height - (t + 0.5) * height / S for t in range(S)]
    exp_y = [height - (e + 0.5) * height / num_experts for e in range(num_experts)]
    x_tok, x_buf = 0.0, 4.0
    fig, ax = plt.subplots(figsize=(4.5 + 0.6 * capacity, 0.32 * height + 1.4), dpi=100)
    for t in range(S):
        ax.add_patch(Rectangle((x_tok - 0.4, tok_y[t] - 0.3), 0.8, 0.6, fc="white", ec="black"))
        ax.text(x_tok, tok_y[t], f"t{t}", ha="center", va="center", fontsize=8)
    used = {(int(e), int(c)) for e, c in zip(idx[kept].tolist(), loc[kept].tolist())}
    overflow = {e: [] for e in range(num_experts)}
    for c in range(capacity):
        ax.text(x_buf + c + 0.45, exp_y[0] + 0.55, f"slot {c}", ha="center", fontsize=7, color="grey")
    for e in range(num_experts):
        ax.text(x_buf + capacity + 0.1, exp_y[e] + 0.25, f"expert {e}", ha="left", va="center", fontsize=8)
        for c in range(capacity):
            if (e, c) not in used:
                ax.add_patch(Rectangle((x_buf + c, exp_y[e] - 0.4), 0.9, 0.8, fc="#eeeeee", ec="grey", hatch="///",
                                       lw=0.5))
    for j in range(k):
        for t in range(S):
            e = int(idx[j, t])
            if e >= 0:
                c = int(loc[j, t])
                ax.add_patch(Rectangle((x_buf + c, exp_y[e] - 0.4), 0.9, 0.8, fc=colors(e % 10), alpha=0.8 - 0.3 * j))
                ax.text(x_buf + c + 0.45, exp_y[e], f"t{t}", ha="center", va="center", fontsize=7)
                ax.annotate("", (x_buf - 0.05, exp_y[e]), (x_tok + 0.45, tok_y[t]),
                            arrowprops=dict(arrowstyle="->", lw=0.7, color=colors(e % 10), ls="-" if j == 0 else ":"))
            elif pre is not None and int(pre[j, t]) >= 0:
                e = int(pre[j, t])
                overflow[e].append(f"t{t}")
                ax.annotate("", (x_buf - 0.05, exp_y[e] - 0.2), (x_tok + 0.45, tok_y[t]),
                            arrowprops=dict(arrowstyle="->", lw=0.8, color="#d62728", ls="--"))
    for e, toks in overflow.items():
        if toks:
            ax.text(x_buf + capacity + 0.1, exp_y[e] - 0.25, f"full: {', '.join(toks)} dropped", ha="left",
                    va="center", fontsize=7, color="#d62728")
    dropped, slots = int((~kept).sum()), num_experts * capacity
    ax.text(x_tok, height + 0.3, f"S={S} tokens", ha="center", fontsize=8)
    ax.text(x_buf + capacity / 2, height + 0.3, f"[E={num_experts}, C={capacity}, d] buffer: {int(kept.sum())} of "
            f"{slots} slots used, {slots - int(kept.sum())} padding, {dropped} route(s) dropped",
            ha="center", fontsize=8)
    ax.set_xlim(-0.8, x_buf + capacity + 3.2)
    ax.set_ylim(-0.5, height + 1.2)
    ax.axis("off")
    ax.set_title(title + (" (dotted: 2nd choice)" if k > 1 else ""), fontsize=9)
    fig.tight_layout()
    return fig


def read_dispatch(fig) -> dict:
    """What a :func:`plot_capacity_dispatch` figure shows, read back from its labels as a reader reads it:
    ``{(expert, slot): token}`` for every token label inside the buffer, placed by the ``slot c`` header above
    its column and the ``expert e`` label beside its row (the token column on the left is not read). A check
    that compares this with a literal layout fails when the picture puts a token in the wrong slot. (Chapter 02.)
    """
    import re

    ax = fig.axes[0]
    slots, experts, tokens = {}, {}, []
    for text in ax.texts:
        (x, y), label = text.get_position(), text.get_text()
        if m := re.fullmatch(r"slot (\d+)", label):
            slots[int(m[1])] = x
        elif m := re.fullmatch(r"expert (\d+)", label):
            experts[int(m[1])] = y
        elif m := re.fullmatch(r"t(\d+)", label):
            tokens.append((x, y, int(m[1])))
    if not slots or not experts:
        raise ValueError("not a plot_capacity_dispatch figure: no 'slot c' or 'expert e' labels")
    shown = {}
    for x, y, token in tokens:
        c = min(slots, key=lambda c: abs(slots[c] - x))
        if abs(slots[c] - x) < 0.5:                                          # under a slot header: in the buffer
            shown[min(experts, key=lambda e: abs(experts[e] - y)), c] = token
    return dict(sorted(shown.items()))


def plot_expert_parallel(gate_idx_per_rank, num_expert: int,
                         title: str = "expert parallelism: which rank sends which token to which expert"):
    """Draw one dispatch all-to-all from real routings: ``gate_idx_per_rank[r]`` is rank ``r``'s ``(T_r, k)``
    global expert ids (``-1`` = dropped); global expert ``g`` lives on rank ``g // num_expert``. Left: every
    rank's tokens (``r<src>t<i>``); right: every rank's local experts with the rows they receive, expert by
    expert; an arrow per route, coloured by its source rank when it crosses ranks (it travels in the
    all-to-all), grey when it stays on its rank. (Chapter 06.)
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    ranks = [_as_rows(g) for g in gate_idx_per_rank]
    world = len(ranks)
    if world == 0 or num_expert < 1:
        raise ValueError(f"need at least one rank and num_expert >= 1, got {world} ranks, num_expert={num_expert}")
    for r, g in enumerate(ranks):
        if g.numel() and int(g.max()) >= world * num_expert:
            raise ValueError(f"rank {r} routes to expert {int(g.max())}, but {world} ranks x {num_expert} = "
                             f"{world * num_expert} experts exist")
    colors = plt.get_cmap("tab10")
    routes = [(s, t, int(e)) for s, g in enumerate(ranks) for t in range(g.shape[0]) for e in g[t] if e >= 0]
    left = [(s, t) for s, g in enumerate(ranks) for t in range(-1, g.shape[0])]  # t = -1: the rank's label
    right = []
    for d in range(world):
        right.append(("rank", d))
        for g in range(d * num_expert, (d + 1) * num_expert):
            rows = [(s, t) for s, t, e in routes if e == g]
            right += [("row", (g, s, t, i)) for i, (s, t) in enumerate(rows)] or [("empty", g)]
    height = max(len(left), len(right))
    fig, ax = plt.subplots(figsize=(8, 0.3 * height + 1.3), dpi=100)
    x_tok, x_row = 0.0, 6.0
    tok_y = {}
    for i, (s, t) in enumerate(left):
        y = height - (i + 0.5) * height / len(left)
        if t < 0:
            ax.text(x_tok, y, f"rank {s}", ha="center", va="center", fontsize=8, weight="bold")
        else:
            tok_y[(s, t)] = y
            ax.add_patch(Rectangle((x_tok - 0.5, y - 0.3), 1.0, 0.6, fc=colors(s % 10), alpha=0.35, ec="black"))
            ax.text(x_tok, y, f"r{s}t{t}", ha="center", va="center", fontsize=7)
    crossing = 0
    for i, (kind, what) in enumerate(right):
        y = height - (i + 0.5) * height / len(right)
        if kind == "rank":
            ax.text(x_row + 0.6, y, f"rank {what}", ha="center", va="center", fontsize=8, weight="bold")
        elif kind == "empty":
            ax.text(x_row + 0.6, y, "(no rows)", ha="center", va="center", fontsize=7, color="grey")
            ax.text(x_row + 1.35, y, f"expert {what}", ha="left", va="center", fontsize=7)
        else:
            g, s, t, n = what
            ax.add_patch(Rectangle((x_row, y - 0.3), 1.2, 0.6, fc=colors(s % 10), alpha=0.35, ec="black"))
            ax.text(x_row + 0.6, y, f"r{s}t{t}", ha="center", va="center", fontsize=7)
            if n == 0:
                ax.text(x_row + 1.35, y, f"expert {g}", ha="left", va="center", fontsize=7)
            crosses = s != g // num_expert
            crossing += crosses
            ax.annotate("", (x_row - 0.05, y), (x_tok + 0.55, tok_y[(s, t)]),
                        arrowprops=dict(arrowstyle="->", lw=0.8 if crosses else 0.6,
                                        color=colors(s % 10) if crosses else "#aaaaaa"))
    ax.text((x_tok + x_row) / 2, -0.4, f"{len(routes)} routes: {crossing} cross ranks in the all-to-all "
            f"(coloured by sender), {len(routes) - crossing} stay on their rank (grey)", ha="center", fontsize=8)
    ax.set_xlim(-1.2, x_row + 2.6)
    ax.set_ylim(-1.0, height + 0.2)
    ax.axis("off")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_parallel_groups(ep_groups, edp_groups, counts=None, dense_label: str = "dense params",
                         title: str = "data-parallel vs expert-parallel groups: which gradients meet where"):
    """Draw every rank's parameters and the groups their gradients are reduced over: dense parameters are
    averaged over all ranks (the data-parallel group); expert ``e``'s gradients are summed only over the
    ranks holding a replica of it (an expert-data-parallel group, ``edp_groups[e]``) and divided by the
    data-parallel size; the ranks of one expert-parallel group (``ep_groups``) hold different experts and
    exchange tokens in the all-to-all. ``counts``: gradient tensors per group, as
    ``allreduce_grouped_grads`` returns them. (Chapter 07.)
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    ep = [sorted(int(r) for r in g) for g in ep_groups]
    edp = [sorted(int(r) for r in g) for g in edp_groups]
    ranks = sorted(r for g in ep for r in g)
    world = len(ranks)
    if ranks != list(range(world)) or sorted(r for g in edp for r in g) != ranks:
        raise ValueError(f"ep_groups {ep} and edp_groups {edp} must each cover ranks 0..W-1 exactly once")
    expert_of = {}
    for g in ep:
        if len(g) != len(edp):
            raise ValueError(f"an expert-parallel group {g} must hold one rank per expert ({len(edp)} experts)")
    for e, g in enumerate(edp):
        expert_of.update({r: e for r in g})
    counts = counts or {}
    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(max(6.0, 1.9 * world + 2.5), 3.2 + 0.45 * len(edp)), dpi=100)
    xs = {r: 1.9 * r for r in ranks}
    for r in ranks:
        x = xs[r]
        ax.add_patch(Rectangle((x - 0.8, -0.1), 1.6, 3.0, fill=False, ec="black", lw=0.8))
        ax.text(x, 2.6, f"rank {r}", ha="center", fontsize=8, weight="bold")
        ax.add_patch(Rectangle((x - 0.65, 1.5), 1.3, 0.8, fc="#9ecae1", ec="black", lw=0.5))
        ax.text(x, 1.9, dense_label, ha="center", va="center", fontsize=6.5)
        e = expert_of[r]
        ax.add_patch(Rectangle((x - 0.65, 0.2), 1.3, 0.8, fc=colors((e + 2) % 10), alpha=0.6, ec="black", lw=0.5))
        ax.text(x, 0.6, f"expert {e}", ha="center", va="center", fontsize=7)
    left, right = xs[0] - 0.8, xs[world - 1] + 0.8
    dense_n = f" ({counts['dp']} tensors)" if "dp" in counts else ""
    ax.plot([left, right], [3.55, 3.55], color="#3182bd", lw=2)
    ax.text((left + right) / 2, 3.65, f"data-parallel group {ranks}: dense grads all-reduced, mean over "
            f"{world}{dense_n}", ha="center", va="bottom", fontsize=8, color="#3182bd")
    for g in ep:
        lo, hi = xs[g[0]] - 0.7, xs[g[-1]] + 0.7
        ax.plot([lo, lo, hi, hi], [3.0, 3.15, 3.15, 3.0], color="black", lw=1)
        ax.text((lo + hi) / 2, 3.2, f"expert-parallel {g}: token all-to-all", ha="center", fontsize=7)
    expert_n = f" ({counts['expert']} tensors)" if "expert" in counts else ""
    for e, g in enumerate(edp):
        y = -0.45 - 0.45 * e
        for r in g:
            ax.plot([xs[r], xs[r]], [0.2, y], color=colors((e + 2) % 10), lw=1.2)
        ax.plot([xs[g[0]], xs[g[-1]] + 0.01], [y, y], color=colors((e + 2) % 10), lw=2)
        how = f"summed over {len(g)}, / {world}" if len(g) > 1 else f"not communicated, / {world}"
        ax.plot([xs[g[-1]], right + 0.25], [y, y], color=colors((e + 2) % 10), lw=0.6, ls=":")
        ax.text(right + 0.3, y, f"expert-data-parallel {g}: expert {e} grads {how}{expert_n}", va="center",
                fontsize=7.5, color=colors((e + 2) % 10))
    ax.set_xlim(left - 0.3, right + 5.2)
    ax.set_ylim(-0.75 - 0.45 * len(edp), 4.3)
    ax.axis("off")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
