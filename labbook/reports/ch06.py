"""Chapter 06's paragraphs and tables, written from its results dict ``R`` (see :mod:`labbook.reports`).

Each function reads only the keys it names; a missing key is a ``KeyError`` naming it. The chapter checks every
number before it is narrated here: these functions only say what was measured.
"""
from __future__ import annotations

MODES = ("cf 1.0", "cf 2.0", "drop_tokens=False")  # DeepSpeed's buffers, section 4


def _table(head: list, rows: list, left: int = 1) -> str:
    """A Markdown table: ``head`` the column names, ``rows`` lists of cells (already formatted); the first ``left``
    columns aligned left (names), the others right (numbers)."""
    lines = [head, ["---"] * left + ["---:"] * (len(head) - left), *rows]
    return "\n".join("| " + " | ".join(str(c) for c in row) + " |" for row in lines)


def _names(items: list) -> str:
    return ", ".join(repr(b) for b in items)


# -- section 4: who sends what, the wire, the two minimums, DeepSpeed's buffers ---------------------------------
def receivers(R: dict) -> str:
    """The rows each rank's experts receive, and what the imbalance costs the all-to-all."""
    got = R["received"]
    mean = sum(got) / len(got)
    text = f"Rows each rank's experts receive: {got}. "
    if max(got) == min(got):
        return text + ("Every rank's experts receive the same number of rows, so no rank's all-to-all waits for a "
                       f"busier one ({R['preset']} preset).")
    return text + (f"The busiest receiver (rank {got.index(max(got))}) gets {max(got) / mean:.2f}x the mean and the "
                   f"quietest {min(got) / mean:.2f}x, with a fresh random gate ({R['preset']} preset). The busiest "
                   "rank computes and receives most, and the all-to-all finishes only when it is done: the load "
                   "imbalance of chapter 01, seen from the network.")


def wire_table(R: dict) -> str:
    """Per rank: the three wire counts of the first repeat (every repeat's call), against the routed rows."""
    rows = [[r, f"{w['control']:,}", f"{w['fixed']:,}", "/".join(f"{c:,}" for c in w["calls"]),
             f"{w['call'] - w['fixed']:,}", f"{w['routed']:,}"] for r, w in enumerate(R["wire"])]
    return _table(["rank", "control", "fixed", "call, each repeat", "call - fixed", "routed rows, 2 trips"], rows)


def two_minimums(R: dict) -> str:
    """The per-choice and the deduplicated minimum under top-2, and which one the wire reached."""
    wire, dup, off = R["on_wire"] // 2, R["dup_rows"], R["off_rows"]
    text = (f"**Two minimums** ({R['preset']} preset). One row per (token, expert) choice: {R['per_choice']:,} B per "
            f"direction over all ranks. One row per (token, remote rank): {R['dedup']:,} B, because {dup} of the "
            f"{off} off-rank rows ({100 * dup / max(off, 1):.1f}%) are a token's second trip to a rank it already "
            "reaches. ")
    if wire == R["per_choice"] != R["dedup"]:
        return text + (f"The lab's exchange, like FastMoE's, reaches the first: the wire carried {wire:,} B per "
                       f"direction, {dup * R['row_bytes']:,} B per direction above what a deduplicating exchange "
                       "would send.")
    if wire == R["dedup"]:
        return text + (f"The wire carried {wire:,} B per direction: the exchange reaches the second, deduplicating "
                       "minimum, and sends no token twice to the same rank.")
    return text + f"The wire carried {wire:,} B per direction, neither minimum."


def ds_table(R: dict) -> str:
    """Per rank: off-rank rows, both minimums, and DeepSpeed's dispatch bytes in each mode; totals, C and drops."""
    W = len(R["off_rank"])
    rows = [[r, R["off_rank"][r], f"{R['per_choice_rank'][r]:,}", f"{R['dedup_rank'][r]:,}",
             *(f"{R['ds'][m]['bytes'] // W:,}" for m in MODES)] for r in range(W)]
    rows.append(["total", sum(R["off_rank"]), f"{R['per_choice']:,}", f"{R['dedup']:,}",
                 *(f"{R['ds'][m]['bytes']:,}" for m in MODES)])
    return (_table(["rank", "off-rank rows", "per choice", "dedup", *(f"DS {m}" for m in MODES)], rows)
            + "\n\ncapacity C per expert per rank: " + ", ".join(f"{m} {R['ds'][m]['C']}" for m in MODES)
            + f"; rows DeepSpeed drops, of {R['routed_rows']}: "
            + ", ".join(f"{m} {R['ds'][m]['dropped']}" for m in MODES) + "; the lab's exchange drops none.")


def _dropped(n: int, of: int) -> str:
    return f"drops {n} of {of} rows ({100 * n / of:.0f}%)" if n else "drops nothing"


