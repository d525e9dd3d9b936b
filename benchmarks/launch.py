"""How fast does each launcher get to the first completed all_reduce? (issue: foundation; chapter 00)

    python benchmarks/launch.py [--sizes 2 4 8] [--repeats 3]

Side by side in one run, for each world size: labutils.launch, torch.multiprocessing.spawn (a
module-level function, which is all spawn can run) and torchrun. Reported: median seconds from the call
to the first rank's completed all_reduce, and to the call's return; ratios against torchrun.
Target: labutils.launch at world size 8 takes at most 0.7x torchrun's time. Results: benchmarks/results/launch.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from launch_workers import first_all_reduce, spawn_main  # noqa: E402

from labutils import launch  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_times(out_dir: str, world_size: int) -> list:
    return [float(open(os.path.join(out_dir, f"t{r}")).read()) for r in range(world_size)]


def time_labutils(world_size: int) -> tuple:
    t0 = time.time()
    done = launch(first_all_reduce, world_size, timeout=300)
    return min(done) - t0, time.time() - t0


def time_spawn(world_size: int) -> tuple:
    with tempfile.TemporaryDirectory() as out:
        t0 = time.time()
        mp.spawn(spawn_main, args=(world_size, free_port(), out), nprocs=world_size, join=True)
        return min(read_times(out, world_size)) - t0, time.time() - t0


def time_torchrun(world_size: int) -> tuple:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world_size),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               os.path.join(HERE, "launch_workers.py"), out]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // world_size))}
        t0 = time.time()
        subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=300)
        return min(read_times(out, world_size)) - t0, time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "launch.json"))
    args = ap.parse_args()
    runners = {"labutils.launch": time_labutils, "mp.spawn": time_spawn, "torchrun": time_torchrun}
    rows = []
    print(f"{'world':>5} {'launcher':<16} {'to all_reduce':>14} {'to return':>10} {'vs torchrun':>12}")
    for ws in args.sizes:
        medians = {}
        for _ in range(args.repeats):  # interleave launchers so machine noise hits all of them alike
            for name, fn in runners.items():
                medians.setdefault(name, []).append(fn(ws))
        first = {n: statistics.median(t[0] for t in ts) for n, ts in medians.items()}
        total = {n: statistics.median(t[1] for t in ts) for n, ts in medians.items()}
        for name in runners:
            ratio = first[name] / first["torchrun"]
            rows.append({"world_size": ws, "launcher": name, "seconds_to_first_all_reduce": first[name],
                         "seconds_to_return": total[name], "ratio_to_torchrun": ratio})
            print(f"{ws:>5} {name:<16} {first[name]:>12.2f} s {total[name]:>8.2f} s {ratio:>11.2f}x", flush=True)
    at8 = [r for r in rows if r["world_size"] == max(args.sizes) and r["launcher"] == "labutils.launch"]
    if at8:
        verdict = "PASS" if at8[0]["ratio_to_torchrun"] <= 0.7 else "MISS"
        print(f"target: labutils.launch <= 0.7x torchrun at world size {max(args.sizes)}: "
              f"{at8[0]['ratio_to_torchrun']:.2f}x {verdict}")
    meta = {"command": " ".join(["python"] + sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": platform.processor() or platform.machine(), "cores": len(os.sched_getaffinity(0)),
            "torch": torch.__version__, "repeats": args.repeats}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
