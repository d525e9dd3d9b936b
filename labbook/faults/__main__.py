"""python -m labbook.faults [NN ...] [--name TEXT] [--record PATH]: run the chapters' fault lists, one line each.

``--record docs/faults.json`` (what ``make faults`` writes) keeps every fault's verdict with the fingerprint of the
code it ran against (:func:`labbook.faults.record.code_fingerprint`); tests/test_chapter_faults.py requires that
record to match the code and to have caught every fault, and runs one fault per chapter live.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from labbook.faults import CHAPTERS, faults
from labbook.faults.record import code_fingerprint
from labbook.faults.run import run, verdict


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("chapters", nargs="*", default=list(CHAPTERS))
    ap.add_argument("--name", default="", help="only faults whose name contains this text")
    ap.add_argument("--jobs", type=int, default=2, help="faults run at once (default 2: the book's 2 cores)")
    ap.add_argument("--record", default=None, help="write every verdict, with the code's fingerprint, here")
    args = ap.parse_args()
    if args.record and (args.name or sorted(args.chapters) != list(CHAPTERS)):
        ap.error("--record needs every fault of every chapter (no chapters, no --name)")
    todo = [(c, f) for c in args.chapters for f in faults(c) if args.name in f.name]
    subsets = sorted({(c, f.cells) for c, f in todo if f.cells})
    t0 = time.time()
    with ThreadPoolExecutor(args.jobs) as pool:  # each run is its own kernel and processes: threads just wait
        clean = dict(zip(subsets, pool.map(lambda cs: run(cs[0], None, cs[1]), subsets)))
        outcomes = pool.map(lambda cf: run(*cf), todo)
        missed, rows = 0, []
        for (chapter, fault), outcome in zip(todo, outcomes):
            why = verdict(fault, outcome)
            control = clean.get((chapter, fault.cells))
            if control is not None and control.failed is not None:
                why = f"the unedited cells fail too (cell {control.failed}), so the check proves nothing"
            missed += why is not None
            rows.append({"chapter": chapter, "fault": fault.name, "check": fault.check, "caught": why is None,
                         "why": why, "seconds": round(outcome.seconds, 1)})
            print(f"{chapter} {'caught' if why is None else 'MISSED'} {outcome.seconds:5.1f} s  {fault.name}"
                  + ("" if why is None else "\n    " + why.replace("\n", "\n    ")), flush=True)
    print(f"{len(rows) - missed} of {len(rows)} faults caught in {time.time() - t0:.0f} s")
    if args.record:
        record = {"code": code_fingerprint(), "caught": len(rows) - missed, "faults": len(rows),
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": os.getloadavg()[0],
                  "seconds": round(time.time() - t0), "rows": rows}
        with open(args.record, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