def deepspeed(R: dict) -> str:
    """DeepSpeed's padded buffers against the exact exchange, with and without ``drop_tokens``."""
    ds, need, of = R["ds"], R["per_choice"], R["routed_rows"]
    one, two, free = ds["cf 1.0"], ds["cf 2.0"], ds["drop_tokens=False"]
    cut = (f"{_dropped(one['dropped'], of)} on busy experts while padding {one['padding']} slots of idle ones"
           if one["dropped"] else f"{_dropped(0, of)}, padding {one['padding']} slots")
    return (f"**DeepSpeed against the exact exchange** ({R['preset']} preset, {R['world']} ranks, {R['tokens']} tokens "
            f"and {R['experts']} experts). With `drop_tokens=True` the buffer has the same size on every rank "
            f"whatever the routing: at capacity factor 1.0 (C = {one['C']}) DeepSpeed sends {one['bytes']:,} B, "
            f"{one['bytes'] / need:.2f}x the per-choice minimum, and {cut}; at 2.0 (C = {two['C']}) it sends "
            f"{two['bytes']:,} B ({two['bytes'] / need:.2f}x) and {_dropped(two['dropped'], of)}. With "
            f"`drop_tokens=False`, C = {free['C']} (the busiest rank-expert pair): nothing is dropped, and it sends "
            f"{free['bytes']:,} B ({free['bytes'] / need:.2f}x), an amount set by this batch's routing. The exact "
            f"exchange sends what the routing needs ({need:,} B) and drops nothing; its price is one extra small "
            "all-to-all (the counts) and a host synchronisation to read them, the latency FastMoE accepts. DeepSpeed "
            "without drops pays a similar price: the all-reduce of C before its buffers can be sized.")


# -- section 5: gradient bugs ---------------------------------------------------------------------------------------
def bug_table(R: dict) -> str:
    """Per (setting, bug): final loss, the gradient check, the Adam-update check, the curve against the correct one."""
    rows = []
    for b in R["bugs"]:
        grad = (f"fails on {', '.join(b['failed'])}" if b["failed"] else "passes") + f" (rel {b['rel']:.1e})"
        adam = f"fails on {', '.join(b['adam_failed'])}" if b["adam_failed"] else "passes"
        half = "" if b["bug"] == "correct" else f"{b['late']:.3f}"
        lower = "" if b["bug"] == "correct" else f"{b['lower_steps']} of {b['steps']}"
        rows.append([b["setting"], b["bug"], f"{b['final']:.4f}", f"{b['vs_correct']:+.1%}", grad, adam, half, lower])
    steps = R["bugs"][0]["steps"]
    head = ["setting", "bug", "final loss", "vs correct", "gradient check", "Adam-update check",
            f"loss / correct, median of steps {steps // 2}-{steps}", "steps below the correct run"]
    return _table(head, rows, left=2)


def bug_lessons(R: dict) -> str:
    """What the loss curves show against what the gradient check shows."""
    bugs = [b for b in R["bugs"] if b["bug"] != "correct"]
    gap = [abs(b["late"] - 1) for b in bugs]
    faster = [b["bug"] for b in bugs if b["late"] < 0.99 and b["lower_steps"] > b["steps"] / 2]
    adam_misses = [b["bug"] for b in bugs if not b["adam_failed"]]
    worst_correct = max(b["rel"] for b in R["bugs"] if b["bug"] == "correct")
    text = (f"**What the loss shows and what the checks show** ({R['preset']} preset, {R['bug_steps']} Adam steps). "
            "Every bug trains: its loss falls like the correct one's, and over the second half of training its median "
            f"is {100 * min(gap):.0f}-{100 * max(gap):.0f}% away from the correct run's, so a curve on its own, "
            "without a correct run beside it, does not flag the bug")
    text += (f"; {_names(faster)} even run{'s' if len(faster) == 1 else ''} more than 1% lower (median over the "
             "second half, and lower in most steps). " if faster else ". ")
    text += ("The gradient check fails on every bug and names the group it touched, while the correct synchronisation "
             f"agrees with one process to a relative {worst_correct:.0e}. The smallest relative tolerance that would "
             f"hide a bug is {min(b['rel'] for b in bugs):.2f} (a tolerance the size of the gradients): a tolerance "
             "hides these only when it is loosened to the bug's own size, which is why \"round-off, loosen the "
             "tolerance\" had to be withdrawn. ")
    if adam_misses:
        return text + (f"Comparing one Adam update instead of the gradients misses {_names(adam_misses)}: Adam "
                       "normalises each gradient by its own running size, so a constant scale largely cancels.")
    return text + "Comparing one Adam update instead of the gradients catches them too in this run."


