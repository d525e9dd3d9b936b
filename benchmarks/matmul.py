"""The machine's matrix-multiply throughput: the roofline of chapter 08's plots.

    .venv/bin/python benchmarks/matmul.py            # -> benchmarks/results/matmul.json
    .venv/bin/python benchmarks/matmul.py --quick    # -> matmul_quick.json

Square matmuls give the peak; the expert shapes ``(m, d) @ (d, h)`` and ``(m, h) @ (h, d)`` at m rows per expert
show how much of it an expert with few tokens can use (the E-separate-MLPs limit of benchmarks/dispatch.py).
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from labbook.perf.timing import machine_info, matmul_gflops, save_result  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-hidden", type=int, default=512)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    squares = [128, 256, 512] if args.quick else [128, 256, 512, 1024, 2048]
    rows = [16, 128, 1024] if args.quick else [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    reps = 3 if args.quick else 7
    start = time.perf_counter()
    d, h = args.d_model, args.d_hidden
    result = {"machine": machine_info(device), "d_model": d, "d_hidden": h, "square": [], "expert": []}
    for n in squares:
        result["square"].append({"n": n, "gflops": matmul_gflops(n, n, n, device=device, reps=reps)})
        print(f"square {n:>5}: {result['square'][-1]['gflops']:7.1f} GFLOP/s", flush=True)
    for m in rows:
        up = matmul_gflops(m, h, d, device=device, reps=reps)      # (m, d) @ (d, h)
        down = matmul_gflops(m, d, h, device=device, reps=reps)    # (m, h) @ (h, d)
        result["expert"].append({"rows": m, "gflops_up": up, "gflops_down": down})
        print(f"rows {m:>5}: d->h {up:7.1f}  h->d {down:7.1f} GFLOP/s", flush=True)
    result["peak_gflops"] = max(r["gflops"] for r in result["square"])
    result["elapsed_s"] = time.perf_counter() - start
    name = "matmul" + ("_quick" if args.quick else "") + ("_cuda" if device.type == "cuda" else "") + ".json"
    out = args.out or ROOT / "benchmarks" / "results" / name
    print(f"wrote {save_result(result, out, ROOT)} in {result['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
