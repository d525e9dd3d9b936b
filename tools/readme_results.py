"""The README's result sentences, generated from the recorded numbers (never typed by hand).

    python tools/readme_results.py            # rewrite every <!-- gen:NAME -->...<!-- /gen --> span in README.md
    python tools/readme_results.py --check    # exit 1, listing the spans that differ (tests/test_readme.py runs it)

Each span is produced by one function below from a record under ``benchmarks/results/`` (or ``docs/runtimes.json``
for the chapters' run times, written by ``tools/execute.py --times``), through the same functions the chapters use
for their verdicts, and names the preset or run it came from.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
SPAN = re.compile(r"<!-- gen:(?P<name>[\w.-]+) -->(?P<body>.*?)<!-- /gen -->", re.S)


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def runtime(chapter: str) -> str:
    rec = json.loads((ROOT / "docs" / "runtimes.json").read_text())
    return f"{rec['seconds'][chapter]:.0f} s"


def ch05() -> str:
    from labbook.lm_study import summary

    rec = _load("moe_vs_dense_full.json")
    s = summary.summarize(rec)
    c, sp, eq = s["moe_vs_dense"], s["speedup"], s["equal_time"]["comparison"]
    seeds = s["seeds"]["MoE"]
    steps = rec["config"].get("steps", "?")
    out = (f"the recorded run (preset {s['preset']}, {seeds} seeds, {steps} steps): MoE {c.mean_a:.3f} vs dense "
           f"{c.mean_b:.3f} nats, {c.verdict} (Welch p = {c.p:.3f}, Holm over {c.family} tests)")
    if sp["t_ci"] is not None:
        out += (f"; dense needs {sp['mean']:.2f}× the steps (95% t-interval [{sp['t_ci'][0]:.2f}, "
                f"{sp['t_ci'][1]:.2f}]: the 1.3× target is {summary.target_verdict(sp, 1.3)})")
    if eq is not None:
        out += f"; at equal CPU time MoE is {eq.relation()} (p = {eq.p:.3f})"
    return out


def bench_moe_vs_dense() -> str:
    from labbook.lm_study import summary

    rec = _load("moe_vs_dense_full.json")
    s = summary.summarize(rec)
    f = s["final"]
    w, mw = s["moe_vs_dense"], s["moe_vs_wide"]
    finals = ", ".join(f"{n} {f[n][0]:.3f} ± {f[n][1]:.3f}" for n in ("MoE", "dense", "dense-wide"))
    eq = s["equal_time"]["comparison"]
    out = (f"{rec['wall_seconds'] / 60:.0f} min wall-clock (preset {s['preset']}). Final validation loss {finals} "
           f"nats: MoE vs dense {w.verdict} (95% CI of the gap [{w.ci[0]:.3f}, "
           f"{w.ci[1]:.3f}]), MoE vs dense-wide {mw.verdict} (p = {mw.p:.2f})")
    if eq is not None:
        out += f"; at equal CPU seconds MoE is {eq.relation()} (p = {eq.p:.2g})"
    if "data_limited" in rec:
        dl = summary.summarize(rec["data_limited"])
        out += (f"; data-limited control ({rec['data_limited']['config']['train_chars']:,} characters): MoE vs dense "
                f"{dl['moe_vs_dense'].verdict}, dense-wide vs dense {dl['wide_vs_dense'].verdict}")
    return out


def bench_launch() -> str:
    rows = {(r["world_size"], r["launcher"]): r for r in _load("launch.json")["rows"]}
    w = max(ws for ws, _ in rows)
    t = {name: rows[(w, name)]["seconds_to_first_all_reduce"] for name in ("labutils.launch", "mp.spawn", "torchrun")}
    return (f"{w} ranks: {t['labutils.launch']:.2f} s vs {t['mp.spawn']:.2f} s vs {t['torchrun']:.2f} s, "
            f"{rows[(w, 'labutils.launch')]['ratio_to_torchrun']:.2f}x torchrun (target <= 0.7x)")


def bench_comm() -> str:
    fits = _load("comm.json")["fits"]
    parts = [f"{w} workers ({f['workers_per_core']:.0f} per core): {f['latency_s'] * 1e3:.2f} ms + bytes / "
             f"{f['bandwidth_gb_s']:.2f} GB/s per rank" for w, f in sorted(fits.items(), key=lambda kv: int(kv[0]))]
    return "; ".join(parts)


def bench_full_scale() -> str:
    r = _load("full_scale.json")
    out = (f"{r['parameters'] / 1e6:.0f}M parameters, {r['tokens_per_step']} tokens, {r['threads']} threads: "
           f"{r['median_step_seconds']:.1f} s per training step (median of {len(r['steps'])}: "
           + ", ".join(f"{k} {v:.1f} s" for k, v in r["median_phase_seconds"].items()) + ")")
    theory = r["theory_bytes"]["total"] / 1e9
    return out + f"; peak {r['peak_rss_bytes'] / 1e9:.2f} GB vs {theory:.2f} GB of parameters + gradients + Adam state"


def bench_token_exchange() -> str:
    rec = _load("token_exchange.json")
    worlds = sorted(rec["worlds"], key=int)
    w = worlds[-1]
    per = rec["worlds"][w]
    base = per["fastmoe"]["sent_mean"]
    choices = int(w) * rec["config"]["tokens"] * rec["config"]["k"]
    ratios = ", ".join(f"{d} {per[d]['sent_mean'] / base:.2f}x" + (
        f" (dropping {per[d]['choices_dropped']} of {choices} choices)" if per[d].get("choices_dropped") else "")
        for d in per if d != "fastmoe")
    err = max(max(p["max_error"].values()) for ws in rec["worlds"].values() for p in ws.values())
    paired = rec.get("paired", {})
    answer = {"ahead": "faster", "behind": "slower", "inconclusive": "inconclusive"}
    timed = ("; step time of FastMoE's exchange against ds drop (paired rounds, Holm over W): " + ", ".join(
        f"W = {x} {answer[paired[x]['verdict']]} ({paired[x]['diff_s'] * 1e3:+.1f} ms, 95% CI "
        f"{paired[x]['ci_s'][0] * 1e3:+.1f} to {paired[x]['ci_s'][1] * 1e3:+.1f})" for x in worlds if x in paired)
             if paired else "")
    return (f"every design equals one process (worst {err:.0e}); bytes per rank at W = {w} relative to FastMoE's "
            f"exchange: {ratios}; the all-reduce design's share grows with W "
            + "(" + ", ".join(f"{per_w['all-reduce']['sent_mean'] / per_w['fastmoe']['sent_mean']:.2f}x"
                              for per_w in (rec['worlds'][x] for x in worlds)) + f" at W = {', '.join(worlds)})"
            + timed)


def _against(q1: float, q3: float, target: float) -> str:
    """A ratio's verdict against an upper target from its quartiles over paired rounds."""
    from labbook.perf.verdicts import iqr_verdict

    verdict = iqr_verdict(q1, q3, target)
    return verdict + (" (the target lies inside the IQR)" if verdict == "inconclusive" else "")


