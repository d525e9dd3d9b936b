"""Chapter 07's sentences, written from its results dict ``R`` (see ``labbook.reports``).

``R`` holds what the chapter measured: ``preset``, ``cores``, ``rtol``/``atol``, ``ddp_worst`` (the largest parameter
difference between DDP and the local model), ``ep_gap`` (the replicas' gap before and after the wrap, and after it
with the broadcast off), ``features`` (feature -> [status, what was seen]), ``torch``, ``costs`` (per world size: rank
0's ``memory`` per mode, ``sent`` bytes per step, ``minimum`` (a ring's), ``unsharded``, ``round_ms``, ``verdicts``,
``collectives``, ``fully_shard predicted``), ``record`` (None, or the recorded full run's ``date``, ``cores``,
``verdicts``, ``rows``, ``differ``), ``trap_ms`` (threads per rank -> round times) and ``trap`` (their verdict).
"""
from __future__ import annotations

import statistics

EP, REP = "MoE, expert parallel (grouped)", "MoE, experts replicated (DDP)"
WORD = {"ahead": "faster than", "behind": "slower than", "inconclusive": "not distinguishable from"}
RECORD = "data_parallel_costs_full.json"


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _state(mem: dict) -> int:
    """Parameters, gradients and Adam's moments, in bytes."""
    return mem["params"] + mem["grads"] + mem["adam moments"]


def feature_table(R: dict) -> str:
    """Section 3: what works on CPU + gloo, one row per feature run in the launches."""
    rows = [f"| {k} | {status} | {str(seen).replace('|', '/')[:140]} |" for k, (status, seen) in R["features"].items()]
    return "\n".join([f"| feature | CPU / gloo, torch {R['torch']} | seen |", "|---|---|---|", *rows])


def cost_table(R: dict) -> str:
    """Section 5's counts, one table per world size: rank 0's memory between steps, the bytes one rank sent per step
    (the median over steps and ranks) beside a ring's minimum, and the step time (the median over rounds, and the
    range, of the slowest rank's median step per round)."""
    out = []
    for w, c in R["costs"].items():
        out += [f"**W = {w}** ranks x {c['threads']} thread on {R['cores']} cores", "",
                "| mode | params B | grads B | Adam B | sent B | ring min B | step ms | [min, max] |",
                "|---|---:|---:|---:|---:|---:|---:|---|"]
        for m, mem in c["memory"].items():
            low, t = c["minimum"][m], c["round_ms"][m]
            out.append(f"| {m} | {mem['params']:,} | {mem['grads']:,} | {mem['adam moments'] + mem['adam steps']:,} | "
                       f"{c['sent'][m]:,.0f} | {'-' if low is None else f'{low:,.0f}'} | {statistics.median(t):.2f} | "
                       f"[{min(t):.2f}, {max(t):.2f}] |")
        out += ["", f"`fully_shard`, in the step (not in the table): each layer's full parameters {c['unsharded']} B, "
                    "and a full-size gradient of each before its reduce-scatter.", ""]
    return "\n".join(out).rstrip()


def fsdp_parity(R: dict) -> str:
    """Section 3: how rank 0 stores each parameter after ``fully_shard``, and each case's distance from DDP."""
    f = R["fsdp"]
    shards = [f"| `{n}` | {kind} | {full} | {local} | {placement} |" for n, (kind, full, local, placement)
              in f["shards"].items()]
    cases = [f"| {n} | {a:.1e} | {b:.1e} | {'OK' if f['ok'][n] else 'MISMATCH'} |"
             for n, (a, b) in f["max_abs"].items()]
    return "\n".join([f"Rank 0's parameters after `fully_shard` ({R['world']} ranks):", "",
                      "| parameter | type | global | local | placement |", "|---|---|---|---|---|", *shards, "",
                      "| case | step 1 max\\|diff\\| | step 2 max\\|diff\\| | parity |", "|---|---:|---:|---|",
                      *cases, "", f"`CPUOffloadPolicy` on a CPU-only build: {f['offload_error']}"])


