"""One MoE problem, every dispatch design side by side. (Taught in chapter 08.)

* :func:`measure_point` times a forward+backward of each design of :mod:`labbook.perf.dispatch` on the same
  problem, interleaved, with its peak memory and the share of choices it kept.
* :func:`check_against_loop`: before any timing, each design's output and gradients against the naive loop's;
  :func:`output_and_grads`: one design's output and every gradient (input, logits, expert weights), to compare.
* :func:`format_rows` and :func:`format_waits`: a point's rows as the chapter's table, and its waits per step.

Where the core's time goes is :mod:`labbook.perf.breakdown`; the verdicts on a live run against its record
are :mod:`labbook.perf.verdicts`.
"""
from __future__ import annotations

from .timing import MIN_ROUNDS, bench, paired_ratio, peak_memory, quartiles, run_conditions, summarize

__all__ = ["measure_point", "check_against_loop", "output_and_grads", "ORDER", "format_rows", "format_waits"]

ORDER = ["loop", "core", "padded", "grouped_mm", "einsum", "ds_cf1", "ds_cf2", "separate", "dense"]  # table order


LOOP_RTOL, LOOP_ATOL = 1e-4, 1e-5  # float32 sums in another order; a lost expert's rows miss by O(1)


def check_against_loop(p, outs: dict, grads: dict, rtol: float = LOOP_RTOL, atol: float = LOOP_ATOL) -> dict:
    """Each design's output and input/logit gradients against the naive loop's on the SAME problem:
    ``{name: {"equal_to_loop": bool, "max_abs_diff": float, "compared_tokens": int}}``.

    ``outs[name]`` is the design's :class:`~labbook.perf.dispatch.DispatchOut`, ``grads[name]`` its
    ``(x.grad, logits.grad)`` (None for the references, which run other weights and are not compared). A design
    that drops choices (``out.dropped``) is compared on the tokens it kept whole, its gradients not at all.
    """
    from labutils.compare import compare_tensors

    ref, (ref_gx, ref_gl) = outs["loop"], grads["loop"]
    res = {}
    for name, out in outs.items():
        if grads.get(name) is None:
            continue
        if out.dropped is not None and bool(out.dropped.any()):
            whole = ~out.dropped                                           # (T,) tokens with every choice kept
            diffs = [compare_tensors(f"{name} y", out.y[whole], ref.y[whole], rtol=rtol, atol=atol)]
            n = int(whole.sum())
        else:
            gx, gl = grads[name]
            diffs = [compare_tensors(f"{name} y", out.y, ref.y, rtol=rtol, atol=atol),
                     compare_tensors(f"{name} x.grad", gx, ref_gx, rtol=rtol, atol=atol),
                     compare_tensors(f"{name} logits.grad", gl, ref_gl, rtol=rtol, atol=atol)]
            n = p.T
        res[name] = {"equal_to_loop": all(d.close for d in diffs), "max_abs_diff": max(d.max_abs for d in diffs),
                     "compared_tokens": n}
    return res


