"""The lab's MoE layer on a GPU against the grouped-GEMM limit, forward + backward (issue 40). One command:

    python benchmarks/gpu_layer.py                   # the issue's 4 shapes, bf16 and fp32 -> results/gpu_layer.json
    python benchmarks/gpu_layer.py --preset tiny     # small shapes: a quick look at a GPU -> gpu_layer_tiny.json
    python benchmarks/gpu_layer.py --device cpu --allow-cpu --preset tiny --rounds 2 --warmup 1
                                                     # a smoke run of the machinery on the CPU: NOT a measurement

Rows, each one forward + backward step (fresh gradients) on the same T tokens:

* ``dense, same FLOPs``: one MLP ``d -> k*h -> d`` (:func:`labbook.perf.dispatch.dense`): the experts' FLOPs, no
  routing;
* ``grouped GEMM, pre-grouped (limit)``: the E expert MLPs on rows already grouped by expert, one
  ``torch._grouped_mm`` per linear (:func:`labutils.moe.backends.grouped_matmul`), biases as the lab's grouped
  backend adds them: the routing-free limit the lab layer is judged against;
* ``lab FMoETransformerMLP``: ``labutils.moe.FMoETransformerMLP`` (NaiveGate, top-k, GELU experts), built with
  ``backend="auto"`` when its constructor takes ``backend``;
* ``ModernMoE grouped (no biases)``: ``ModernMoE(impl="grouped")``, chapter 09's layer (its experts have no
  biases, and its router is its own);
* ``real fastmoe``: ``fmoe.FMoETransformerMLP`` with the lab layer's weights copied in, when ``import fmoe`` works.

Timing: CUDA events (``time.perf_counter`` on the CPU smoke run), ``--warmup`` steps per row, then ``--rounds``
rounds (7), the rows in a fresh seeded order each round (:func:`labbook.perf.layer_bench.round_orders`), the GPU
synchronised before each row; per row the median, (min, max) and the peak memory of one step above what was
allocated when it began (``torch.cuda.max_memory_allocated`` after a reset: :func:`labbook.perf.timing.peak_memory`).
Parity: the lab layer and real fastmoe on the same weights and input, the largest output difference.
Target (issue 40), per shape and dtype: the lab layer runs at >= 0.8 of the limit's speed (grouped ms / lab ms).
Without a CUDA GPU (and without ``--allow-cpu``) it says so in one line, writes nothing and exits 0.
"""
from __future__ import annotations

import argparse
import inspect
import math
import os
import pathlib
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from labbook.perf import dispatch as D  # noqa: E402
from labbook.perf.layer_bench import round_orders  # noqa: E402
from labbook.perf.problem import Problem, fwd_bwd, make_problem, route  # noqa: E402
from labbook.perf.timing import machine_info, peak_memory, save_result, sync  # noqa: E402
from labutils.moe.backends import grouped_matmul  # noqa: E402
from labutils.moe.functions import count_by_gate, scatter  # noqa: E402

