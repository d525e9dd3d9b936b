"""labutils.launch: results, errors, timeouts, no orphans, loopback-only, threads, torchrun entry."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
from launch_helpers import new_tag, tagged_pids, wait_gone

from labutils import WorkerError, launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sum_ranks(scale):
    t = torch.tensor([dist.get_rank() + 1.0]) * scale
    dist.all_reduce(t)
    return t.item()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_all_reduce_results(world_size):
    expected = 10.0 * world_size * (world_size + 1) / 2
    assert launch(sum_ranks, world_size, 10.0) == [expected] * world_size


class Box:
    def __init__(self, rank):
        self.rank = rank


def rich_results(n, *, offset):
    rank = dist.get_rank()
    return {"rank": rank, "tensor": torch.arange(n) + rank + offset, "box": Box(rank)}


def test_returns_tensors_dicts_classes_and_kwargs():
    out = launch(rich_results, 2, 3, offset=100)
    assert [o["rank"] for o in out] == [0, 1]
    assert torch.equal(out[1]["tensor"], torch.tensor([101, 102, 103]))
    assert isinstance(out[0]["box"], Box) and out[1]["box"].rank == 1


def print_lines():
    print(f"hello from {dist.get_rank()}")
    print(f"problem on {dist.get_rank()}", file=sys.stderr)
    return None


def test_output_prefixed_with_rank(capfd):
    launch(print_lines, 2)
    out, err = capfd.readouterr()
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out
    assert "[rank 1] problem on 1" in err


def raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 would wait here forever without the launcher
    return t


def test_raising_rank_is_reported_quickly_with_traceback():
    tag = new_tag()
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(raise_on_rank_one, 2, env=tag, timeout=60)
    assert time.monotonic() - t0 < 15, "a failing rank must stop the launch within seconds, not at the timeout"
    err = info.value
    assert err.rank == 1 and "ValueError: rank one is unhappy" in str(err)
    assert 'raise ValueError("rank one is unhappy")' in err.remote_traceback  # source line included
    assert wait_gone(tag) == []


def die(how):
    if dist.get_rank() == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), getattr(signal, how))
    t = torch.ones(1)
    dist.all_reduce(t)


@pytest.mark.parametrize("how,code", [("exit", 3), ("SIGKILL", -9), ("SIGSEGV", -11)])
def test_dying_rank_reports_code_or_signal(how, code):
    tag = new_tag()
    with pytest.raises(WorkerError) as info:
        launch(die, 2, how, env=tag, timeout=60)
    assert info.value.rank == 1 and info.value.exitcode == code
    assert (how if how != "exit" else "exited with code 3") in str(info.value)
    assert wait_gone(tag) == []


def never_reach_collective():
    if dist.get_rank() == 1:
        time.sleep(600)
    t = torch.ones(1)
    dist.all_reduce(t)


def test_stuck_rank_times_out_with_stacks():
    tag = new_tag()
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(never_reach_collective, 2, env=tag, timeout=6)
    assert time.monotonic() - t0 < 20
    stacks = info.value.stacks
    assert set(stacks) == {0, 1}
    assert "in all_reduce" in stacks[0] and "never_reach_collective" in stacks[0]
    assert "time.sleep" in stacks[1] or "in never_reach_collective" in stacks[1]
    assert wait_gone(tag) == []


def report_threads():
    return torch.get_num_threads()


def test_threads_split_between_ranks():
    cores = len(os.sched_getaffinity(0))
    assert launch(report_threads, 2) == [max(1, cores // 2)] * 2
    assert launch(report_threads, 2, threads=1) == [1, 1]


def listening_addresses():
    """Local addresses of this process's listening TCP sockets (from /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                    found.append(cols[1].split(":")[0])
    t = torch.ones(1)
    dist.all_reduce(t)
    return found


