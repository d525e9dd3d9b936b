"""labutils.train: exact resume, atomic weights-only checkpoints, progress, histories; labutils.data streams."""
import io
import os
import random

import pytest
import torch

import labutils.train as train_mod
from labutils.checkpoint import load_checkpoint
from labutils.data import CharBatches, EpochBatches, RandomPairs, char_corpus, fixed_windows
from labutils.models import CharLM, SeqRegressor, make_ffn
from labutils.moe import NoisyGate
from labutils.train import Progress, evaluate_loss, lm_cross_entropy, train


def noisy_model(seed):
    """A model that draws from the global RNG in training (NoisyGate), so resume must restore it."""
    torch.manual_seed(seed)
    return SeqRegressor(16, 2, lambda: make_ffn("fmoe", 16, 24, num_expert=4, top_k=2, gate=NoisyGate), n_layers=2)


def run(model, ckpt, steps, **kw):
    return train(model, RandomPairs(4, 6, 16, seed=7), steps=steps, checkpoint=ckpt, progress=False, lr=1e-2,
                 eval_fn=lambda m: evaluate_loss(m, *RandomPairs(8, 6, 16, seed=99).next_batch()), eval_every=2, **kw)


def test_resume_continues_bit_exactly(tmp_path):
    uninterrupted = noisy_model(0)
    full = run(uninterrupted, None, 7)
    first = run(noisy_model(0), tmp_path / "ck.pt", 4)
    random.random()
    torch.randn(100)  # disturb the global RNGs between the two parts, as a new session would
    resumed_model = noisy_model(5)  # different init: everything must come from the checkpoint
    second = run(resumed_model, tmp_path / "ck.pt", 7)
    assert first.losses == full.losses[:4]
    assert second.steps_run == 3
    assert second.losses == full.losses, "resumed losses differ from the uninterrupted run"
    assert second.aux == full.aux and second.val == full.val
    assert torch.equal(second.expert_load(), full.expert_load())
    for (name, a), b in zip(uninterrupted.state_dict().items(), resumed_model.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs after resume"


def test_checkpoint_is_weights_only_and_atomic(tmp_path, monkeypatch):
    path = tmp_path / "ck.pt"
    model = noisy_model(0)
    run(model, path, 2)
    state = torch.load(path, weights_only=True)  # raises if anything but tensors/containers/primitives is inside
    assert state["step"] == 2 and set(state) >= {"model", "optimizer", "rng", "data", "history"}
    assert not os.path.exists(str(path) + ".tmp")

    def torn_save(obj, f):  # a crash half-way through writing the next checkpoint
        with open(f, "wb") as fh:
            fh.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(train_mod.torch, "save", torn_save)
    with pytest.raises(OSError, match="disk full"):
        run(model, path, 4)
    assert load_checkpoint(path)["step"] == 2, "a failed save must leave the previous checkpoint intact"


def test_resume_at_the_end_does_not_train(tmp_path):
    first = run(noisy_model(0), tmp_path / "ck.pt", 3)
    again = run(noisy_model(1), tmp_path / "ck.pt", 3)
    assert again.steps_run == 0 and again.losses == first.losses


def test_bad_checkpoint_version_is_refused(tmp_path):
    torch.save({"version": 99}, tmp_path / "old.pt")
    with pytest.raises(ValueError, match="version 99"):
        load_checkpoint(tmp_path / "old.pt")


def test_progress_prints_about_ten_plain_lines():
    out = io.StringIO()
    bar = Progress(95, "fit", stream=out)
    for step in range(1, 96):
        bar.update(step, loss=1.0 / step)
    lines = out.getvalue().splitlines()
    assert 9 <= len(lines) <= 11 and "\r" not in out.getvalue()
    assert lines[-1].startswith("fit 95/95 [####################] loss 0.0105")


def test_history_feeds_the_plots_and_loss_falls():
    torch.manual_seed(0)
    model = SeqRegressor(16, 2, lambda: make_ffn("fmoe", 16, 32, num_expert=4, top_k=2), n_layers=1)
    result = train(model, RandomPairs(8, 8, 16, seed=0), steps=60, lr=3e-3, progress=False)
    load = result.expert_load()
    assert load.shape == (60, 4) and (load.sum(1) == 8 * 8 * 2).all()
    assert sum(result.losses[-10:]) / 10 < 0.7 * result.losses[0], "random-target regression should fall ~2 -> ~1"
    dense = SeqRegressor(16, 2, lambda: make_ffn("dense", 16, 32), n_layers=1)
    with pytest.raises(ValueError, match="no expert load"):
        train(dense, RandomPairs(2, 2, 16), steps=1, progress=False).expert_load()


def test_char_lm_trains_on_a_corpus():
    corpus = char_corpus("def f(x):\n    return x + 1\n" * 200, chunk=64)
    assert corpus.decode(corpus.encode("def f")) == "def f"
    assert len(corpus.train) + len(corpus.val) == corpus.text_chars
    torch.manual_seed(0)
    lm = CharLM(corpus.vocab_size, 16, 2, 1, 16, ffn=lambda: make_ffn("fmoe", 16, 16, num_expert=4, top_k=2))
    xv, yv = fixed_windows(corpus.val, 8, 16)
    result = train(lm, CharBatches(corpus.train, 8, 16), steps=40, lr=1e-2, loss_fn=lm_cross_entropy,
                   eval_fn=lambda m: evaluate_loss(m, xv, yv, lm_cross_entropy), eval_every=20, progress=False)
    assert [s for s, _ in result.val] == [20, 40]
    assert result.val[-1][1] < 0.5 * torch.log(torch.tensor(corpus.vocab_size)).item(), "a repeated line is easy"


def test_streams_resume_their_position():
    x, y = torch.arange(10.0)[:, None], -torch.arange(10.0)[:, None]
    a = EpochBatches(x, y, 3, seed=1)
    for _ in range(4):  # into the second epoch (3 batches per epoch)
        a.next_batch()
    b = EpochBatches(x, y, 3, seed=2)
    b.load_state_dict(a.state_dict())
    for _ in range(5):
        assert torch.equal(a.next_batch()[0], b.next_batch()[0])
    assert a.epoch == 2
    c = CharBatches(torch.arange(100), 2, 5, seed=0)
    c.next_batch()
    d = CharBatches(torch.arange(100), 2, 5, seed=9)
    d.load_state_dict(c.state_dict())
    assert torch.equal(c.next_batch()[0], d.next_batch()[0])
    xb, yb = c.next_batch()
    assert torch.equal(yb[:, :-1], xb[:, 1:]), "targets are the inputs shifted by one"
    with pytest.raises(ValueError, match="batch_size"):
        EpochBatches(x, y, 11)
