"""A small training loop: plain-text progress, loss and expert-load history, atomic checkpoints, exact resume.
(Taught in chapter 03; used by chapters 04 and 05.)

Each step: ``out = model(x)``; ``loss = loss_fn(out, y) + aux_coef * collect_aux_loss(model, clear=True)``;
backward; step.
The history keeps the task loss (without the aux term) so dense and MoE runs compare on the same quantity.

Checkpoints (``checkpoint=``, ``save_every=``, ``resume=``) are atomic and weights-only, and resume bit for bit:
a run stopped at step k and resumed produces the same losses as one that never stopped (``labutils.checkpoint``).

Nothing is lost to a bad input:

- a non-finite loss (a learning rate that diverges, NaN in the data) stops the run *before* that step's update
  with a :class:`NonFiniteLossError` naming the step and its likely cause; ``err.result`` holds the history so far
  (``allow_nonfinite=True`` records the value and carries on);
- the checkpoint's directory is checked before the first step; a save that still fails mid-run raises a
  :class:`CheckpointSaveError` whose ``err.result`` holds the history, and the previous checkpoint stays intact;
- a file that is not a readable checkpoint, or one of another configuration, raises a :class:`CheckpointError`
  naming the path and every mismatch, before anything is loaded.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ._deprecate import forward_moved
from .checkpoint import check_writable, restore
from .checkpoint import save_or_raise as _save
from .data import _size  # the one int check of the trainer and its data
from .models import AUX_COEF, ExpertLoadRecorder
from .moe.gates import collect_aux_loss

forward_moved(__name__)  # the checkpoint functions' old addresses here warn: labutils.checkpoint is theirs


class NonFiniteLossError(FloatingPointError):
    """The loss of step ``step`` was NaN or infinite; raised before that step's update (the weights are those
    of step ``step - 1``). ``result`` is the :class:`TrainResult` of the steps before it."""

    def __init__(self, message: str, *, step: int, loss: float, aux: float, result: "TrainResult"):
        super().__init__(message)
        self.step, self.loss, self.aux, self.result = step, loss, aux, result

def mse(out, target):
    """Mean squared error: the book's regression loss."""
    return F.mse_loss(out, target)


