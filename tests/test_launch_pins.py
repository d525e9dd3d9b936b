"""launch() and its helpers pinned without starting a rank (issue 38: mutation testing of ``launcher/__init__``).

Every test here runs in the pytest process: ``labutils.launcher._Run`` (what starts the zygote and the ranks) is
replaced by a recorder, so each check of ``launch`` is seen up to the moment a real launch would start, with the
exact arguments the run would get. Error messages are compared in full (mutmut turns each literal into
``"XX...XX"``), defaults by a behaviour that would differ. What needs real ranks (the zygote, the wait, the
reports) is in test_launch.py and the other ``dist`` files. No process group is left initialised."""
from __future__ import annotations

import functools
import inspect
import io
import linecache
import pickle
import sys
import types

import pytest
import torch
import torch.distributed as dist

from labutils import launcher
from labutils.launcher import backend as launch_backend
from labutils.optional import HINTS


def _noop():
    return None


def two(a, b=0, *, c=1):
    return a + b + c


def takes_threads(threads):
    return threads


def takes_several(backend, timeout, threads, env, debug):
    return backend


def takes_debug(debug):
    return debug


def takes_backend(backend):
    return backend


class FakeRun:
    """Stands for ``_run.Run``: records what launch gives it, and the order of start / wait / stop."""

    made: list = []

    def __init__(self, *args):
        self.args, self.events = args, []
        FakeRun.made.append(self)

    def start(self, payload):
        self.events.append("start")
        self.payload = payload

    def wait(self):
        self.events.append("wait")
        return ["result of rank 0", "result of rank 1"]

    def stop(self):
        self.events.append("stop")


@pytest.fixture
def runs(monkeypatch):
    """``launch`` records its would-be run instead of starting processes; returns the list of runs made."""
    FakeRun.made = []
    monkeypatch.setattr(launcher, "_Run", FakeRun)
    monkeypatch.setattr(launch_backend, "threads_per_rank", lambda world_size: 100 + world_size)
    before = dist.is_available() and dist.is_initialized()   # a group an earlier test left is not this test's
    yield FakeRun.made
    assert before or not (dist.is_available() and dist.is_initialized()), "this test left a process group initialised"


def _message(excinfo) -> str:
    return str(excinfo.value)


# -- what a good call hands to the run ----------------------------------------------------------------------------

def test_a_good_call_gives_the_run_every_setting_then_starts_waits_stops(runs):
    out = launcher.launch(two, 2, 5, backend="gloo", timeout=7, threads=3, env={"A": "1"}, b=4)
    assert out == ["result of rank 0", "result of rank 1"]
    assert len(runs) == 1
    assert runs[0].args == (2, "gloo", 7.0, 3, {"A": "1"}, False)
    assert type(runs[0].args[2]) is float
    assert runs[0].events == ["start", "wait", "stop"]
    call = pickle.loads(runs[0].payload)
    assert call == {"fn": two, "args": (5,), "kwargs": {"b": 4}, "sources": {}}


def test_defaults_auto_backend_machine_threads_script_timeout_no_env_no_debug(runs, monkeypatch):
    seen = []

    def choose(backend, world_size, threads=None):
        seen.append((backend, world_size, threads))
        return "gloo", 11

    monkeypatch.setattr(launcher, "choose", choose)
    monkeypatch.delitem(sys.modules, "IPython", raising=False)
    launcher.launch(_noop, 3)
    assert seen == [("auto", 3, None)]
    assert runs[0].args == (3, "gloo", 300.0, 11, None, False)
    launcher.launch(_noop, 2, backend="nccl", threads=4, debug=True)
    assert seen[-1] == ("nccl", 2, 4)
    assert runs[1].args == (2, "gloo", 300.0, 11, None, True)