def bench_train_step() -> str:
    r = _load("train_step.json")
    q, mem, m = r["moe_over_dense"], r["peak_moe_over_dense"], r["machine"]
    step = _against(q["q1"], q["q3"], 1.2)
    return (f"chapter 05's full configuration ({m['clock']}, load {m['load_avg_1min']:.0f} on {m['cores']} cores): "
            f"MoE step / dense step {q['median']:.2f} [IQR {q['q1']:.2f}-{q['q3']:.2f}] over {r['config']['rounds']} "
            f"paired rounds, target <= 1.20 {step}; peak memory of a step {mem:.2f}x dense's, target <= 1.3 "
            + ("met" if mem <= 1.3 else "NOT met"))


def bench_step_cuts() -> str:
    r = _load("step_cuts.json")
    cuts = [f"{name}: {c['cut_over_plain']['median']:.2f}x [IQR {c['cut_over_plain']['q1']:.2f}-"
            f"{c['cut_over_plain']['q3']:.2f}], " + ("adopted" if c["adopted"] else "not adopted")
            for name, c in r["cuts"].items()]
    return (f"one MoE layer of chapter 05's full configuration, forward + backward (a gate cut timed on the whole "
            f"gate, the experts' on the expert block), cut / plain form over {r['config']['rounds']} paired "
            f"rounds: " + "; ".join(cuts))


def bench_matmul() -> str:
    r = _load("matmul.json")
    sq = {row["n"]: row["gflops"] for row in r["square"]}
    return (f"{sq[max(sq)]:.0f} GFLOP/s for a {max(sq)} square matmul ({r['machine']['torch_threads']} threads, "
            f"{r['machine']['date'][:10]}); the shared machine's speed drifts, so only ratios taken in one run are "
            "compared")


def _modern() -> tuple:
    from labbook import train_modern

    rec = _load("modern_moe_full.json")
    return rec, train_modern.dense_verdicts(rec)


def ch09() -> str:
    rec, v = _modern()
    causal = [n for n, (_, _, c) in v.items() if c]
    ahead = [n for n in causal if v[n][0].verdict == "ahead"]
    leaky = [n for n, (_, _, c) in v.items() if not c]
    return (f"the recorded run (preset full, {len(rec['preset']['seeds'])} seeds, {rec['preset']['steps']} steps, last "
            f"evaluation): {len(ahead)} of {len(causal)} causally evaluated MoE variants ahead of dense (Welch, "
            f"Holm-corrected over the tests against dense, α = 0.05)"
            + (f"; {', '.join(leaky)} judged on prefixes (they see later tokens)" if leaky else ""))


