"""Chapter 02's tables, sentences and figures, written from its results dict ``R`` (notebooks/02_deepspeed_moe.ipynb).

The chapter measures and checks in its cells; these functions only lay out what ``R`` holds: the printed tables of
sections 4 to 15 and appendix B (plain text, for ``print``), the paragraph on the two ``l_aux`` forms
(:func:`forms`), the summary (:func:`summary`, Markdown), and three figures drawn from the measurements (made without
pyplot, so a cell that ends with one shows it once). Tested in tests/test_reports_ch02.py. A key missing from ``R``
raises ``KeyError`` naming it.
"""
from __future__ import annotations

# --- section 4: the capacity formula ------------------------------------------------------------------------------


def gate_table(R: dict) -> str:
    """The capacity table: per token count and k, the formula's C, the gate's C, routes, drop rate, load -> kept."""
    rows, E = R["gate_rows"], R["E"]
    counts = sorted({row[0] for row in rows}, reverse=True)
    lines = [f"E={E} experts, capacity_factor=1.0, min_capacity=4; S={counts[0]} tokens (k·S/E whole) and "
             f"S={counts[-1]} (fractional)",
             f"{'S':>4} {'k':>2} {'k·S/E':>7} {'C formula':>9} {'C measured':>10} {'routes':>6} {'dropped':>7}  "
             "exp_counts -> kept"]
    for n, k, formula, capacity, rate, chosen, kept in rows:
        lines.append(f"{n:>4} {k:>2} {k * n / E:>7g} {formula:>9} {capacity:>10} {sum(chosen):>6} {rate:>7.1%}  "
                     f"{chosen} -> {kept}")
    return "\n".join(lines)


def _figure(size):
    from matplotlib.figure import Figure

    return Figure(figsize=size, dpi=100)


def capacity_figure(R: dict):
    """Section 4's bars: for the chapter's S and k = 1, 2, 3, the routes each expert was chosen for, those it kept,
    and the capacity C."""
    rows = [row for row in R["gate_rows"] if row[0] == R["S"]]
    fig = _figure((9, 2.6))
    axes = fig.subplots(1, len(rows), sharey=True)
    for ax, (_, k, _, capacity, rate, chosen, kept) in zip(axes, rows):
        ax.bar(range(len(chosen)), chosen, color="#d9d9d9", label="chosen (exp_counts)")
        ax.bar(range(len(kept)), kept, color="#1f77b4", label="kept")
        ax.axhline(capacity, color="#d62728", ls="--", lw=1, label="capacity C")
        ax.set(title=f"k={k}: C={capacity}, {rate:.0%} dropped", xlabel="expert")
    axes[0].set_ylabel("routes")
    axes[0].legend(frameon=False, fontsize=7)
    fig.tight_layout()
    return fig


# --- section 6: the drop rate against the capacity factor -------------------------------------------------------


def sweep_lines(R: dict, k: int) -> str:
    """One k of the sweep: the drop rate at each factor, the dropped routes measured, predicted per expert and by
    one shared pool, and ``drop_tokens=False``'s capacity."""
    sweep, factors = R["sweep"][k], R["factors"]
    capacity, max_load, rate, tokens = sweep["nodrop"]
    return "\n".join([
        f"k={k} drop rate: " + "  ".join(f"cf={cf}:{d:.1%}" for cf, d in zip(factors, sweep["rates"])),
        f"     dropped routes measured {sweep['measured']}",
        f"     predicted per expert   {sweep['per_expert']}",
        f"     one shared pool        {sweep['pooled']}",
        f"     drop_tokens=False: C={capacity} = max load {max_load}, dropped {rate:.0%} (an effective cf of "
        f"{capacity * R['E'] / (k * tokens):.2f})"])


def drop_figure(R: dict):
    """Section 6's curve: the share of routes dropped against the capacity factor, one line per k."""
    fig = _figure((5, 3))
    ax = fig.subplots()
    for k, sweep in R["sweep"].items():
        ax.plot(R["factors"], [100 * y for y in sweep["rates"]], marker="o", label=f"k={k}")
    tokens = next(iter(R["sweep"].values()))["nodrop"][3]
    ax.set(xlabel="capacity_factor", ylabel="routes dropped (%)", title=f"drop rate, S={tokens}, E={R['E']}")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    fig.tight_layout()
    return fig


# --- sections 7 and 8: which tokens are kept, and the noisy gates ------------------------------------------------


