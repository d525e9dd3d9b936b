"""Run a function on local distributed workers from a notebook cell. (Taught in chapter 00.)

    from . import launch

    def hello(scale):
        import torch, torch.distributed as dist
        t = torch.tensor([dist.get_rank() + 1.0]) * scale
        dist.all_reduce(t)
        return t.item()

    launch(hello, 4, 10.0)   # -> [100.0, 100.0, 100.0, 100.0]

How it works (and why): `torch.multiprocessing.spawn` cannot unpickle a function defined in a notebook,
`fork` of the kernel deadlocks once it has run a matmul and cannot carry CUDA, and `torchrun` is slow and
orphans workers when killed. So `launch` ships the function *by value* (cloudpickle) to a fresh
interpreter (``_worker.py`` of this package) that imports torch once and forks one process per rank before any
tensor op runs. Ranks meet through a FileStore in a temporary directory: no port is chosen by us, so no race, and
gloo is bound to the loopback interface. Each rank's output appears in the cell prefixed with its rank.
A rank that raises or dies stops the whole launch within about a second with a `WorkerError`; a rank
stuck at the timeout is reported with its Python stack; ranks waiting in different collectives (rank 0
all_reduce, rank 1 all_gather) are reported after ``MISMATCH_S`` seconds, each rank's call named. Nothing
outlives the call: the ranks die with the zygote, and the zygote, a subreaper, kills every process below it
(a rank's child in a new session too) when the ranks are done, when the launch stops, or when the caller
dies, and then removes the launch directory of a dead caller; a directory left anyway (the zygote killed
too) is swept by the next launch, which checks whether its owner process is still alive.

The same function runs unchanged under torchrun through ``python -m labutils.torchrun`` (see that module).

This package is the launch wing (0.3.0; before, its modules sat at the top of ``labutils``, whose old paths forward
until 1.0.0). Its ``__init__`` checks the call and ships it; the rest is one idea per file: ``_run`` (the zygote,
its pipes and events, the wait, the stop), ``_failures`` (results, ``WorkerError`` and its messages), ``_launchdir``
(the launch directory and its owner), ``backend`` (the backend and threads, as torchrun's), and on the ranks' side
``_worker`` (the zygote and each rank, started by file path), ``_procs`` and ``_watch`` (loaded by it by path).
"""
from __future__ import annotations

import inspect
import io
import linecache
import math
import numbers
import sys

from .._deprecate import forward_moved
from ..optional import HINTS
from ._failures import MISMATCH_S, WorkerError  # noqa: F401  (MISMATCH_S: here for the tests and tools)
from ._launchdir import TMP_PREFIX, _start_time, sweep_stale_dirs  # noqa: F401  (the same)
from ._run import Run as _Run
from .backend import choose

__all__ = ["launch", "WorkerError", "worker_info"]
forward_moved(__name__)  # its re-exports' old addresses warn (labutils._deprecate)

NOTEBOOK_TIMEOUT_S, SCRIPT_TIMEOUT_S = 120.0, 300.0  # the default timeout inside a Jupyter kernel / elsewhere


def _cloudpickle():
    """cloudpickle, imported when a launch needs it (``import labutils`` and ``labutils.moe`` work without)."""
    try:
        import cloudpickle
    except ImportError as exc:
        raise ImportError(f"launch needs cloudpickle to ship a function to its workers, and it cannot be "
                          f"imported ({exc}): {HINTS['cloudpickle']}") from exc
    return cloudpickle


def in_notebook() -> bool:
    """True inside a Jupyter (IPython) kernel."""
    shell = sys.modules.get("IPython")
    get_ipython = getattr(shell, "get_ipython", None)
    ip = get_ipython() if callable(get_ipython) else None
    return ip is not None and getattr(ip, "kernel", None) is not None


def default_timeout() -> float:
    """The timeout of a launch that names none: 120 s in a notebook kernel (a hang blocks the notebook, and
    the book's workers take seconds), 300 s elsewhere."""
    return NOTEBOOK_TIMEOUT_S if in_notebook() else SCRIPT_TIMEOUT_S


