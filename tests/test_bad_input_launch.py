"""Bad input to the collectives and to ``launch`` gets a clear error on every rank: never a hang, a SIGABRT or
a silently wrong result (issue 19). Two gloo ranks, short timeouts."""

import io
import json
import linecache
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types

import pytest
import torch
import torch.distributed as dist

from labutils import WorkerError, launch
from labutils.agreement import CollectiveMismatch
from labutils.collectives import all_gather, all_gather_same_dim, all_gather_variable_dim, all_to_all

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _try(fn):
    try:
        fn()
    except Exception as exc:  # the test compares the error every rank got
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def collective_cases():
    """Each bad case on both ranks; then a good collective proves the ranks are still in step."""
    rank = dist.get_rank()
    out: dict = {
        "dtype": _try(lambda: all_gather_variable_dim(torch.ones(2, 3, dtype=torch.float32 if rank == 0
                                                                  else torch.int32))),
        "trailing": _try(lambda: all_gather_variable_dim(torch.ones(2, 3 + rank))),
        "sizes": _try(lambda: all_gather_variable_dim(torch.ones(2 + rank, 3), sizes=[3, 3])),
        "dim": _try(lambda: all_gather_variable_dim(torch.ones(2, 3), dim=2)),
        "dim_one_rank": _try(lambda: all_gather_variable_dim(torch.ones(2, 3) if rank == 0 else torch.ones(6),
                                                             dim=1)),
        "zero_d": _try(lambda: all_gather_variable_dim(torch.tensor(1.0))),
        "same_dim": _try(lambda: all_gather_same_dim(torch.ones(2 + rank))),
        "autograd": _try(lambda: all_gather(torch.ones(2, dtype=torch.float64 if rank else torch.float32))),
        # rank 1 expects 3 rows from rank 0, which sends it 2
        "a2a_splits": _try(lambda: all_to_all(torch.ones(3 if rank == 0 else 2, 4),
                                              [1, 1] if rank == 0 else [3, 1], [1, 2] if rank == 0 else [1, 1])),
        "a2a_dtype": _try(lambda: all_to_all(torch.ones(2, 4, dtype=torch.float32 if rank == 0 else torch.float16),
                                             [1, 1], [1, 1])),
        "a2a_local": _try(lambda: all_to_all(torch.ones(2, 4), [1, 1], [2, 1] if rank == 0 else [1, 1])),
    }
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    out["still_in_step"] = t.item()
    # the good paths, checked and unchecked, still give the right answer
    got, sizes = all_gather_variable_dim(torch.full((1 + rank, 2), float(rank)))
    got2, _ = all_gather_variable_dim(torch.full((1 + rank, 2), float(rank)), sizes=[1, 2], check=False)
    out["good"] = (got.tolist(), sizes.tolist(), torch.equal(got, got2))
    y = all_to_all(torch.arange(3.0).unsqueeze(1) + 10 * rank, [1, 2] if rank == 0 else [2, 1],
                   [1, 2] if rank == 0 else [2, 1])
    out["a2a_good"] = y.squeeze(1).tolist()
    return out


@pytest.fixture(scope="module")
def cases():
    return launch(collective_cases, 2, timeout=60)


@pytest.mark.parametrize("case, words", [
    ("dtype", ["CollectiveMismatch", "dtype", "rank 0 torch.float32", "rank 1 torch.int32"]),
    ("trailing", ["CollectiveMismatch", "dims other than dim 0", "rank 0 [3]", "rank 1 [4]"]),
    ("sizes", ["passed sizes=[3, 3]", "[2, 3]"]),
    ("dim", ["IndexError", "dim=2", "ndim=2"]),
    ("dim_one_rank", ["rank 1 passed dim=1", "ndim=1"]),
    ("zero_d", ["CollectiveMismatch", "0-d", "reshape(1)"]),
    ("same_dim", ["all_gather_same_dim", "shape", "rank 0 [2]", "rank 1 [3]"]),
    ("autograd", ["dtype", "torch.float64"]),
    ("a2a_splits", ["all_to_all", "rank 1 expects 3 rows from rank 0", "sends it 2"]),
    ("a2a_dtype", ["all_to_all", "dtype", "torch.float16"]),
    ("a2a_local", ["all_to_all", "rank 0", "input_split_sizes sum to 3 but x has 2 rows"]),
])
def test_collective_bad_input_raises_alike_on_every_rank(cases, case, words):
    msgs = [c[case] for c in cases]
    assert msgs[0] == msgs[1], f"ranks got different errors: {msgs}"
    for w in words:
        assert w in msgs[0], f"{w!r} not in {msgs[0]!r}"
    assert "every rank" in msgs[0]


def test_collective_mismatch_is_a_value_error():
    assert issubclass(CollectiveMismatch, ValueError)