def gradient_tables(R: dict) -> str:
    """Section 4: the largest gradient errors of each method against the single-process reference (rank 1), as
    ``max |diff|`` and as ``||diff|| / ||reference||`` over the whole tensor."""
    out = []
    for method, g in R["moe_grads"].items():
        out += [f"**{method}**, rank 1: {'OK' if g['ok'] else 'MISMATCH'} (rtol={g['rtol']:g}, atol={g['atol']:g})", "",
                "| tensor | max \\|diff\\| | \\|\\|diff\\|\\| / \\|\\|ref\\|\\| |", "|---|---:|---:|",
                *(f"| `{name}` | {a:.2e} | {rel:.2e} |" for name, a, rel in g["rows"]), ""]
    return "\n".join(out).rstrip()


def _costs_at(w: int, c: dict, cores: int) -> str:
    mem, sent, seen = c["memory"], c["sent"], c["unsharded"]
    fs, ep = c["verdicts"]["fully_shard vs DDP"], c["verdicts"]["expert parallel vs experts replicated"]
    per_core = f"{w} ranks on {cores} cores" + (" (oversubscribed)" if w > cores else "")
    return (
        f"- **W = {w}** ({per_core}, 1 thread per rank): between steps `fully_shard` holds "
        f"{_ratio(mem['fully_shard']['params'], mem['DDP']['params']):.2f} of DDP's parameters, gradients and Adam "
        f"state per rank ({_state(mem['fully_shard']):,} vs {_state(mem['DDP']):,} B); in the step each layer also "
        f"holds its full parameters and a full-size gradient for a moment (the largest layer: {max(seen.values()):,} B "
        f"each, not in the bars). It sends {_ratio(sent['fully_shard'], sent['DDP']):.2f}x DDP's bytes per step "
        f"({sent['fully_shard']:,.0f} vs {sent['DDP']:,.0f} B; the ring minima are {c['minimum']['fully_shard']:,.0f} "
        f"vs {c['minimum']['DDP']:,.0f} B), and its step is {WORD[fs['verdict']]} DDP's: {fs['ms'][0]:.2f} vs "
        f"{fs['ms'][1]:.2f} ms (mean of {fs['n']} round medians, difference 95% CI [{fs['ci'][0]:.2f}, "
        f"{fs['ci'][1]:.2f}] ms, Welch p = {fs['p']:.2g}). Both `replicate`s hold and send what DDP does "
        f"({sent['replicate']:,.0f} and {sent['replicate (FSDP2)']:,.0f} B, checked above). Expert parallelism holds "
        f"{_ratio(mem[EP]['params'], mem[REP]['params']):.2f} of the replicated MoE's parameters per rank and sends "
        f"{_ratio(sent[EP], sent[REP]):.2f}x its bytes (the all-to-all of tokens replaces the all-reduce of expert "
        f"gradients); its step is {WORD[ep['verdict']]} the replicated one's: {ep['ms'][0]:.2f} vs {ep['ms'][1]:.2f} "
        f"ms (Welch p = {ep['p']:.2g}).")


def costs_verdict(R: dict) -> str:
    """Section 5's verdict: memory, bytes and step time of `fully_shard` against DDP and of expert parallelism
    against replicated experts, per world size."""
    faster = [w for w, c in R["costs"].items() if c["verdicts"]["fully_shard vs DDP"]["verdict"] == "ahead"]
    head = (f"Preset **{R['preset']}**. " + (f"`fully_shard` was faster than DDP at W = {faster}. " if faster else
                                             "`fully_shard` saved memory at every W here and was faster at none. ")
            + "*Hypothesis*, not tested here: on models this small a step is dominated by fixed per-message costs, "
              "and `fully_shard` sends more messages (an all-gather per layer in forward and backward, then a "
              "reduce-scatter) than DDP's single bucketed all-reduce.")
    return head + "\n\n" + "\n".join(_costs_at(w, c, R["cores"]) for w, c in R["costs"].items())


