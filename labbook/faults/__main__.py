"""python -m labbook.faults [NN ...] [--name TEXT]: run the chapters' fault lists, one line per fault."""
from __future__ import annotations

import argparse
import sys

from labbook.faults import CHAPTERS, faults
from labbook.faults.run import run, verdict


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("chapters", nargs="*", default=list(CHAPTERS))
    ap.add_argument("--name", default="", help="only faults whose name contains this text")
    args = ap.parse_args()
    missed = 0
    for chapter in args.chapters:
        for fault in faults(chapter):
            if args.name not in fault.name:
                continue
            outcome = run(chapter, fault)
            why = verdict(fault, outcome)
            missed += why is not None
            print(f"{chapter} {'caught' if why is None else 'MISSED'} {outcome.seconds:5.1f} s  {fault.name}"
                  + ("" if why is None else "\n    " + why.replace("\n", "\n    ")), flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
