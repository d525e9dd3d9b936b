"""``python -m labbook.grader``: grade submitted notebooks into a CSV, grade one solution file, or serve.

    python -m labbook.grader grade SUBMISSIONS/ --out grades.csv    # every notebook under SUBMISSIONS/
    python -m labbook.grader one my_moe_forward solution.py         # one solution's text ('-': stdin)
    python -m labbook.grader list                                   # the exercises, by chapter

A notebook ``SUBMISSIONS/<student>/.../NN_slug.ipynb`` (nbgrader's ``submitted/`` layout) belongs to ``<student>``;
a notebook directly in ``SUBMISSIONS/`` to its file name. Its chapter is the file name's ``NN_``; without one, every
exercise whose function it defines is graded. The CSV has a row per (student, exercise): student, notebook,
chapter, exercise, result (pass / fail), reason.
"""
from __future__ import annotations

import argparse
import csv
import pathlib
import re
import sys

from labbook.grader import catalog, source

FIELDS = ["student", "notebook", "chapter", "exercise", "result", "reason"]


def submissions(root: pathlib.Path) -> list:
    """``[(student, notebook path)]`` for every notebook under ``root`` (checkpoints skipped)."""
    if root.is_file():
        return [(root.stem, root)]
    found = []
    for path in sorted(root.rglob("*.ipynb")):
        if ".ipynb_checkpoints" in path.parts:
            continue
        rel = path.relative_to(root)
        found.append((rel.parts[0] if len(rel.parts) > 1 else path.stem, path))
    return found


def exercises_for(path: pathlib.Path) -> list:
    m = re.match(r"(\d\d)_", path.name)
    if m and catalog.by_chapter(m.group(1)):
        return catalog.by_chapter(m.group(1))
    return [e for e in catalog.ENTRIES.values() if source.from_notebook(path, e.function) is not None]


def grade_folder(root: pathlib.Path, out: pathlib.Path, only=None, grade_fn=None) -> list:
    """Grade every submission under ``root`` into the CSV ``out``; returns the rows."""
    from labbook.grader import service

    grade_fn = grade_fn or service.grade
    rows = []
    for student, path in submissions(root):
        for e in exercises_for(path):
            if only and e.function not in only:
                continue
            row = {"student": student, "notebook": str(path.relative_to(root) if root.is_dir() else path.name),
                   "chapter": e.chapter, "exercise": e.function}
            try:
                text = source.from_notebook(path, e.function)
            except (OSError, ValueError) as exc:
                text, row["reason"] = None, f"unreadable notebook: {exc}"
            if text is None:
                row.update(result="fail", reason=row.get("reason") or f"no cell defines `def {e.function}(`")
            else:
                report = grade_fn(e.function, text)
                row.update(result="pass" if report.passed else "fail", reason=report.reason)
            rows.append(row)
            print(f"{student:<20} {e.chapter} {e.function:<24} {row['result']}  {row['reason'][:90]}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m labbook.grader", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grade", help="grade every notebook under a folder into a CSV")
    g.add_argument("submissions", type=pathlib.Path)
    g.add_argument("--out", type=pathlib.Path, default=pathlib.Path("grades.csv"))
    g.add_argument("--exercise", action="append", help="grade only these exercises (repeatable)")
    o = sub.add_parser("one", help="grade one solution's text")
    o.add_argument("exercise")
    o.add_argument("file", help="a file holding the solution cell's text, or - for stdin")
    o.add_argument("--seed", type=int, default=None)
    o.add_argument("--hidden", type=int, default=None, help="number of hidden cases (default: the exercise's)")
    sub.add_parser("list", help="the exercises, by chapter")
    sub.add_parser("serve", help="the grading service (used by grade() and the CSV command)")
    args = ap.parse_args(argv)
    if args.cmd == "serve":
        from labbook.grader import service
        service.serve()
        return 0
    if args.cmd == "list":
        for e in catalog.ENTRIES.values():
            print(f"{e.chapter}  {e.function:<24} imports: {', '.join(sorted(e.policy.imports))}")
        return 0
    if args.cmd == "one":
        from labbook.grader.grading import grade

        catalog.entry(args.exercise)
        text = sys.stdin.read() if args.file == "-" else pathlib.Path(args.file).read_text()
        report = grade(args.exercise, text, args.seed, args.hidden)
        print(report.text())
        return 0 if report.passed else 1
    if not args.submissions.exists():
        ap.error(f"submissions: {args.submissions} does not exist")
    for name in args.exercise or ():
        catalog.entry(name)
    rows = grade_folder(args.submissions, args.out, set(args.exercise or ()))
    passed = sum(r["result"] == "pass" for r in rows)
    print(f"{passed} of {len(rows)} exercises pass; {len({r['student'] for r in rows})} students; CSV: {args.out}")
    return 0
