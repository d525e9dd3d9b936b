"""Chapter 08's faults: each names the check cell that must catch it. (See ``labbook.faults``.)

Issue 38's items for this chapter: an inverted ratio column, a flipped target verdict, inflated peak memory, wrong
FLOPs, a sweep served from the stored record, a step that sleeps 3 ms (judged at any load), and verdicts that call
one sitting's recordings separate runs or drop the margin. Issue 39 moved the chapter's helpers into
``labbook/perf`` (the phase sums and the cuts' calls: ``step_phases.py``; the profile against its record:
``breakdown.shifted_phases``): their faults edit the library.
"""
from labbook.faults import Edit, Fault

SETUP, HARNESS, SAME, AT_SIZE, MM = "24ee5939", "236c283a", "01ecc00a", "980abfec", "a962ff6a"
SWEEP, LIVE, MEMORY, RECORD, WAIT = "ba3b0300", "c08live01", "c08live02", "9d4754b4", "c08wait01"
PRIMARY, BD_LIVE, BD_CHECK, COMM = "ce7a8796", "1821181b", "dba50e5d", "49c03793"
SAID1, SAID3, SAID5, REC_CHECK = "8bf44dfd", "bdc3d928", "7e4d1dca", "6d064143"
SPEED, LAYERS, LAYER_VERDICTS, RULE, FIXED, STEP, CUTS = (
    "d6471dbb", "7a34bda5", "c08layer1", "c08rule01", "9000d8e7", "c2effe09", "7c091134")

LIVE_CELLS = (SETUP, SWEEP, LIVE)
VERDICT_CELLS = (SETUP, PRIMARY, SAID1, SAID3, SPEED, LAYERS, LAYER_VERDICTS, RULE)

