"""Speed and memory of the chapter-01 MoE layer against every other way to run the same experts.

    .venv/bin/python benchmarks/moe_layer.py                  # three shapes, glibc defaults, as a notebook runs
    .venv/bin/python benchmarks/moe_layer.py --quick          # a tiny shape: a smoke run
    .venv/bin/python benchmarks/moe_layer.py --kernel         # the same, inside a Jupyter kernel
    .venv/bin/python benchmarks/moe_layer.py --tuned-malloc   # labelled extra row: glibc keeps freed memory
    .venv/bin/python benchmarks/moe_layer.py --threads 1      # labelled extra row: one thread's CPU time
    .venv/bin/python benchmarks/moe_layer.py --memory         # peak RSS of fwd+bwd: ours vs DeepSpeed cf=1

Forward + backward, fp32, CPU, top-2, rows interleaved in a seeded random order per round (15 rounds at the first
shape, 45 at the others; --repeats overrides), see labbook.perf.layer_bench.
Targets (issue 15), judged on PAIRED MEDIANS (per round, ours against the other row in the same round):
ours (dropless) is at least as fast as the best of DeepSpeed cf=1 (kept tokens only), the argsort + index_add
layer and grouped_mm, at all three shapes; ours reaches >= 0.95 of the pre-sliced MLPs at shape 0 and >= 0.90
at shape 1; peak RSS <= 1.1x DeepSpeed cf=1's at shape 0. "ours, again" measures the repeat-to-repeat spread.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from labbook.perf.layer_bench import bench_shape, retain_freed_memory  # noqa: E402
from labbook.perf.timing import machine_info, save_result  # noqa: E402
from labbook.perf.verdicts import find_row, paired_speedup  # noqa: E402

SHAPES = [dict(T=4096, d=512, h=2048, E=16), dict(T=1024, d=256, h=1024, E=8), dict(T=4096, d=256, h=512, E=64)]
QUICK = [dict(T=256, d=64, h=128, E=4)]
SLICED_TARGET = {0: 0.95, 1: 0.90}
# interleaved rounds per shape: the two smaller shapes take well under a second a round, so they get three
# times the rounds of the first (a median's standard error shrinks with the square root of the rounds)
ROUNDS = {0: 15, 1: 45, 2: 45}
COMPETITORS = ("DeepSpeed cf=1", "argsort + index_add", "grouped_mm")
RESULTS = ROOT / "benchmarks" / "results"


def verdicts(result: dict, shape_index: int | None) -> dict:
    """Every target of one shape, from paired medians (with their IQR), and the repeat-to-repeat spread."""
    ours = find_row(result, "ours (")
    out = {"ours_drops_nothing": ours["share"] == 1.0}
    for name in COMPETITORS:
        med, iqr = paired_speedup(ours, find_row(result, name))
        out[f"ours / {name}"] = dict(paired_median=med, iqr=iqr, met=med >= 1.0)
    med, iqr = paired_speedup(ours, find_row(result, "E MLPs"))
    target = SLICED_TARGET.get(shape_index) if shape_index is not None else None
    out["ours / pre-sliced"] = dict(paired_median=med, iqr=iqr, target=target,
                                    met=None if target is None else med >= target)
    med, iqr = paired_speedup(ours, find_row(result, "ours, again"))
    out["repeat spread (ours / ours again)"] = dict(paired_median=med, iqr=iqr)
    return out


def format_verdicts(v: dict) -> str:
    lines = [f"drops nothing: {v['ours_drops_nothing']}"]
    for key, item in v.items():
        if isinstance(item, dict):
            lo, hi = item["iqr"]
            goal = "" if item.get("met") is None else (" MET" if item["met"] else " NOT met")
            target = f" (target {item['target']})" if item.get("target") else (" (target 1.0)" if "met" in item and
                                                                              item.get("met") is not None else "")
            lines.append(f"{key:<40} {item['paired_median']:.3f} [IQR {lo:.3f}-{hi:.3f}]{target}{goal}")
    return "\n".join(lines)


def run_shapes(shapes, picked, repeats) -> list:
    """``repeats``: rounds for every shape, or None for :data:`ROUNDS` (3 for the quick shape)."""
    results = []
    for i in picked:
        rounds = repeats or (ROUNDS[i] if shapes is SHAPES else 3)
        r = bench_shape(**shapes[i], repeats=rounds)
        r["verdicts"] = verdicts(r, i if shapes is SHAPES else None)
        print(format_verdicts(r["verdicts"]) + "\n", flush=True)
        results.append(r)
    return results


MEMORY_CHILD = """
import json, resource, sys, torch
sys.path.insert(0, {root!r})
from labbook.perf.layer_bench import build_rows
import deepspeed.moe.layer  # imported in both rows' processes, so the baselines match
def rss_kb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS"))
base = rss_kb()                      # torch (and deepspeed) imported, nothing built
row, = build_rows(**{shape!r}, deepspeed_factors=(1.0,), only={name!r})
before = rss_kb()                    # weights and inputs of this one row
for _ in range(3):
    row.run()
