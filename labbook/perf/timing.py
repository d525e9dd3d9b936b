"""Measure the machine: matmul throughput, timings and peak memory. (Taught in chapter 08.)

* :func:`matmul_gflops` times ``(m, k) @ (k, n)`` and returns GFLOP/s: the roofline every MoE design is
  measured against (an MoE layer is, at best, its expert matmuls).
* :func:`bench` times several callables *interleaved* (A B C A B C ...), so a noisy neighbour slows all of them
  alike and their ratios stay meaningful; it keeps every repetition, and callers report the median and its IQR.
* :func:`run_conditions` states how far a run can be trusted: load against cores, threads, clock, rounds.
* :func:`peak_memory` is the most memory one call holds at once above what existed before it: CUDA's allocator
  statistics on a GPU, the profiler's allocation events on CPU.
* :func:`machine_info` records where and when a result was measured (stored with every benchmark JSON).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

__all__ = ["sync", "clock", "bench", "context_switches", "run_conditions", "describe_conditions", "MIN_ROUNDS",
           "fit_latency_bandwidth", "summarize", "save_result", "matmul_gflops", "peak_memory", "machine_info",
           "cpu_model", "clock_name"]


def sync(device) -> None:
    """Wait for queued GPU work (a no-op on CPU): call before reading a clock."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def context_switches() -> tuple:
    """``(voluntary, involuntary)`` context switches of the calling thread so far (Linux: ``getrusage`` of the
    thread; else of the process). A *voluntary* switch is the thread giving up the core: it sleeps or waits (a
    lock, I/O). An *involuntary* one is the kernel taking the core away: another process was preempting it. On one
    torch thread, a step's wall time minus its CPU time is one or the other; these counts tell which. (With more
    torch threads the caller also waits for its thread pool, which counts as voluntary.)"""
    import resource

    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    r = resource.getrusage(who)
    return r.ru_nvcsw, r.ru_nivcsw


def bench(fns: dict, reps: int = 5, warmup: int = 1, device: str | torch.device = "cpu", budget_s: float | None = None,
          wall: dict | None = None, switches: dict | None = None) -> dict:
    """Time each ``fns[name]()`` ``reps`` times, interleaved; returns ``{name: [seconds, ...]}``.

    Wall clock, or the thread's CPU time when torch runs one CPU thread (see :func:`clock`).

    ``budget_s`` stops early (after at least 2 rounds) once the timed rounds have used that many seconds of THE
    clock (with one thread, CPU time: a loaded machine does not cut the rounds).
    ``wall``: a dict to fill with the same calls' wall-clock times ``{name: [seconds, ...]}`` (with one thread,
    wall minus CPU time is what a step spent waiting: sleeping, or preempted by other processes).
    ``switches``: a dict to fill with each call's ``(voluntary, involuntary)`` context switches
    (:func:`context_switches`): a step that sleeps or waits makes voluntary ones, a preempted step involuntary ones.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    walls = {name: [] for name in fns}
    csw = {name: [] for name in fns}
    now = clock(device)
    start = now()
    for rep in range(reps):
        for name, fn in fns.items():
            sync(device)
            v0, i0 = context_switches()
            w0, t0 = time.perf_counter(), now()
            fn()
            sync(device)
            t1, w1 = now(), time.perf_counter()
            v1, i1 = context_switches()
            times[name].append(t1 - t0)
            walls[name].append(w1 - w0)
            csw[name].append((v1 - v0, i1 - i0))
        if budget_s is not None and rep >= 1 and now() - start > budget_s:
            break
    if wall is not None:
        wall.update(walls)
    if switches is not None:
        switches.update(csw)
    return times


MIN_ROUNDS = 5  # fewer timed rounds than this and a median/IQR says little: such a run is flagged


def run_conditions(rounds: int, min_rounds: int = MIN_ROUNDS, device: str | torch.device = "cpu") -> dict:
    """How trustworthy a timed run is, stated with it: the load average against the cores, the torch threads,
    the clock, the timed rounds against ``min_rounds``, and ``flags``: what makes the run doubtful
    (``"overloaded"``: the 1-minute load exceeds the cores, so a wall-clock run shared them; ``"too few rounds"``).
    With one thread the clock is CPU time, which other processes do not inflate: an overloaded machine is then
    flagged but the timings still stand (see :func:`clock`)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    flags = []
    if load is not None and load > cores:
        flags.append("overloaded")
    if rounds < min_rounds:
        flags.append("too few rounds")
    return {"load_avg_1min": load, "cores": cores, "torch_threads": torch.get_num_threads(),
            "clock": clock_name(device), "rounds": rounds, "min_rounds": min_rounds, "flags": flags,
            "cpu_time": clock(device) is time.thread_time}


