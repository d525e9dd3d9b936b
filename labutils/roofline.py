"""Measure the machine: matmul throughput, timings and peak memory. (Taught in chapter 08.)

* :func:`matmul_gflops` times ``(m, k) @ (k, n)`` and returns GFLOP/s: the roofline every MoE design is
  measured against (an MoE layer is, at best, its expert matmuls).
* :func:`bench` times several callables *interleaved* (A B C A B C ...), so a noisy neighbour slows all of them
  alike and their ratios stay meaningful; it keeps every repetition, and callers report the best and the median.
* :func:`peak_memory` is the most memory one call holds at once above what existed before it: CUDA's allocator
  statistics on a GPU, the profiler's allocation events on CPU.
* :func:`machine_info` records where and when a result was measured (stored with every benchmark JSON).
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time

import torch

__all__ = ["sync", "bench", "summarize", "save_result", "matmul_gflops", "peak_memory", "machine_info", "cpu_model",
           "measure_point", "core_breakdown", "labelled_core_steps", "PHASES"]


def sync(device) -> None:
    """Wait for queued GPU work (a no-op on CPU): call before reading a clock."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def bench(fns: dict, reps: int = 5, warmup: int = 1, device="cpu", budget_s: float | None = None) -> dict:
    """Time each ``fns[name]()`` ``reps`` times, interleaved; returns ``{name: [seconds, ...]}``.

    Wall clock, or the thread's CPU time when torch runs one CPU thread (see :func:`_clock`).

    ``budget_s`` stops early (after at least 2 rounds) once the timed rounds have used that many seconds.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    clock = _clock(device)
    start = time.perf_counter()
    for rep in range(reps):
        for name, fn in fns.items():
            sync(device)
            t0 = clock()
            fn()
            sync(device)
            times[name].append(clock() - t0)
        if budget_s is not None and rep >= 1 and time.perf_counter() - start > budget_s:
            break
    return times


def _clock(device="cpu"):
    """Wall clock, except on CPU with ONE torch thread: that thread's CPU time, which other processes sharing the
    cores do not inflate (every op then runs on the calling thread). Same rule as ``labutils.moe.bench``."""
    if torch.device(device).type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def save_result(record: dict, out, root=None) -> str:
    """Write a benchmark record to ``out`` as indented JSON (creating its folder); returns the path to print,
    relative to ``root`` when ``out`` lies under it. The benchmark scripts write their results with it."""
    import pathlib

    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    return str(out.relative_to(root)) if root is not None and out.is_relative_to(root) else str(out)


def summarize(seconds: list) -> dict:
    """Best and median of a list of timings (the best is the least disturbed by other processes)."""
    return {"best_s": min(seconds), "median_s": statistics.median(seconds), "reps": len(seconds)}


def matmul_gflops(m: int, n: int, k: int, dtype=torch.float32, device="cpu", reps: int = 5) -> float:
    """Best-of-``reps`` GFLOP/s of ``(m, k) @ (k, n)`` (2*m*n*k flops) on this machine."""
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    out = torch.empty(m, n, dtype=dtype, device=device)
    inner = max(1, min(1000, int(2e7 / (m * n * k))))  # ~40 MFLOP per timed call: small shapes repeat

    def mm():
        for _ in range(inner):
            torch.mm(a, b, out=out)

    best = bench({"mm": mm}, reps=reps, warmup=2, device=device)["mm"]
    return 2.0 * m * n * k * inner / min(best) / 1e9


def peak_memory(fn, device="cpu") -> int:
    """Peak bytes allocated during ``fn()`` above what was allocated when it started.

    On CUDA: ``torch.cuda.max_memory_allocated``. On CPU: the running sum of the profiler's ``[memory]``
    events (every allocation and free of the CPU allocator, in time order), so temporaries inside the
    backward pass count too. A block allocated under an *earlier* profiler and freed inside this one shows up
    as a free without its allocation, so the peak is taken above the lowest point reached before it.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    from torch.profiler import ProfilerActivity, profile

    from .ds import quiet  # the profiler prints start/stop lines and allocator warnings at the C level

    with quiet(), profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    current = low = peak = 0
    for _, nbytes in events:
        current += nbytes
        low = min(low, current)
        peak = max(peak, current - low)
    return int(peak)


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device="cpu", command: str | None = None) -> dict:
    """Where, when and how a measurement was taken: stored with every benchmark result."""
    device = torch.device(device)
    info = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": command if command is not None else " ".join([os.path.basename(sys.executable)] + sys.argv),
        "device": str(device),
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "clock": "thread CPU time (1 thread)" if _clock(device) is time.thread_time else "wall clock",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_avg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