FAULTS = [
    Fault("the harness cost taken the wrong way round (own time over fed time)", check=HARNESS,
          expect="the harness cost is real",
          edits=(Edit(HARNESS, "fed_over_own = [f / o for o, f in zip(", "fed_over_own = [o / f for o, f in zip("),),
          cells=(SETUP, HARNESS)),
    Fault("padded combines each token's two choices with each other's scores", check=SAME,
          expect="padded equals the naive loop",
          library=(Edit("labbook/perf/dispatch.py", "y = combine(gather(out[expert, slot], pos, idx.numel()), score)",
                        "y = combine(gather(out[expert, slot], pos, idx.numel()), score.flip(1))"),),
          cells=(SETUP, SAME)),
    Fault("the sweep's check against the loop has an absolute tolerance of 10", check=AT_SIZE,
          expect="negative control: above T=200",
          library=(Edit("labbook/perf/sweep.py", "LOOP_RTOL, LOOP_ATOL = 1e-4, 1e-5",
                        "LOOP_RTOL, LOOP_ATOL = 1e-4, 10.0"),),
          cells=(SETUP, AT_SIZE)),
    Fault("the live sweep served from the stored record", check=LIVE, expect="equals a loop written out here",
          edits=(Edit(SWEEP, "rows = measure_point(p, list(D.DESIGNS), reps=cfg.reps)",
                      'rows = [r for r in records.load(f"dispatch_live_{PRESET}_1thread.json")["rows"] '
                      'if r["num_expert"] == E]'),),
          cells=LIVE_CELLS),
    Fault("the ratio column inverted (design time over dense time)", check=LIVE, expect="the ratio column is",
          library=(Edit("labbook/perf/sweep.py", "ratio, ratio_iqr = paired_ratio(times[limit], times[n])",
                        "ratio, ratio_iqr = paired_ratio(times[n], times[limit])"),),
          cells=LIVE_CELLS),
    Fault("FLOPs of the forward only (4*T*k*d*h)", check=LIVE, expect="GFLOP/s is",
          library=(Edit("labbook/perf/problem.py", "return 12.0 * self.T * self.top_k",
                        "return 4.0 * self.T * self.top_k"),),
          cells=LIVE_CELLS),
    Fault("peak memory counts frees as allocations (inflated)", check=MEMORY, expect="peak memory:",
          library=(Edit("labbook/perf/timing.py", "        current += nbytes\n", "        current += abs(nbytes)\n"),),
          cells=(SETUP, SWEEP, MEMORY)),
    Fault("compare_ratios tests the live rounds against themselves", check=RECORD,
          expect="negative control: grouped_mm doing its matmuls four times",
          library=(Edit("labbook/perf/verdicts.py", "b = [math.log(r) for r in recorded]",
                        "b = [math.log(r) for r in live]"),),
          cells=(SETUP, SWEEP, RECORD)),
    Fault("a grouped_mm step that sleeps 3 ms (a debugging pause left in)", check=WAIT,
          expect="live sweep: no design sleeps or waits",
          library=(Edit("labbook/perf/dispatch.py",
                        "    idx, score = route(p.logits, p.top_k)\n    return DispatchOut(grouped_moe(",
                        "    idx, score = route(p.logits, p.top_k)\n    __import__('time').sleep(0.003)\n"
                        "    return DispatchOut(grouped_moe("),),
          cells=(SETUP, SWEEP, WAIT)),
    Fault("the profiler-overhead limit raised to 90%", check=BD_CHECK, expect="negative control: an 83% overhead",
          library=(Edit("labbook/perf/breakdown.py", "limit: float = 0.5,", "limit: float = 0.9,"),),
          cells=(SETUP, SWEEP, RECORD, PRIMARY, BD_LIVE, BD_CHECK)),
    Fault("a phase that vanished from the profile not counted as shifted", check=BD_CHECK,
          expect="negative control: the combine charged to expert compute",
          library=(Edit("labbook/perf/breakdown.py",
                        'if v["call"] == "vanished" or (v["call"] == "moved" and both_ok)]',
                        'if v["call"] == "moved" and both_ok]'),),
          cells=(SETUP, SWEEP, RECORD, PRIMARY, BD_LIVE, BD_CHECK)),
    Fault("the first primary recording read twice", check=REC_CHECK, expect="distinct recordings",
          edits=(Edit(PRIMARY, 'for t in ("r1", "r2")', 'for t in ("r1", "r1")'),),
          cells=(SETUP, MM, PRIMARY, BD_LIVE, COMM, SAID1, SAID5, REC_CHECK)),
    Fault("a flipped target verdict (ahead reads NOT met)", check=RULE, expect="every verdict of sections 8 and 9",
          library=(Edit("labbook/perf/verdicts.py", 'lean = "met" if side == "ahead" else "NOT met"',
                        'lean = "NOT met" if side == "ahead" else "met"'),),
          cells=VERDICT_CELLS),
    Fault("recordings minutes apart read as hours apart (separate runs)", check=RULE,
          expect="every verdict of sections 8 and 9",
          library=(Edit("labbook/perf/verdicts.py", "gaps = [(b - a).total_seconds() / 3600",
                        "gaps = [(b - a).total_seconds() / 60"),),
          cells=VERDICT_CELLS),
    Fault("one sitting's recordings called without the margin", check=RULE, expect="every verdict of sections 8 and 9",
          library=(Edit("labbook/perf/verdicts.py", "wide = [speed_call(r, target, margin=margin, alpha=alpha)",
                        "wide = [speed_call(r, target, margin=0.0, alpha=alpha)"),),
          cells=VERDICT_CELLS),
    Fault("DeepSpeed's share read as 1.0 instead of from its gate", check=SPEED, expect="shares come from the routing",
          library=(Edit("labbook/perf/layer_bench.py", "seen.update(share=_ds_share(out, k))",
                        "seen.update(share=1.0)"),),
          cells=(SETUP, SPEED)),
    Fault("round_ratios inverted (b over a)", check=FIXED, expect="the core's fixed cost per step",
          library=(Edit("labbook/perf/verdicts.py", 'return [(a["share"] / ta) / (b["share"] / tb)',
                        'return [(b["share"] / tb) / (a["share"] / ta)'),),
          cells=(SETUP, FIXED)),
    Fault("the phase sums checked within 50%", check=STEP, expect="negative control: a record missing a phase",
          library=(Edit("labbook/perf/step_phases.py", "def phase_sums_hold(phases: dict, tol: float = 0.05)",
                        "def phase_sums_hold(phases: dict, tol: float = 0.5)"),),
          cells=(SETUP, STEP)),
    Fault("the cuts judged are the ones labutils did not adopt", check=CUTS, expect="every adopted cut is faster",
          library=(Edit("labbook/perf/step_phases.py", 'for n, r in record["cuts"].items() if r["adopted"]}',
                        'for n, r in record["cuts"].items() if not r["adopted"]}'),),
          cells=(SETUP, CUTS)),
]