def test_the_real_backend_choice_reaches_the_run(runs, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    launcher.launch(_noop, 2)
    launcher.launch(_noop, 1, threads=5)
    launcher.launch(_noop, 2, backend="gloo", threads=1)
    assert [r.args[:4] for r in runs] == [(2, "gloo", 300.0, 102), (1, "gloo", 300.0, 5), (2, "gloo", 300.0, 1)]


def test_the_run_is_stopped_even_when_its_wait_raises(runs, monkeypatch):
    class Boom(Exception):
        pass

    def wait(self):
        self.events.append("wait")
        raise Boom

    monkeypatch.setattr(FakeRun, "wait", wait)
    with pytest.raises(Boom):
        launcher.launch(_noop, 2)
    assert runs[0].events == ["start", "wait", "stop"]


def test_keywords_and_fn_kwargs_are_merged_into_the_payload(runs):
    launcher.launch(two, 2, 1, fn_kwargs={"c": 3}, b=2)
    assert pickle.loads(runs[0].payload)["kwargs"] == {"b": 2, "c": 3}
    launcher.launch(takes_threads, 2, threads=4, fn_kwargs={"threads": 9})
    assert pickle.loads(runs[1].payload)["kwargs"] == {"threads": 9}
    assert runs[1].args[3] == 4                                       # launch's own threads stay launch's
    assert len(runs) == 2


def test_valid_edge_values_are_accepted(runs):
    launcher.launch(_noop, 1, timeout=0.5, threads=1)
    launcher.launch(_noop, 2, timeout=1e6, env={})
    launcher.launch(print, 2)                                          # a builtin with a signature
    assert [r.args[2] for r in runs] == [0.5, 1e6, 300.0]


# -- argument checks: the full messages -----------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [0, -1, True, False, 1.0, "2", None])
def test_world_size_must_be_a_positive_int(runs, world_size):
    with pytest.raises(ValueError) as excinfo:
        launcher.launch(_noop, world_size)
    assert _message(excinfo) == f"world_size must be an int >= 1 (the number of ranks), got {world_size!r}"
    assert runs == []


@pytest.mark.parametrize("threads", [0, -2, True, False, 1.5, "1"])
def test_threads_must_be_a_positive_int_or_none(runs, threads):
    with pytest.raises(ValueError) as excinfo:
        launcher.launch(_noop, 2, threads=threads)
    assert _message(excinfo) == f"threads must be an int >= 1 (torch threads per rank) or None, got {threads!r}"
    assert runs == []


@pytest.mark.parametrize("timeout", [0, 0.0, -1, -1e-9, True, False, float("inf"), float("-inf"), float("nan"), "5",
                                     [5]])
def test_timeout_must_be_a_finite_positive_number(runs, timeout):
    with pytest.raises(ValueError) as excinfo:
        launcher.launch(_noop, 2, timeout=timeout)
    assert _message(excinfo) == (f"timeout must be a finite number of seconds > 0 (a launch must never hang), "
                                 f"got {timeout!r}")
    assert runs == []


@pytest.mark.parametrize("env, bad", [
    ({"A": 1}, {"A": 1}),
    ({1: "a"}, {1: "a"}),
    ({"A": "1", "B": 2, "C": "3", 4: "x"}, {"B": 2, 4: "x"}),           # only the bad entries are shown
    (["A=1"], ["A=1"]),
    ("A=1", "A=1"),
    ((("A", "1"),), (("A", "1"),)),
])
def test_env_must_map_str_to_str_and_the_message_shows_what_is_wrong(runs, env, bad):
    with pytest.raises(TypeError) as excinfo:
        launcher.launch(_noop, 2, env=env)
    assert _message(excinfo) == f"env must be a dict of str -> str (environment variables for the ranks), got {bad!r}"
    assert runs == []


def test_debug_must_be_a_bool(runs):
    for debug in ("yes", 1, None):
        with pytest.raises(TypeError) as excinfo:
            launcher.launch(_noop, 2, debug=debug)
        assert _message(excinfo) == f"debug must be True or False, got {debug!r}"
    assert runs == []


@pytest.mark.parametrize("fn, name", [(42, "int"), (None, "NoneType"), ("_noop", "str")])
def test_fn_must_be_callable(runs, fn, name):
    with pytest.raises(TypeError) as excinfo:
        launcher.launch(fn, 2)
    assert _message(excinfo) == f"fn must be callable, got {name}"
    assert runs == []


@pytest.mark.parametrize("fn_kwargs", [["x"], "xy", [("x", 1)], {1: 2}, {"x": 1, 2: 3}, 5])
def test_fn_kwargs_must_be_a_dict_with_str_keys(runs, fn_kwargs):
    with pytest.raises(TypeError) as excinfo:
        launcher.launch(_noop, 2, fn_kwargs=fn_kwargs)
    assert _message(excinfo) == f"fn_kwargs must be a dict of keyword arguments for fn, got {fn_kwargs!r}"
    assert runs == []


def test_a_keyword_in_fn_kwargs_and_given_directly_is_refused(runs):
    with pytest.raises(TypeError) as excinfo:
        launcher.launch(two, 2, 1, fn_kwargs={"q": 1, "c": 1, "b": 2, "z": 0, "x": 1, "m": 2}, c=3, b=4, x=5, m=6, q=7)
    assert _message(excinfo) == "keyword arguments ['b', 'c', 'm', 'q', 'x'] given both in fn_kwargs and directly"
    assert runs == []


def test_open_files_are_refused_by_position_and_by_keyword(runs, tmp_path):
    buf = io.BytesIO(b"x")
    with pytest.raises(TypeError) as excinfo:
        launcher.launch(two, 2, 1, buf)
    assert _message(excinfo) == (f"launch cannot send argument 1, an open file ({buf!r}), to the workers: each "
                                 "worker would get a copy or nothing, never the same file. Pass its path and open it "
                                 "in the worker function")
    with open(tmp_path / "f.txt", "w") as f, pytest.raises(TypeError) as excinfo:
        launcher.launch(two, 2, 1, b=2, c=f)
    assert _message(excinfo) == (f"launch cannot send keyword argument 'c', an open file ({f!r}), to the workers: "
                                 "each worker would get a copy or nothing, never the same file. Pass its path and "
                                 "open it in the worker function")
    with pytest.raises(TypeError) as excinfo:
        launcher.launch(two, 2, 1, fn_kwargs={"c": buf})
    assert _message(excinfo).startswith("launch cannot send keyword argument 'c', an open file (")
    assert runs == []


# -- values cloudpickle cannot send --------------------------------------------------------------------------

class Unsendable:
    """Pickling it raises a known error (as a lock, a generator or a socket does)."""

    def __reduce__(self):
        raise RuntimeError("no way across")


class UnsendableCallable(Unsendable):
    def __call__(self):
        return 1


class SendableOnce:
    """Pickles alone, never as part of the whole call (``_unpicklable``'s last resort)."""

    calls = 0

    def __reduce__(self):
        SendableOnce.calls += 1
        if SendableOnce.calls == 1:
            raise ValueError("first try fails")
        return (SendableOnce, ())


TAIL = (". Workers are separate processes: pass plain data (tensors, numbers, dicts) and create locks, open files, "
        "sockets or generators inside the worker function")


def test_an_unpicklable_fn_is_named(runs):
    with pytest.raises(TypeError) as excinfo:
        launcher.launch(UnsendableCallable(), 2)
    assert _message(excinfo) == ("launch cannot send fn to the workers: it cannot be pickled (RuntimeError: no way "
                                 "across)" + TAIL)
    assert isinstance(excinfo.value.__cause__, RuntimeError)
    assert runs == []


def test_an_unpicklable_argument_is_named_by_position_type_and_reason(runs):
    with pytest.raises(TypeError) as excinfo:
        launcher.launch(two, 2, 1.0, Unsendable())
    assert _message(excinfo) == ("launch cannot send argument 1 (Unsendable) to the workers: it cannot be pickled "
                                 "(RuntimeError: no way across)" + TAIL)
    assert runs == []


def test_an_unpicklable_keyword_argument_is_named(runs):
    with pytest.raises(TypeError) as excinfo:
        launcher.launch(two, 2, 1.0, b=2, c=Unsendable())
    assert _message(excinfo) == ("launch cannot send keyword argument 'c' (Unsendable) to the workers: it cannot be "
                                 "pickled (RuntimeError: no way across)" + TAIL)
    assert runs == []


def test_a_call_that_pickles_only_in_parts_gets_the_general_message(runs):
    SendableOnce.calls = 0
    with pytest.raises(TypeError) as excinfo:
        launcher.launch(two, 2, SendableOnce())
    assert _message(excinfo) == "launch cannot pickle the call for the workers: ValueError: first try fails"
    assert SendableOnce.calls == 2 and runs == []


def test_without_cloudpickle_the_error_says_how_to_install_it(runs, monkeypatch):
    monkeypatch.setitem(sys.modules, "cloudpickle", None)
    try:
        import cloudpickle  # noqa: F401
    except ImportError as exc:
        why = str(exc)
    with pytest.raises(ImportError) as excinfo:
        launcher.launch(_noop, 2)
    assert _message(excinfo) == (f"launch needs cloudpickle to ship a function to its workers, and it cannot be "
                                 f"imported ({why}): {HINTS['cloudpickle']}")
    assert isinstance(excinfo.value.__cause__, ImportError) and runs == []


# -- the call must fit fn's signature --------------------------------------------------------------------------

def _bind_error(fn, *args, **kwargs) -> str:
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as exc:
        return str(exc)
    raise AssertionError("expected the call not to bind")


def test_a_call_that_does_not_bind_is_refused_with_the_counts(runs):
    with pytest.raises(TypeError) as excinfo:
        launcher.launch(two, 2, 1, 2, 3, timeout=5, z=1, y=2)
    why = _bind_error(two, 1, 2, 3, z=1, y=2)
    assert _message(excinfo) == (f"launch cannot call two(a, b=0, *, c=1) with the arguments given: {why} "
                                 f"(3 positional, keywords ['y', 'z']); nothing was started")
    with pytest.raises(TypeError) as excinfo:
        launcher.launch(two, 3)
    assert _message(excinfo) == (f"launch cannot call two(a, b=0, *, c=1) with the arguments given: "
                                 f"{_bind_error(two)} (0 positional, keywords []); nothing was started")
    assert runs == []


def test_a_callable_without_a_qualname_is_named_by_its_type(runs):
    fn = functools.partial(two)
    with pytest.raises(TypeError) as excinfo:
        launcher.launch(fn, 2)
    assert _message(excinfo) == (f"launch cannot call partial(a, b=0, *, c=1) with the arguments given: "
                                 f"{_bind_error(fn)} (0 positional, keywords []); nothing was started")


def test_positional_and_keyword_arguments_that_bind_are_accepted(runs):
    launcher.launch(two, 2, 1, 2, c=3)
    launcher.launch(two, 2, a=1)
    assert len(runs) == 2


def test_one_own_keyword_that_fn_needed_points_to_fn_kwargs(runs):
    with pytest.raises(TypeError) as excinfo:
        launcher.launch(takes_threads, 2, threads=1, timeout=5, env={"A": "1"})
    why = _bind_error(takes_threads)
    assert _message(excinfo) == (f"launch(fn, 2, threads=1): threads=1 went to launch itself (its own keyword: "
                                 f"threads), so takes_threads(threads) gets no 'threads' ({why}). To pass it to fn, "
                                 f"use fn_kwargs: launch(fn, 2, fn_kwargs={{'threads': 1}})")
    assert runs == []


def test_several_own_keywords_that_fn_needed_are_all_named(runs):
    with pytest.raises(TypeError) as excinfo:
        launcher.launch(takes_several, 3, backend="gloo", timeout=5, threads=2, env={"A": "1"}, debug=True)
    given = "backend='gloo', timeout=5, threads=2, env={'A': '1'}, debug=True"
    why = _bind_error(takes_several)
    assert _message(excinfo) == (f"launch(fn, 3, {given}): {given} went to launch itself (its own keywords: "
                                 f"backend, timeout, threads, env, debug), so takes_several(backend, timeout, "
                                 f"threads, env, debug) gets no 'backend', 'timeout', 'threads', 'env', 'debug' "
                                 f"({why}). To pass them to fn, use fn_kwargs: launch(fn, 3, fn_kwargs={{'backend': "
                                 f"'gloo', 'timeout': 5, 'threads': 2, 'env': {{'A': '1'}}, 'debug': True}})")


def test_two_own_keywords_use_the_plural(runs):
    with pytest.raises(TypeError) as excinfo:
        launcher.launch(takes_several, 2, "gloo", timeout=5, debug=True, threads=2, env={"A": "1"},
                        fn_kwargs={"threads": 1, "env": 2})
    assert _message(excinfo).startswith("launch(fn, 2, timeout=5, debug=True): timeout=5, debug=True went to launch "
                                        "itself (its own keywords: timeout, debug), so ")
    assert _message(excinfo).endswith("). To pass them to fn, use fn_kwargs: launch(fn, 2, fn_kwargs={'timeout': 5, "
                                      "'debug': True})")


def test_an_own_keyword_left_at_its_default_is_not_blamed(runs):
    """``debug=False`` and ``backend="auto"`` are launch's defaults: fn's missing argument is a plain refusal."""
    for fn, kw in ((takes_debug, {}), (takes_debug, {"debug": False}), (takes_backend, {}),
                   (takes_backend, {"backend": "auto"}), (takes_threads, {"threads": None})):
        with pytest.raises(TypeError) as excinfo:
            launcher.launch(fn, 2, **kw)
        sig = inspect.signature(fn)
        assert _message(excinfo) == (f"launch cannot call {fn.__name__}{sig} with the arguments given: "
                                     f"{_bind_error(fn)} (0 positional, keywords []); nothing was started")
    assert runs == []


def test_an_own_keyword_that_fn_kwargs_also_gives_is_not_blamed(runs):
    with pytest.raises(TypeError) as excinfo:
        launcher.launch(takes_several, 2, threads=1, fn_kwargs={"threads": 3})
    why = _bind_error(takes_several, threads=3)
    assert _message(excinfo) == (f"launch cannot call takes_several(backend, timeout, threads, env, debug) with the "
                                 f"arguments given: {why} (0 positional, keywords ['threads']); nothing was started")


# -- the notebook cells shipped along ----------------------------------------------------------------------------

def test_only_notebook_cells_are_collected(monkeypatch):
    cache = {
        "/tmp/ipykernel_7/1.py": (10, None, ["a = 1\n"], "/tmp/ipykernel_7/1.py"),
        "<ipython-input-3-abc>": (5, None, ["b = 2\n"]),                        # three fields: still a cell
        "/home/me/ipykernel_tools.py": (1, 2.0, ["c = 3\n"], "x"),             # 'ipykernel_' anywhere in the name
        "/usr/lib/python3/os.py": (1, 2.0, ["import sys\n"], "/usr/lib/python3/os.py"),
        "<ipython-input-9-lazy>": (lambda: None,),                             # a lazy entry: no lines yet
        "/tmp/ipykernel_7/2.py": (1, None),
        "x<ipython-input": (1, None, ["d = 4\n"], "x"),
    }
    monkeypatch.setattr(linecache, "cache", cache)
    assert launcher._cell_sources() == {"/tmp/ipykernel_7/1.py": ["a = 1\n"], "<ipython-input-3-abc>": ["b = 2\n"],
                                        "/home/me/ipykernel_tools.py": ["c = 3\n"]}


def test_the_payload_ships_the_cells_the_function_uses_and_no_other(runs, monkeypatch):
    used, other = "/tmp/ipykernel_1/101.py", "/tmp/ipykernel_1/102.py"
    namespace: dict = {}
    exec(compile("def from_cell(x):\n    return x + 1\n", used, "exec"), namespace)
    monkeypatch.setattr(linecache, "cache", {used: (1, None, ["def from_cell(x):\n", "    return x + 1\n"], used),
                                             other: (1, None, ["password = 'hunter2'\n"], other)})
    launcher.launch(namespace["from_cell"], 2, 4)
    call = pickle.loads(runs[0].payload)
    assert call["sources"] == {used: ["def from_cell(x):\n", "    return x + 1\n"]}
    assert call["fn"](call["args"][0]) == 5 and call["kwargs"] == {}


# -- where a launch runs: notebook or script ----------------------------------------------------------------------

class _Kernel:
    kernel = object()


class _NoKernel:
    kernel = None


class _NoKernelAttribute:
    pass


def _ipython(get_ipython):
    fake = types.ModuleType("IPython")
    if get_ipython is not None:
        fake.get_ipython = get_ipython  # pyright: ignore[reportAttributeAccessIssue]
    return fake


@pytest.mark.parametrize("module, expected", [
    (_ipython(_Kernel), True),
    (_ipython(_NoKernel), False),
    (_ipython(_NoKernelAttribute), False),
    (_ipython(lambda: None), False),               # IPython imported, no shell running
    (_ipython(None), False),                       # a module without get_ipython
    ("not callable", False),
], ids=["kernel", "kernel-None", "no-kernel-attr", "no-shell", "no-get_ipython", "get_ipython-not-callable"])
def test_in_notebook_needs_a_shell_with_a_kernel(monkeypatch, module, expected):
    if module == "not callable":
        module = _ipython(None)
        module.get_ipython = "a string"  # pyright: ignore[reportAttributeAccessIssue]
    monkeypatch.setitem(sys.modules, "IPython", module)
    assert launcher.in_notebook() is expected
    assert launcher.default_timeout() == (120.0 if expected else 300.0)


def test_in_notebook_without_ipython(monkeypatch):
    monkeypatch.delitem(sys.modules, "IPython", raising=False)
    assert launcher.in_notebook() is False
    assert launcher.default_timeout() == 300.0


def test_a_launch_without_timeout_in_a_notebook_gets_120_seconds(runs, monkeypatch):
    monkeypatch.setitem(sys.modules, "IPython", _ipython(_Kernel))
    launcher.launch(_noop, 2)
    launcher.launch(_noop, 2, timeout=9)
    assert [r.args[2] for r in runs] == [120.0, 9.0]


# -- worker_info ---------------------------------------------------------------------------------------------------

WORKER_INFO_OUTSIDE = ("worker_info() describes the rank it runs on, and no torch.distributed process group is "
                       "initialised here: call it inside the function you run with labutils.launch(fn, world_size) "
                       "(or under python -m labutils.torchrun), not in the notebook or script that starts the launch")


@pytest.mark.parametrize("available, initialised", [(True, False), (False, False), (False, True)])
def test_worker_info_outside_a_launch_says_where_to_call_it(monkeypatch, available, initialised):
    monkeypatch.setattr(dist, "is_available", lambda: available)
    monkeypatch.setattr(dist, "is_initialized", lambda: initialised)
    with pytest.raises(RuntimeError) as excinfo:
        launcher.worker_info()
    assert _message(excinfo) == WORKER_INFO_OUTSIDE


def _fake_group(monkeypatch, backend):
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: backend)
    monkeypatch.setattr(dist, "get_rank", lambda *a: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)


def test_worker_info_on_a_gloo_rank(monkeypatch):
    _fake_group(monkeypatch, "gloo")
    assert launcher.worker_info() == {"rank": 3, "world_size": 4, "backend": "gloo", "device": torch.device("cpu")}


def test_worker_info_on_an_nccl_rank_names_its_cuda_device(monkeypatch):
    _fake_group(monkeypatch, "nccl")
    info = launcher.worker_info()
    assert info == {"rank": 3, "world_size": 4, "backend": "nccl", "device": torch.device("cuda", 2)}
    assert info["device"].index == 2


def test_worker_info_in_a_real_one_rank_group(tmp_path):
    """The same, on a real (FileStore, gloo) group of one rank in this process, destroyed at the end. In the full
    suite an earlier test has already started DeepSpeed's in-process comm (``init_deepspeed``: one gloo rank, kept
    for the process by design); then that real group is the one read, and left as it was."""
    expected = {"rank": 0, "world_size": 1, "backend": "gloo", "device": torch.device("cpu")}
    if dist.is_initialized():
        assert launcher.worker_info() == expected
        return
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert launcher.worker_info() == expected
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()