print(json.dumps({{"row": row.name, "rss_base_mb": base / 1024, "rss_before_mb": before / 1024,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


def memory(shape: dict, repeats: int = 3) -> dict:
    """Peak RSS of 3 forward+backward steps, each row alone in a fresh process (same shape), the two rows
    alternating ``repeats`` times: glibc's peak moves by tens of MB from process to process, so the verdict is
    the ratio of the median peaks."""
    runs: dict = {}
    for _ in range(repeats):
        for name in ("ours (", "DeepSpeed cf=1"):
            code = MEMORY_CHILD.format(root=str(ROOT), shape=shape, name=name)
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
            line = [x for x in proc.stdout.splitlines() if x.startswith("{")]
            if not line:
                raise RuntimeError(f"memory child for {name!r} failed:\n{proc.stderr[-2000:]}")
            rec = json.loads(line[-1])
            rec["step_mb"] = rec["peak_rss_mb"] - rec["rss_before_mb"]
            runs.setdefault(rec["row"], []).append(rec)
    out: dict = {}
    for row, recs in runs.items():
        out[row] = {key: statistics.median(r[key] for r in recs) for key in recs[0] if key != "row"}
        out[row].update(row=row, peak_rss_mb_each=[r["peak_rss_mb"] for r in recs])
    ours, ds = (next(v for k, v in out.items() if k.startswith(p)) for p in ("ours (", "DeepSpeed"))
    out["repeats"] = repeats
    out["ratio_peak_rss"] = ours["peak_rss_mb"] / ds["peak_rss_mb"]
    out["ratio_step_mb"] = ours["step_mb"] / ds["step_mb"]
    out["met"] = out["ratio_peak_rss"] <= 1.1
    return out


KERNEL_CODE = """
import json, sys
sys.path.insert(0, {root!r})
sys.argv = ["moe_layer.py"]
import importlib.util
spec = importlib.util.spec_from_file_location("moe_layer_bench", {script!r})
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
print("RESULT" + json.dumps(mod.run_shapes(mod.SHAPES, {picked!r}, {repeats!r})))
"""


def in_kernel(picked, repeats) -> list:
    """The same measurement inside a Jupyter kernel (the lab's python3 kernel), as a notebook cell runs it."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    chunks = []
    try:
        code = KERNEL_CODE.format(root=str(ROOT), script=__file__, picked=list(picked), repeats=repeats)
        kc.execute_interactive(code, timeout=3600, output_hook=lambda msg: chunks.append(
            msg["content"].get("text", "") if msg["msg_type"] == "stream" else ""))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    text = "".join(chunks)
    return json.loads(text.split("RESULT", 1)[1].strip().splitlines()[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one tiny shape, 3 rounds")
    ap.add_argument("--repeats", type=int, default=None,
                    help="interleaved rounds for every shape (default 15, 45, 45 by shape; quick 3)")
    ap.add_argument("--shapes", type=str, default=None, help="comma-separated indices into the shapes, e.g. 0,1")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (1: the thread's CPU time)")
    ap.add_argument("--tuned-malloc", action="store_true", help="glibc keeps freed memory (mallopt): a tuning")
    ap.add_argument("--kernel", action="store_true", help="run the shapes inside a Jupyter kernel")
    ap.add_argument("--memory", action="store_true", help="only the peak-RSS comparison at shape 0")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    if args.tuned_malloc and not retain_freed_memory():
        ap.error("--tuned-malloc needs glibc")
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    shapes = QUICK if args.quick else SHAPES
    picked = [int(i) for i in args.shapes.split(",")] if args.shapes else list(range(len(shapes)))
    repeats = args.repeats
    allocator = "glibc, freed memory kept (mallopt): TUNED" if args.tuned_malloc else "glibc defaults"
    record = dict(benchmark="moe_layer", allocator=allocator, machine_before=machine_info())
    if args.memory:
        record["memory"] = memory(SHAPES[0])
        print(json.dumps(record["memory"], indent=1))
        default = "moe_layer_memory.json"
    elif args.kernel:
        record["where"] = "inside a Jupyter kernel (python3)"
        record["shapes"] = in_kernel(picked, repeats)
        default = "moe_layer_kernel.json"
    else:
        record["where"] = "a python process"
        record["shapes"] = run_shapes(shapes, picked, repeats)
        default = ("moe_layer_quick.json" if args.quick else "moe_layer" + ("_tuned" if args.tuned_malloc else "")
                   + (f"_{args.threads}thread" if args.threads else "") + ".json")
    record["machine_after"] = machine_info()
    print(f"wrote {save_result(record, args.out or RESULTS / default, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
