"""All-to-all time against message size and world size (gloo on CPU, NCCL on GPUs): expert parallelism's cost.

    .venv/bin/python benchmarks/comm.py            # 2, 4, 8 workers -> benchmarks/results/comm.json
    .venv/bin/python benchmarks/comm.py --quick    # 2 workers, few sizes -> comm_quick.json

Each rank sends ``bytes_per_rank`` in total, split evenly over the ranks (``labutils.collectives.all_to_all``, the
differentiable exchange of chapter 06, forward only). Time per call: the slowest rank's median over ``reps``,
each call started after a barrier. Workers come from ``labutils.launch`` (fresh processes).
On a machine with fewer cores than workers the ranks share cores: that cost is measured, not hidden.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from labbook.perf.timing import fit_latency_bandwidth, machine_info, save_result  # noqa: E402
from labutils.launcher import launch  # noqa: E402


def all_to_all_times(sizes: list, reps: int) -> dict:
    """Inside a worker: seconds per all-to-all for each total message size in bytes (float32 rows of 64)."""
    import statistics

    import torch.distributed as dist

    from labutils.collectives import all_to_all

    world, row = dist.get_world_size(), 64
    out = {}
    for nbytes in sizes:
        rows_per_peer = max(1, nbytes // (4 * row * world))
        x = torch.randn(rows_per_peer * world, row)
        splits = [rows_per_peer] * world
        all_to_all(x, splits, splits)  # warm-up (connections, buffers)
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            all_to_all(x, splits, splits)
            times.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(times)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the exchange is as slow as its slowest rank
        out[x.numel() * 4] = t.item()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--worlds", default=None, help="comma-separated world sizes (default 2,4,8)")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")] if args.worlds else ([2] if args.quick else [2, 4, 8])
    sizes = [2 ** p for p in (range(12, 22, 3) if args.quick else range(10, 25, 2))]  # 1 KiB .. 16 MiB
    reps = 3 if args.quick else 7
    start = time.perf_counter()
    machine = machine_info("cpu")
    result = {"machine": machine, "backend": "gloo", "reps": reps, "rows": [], "fits": {}}
    for world in worlds:
        per_rank = launch(all_to_all_times, world, sizes, reps, backend="gloo", timeout=240, threads=1)
        for nbytes, seconds in per_rank[0].items():
            result["rows"].append({"world_size": world, "bytes_per_rank": nbytes, "seconds": seconds,
                                   "gb_per_s_per_rank": nbytes / seconds / 1e9})
            print(f"world {world}  {nbytes / 2 ** 10:>8.0f} KiB per rank  {seconds * 1e3:8.2f} ms  "
                  f"{nbytes / seconds / 1e9:6.2f} GB/s per rank", flush=True)
        fit = fit_latency_bandwidth(list(per_rank[0]), list(per_rank[0].values()))
        fit["workers_per_core"] = world / machine["cores"]
        result["fits"][str(world)] = fit
        print(f"world {world} on {machine['cores']} cores ({fit['workers_per_core']:.1f} workers per core): "
              f"t = {fit['latency_s'] * 1e6:.0f} us + bytes / {fit['bandwidth_gb_s']:.2f} GB/s "
              f"(worst point off by {100 * fit['max_rel_error']:.0f}%)", flush=True)
    result["elapsed_s"] = time.perf_counter() - start
    out = args.out or ROOT / "benchmarks" / "results" / ("comm_quick.json" if args.quick else "comm.json")
    print(f"wrote {save_result(result, out, ROOT)} in {result['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
