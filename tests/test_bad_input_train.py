"""Bad input to the trainer, its checkpoints, the plots and the data streams (issue 19): a clear error that names
the bad value, raised before anything is lost or overwritten; never a NaN history, an empty plot or 0 steps
without a word."""
import math
import os
import pickle
import traceback
from typing import Any

import matplotlib.pyplot as plt
import pytest
import torch

import labutils.checkpoint as checkpoint_mod
import labutils.train as train_mod
from labutils import plot_expert_load, plot_losses, plot_param_counts
from labutils.checkpoint import CheckpointError, CheckpointSaveError, load_checkpoint
from labutils.data import CharBatches, EpochBatches, RandomPairs, char_corpus, fixed_windows
from labutils.models import SeqRegressor, make_ffn
from labutils.train import NonFiniteLossError, evaluate_loss, train

D = 8


def moe_model(seed=0, d=D, hidden=2 * D):
    torch.manual_seed(seed)
    return SeqRegressor(d, 2, lambda: make_ffn("fmoe", d, hidden, num_expert=4, top_k=2), n_layers=1)


def wrong(value) -> Any:
    """A value of the wrong type, passed on purpose (keeps the type checker quiet about the test's intent)."""
    return value


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def same_weights(model, before):
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


class PoisonedPairs(RandomPairs):
    """RandomPairs whose batch number ``bad`` holds a NaN input (the 'NaN in the data' of the issue)."""

    def __init__(self, *args, bad, **kwargs):
        super().__init__(*args, **kwargs)
        self.bad = bad

    def next_batch(self):
        x, y = super().next_batch()
        if self.position == self.bad:
            x[0, 0, 0] = math.nan
        return x, y


def quiet_train(model, data, **kw):
    kw.setdefault("lr", 1e-2)
    return train(model, data, progress=False, **kw)


# -- non-finite losses ------------------------------------------------------------------------------------------

def test_nan_data_stops_at_its_step_before_the_update_and_keeps_the_history():
    model, two_steps = moe_model(), moe_model()
    reference = quiet_train(two_steps, RandomPairs(2, 4, D, seed=1), steps=2)
    with pytest.raises(NonFiniteLossError, match=r"step 3: the loss is nan.*inputs hold 1 non-finite") as err:
        quiet_train(model, PoisonedPairs(2, 4, D, seed=1, bad=3), steps=6)
    assert err.value.step == 3 and math.isnan(err.value.loss)
    assert err.value.result.losses == reference.losses and err.value.result.steps_run == 2
    assert "allow_nonfinite=True" in str(err.value)
    assert same_weights(model, weights(two_steps)), "stopped before step 3's update: the weights of step 2"


def test_a_diverging_learning_rate_names_the_step_and_the_lr():
    model = moe_model()
    sgd = torch.optim.SGD(model.parameters(), lr=1e4)
    with pytest.raises(NonFiniteLossError, match=r"step \d+: .*try an lr below \[10000\.0\]") as err:
        quiet_train(model, RandomPairs(2, 4, D, seed=0), steps=50, optimizer=sgd)
    step = err.value.step
    assert 1 < step <= 50 and len(err.value.result.losses) == step - 1
    assert all(math.isfinite(v) for v in err.value.result.losses)


def test_allow_nonfinite_records_the_nan_and_carries_on():
    result = quiet_train(moe_model(), PoisonedPairs(2, 4, D, seed=1, bad=3), steps=5, allow_nonfinite=True)
    assert result.steps_run == 5 and len(result.losses) == 5
    assert math.isnan(result.losses[2]) and all(math.isfinite(v) for v in result.losses[:2])


@pytest.mark.parametrize("steps", [-1, 2.0, "3", True, None])
def test_steps_must_be_a_non_negative_int(steps):
    data = RandomPairs(2, 4, D)
    with pytest.raises(ValueError, match=f"steps must be an int >= 0, got {steps!r}"):
        quiet_train(moe_model(), data, steps=steps)
    assert data.position == 0


@pytest.mark.parametrize(("kw", "match"), [({"save_every": -2}, "save_every"), ({"eval_every": 1.5}, "eval_every"),
                                          ({"lr": 0}, "lr must be"), ({"lr": math.nan}, "lr must be"),
                                          ({"clip": -1.0}, "clip must be")])
def test_other_arguments_are_checked_before_the_first_step(kw, match):
    data = RandomPairs(2, 4, D)
    with pytest.raises(ValueError, match=match):
        quiet_train(moe_model(), data, steps=3, **kw)
    assert data.position == 0


def test_data_must_be_a_stream():
    x = torch.randn(4, 4, D)
    with pytest.raises(TypeError, match="EpochBatches"):
        quiet_train(moe_model(), (x, x), steps=1)