def bench_modern_moe() -> str:
    rec, v = _modern()
    by = {x["name"]: x for x in rec["variants"]}
    dense = by["dense"]["final"]
    best = min((n for n in v if v[n][2]), key=lambda n: v[n][0].mean_a)
    aux = by["top-2/8, sigmoid, aux-free"].get("balance") or {}
    out = (f"{rec['wall_seconds'] / 60:.0f} min (preset full). Dense {sum(dense) / len(dense):.3f}; lowest causally "
           f"evaluated MoE: {best} {v[best][0].mean_a:.3f} ({v[best][0].verdict} vs dense, p = {v[best][0].p:.3g})")
    if aux:
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        out += (f"; aux-free MaxVio {mean(aux['batch_max_over_mean']) - 1:.3f} per batch vs "
                f"{mean(aux['window_max_over_mean']) - 1:.3f} per {aux['window_steps']}-step window")
    return out


def coursework_copies() -> str:
    """The coursework copies with their line counts, computed from the package's files and import graph."""
    sys.path.insert(0, str(ROOT / "tools"))
    import coursework_copies as cc

    return "\n" + cc.table() + "\n"


def faults() -> str:
    """The last full fault run (make faults): docs/faults.json."""
    path = ROOT / "docs" / "faults.json"
    if not path.exists():
        return "no full run recorded yet"
    rec = json.loads(path.read_text())
    per = {}
    for row in rec["rows"]:
        caught, total = per.get(row["chapter"], (0, 0))
        per[row["chapter"]] = (caught + row["caught"], total + 1)
    chapters = ", ".join(f"{c} {k}/{n}" for c, (k, n) in sorted(per.items()))
    return (f"the last full run ({rec['date']}, {rec['seconds'] // 60} min at load {rec['load']:.1f}): "
            f"{rec['caught']} of {rec['faults']} faults caught by the check each names ({chapters})")


def mutation() -> str:
    """The mutation record (make mutate): docs/mutation.json."""
    path = ROOT / "docs" / "mutation.json"
    if not path.exists():
        return "no module measured yet"
    import hashlib

    sys.path.insert(0, str(ROOT / "tools"))
    from mutate import TARGETS

    rec = json.loads(path.read_text())

    def changed(m: str, r: dict) -> str:  # the record is of other code than the module's source now
        now = hashlib.sha256((ROOT / m).read_bytes()).hexdigest()[:16] if (ROOT / m).exists() else None
        return ", code changed since" if r.get("source_sha") and now != r["source_sha"] else ""

    parts = [f"`{m.removeprefix('labutils/')}` {r['killed']}/{r['mutants'] - r['equivalent'] - r.get('gpu_only', 0)} "
             f"killed ({100 * r['score']:.1f}%, {r['equivalent']} equivalent"
             + (f", {r['gpu_only']} GPU-only" if r.get("gpu_only") else "")
             + (f", {r['rescored']} of them reviewed after the run" if r.get("rescored") else "")
             + f"; commit {r['commit']}"
             + changed(m, r) + ")"
             for m, r in sorted(rec["modules"].items())]
    missing = [m.removeprefix("labutils/") for m in TARGETS if m not in rec["modules"]]
    return (f"measured so far (target {100 * rec.get('target_score', 0.95):.0f}% per module): " + "; ".join(parts)
            + (f". Not measured yet: {', '.join(f'`{m}`' for m in missing)}" if missing else ""))


GENERATORS = {"faults": faults, "mutation": mutation,
              "coursework-copies": coursework_copies, "ch05": ch05, "bench-moe-vs-dense": bench_moe_vs_dense,
              "bench-launch": bench_launch,
              "bench-comm": bench_comm, "bench-full-scale": bench_full_scale,
              "bench-token-exchange": bench_token_exchange, "bench-train-step": bench_train_step,
              "bench-step-cuts": bench_step_cuts,
              "bench-matmul": bench_matmul, "ch09": ch09, "bench-modern-moe": bench_modern_moe}


def generate(name: str) -> str:
    if name.startswith("runtime-"):
        return runtime(name.removeprefix("runtime-"))
    if name not in GENERATORS:
        raise KeyError(f"README.md has a span gen:{name} that tools/readme_results.py cannot generate")
    return GENERATORS[name]()


def render(text: str) -> tuple:
    """(new text, names of spans whose text changed)."""
    changed = []

    def sub(m):
        body = generate(m["name"])
        if body != m["body"]:
            changed.append(m["name"])
        return f"<!-- gen:{m['name']} -->{body}<!-- /gen -->"

    return SPAN.sub(sub, text), changed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only report spans that differ; exit 1 if any")
    args = ap.parse_args()
    readme = ROOT / "README.md"
    new, changed = render(readme.read_text())
    if args.check:
        for name in changed:
            print(f"README.md: gen:{name} differs from the record (run python tools/readme_results.py)")
        return 1 if changed else 0
    readme.write_text(new)
    print(f"README.md: {len(changed)} span(s) rewritten: {', '.join(changed) or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