def rts_lines(R: dict) -> str:
    """Section 7: the busy expert's kept tokens, first come, by ``torch.topk`` ties, and by two RTS calls."""
    rts = R["rts"]
    return "\n".join([f"expert {rts['expert']} is chosen by {rts['chosen']} tokens, keeps C={rts['C']}",
                      f"first come (FastMoE-style): {rts['first_come']}",
                      f"use_rts=False (topk ties):  {rts['no_rts']}",
                      f"use_rts=True, call 1:       {rts['a']}",
                      f"use_rts=True, call 2:       {rts['b']}"])


def noise_table(R: dict) -> str:
    """Section 8: the share of tokens each noisy policy routes differently from the clean gate."""
    lines = [f"{'':<8} {'k=1 train':>10} {'k=1 eval':>9} {'k=2 train':>10}   (share of tokens routed differently)"]
    for policy, (train1, eval1, train2) in R["noise"].items():
        lines.append(f"{policy:<8} {train1:>10.1%} {eval1:>9.1%} {train2:>10.1%}")
    return "\n".join(lines)


# --- section 11: the re-derivation, bit for bit --------------------------------------------------------------------


def exact_table(R: dict) -> str:
    """Section 11's cases: DeepSpeed's C and drop rate and whether the re-derivation is bit-exact (k = 3 is shown
    with ``drop_tokens=True`` only)."""
    return "\n".join(f"k={k} {label:<20} drop_tokens={drop!s:<5} C={capacity:<3} dropped {rate:5.1%}  bit-exact: {ok}"
                     for k, label, drop, capacity, rate, ok in R["exact_rows"] if k < 3 or drop)


def exact5_lines(R: dict) -> str:
    """The E = 5 cross-check: fractional capacities, bit-exact routers, and top-1's ``l_aux`` in top-2's form."""
    e5 = R["exact5"]
    return "\n".join([
        f"E={e5['E']}, S={R['S']}, cf=1.0: k·S/E = {[k * R['S'] / e5['E'] for k in (1, 2, 3)]}, "
        f"C measured {e5['caps']}",
        f"bit-exact of {e5['routers']} routers: " + ", ".join(f"k={k}: {n}" for k, n in e5["exact"].items())
        + f"; top-1's l_aux in top-2's form differs from DeepSpeed's on {e5['forms_differ']}"])


def forms_table(R: dict) -> str:
    """The share of routers whose two ``l_aux`` forms differ in the last bit, per token count and E."""
    shares, routers = R["bit_share"], R["bit_routers"]
    es = list(next(iter(shares.values())))
    lines = ["share of routers whose l_aux differs in the last bit", f"{'E:':<18}" + " ".join(f"{e:>6}" for e in es)]
    for n_tok, by_e in shares.items():
        lines.append(f"{f'S={n_tok} ({routers[n_tok]})':<18}" + " ".join(f"{by_e[e]:>6.1%}" for e in es))
    return "\n".join(lines)


def _differing(by_e: dict) -> list:
    return [e for e, share in by_e.items() if share]


def forms(R: dict) -> str:
    """The paragraph after the forms table: where top-1's and top-2's ``l_aux`` differ, and that it depends on E and
    on S (a power of two never may)."""
    shares = R["bit_share"]
    es = list(next(iter(shares.values())))
    pow2 = [e for e in es if e & (e - 1) == 0]

    def at(n_tok):
        found = [f"{shares[n_tok][e]:.1%} for E = {e}" for e in _differing(shares[n_tok])]
        return f"at S = {n_tok}: " + (", ".join(found) if found else "none")

    broken = sorted({e for by_e in shares.values() for e in _differing(by_e)} & set(pow2))
    never = (f"never for E = {', '.join(map(str, pow2))}, as they must" if not broken else
             f"and even for E = {', '.join(map(str, broken))}, a power of two, where they must not")
    moving = [e for e in es if len({bool(by_e[e]) for by_e in shares.values()}) > 1]
    return (f"Measured in this run ({R['preset']} preset; both presets' token counts): the two forms differ in the "
            f"last bit (by one float32 step at most) {'; '.join(at(n) for n in shares)}; {never}. No single share "
            "describes it: it depends on E and on S"
            + (f" (E = {', '.join(map(str, moving))} differ at one token count and not at the other)" if moving else "")
            + ". A re-derivation is bit-exact only if it writes each gate's own form.")


# --- DeepSpeed against the FastMoE gates ---------------------------------------------------------------------------


