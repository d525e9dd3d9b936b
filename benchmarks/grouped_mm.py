"""One grouped GEMM (``torch._grouped_mm``) against a loop of per-expert matmuls: chapter 09's experts.

    .venv/bin/python benchmarks/grouped_mm.py            # -> benchmarks/results/grouped_mm.json
    .venv/bin/python benchmarks/grouped_mm.py --quick    # -> grouped_mm_quick.json

For each (experts, tokens) shape: the routed experts' forward (and forward+backward) through
``labutils.moe.modern.experts.RoutedExperts`` with ``impl="loop"`` and ``impl="grouped"`` on the same weights
and the same expert-contiguous rows (random top-k routing), timed interleaved; medians with their IQR, and the
paired per-round ratio loop/grouped (above 1: grouped is faster). Outputs are checked equal before timing.
Not part of the tests: timings on a shared machine are not verdicts.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from labbook.perf.timing import bench, clock_name, machine_info, paired_ratio, save_result, summarize  # noqa: E402
from labutils.moe.modern.experts import RoutedExperts  # noqa: E402


def problem(E: int, T: int, k: int, d: int, h: int, device):
    torch.manual_seed(0)
    loop = RoutedExperts(E, d, h, impl="loop").to(device)
    grouped = RoutedExperts(E, d, h, impl="grouped").to(device)
    grouped.load_state_dict(loop.state_dict())
    idx = torch.rand(T, E).topk(k, -1).indices.reshape(-1)                 # (T k) random top-k routing
    counts = torch.bincount(idx, minlength=E)                              # (E,)
    x = torch.randn(T * k, d, device=device)                               # expert-contiguous rows
    torch.testing.assert_close(loop(x, counts), grouped(x, counts), rtol=1e-4, atol=1e-4)
    return loop, grouped, x, counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--d-hidden", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shapes = [(8, 512), (64, 512)] if args.quick else [(8, 256), (8, 2048), (32, 2048), (64, 2048), (128, 4096)]
    reps = 5 if args.quick else 15
    d, h, k = args.d_model, args.d_hidden, args.top_k
    start = time.perf_counter()
    result = {"machine": machine_info(args.device), "clock": clock_name(device), "d_model": d, "d_hidden": h,
              "top_k": k, "torch": torch.__version__, "rows": []}
    for E, T in shapes:
        loop, grouped, x, counts = problem(E, T, k, d, h, device)
        g = torch.randn(x.shape[0], d, device=device)
        xg = x.clone().requires_grad_()

        def fwd(m, x=x, counts=counts):
            return lambda: m(x, counts)

        def fwd_bwd(m, xg=xg, counts=counts, g=g):
            return lambda: torch.autograd.grad(m(xg, counts), [xg, *m.parameters()], g)

        for what, make in (("forward", fwd), ("forward+backward", fwd_bwd)):
            times = bench({"loop": make(loop), "grouped": make(grouped)}, reps=reps, warmup=2, device=args.device)
            ratio, (q1, q3) = paired_ratio(times["loop"], times["grouped"])
            row = {"experts": E, "tokens": T, "pass": what, "loop": summarize(times["loop"]),
                   "grouped": summarize(times["grouped"]), "loop_over_grouped": ratio,
                   "ratio_iqr": [q1, q3]}
            result["rows"].append(row)
            print(f"E={E:>4} T={T:>5} {what:<17} loop {1e3 * row['loop']['median_s']:8.2f} ms "
                  f"(IQR {row['loop']['iqr_pct']:4.0f}%) | grouped {1e3 * row['grouped']['median_s']:8.2f} ms "
                  f"(IQR {row['grouped']['iqr_pct']:4.0f}%) | loop/grouped {ratio:5.2f} [{q1:.2f}, {q3:.2f}]",
                  flush=True)
    result["elapsed_s"] = time.perf_counter() - start
    name = "grouped_mm" + ("_quick" if args.quick else "") + ("_cuda" if device.type == "cuda" else "") + ".json"
    out = args.out or ROOT / "benchmarks" / "results" / name
    print(f"wrote {save_result(result, out, ROOT)} in {result['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
