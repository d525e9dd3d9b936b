"""Worker bodies for benchmarks/launch.py (module-level so mp.spawn and torchrun can import them)."""
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def first_all_reduce() -> float:
    """All-reduce one tensor; return the wall-clock time at which it completed."""
    t = torch.ones(1)
    dist.all_reduce(t)
    return time.time()


def spawn_main(rank: int, world_size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))
    done = first_all_reduce()
    with open(os.path.join(out_dir, f"t{rank}"), "w") as f:
        f.write(repr(done))
    dist.destroy_process_group()


if __name__ == "__main__":  # torchrun entry: python -m torch.distributed.run ... launch_workers.py OUT_DIR
    dist.init_process_group("gloo")
    done = first_all_reduce()
    with open(os.path.join(sys.argv[1], f"t{dist.get_rank()}"), "w") as f:
        f.write(repr(done))
    dist.destroy_process_group()
