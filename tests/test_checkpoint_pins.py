"""labutils.checkpoint pinned down (issue 38, mutation testing): the exact words of every error, the exact contents
of a checkpoint and of a restore, the CUDA RNG states (faked on a CPU machine), and the weights-only guarantee
even when the environment asks torch to lift it. Small models, no training loop, no process group."""
import errno
import os
import pickle
import random
import warnings

import pytest
import torch

import labutils.checkpoint as checkpoint_mod
from labutils.checkpoint import (
    CheckpointError,
    CheckpointSaveError,
    check_writable,
    load_checkpoint,
    restore,
    save_checkpoint,
    save_or_raise,
)
from labutils.data import RandomPairs
from labutils.train import TrainResult


class RecordingSGD(torch.optim.SGD):
    """An SGD that remembers the keys of every state dict it is given (restore must give exactly its own)."""

    loaded_keys: list

    def load_state_dict(self, state_dict):
        self.loaded_keys = getattr(self, "loaded_keys", []) + [sorted(state_dict)]
        super().load_state_dict(state_dict)


def parts(optimizer_class=torch.optim.SGD, groups=False, **opt_kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    params = ([{"params": [model.weight]}, {"params": [model.bias]}] if groups else model.parameters())
    optimizer = optimizer_class(params, lr=0.1, **opt_kw)
    return model, optimizer, RandomPairs(2, 4, 3, seed=1), TrainResult(losses=[1.0, 0.5], aux=[0.0, 0.0])


def step_once(model, optimizer):
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()


def saved(tmp_path, name="ck.pt", **kw):
    """A checkpoint written by save_checkpoint, and the objects that fit it."""
    model, optimizer, data, history = parts(**kw)
    step_once(model, optimizer)
    path = tmp_path / name
    save_checkpoint(path, model=model, optimizer=optimizer, step=2, data=data, history=history)
    return path, model, optimizer, data


def rewrite(path, edit):
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)


def mismatch_error(path, net, optimizer, data) -> str:
    with pytest.raises(CheckpointError) as err:
        restore(path, net, optimizer, data, steps=10)
    return str(err.value)


def head(path, n):
    return (f"{path} does not fit this run ({n} mismatch{'es' if n > 1 else ''}; nothing was loaded, the model is "
            "untouched):")


# -- save_checkpoint: every part is checked, with words ----------------------------------------------------------

@pytest.mark.parametrize("name, value, words", [
    ("model", None, "save_checkpoint(model=None): needs the torch.nn.Module being trained, an object with a "
                    ".state_dict() method, got NoneType; nothing was written."),
    ("data", 42, "save_checkpoint(data=42): needs the run's batch stream (labutils.data: RandomPairs, CharBatches, "
                 "...), an object with a .state_dict() method, got int; nothing was written."),
    ("data", None, "save_checkpoint(data=None): needs the run's batch stream (labutils.data: RandomPairs, "
                   "CharBatches, ...), an object with a .state_dict() method, got NoneType; nothing was written."),
    ("history", [1.0], "save_checkpoint(history=[1.0]): needs the run's TrainResult so far, an object with a "
                       ".state() method, got list; nothing was written."),
    ("history", None, "save_checkpoint(history=None): needs the run's TrainResult so far, an object with a "
                      ".state() method, got NoneType; nothing was written."),
    ("optimizer", "sgd", "save_checkpoint(optimizer='sgd'): needs the run's torch.optim.Optimizer (resuming "
                         "restores its state), an object with a .state_dict() method, got str; nothing was written."),
    ("optimizer", None, "save_checkpoint(optimizer=None): needs the run's torch.optim.Optimizer (resuming restores "
                        "its state), an object with a .state_dict() method, got NoneType; nothing was written. To "
                        "save only the weights, use torch.save(model.state_dict(), path) (and load them with "
                        "model.load_state_dict)."),
])
def test_save_checkpoint_names_the_bad_part_exactly(tmp_path, name, value, words):
    model, optimizer, data, history = parts()
    kw = dict(model=model, optimizer=optimizer, data=data, history=history)
    kw[name] = value
    with pytest.raises(TypeError) as err:
        save_checkpoint(tmp_path / "ck.pt", step=1, **kw)
    assert str(err.value) == words
    assert os.listdir(tmp_path) == [], "nothing is written"