def lm_cross_entropy(logits, targets):
    """Next-character cross entropy in nats: logits ``(B, T, V)``, targets ``(B, T)``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@dataclass
class TrainResult:
    """What :func:`train` measured, one entry per step (``val``: ``(step, loss)`` pairs)."""
    losses: list = field(default_factory=list)   # task loss per step
    aux: list = field(default_factory=list)      # summed gate loss per step (before aux_coef)
    val: list = field(default_factory=list)      # [(step, validation loss)]
    load: list = field(default_factory=list)     # per step: (layers, experts) token counts
    seconds: float = 0.0                         # wall time of this call (not of earlier resumed parts)
    steps_run: int = 0                           # steps run by this call

    @property
    def steps(self) -> int:
        return len(self.losses)

    def expert_load(self, layer: int | None = None) -> torch.Tensor:
        """``(steps, experts)`` counts for ``plot_expert_load``: one layer, or summed over layers (None)."""
        if not self.load:
            raise ValueError("no expert load recorded: the model has no MoE layer or record_load was False")
        load = torch.stack(self.load)  # (steps, layers, experts)
        return load.sum(1) if layer is None else load[:, layer]

    def state(self) -> dict:
        return {"losses": list(self.losses), "aux": list(self.aux), "val": [list(v) for v in self.val],
                "load": torch.stack(self.load) if self.load else None}

    @classmethod
    def from_state(cls, state: dict) -> "TrainResult":
        load = state["load"]
        return cls(list(state["losses"]), list(state["aux"]), [tuple(v) for v in state["val"]],
                   list(load.unbind(0)) if load is not None else [])


class Progress:
    """A plain-text progress line every ``total // lines`` steps (no tqdm, no carriage returns)."""

    def __init__(self, total: int, label: str = "train", lines: int = 10, width: int = 20, stream=None):
        self.total, self.label, self.width = total, label, width
        self.every = max(1, total // max(1, lines))
        self.stream = stream or sys.stdout
        self.t0 = time.perf_counter()

    def update(self, step: int, **metrics) -> None:
        if step % self.every and step != self.total:
            return
        filled = round(self.width * step / max(1, self.total))
        bar = "#" * filled + "." * (self.width - filled)
        shown = " ".join(f"{k} {v:.4f}" for k, v in metrics.items() if v is not None)
        print(f"{self.label} {step:>{len(str(self.total))}}/{self.total} [{bar}] {shown} "
              f"({time.perf_counter() - self.t0:.1f} s)", file=self.stream, flush=True)

def _is_engine(model) -> bool:
    """A DeepSpeed engine: it owns backward() and step() and wraps the real model in .module."""
    return all(hasattr(model, a) for a in ("backward", "step", "module"))


def _positive(value) -> bool:
    if isinstance(value, (bool, str)):
        return False
    try:
        return math.isfinite(float(value)) and float(value) > 0
    except (TypeError, ValueError):
        return False


def _check_arguments(model, data, steps, save_every, eval_every, lr, clip, checkpoint, engine) -> int:
    """Every argument of :func:`train` that can be wrong before the first step, with what was expected."""
    if engine and checkpoint is not None:
        raise ValueError("checkpoints of a DeepSpeed engine go through engine.save_checkpoint, not train()")
    steps = _size("steps", steps, minimum=0)
    _size("save_every", save_every, minimum=0)
    _size("eval_every", eval_every, minimum=0)
    if not engine and not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module or a DeepSpeed engine, got {type(model).__name__}")
    needed = ("next_batch",) + (("state_dict", "load_state_dict") if checkpoint is not None else ())
    if not all(hasattr(data, a) for a in needed):
        raise TypeError(f"data must be a stream with {', '.join(needed)} (labutils.data: RandomPairs, EpochBatches, "
                        f"CharBatches), got {type(data).__name__}; wrap fixed tensors in EpochBatches(x, y, batch)")
    for name, value in (("lr", lr), ("clip", clip)):
        if value is not None and not _positive(value):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if checkpoint is not None:
        check_writable(os.fspath(checkpoint))
    return steps

def train(model, data, *, steps: int, loss_fn: Callable = mse, optimizer: torch.optim.Optimizer | None = None,
          lr: float = 1e-3, aux_coef: float = AUX_COEF, clip: float | None = None, checkpoint=None,
          save_every: int = 0, resume: bool = True, eval_fn: Callable | None = None, eval_every: int = 0,
          record_load: bool = True, progress: bool = True, label: str = "train",
          allow_nonfinite: bool = False) -> TrainResult:
    """Train ``model`` for ``steps`` total steps on ``data`` (a stream from ``labutils.data``). (Chapter 03.)

    ``model`` may be a plain module (``optimizer`` defaults to Adam(lr)) or a DeepSpeed engine (its own
    optimizer; no checkpoint). ``checkpoint``: a path; with ``resume`` an existing one is continued, and it is
    rewritten every ``save_every`` steps and at the end. ``eval_fn(model) -> float`` runs under ``no_grad`` in
    eval mode every ``eval_every`` steps. Returns the whole history, earlier resumed steps included.
    A NaN or infinite loss raises :class:`NonFiniteLossError` before its update (``allow_nonfinite=True``
    carries on); a failed save raises :class:`CheckpointSaveError`. Both keep the history in ``err.result``.
    """
    engine = _is_engine(model)
    steps = _check_arguments(model, data, steps, save_every, eval_every, lr if optimizer is None else None, clip,
                             checkpoint, engine)
    net = model.module if engine else model
    if optimizer is None and not engine:
        optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    history, start = TrainResult(), 0
    if checkpoint is not None and resume and os.path.exists(checkpoint):
        start, history = _restore(checkpoint, net, optimizer, data, steps)
        if start == steps and progress:
            print(f"{label}: {checkpoint} is already at step {steps}: nothing to run (ask for more steps to go on)")
    recorder = ExpertLoadRecorder(net) if record_load else None
    bar = Progress(steps, label) if progress else None
    t0 = time.perf_counter()
    try:
        net.train()
        for step in range(start + 1, steps + 1):
            try:
                task, aux = _step(model, net, data, loss_fn, optimizer, aux_coef, clip, engine, allow_nonfinite)
            except _NonFinite as bad:
                _finish(history, t0, step - 1 - start)
                raise NonFiniteLossError(f"step {step}: {bad.message}", step=step, loss=bad.task, aux=bad.aux,
                                         result=history) from None
            history.losses.append(task)
            history.aux.append(aux)
            if recorder is not None and (counts := recorder.pop()) is not None:
                history.load.append(counts)
            if eval_fn is not None and eval_every and (step % eval_every == 0 or step == steps):
                history.val.append((step, _evaluate(net, eval_fn, recorder)))
            if bar is not None:
                bar.update(step, loss=task, val=history.val[-1][1] if history.val else None)
            if checkpoint is not None and ((save_every and step % save_every == 0) or step == steps):
                _save(checkpoint, net, optimizer, step, data, _finish(history, t0, step - start))
    finally:
        if recorder is not None:
            recorder.close()
    return _finish(history, t0, max(0, steps - start))


def _restore(path, net, optimizer, data, steps) -> tuple[int, TrainResult]:
    """``labutils.checkpoint.restore``, with the history as a :class:`TrainResult`."""
    step, saved = restore(path, net, optimizer, data, steps)
    return step, TrainResult.from_state(saved)


def _finish(history: TrainResult, t0: float, ran: int) -> TrainResult:
    history.seconds, history.steps_run = time.perf_counter() - t0, ran
    return history

class _NonFinite(Exception):
    def __init__(self, message: str, task: float, aux: float):
        super().__init__(message)
        self.message, self.task, self.aux = message, task, aux


def _step(model, net, data, loss_fn, optimizer, aux_coef, clip, engine, allow_nonfinite=False):
    """One optimisation step; returns (task loss, aux loss) as floats. A non-finite loss stops before backward."""
    x, y = data.next_batch()
    device = next(net.parameters()).device
    x, y = x.to(device), y.to(device)
    out = model(x)
    task = loss_fn(out, y)
    aux = collect_aux_loss(net, clear=True)
    loss = task + aux_coef * aux
    task_value, aux_value = task.item(), float(aux.detach())
    if not allow_nonfinite and not math.isfinite(float(loss.detach())):
        raise _NonFinite(_why_nonfinite(task_value, aux_value, x, y, net, optimizer), task_value, aux_value)
    if engine:
        model.backward(loss)
        model.step()
    else:
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(net.parameters(), clip)
        optimizer.step()
    return task_value, aux_value


def _why_nonfinite(task: float, aux: float, x, y, net, optimizer) -> str:
    """The message of a non-finite loss: its value and the likeliest cause (the data, or a diverged update)."""
    head = f"the loss is {task} (aux {aux}); stopped before this step's update"
    bad_data = [f"{name} hold {n} non-finite of {t.numel()} values" for name, t in (("inputs", x), ("targets", y))
                if t.is_floating_point() and (n := int((~torch.isfinite(t)).sum()))]
    bad_params = [name for name, p in net.named_parameters() if not bool(torch.isfinite(p).all())]
    lrs = sorted({g["lr"] for g in getattr(optimizer, "param_groups", [])})
    smaller = f"try an lr below {lrs}" if lrs else "try a smaller learning rate"
    if bad_data:
        cause = "the batch is not finite: " + " and ".join(bad_data) + "; clean the data"
    elif bad_params:
        cause = (f"{len(bad_params)} parameter tensors are already non-finite (first {bad_params[0]}): an earlier "
                 f"update diverged, or they were loaded that way ({smaller}, or clip=1.0)")
    elif not math.isfinite(aux):
        cause = "the gates' aux loss is not finite (the task loss is); look for non-finite tokens in the gate input"
    else:
        biggest = max((float(p.detach().abs().max()) for p in net.parameters() if p.numel()), default=0.0)
        cause = (f"the batch and the weights are finite (largest |weight| {biggest:.3g}): the loss overflowed "
                 f"({smaller})")
    return f"{head}: {cause}. err.result holds the history so far; train(..., allow_nonfinite=True) carries on"


def _evaluate(net, eval_fn, recorder) -> float:
    if recorder is not None:
        recorder.enabled = False
    net.eval()
    try:
        with torch.no_grad():
            value = float(eval_fn(net))
        collect_aux_loss(net, clear=True)  # drop the gate losses the evaluation forward left behind
    finally:
        net.train()
        if recorder is not None:
            recorder.enabled = True
    return value

def evaluate_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable = mse,
                  batch_size: int = 64) -> float:
    """Mean ``loss_fn`` over fixed ``(inputs, targets)`` in eval mode, batch by batch (weighted by size)."""
    if len(inputs) != len(targets) or len(inputs) == 0:
        raise ValueError(f"evaluate_loss needs as many inputs as targets, at least one: got {len(inputs)} inputs "
                         f"and {len(targets)} targets")
    _size("batch_size", batch_size)
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(inputs), batch_size):
            x, y = inputs[i:i + batch_size], targets[i:i + batch_size]
            total += float(loss_fn(model(x), y)) * len(x)
            n += len(x)
    model.train(was_training)
    return total / n
