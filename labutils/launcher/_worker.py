"""The worker side of `launch`: the zygote that forks the ranks, and each rank. Internal; see ``__init__.py``.

The parent (``labutils.launcher``) starts this file by its path (``runpy.run_path``) in a fresh interpreter: it
imports nothing of its package, so a renamed or nested copy of the package launches the same way. The
zygote imports torch once and forks one child per rank *before* any tensor op has run in it (so fork is
safe: no OpenMP pool, no CUDA context), then waits for them. Each rank wires its output, dies with the
zygote, unpickles the user's function by value, joins the process group through a FileStore, runs, writes
its result or its traceback and leaves with ``os._exit``.

Channels between the parent, the zygote and the ranks:

| channel | direction | what travels |
|---|---|---|
| last argv | parent -> zygote | JSON config: world size, backend, tmpdir, store, threads, timeouts, fds |
| ``TMPDIR/payload.pkl`` | parent -> ranks | cloudpickle of ``{fn, args, kwargs, sources}`` (cells, for tracebacks) |
| ``TMPDIR/store`` | rank <-> rank | torch.distributed FileStore: the rendezvous (no port is chosen) |
| per-rank stdout/stderr pipes | rank -> parent | the rank's output, printed as ``[rank R] ...`` |
| zygote stdout | zygote -> parent | line protocol: ``pid RANK PID`` when forked, ``exit RANK CODE`` when reaped |
| zygote stderr | zygote -> parent | anything the zygote itself prints, shown as ``[launch] ...`` |
| ``TMPDIR/result_R.pkl`` | rank -> parent | the return value (written atomically) |
| ``TMPDIR/error_R.pkl`` | rank -> parent | ``{time, summary, traceback}`` of an exception or ``SystemExit`` |
| ``TMPDIR/stack_R.txt`` | rank -> parent | faulthandler stacks, written when the parent sends SIGUSR1 at a timeout |
| ``TMPDIR/calls.bin`` | ranks -> parent | shared memory, a 128-byte slot per rank: the collective it is in now |
| PDEATHSIG | kernel | a rank gets SIGKILL when the zygote dies; the zygote SIGUSR2 when the caller dies |

The collective watch (``_watch.py``): each rank publishes the collective it is in, so that the parent can
name the calls of ranks that wait for each other in different collectives instead of waiting for the timeout.
Process plumbing (die with the parent, kill every process below one) is in ``_procs.py``; both files are loaded
by their path (:func:`_sibling`), like this one.

Nothing outlives the launch: the zygote is a child subreaper (PR_SET_CHILD_SUBREAPER), so a process a rank
starts, even in a new session (``start_new_session=True``) and even after that rank died, stays below the
zygote; when the ranks are done, or the caller stops the launch or dies, the zygote kills every process below
it (walking /proc) and, when the caller died, removes the launch directory.
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import linecache
import os
import shutil
import signal
import sys
import time
import traceback
from datetime import timedelta

CALLER_GONE = signal.SIGUSR2  # the zygote's PDEATHSIG (SIGTERM is the caller's stop())


def _sibling(name: str):
    """``name``.py of this folder, loaded by its path under a name of no package: the worker never names its
    package, so a renamed (``mylab/``) or nested copy starts the same way."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"launch{name}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_procs = _sibling("_procs")  # die_with_parent, kill_tree, ...: processes below the zygote
_watch = _sibling("_watch")  # the collective watch


# -- one rank ------------------------------------------------------------------------------------


def _wire_output(rank: int, cfg: dict) -> None:
    os.dup2(cfg["out_fds"][rank], 1)
    os.dup2(cfg["err_fds"][rank], 2)
    for fd in cfg["out_fds"] + cfg["err_fds"]:
        os.close(fd)
    # the rank's streams for its whole life (closed by os._exit), hence no `with`
    sys.stdout = open(1, "w", buffering=1, closefd=False, encoding="utf-8", errors="replace")  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False, encoding="utf-8", errors="replace")  # noqa: SIM115


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
    store = dist.FileStore(cfg["store_path"], cfg["world_size"])  # pyright: ignore[reportPrivateImportUsage]
    dist.init_process_group(cfg["backend"], store=store, rank=rank, world_size=cfg["world_size"],
                            timeout=timedelta(seconds=cfg["pg_timeout"]), **kwargs)
    # Every rank's side of gloo's full mesh is connected before anyone runs fn: a rank whose fn needs no
    # collective could otherwise return and close its sockets while a peer is still connecting to it
    # ("connectFullMesh failed ... Connection closed by peer", seen on a loaded machine).
    dist.barrier()