def test_collectives_stay_in_step_and_correct(cases):
    assert [c["still_in_step"] for c in cases] == [3.0, 3.0]
    gathered = [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    assert [c["good"] for c in cases] == [(gathered, [1, 2], True)] * 2
    # rank 0 sends row 0 to itself and rows 1-2 to rank 1; rank 1 sends rows 0-1 (10, 11) to rank 0
    assert [c["a2a_good"] for c in cases] == [[0.0, 10.0, 11.0], [1.0, 2.0, 12.0]]


def gather_mismatched_dtype():
    rank = dist.get_rank()
    return all_gather_variable_dim(torch.ones(2, dtype=torch.float32 if rank == 0 else torch.int32))


def test_collective_mismatch_is_a_worker_error_not_a_crash():
    with pytest.raises(WorkerError) as info:
        launch(gather_mismatched_dtype, 2, timeout=60)
    msg = str(info.value)
    assert "CollectiveMismatch" in msg and "dtype" in msg and "SIG" not in msg
    assert info.value.exitcode == 1


# -- launch's own arguments: refused before anything starts ---------------------------------------------------
def _noop():
    return None


@pytest.mark.parametrize("kwargs, words", [
    (dict(world_size=True), ["world_size", "int >= 1", "True"]),
    (dict(world_size=1.5), ["world_size", "1.5"]),
    (dict(world_size="2"), ["world_size", "'2'"]),
    (dict(world_size=0), ["world_size", "0"]),
    (dict(world_size=2, threads=0), ["threads", "int >= 1", "0"]),
    (dict(world_size=2, threads=True), ["threads", "True"]),
    (dict(world_size=2, timeout=float("nan")), ["timeout", "finite", "nan"]),
    (dict(world_size=2, timeout=float("inf")), ["timeout", "inf"]),
    (dict(world_size=2, timeout="10"), ["timeout", "'10'"]),
    (dict(world_size=2, timeout=-1), ["timeout", "-1"]),
])
def test_bad_launch_numbers_are_value_errors(kwargs, words):
    with pytest.raises(ValueError) as info:
        launch(_noop, **kwargs)
    for w in words:
        assert w in str(info.value)


@pytest.mark.parametrize("env", [{"A": 1}, {1: "a"}, ["A=1"], "A=1"])
def test_env_must_map_str_to_str(env):
    with pytest.raises(TypeError, match="env must be a dict of str -> str"):
        launch(_noop, 2, env=env)


def test_open_file_argument_is_refused(tmp_path):
    with open(tmp_path / "data.txt", "w") as f, pytest.raises(TypeError) as info:
        launch(_noop, 2, f)
    assert "argument 0, an open file" in str(info.value) and "Pass its path" in str(info.value)
    with pytest.raises(TypeError, match="keyword argument 'out', an open file"):
        launch(_noop, 2, out=io.StringIO())


def test_unpicklable_argument_is_named_with_the_reason():
    with pytest.raises(TypeError) as info:
        launch(_noop, 2, 1.0, threading.Lock())
    msg = str(info.value)
    assert "argument 1 (lock)" in msg and "cannot be pickled" in msg and "inside the worker function" in msg
    with pytest.raises(TypeError, match="keyword argument 'gen' \\(generator\\)"):
        launch(_noop, 2, gen=(i for i in range(3)))


def test_fn_kwargs_conflicting_with_direct_keywords():
    with pytest.raises(TypeError, match="both in fn_kwargs and directly"):
        launch(_noop, 2, fn_kwargs={"x": 1}, x=2)
    with pytest.raises(TypeError, match="fn_kwargs must be a dict"):
        launch(_noop, 2, fn_kwargs=[("x", 1)])


def test_default_timeout_is_shorter_in_a_notebook(monkeypatch):
    from labutils import launcher

    assert launcher.default_timeout() == 300.0 and not launcher.in_notebook()

    class Shell:
        kernel = object()

    fake = types.ModuleType("IPython")
    fake.get_ipython = Shell  # pyright: ignore[reportAttributeAccessIssue]
    monkeypatch.setitem(sys.modules, "IPython", fake)
    assert launcher.in_notebook() and launcher.default_timeout() == 120.0
    seen = {}

    class Stop(Exception):
        pass

    def fake_run(world_size, backend, timeout, *rest):
        seen["timeout"] = timeout
        raise Stop

    monkeypatch.setattr(launcher, "_Run", fake_run)
    with pytest.raises(Stop):
        launch(_noop, 2)
    assert seen["timeout"] == 120.0
    assert "120 s inside a Jupyter kernel" in (launch.__doc__ or "")


def test_payload_ships_only_the_cells_the_function_uses():
    from labutils.launcher import _payload

    used, other = "/tmp/ipykernel_1/101.py", "/tmp/ipykernel_1/102.py"
    code = compile("def from_cell(x):\n    return x + 1\n", used, "exec")
    namespace: dict = {}
    exec(code, namespace)
    linecache.cache[used] = (1, None, ["def from_cell(x):\n", "    return x + 1\n"], used)
    linecache.cache[other] = (1, None, ["password = 'hunter2'\n"], other)
    try:
        payload = pickle.loads(_payload(namespace["from_cell"], (1,), {}))
    finally:
        linecache.cache.pop(used, None)
        linecache.cache.pop(other, None)
    assert set(payload["sources"]) == {used}
    assert payload["fn"](1) == 2


# -- stale launch directories ----------------------------------------------------------------------------------
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_sweep_removes_only_directories_whose_owner_died(tmp_path):
    from labutils.launcher import _start_time, sweep_stale_dirs

    dead, alive, foreign, torn = (tmp_path / f"labutils-launch-{n}" for n in ("dead", "alive", "noowner", "torn"))
    for d in (dead, alive, foreign, torn):
        d.mkdir()
        (d / "payload.pkl").write_bytes(b"secret")
    (torn / "owner.json").write_text('{"pi')  # being written by a launch starting right now: not judged
    (dead / "owner.json").write_text(json.dumps({"pid": _dead_pid(), "start": "1"}))
    (alive / "owner.json").write_text(json.dumps({"pid": os.getpid(), "start": _start_time(os.getpid())}))
    assert sweep_stale_dirs(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and alive.exists() and foreign.exists() and torn.exists()
    # a live pid whose start time differs is a reused pid: its directory is stale too
    (alive / "owner.json").write_text(json.dumps({"pid": os.getpid(), "start": "0"}))
    assert sweep_stale_dirs(str(tmp_path)) == [str(alive)]


def test_directory_of_a_killed_caller_is_swept_by_the_next_launch(tmp_path, monkeypatch):
    script = ("import time\nfrom labutils import launch\n"
              "def sleeper():\n    time.sleep(600)\n"
              "launch(sleeper, 2, timeout=300)\n")
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=str(tmp_path))
    deadline = time.monotonic() + 60
    dirs: list = []
    while time.monotonic() < deadline and not dirs:
        dirs = [p for p in tmp_path.glob("labutils-launch-*") if (p / "payload.pkl").exists()]
        time.sleep(0.2)
    assert dirs, "the launch never wrote its payload"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert dirs[0].exists()  # SIGKILL: the caller could not clean up
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert launch(_noop, 1) == [None]
    assert not dirs[0].exists()
    assert list(tmp_path.glob("labutils-launch-*")) == []  # and the new launch cleaned up its own


# -- ranks that leave, die or call different collectives --------------------------------------------------------
def leave_early(how):
    if dist.get_rank() == 1:
        if how == "exit":
            sys.exit(0)
        return "left"
    t = torch.ones(3)
    dist.all_reduce(t)  # rank 1 never comes: gloo says only "Connection closed by peer"
    return "stayed"


@pytest.mark.parametrize("how, words", [("return", "rank 1 returned from the function (exit code 0)"),
                                        ("exit", "rank 1 called sys.exit(0) (exit code 0)")])
def test_rank_that_left_first_is_named(how, words):
    with pytest.raises(WorkerError) as info:
        launch(leave_early, 2, how, timeout=60)
    msg = str(info.value)
    assert msg.startswith(words) and "still waited for it in a collective" in msg, msg
    assert info.value.rank == 1 and info.value.exitcode == 0
    assert "then rank 0 raised" in msg


def exit_without_collective():
    if dist.get_rank() == 1:
        sys.exit(0)
    return 0


def test_sys_exit_zero_without_result_is_named():
    with pytest.raises(WorkerError, match=r"rank 1 exited with code 0 but left no result: it called sys.exit\(0\)"):
        launch(exit_without_collective, 2, timeout=60)


def killed_after_a_word():
    if dist.get_rank() == 1:
        print("rank 1's last words before the signal", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1)
    dist.all_reduce(t)


def test_killed_rank_shows_its_last_stderr_lines():
    with pytest.raises(WorkerError) as info:
        launch(killed_after_a_word, 2, timeout=60)
    msg = str(info.value)
    assert info.value.rank == 1 and "killed by SIGKILL" in msg
    assert "--- last stderr lines of rank 1 ---\nrank 1's last words before the signal" in msg


def mismatched_collectives():
    t = torch.ones(3)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, 0)
    return t.sum().item()


def test_debug_detects_mismatched_collectives_at_once():
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="Detected mismatch between collectives") as info:
        launch(mismatched_collectives, 2, timeout=120, debug=True)
    assert time.monotonic() - t0 < 60, "debug=True must report the mismatch, not wait for the timeout"
    assert "ALLREDUCE" in str(info.value) and "BROADCAST" in str(info.value)


def test_timeout_message_suggests_debug():
    with pytest.raises(WorkerError, match=r"launch\(\.\.\., debug=True\)"):
        launch(mismatched_collectives, 2, timeout=4)


def kwargs_named_like_launch(*, threads, timeout, env, backend):
    return threads, timeout, env, backend


def test_fn_kwargs_reach_the_function_unchanged():
    got = launch(kwargs_named_like_launch, 2, timeout=60,
                 fn_kwargs={"threads": 7, "timeout": 0.5, "env": {"A": "1"}, "backend": "mine"})
    assert got == [(7, 0.5, {"A": "1"}, "mine")] * 2
