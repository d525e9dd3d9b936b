"""Three ways to move tokens to experts on other ranks, side by side on gloo: FastMoE's unpadded all-to-all,
DeepSpeed's padded capacity buffers (drop_tokens True and False) and Hugging Face's all-reduce of expert outputs.
(Chapter 06 reads the record.)

    .venv/bin/python benchmarks/token_exchange.py            # W = 2, 4, 8 -> benchmarks/results/token_exchange.json
    .venv/bin/python benchmarks/token_exchange.py --quick    # W = 2, small -> token_exchange_quick.json

For each world size and design (``labbook.token_exchange.run_design``, workers from ``labutils.launch``):
the largest output/gradient difference from one process holding every expert, the bytes each rank puts on the
wire per training step (forward, backward and the router's gradient reduction), counted by the kernel
(``labutils.wire``), and the step time: per step the slowest rank, then the median and quartiles over steps.
All W workers share this machine's cores (W = 8 on 2 cores: 4 processes a core): the record says how many.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from labbook.perf.timing import machine_info, quartiles, save_result  # noqa: E402
from labbook.token_exchange import DESIGNS, run_design  # noqa: E402
from labutils.launcher import launch  # noqa: E402

PRESETS = {"full": dict(worlds=[2, 4, 8], experts=16, d=64, h=128, k=2, tokens=256, steps=15),
           "quick": dict(worlds=[2], experts=4, d=16, h=32, k=2, tokens=32, steps=5)}


def summarize(per_rank: list) -> dict:
    """One design at one world size: worst parity error over ranks, bytes per rank, slowest-rank step times."""
    steps = len(per_rank[0]["seconds"])
    slowest = [max(r["seconds"][i] for r in per_rank) for i in range(steps)]
    q1, med, q3 = quartiles(slowest)
    return {"max_error": {k: max(r["errors"][k] for r in per_rank) for k in per_rank[0]["errors"]},
            "sent_per_rank": [r["sent_median"] for r in per_rank],
            "sent_mean": statistics.fmean(r["sent_median"] for r in per_rank),
            "step_seconds": {"q1": q1, "median": med, "q3": q3, "all": slowest},
            "tokens_without_output": sum(r["tokens_without_output"] for r in per_rank),
            "choices_dropped": sum(r["choices_dropped"] for r in per_rank)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    cfg = PRESETS["quick" if args.quick else "full"]
    out = args.out or ROOT / "benchmarks" / "results" / ("token_exchange_quick.json" if args.quick
                                                         else "token_exchange.json")
    record = {"config": cfg, "machine": machine_info(), "worlds": {}}
    kw = {k: cfg[k] for k in ("experts", "d", "h", "k", "tokens", "steps")}
    for world in cfg["worlds"]:
        record["worlds"][str(world)] = {}
        for design in DESIGNS:
            res = summarize(launch(run_design, world, design, timeout=600, fn_kwargs=kw))
            record["worlds"][str(world)][design] = res
            print(f"W={world} {design:<12} sent/rank {res['sent_mean']:>10.0f} B   step median "
                  f"{res['step_seconds']['median'] * 1e3:7.1f} ms [IQR {res['step_seconds']['q1'] * 1e3:.1f}-"
                  f"{res['step_seconds']['q3'] * 1e3:.1f}]   max error {max(res['max_error'].values()):.1e}   "
                  f"choices dropped {res['choices_dropped']}", flush=True)
    record["machine"]["load_avg_1min_end"] = machine_info()["load_avg_1min"]
    print("wrote", save_result(record, out, ROOT))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