def test_save_checkpoint_writes_exactly_these_parts(tmp_path):
    path, model, optimizer, data = saved(tmp_path)
    assert os.listdir(tmp_path) == ["ck.pt"]
    state = torch.load(path, weights_only=True)
    assert list(state) == list(checkpoint_mod.CHECKPOINT_KEYS)
    assert state["version"] == 1 and state["step"] == 2
    assert state["optimizer"]["class"] == "torch.optim.sgd.SGD"
    assert set(state["rng"]) == {"torch", "python", "python_version", "python_gauss"}
    assert state["history"] == {"losses": [1.0, 0.5], "aux": [0.0, 0.0], "val": [], "load": None}


# -- save_or_raise ----------------------------------------------------------------------------------------------

def test_save_or_raise_keeps_path_step_history_and_the_cause(tmp_path):
    model, optimizer, data, history = parts()
    path = tmp_path / "gone" / "ck.pt"
    with pytest.raises(CheckpointSaveError) as err:
        save_or_raise(path, model, optimizer, 3, data, history)
    folder = str(tmp_path / "gone")
    assert str(err.value) == (
        f"step 3: writing checkpoint {str(path)!r} failed (FileNotFoundError: [Errno 2] cannot write checkpoint "
        f"{str(path)!r}: the directory {folder!r} does not exist; create it first (os.makedirs({folder!r}, "
        "exist_ok=True))); the previous checkpoint file is unchanged and err.result holds the history of all 2 steps")
    assert err.value.path == str(path) and isinstance(err.value.path, str)
    assert err.value.step == 3 and err.value.result is history
    assert type(err.value.__cause__) is FileNotFoundError


# -- check_writable ---------------------------------------------------------------------------------------------

def test_check_writable_on_a_directory_suggests_a_file_in_it(tmp_path):
    folder = str(tmp_path)
    with pytest.raises(CheckpointError) as err:
        check_writable(folder)
    assert str(err.value) == (f"checkpoint={folder!r} is a directory: give a file in it, "
                              f"e.g. {os.path.join(folder, 'run.pt')!r}")


def test_check_writable_probes_path_dot_tmp(tmp_path):
    path = str(tmp_path / "run.pt")
    check_writable(path)
    assert os.listdir(tmp_path) == [], "the probe is removed"
    os.mkdir(path + ".tmp")  # what save_checkpoint writes first cannot be created: a directory is in the way
    with pytest.raises(CheckpointError) as err:
        check_writable(path)
    assert str(err.value) == (f"checkpoint={path!r}: {path + '.tmp'!r} is a directory, and a save writes that "
                              "file first (then renames it to the checkpoint); remove or rename that directory")
    os.rmdir(path + ".tmp")
    check_writable(path)     # the directory was all that was in the way


def test_check_writable_without_strerror_shows_the_error_itself(tmp_path, monkeypatch):
    def failing_open(*args, **kwargs):
        raise OSError("the quota server is gone")
    monkeypatch.setattr(checkpoint_mod, "open", failing_open, raising=False)
    path = str(tmp_path / "run.pt")
    with pytest.raises(CheckpointError) as err:
        check_writable(path)
    assert str(err.value) == (f"checkpoint={path!r} cannot be written in {str(tmp_path)!r} (the quota server is "
                              "gone); pick a writable directory (checked before the first step)")


# -- load_checkpoint --------------------------------------------------------------------------------------------

def test_load_checkpoint_of_a_missing_file_is_enoent(tmp_path):
    path = str(tmp_path / "absent.pt")
    with pytest.raises(FileNotFoundError) as err:
        load_checkpoint(path)
    assert err.value.errno == errno.ENOENT and err.value.strerror == "no such checkpoint file"
    assert err.value.filename == path
    assert str(err.value) == f"[Errno 2] no such checkpoint file: {path!r}"