def measure_point(p, names=None, reps: int = 5, memory: bool = True, device="cpu", budget_s: float | None = None,
                  limit: str = "dense", designs: dict | None = None, strict: bool = True,
                  min_rounds: int = MIN_ROUNDS) -> list:
    """Time one forward+backward of each design on problem ``p`` (interleaved) and measure its peak memory.

    Before timing, every design's output and gradients are checked against the naive loop's on this very problem
    (:func:`check_against_loop`: the loop runs once even when it is not timed): ``strict`` raises AssertionError
    naming the design and the size when one differs, so no timed size goes unchecked.

    Returns one dict per design: median (with IQR) and best seconds, tokens/s and useful GFLOP/s at the median,
    ``ratio`` (the paired median over interleaved rounds of reference time / design time, so 1.0 = as fast as
    the ``limit`` row, a dense MLP of the same FLOPs by default; ``ratio_iqr`` its IQR; ``ratios`` every
    round's; a reference, which designs may beat), ``ratio_separate`` (the same against the E separate MLPs),
    ``kept`` (share of the T*k choices the experts received), ``rows`` (rows computed / (T*k): above 1 is
    padding), ``equal_to_loop``/``max_abs_diff``, ``wait_share`` (median over rounds of 1 - clock time / wall
    time: with one thread, time the step spent not running), ``voluntary_switches`` and ``involuntary_switches``
    (median per step, :func:`~labbook.perf.timing.context_switches`: which of the two that time was, sleeping or
    waiting vs preempted by other processes), ``times_s``/``walls_s`` (every round's clock and wall seconds, so a
    reader can recompute each summary), ``y_sum``/``y_abs_sum`` (float64 sums of the output this very run
    computed, None for the references: a record cannot stand in for a live run), ``peak_mb`` and ``conditions``
    (:func:`~labbook.perf.timing.run_conditions`). ``designs`` passes prebuilt designs (e.g. a patched one).
    A design that raises is reported as ``{"design", "error"}`` instead.
    """
    from .dispatch import build_designs
    from .problem import fwd_bwd

    designs = dict(build_designs(p, names) if designs is None else designs)
    for extra in ("dense", "separate"):
        if extra not in designs:
            designs.update(build_designs(p, [extra]))
    outs, grads, failed = {}, {}, []
    checked = dict(designs)
    if "loop" not in checked:
        checked["loop"] = build_designs(p, ["loop"])["loop"]
    for n, fn in checked.items():  # warm-up, the kept/rows counts, and the outputs checked against the loop
        try:
            outs[n] = fwd_bwd(fn, p)
        except Exception as exc:  # e.g. a kernel this device lacks: reported, not fatal
            if n in ("dense", "separate", "loop"):
                raise
            failed.append({"design": n, "error": f"{type(exc).__name__}: {exc}"[:300]})
            designs.pop(n, None)
            continue
        grads[n] = None if n in ("dense", "separate") else (p.x.grad.clone(), p.logits.grad.clone())
    equal = check_against_loop(p, outs, grads)
    wrong = [f"{n} (max |diff| {v['max_abs_diff']:.3g})" for n, v in equal.items() if not v["equal_to_loop"]]
    if wrong and strict:
        raise AssertionError(f"at T={p.T} E={p.E} k={p.top_k} d={p.d} h={p.h}, these designs differ from the naive "
                             f"loop: {', '.join(wrong)}")
    wall: dict = {}
    switches: dict = {}
    times = bench({n: (lambda fn=fn: fwd_bwd(fn, p)) for n, fn in designs.items()}, reps=reps, warmup=0,
                  device=device, budget_s=budget_s, wall=wall, switches=switches)
    cond = run_conditions(len(times[limit]), min_rounds, device)
    rows = []
    for n in designs:
        s = summarize(times[n])
        ratio, ratio_iqr = paired_ratio(times[limit], times[n])
        row = {"design": n, **s, "tokens_per_s": p.T / s["median_s"], "gflops": p.flops() / s["median_s"] / 1e9,
               "ratio": ratio, "ratio_iqr": ratio_iqr, "ratios": [r / t for r, t in zip(times[limit], times[n])],
               "ratio_separate": paired_ratio(times["separate"], times[n])[0],
               "kept": outs[n].kept / (p.T * p.top_k), "rows": outs[n].rows / (p.T * p.top_k),
               "wait_share": quartiles([max(0.0, 1.0 - c / w) if w > 0 else 0.0
                                        for c, w in zip(times[n], wall[n])])[1],
               "voluntary_switches": quartiles([v for v, _ in switches[n]])[1],
               "involuntary_switches": quartiles([i for _, i in switches[n]])[1],
               "times_s": list(times[n]), "walls_s": list(wall[n]),
               "y_sum": None if grads.get(n) is None else float(outs[n].y.detach().double().sum()),
               "y_abs_sum": None if grads.get(n) is None else float(outs[n].y.detach().double().abs().sum()),
               "conditions": cond, **equal.get(n, {})}
        if memory:
            p.zero_grad()  # free the previous design's gradients before the measurement starts
            row["peak_mb"] = peak_memory(lambda fn=designs[n]: fwd_bwd(fn, p), device) / 2 ** 20
        rows.append(row)
    return rows + failed


def output_and_grads(fn, p) -> tuple:
    """One forward+backward of design ``fn`` on ``p``: ``(DispatchOut, {"x", "logits", "w1", "b1", "w2", "b2"})``,
    the gradients cloned; a design that owns its weights (the core, DeepSpeed's layer) gives them in the problem's
    layout (``expert_grads``)."""
    from .problem import fwd_bwd

    out = fwd_bwd(fn, p)
    g = {"x": p.x.grad.clone(), "logits": p.logits.grad.clone()}
    g.update(fn.expert_grads() if hasattr(fn, "expert_grads") else
             {k: getattr(p, k).grad.clone() for k in ("w1", "b1", "w2", "b2")})
    return out, g


def format_rows(rows: list) -> str:
    """A point's rows (:func:`measure_point`) as a table in :data:`ORDER`: median ms and IQR, GFLOP/s, the paired
    ratio to dense with its IQR, kept, rows, wait share, voluntary / involuntary switches per step, peak MB."""
    lines = [f"{'design':<11}{'median ms':>10}{'IQR':>6}{'GFLOP/s':>9}{'ratio [IQR]':>20}{'kept':>6}{'rows':>6}"
             f"{'wait':>6}{'sleeps':>7}{'preempt':>8}{'peak MB':>9}"]
    for r in sorted((r for r in rows if "error" not in r), key=lambda r: ORDER.index(r["design"])):
        lo, hi = r["ratio_iqr"]
        lines.append(f"{r['design']:<11}{r['median_s'] * 1e3:>10.1f}{r['iqr_pct']:>5.0f}%{r['gflops']:>9.1f}"
                     f"{r['ratio']:>7.2f} [{lo:.2f}-{hi:.2f}]{r['kept']:>6.2f}{r['rows']:>6.2f}"
                     f"{r.get('wait_share', 0):>6.2f}{r.get('voluntary_switches', float('nan')):>7.0f}"
                     f"{r.get('involuntary_switches', float('nan')):>8.0f}{r.get('peak_mb', float('nan')):>9.1f}")
    return "\n".join(lines)


def format_waits(rows: list, what: str) -> str:
    """Per number of experts, each design's wait beyond its CPU time (ms) and its voluntary / involuntary context
    switches per step (medians over rounds): sleeping or waiting, or preempted by another process."""
    from statistics import median

    def wait_ms(r):
        return 1e3 * median(w - t for w, t in zip(r["walls_s"], r["times_s"]))

    return "\n".join(f"   {what}, E={E}: wait ms / voluntary / involuntary switches per step (medians): " + ", ".join(
        f"{r['design']} {wait_ms(r):.1f}/{r['voluntary_switches']:.0f}/{r['involuntary_switches']:.0f}"
        for r in rows if r["num_expert"] == E) for E in dict.fromkeys(r["num_expert"] for r in rows
                                                                       if r["design"] == "dense"))
