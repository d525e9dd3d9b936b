"""One rank of a `launch` call, running in a child forked by labutils/_zygote.py. Internal.

Order of work: wire stdout/stderr to the parent's per-rank pipes, die with the zygote, register a
stack dump on SIGUSR1 (the parent asks for it at a timeout), unpickle the user's function, join the
process group, run, write the result (or the traceback) and leave with os._exit.
"""
from __future__ import annotations

import faulthandler
import linecache
import os
import signal
import sys
import time
import traceback
from datetime import timedelta


def _wire_output(rank: int, cfg: dict) -> None:
    os.dup2(cfg["out_fds"][rank], 1)
    os.dup2(cfg["err_fds"][rank], 2)
    for fd in cfg["out_fds"] + cfg["err_fds"]:
        os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False, encoding="utf-8", errors="replace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, encoding="utf-8", errors="replace")


def _set_rank_env(rank: int, cfg: dict) -> None:
    world = cfg["world_size"]
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", MASTER_ADDR="127.0.0.1")


def _install_sources(sources: dict) -> None:
    """Put notebook cell sources into linecache so remote tracebacks show the cell's lines."""
    for filename, lines in sources.items():
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)


def _init_process_group(rank: int, cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    kwargs = {}
    if cfg["backend"] == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    store = dist.FileStore(cfg["store_path"], cfg["world_size"])
    dist.init_process_group(cfg["backend"], store=store, rank=rank, world_size=cfg["world_size"],
                            timeout=timedelta(seconds=cfg["pg_timeout"]), **kwargs)


def _write(path: str, obj) -> None:
    import cloudpickle

    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        cloudpickle.dump(obj, f)
    os.replace(tmp, path)


def run(rank: int, cfg: dict) -> None:
    """Run the user's function as ``rank``; never returns."""
    code = 1
    tmp = cfg["tmpdir"]
    try:
        _wire_output(rank, cfg)
        from labutils._zygote import die_with_parent

        die_with_parent(os.getppid())
        faulthandler.register(signal.SIGUSR1, file=open(os.path.join(tmp, f"stack_{rank}.txt"), "w"),
                              all_threads=True)
        _set_rank_env(rank, cfg)
        import cloudpickle
        import torch

        torch.set_num_threads(cfg["threads"])
        with open(os.path.join(tmp, "payload.pkl"), "rb") as f:
            payload = cloudpickle.load(f)
        _install_sources(payload["sources"])
        _init_process_group(rank, cfg)
        result = payload["fn"](*payload["args"], **payload["kwargs"])
        _write(os.path.join(tmp, f"result_{rank}.pkl"), result)
        _destroy()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        _record_error(tmp, rank, f"SystemExit({exc.code!r})", traceback.format_exc())
    except BaseException as exc:  # report everything, KeyboardInterrupt included
        tb = exc.__traceback__.tb_next or exc.__traceback__  # drop this module's own frame
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        _record_error(tmp, rank, f"{type(exc).__name__}: {exc}", text)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _destroy() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _record_error(tmp: str, rank: int, summary: str, tb: str) -> None:
    try:
        _write(os.path.join(tmp, f"error_{rank}.pkl"), {"time": time.time(), "summary": summary, "traceback": tb})
    except Exception:
        sys.stderr.write(tb)
