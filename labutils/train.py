"""A small training loop: plain-text progress, loss and expert-load history, atomic checkpoints, exact resume.
(Taught in chapter 03; used by chapters 04 and 05.)

Each step: ``out = model(x)``; ``loss = loss_fn(out, y) + aux_coef * aux_loss(model)``; backward; step.
The history keeps the task loss (without the aux term) so dense and MoE runs compare on the same quantity.

Checkpoints hold only tensors, numbers, strings, lists and dicts, so they load with
``torch.load(path, weights_only=True)``. They are written to ``path + ".tmp"`` and moved into place with
``os.replace`` (atomic on one file system): a crash mid-write never leaves a torn checkpoint. Resuming
restores model, optimizer, step, the global RNG states and the data stream's position, so a run stopped at
step k and resumed produces the same losses, bit for bit, as one that never stopped.
"""
from __future__ import annotations

import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .transformer import AUX_COEF, ExpertLoadRecorder, aux_loss

CHECKPOINT_VERSION = 1


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


def _rng_state() -> dict:
    version, internal, gauss_next = random.getstate()
    state = {"torch": torch.get_rng_state(), "python": list(internal), "python_version": version,
             "python_gauss": gauss_next}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path, *, model, optimizer, step: int, data, history: TrainResult) -> None:
    """Write everything needed to resume to ``path`` atomically (tmp file + ``os.replace``)."""
    state = {"version": CHECKPOINT_VERSION, "step": step, "model": model.state_dict(),
             "optimizer": optimizer.state_dict(), "rng": _rng_state(), "data": data.state_dict(),
             "history": history.state()}
    path = os.fspath(path)
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path) -> dict:
    """Read a checkpoint with ``weights_only=True`` (no arbitrary code runs) and check its version."""
    state = torch.load(os.fspath(path), weights_only=True)
    if state.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{path}: checkpoint version {state.get('version')} is not {CHECKPOINT_VERSION}")
    return state


def _is_engine(model) -> bool:
    """A DeepSpeed engine: it owns backward() and step() and wraps the real model in .module."""
    return all(hasattr(model, a) for a in ("backward", "step", "module"))


def train(model, data, *, steps: int, loss_fn: Callable = mse, optimizer: torch.optim.Optimizer | None = None,
          lr: float = 1e-3, aux_coef: float = AUX_COEF, clip: float | None = None, checkpoint=None,
          save_every: int = 0, resume: bool = True, eval_fn: Callable | None = None, eval_every: int = 0,
          record_load: bool = True, progress: bool = True, label: str = "train") -> TrainResult:
    """Train ``model`` for ``steps`` total steps on ``data`` (a stream from ``labutils.data``). (Chapter 03.)

    ``model`` may be a plain module (``optimizer`` defaults to Adam(lr)) or a DeepSpeed engine (its own
    optimizer; no checkpoint). ``checkpoint``: a path; with ``resume`` an existing one is continued, and it is
    rewritten every ``save_every`` steps and at the end. ``eval_fn(model) -> float`` runs under ``no_grad`` in
    eval mode every ``eval_every`` steps. Returns the whole history, earlier resumed steps included.
    """
    engine = _is_engine(model)
    net = model.module if engine else model
    if engine and checkpoint is not None:
        raise ValueError("checkpoints of a DeepSpeed engine go through engine.save_checkpoint, not train()")
    if optimizer is None and not engine:
        optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    history, start = TrainResult(), 0
    if checkpoint is not None and resume and os.path.exists(checkpoint):
        start, history = _restore(checkpoint, net, optimizer, data)
    recorder = ExpertLoadRecorder(net) if record_load else None
    bar = Progress(steps, label) if progress else None
    t0 = time.perf_counter()
    try:
        net.train()
        for step in range(start + 1, steps + 1):
            task, aux = _step(model, net, data, loss_fn, optimizer, aux_coef, clip, engine)
            history.losses.append(task)
            history.aux.append(aux)
            if recorder is not None and (counts := recorder.pop()) is not None:
                history.load.append(counts)
            if eval_fn is not None and eval_every and (step % eval_every == 0 or step == steps):
                history.val.append((step, _evaluate(net, eval_fn, recorder)))
            if bar is not None:
                bar.update(step, loss=task, val=history.val[-1][1] if history.val else None)
            if checkpoint is not None and ((save_every and step % save_every == 0) or step == steps):
                save_checkpoint(checkpoint, model=net, optimizer=optimizer, step=step, data=data, history=history)
    finally:
        if recorder is not None:
            recorder.close()
    history.seconds, history.steps_run = time.perf_counter() - t0, max(0, steps - start)
    return history


def _step(model, net, data, loss_fn, optimizer, aux_coef, clip, engine):
    """One optimisation step; returns (task loss, aux loss) as floats."""
    x, y = data.next_batch()
    device = next(net.parameters()).device
    x, y = x.to(device), y.to(device)
    out = model(x)
    task = loss_fn(out, y)
    aux = aux_loss(net)
    loss = task + aux_coef * aux
    if engine:
        model.backward(loss)
        model.step()
    else:
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(net.parameters(), clip)
        optimizer.step()
    return task.item(), float(aux.detach())


def _evaluate(net, eval_fn, recorder) -> float:
    if recorder is not None:
        recorder.enabled = False
    net.eval()
    try:
        with torch.no_grad():
            value = float(eval_fn(net))
        aux_loss(net)  # drop the gate losses the evaluation forward left behind
    finally:
        net.train()
        if recorder is not None:
            recorder.enabled = True
    return value


def _restore(path, net, optimizer, data):
    state = load_checkpoint(path)
    net.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    data.load_state_dict(state["data"])
    _set_rng_state(state["rng"])
    return int(state["step"]), TrainResult.from_state(state["history"])


def evaluate_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable = mse,
                  batch_size: int = 64) -> float:
    """Mean ``loss_fn`` over fixed ``(inputs, targets)`` in eval mode, batch by batch (weighted by size)."""
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
