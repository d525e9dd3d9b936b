"""Which numbers a chapter's outputs lost or gained between two executions (issue 39: narrate apart, numbers kept).

    python tools/nbnumbers.py OLD.ipynb NEW.ipynb [--all]

Every number in every output (stream text, text/plain, text/markdown, text/html; images left out) is collected
as it is written; the tool prints the numbers present in OLD and missing from NEW, and (with --all) the new ones.
Timings and addresses differ between runs anyway: read the list, do not expect it empty.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys

NUMBER = re.compile(r"(?<![\w.])[-−]?\d+(?:\.\d+)?(?:e[-+]?\d+)?%?")


def numbers(path: str) -> collections.Counter:
    with open(path) as f:
        nb = json.load(f)
    found: collections.Counter = collections.Counter()
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            texts = [out.get("text", "")]
            for kind in ("text/plain", "text/markdown", "text/html"):
                texts.append(out.get("data", {}).get(kind, ""))
            for t in texts:
                t = "".join(t) if isinstance(t, list) else t
                found.update(n.replace("−", "-") for n in NUMBER.findall(t))
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--all", action="store_true", help="also list the numbers only NEW has")
    args = ap.parse_args()
    old, new = numbers(args.old), numbers(args.new)
    lost = old - new
    print(f"{sum(old.values())} numbers before, {sum(new.values())} after; {sum(lost.values())} lost:")
    print(" ".join(f"{n}x{c}" if c > 1 else n for n, c in sorted(lost.items())))
    if args.all:
        gained = new - old
        print(f"{sum(gained.values())} gained:")
        print(" ".join(f"{n}x{c}" if c > 1 else n for n, c in sorted(gained.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
