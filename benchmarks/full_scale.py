"""The book's 273.9M-parameter MoE layer trained on CPU: seconds per step and peak memory vs theory.

    .venv/bin/python benchmarks/full_scale.py            # book scale, warm-up + 3 timed steps -> full_scale.json
    .venv/bin/python benchmarks/full_scale.py --quick    # chapter 03's tiny model, a smoke run -> full_scale_quick.json

The model is ``labutils.models.book_model`` (one pre-norm block, 5 x 1024^2 attention, 32 experts of
1024 -> 4096 -> 1024, top-2 NaiveGate) trained with Adam on random (batch, seq, 1024) data, as chapter 03's
``LAB_PRESET=full`` run. Theory in fp32: parameters + gradients + Adam's two moments = 16 bytes x parameters.
Peak RSS is the process's high-water mark (``ru_maxrss``), which also holds PyTorch itself (measured before
the model is built, reported as ``baseline``) and activations. Needs ~6 GB of free memory at book scale.
"""
from __future__ import annotations

import argparse
import pathlib
import resource
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from labbook.perf.timing import save_result  # noqa: E402
from labutils.data import RandomPairs  # noqa: E402
from labutils.models import AUX_COEF, book_model  # noqa: E402
from labutils.moe import collect_aux_loss  # noqa: E402
from labutils.params import count_params  # noqa: E402
from labutils.train import mse, train  # noqa: E402

GB = 1e9


def peak_rss_bytes() -> int:
    """High-water resident memory of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(sizes: dict, batch: int, seq: int, steps: int, warmup: int) -> dict:
    baseline = peak_rss_bytes()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = book_model(device="cpu", **sizes)
    build_s = time.perf_counter() - t0
    counts = count_params(model)
    n = counts.total
    data = RandomPairs(batch, seq, sizes["d_model"], seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    warm = train(model, data, steps=warmup, optimizer=optimizer, progress=False, record_load=False)
    timed = []
    for _ in range(steps):  # the same step as train(), each phase timed on its own
        x, y = data.next_batch()
        t = [time.perf_counter()]
        loss = mse(model(x), y) + AUX_COEF * collect_aux_loss(model, clear=True)
        t.append(time.perf_counter())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        t.append(time.perf_counter())
        optimizer.step()
        t.append(time.perf_counter())
        timed.append({"forward": t[1] - t[0], "backward": t[2] - t[1], "adam": t[3] - t[2], "total": t[3] - t[0],
                      "loss": loss.item()})
    peak = peak_rss_bytes()
    theory = {"params": 4 * n, "grads": 4 * n, "adam_moments": 8 * n}
    theory["total"] = sum(theory.values())
    def median(key):
        return sorted(p[key] for p in timed)[len(timed) // 2]

    return {
        "sizes": sizes, "batch": batch, "seq": seq, "tokens_per_step": batch * seq,
        "parameters": n, "by_category": dict(counts.by_category),
        "build_seconds": build_s, "warmup_losses": warm.losses, "warmup_seconds": warm.seconds,
        "steps": timed, "median_step_seconds": median("total"),
        "median_phase_seconds": {k: median(k) for k in ("forward", "backward", "adam")},
        "peak_rss_bytes": peak, "baseline_rss_bytes": baseline, "theory_bytes": theory,
        "peak_over_theory": peak / theory["total"], "above_baseline_over_theory": (peak - baseline) / theory["total"],
        "threads": torch.get_num_threads(), "torch": torch.__version__,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="chapter 03's tiny model instead of the book's")
    ap.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=16)
    args = ap.parse_args()
    if args.quick:
        sizes = dict(d_model=64, n_heads=4, num_expert=8, d_hidden=128)
    else:
        sizes = dict(d_model=1024, n_heads=16, num_expert=32, d_hidden=4096)
    result = run(sizes, args.batch, args.seq, args.steps, warmup=1)
    th = result["theory_bytes"]
    print(f"parameters {result['parameters']:,} | tokens/step {result['tokens_per_step']} | "
          f"threads {result['threads']}")
    phases = ", ".join(f"{k} {v:.2f}" for k, v in result["median_phase_seconds"].items())
    every = ", ".join(f"{step['total']:.2f}" for step in result["steps"])
    print(f"seconds/step: median {result['median_step_seconds']:.2f} ({phases}); all: {every}; "
          f"warm-up {result['warmup_seconds']:.2f}")
    print(f"theory (fp32): params {th['params'] / GB:.2f} + grads {th['grads'] / GB:.2f} + Adam "
          f"{th['adam_moments'] / GB:.2f} = {th['total'] / GB:.2f} GB")
    print(f"peak RSS {result['peak_rss_bytes'] / GB:.2f} GB (PyTorch alone {result['baseline_rss_bytes'] / GB:.2f} GB)"
          f" = {result['peak_over_theory']:.2f}x theory; above baseline {result['above_baseline_over_theory']:.2f}x")
    out = ROOT / "benchmarks" / "results" / ("full_scale_quick.json" if args.quick else "full_scale.json")
    print("wrote", save_result(result, out, ROOT))


if __name__ == "__main__":
    main()
