"""Chapter 09's ten variants at full size (chapter 05's model, 3 seeds): the record the chapter shows.

    .venv/bin/python benchmarks/modern_moe.py            # -> benchmarks/results/modern_moe_full.json (about 20 min)

Two variants run side by side, one torch thread each; each variant runs its seeds one after another with
``labbook.train_modern.run_variant`` (the chapter's own runner), so ``LAB_PRESET=full`` in the chapter
computes the same numbers. Per seed it records every evaluation (``final`` is the last one), the last model
scored generation-style on prefixes (``final_prefix``) and each batch's own load balance beside the windowed one.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from labbook import train_modern  # noqa: E402
from labbook.perf.timing import machine_info, save_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(train_modern.PRESETS), default="full")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    record = train_modern.record_full(train_modern.PRESETS[args.preset], jobs=args.jobs)
    record["machine"] = machine_info()
    print("wrote", save_result(record, ROOT / "benchmarks" / "results" / f"modern_moe_{args.preset}.json", ROOT))
    print(f"{record['wall_seconds'] / 60:.1f} minutes")
    print("\n".join(train_modern.ranking_lines(record)))


if __name__ == "__main__":
    main()