def record_comparison(R: dict) -> str:
    """This run's step-time verdicts beside the recorded full run's, and whether the counted numbers agree."""
    rec = R["record"]
    if rec is None:
        return f"No full-preset record `{RECORD}` in `benchmarks/results/` yet: run the chapter with `LAB_PRESET=full`."
    rows = []
    for w, c in R["costs"].items():
        for what, mine in c["verdicts"].items():
            theirs = rec["verdicts"][str(w)][what]
            agree = "agree" if mine["verdict"] == theirs["verdict"] else "**disagree**"
            rows.append(f"| {w} | {what} | {mine['verdict']} (p = {mine['p']:.2g}) | {theirs['verdict']} "
                        f"(p = {theirs['p']:.2g}) | {agree} |")
    n_dis = sum("disagree" in r for r in rows)
    return (f"| W | step time | this run ({R['preset']}) | recorded full run ({rec['date']}, {rec['cores']} cores) "
            "| |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
            + (f"The presets disagree on {n_dis} of {len(rows)} step-time verdicts: at these sizes and on a shared "
               "machine, a step-time verdict is a property of one run, not of the method. " if n_dis else
               "The two presets agree on every step-time verdict. ")
            + f"Memory and bytes are counted, not timed: for the dense modes (W = {', '.join(map(str, R['costs']))}) "
            + ("this run's equal the record's (memory exactly, bytes within 5%)." if not rec["differ"] else
               f"this run's differ from the record's: {rec['differ']}."))


def collectives(R: dict) -> str:
    """What one all-reduce, all-gather and reduce-scatter sent on gloo, and `fully_shard`'s bytes predicted from it."""
    lines = []
    for w, c in R["costs"].items():
        cb = c["collectives"]
        lines.append(f"- W = {w}: " + ", ".join(f"{k} sent {v['sent']:,} B (ring minimum {v['ring minimum']:,.0f})"
                                                for k, v in cb.items() if k != "tensor bytes")
                     + f"; gloo's reduce-scatter sent {cb['reduce_scatter']['sent'] / cb['all_reduce']['sent']:.2f}x "
                       "what its all-reduce of the whole tensor sent.")
        lines.append(f"  Predicted from these rates for `fully_shard` (two all-gathers and a reduce-scatter of "
                     f"{c['memory']['DDP']['params']:,} B): {c['fully_shard predicted']:,.0f} B per step; counted: "
                     f"{c['sent']['fully_shard']:,.0f} B.")
    rs_is_allreduce = all(abs(c["collectives"]["reduce_scatter"]["sent"] - c["collectives"]["all_reduce"]["sent"])
                          <= 0.02 * c["collectives"]["all_reduce"]["sent"] for c in R["costs"].values())
    tensor_b = R["costs"][min(R["costs"])]["collectives"]["tensor bytes"]
    if rs_is_allreduce:
        why = ("On gloo a reduce-scatter costs a whole all-reduce, not the `(W-1)/W` a ring reduce-scatter needs: "
               "`fully_shard` pays two all-gathers plus one all-reduce-sized exchange per step. The counted bytes are "
               + " and ".join(f"{c['sent']['fully_shard'] / c['fully_shard predicted']:.2f}x"
                              for c in R["costs"].values())
               + f" the prediction from the {tensor_b:,} B rates at W = " + " and ".join(map(str, R["costs"]))
               + "; *hypothesis*: the remainder is gloo's framing of the smaller per-layer messages. NCCL has a true "
               "reduce-scatter (`ncclReduceScatter`), so this count does not carry over to GPUs.")
    else:
        why = "On this run gloo's reduce-scatter did not cost an all-reduce; compare the rows above."
    return f"Preset {R['preset']}, one {tensor_b:,} B tensor:\n\n" + "\n".join(lines) + "\n\n" + why