# -- section 6: three ways to move tokens -----------------------------------------------------------------------------
def exchange_verdicts(rec: dict) -> list:
    """One sentence per world size of a token-exchange record: fewest bytes, and the fastest design unless the
    interquartile ranges of the two fastest overlap (then a tie)."""
    lines = []
    for w in sorted(rec["worlds"], key=int):
        per = rec["worlds"][w]
        by_bytes = sorted(per, key=lambda d: per[d]["sent_mean"])
        least = by_bytes[0]
        by_time = sorted(per, key=lambda d: per[d]["step_seconds"]["median"])
        a, b = per[by_time[0]]["step_seconds"], per[by_time[1]]["step_seconds"]
        fast = (f"fastest {by_time[0]} ({a['median'] * 1e3:.1f} ms)" if a["q3"] < b["q1"] else
                f"{by_time[0]} and {by_time[1]} tie on time (IQRs overlap: {a['median'] * 1e3:.1f} vs "
                f"{b['median'] * 1e3:.1f} ms)")
        choices = int(w) * rec["config"]["tokens"] * rec["config"]["k"]
        dropped = "; ".join(f"{d} dropped {per[d]['choices_dropped']} of {choices} expert choices"
                            for d in per if per[d]["choices_dropped"])
        lines.append(f"W = {w}: fewest bytes {least} ({per[least]['sent_mean'] / 1e3:.0f} kB per rank; "
                     + ", ".join(f"{d} {per[d]['sent_mean'] / per[least]['sent_mean']:.2f}x" for d in by_bytes[1:])
                     + f"); {fast}" + (f"; {dropped}" if dropped else "") + ".")
    return lines


def exchange(R: dict) -> str:
    """This run's verdicts (W = 2), then the record's (W = 2, 4, 8) as context, with its code status."""
    live, rec = R["exchange"], R["exchange_record"]
    return (f"This run ({live['config']['experts']} experts, {live['config']['tokens']} tokens per rank): "
            + " ".join(exchange_verdicts(live)) + f"\n\nThe record, as context ({R['record_status']}):\n\n"
            + "\n".join(f"* {line}" for line in exchange_verdicts(rec)))


# -- the chapter's summary ---------------------------------------------------------------------------------------------
def summary(R: dict) -> str:
    """What this run measured, one bullet per section."""
    ds, live, rec = R["ds"], R["exchange"], R["exchange_record"]
    bugs = [b for b in R["bugs"] if b["bug"] != "correct"]
    padded = R["beyond_control"]["with padding"]
    dup = (f"sending each token once per remote rank would take {R['dedup']:,} B ({R['dup_rows']} duplicate rows)"
           if R["dup_rows"] else "no token has two experts on the same remote rank, so there is nothing to "
           "deduplicate")
    worlds = ", ".join(sorted(rec["worlds"], key=int))
    return "\n".join([
        f"* ({R['preset']} preset) {R['world']} gloo workers x {R['experts_per_rank']} experts equal one process with "
        f"all {R['world'] * R['experts_per_rank']}: outputs and every gradient close at atol 1e-5 + rtol 1e-5 (largest "
        f"absolute difference {R['parity_worst']:.1e}), with batch sizes {R['batches']}; and 4 workers with batch "
        f"sizes {R['zero_batches']}, one of them empty ({R['zero_worst']:.1e}). Expert gradients scaled by the EP "
        "size and a router gradient never summed over ranks both fail that check.",
        "* The wire carried exactly the routed rows beyond the control messages "
        f"({R['beyond_control']['as written']:,} B over all ranks for one forward, the same in every repeat, nothing "
        f"through the store); an extra all-to-all of padding raised that to {padded:,} B and failed the check, with "
        "the output and the exchange's record unchanged.",
        f"* Under top-2 the exchange sends one row per choice, {R['per_choice']:,} B per direction; {dup}.",
        f"* Gradient bugs, {R['bug_steps']} Adam steps: losses within "
        f"{100 * max(abs(b['late'] - 1) for b in bugs):.0f}% of the correct run's (median over the second half); "
        f"the one-process gradient check fails on each ({', '.join(b['bug'] for b in bugs)}), on the group it "
        "touched, and passes the correct synchronisation.",
        f"* DeepSpeed's buffers: {ds['cf 1.0']['bytes']:,} B at cf 1.0 with {ds['cf 1.0']['dropped']} rows dropped, "
        f"{ds['cf 2.0']['bytes']:,} B at cf 2.0 with {ds['cf 2.0']['dropped']} dropped, "
        f"{ds['drop_tokens=False']['bytes']:,} B with `drop_tokens=False` (C = {ds['drop_tokens=False']['C']}, set "
        "by the routing) and none dropped.",
        f"* Three ways to move tokens, this run ({live['config']['experts']} experts, {live['config']['tokens']} "
        f"tokens per rank, every design equal to one process and each sending its rows plus at most "
        f"{R['exchange_allowance']:,} B): " + " ".join(exchange_verdicts(live)) + f" Recorded at W = {worlds} "
        f"({rec['config']['experts']} experts, {rec['config']['tokens']} tokens per rank; context only: "
        f"{R['record_status']}): " + " ".join(exchange_verdicts(rec)),
    ])