def test_resuming_past_the_end_is_refused_and_at_the_end_says_so(tmp_path, capsys):
    path = tmp_path / "ck.pt"
    quiet_train(moe_model(), RandomPairs(2, 4, D), steps=5, checkpoint=path)
    stamp = path.read_bytes()
    model = moe_model(seed=1)
    before = weights(model)
    with pytest.raises(ValueError, match=r"already at step 5, past steps=3: ask for steps >= 5"):
        quiet_train(model, RandomPairs(2, 4, D), steps=3, checkpoint=path)
    assert same_weights(model, before) and path.read_bytes() == stamp
    capsys.readouterr()
    again = train(moe_model(), RandomPairs(2, 4, D), steps=5, checkpoint=path)
    assert again.steps_run == 0 and "already at step 5: nothing to run" in capsys.readouterr().out


# -- unreadable checkpoints ---------------------------------------------------------------------------------------

class NotATensor:
    pass


def _bad_files(folder):
    good = folder / "good.pt"
    quiet_train(moe_model(), RandomPairs(2, 4, D), steps=1, checkpoint=good)
    blob = good.read_bytes()
    files = {"empty": (b"", "empty"), "truncated": (blob[: len(blob) // 2], "truncated"),
             "random": (os.urandom(600), "not"), "text": (b"hello, world", "not")}
    for name, (data, _) in files.items():
        (folder / f"{name}.pt").write_bytes(data)
    torch.save({"x": NotATensor()}, folder / "object.pt")
    with open(folder / "pickle.pt", "wb") as fh:
        pickle.dump({"x": 1}, fh, protocol=4)
    causes = {name: cause for name, (_, cause) in files.items()} | {"object": "not written by labutils",
                                                                     "pickle": "not written by labutils"}
    return {name: (folder / f"{name}.pt", cause) for name, cause in causes.items()}


def test_unreadable_checkpoints_name_the_path_and_the_cause_never_weights_only_false(tmp_path):
    for name, (path, cause) in _bad_files(tmp_path).items():
        for via_train in (False, True):
            with pytest.raises(CheckpointError) as err:
                if via_train:
                    quiet_train(moe_model(), RandomPairs(2, 4, D), steps=2, checkpoint=path)
                else:
                    load_checkpoint(path)
            text = "".join(traceback.format_exception(err.value))
            assert str(path) in str(err.value) and cause in str(err.value), (name, str(err.value))
            assert "weights_only=False" not in text and "`weights_only` set to `False`" not in text, name
        assert path.exists(), "a bad checkpoint is reported, not overwritten"
    with pytest.raises(FileNotFoundError, match="no such checkpoint file.*absent.pt"):
        load_checkpoint(tmp_path / "absent.pt")
    with pytest.raises(CheckpointError, match="a directory, not a checkpoint file"):
        load_checkpoint(tmp_path)


# -- a checkpoint of another run ----------------------------------------------------------------------------------

def test_a_checkpoint_of_another_config_loads_nothing_and_lists_every_mismatch(tmp_path):
    path = tmp_path / "small.pt"
    quiet_train(moe_model(hidden=2 * D), RandomPairs(2, 4, D), steps=2, checkpoint=path)
    other = moe_model(hidden=3 * D)  # every expert tensor differs in shape; attention, gate and norms do not
    before = weights(other)
    own, saved = other.state_dict(), load_checkpoint(path)["model"]
    differing = [k for k in own if own[k].shape != saved[k].shape]
    assert 0 < len(differing) < len(own)  # some tensors would have loaded fine: the partial overwrite of today
    with pytest.raises(CheckpointError, match="does not fit this run") as err:
        quiet_train(other, RandomPairs(2, 4, D), steps=4, checkpoint=path)
    for key in differing:
        assert f"model {key}: {tuple(saved[key].shape)} in the checkpoint, {tuple(own[key].shape)} here" in str(
            err.value)
    assert "optimizer state" in str(err.value)
    assert same_weights(other, before), "no tensor may be loaded from a checkpoint that does not fit"


def test_another_optimizer_class_is_refused_before_loading(tmp_path):
    path = tmp_path / "adam.pt"
    quiet_train(moe_model(), RandomPairs(2, 4, D), steps=2, checkpoint=path)
    model = moe_model(seed=3)
    before = weights(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(CheckpointError, match=r"optimizer: the checkpoint's is torch\.optim\.adam\.Adam, this "
                                              r"run's is torch\.optim\.sgd\.SGD"):
        quiet_train(model, RandomPairs(2, 4, D), steps=4, checkpoint=path, optimizer=sgd)
    assert same_weights(model, before) and not sgd.state
    state = torch.load(path, weights_only=True)  # a checkpoint without the class: the settings still tell
    del state["optimizer"]["class"]
    torch.save(state, path)
    with pytest.raises(CheckpointError, match="another optimizer class"):
        quiet_train(model, RandomPairs(2, 4, D), steps=4, checkpoint=path, optimizer=sgd)
    assert same_weights(model, before)


def test_another_data_stream_is_refused_before_loading(tmp_path):
    path = tmp_path / "pairs.pt"
    quiet_train(moe_model(), RandomPairs(2, 4, D), steps=2, checkpoint=path)
    model = moe_model(seed=3)
    before = weights(model)
    x = torch.randn(6, 4, D)
    with pytest.raises(CheckpointError, match="data order: missing from the checkpoint"):
        quiet_train(model, EpochBatches(x, x, 2), steps=4, checkpoint=path)
    assert same_weights(model, before)


# -- where checkpoints go ----------------------------------------------------------------------------------------

def test_a_missing_directory_fails_before_the_first_step(tmp_path):
    (tmp_path / "a_file").write_text("x")
    cases = {tmp_path / "missing" / "ck.pt": "does not exist",
             tmp_path / "a_file" / "ck.pt": "is a file, not a directory", tmp_path: "is a directory"}
    for path, match in cases.items():
        data = RandomPairs(2, 4, D)
        with pytest.raises(CheckpointError, match=match):
            quiet_train(moe_model(), data, steps=3, checkpoint=path)
        assert data.position == 0, "checked before training, not after it"


def test_a_read_only_directory_fails_before_the_first_step(tmp_path, monkeypatch):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        probe = folder / "probe"
        try:
            probe.write_text("x")  # root ignores the mode bits: refuse the write as a read-only disk would
            probe.unlink()

            def read_only(file, mode="r", *args, **kwargs):
                if str(file).startswith(str(folder)) and "w" in mode:
                    raise PermissionError(13, "Permission denied", str(file))
                return open(file, mode, *args, **kwargs)
            monkeypatch.setattr(checkpoint_mod, "open", read_only, raising=False)  # its probe file
        except PermissionError:
            pass
        data = RandomPairs(2, 4, D)
        with pytest.raises(CheckpointError, match=r"cannot be written .*Permission denied"):
            quiet_train(moe_model(), data, steps=3, checkpoint=folder / "ck.pt")
        assert data.position == 0 and os.listdir(folder) == []
    finally:
        folder.chmod(0o755)


def test_a_save_that_fails_mid_run_keeps_the_history_and_the_last_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ck.pt"
    real_save, calls = torch.save, []

    def flaky_save(obj, f):
        calls.append(f)
        if len(calls) == 2:  # the second save (step 4) hits a full disk half-way
            with open(f, "wb") as fh:
                fh.write(b"half")
            raise OSError(28, "No space left on device")
        real_save(obj, f)

    monkeypatch.setattr(train_mod.torch, "save", flaky_save)
    with pytest.raises(CheckpointSaveError, match=r"step 4: writing checkpoint .*No space left") as err:
        quiet_train(moe_model(), RandomPairs(2, 4, D), steps=6, save_every=2, checkpoint=path)
    assert isinstance(err.value, OSError) and err.value.step == 4
    assert err.value.result.steps == 4 and err.value.result.steps_run == 4
    assert all(math.isfinite(v) for v in err.value.result.losses)
    assert load_checkpoint(path)["step"] == 2 and os.listdir(tmp_path) == ["ck.pt"], "no .tmp left behind"


# -- plots -------------------------------------------------------------------------------------------------------

def test_a_nan_does_not_erase_the_smoothed_curve():
    values = [2.0 - 0.01 * i for i in range(40)]
    values[5] = math.nan
    values[9] = math.inf
    with pytest.warns(UserWarning, match=r"skipped non-finite values .*2 in 'run'"):
        fig = plot_losses({"run": values, "clean": values[:4] + [1.0] * 36}, smooth=0.9)
    lines = fig.axes[0].get_lines()
    smoothed = [ln for ln in lines if ln.get_label().startswith("run")][0].get_ydata()
    assert all(math.isfinite(v) for v in smoothed), "the average carries over the non-finite points"
    assert smoothed[-1] < smoothed[4] and smoothed[-1] > 1.5
    assert [ln.get_label() for ln in fig.axes[0].get_legend().get_lines()][0] == "run (2 non-finite skipped)"
    plt.close(fig)


@pytest.mark.parametrize(("runs", "kw", "match"), [
    ([], {}, "no values"), ({}, {}, "no values"), ({"a": [1.0], "b": []}, {}, r"\['b'\] have no values"),
    ([math.nan, math.nan], {}, "no finite value"),
    ([1.0, 0.0, 2.0], {"logy": True}, "logy=True needs values > 0.*reach 0.0"),
    ({"a": [1.0, -1.0]}, {"logy": True}, r"\['a'\]"),
    ({"a": [1.0, 2.0]}, {"steps": {"b": [1, 2]}}, r"steps names run\(s\) \['b'\]"),
    ({"a": [1.0, 2.0]}, {"steps": {"a": [10]}}, "1 steps for 2 values")])
def test_plot_losses_refuses_what_would_draw_empty_or_misleading_axes(runs, kw, match):
    plt.close("all")  # another test's figure (in whatever order the tests run) is not this call's
    with pytest.raises(ValueError, match=match):
        plot_losses(runs, **kw)
    assert not plt.get_fignums(), "no figure is left open by a refused call"


def test_plot_losses_names_the_run_and_value_that_is_not_a_number():
    with pytest.raises(TypeError, match=r"run 'b': value 1 is None, not a number"):
        plot_losses({"a": [1.0, 2.0], "b": [1.0, None]})
    with pytest.raises(TypeError, match="run 'a' must be a list of numbers, got float"):
        plot_losses({"a": 1.5})


@pytest.mark.parametrize(("counts", "kw", "error", "match"), [
    ({}, {}, ValueError, "no parameters"), ({"a": math.nan}, {}, ValueError, "finite numbers >= 0"),
    ({"a": -5}, {}, ValueError, "finite numbers >= 0"), ({"a": 0, "b": 0}, {}, ValueError, "every count is 0"),
    ({"a": 10, "b": 0}, {"log": True}, ValueError, r"log=True .*\['b'\]"),
    ([("a", 1)], {}, TypeError, "ParamCounts or a dict")])
def test_plot_param_counts_refuses_bad_counts(counts, kw, error, match):
    with pytest.raises(error, match=match):
        plot_param_counts(counts, **kw)


@pytest.mark.parametrize(("load", "match"), [
    (torch.zeros(0), "empty"), (torch.zeros(3, 0), "empty"),
    (torch.tensor([4.0, math.nan, 2.0]), r"1 entries are not \(at \[\(1,\)\]"),
    (torch.tensor([[1.0, 2.0], [3.0, -1.0]]), r"at \[\(1, 1\)\]"), (torch.tensor(3.0), "load must be")])
def test_plot_expert_load_refuses_empty_or_non_finite_counts(load, match):
    with pytest.raises(ValueError, match=match):
        plot_expert_load(load)


# -- data streams ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("make", "error", "match"), [
    (lambda: RandomPairs(0, 4, 8), ValueError, "batch must be an int >= 1, got 0"),
    (lambda: RandomPairs(2, wrong(4.0), 8), ValueError, "T must be an int >= 1, got 4.0"),
    (lambda: RandomPairs(2, 4, True), ValueError, "d must be an int >= 1, got True"),
    (lambda: EpochBatches(torch.ones(4, 2), torch.ones(4, 2), 0), ValueError, "batch_size must be an int >= 1"),
    (lambda: EpochBatches(wrong([1, 2]), wrong([1, 2]), 1), TypeError, "must be tensors"),
    (lambda: CharBatches(torch.arange(10), 2, 10), ValueError, "10 tokens, need at least block_size \\+ 1 = 11"),
    (lambda: CharBatches(torch.arange(10), -1, 4), ValueError, "batch_size must be an int >= 1, got -1"),
    (lambda: CharBatches(torch.rand(100), 2, 4), ValueError, "1-D tensor of token ids.*float32"),
    (lambda: CharBatches(torch.arange(100).view(10, 10), 2, 4), ValueError, r"shape \(10, 10\)"),
    (lambda: fixed_windows(torch.arange(100), 0, 4), ValueError, "n must be an int >= 1"),
    (lambda: char_corpus("short text", chunk=4), ValueError, "needs more than 36; lower chunk or val_every"),
    (lambda: char_corpus("x" * 100, val_every=1), ValueError, "val_every must be an int >= 2"),
    (lambda: char_corpus(wrong(b"bytes")), TypeError, "text must be a str")])
def test_stream_arguments_are_checked(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_a_stream_refuses_the_state_of_another_stream():
    x = torch.randn(6, 3)
    epochs = EpochBatches(x, x, 2)
    with pytest.raises(ValueError, match=r"lacks \['epoch', 'index', 'order'\]"):
        epochs.load_state_dict(RandomPairs(2, 2, 2).state_dict())
    other = EpochBatches(torch.randn(8, 3), torch.randn(8, 3), 2)
    with pytest.raises(ValueError, match="dataset of 8 samples"):
        epochs.load_state_dict(other.state_dict())


def test_evaluate_loss_refuses_empty_or_mismatched_data():
    model = moe_model()
    x = torch.randn(4, 4, D)
    with pytest.raises(ValueError, match="0 inputs and 0 targets"):
        evaluate_loss(model, x[:0], x[:0])
    with pytest.raises(ValueError, match="4 inputs and 3 targets"):
        evaluate_loss(model, x, x[:3])
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        evaluate_loss(model, x, x, batch_size=0)
