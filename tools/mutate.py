"""Mutation testing of labutils with mutmut (issue 38): how many planted bugs the unit tests catch, per module.

    python tools/mutate.py labutils/moe/capacity.py [more modules]   # what `make mutate MODULE=...` runs
    python tools/mutate.py --all                                    # every module of TARGETS

Each module runs in its own scratch copy of the repository (build/mutate/<module>/): mutmut 3 mutates it there,
runs the unit tests that cover each mutated function (the `make quick` set, without the tests that rebuild
functions from their bytecode, which mutmut's trampolines change) and records killed / survived / timeout per
mutant. The record, docs/mutation.json, keeps per module the counts, the score over non-equivalent mutants and the
surviving mutants' names; tools/mutation_equivalent.json lists the mutants reviewed as equivalent, each with its
reason. An entry with ``"kind": "gpu-only"`` is a mutant that changes only where a tensor lives (``device=``): on
this CPU-only run it cannot differ; it is left out of the score like an equivalent one but counted apart
(``gpu_only``), and the CUDA tests are what would catch it. The copy is of the last commit (git archive HEAD).
Exit status 1 when a module of TARGETS is below TARGET_SCORE. ``--rescore MODULE...`` re-counts a recorded run
after a review, without running anything (refused when the module's source changed since).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "mutation.json"
EQUIVALENT = ROOT / "tools" / "mutation_equivalent.json"
TARGET_SCORE = 0.95
# The list: every module of moe/, and these.
TARGETS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "labutils" / "moe").glob("*.py")
                 if p.name != "__init__.py") + [f"labutils/{m}.py" for m in (
    "collectives", "agreement", "wire", "stats", "_stats_input", "_stats_intervals", "data_parallel", "checkpoint",
    "launcher/__init__")]  # launch(): the launch wing's __init__ (labutils/launcher.py until 0.3.0)
# The tests mutmut runs: the quick set, less the tests that read bytecode or file layout.
QUICK = "not dist and not kernel and not browser and not gpu"
NOT_UNDER_MUTATION = ("test_grader*.py", "test_layout.py", "test_chapter_faults.py", "test_browser.py",
                      "test_portable_copy.py", "test_coursework.py", "test_student.py", "test_setup.py",
                      "test_readme.py", "test_diagrams.py")
COPIED = ("labutils", "labbook", "tests", "benchmarks", "notebooks", "tools", "README.md", "docs")


def scratch(module: str) -> pathlib.Path:
    """A fresh copy of the repository in which mutmut mutates ``module`` only."""
    work = ROOT / "build" / "mutate" / module.replace("/", "_").removesuffix(".py")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    # The committed tree, not the working one: the record is of a commit, and half-edited files stay out.
    archive = subprocess.run(["git", "archive", "HEAD", *COPIED], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(work)], input=archive, check=True)
    for pattern in NOT_UNDER_MUTATION:
        for f in (work / "tests").glob(pattern):
            f.unlink()
    pyproject = subprocess.run(["git", "show", "HEAD:pyproject.toml"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout
    pyproject += ("\n[tool.mutmut]\n"
                  'source_paths = ["labutils"]\n'
                  f'only_mutate = ["{module}"]\n'
                  'also_copy = ["labbook", "benchmarks", "notebooks", "tools", "README.md", "docs"]\n'
                  f'pytest_add_cli_args = ["-q", "-x", "-p", "no:cacheprovider", "-m", "{QUICK}"]\n'
                  'pytest_add_cli_args_test_selection = ["tests"]\n'
                  "use_git_change_detection = false\n"
                  # a test's first call may import DeepSpeed or build a process group: seconds of CPU that mutmut's
                  # per-test limit (15x the recorded time + 1 s) would call a timeout; a timeout is not a kill here
                  "timeout_constant = 30.0\n"
                  # fork straight from a process that has run torch ops deadlocks the child (its thread pools do
                  # not survive fork, and mutmut's CPU-time limit never fires on a sleeping process): fork from a
                  # server that has only collected the tests
                  'process_isolation = "forkserver"\n')
    (work / "pyproject.toml").write_text(pyproject)
    return work


def equivalent_entries() -> dict:
    """{mutant name: {"reason": ..., "kind"?: "gpu-only"}} as reviewed."""
    return json.loads(EQUIVALENT.read_text()) if EQUIVALENT.exists() else {}


def equivalent() -> dict:
    """{mutant name: reason} left out of the score: equivalent (the program's behaviour cannot differ) or
    gpu-only (it can differ only on a GPU, which this run does not have)."""
    return {name: entry["reason"] for name, entry in equivalent_entries().items()}


STATUS = re.compile(r"^\s*(?P<name>[\w.]+__mutmut_\d+): (?P<status>[\w ]+)$")


def mutate(module: str) -> dict:
    work = scratch(module)
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", "2"], cwd=work, env=env,
                         capture_output=True, text=True)
    took = time.monotonic() - t0
    (work / "mutmut-run.log").write_text(run.stdout.replace("\r", "\n") + "\n--- stderr ---\n" + run.stderr)
    listed = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=work, env=env,
                            capture_output=True, text=True)
    statuses = {}
    for line in listed.stdout.splitlines():
        m = STATUS.match(line)
        if m:
            statuses[m["name"]] = m["status"].strip()
    if not statuses or all(s == "not checked" for s in statuses.values()):
        raise RuntimeError(f"mutmut produced no results for {module}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    eq = equivalent()
    gpu_only = {n for n, e in equivalent_entries().items() if e.get("kind") == "gpu-only"}
    survived = sorted(n for n, s in statuses.items() if s != "killed" and n not in eq)  # timeouts included
    counted = [n for n in statuses if n not in eq]
    killed = sum(statuses[n] == "killed" for n in counted)
    by_status: dict = {}
    for s in statuses.values():
        by_status[s] = by_status.get(s, 0) + 1
    return {"mutants": len(statuses), "by_status": by_status,
            "equivalent": sum(n in eq and n not in gpu_only for n in statuses),
            "gpu_only": sum(n in gpu_only for n in statuses),
            "killed": killed, "score": round(killed / len(counted), 4) if counted else 1.0,
            "survivors": survived, "seconds": round(took)}


def rescore(module: str, record: dict) -> dict:
    """The recorded run of ``module`` with the reviewed list as it is now: survivors since reviewed as equivalent
    (or GPU-only) leave the score's denominator. Nothing is re-run, so a survivor a new test kills stays a survivor
    until the next run; refused when the module's source is not the one the record was made of (mutant names
    are numbered per function and would point at other mutants)."""
    r = dict(record["modules"][module])
    now = hashlib.sha256((ROOT / module).read_bytes()).hexdigest()[:16]
    if r.get("source_sha") != now:
        raise SystemExit(f"--rescore {module}: its source changed since the recorded run (commit {r.get('commit')}); "
                         "run it again instead")
    entries = equivalent_entries()
    reviewed = [n for n in r["survivors"] if n in entries]
    r["survivors"] = [n for n in r["survivors"] if n not in entries]
    r["gpu_only"] = r.get("gpu_only", 0) + sum(entries[n].get("kind") == "gpu-only" for n in reviewed)
    r["equivalent"] += sum(entries[n].get("kind") != "gpu-only" for n in reviewed)
    counted = r["mutants"] - r["equivalent"] - r["gpu_only"]
    r["score"] = round(r["killed"] / counted, 4) if counted else 1.0
    r["rescored"] = len(reviewed) + r.get("rescored", 0)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("modules", nargs="*")
    ap.add_argument("--all", action="store_true", help=f"every module of TARGETS ({len(TARGETS)})")
    ap.add_argument("--rescore", action="store_true",
                    help="re-count the recorded runs of the modules given with the reviewed list as it is now")
    args = ap.parse_args()
    modules = TARGETS if args.all else args.modules
    if not modules:
        ap.error("give modules (labutils/moe/capacity.py ...) or --all")
    for m in modules:
        if not (ROOT / m).is_file() or not m.startswith("labutils/") or not m.endswith(".py"):
            ap.error(f"module must be a .py file under labutils/, got {m!r}")
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {"modules": {}}
    if args.rescore:
        for m in modules:
            if m not in record["modules"]:
                ap.error(f"--rescore: no recorded run of {m}")
            record["modules"][m] = r = rescore(m, record)
            print(f"{m:<36} {r['killed']} killed ({100 * r['score']:.1f}%), {len(r['survivors'])} survive "
                  f"({r['rescored']} reviewed since the run)")
        RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        return 0
    below = []
    for m in modules:
        # the commit and source the scratch copy is made of (a commit landing during the run is not in it)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        source = subprocess.run(["git", "show", f"HEAD:{m}"], cwd=ROOT, capture_output=True, check=True).stdout
        result = mutate(m)
        result["commit"] = commit
        result["source_sha"] = hashlib.sha256(source).hexdigest()[:16]
        # re-read before writing: another run (or a --rescore) may have recorded other modules meanwhile
        record = json.loads(RECORD.read_text()) if RECORD.exists() else {"modules": {}}
        record["modules"][m] = result
        RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        mark = "" if result["score"] >= TARGET_SCORE or m not in TARGETS else "  BELOW TARGET"
        below += [m] if mark else []
        counted = result['mutants'] - result['equivalent'] - result['gpu_only']
        print(f"{m:<36} {result['killed']:>4}/{counted:<4} killed ({100 * result['score']:.1f}%), "
              f"{result['equivalent']} equivalent, {result['gpu_only']} gpu-only, {len(result['survivors'])} "
              f"survive, {result['seconds']} s{mark}", flush=True)
    record["target_score"] = TARGET_SCORE
    RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return 1 if below else 0


if __name__ == "__main__":
    sys.exit(main())