def fastmoe_lines(R: dict) -> str:
    """The same routers through DeepSpeed's gates and the lab's FastMoE gates: drops, weights and aux losses."""
    f = R["fastmoe"]
    (ds2, gs2), (ds1, sw1, by_hand), (kept_ds, kept_fm, differ) = f["aux2"], f["aux1"], f["kept1"]
    return "\n".join([
        f"top-2 (C={f['C2']}): same experts and same drops: {f['same_kept2']}; weights differ for "
        f"{f['weights_differ']} tokens = the {f['lost_one']} tokens that lost one route",
        f"      aux loss: DeepSpeed {ds2:.6f}, GShardGate {gs2:.6f}",
        f"top-1 (C={f['C1']}): kept {kept_ds} vs {kept_fm} tokens, {differ} differ (DeepSpeed: topk tie order; Switch: "
        f"arrival order)",
        f"      aux loss: DeepSpeed {ds1:.6f} (before drops), SwitchGate {sw1:.6f}, fastmoe's formula by hand "
        f"{by_hand:.6f}"])


# --- section 12: PR-MoE --------------------------------------------------------------------------------------------

CATEGORIES = (("moe experts", "#1f77b4"), ("router/gate", "#ff7f0e"), ("other", "#7f7f7f"))


def _total(counts: dict) -> int:
    return sum(counts.values())


def pyramid_table(R: dict) -> str:
    """Parameters of each design (experts, router, other, total) and those one token uses (k = 1)."""
    p = R["pyramid"]
    layers, size = p["layers"], p["expert_size"]
    lines = [f"{layers} layers, pyramid experts per layer {p['experts']}, expert = {size:,} params",
             f"{'design':<9} {'experts':>8} {'router':>7} {'other':>7} {'total':>8} {'active/token':>13}"]
    for name, c in p["counts"].items():
        experts, total = c.get("moe experts", 0), _total(c)
        active = total if not experts else total - experts + layers * size           # k = 1: one expert per layer
        lines.append(f"{name:<9} {experts:>8,} {c.get('router/gate', 0):>7,} {c.get('other', 0):>7,} {total:>8,} "
                     f"{active:>13,}")
    return "\n".join(lines)


def param_figure(R: dict):
    """Section 12's stacked bars: where each design's parameters are."""
    p = R["pyramid"]
    names = list(p["counts"])
    fig = _figure((6, 2.8))
    ax = fig.subplots()
    bottom = [0] * len(names)
    for cat, color in CATEGORIES:
        values = [p["counts"][n].get(cat, 0) for n in names]
        ax.bar(names, values, bottom=bottom, color=color, label=cat)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(ylabel="parameters", title=f"{p['layers']} layers, d={R['D']}: where the parameters are")
    ax.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    return fig


# --- section 15 and appendix B -------------------------------------------------------------------------------------


def small_batch_lines(R: dict) -> str:
    """A batch smaller than ``min_capacity``: top-1's refusal, top-2's padding."""
    b = R["small_batch"]
    refused = f"AssertionError: {b['refusal']}" if b["refusal"] else "ran (no error)"
    return (f"k=1, {b['tokens']} tokens, min_capacity=4 -> {refused}\n"
            f"k=2, {b['tokens']} tokens: C={b['C']}, {b['slots']} slots for {b['routes']} routes "
            f"({1 - b['routes'] / b['slots']:.0%} of the expert buffer is padding)")


def quirk_lines(R: dict) -> str:
    """Appendix B: how often DeepSpeed's float32 capacity differs from the exact ceil and from float64, examples."""
    q = R["quirk"]
    lines = [f"float32 capacity differs from the exact ceil in {q['off']} of {q['grid']} (S, E, cf, k) cases, and from "
             f"math.ceil(S / E * cf * k) in Python floats (float64) in {q['off64']}, e.g."]
    lines += [f"  S={s} E={e} cf={c} k={k}: exact {exact}, float64 {f64}, DeepSpeed {ds}"
              for s, e, c, k, exact, f64, ds in q["examples"]]
    return "\n".join(lines)


# --- the summary ---------------------------------------------------------------------------------------------------


def _all(n: int, of: int) -> str:
    return f"all {of}" if n == of else f"only {n} of {of}"