def test_load_checkpoint_of_a_list_says_what_it_holds(tmp_path):
    path = tmp_path / "list.pt"
    torch.save([torch.zeros(1)], path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert str(err.value) == (f"{path}: not a labutils checkpoint (it holds a list, not a dict of model, "
                              "optimizer, ...)")


def test_load_checkpoint_lists_the_missing_keys(tmp_path):
    path = tmp_path / "part.pt"
    torch.save({"version": 1, "step": 3, "model": {}}, path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert str(err.value) == (f"{path}: not a complete labutils checkpoint, missing "
                              "['optimizer', 'rng', 'data', 'history']")


def test_load_checkpoint_keeps_the_cause_of_a_truncated_file(tmp_path):
    path, *_ = saved(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match="the file is truncated") as err:
        load_checkpoint(path)
    cause = err.value.__cause__
    assert cause is not None and not isinstance(cause, pickle.UnpicklingError), "the reader's error stays attached"


def test_load_checkpoint_silences_only_the_pickle_protocol_notice(tmp_path, monkeypatch):
    path, *_ = saved(tmp_path)
    torch.save(torch.load(path, weights_only=True), path, pickle_protocol=3)  # torch warns on reading it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_checkpoint(path)["step"] == 2
    real_load = torch.load

    def noisy_load(*args, **kwargs):
        warnings.warn("a warning of another kind", UserWarning, stacklevel=2)
        return real_load(*args, **kwargs)
    monkeypatch.setattr(torch, "load", noisy_load)
    with pytest.warns(UserWarning, match="a warning of another kind"):
        assert load_checkpoint(path)["step"] == 2


RAN = []


def _ran_on_load(what):
    RAN.append(what)
    return what


class CodeOnLoad:
    def __reduce__(self):
        return _ran_on_load, ("code ran",)


def test_load_checkpoint_stays_weights_only_when_the_environment_lifts_it(tmp_path, monkeypatch):
    path = tmp_path / "evil.pt"
    torch.save({"version": 1, "payload": CodeOnLoad()}, path)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # lifts weights_only where it is not passed
    RAN.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match="not a readable checkpoint"):
            load_checkpoint(path)
    assert RAN == [], "loading a checkpoint never runs code from it"


# -- restore: what it checks, how it says so, what it loads ------------------------------------------------------

def test_restore_past_steps_says_how_to_continue(tmp_path):
    path, model, optimizer, data = saved(tmp_path)
    with pytest.raises(ValueError) as err:
        restore(path, model, optimizer, data, steps=1)
    assert str(err.value) == (f"{path} is already at step 2, past steps=1: ask for steps >= 2 to continue it, or "
                              "resume=False (or another path) to start over")


def add_model_keys(n):
    def edit(state):
        for i in range(n):
            state["model"][f"extra{i:02d}"] = torch.zeros(1)
    return edit


@pytest.mark.parametrize("n", [1, 2, 20, 21, 22])
def test_restore_lists_twenty_mismatches_then_counts_the_rest(tmp_path, n):
    path, model, optimizer, data = saved(tmp_path)
    rewrite(path, add_model_keys(n))
    lines = [f"model extra{i:02d}: in the checkpoint, not in this run" for i in range(n)]
    expected = head(path, n) + "".join(f"\n  {line}" for line in lines[:20])
    if n > 20:
        expected += f"\n  ... and {n - 20} more"
    assert mismatch_error(path, model, optimizer, data) == expected


def test_restore_reports_a_model_that_is_not_a_dict(tmp_path):
    path, model, optimizer, data = saved(tmp_path)

    def edit(state):
        state["model"] = [torch.zeros(1)]
    rewrite(path, edit)
    assert mismatch_error(path, model, optimizer, data) == (
        head(path, 1) + "\n  model: the checkpoint holds a list, not a state dict")


def test_restore_reports_model_data_and_optimizer_class_together(tmp_path):
    path, model, optimizer, data = saved(tmp_path)

    def edit(state):
        state["model"]["extra00"] = torch.zeros(1)
        state["data"]["extra"] = 1
    rewrite(path, edit)
    adam = torch.optim.Adam(model.parameters())
    assert mismatch_error(path, model, adam, data) == (
        head(path, 3) + "\n  model extra00: in the checkpoint, not in this run"
        "\n  data extra: in the checkpoint, not in this run"
        "\n  optimizer: the checkpoint's is torch.optim.sgd.SGD, this run's is torch.optim.adam.Adam")


def test_restore_of_optimizer_state_without_param_groups(tmp_path):
    path, model, optimizer, data = saved(tmp_path)
    rewrite(path, lambda state: state["optimizer"].pop("param_groups"))
    assert mismatch_error(path, model, optimizer, data) == (
        head(path, 1) + "\n  optimizer: 0 parameter groups in the checkpoint, 1 here")


def test_restore_of_optimizer_state_without_state_checks_the_rest(tmp_path):
    path, model, optimizer, data = saved(tmp_path)

    def edit(state):
        state["optimizer"].pop("state")
        state["model"]["extra00"] = torch.zeros(1)
    rewrite(path, edit)
    assert mismatch_error(path, model, optimizer, data) == (
        head(path, 1) + "\n  model extra00: in the checkpoint, not in this run")


def test_restore_counts_parameter_groups(tmp_path):
    path, model, optimizer, data = saved(tmp_path, groups=True)
    one_group = torch.optim.SGD(model.parameters(), lr=0.1)
    assert mismatch_error(path, model, one_group, data) == (
        head(path, 1) + "\n  optimizer: 2 parameter groups in the checkpoint, 1 here")


def test_restore_compares_each_group_count_and_settings(tmp_path):
    path, model, optimizer, data = saved(tmp_path, momentum=0.9)

    def edit(state):
        group = state["optimizer"]["param_groups"][0]
        group["params"] = group["params"] + [7]
        group["extra"] = 1
        del group["momentum"]
    rewrite(path, edit)
    assert mismatch_error(path, model, optimizer, data) == (
        head(path, 2) + "\n  optimizer group 0: 3 parameters in the checkpoint, 2 here"
        "\n  optimizer group 0: settings ['extra', 'momentum'] are in only one of them (another optimizer class?)")


@pytest.mark.parametrize("bad", [[0], [0, 1]])
def test_restore_names_optimizer_state_that_does_not_fit_in_any_group(tmp_path, bad):
    path, model, optimizer, data = saved(tmp_path, optimizer_class=torch.optim.Adam, groups=True)

    def edit(state):
        for i in bad:
            state["optimizer"]["state"][i]["exp_avg"] = torch.zeros(5)
    rewrite(path, edit)
    assert mismatch_error(path, model, optimizer, data) == (
        head(path, 1) + f"\n  optimizer state: {len(bad)} tensors do not fit their parameter (first: exp_avg of "
        "parameter 0 is (5,), the parameter here (2, 3))")


def test_restore_hands_the_optimizer_its_own_state_dict_only(tmp_path):
    path, model, optimizer, data = saved(tmp_path, optimizer_class=RecordingSGD, momentum=0.9)
    assert torch.load(path, weights_only=True)["optimizer"]["class"] == f"{__name__}.RecordingSGD"
    fresh, other, stream, _ = parts(optimizer_class=RecordingSGD, momentum=0.9)
    step, history = restore(path, fresh, other, stream, steps=5)
    assert step == 2 and history["losses"] == [1.0, 0.5]
    assert other.loaded_keys == [["param_groups", "state"]]
    assert torch.equal(other.state_dict()["state"][0]["momentum_buffer"],
                       optimizer.state_dict()["state"][0]["momentum_buffer"])


# -- RNG states, CUDA included (faked: this runs on CPU-only machines) -------------------------------------------

def test_rng_state_holds_the_cuda_states_when_cuda_is_there(tmp_path, monkeypatch):
    cuda_states = [torch.arange(4, dtype=torch.uint8)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: cuda_states)
    state = checkpoint_mod._rng_state()
    assert set(state) == {"torch", "python", "python_version", "python_gauss", "cuda"}
    assert state["cuda"] is cuda_states


class SetCalls:
    def __init__(self):
        self.calls = []

    def __call__(self, states):
        self.calls.append(states)


@pytest.mark.parametrize("cuda, with_states, called", [(True, True, True), (True, False, False),
                                                        (False, True, False)])
def test_set_rng_state_sets_cuda_only_when_saved_and_present(monkeypatch, cuda, with_states, called):
    setter = SetCalls()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", setter)
    before_torch, before_python = torch.get_rng_state(), random.getstate()
    state = checkpoint_mod._rng_state()
    expected = (torch.rand(3), random.random())
    cuda_states = [torch.arange(4, dtype=torch.uint8)]
    state.pop("cuda", None)
    if with_states:
        state["cuda"] = cuda_states
    try:
        checkpoint_mod._set_rng_state(state)
        assert (torch.rand(3).tolist(), random.random()) == (expected[0].tolist(), expected[1])
    finally:
        torch.set_rng_state(before_torch)
        random.setstate(before_python)
    assert setter.calls == ([cuda_states] if called else [])
    if called:
        assert setter.calls[0] is cuda_states