def worker_info() -> dict:
    """Rank, world size, backend and device of the calling worker (for use inside ``fn``)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("worker_info() describes the rank it runs on, and no torch.distributed process group "
                           "is initialised here: call it inside the function you run with "
                           "labutils.launch(fn, world_size) (or under python -m labutils.torchrun), not in the "
                           "notebook or script that starts the launch")
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "backend": backend, "device": device}


def _cell_sources() -> dict:
    """Notebook cells live only in linecache (ipykernel files, <ipython-input-...>): ship them along."""
    return {name: entry[2] for name, entry in list(linecache.cache.items())
            if len(entry) >= 3 and ("ipykernel_" in name or name.startswith("<ipython-input"))}


def _payload(fn, args: tuple, kwargs: dict) -> bytes:
    """cloudpickle of ``{fn, args, kwargs, sources}``; ``sources`` holds only the notebook cells the pickled
    code refers to (for tracebacks), never the rest of the session's cells. Unpicklable arguments are named."""
    cloudpickle = _cloudpickle()
    call = {"fn": fn, "args": args, "kwargs": kwargs}
    try:
        body = cloudpickle.dumps(call)
    except Exception as exc:
        raise TypeError(_unpicklable(cloudpickle, call, exc)) from exc
    sources = {name: lines for name, lines in _cell_sources().items() if name.encode() in body}
    return cloudpickle.dumps({**call, "sources": sources})


def _unpicklable(cloudpickle, call: dict, exc: Exception) -> str:
    """Which of fn / args / kwargs cannot be pickled, and why."""
    parts = [("fn", call["fn"])] + [(f"argument {i} ({type(a).__name__})", a) for i, a in enumerate(call["args"])]
    parts += [(f"keyword argument {k!r} ({type(v).__name__})", v) for k, v in call["kwargs"].items()]
    for what, value in parts:
        try:
            cloudpickle.dumps(value)
        except Exception as why:
            return (f"launch cannot send {what} to the workers: it cannot be pickled ({type(why).__name__}: "
                    f"{why}). Workers are separate processes: pass plain data (tensors, numbers, dicts) and "
                    "create locks, open files, sockets or generators inside the worker function")
    return f"launch cannot pickle the call for the workers: {type(exc).__name__}: {exc}"


def _check_arguments(world_size, timeout, threads, env, args, kwargs) -> float:
    """Every argument of ``launch`` checked before anything starts; returns the timeout in seconds."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1 (the number of ranks), got {world_size!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be an int >= 1 (torch threads per rank) or None, got {threads!r}")
    if timeout is None:
        timeout = default_timeout()
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not math.isfinite(timeout) \
            or timeout <= 0:
        raise ValueError(f"timeout must be a finite number of seconds > 0 (a launch must never hang), "
                         f"got {timeout!r}")
    if env is not None and (not isinstance(env, dict)
                            or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        bad = env if not isinstance(env, dict) else {k: v for k, v in env.items()
                                                    if not (isinstance(k, str) and isinstance(v, str))}
        raise TypeError(f"env must be a dict of str -> str (environment variables for the ranks), got {bad!r}")
    for what, value in [(f"argument {i}", a) for i, a in enumerate(args)] + \
                       [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]:
        if isinstance(value, io.IOBase):
            raise TypeError(f"launch cannot send {what}, an open file ({value!r}), to the workers: each worker "
                            "would get a copy or nothing, never the same file. Pass its path and open it in the "
                            "worker function")
    return float(timeout)


def _check_call(fn, world_size, args: tuple, kwargs: dict, own: dict) -> None:
    """``fn(*args, **kwargs)`` must bind to ``fn``'s signature before any process starts. A parameter of ``fn``
    named like one of launch's own keywords (``own``: those given) that nothing fills gets pointed to
    ``fn_kwargs``: ``launch(fn, 2, threads=1)`` sets launch's threads, not fn's."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable without a signature: the ranks will tell
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        taken = {k: v for k, v in own.items() if k in sig.parameters and k not in kwargs}
        if taken:
            given = ", ".join(f"{k}={v!r}" for k, v in taken.items())
            raise TypeError(
                f"launch(fn, {world_size}, {given}): {given} went to launch itself (its own "
                f"keyword{'s' if len(taken) > 1 else ''}: {', '.join(taken)}), so {name}{sig} gets no "
                f"{', '.join(repr(k) for k in taken)} ({exc}). To pass {'them' if len(taken) > 1 else 'it'} to "
                f"fn, use fn_kwargs: launch(fn, {world_size}, fn_kwargs={taken!r})") from None
        raise TypeError(f"launch cannot call {name}{sig} with the arguments given: {exc} "
                        f"({len(args)} positional, keywords {sorted(kwargs)}); nothing was started") from None