def _write(path: str, obj) -> None:
    import cloudpickle

    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        cloudpickle.dump(obj, f)
    os.replace(tmp, path)


def run_rank(rank: int, cfg: dict) -> None:
    """Run the user's function as ``rank``; never returns."""
    code = 1
    tmp = cfg["tmpdir"]
    try:
        _wire_output(rank, cfg)
        _procs.die_with_parent(os.getppid())
        stack_file = open(os.path.join(tmp, f"stack_{rank}.txt"), "w")  # noqa: SIM115 (open until os._exit)
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        _set_rank_env(rank, cfg)
        import cloudpickle
        import torch

        torch.set_num_threads(cfg["threads"])
        with open(os.path.join(tmp, "payload.pkl"), "rb") as f:
            payload = cloudpickle.load(f)
        _install_sources(payload["sources"])
        _init_process_group(rank, cfg)
        _watch.watch_collectives(rank, cfg)  # after init's barrier: the watch counts the function's collectives
        result = payload["fn"](*payload["args"], **payload["kwargs"])
        _write(os.path.join(tmp, f"result_{rank}.pkl"), result)
        _destroy()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        _record_error(tmp, rank, f"SystemExit({exc.code!r})", traceback.format_exc())
    except BaseException as exc:  # report everything, KeyboardInterrupt included
        tb = exc.__traceback__
        tb = (tb.tb_next if tb is not None else None) or tb  # drop this module's own frame
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        _record_error(tmp, rank, f"{type(exc).__name__}: {exc}", text)
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
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


# -- the zygote -----------------------------------------------------------------------------------

def main() -> None:
    cfg = json.loads(sys.argv[-1])
    zygote = os.getpid()

    def stop(signum=None, _frame=None):
        """SIGTERM: the caller's stop(); CALLER_GONE: the caller's thread that started us died (PDEATHSIG)."""
        if os.getpid() != zygote:  # a rank forked before it reset the handler: just die
            os._exit(1)
        _procs.kill_tree(zygote)
        _procs.reap(2.0)
        if signum != signal.SIGTERM:
            # The signal comes when the caller's *thread* exits: when its whole process is gone we are handed
            # to another parent. Then nobody else removes the launch directory: do it here.
            deadline = time.monotonic() + 5.0
            while os.getppid() == cfg["parent_pid"] and time.monotonic() < deadline:
                time.sleep(0.02)
            if os.getppid() != cfg["parent_pid"]:
                shutil.rmtree(cfg["tmpdir"], ignore_errors=True)
        os._exit(0)

    for sig in (signal.SIGTERM, CALLER_GONE):
        signal.signal(sig, stop)
    _procs.prctl(_procs.PR_SET_CHILD_SUBREAPER, 1)  # orphans of the ranks (new sessions too) stay below the zygote
    _procs.die_with_parent(cfg["parent_pid"], CALLER_GONE, on_death=stop)
    import cloudpickle  # noqa: F401
    import torch  # noqa: F401  (imported once, shared by every forked rank)
    import torch.distributed  # noqa: F401

    pids = {}
    for rank in range(cfg["world_size"]):
        pid = os.fork()
        if pid == 0:
            for sig in (signal.SIGTERM, CALLER_GONE):
                signal.signal(sig, signal.SIG_DFL)
            run_rank(rank, cfg)  # never returns
        pids[pid] = rank
        print(f"pid {rank} {pid}", flush=True)
    for fd in cfg["out_fds"] + cfg["err_fds"]:
        os.close(fd)
    while pids:
        pid, status = os.waitpid(-1, 0)
        if pid in pids:  # else an orphan a rank left behind, reparented to us
            print(f"exit {pids.pop(pid)} {_procs.status_code(status)}", flush=True)
    _procs.kill_tree(zygote)  # what the ranks started and left running
    _procs.reap(2.0)


if __name__ == "__main__":
    main()
