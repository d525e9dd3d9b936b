"""Chapter 05's study at full size: MoE against dense (and dense-wide) on the stdlib, 3 seeds, plus ablations.

    .venv/bin/python benchmarks/moe_vs_dense.py                 # full preset, 2 processes -> moe_vs_dense_full.json
    .venv/bin/python benchmarks/moe_vs_dense.py --preset tiny   # the chapter's CI-sized run (under a minute)
    .venv/bin/python benchmarks/moe_vs_dense.py --plot-only     # redraw the figure from the recorded JSON

Each run uses one torch thread; ``--jobs`` runs go side by side (2 on the book's 2-core machine), so the
wall-clock axis is CPU seconds of one core shared with one other run. The verdict lines are computed from the
record by ``labutils.lm_study.summarize``; chapter 05 shows the recorded figure and verdict when present.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from labutils import lm_study  # noqa: E402
from labutils.perf.timing import machine_info, save_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(lm_study.PRESETS), default="full")
    ap.add_argument("--jobs", type=int, default=2, help="runs side by side, one torch thread each")
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure from the recorded JSON")
    args = ap.parse_args()
    out = ROOT / "benchmarks" / "results" / f"moe_vs_dense_{args.preset}.json"
    if args.plot_only:
        record = json.loads(out.read_text())
    else:
        record = lm_study.run_study(lm_study.PRESETS[args.preset], jobs=args.jobs)
        record["machine"] = machine_info()
        print("wrote", save_result(record, out, ROOT))
    print("\n".join(lm_study.verdict_lines(lm_study.summarize(record))))
    fig = lm_study.plot_study(record)
    fig.savefig(out.with_suffix(".png"), dpi=90, bbox_inches="tight")
    print("wrote", out.with_suffix(".png").relative_to(ROOT))


if __name__ == "__main__":
    main()