def describe_conditions(cond: dict) -> str:
    """One generated line: load, cores, threads, clock, rounds, and what is doubtful about the run."""
    load = "unknown" if cond["load_avg_1min"] is None else f"{cond['load_avg_1min']:.2f}"
    line = (f"load {load} on {cond['cores']} cores, {cond['torch_threads']} torch thread(s), {cond['clock']}, "
            f"{cond['rounds']} timed rounds (minimum {cond['min_rounds']})")
    if not cond["flags"]:
        return line + ": conditions OK"
    why = []
    if "overloaded" in cond["flags"]:
        why.append("OVERLOADED (load above the cores)" + ("; CPU time still stands" if cond["cpu_time"]
                                                             else "; wall-clock times are inflated"))
    if "too few rounds" in cond["flags"]:
        why.append("TOO FEW ROUNDS for a median and IQR")
    return line + ": " + "; ".join(why)


def clock(device: str | torch.device = "cpu"):
    """THE clock of every lab benchmark: wall clock, except on CPU with ONE torch thread, where it is that
    thread's CPU time, which other processes sharing the cores do not inflate (every op then runs on the
    calling thread)."""
    if torch.device(device).type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def clock_name(device: str | torch.device = "cpu") -> str:
    """How :func:`clock` measures here, as stored in every benchmark record."""
    return "thread CPU time (1 thread)" if clock(device) is time.thread_time else "wall clock"


def save_result(record: dict, out, root=None) -> str:
    """Write a benchmark record to ``out`` as indented JSON (creating its folder); returns the path to print,
    relative to ``root`` when ``out`` lies under it. The benchmark scripts write their results with it; the record
    gains ``"code"``, the fingerprint of the lab's loaded modules (:mod:`labbook.records`)."""
    import pathlib

    from labbook.records import fingerprint

    out = pathlib.Path(out)
    record = {**record, "code": record.get("code") or fingerprint()}  # tie the record to the code that made it
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    return str(out.relative_to(root)) if root is not None and out.is_relative_to(root) else str(out)


def quartiles(values) -> tuple:
    """(q1, median, q3) of a list (inclusive method: fine for small samples)."""
    v = sorted(values)
    if len(v) == 1:
        return v[0], v[0], v[0]
    q1, q2, q3 = statistics.quantiles(v, n=4, method="inclusive")
    return q1, q2, q3


def summarize(seconds: list) -> dict:
    """Median (the statistic verdicts use), its IQR as a share of the median, and the best of a list of timings."""
    q1, med, q3 = quartiles(seconds)
    return {"median_s": med, "iqr_pct": 100 * (q3 - q1) / med, "best_s": min(seconds), "reps": len(seconds)}


def paired_ratio(reference: list, times: list) -> tuple:
    """Median and IQR over interleaved rounds of ``reference[i] / times[i]`` (above 1: faster than the reference)."""
    q1, med, q3 = quartiles([r / t for r, t in zip(reference, times)])
    return med, (q1, q3)


def fit_latency_bandwidth(sizes_bytes, seconds) -> dict:
    """Least-squares fit of ``t = latency + bytes / bandwidth`` over every message size (the alpha-beta model).

    Returns ``latency_s``, ``bandwidth_gb_s`` and ``max_rel_error`` (the worst point's relative miss), so a
    reader sees how well two numbers describe the whole curve.
    """
    x = torch.tensor([float(b) for b in sizes_bytes], dtype=torch.float64)
    y = torch.tensor([float(s) for s in seconds], dtype=torch.float64)
    if x.numel() < 2 or x.unique().numel() < 2:
        raise ValueError("fit_latency_bandwidth needs at least two different message sizes")
    A = torch.stack([torch.ones_like(x), x], dim=1)                       # (n, 2)
    latency, per_byte = torch.linalg.lstsq(A, y.unsqueeze(1)).solution.squeeze(1).tolist()
    fitted = latency + per_byte * x
    return {"latency_s": latency, "bandwidth_gb_s": (1.0 / per_byte / 1e9) if per_byte > 0 else float("inf"),
            "max_rel_error": float(((fitted - y).abs() / y).max())}


def matmul_gflops(m: int, n: int, k: int, dtype=torch.float32, device: str | torch.device = "cpu",
                  reps: int = 5) -> float:
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

    from labutils.nbtools import quiet  # the profiler prints start/stop lines and allocator warnings at the C level

    with quiet(), profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        fn()
    kineto = prof.profiler.kineto_results  # pyright: ignore[reportOptionalMemberAccess]  (set once profiling ends)
    cpu = torch.autograd.DeviceType.CPU  # pyright: ignore[reportPrivateImportUsage]
    events = sorted((e.start_ns(), e.nbytes())  # pyright: ignore[reportAttributeAccessIssue]
                    for e in kineto.events()  # pyright: ignore[reportOptionalMemberAccess]
                    if e.name() == "[memory]" and e.device_type() == cpu)
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


def machine_info(device: str | torch.device = "cpu", command: str | None = None) -> dict:
    """Where, when and how a measurement was taken: stored with every benchmark result."""
    device = torch.device(device)
    info = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": command if command is not None else " ".join([os.path.basename(sys.executable)] + sys.argv),
        "device": str(device),
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "clock": clock_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_avg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info