# ---- one MoE problem, every design side by side --------------------------------------------------
def measure_point(p, names=None, reps: int = 5, memory: bool = True, device="cpu", budget_s: float | None = None,
                  limit: str = "dense") -> list:
    """Time one forward+backward of each design on problem ``p`` (interleaved) and measure its peak memory.

    Returns one dict per design: best/median seconds, tokens/s, useful GFLOP/s, ``ratio`` (limit's best time
    / design's best time, so 1.0 = as fast as the limit), ``ratio_separate`` (same against the E separate MLPs),
    ``kept`` (share of the T*k choices that reached an expert), ``rows`` (rows computed / (T*k): above 1 is
    padding) and ``peak_mb``. A design that raises is reported as ``{"design", "error"}`` instead.
    """
    from .dispatch import build_designs, fwd_bwd

    designs = build_designs(p, names)
    for extra in ("dense", "separate"):
        if extra not in designs:
            designs.update(build_designs(p, [extra]))
    outs, failed = {}, []
    for n, fn in list(designs.items()):  # warm-up, and the kept/rows counts
        try:
            outs[n] = fwd_bwd(fn, p)
        except Exception as exc:  # e.g. a kernel this device lacks: reported, not fatal
            if n in ("dense", "separate"):
                raise
            failed.append({"design": n, "error": f"{type(exc).__name__}: {exc}"[:300]})
            del designs[n]
    times = bench({n: (lambda fn=fn: fwd_bwd(fn, p)) for n, fn in designs.items()}, reps=reps, warmup=0,
                  device=device, budget_s=budget_s)
    best = {n: min(t) for n, t in times.items()}
    rows = []
    for n in designs:
        s = summarize(times[n])
        row = {"design": n, **s, "tokens_per_s": p.T / s["best_s"], "gflops": p.flops() / s["best_s"] / 1e9,
               "ratio": best[limit] / s["best_s"], "ratio_separate": best["separate"] / s["best_s"],
               "kept": outs[n].kept / (p.T * p.top_k), "rows": outs[n].rows / (p.T * p.top_k)}
        if memory:
            p.zero_grad()  # free the previous design's gradients before the measurement starts
            row["peak_mb"] = peak_memory(lambda fn=designs[n]: fwd_bwd(fn, p), device) / 2 ** 20
        rows.append(row)
    return rows + failed


# ---- where the core's time goes ------------------------------------------------------------------
PHASES = ("routing", "dispatch", "expert compute", "combine")
# FMoE.forward's named steps (labutils/moe/layers.py) and the phase each belongs to
_CORE_STEPS = {"route": "routing", "count_by_gate": "routing", "scatter": "dispatch",
               "expert_exchange": "expert compute", "gather": "combine", "combine": "combine"}


@contextlib.contextmanager
def labelled_core_steps():
    """Wrap each named step of the core's ``FMoE.forward`` in ``torch.profiler.record_function(phase)``.

    The core is not edited: its module-level step functions and its two step methods are swapped for labelled
    wrappers for the duration of the block, then restored.
    """
    from torch.profiler import record_function

    from .moe import layers

    def labelled(fn, phase):
        @functools.wraps(fn)
        def step(*args, **kwargs):
            with record_function(phase):
                return fn(*args, **kwargs)
        return step

    saved = {}
    for name, phase in _CORE_STEPS.items():
        owner = layers.FMoE if name in ("route", "expert_exchange") else layers
        saved[(owner, name)] = getattr(owner, name)
        setattr(owner, name, labelled(getattr(owner, name), phase))
    try:
        yield
    finally:
        for (owner, name), fn in saved.items():
            setattr(owner, name, fn)


def _phase_times(events) -> dict:
    """Forward: time inside each phase's labels. Backward: each autograd node's time, charged to the phase
    whose forward op created it (matched by the op's sequence number)."""
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in events if e.name in PHASES]
    walls = {e.name: e.time_range.elapsed_us() for e in events if e.name in ("forward", "backward")}
    seq_phase = {}
    for e in events:
        if e.sequence_nr >= 0 and not e.name.startswith("autograd::engine"):
            for start, end, phase in spans:
                if start <= e.time_range.start <= end:
                    seq_phase[e.sequence_nr] = phase
    fwd = dict.fromkeys(PHASES, 0.0)
    bwd = dict.fromkeys(PHASES, 0.0)
    for start, end, phase in spans:
        fwd[phase] += (end - start) / 1e6
    for e in events:
        if e.name.startswith("autograd::engine::evaluate_function") and e.sequence_nr in seq_phase:
            bwd[seq_phase[e.sequence_nr]] += e.time_range.elapsed_us() / 1e6
    fwd["other"] = walls["forward"] / 1e6 - sum(fwd.values())
    bwd["other"] = walls["backward"] / 1e6 - sum(bwd.values())
    return {"forward": fwd, "backward": bwd}


def core_breakdown(p, reps: int = 3) -> dict:
    """Profile the core's forward+backward on problem ``p`` into routing, dispatch, expert compute, combine.

    Returns ``{"forward": {phase: s}, "backward": {phase: s}, "total": {phase: s}, "profiled_s",
    "unprofiled_s"}``: phases averaged over ``reps`` profiled steps ("other": autograd bookkeeping, reshapes,
    the functional_call that feeds the weights), ``unprofiled_s`` the best of ``reps`` plain steps. The profiler
    adds a few microseconds per op, so ``profiled_s`` is above ``unprofiled_s``; shares are what to read.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    from .dispatch import core, fwd_bwd
    from .ds import quiet

    fwd_bwd(core, p)                                                       # warm-up
    unprofiled = min(bench({"core": lambda: fwd_bwd(core, p)}, reps=reps, warmup=0)["core"])
    runs = []
    with quiet(), labelled_core_steps():
        for _ in range(reps):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                p.zero_grad()
                with record_function("forward"):
                    y = core(p).y
                with record_function("backward"):
                    y.backward(p.grad_y)
            runs.append(_phase_times(prof.events()))
    out = {part: {k: sum(r[part][k] for r in runs) / reps for k in runs[0][part]} for part in ("forward", "backward")}
    out["total"] = {k: out["forward"][k] + out["backward"][k] for k in out["forward"]}
    out["profiled_s"] = sum(out["total"].values())
    out["unprofiled_s"] = unprofiled
    return out
