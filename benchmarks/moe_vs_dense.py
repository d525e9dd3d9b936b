"""Chapter 05's study at full size: MoE against dense (and dense-wide) on the stdlib, 3 seeds, ablations on every
seed, and the data-limited control (the same models on ``control_chars`` training characters, under the record's
``data_limited`` key).

    .venv/bin/python benchmarks/moe_vs_dense.py                 # full preset, 2 processes -> moe_vs_dense_full.json
    .venv/bin/python benchmarks/moe_vs_dense.py --preset tiny   # the chapter's CI-sized run (under a minute)
    .venv/bin/python benchmarks/moe_vs_dense.py --plot-only     # redraw the figure from the recorded JSON

Each run uses one torch thread; ``--jobs`` runs go side by side (2 on the book's 2-core machine). The time axis
is each run's own CPU seconds (``time.process_time``, evaluations left out), so a run is charged for its
computation, not for time it waited while other work shared its core. The verdict lines are computed from the
record by ``labbook.lm_study.summary.summarize``; chapter 05 shows the recorded figure and verdict when present.
The record is written to a ``.partial.json`` file and moved over the committed one only when every run has
finished, so an interrupted study never replaces a complete record.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from labbook.lm_study import config, plots, runner, summary  # noqa: E402
from labbook.perf.timing import machine_info, save_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(config.PRESETS), default="full")
    ap.add_argument("--jobs", type=int, default=2, help="runs side by side, one torch thread each")
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure from the recorded JSON")
    ap.add_argument("--no-control", action="store_true", help="skip the data-limited control")
    args = ap.parse_args()
    out = ROOT / "benchmarks" / "results" / f"moe_vs_dense_{args.preset}.json"
    if args.plot_only:
        record = json.loads(out.read_text())
    else:
        cfg = config.PRESETS[args.preset]
        record = runner.run_study(cfg, jobs=args.jobs)
        if not args.no_control:
            record["data_limited"] = runner.run_study(config.data_limited(cfg), jobs=args.jobs)
        record["machine"] = machine_info()
        partial = out.with_suffix(".partial.json")
        save_result(record, partial, ROOT)
        os.replace(partial, out)  # only a finished study replaces the record
        print("wrote", out.relative_to(ROOT))
    print("\n".join(summary.verdict_lines(summary.summarize(record))))
    print("\n".join(summary.ablation_lines(record)))
    if "data_limited" in record:
        print("data-limited control:")
        print("\n".join(summary.verdict_lines(summary.summarize(record["data_limited"]))))
    fig = plots.plot_study(record)
    fig.savefig(out.with_suffix(".png"), dpi=90, bbox_inches="tight")
    print("wrote", out.with_suffix(".png").relative_to(ROOT))


if __name__ == "__main__":
    main()