def test_listens_on_loopback_only():
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1
    for addrs in launch(listening_addresses, 2):
        assert addrs, "expected gloo to listen somewhere"
        assert set(addrs) <= loopback, f"a rank listens beyond loopback: {addrs}"


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="world_size"):
        launch(sum_ranks, 0, 1.0)
    with pytest.raises(ValueError, match="backend"):
        launch(sum_ranks, 2, 1.0, backend="mpi")
    with pytest.raises(ValueError, match="timeout"):
        launch(sum_ranks, 2, 1.0, timeout=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_nccl_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        launch(sum_ranks, 2, 1.0, backend="nccl")


def _raise():
    raise RuntimeError("no process started in this test")


def _gpus(monkeypatch, n):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_nccl_with_fewer_gpus_than_ranks_is_refused_before_any_rank_starts(monkeypatch):
    """Issue 40: on one GPU, `launch(fn, 2, backend="nccl")` failed in both ranks only once NCCL saw a duplicate
    GPU. Now it is refused up front, naming both numbers, and no worker process starts."""
    import labutils.launcher._run as run
    started = []
    monkeypatch.setattr(run.subprocess, "Popen", lambda *a, **k: started.append(a))  # how a launch starts ranks
    _gpus(monkeypatch, 1)
    with pytest.raises(ValueError, match=r"^launch\(world_size=2, backend='nccl'\) needs one GPU per rank: 2 ranks "
                                        r"but torch\.cuda\.device_count\(\) = 1 GPU\(s\) visible; use "
                                        r"backend='gloo' \(CPU\) or world_size <= 1$"):
        launch(sum_ranks, 2, 1.0, backend="nccl", timeout=5)
    assert not started
    with pytest.raises(RuntimeError):                  # negative control: a gloo launch does reach Popen
        monkeypatch.setattr(run.subprocess, "Popen", lambda *a, **k: started.append(a) or _raise())
        launch(os.getpid, 2, backend="gloo", timeout=5)
    assert len(started) == 1
    _gpus(monkeypatch, 0)
    with pytest.raises(RuntimeError, match="needs CUDA GPUs; none is available here"):
        launch(sum_ranks, 2, 1.0, backend="nccl", timeout=5)


def test_the_gpu_count_check_passes_with_a_gpu_per_rank(monkeypatch):
    """Negative control of the refusal: with 2 GPUs for 2 ranks `choose` lets NCCL through, and `auto` picks it."""
    from labutils.launcher.backend import choose
    _gpus(monkeypatch, 2)
    assert choose("nccl", 2, threads=1) == ("nccl", 1) and choose("auto", 2, threads=1) == ("nccl", 1)
    assert choose("auto", 3, threads=1) == ("gloo", 1)       # auto never asks for more GPUs than there are


@pytest.mark.parametrize("gpus, want", [
    (0, ("gloo", "cpu", "gloo on the CPU: no CUDA GPU visible (2 rank(s))")),
    (1, ("gloo", "cpu", "gloo on the CPU: 1 CUDA GPU(s) visible, 2 rank(s) need 2")),
    (2, ("nccl", "cuda", "NCCL on CUDA: 2 GPU(s) visible for 2 rank(s)")),
])
def test_gpu_or_cpu_says_which_and_why(monkeypatch, gpus, want):
    from labutils.launcher.backend import gpu_or_cpu
    _gpus(monkeypatch, gpus)
    assert gpu_or_cpu(2) == want


def nccl_sum():
    t = torch.ones(1, device="cuda") * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return dist.get_backend(), t.item()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL path needs 2 CUDA GPUs")
def test_nccl_backend_on_gpus():
    assert launch(nccl_sum, 2) == [("nccl", 3.0)] * 2


SCRIPT = textwrap.dedent("""
    import signal, sys, time, torch, torch.distributed as dist
    # a Jupyter kernel turns SIGINT into KeyboardInterrupt; a process started from a shell's background job
    # (CI scripts often are) inherits SIGINT *ignored*, and Python then leaves it ignored: install it explicitly
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {root!r})
    from labutils import launch
    def stuck():
        t = torch.ones(1)
        if dist.get_rank() == 1:
            time.sleep(600)
        dist.all_reduce(t)
    print("launching", flush=True)
    launch(stuck, 2, timeout=300)
""")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_interrupted_or_killed_caller_leaves_no_orphans(tmp_path, sig):
    """SIGINT is a notebook's kernel interrupt; SIGKILL is a kernel that dies."""
    tag = new_tag()
    script = tmp_path / "caller.py"
    script.write_text(SCRIPT.format(root=ROOT))
    proc = subprocess.Popen([sys.executable, str(script)], env={**os.environ, **tag}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "launching"
    deadline = time.monotonic() + 30
    while len(tagged_pids(tag)) < 4 and time.monotonic() < deadline:  # caller, zygote, two ranks
        time.sleep(0.2)
    assert len(tagged_pids(tag)) >= 4
    time.sleep(1.0)
    proc.send_signal(sig)
    proc.wait(timeout=20)
    if sig == signal.SIGINT:
        assert "KeyboardInterrupt" in proc.stderr.read()
    assert wait_gone(tag, 10) == [], "workers outlived their caller"


def test_torchrun_entry_runs_the_same_function(tmp_path):
    (tmp_path / "workermod.py").write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        def sum_ranks(scale):
            t = torch.tensor([dist.get_rank() + 1.0]) * scale
            dist.all_reduce(t)
            return t.item()
    """))
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = subprocess.run([torchrun, "--nproc-per-node", "2", "-m", "labutils.torchrun", "workermod:sum_ranks", "10.0"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "result[0] = 30.0" in out.stdout and "result[1] = 30.0" in out.stdout
