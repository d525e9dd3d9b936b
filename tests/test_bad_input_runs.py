"""Bad input, round four (issue 41): checkpoints, study settings and launches whose errors did not say what to
change (torch's "[enforce fail at inline_container.cc]", "version None is not 1", "not a torch.save file",
"unexpected pos 64 vs 0", a ZeroDivisionError, a bare ModuleNotFoundError) or named the wrong cause (a rank
that called ``os._exit(0)`` "returned from the function"). Each error names the argument, the bad value and
what is accepted, and comes before any work; a failed save leaves the previous checkpoint and no ``.tmp``.
A positive control per function shows the good path unchanged.

Tests that start workers carry ``@pytest.mark.dist`` (2 gloo ranks each)."""
import errno
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import labutils.checkpoint as checkpoint_mod
from labbook.lm_study.config import StudyConfig
from labbook.study import run_jobs
from labbook.train_modern import run_variant
from labutils import WorkerError, launch
from labutils.checkpoint import CheckpointError, CheckpointSaveError, load_checkpoint, save_checkpoint
from labutils.data import RandomPairs, char_corpus
from labutils.models import SeqRegressor, make_ffn
from labutils.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_run(steps=1, checkpoint=None):
    """A small model, its optimizer, data stream and history after ``steps`` steps."""
    torch.manual_seed(0)
    model = SeqRegressor(16, 2, lambda: make_ffn("dense", 16, 24), n_layers=1)
    data = RandomPairs(4, 6, 16, seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    history = train(model, data, steps=steps, optimizer=opt, checkpoint=checkpoint, progress=False)
    return model, opt, data, history


def save(path, model, opt, data, history, step=1):
    save_checkpoint(path, model=model, optimizer=opt, step=step, data=data, history=history)


def leftovers(folder) -> list:
    return sorted(name for name in os.listdir(folder) if name.endswith(".tmp"))


# -- checkpoints --------------------------------------------------------------------------------------------------

def test_checkpoint_save_and_load_control(tmp_path):
    model, opt, data, history = tiny_run()
    path = tmp_path / "ck.pt"
    save(path, model, opt, data, history, step=1)
    save(path, model, opt, data, history, step=3)                  # over an existing one, atomically
    state = load_checkpoint(path)
    assert state["step"] == 3 and set(state) >= set(checkpoint_mod.CHECKPOINT_KEYS)
    assert leftovers(tmp_path) == []


def in_child_without_root(fn) -> dict:
    """``fn()`` in a forked child that runs as the user nobody when this process is root (root writes into any
    directory), else as this user; returns what it raised, as {type, errno, msg} (type None: nothing)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read)
            signal.alarm(60)                                        # a hang kills the child, not the suite
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            try:
                fn()
                report = {"type": None}
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                report = {"type": type(exc).__name__, "errno": getattr(exc, "errno", None), "msg": str(exc)}
            os.write(write, json.dumps(report).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and data, f"the child failed (status {status})"
    return json.loads(data)


def test_checkpoint_save_into_read_only_directory_names_the_path():
    """A directory the user cannot write: the save checks it before torch writes anything."""
    base = tempfile.mkdtemp(prefix="labutils-ro-")
    try:
        os.chmod(base, 0o755)                                       # traversable by nobody too
        folder = os.path.join(base, "runs")
        os.mkdir(folder)
        path = os.path.join(folder, "ck.pt")
        model, opt, data, history = tiny_run(steps=2, checkpoint=path)   # the previous checkpoint, at step 2
        os.chmod(path, 0o644)
        os.chmod(folder, 0o555)
        report = in_child_without_root(lambda: save(path, model, opt, data, history, step=9))
        assert report["type"] == "PermissionError" and report["errno"] == errno.EACCES, report
        msg = report["msg"]
        assert f"cannot write checkpoint {path!r}: the directory {folder!r} is not writable" in msg, msg
        assert "Permission denied" in msg and "Save to a directory you can write to" in msg, msg
        assert "enforce fail" not in msg and f"the previous checkpoint {path!r} is unchanged" in msg, msg
        assert load_checkpoint(path)["step"] == 2 and leftovers(folder) == []
    finally:
        for dirpath, _, _ in os.walk(base):
            os.chmod(dirpath, 0o755)
        shutil.rmtree(base, ignore_errors=True)


def test_checkpoint_save_without_optimizer_is_a_type_error(tmp_path):
    model, _, data, history = tiny_run()
    path = tmp_path / "ck.pt"
    with pytest.raises(TypeError, match=r"save_checkpoint\(optimizer=None\): needs the run's torch\.optim\.Optimizer "
                                        r"\(resuming restores its state\).*got NoneType; nothing was written\. To save "
                                        r"only the weights, use torch\.save\(model\.state_dict\(\), path\)"):
        save_checkpoint(path, model=model, optimizer=None, step=1, data=data, history=history)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("which", ["model", "optimizer"])
def test_checkpoint_bare_state_dict_is_named(tmp_path, which):
    model, opt, _, _ = tiny_run()
    path = tmp_path / "weights.pt"
    torch.save((model if which == "model" else opt).state_dict(), path)
    words = (r"a bare state_dict \(\d+ tensors, e\.g\. '[\w.]+'\), not a checkpoint written by save_checkpoint or "
             r"train\(checkpoint=\.\.\.\).*Load it with model\.load_state_dict\(torch\.load\(path, "
             r"weights_only=True\)\)"
             if which == "model" else
             r"a bare optimizer state_dict, not a checkpoint written by save_checkpoint.*Load it with "
             r"optimizer\.load_state_dict\(")
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + ": " + words) as info:
        load_checkpoint(path)
    assert "version None" not in str(info.value)


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
def test_checkpoint_cut_in_half_is_called_truncated(tmp_path, fmt):
    full = tmp_path / "full.pt"
    tiny_run(steps=2, checkpoint=full)
    if fmt == "legacy":                                              # torch's pre-1.6 format: one pickle stream
        buf = io.BytesIO()
        torch.save(load_checkpoint(full), buf, _use_new_zipfile_serialization=False)
        data = buf.getvalue()
        words = r"the file is truncated \(unexpected end of file\)"
    else:
        data = full.read_bytes()
        words = (r"the file is truncated \(it starts as a torch\.save zip archive, but the zip's central directory "
                 r"at its end is missing\)")
    half = tmp_path / "half.pt"
    half.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=re.escape(f"{half}: not a readable checkpoint: {len(data) // 2} bytes: ")
                       + words + ": a save or a copy was cut short") as info:
        load_checkpoint(half)
    assert "not a torch.save file" not in str(info.value)


def torch_text_full(obj, f):
    """torch's own writer on a full disk: part of the file, then no errno, only this."""
    with open(f, "wb") as fh:
        fh.write(b"PK\x03\x04" + b"\0" * 60)
    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")


def errno_full(obj, f):
    with open(f, "wb") as fh:
        fh.write(b"PK\x03\x04")
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("how", ["torch text", "errno", "/dev/full", "during train"])
def test_checkpoint_full_disk_says_no_space_left(tmp_path, monkeypatch, how):
    path = tmp_path / "ck.pt"
    model, opt, data, history = tiny_run(steps=2, checkpoint=path)   # the previous checkpoint, at step 2
    if how == "/dev/full":                                           # a real ENOSPC device behind the tmp file
        if not os.path.exists("/dev/full"):
            pytest.skip("no /dev/full on this system (the other three cases simulate it)")
        os.symlink("/dev/full", str(path) + ".tmp")
        model = SeqRegressor(16, 2, lambda: make_ffn("dense", 16, 4096), n_layers=1)   # past torch's buffers
    else:
        monkeypatch.setattr(checkpoint_mod.torch, "save", errno_full if how == "errno" else torch_text_full)
    folder = re.escape(repr(str(tmp_path)))
    words = (rf"no space left on the device holding {folder}: writing checkpoint {re.escape(repr(str(path)))} failed "
             rf"\(.*\); the previous checkpoint .* is unchanged and no ck\.pt\.tmp is left \(.* MiB free there now\)\. "
             "Free some space or save the checkpoint elsewhere")
    if how == "during train":
        with pytest.raises(CheckpointSaveError, match=words) as info:
            train(model, data, steps=4, optimizer=opt, checkpoint=path, progress=False)
        cause = info.value.__cause__
        assert info.value.result.steps == 4 and isinstance(cause, OSError) and cause.errno == errno.ENOSPC
    else:
        with pytest.raises(OSError, match=words) as info:
            save(path, model, opt, data, history, step=3)
        assert info.value.errno == errno.ENOSPC and not isinstance(info.value, CheckpointError)
    if how == "torch text":
        assert "unexpected pos 64 vs 0" in str(info.value) and "how torch reports a full disk" in str(info.value)
    monkeypatch.undo()
    assert load_checkpoint(path)["step"] == 2, "a failed save must leave the previous checkpoint intact"
    assert leftovers(tmp_path) == [] and not os.path.lexists(str(path) + ".tmp")


# -- study settings -----------------------------------------------------------------------------------------------

def test_study_config_seeds_control():
    assert StudyConfig().seeds == (0, 1, 2)
    assert StudyConfig(seeds=[3, 4]).seeds == (3, 4)                 # a list (a JSON record's) becomes a tuple
    assert hash(StudyConfig(seeds=[3, 4])) == hash(StudyConfig(seeds=(3, 4)))


@pytest.mark.parametrize("seeds, error, words", [
    (3, TypeError, r"seeds must be a tuple or list of ints, one run per seed \(three seeds: \(0, 1, 2\), i\.e\. "
                   r"tuple\(range\(3\)\)\), got 3$"),
    ("012", TypeError, r"seeds must be a tuple or list of ints.*got '012'$"),
    ((0, 1.0), TypeError, r"seeds must be a tuple or list of ints.*got \(0, 1\.0\)$"),
    ((), ValueError, r"need at least one seed \(a tuple or list of ints, e\.g\. \(0, 1\)\), got \(\)$"),
])
def test_study_config_seeds_must_be_a_tuple_of_ints(seeds, error, words):
    with pytest.raises(error, match=r"^StudyConfig\(seeds=\.\.\.\): " + words):
        StudyConfig(seeds=seeds)


def _square(x):
    return x * x


def test_run_jobs_control():
    seen = []
    assert run_jobs(_square, [(2,), (3,)], 1, seen.append) == [4, 9] and seen == [4, 9]


@pytest.mark.parametrize("jobs", [0, -1, 1.5, True, "2"])
def test_run_jobs_refuses_jobs_below_one(jobs):
    calls = []
    with pytest.raises(ValueError, match=re.escape(f"run_jobs(jobs={jobs!r}): jobs must be an int >= 1 (1: the tasks "
                                                   "one after another in this process; n: n processes side by side)")):
        run_jobs(calls.append, [(1,), (2,)], jobs)
    assert calls == [], "no task may run before the check"


MODERN_CFG = SimpleNamespace(d_model=16, n_heads=2, n_layers=1, block=8, batch=4, steps=2, lr=1e-2, eval_every=2)


def test_run_variant_control():
    corpus = char_corpus("def f(x):\n    return x + 1\n" * 200, val_every=5, chunk=256)
    res = run_variant(lambda: make_ffn("dense", 16, 32), corpus, MODERN_CFG, seeds=[0])
    assert res["val_steps"] == [2] and len(res["final"]) == 1


@pytest.mark.parametrize("seeds, error, words", [
    ((), ValueError, r"need at least one seed \(a tuple or list of ints, e\.g\. \(0, 1\)\), got \(\)$"),
    (2, TypeError, r"seeds must be a tuple or list of ints.*got 2$"),
])
def test_run_variant_refuses_bad_seeds_before_training(seeds, error, words):
    corpus = None      # never read: the check comes first (reading it would be an AttributeError)
    with pytest.raises(error, match=r"^run_variant\(seeds=\.\.\.\): " + words):
        run_variant(lambda: make_ffn("dense", 16, 32), corpus, MODERN_CFG, seeds=seeds)


# -- launches -----------------------------------------------------------------------------------------------------

def box_from_rank_only_module(unwrap):
    import rankonly  # only on the ranks' path (launch's env PYTHONPATH), not on the caller's

    box = rankonly.Box(dist.get_rank())
    return box.value if unwrap else box


RANK_ONLY = "class Box:\n    def __init__(self, value):\n        self.value = value\n"


@pytest.mark.dist
def test_launch_result_importable_only_on_ranks_control(tmp_path):
    (tmp_path / "rankonly.py").write_text(RANK_ONLY)
    assert launch(box_from_rank_only_module, 2, True, timeout=60, env={"PYTHONPATH": str(tmp_path)}) == [0, 1]


@pytest.mark.dist
def test_launch_result_of_a_rank_only_module_names_rank_and_module(tmp_path):
    (tmp_path / "rankonly.py").write_text(RANK_ONLY)
    with pytest.raises(WorkerError) as info:
        launch(box_from_rank_only_module, 2, False, timeout=60, env={"PYTHONPATH": str(tmp_path)})
    msg = str(info.value)
    assert msg.startswith("rank 0 returned a value that cannot be unpickled here: it needs the module 'rankonly', "
                          "which the ranks can import but this process cannot (ModuleNotFoundError: No module named "
                          "'rankonly')"), msg
    assert "must be importable in the caller: return plain data (tensors, numbers" in msg, msg
    assert info.value.rank == 0 and info.value.exitcode == 0 and "rankonly" not in sys.modules


CALLER_SIDE = textwrap.dedent("""
    import os
    def path_of_ranks():
        import rankextra                      # only on env's PYTHONPATH
        return {"extra": rankextra.VALUE, "path": os.environ["PYTHONPATH"].split(os.pathsep)}
""")


@pytest.mark.dist
def test_launch_env_pythonpath_adds_to_the_ranks_path(tmp_path, monkeypatch):
    """``env={"PYTHONPATH": ...}`` used to replace the path launch gives the ranks: a function of a module the
    caller imports from its sys.path (a renamed coursework copy, say) could no longer be unpickled there."""
    caller, extra = tmp_path / "caller", tmp_path / "extra"
    caller.mkdir()
    extra.mkdir()
    (caller / "callerside41.py").write_text(CALLER_SIDE)
    (extra / "rankextra.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(caller))                       # the caller's sys.path, not its PYTHONPATH
    monkeypatch.delitem(sys.modules, "callerside41", raising=False)
    import callerside41

    try:
        out = launch(callerside41.path_of_ranks, 2, timeout=60, env={"PYTHONPATH": str(extra)})
    finally:
        sys.modules.pop("callerside41", None)
    assert [r["extra"] for r in out] == [41, 41]
    path = out[0]["path"]
    assert path[0] == ROOT, "the package's own folder comes first (a renamed copy imports under its name)"
    assert path.index(str(extra)) < path.index(str(caller)), path  # env's entries, then the caller's sys.path


COURSEWORK = textwrap.dedent("""
    import os
    import sys
    import mylab                               # the package, copied and renamed: only this folder has it
    from mylab.moe import FMoE

    def rank_work():
        import torch
        import torch.distributed as dist
        import rankextra                       # only on env's PYTHONPATH
        layer = FMoE(2, 4, top_k=1, expert=lambda d: torch.nn.Linear(d, d))
        return [rankextra.VALUE, dist.get_rank(), type(layer).__module__]

    os.chdir(sys.argv[2])                      # a notebook's %cd: the ranks start there, away from mylab
    print("RESULT", mylab.launch(rank_work, 2, timeout=60, env={"PYTHONPATH": sys.argv[1]}))
""")


@pytest.mark.dist
def test_launch_env_pythonpath_in_a_renamed_coursework_copy(tmp_path):
    """The issue's case itself: a copy of the package renamed ``mylab`` (nothing of this repository on the path),
    imported from its folder, which the script then leaves (a notebook's ``%cd``), launching with
    ``env={"PYTHONPATH": ...}``: the ranks import both the copy and env's module (env's PYTHONPATH used to replace
    the path, and the ranks, started elsewhere, could not import ``mylab`` to unpickle the function)."""
    project, extra, elsewhere = tmp_path / "project", tmp_path / "extra", tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copytree(os.path.join(ROOT, "labutils"), project / "mylab",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    extra.mkdir()
    (extra / "rankextra.py").write_text("VALUE = 41\n")
    (project / "coursework.py").write_text(COURSEWORK)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LAB_PRESET")}
    proc = subprocess.run([sys.executable, "coursework.py", str(extra), str(elsewhere)], cwd=project, env=env,
                          capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "RESULT [[41, 0, 'mylab.moe.layers'], [41, 1, 'mylab.moe.layers']]" in proc.stdout, out
    assert "labutils" not in proc.stdout, out


def leave_without_result(how):
    if dist.get_rank() == 1:
        if how == "os._exit":
            os._exit(0)
        return "left"
    t = torch.ones(3)
    dist.all_reduce(t)  # rank 1 never comes
    return "stayed"


@pytest.mark.dist
@pytest.mark.parametrize("how, words", [
    ("return", "rank 1 returned from the function (exit code 0) while"),          # the control
    ("os._exit", "rank 1 exited (status 0) without returning a result (os._exit(0)?) while"),
])
def test_launch_rank_that_calls_os_exit_zero_is_not_said_to_return(how, words):
    with pytest.raises(WorkerError) as info:
        launch(leave_without_result, 2, how, timeout=60)
    msg = str(info.value)
    assert msg.startswith(words) and "the other ranks still waited for it in a collective" in msg, msg
    assert info.value.rank == 1 and info.value.exitcode == 0 and "then rank 0 raised" in msg, msg
    if how == "os._exit":
        assert "returned from the function" not in msg, msg