PRESETS = {
    "issue": [dict(T=16384, d=1024, h=4096, E=8, k=2), dict(T=16384, d=1024, h=1024, E=64, k=2),
              dict(T=32768, d=2048, h=1408, E=64, k=6), dict(T=4096, d=512, h=2048, E=16, k=2)],
    "tiny": [dict(T=512, d=64, h=128, E=4, k=2), dict(T=512, d=64, h=64, E=16, k=2)],
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TARGET = 0.8  # the lab layer at >= 0.8 of the grouped row's speed: grouped_ms / lab_ms >= 0.8
DENSE, LIMIT, LAB, MODERN, FASTMOE = ("dense, same FLOPs", "grouped GEMM, pre-grouped (limit)",
                                      "lab FMoETransformerMLP", "ModernMoE grouped (no biases)", "real fastmoe")
ROWS = {
    DENSE: "one MLP d -> k*h -> d on all T tokens: the experts' FLOPs, no routing (labbook.perf.dispatch.dense)",
    LIMIT: "E expert MLPs on rows already grouped by expert, one torch._grouped_mm per linear, biases added per "
           "row as the lab's grouped backend adds them; no gate, no sort, no scatter/gather: the routing-free limit",
    LAB: "labutils.moe.FMoETransformerMLP, NaiveGate top-k, GELU experts with biases",
    MODERN: "labutils.moe.modern.layer.ModernMoE(impl='grouped'): softmax top-k router, GELU experts WITHOUT biases",
    FASTMOE: "fmoe.FMoETransformerMLP (NaiveGate), the lab layer's weights copied in",
}
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_OUT = {"issue": "gpu_layer.json", "tiny": "gpu_layer_tiny.json"}
CPU_OUT = "gpu_layer_cpu_smoke.json"


# ---- the verdict ------------------------------------------------------------------------------------------------
def verdict(grouped_ms: float, lab_ms: float, target: float = TARGET) -> dict:
    """Issue 40's target on one shape and dtype: the lab layer at >= ``target`` of the grouped row's speed.

    ``speed = grouped_ms / lab_ms`` (1.0: as fast as the limit); ``lab_over_grouped`` is its inverse, the time ratio.
    """
    for name, v in (("grouped_ms", grouped_ms), ("lab_ms", lab_ms)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a finite time > 0 in ms, got {v!r}")
    speed = grouped_ms / lab_ms
    met = speed >= target
    return {"speed": speed, "lab_over_grouped": lab_ms / grouped_ms, "target": target, "met": met,
            "verdict": "met" if met else "NOT met"}


# ---- the rows ---------------------------------------------------------------------------------------------------
def shape_name(s: dict) -> str:
    return f"T{s['T']} d{s['d']} h{s['h']} E{s['E']} k{s['k']}"


def add_dense_weights(p: Problem, seed: int) -> None:
    """The dense reference's MLP ``d -> k*h -> d`` (``p.dense_w``), without the pre-sliced copies that
    ``make_problem(limits=True)`` also builds (a second set of expert weights, too big for the issue's shapes)."""
    g = torch.Generator().manual_seed(seed + 1)
    kh, d = p.top_k * p.h, p.d

    def leaf(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(device=p.x.device, dtype=p.x.dtype).requires_grad_()

    p.dense_w = [leaf(kh, d, scale=d ** -0.5), leaf(kh, scale=0.1), leaf(d, kh, scale=kh ** -0.5), leaf(d, scale=0.1)]


def grouped_limit(xs, expert, counts, w1, b1, w2, b2):
    """``xs (N, d)`` expert-contiguous, ``expert (N,)`` each row's expert, ``counts (E,)``, fastmoe's weight layout
    ``w1 (E, h, d), b1 (E, h), w2 (E, d, h), b2 (E, d)`` -> ``(N, d)``: two grouped GEMMs and a GELU."""
    hid = F.gelu(grouped_matmul(xs, w1.transpose(1, 2), counts) + b1.index_select(0, expert))   # (N, h)
    return grouped_matmul(hid, w2.transpose(1, 2), counts) + b2.index_select(0, expert)         # (N, d)


def limit_step(p: Problem):
    """The limit row's step: the problem's routing only decides the group sizes; the rows arrive grouped."""
    idx, _ = route(p.logits.detach(), p.top_k)                             # (T, k)
    pos, counts = count_by_gate(idx, p.E)                                  # (N,), (E,)
    expert = idx.reshape(-1)[pos]                                          # (N,)
    xs = scatter(p.x.detach(), pos, p.top_k).contiguous().requires_grad_()  # (N, d) already grouped
    grad = torch.randn_like(xs)
    weights = (p.w1, p.b1, p.w2, p.b2)

    def step():
        for t in (xs, *weights):
            t.grad = None
        grouped_limit(xs, expert, counts, *weights).backward(grad)
    return step


def layer_step(layer, x: torch.Tensor, grad: torch.Tensor, after=None):
    """One forward + backward of ``layer`` on its own leaf copy of ``x`` with fresh gradients."""
    x = x.detach().clone().requires_grad_()

    def step():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        layer(x).backward(grad)
        if after is not None:
            after()
    return step


def lab_layer(s: dict, device, dtype, seed: int):
    """The lab's FMoETransformerMLP (``backend="auto"`` when the constructor takes it), biases made nonzero so
    that a parity check against fastmoe covers them. Returns ``(layer, backend argument or None)``."""
    from labutils.moe.transformer import FMoETransformerMLP

    takes_backend = "backend" in inspect.signature(FMoETransformerMLP).parameters   # being added in issue 40
    kwargs: dict[str, Any] = {"backend": "auto"} if takes_backend else {}
    torch.manual_seed(seed)
    layer = FMoETransformerMLP(num_expert=s["E"], d_model=s["d"], d_hidden=s["h"], top_k=s["k"], **kwargs)
    with torch.no_grad():
        for name, t in layer.named_parameters():
            if name.endswith("bias"):
                t.normal_(0.0, 0.1)
    return layer.to(device=device, dtype=dtype), kwargs.get("backend")


def lab_backend(layer, x) -> str:
    """What the lab layer runs on ``x``: its ``expert_backend`` when it has one."""
    fn = getattr(layer, "expert_backend", None)
    return str(fn(x)) if callable(fn) else "the layer's only path (no backend argument)"


def fastmoe_info() -> dict:
    """Whether real fastmoe imports, its version, and its commit (FASTMOE_COMMIT, else ``fmoe.__version__``)."""
    from labutils.optional import require

    commit = os.environ.get("FASTMOE_COMMIT")
    try:
        fmoe = require("fmoe", "the real fastmoe row")
    except ImportError as exc:
        return {"available": False, "why": str(exc).splitlines()[0][:300], "commit": commit, "version": None}
    version = getattr(fmoe, "__version__", None)
    return {"available": True, "why": None, "commit": commit or version, "version": version}


def build(s: dict, dtype, device, seed: int, fm: dict):
    """The rows of one shape and dtype: ``(steps {name: step}, skipped {name: why}, parity, lab info, problem)``."""
    p = make_problem(s["T"], s["d"], s["h"], s["E"], s["k"], seed=seed, device=device, dtype=dtype, limits=False)
    add_dense_weights(p, seed)
    steps, skipped, parity = {}, {}, {}
    steps[DENSE] = lambda: fwd_bwd(D.dense, p)
    steps[LIMIT] = limit_step(p)
    lab, backend_arg = lab_layer(s, device, dtype, seed)
    info = {"backend_argument": backend_arg, "runs": lab_backend(lab, p.x)}
    steps[LAB] = layer_step(lab, p.x, p.grad_y)
    from labutils.moe.modern.layer import ModernMoE

    torch.manual_seed(seed)
    modern = ModernMoE(s["d"], s["h"], s["E"], top_k=s["k"], impl="grouped").to(device=device, dtype=dtype)
    steps[MODERN] = layer_step(modern, p.x, p.grad_y, after=modern.history.clear)  # history: one entry a step
    if not fm["available"]:
        skipped[FASTMOE] = f"fastmoe not importable: {fm['why']}"
    elif device.type != "cuda":
        skipped[FASTMOE] = "real fastmoe runs on CUDA only"
    else:
        try:
            import fmoe

            from labbook.fastmoe_parity import copy_moe_weights

            real = fmoe.FMoETransformerMLP(num_expert=s["E"], d_model=s["d"], d_hidden=s["h"],
                                           top_k=s["k"]).to(device=device, dtype=dtype)
            copy_moe_weights(lab, real)
            with torch.no_grad():
                y_lab, y_real = lab(p.x), real(p.x)
            parity = {"max_abs_diff": float((y_lab.float() - y_real.float()).abs().max()),
                      "max_abs_output": float(y_lab.float().abs().max()),
                      "how": "the same input, the lab layer's weights (gate included) copied into fastmoe's"}
            steps[FASTMOE] = layer_step(real, p.x, p.grad_y)
        except Exception as exc:  # a fastmoe build without this dtype, an old API: said in the record
            skipped[FASTMOE] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    if not parity:
        parity = {"max_abs_diff": None, "why": skipped.get(FASTMOE, "not compared")}
    return steps, skipped, parity, info, p


# ---- timing -----------------------------------------------------------------------------------------------------
def warm_up(steps: dict, skipped: dict, warmup: int, device) -> None:
    """``warmup`` steps of each row; a row that fails (out of memory, an unsupported dtype) leaves ``steps`` for
    ``skipped``, with the error."""
    for name in list(steps):
        try:
            for _ in range(max(1, warmup)):
                steps[name]()
            sync(device)
        except Exception as exc:
            del steps[name]
            skipped[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            if device.type == "cuda":
                torch.cuda.empty_cache()


def time_rows(steps: dict, rounds: int, device, seed: int = 0) -> dict:
    """``{name: [ms, ...]}``: ``rounds`` rounds, the rows in a fresh seeded order each round; CUDA events on a GPU
    (synchronised before each row), ``time.perf_counter`` on the CPU."""
    names = list(steps)
    times: dict = {n: [] for n in names}
    for order in round_orders(len(names), rounds, seed):
        for i in order:
            name = names[i]
            sync(device)
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                steps[name]()
                end.record()
                end.synchronize()
                times[name].append(float(start.elapsed_time(end)))
            else:
                t0 = time.perf_counter()
                steps[name]()
                times[name].append(1e3 * (time.perf_counter() - t0))
    return times


def measure(s: dict, dtype_name: str, device, rounds: int, warmup: int, seed: int, fm: dict) -> dict:
    """One shape and dtype: every row's times, peak memory and TFLOP/s, the parity, the verdict."""
    steps, skipped, parity, info, p = build(s, DTYPES[dtype_name], device, seed, fm)
    warm_up(steps, skipped, warmup, device)
    peaks = {name: peak_memory(step, device) / 2 ** 20 for name, step in steps.items()}
    times = time_rows(steps, rounds, device, seed)
    flops = p.flops()
    rows = {}
    for name, ms in times.items():
        med = statistics.median(ms)
        rows[name] = {"median_ms": med, "spread_ms": [min(ms), max(ms)], "times_ms": ms, "peak_mib": peaks[name],
                      "tflops": flops / (med * 1e-3) / 1e12}
    entry = {"shape": dict(s), "dtype": dtype_name, "flops_per_step": flops, "lab_layer": info, "rows": rows,
             "skipped": skipped, "parity": parity, "grouped_ms": None, "lab_ms": None, "lab_over_grouped": None,
             "verdict": None}
    if LIMIT in rows and LAB in rows:
        entry["grouped_ms"], entry["lab_ms"] = rows[LIMIT]["median_ms"], rows[LAB]["median_ms"]
        entry["verdict"] = verdict(entry["grouped_ms"], entry["lab_ms"])
        entry["lab_over_grouped"] = entry["verdict"]["lab_over_grouped"]
    else:
        entry["why_no_verdict"] = "; ".join(f"{n}: {skipped.get(n, 'missing')}" for n in (LIMIT, LAB) if n not in rows)
    del steps, p
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return entry


def describe(entry: dict) -> str:
    """One line per shape and dtype: each row's median, then the verdict."""
    rows = " | ".join(f"{n} {r['median_ms']:.3f} ms" for n, r in entry["rows"].items())
    v = entry["verdict"]
    said = (f"grouped/lab {v['speed']:.2f} (target {v['target']}) {v['verdict']}" if v else
            f"no verdict ({entry['why_no_verdict']})")
    skipped = "".join(f"\n    skipped {n}: {why}" for n, why in entry["skipped"].items())
    diff = entry["parity"].get("max_abs_diff")
    parity = f"\n    lab vs real fastmoe, max |output diff| {diff:.3e}" if diff is not None else ""
    return f"{shape_name(entry['shape'])} {entry['dtype']}: {rows} -> {said}{parity}{skipped}"


# ---- the command ------------------------------------------------------------------------------------------------
def shown(path: pathlib.Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="issue", help="issue: the 4 shapes; tiny: small ones")
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu for a smoke run with --allow-cpu")
    ap.add_argument("--allow-cpu", action="store_true",
                    help="allow --device cpu: a smoke run of the machinery (fp32, perf_counter), not a measurement")
    ap.add_argument("--dtypes", default="bf16,fp32", help="comma-separated, of bf16 and fp32 (the CPU: fp32 only)")
    ap.add_argument("--shapes", default=None, help="comma-separated indices into the preset's shapes, e.g. 0,3")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds (the median is reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per row before the rounds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=pathlib.Path, default=None, help="the record (default under benchmarks/results/)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type not in ("cuda", "cpu"):
        ap.error(f"--device must be cuda or cpu, got {args.device!r}")
    if device.type == "cpu" and not args.allow_cpu:
        ap.error("--device cpu measures nothing about a GPU: add --allow-cpu for a smoke run of the machinery")
    dtypes = [t.strip() for t in args.dtypes.split(",") if t.strip()]
    unknown = [t for t in dtypes if t not in DTYPES]
    if unknown or not dtypes:
        ap.error(f"--dtypes takes {sorted(DTYPES)}, got {args.dtypes!r}")
    if args.rounds < 1 or args.warmup < 0:
        ap.error("--rounds must be >= 1 and --warmup >= 0")
    shapes = PRESETS[args.preset]
    picked = [int(i) for i in args.shapes.split(",")] if args.shapes else list(range(len(shapes)))
    if any(not 0 <= i < len(shapes) for i in picked):
        ap.error(f"--shapes: indices 0..{len(shapes) - 1} into the {args.preset} preset, got {args.shapes!r}")
    out = args.out or RESULTS / (CPU_OUT if device.type == "cpu" else DEFAULT_OUT[args.preset])
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"no CUDA GPU visible (torch {torch.__version__}, cuda available: {torch.cuda.is_available()}): "
              f"nothing to measure; the record {shown(out)} is left as is")
        return 0
    if device.type == "cpu" and dtypes != ["fp32"]:
        print("the CPU smoke run times fp32 only")
        dtypes = ["fp32"]
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    fm = fastmoe_info()
    smoke = device.type == "cpu"
    record = {
        "benchmark": "gpu_layer", "preset": args.preset, "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "smoke": smoke,
        "note": ("a CPU smoke run of the machinery (--allow-cpu): not a GPU measurement" if smoke else
                 "forward + backward on one GPU"),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                     "fastmoe": fm},
        "machine": machine_info(device),
        "timing": {"clock": "time.perf_counter (CPU smoke run)" if smoke else "CUDA events",
                   "warmup": args.warmup, "rounds": args.rounds, "statistic": "median over rounds",
                   "order": "rows in a fresh seeded order each round, the device synchronised before each row",
                   "peak_mib": "most memory one step allocated above what was allocated when it began"},
        "target": {"what": "lab layer at >= 0.8 of the grouped row's speed: grouped_ms / lab_ms >= 0.8",
                   "speed": TARGET, "lab_row": LAB, "grouped_row": LIMIT},
        "rows": ROWS, "results": [],
    }
    print(f"{record['gpu'] or 'CPU smoke run'}: torch {torch.__version__}, CUDA {torch.version.cuda}, fastmoe "
          f"{fm['commit'] or ('not importable' if not fm['available'] else 'version unknown')}", flush=True)
    start = time.perf_counter()
    for i in picked:
        for dtype_name in dtypes:
            entry = measure(shapes[i], dtype_name, device, args.rounds, args.warmup, args.seed, fm)
            record["results"].append(entry)
            print(describe(entry), flush=True)
    calls = [e["verdict"]["verdict"] for e in record["results"] if e["verdict"]]
    record["summary"] = {"met": calls.count("met"), "NOT met": calls.count("NOT met"),
                         "no verdict": len(record["results"]) - len(calls)}
    record["elapsed_s"] = time.perf_counter() - start
    print(f"target (grouped/lab >= {TARGET}): met {calls.count('met')}, NOT met {calls.count('NOT met')} of "
          f"{len(record['results'])}")
    print(f"wrote {save_result(record, out, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