def trap(R: dict) -> str:
    """The oversubscription trap: DDP's step with a thread per core on every rank against one thread per rank."""
    cores, many, one, v = R["cores"], R["trap_ms"][R["cores"]], R["trap_ms"][1], R["trap"]
    verdict = {"behind": f"the oversubscribed run is slower (Welch p = {v['p']:.2g}).",
               "ahead": f"here the extra threads were faster (Welch p = {v['p']:.2g}); the trap did not show on this "
                        "machine at this size.",
               "inconclusive": f"no difference this run could resolve (Welch p = {v['p']:.2g}); on a busy machine the "
                               "spread hides it."}[v["verdict"]]
    return (f"DDP, 2 ranks on {cores} cores, preset {R['preset']}: {cores} threads per rank give a median step of "
            f"{statistics.median(many):.2f} ms [{min(many):.2f}-{max(many):.2f}], 1 thread per rank "
            f"{statistics.median(one):.2f} ms [{min(one):.2f}-{max(one):.2f}]: " + verdict
            + (" With one core per rank or fewer, 1 thread per rank is the setting that cannot oversubscribe."
               if cores <= 2 else ""))


def summary(R: dict) -> str:
    """The chapter's summary list."""
    gap, w_lo, w_hi = R["ep_gap"], min(R["costs"]), max(R["costs"])
    hi = R["costs"][w_hi]
    matched = R["ddp_worst"] <= R["atol"]
    synced = gap["after"] == 0 and gap["after, broadcast off"] > 0
    return "\n".join([
        f"Preset **{R['preset']}**, generated from this run:",
        "",
        "- DDP, both `replicate()`s and `fully_shard()` compute the gradient of the **global** batch: with equal "
        "rank slices and a mean loss, the data-parallel model "
        + ("matched" if matched else "did NOT match")
        + f" the local model (largest parameter difference {R['ddp_worst']:.1e} for DDP, "
        f"{'within' if matched else 'beyond'} `rtol={R['rtol']:g}, atol={R['atol']:g}`), and the ranks were shown to "
        "train on disjoint slices: parity alone passes whole-batch training on every rank, the slices check does not.",
        "- `replicate()` is DDP without the wrapper: identical `state_dict` keys, per-submodule application, DDP "
        "options pass through, and `ignored_modules` keeps chosen gradients local. torch 2.13 also ships an "
        "FSDP2-based `replicate` (`Replicate()` DTensors on a mesh); both live in the private "
        "`torch.distributed._composable`.",
        "- `fully_shard()` stores a `Shard(0)` `DTensor` per parameter and runs on CPU/gloo with "
        "`init_device_mesh(\"cpu\", ...)`; each feature row of section 3's table was run; on a wrong (1-rank) mesh it "
        "no longer matches DDP.",
        "- For an MoE, a parameter's *name* no longer identifies its *value* across ranks. Tag expert parameters; "
        "average dense gradients over the data-parallel group; reduce expert gradients only over ranks holding the "
        "same expert and divide by the data-parallel size (DeepSpeed) to match single-process training; fastmoe keeps "
        f"the sum. The start-up broadcast made replicas that started {gap['before']:g} apart "
        + (f"equal (gap {gap['after']:g}); switched off, the gap stayed {gap['after, broadcast off']:g} and the "
           "gradients were wrong." if synced else
           f"{gap['after']:g} apart after the wrap, and {gap['after, broadcast off']:g} with it switched off: the "
           "broadcast did not make them equal."),
        f"- Costs at W = {w_lo} and {w_hi}: see the verdict of section 5 (`fully_shard` holds "
        f"{_ratio(hi['memory']['fully_shard']['params'], hi['memory']['DDP']['params']):.2f} of DDP's state per rank "
        f"between steps at W = {w_hi}, plus each layer's full parameters and gradient in the step, and sends "
        f"{_ratio(hi['sent']['fully_shard'], hi['sent']['DDP']):.2f}x its bytes).",
    ])