def launch(fn, world_size: int, *args, backend: str = "auto", timeout: float | None = None,
           threads: int | None = None, env: dict | None = None, debug: bool = False, fn_kwargs: dict | None = None,
           **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` local ranks with torch.distributed initialised.

    Returns the list of per-rank return values (tensors, dicts, notebook-defined classes...). They are
    unpickled in the caller: a value of a module only the ranks can import raises a WorkerError naming the rank
    and the module (return plain data).
    ``backend``: "auto" (NCCL when CUDA has enough GPUs, else gloo), "gloo" or "nccl".
    ``timeout``: seconds for the whole call, a finite number > 0; stuck ranks are then reported with their
    stacks. Default: 120 s inside a Jupyter kernel (a hung cell blocks the notebook), 300 s elsewhere.
    ``threads``: torch threads per rank, an int >= 1 (default: cores // world_size, at least 1).
    ``env``: extra environment variables for the ranks, a dict of str -> str. Its ``PYTHONPATH`` is added to
    the path launch gives the ranks, never replaces it: the ranks get this package's folder (whatever the
    package is called: a renamed coursework copy too), then ``env["PYTHONPATH"]``'s entries, then the caller's
    ``sys.path``, so they import what the caller imports, plus what ``env`` adds.
    ``debug=True``: torch checks, before each collective, that every rank calls the same one with the same
    shapes and dtypes (``TORCH_DISTRIBUTED_DEBUG=DETAIL``): a mismatch (rank 0 all_reduce, rank 1 broadcast)
    raises at once instead of hanging to the timeout. Costs an extra exchange per collective. Without it, ranks
    that sit ``MISMATCH_S`` (2) seconds in different collectives of the default group are still reported, each
    rank's call named (the collective watch: each rank publishes the collective it is in, see _worker.py).
    ``fn_kwargs``: keyword arguments for ``fn``, for a function whose keywords are named like launch's own
    (``launch(fn, 2, fn_kwargs={"timeout": 5})`` calls ``fn(timeout=5)``); merged with ``**kwargs``. A call
    that does not fit ``fn``'s signature is refused before anything starts (a TypeError that points to
    ``fn_kwargs`` when one of launch's own keywords took the value ``fn`` needed).
    Arguments travel by pickle (cloudpickle): each rank gets its own copy; open files are refused.
    Raises WorkerError naming the first failing rank with its remote traceback (a rank that returned, called
    ``sys.exit`` or exited without returning (``os._exit(0)``) while the others waited for it in a collective
    is named as the one that left, with what it did).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if fn_kwargs is not None:
        if not isinstance(fn_kwargs, dict) or not all(isinstance(k, str) for k in fn_kwargs):
            raise TypeError(f"fn_kwargs must be a dict of keyword arguments for fn, got {fn_kwargs!r}")
        both = sorted(set(fn_kwargs) & set(kwargs))
        if both:
            raise TypeError(f"keyword arguments {both} given both in fn_kwargs and directly")
        kwargs = {**kwargs, **fn_kwargs}
    own = {name: value for name, value, default in (("backend", backend, "auto"), ("timeout", timeout, None),
                                                    ("threads", threads, None), ("env", env, None),
                                                    ("debug", debug, False)) if value != default}
    timeout = _check_arguments(world_size, timeout, threads, env, args, kwargs)
    if not isinstance(debug, bool):
        raise TypeError(f"debug must be True or False, got {debug!r}")
    backend, threads = choose(backend, world_size, threads)  # the same choice as under torchrun
    payload = _payload(fn, args, kwargs)
    _check_call(fn, world_size, args, kwargs, own)
    run = _Run(world_size, backend, timeout, threads, env, debug)
    try:
        run.start(payload)
        return run.wait()
    finally:
        run.stop()
