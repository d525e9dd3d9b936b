"""Every MoE dispatch design against the machine's limits: experts, tokens per expert and top-k swept.

    .venv/bin/python benchmarks/dispatch.py                 # full sweeps -> benchmarks/results/dispatch.json
    .venv/bin/python benchmarks/dispatch.py --quick         # tiny sizes, a smoke run -> dispatch_quick.json
    .venv/bin/python benchmarks/dispatch.py --device cuda   # the same on a GPU -> dispatch_cuda.json
    .venv/bin/python benchmarks/dispatch.py --threads 1     # one thread, timed in its CPU time -> dispatch_1thread.json
    .venv/bin/python benchmarks/dispatch.py --threads 1 --tag r1   # the PRIMARY record, twice (r1, r2): chapter 08's
    .venv/bin/python benchmarks/dispatch.py --threads 1 --tag r2   # verdicts need at least two recordings
    .venv/bin/python benchmarks/dispatch.py --threads 1 --config live-tiny   # chapter 08's live sizes (tiny preset):
                                                            # what its live run is checked against

One thread timed in its CPU time is the primary record: other processes sharing the cores do not inflate it
(a 2-thread wall-clock run on a loaded machine gave 10-30x the times, issue 32). Every record states the load
average before and after and flags a run whose load exceeded the cores or whose rounds fell below the minimum.

One forward+backward per design on identical weights and routing (labbook/perf/dispatch.py), interleaved over
``--reps`` rounds; times are medians with their IQR and ratios paired medians (labbook.perf.sweep.measure_point).
Each row: tokens/s, useful GFLOP/s, ratio to the dense limit and to the E separate MLPs, share of
choices kept, rows computed (padding), peak memory. Also the core's profiled time per phase at several tokens
per expert, and the machine's matmul GFLOP/s (the roofline). Chapter 08 reads the JSON.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from labbook.perf.breakdown import core_breakdown  # noqa: E402
from labbook.perf.dispatch import DESIGNS  # noqa: E402
from labbook.perf.problem import make_problem  # noqa: E402
from labbook.perf.sweep import measure_point  # noqa: E402
from labbook.perf.timing import (  # noqa: E402
    describe_conditions,
    machine_info,
    matmul_gflops,
    run_conditions,
    save_result,
)
from labutils.optional import available  # noqa: E402

FULL = dict(d_model=256, d_hidden=512, top_k=2, reps=8, budget_s=8,
            experts=dict(tokens=1024, num_expert=[4, 8, 16, 32, 64, 128]),
            tokens=dict(num_expert=16, tokens_per_expert=[16, 32, 64, 128, 256, 512]),
            topk=dict(tokens=1024, num_expert=16, top_k=[1, 2, 4]),
            breakdown=dict(num_expert=16, tokens_per_expert=[16, 64, 128, 512]),
            einsum_max_mb=512)
QUICK = dict(d_model=64, d_hidden=128, top_k=2, reps=2, budget_s=2,
             experts=dict(tokens=256, num_expert=[4, 16]),
             tokens=dict(num_expert=8, tokens_per_expert=[16, 128]),
             topk=dict(tokens=256, num_expert=8, top_k=[1, 4]),
             breakdown=dict(num_expert=8, tokens_per_expert=[16, 128]),
             einsum_max_mb=64)
# chapter 08's live run, tiny and full presets (keep in step with the chapter's select_preset): the record its
# live relative costs and phase shares are checked against
LIVE_TINY = dict(d_model=128, d_hidden=256, top_k=2, reps=15, budget_s=None,   # the record: 15 rounds; live: 5
                 experts=dict(tokens=512, num_expert=[4, 32]),
                 breakdown=dict(num_expert=16, tokens_per_expert=[16, 128]), einsum_max_mb=512)
LIVE_FULL = dict(d_model=256, d_hidden=512, top_k=2, reps=5, budget_s=None,
                 experts=dict(tokens=2048, num_expert=[4, 8, 16, 32, 64, 128]),
                 breakdown=dict(num_expert=16, tokens_per_expert=[16, 64, 128, 512]), einsum_max_mb=512)
CONFIGS = {"full": FULL, "quick": QUICK, "live-tiny": LIVE_TINY, "live-full": LIVE_FULL}


def designs_for(T, E, k, cfg, device, skipped):
    """All designs, less DeepSpeed when missing and the one-hot einsum when its (T, E, C) tensors would not fit."""
    names = list(DESIGNS)
    if not available("deepspeed"):
        names = [n for n in names if not n.startswith("ds_")]
        skipped.append("DeepSpeed designs: deepspeed is not installed")
    # einsum holds ~4 (T, E, C) float tensors, C ~ the busiest expert's count (about 1.3 * T*k/E here)
    mb = 4 * T * E * (1.3 * T * k / E) * 4 / 2 ** 20
    if mb > cfg["einsum_max_mb"]:
        names.remove("einsum")
        skipped.append(f"einsum at T={T} E={E} k={k}: its one-hot tensors would need ~{mb:.0f} MB")
    if device.type == "cuda" and available("fmoe"):
        names.append("fastmoe")
    return names


def point(T, E, k, cfg, device, skipped, sweep, seed=0):
    p = make_problem(T, cfg["d_model"], cfg["d_hidden"], E, k, device=device, seed=seed)
    names = designs_for(T, E, k, cfg, device, skipped)
    rows = measure_point(p, names, reps=cfg["reps"], device=device, budget_s=cfg["budget_s"])
    meta = dict(sweep=sweep, tokens=T, num_expert=E, top_k=k, tokens_per_expert=T * k / E,
                d_model=cfg["d_model"], d_hidden=cfg["d_hidden"])
    ok = [r for r in rows if "error" not in r]
    print(f"{sweep:<8} T={T:<5} E={E:<4} k={k} tokens/expert={T * k // E:<5} ratio to dense: "
          + ", ".join(f"{r['design']} {r['ratio']:.2f}" for r in ok), flush=True)
    for r in rows:
        if "error" in r:
            print(f"    {r['design']} failed: {r['error']}", flush=True)
    return [{**meta, **r} for r in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 2 reps (= --config quick)")
    ap.add_argument("--config", choices=list(CONFIGS), default=None, help="sizes (default: full)")
    ap.add_argument("--tag", default="", help="suffix of the output name: a repeated recording (r1, r2)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--sweeps", default="experts,tokens,topk,breakdown")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    name = args.config or ("quick" if args.quick else "full")
    cfg = CONFIGS[name]
    live = name.startswith("live")
    suffix = (("" if name == "full" else "_" + name.replace("-", "_")) + ("_cuda" if device.type == "cuda" else "")
              + ("_1thread" if args.threads == 1 and device.type == "cpu" else "")
              + (f"_{args.tag}" if args.tag else ""))
    out = args.out or ROOT / "benchmarks" / "results" / f"dispatch{suffix}.json"
    start = time.perf_counter()
    d, h = cfg["d_model"], cfg["d_hidden"]
    result = {"machine": machine_info(device), "config": dict(cfg, name=name), "skipped": [],
              "matmul_gflops": {"square_512": matmul_gflops(512, 512, 512, device=device),
                                "square_1024": matmul_gflops(1024, 1024, 1024, device=device),
                                "dense_limit_shape": matmul_gflops(1024, cfg["top_k"] * h, d, device=device)},
              "rows": [], "breakdown": []}
    sweeps = [s for s in args.sweeps.split(",") if s in cfg]
    skipped = result["skipped"]
    if "experts" in sweeps:
        s = cfg["experts"]
        for E in s["num_expert"]:  # the live configs use the chapter's seeds (seed=E)
            result["rows"] += point(s["tokens"], E, cfg["top_k"], cfg, device, skipped, "experts", E if live else 0)
    if "tokens" in sweeps:
        s = cfg["tokens"]
        for tpe in s["tokens_per_expert"]:
            result["rows"] += point(tpe * s["num_expert"] // cfg["top_k"], s["num_expert"], cfg["top_k"], cfg,
                                    device, skipped, "tokens")
    if "topk" in sweeps:
        s = cfg["topk"]
        for k in s["top_k"]:
            result["rows"] += point(s["tokens"], s["num_expert"], k, cfg, device, skipped, "topk")
    if "breakdown" in sweeps and device.type == "cpu":  # the CPU profiler's timeline; on CUDA use nsys
        s = cfg["breakdown"]
        for tpe in s["tokens_per_expert"]:
            T = tpe * s["num_expert"] // cfg["top_k"]
            p = make_problem(T, d, h, s["num_expert"], cfg["top_k"], device=device, seed=tpe if live else 0,
                             limits=not live)
            b = core_breakdown(p, reps=cfg["reps"] if live else 3)
            result["breakdown"].append(dict(tokens=T, num_expert=s["num_expert"], top_k=cfg["top_k"],
                                            tokens_per_expert=tpe, **b))
            print(f"breakdown tokens/expert={tpe}: " + ", ".join(f"{k} {v * 1e3:.1f} ms"
                                                                 for k, v in b["total"].items()), flush=True)
    result["skipped"] = sorted(set(skipped))
    result["elapsed_s"] = time.perf_counter() - start
    after = machine_info(device)
    result["load_avg_1min_after"] = after["load_avg_1min"]
    rounds = [len(r["ratios"]) for r in result["rows"] if "ratios" in r]
    result["conditions"] = run_conditions(min(rounds) if rounds else 0, device=device)
    result["conditions"]["load_avg_1min_before"] = result["machine"]["load_avg_1min"]
    print(describe_conditions(result["conditions"]))
    print(f"wrote {save_result(result, out, ROOT)} in {result['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