def summary(R: dict) -> str:
    """The chapter's summary, one bullet per part, every number from ``R``."""
    S, E = R["S"], R["E"]
    pic, rts, noise, ev, aux = R["picture"], R["rts"], R["noise"], R["eval_random"], R["aux"]
    at1 = R["factors"].index(1.0)
    kept_late = len(set(rts["no_rts"]) - set(rts["first_come"]))
    exact_ok = sum(row[-1] for row in R["exact_rows"])
    e5 = R["exact5"]
    exact5_ok = sum(e5["exact"].values())
    pyramid, (first, last) = R["pyramid"], R["train"]
    refused = sum(line.startswith("CapacityMismatchError") for line in R["pitfall"][False])
    ran = all(line.startswith("ran") for line in R["pitfall"][True])
    differ_es = _differing(R["bit_share"][S]) if S in R["bit_share"] else "(not measured at this S)"
    return "\n".join([
        f"On the {R['preset']} preset (S = {S} tokens, E = {E} experts, d = {R['D']}):",
        "",
        f"- `init_deepspeed()` started DeepSpeed {R['ds_version']} in this process in {R['ds_start_s']:.1f} s "
        f"({R['backend']}, world size {R['world_size']}); a second call changed nothing.",
        f"- The experts run on one `[E, C, d]` buffer: section 1's run has {pic['experts']} experts x "
        f"{pic['capacity']} slots, {pic['dropped']} dropped tokens and {pic['padded']} padded slots; the buffer the "
        f"experts received, and the picture read back from its labels, equal the layout written out by hand.",
        f"- Capacity is `max(ceil(cf·k·S/E), min_capacity)` evaluated in float32 (S = 100, E = 4, cf = 1.2: "
        f"{R['cap100']['float32']}, where float64 gives {R['cap100']['float64']}; appendix B). Each expert keeps "
        f"`min(exp_counts, C)`: the dropped routes matched that count at all {len(R['factors'])} capacity factors for "
        f"k = 1 and 2 (at cf = 1.0: {R['sweep'][1]['rates'][at1]:.1%} of routes dropped for k = 1, "
        f"{R['sweep'][2]['rates'][at1]:.1%} for k = 2; every drop rate printed equals dropped / routes counted route "
        f"by route); `exp_counts` is demand, not work.",
        f"- Top-1 without RTS kept a `torch.topk`-tie-order subset ({kept_late} of its C = {rts['C']} kept tokens were "
        f"not among the first {rts['C']} to arrive); with RTS two calls kept {len(set(rts['a']) ^ set(rts['b']))} "
        f"different tokens. Top-2 dropped {'exactly' if R['fastmoe']['same_kept2'] else 'NOT'} the routes FastMoE's "
        f"`GShardGate` drops (arrival order).",
        f"- `Jitter` re-routed {noise['Jitter'][0]:.1%} (k = 1) and {noise['Jitter'][2]:.1%} (k = 2) of the tokens in "
        f"training, `RSample` {noise['RSample'][0]:.1%} (k = 1) and {noise['RSample'][2]:.1%} (k = 2); in eval they "
        f"re-routed {noise['Jitter'][1]:.1%} and {noise['RSample'][1]:.1%} (k = 1). Randomness left in eval: "
        f"2nd-expert sampling changed the 2nd expert of {ev[True][0]:.0%} of the tokens between two eval calls "
        f"({ev[False][0]:.0%} with it off), and fastmoe's default `random_routing` dropped different 2nd choices in "
        f"two eval calls.",
        f"- `l_aux` was {aux['random router']:.3f} for a random router and {aux['collapsing router']:.3f} (E = {E}) "
        f"for a collapsed one. The re-derived gates matched DeepSpeed bit for bit in "
        f"{_all(exact_ok, len(R['exact_rows']))} cases at E = {E} and {_all(exact5_ok, 3 * e5['routers'])} at "
        f"E = {e5['E']} (capacities {e5['caps']}, fractional); top-1's `sum(m·f)·E` and top-2's `mean(m·f)·E·E` "
        f"differed in the last bit at S = {S} for E = {differ_es} only (section 11: the set depends on S).",
        f"- Residual MoE = c0·MoE(x) + c1·MLP(x) exactly; the {pyramid['layers']}-layer PR-MoE (experts "
        f"{pyramid['experts']}) has {_total(pyramid['counts']['PR-MoE']):,} parameters against "
        f"{_total(pyramid['counts'][f'MoE x{E}']):,} for MoE x{E}. `deepspeed.initialize` trained it: loss "
        f"{first:.3f} → {last:.3f} in {R['train_steps']} steps.",
        f"- `ep_size=2` on two gloo ranks gave the `ep_size=1` outputs (largest difference {R['ep_gap']:.1e}) and "
        f"gradients within 1e-6. Ranks that disagree on C: the guard raised on {refused} of {len(R['pitfall'][False])} "
        f"ranks; with the expert group set, {'all ran' if ran else 'NOT every rank ran'}.",
        "- Book says / code does: the noise is uniform jitter and Gumbel-max, not Gaussian or Gumbel-softmax; the "
        "PR-MoE pyramid puts more (same-size) experts in deeper layers; capacity is fixed per call unless "
        "`drop_tokens=False`.",
    ])
