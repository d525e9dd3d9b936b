"""A small training loop: plain-text progress, loss and expert-load history, atomic checkpoints, exact resume.
(Taught in chapter 03; used by chapters 04 and 05.)

Each step: ``out = model(x)``; ``loss = loss_fn(out, y) + aux_coef * collect_aux_loss(model, clear=True)``;
backward; step.
The history keeps the task loss (without the aux term) so dense and MoE runs compare on the same quantity.

Checkpoints hold only tensors, numbers, strings, lists and dicts, so they load with
``torch.load(path, weights_only=True)``. They are written to ``path + ".tmp"`` and moved into place with
``os.replace`` (atomic on one file system): a crash mid-write never leaves a torn checkpoint. Resuming
restores model, optimizer, step, the global RNG states and the data stream's position, so a run stopped at
step k and resumed produces the same losses, bit for bit, as one that never stopped.

Nothing is lost to a bad input:

- a non-finite loss (a learning rate that diverges, NaN in the data) stops the run *before* that step's update
  with a :class:`NonFiniteLossError` naming the step and its likely cause; ``err.result`` holds the history so far
  (``allow_nonfinite=True`` records the value and carries on);
- the checkpoint's directory is checked before the first step; a save that still fails mid-run raises a
  :class:`CheckpointSaveError` whose ``err.result`` holds the history, and the previous checkpoint stays intact;
- a file that is not a readable checkpoint (empty, truncated, another format) raises a :class:`CheckpointError`
  naming the path and the cause; a checkpoint of another configuration is compared with the model, the
  optimizer (its class is stored next to its state, under ``"class"``) and the data stream *before anything is
  loaded*, and the error lists every mismatch.
"""
from __future__ import annotations

import errno
import math
import numbers
import os
import pickle
import random
import re
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .models import AUX_COEF, ExpertLoadRecorder
from .moe.gates import collect_aux_loss

CHECKPOINT_VERSION = 1
CHECKPOINT_KEYS = ("version", "step", "model", "optimizer", "rng", "data", "history")


class NonFiniteLossError(FloatingPointError):
    """The loss of step ``step`` was NaN or infinite; raised before that step's update (the weights are those
    of step ``step - 1``). ``result`` is the :class:`TrainResult` of the steps before it."""

    def __init__(self, message: str, *, step: int, loss: float, aux: float, result: "TrainResult"):
        super().__init__(message)
        self.step, self.loss, self.aux, self.result = step, loss, aux, result


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, does not fit this run, or cannot be written where asked."""


class CheckpointSaveError(OSError):
    """Writing the checkpoint failed mid-run; ``result`` holds the history up to ``step`` (nothing is lost)."""

    def __init__(self, message: str, *, path: str, step: int, result: "TrainResult"):
        super().__init__(message)
        self.path, self.step, self.result = path, step, result


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
    optimizer_state = {**optimizer.state_dict(), "class": _class_name(optimizer)}
    state = {"version": CHECKPOINT_VERSION, "step": step, "model": model.state_dict(),
             "optimizer": optimizer_state, "rng": _rng_state(), "data": data.state_dict(),
             "history": history.state()}
    path = os.fspath(path)
    tmp = path + ".tmp"
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):  # never leave half a file behind
            os.remove(tmp)
        raise


def load_checkpoint(path) -> dict:
    """Read a checkpoint with ``weights_only=True`` (no arbitrary code runs) and check its version and keys.

    A file that is empty, truncated or not a labutils checkpoint raises :class:`CheckpointError` naming ``path``
    and the cause (a missing one: ``FileNotFoundError``).
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise CheckpointError(f"{path}: a directory, not a checkpoint file")
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, "no such checkpoint file", path)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            state = torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - every reader failure becomes one clear error
        raise CheckpointError(f"{path}: not a readable checkpoint: {_load_failure(path, exc)}") from (
            None if isinstance(exc, pickle.UnpicklingError) else exc)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not a labutils checkpoint (it holds a {type(state).__name__}, "
                              "not a dict of model, optimizer, ...)")
    if state.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path}: checkpoint version {state.get('version')} is not {CHECKPOINT_VERSION}")
    missing = [k for k in CHECKPOINT_KEYS if k not in state]
    if missing:
        raise CheckpointError(f"{path}: not a complete labutils checkpoint, missing {missing}")
    return state


def _load_failure(path: str, exc: Exception) -> str:
    """What went wrong reading ``path``, in words (never the advice to disable ``weights_only``)."""
    size = os.path.getsize(path)
    if size == 0:
        return "the file is empty (0 bytes): a save or a copy that was interrupted"
    if isinstance(exc, pickle.UnpicklingError):
        return (f"{size} bytes that are not tensors and plain containers ({_refused(str(exc))}); labutils "
                "only loads checkpoints that cannot run code, so this file was not written by labutils.train")
    if isinstance(exc, RuntimeError) and "zip archive" in str(exc):
        return f"{size} bytes that are not a complete torch.save archive: the file is truncated or corrupted"
    return f"{size} bytes that torch.load cannot read ({type(exc).__name__}: {exc}): not a torch.save file"


def _refused(message: str) -> str:
    """What torch's weights-only unpickler refused, from its message: the global (a function or class the file
    would call or build, e.g. ``posix.system``) when it names one, else its own first line, without torch's advice
    to lift the restriction."""
    name = re.search(r"GLOBAL ([\w.]+)", message)
    if name:
        return f"it refers to the global {name.group(1)}, which loading would import and call"
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    reason = next((ln for ln in lines if not ln.startswith(("Weights only load failed", "Check the documentation"))
                   and "weights_only" not in ln), None)
    return reason.split(". Please use")[0] if reason else "a pickle the weights-only loader refuses"


def _class_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _is_engine(model) -> bool:
    """A DeepSpeed engine: it owns backward() and step() and wraps the real model in .module."""
    return all(hasattr(model, a) for a in ("backward", "step", "module"))


def _count(name: str, value, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


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
    steps = _count("steps", steps)
    _count("save_every", save_every)
    _count("eval_every", eval_every)
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
        _check_writable(os.fspath(checkpoint))
    return steps


def _check_writable(path: str) -> None:
    """Fail before training, not after it, when ``path`` cannot be written (probe: ``path.tmp``, removed)."""
    if os.path.isdir(path):
        raise CheckpointError(f"checkpoint={path!r} is a directory: give a file in it, "
                              f"e.g. {os.path.join(path, 'run.pt')!r}")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint={path!r}: {folder!r} is a file, not a directory")
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint={path!r}: the directory {folder!r} does not exist; create it first "
                              f"(os.makedirs({folder!r}, exist_ok=True))")
    probe = path + ".tmp"
    try:
        with open(probe, "wb"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise CheckpointError(f"checkpoint={path!r} cannot be written in {folder!r} ({exc.strerror or exc}); "
                              "pick a writable directory (checked before the first step)") from exc


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


def _finish(history: TrainResult, t0: float, ran: int) -> TrainResult:
    history.seconds, history.steps_run = time.perf_counter() - t0, ran
    return history


def _save(path, net, optimizer, step, data, history) -> None:
    try:
        save_checkpoint(path, model=net, optimizer=optimizer, step=step, data=data, history=history)
    except (OSError, RuntimeError) as exc:
        raise CheckpointSaveError(f"step {step}: writing checkpoint {os.fspath(path)!r} failed "
                                  f"({type(exc).__name__}: {exc}); the previous checkpoint file is unchanged and "
                                  f"err.result holds the history of all {history.steps} steps",
                                  path=os.fspath(path), step=step, result=history) from exc


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


def _restore(path, net, optimizer, data, steps):
    """Load ``path`` into the model, optimizer and data stream, after checking that every part of it fits."""
    state = load_checkpoint(path)
    step = int(state["step"])
    if step > steps:
        raise ValueError(f"{os.fspath(path)} is already at step {step}, past steps={steps}: ask for steps >= {step} "
                         "to continue it, or resume=False (or another path) to start over")
    problems = _mismatches(state, net, optimizer, data)
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise CheckpointError(f"{os.fspath(path)} does not fit this run ({len(problems)} mismatch"
                              f"{'es' if len(problems) > 1 else ''}; nothing was loaded, the model is untouched):"
                              f"\n  {shown}")
    net.load_state_dict(state["model"])
    optimizer.load_state_dict({k: v for k, v in state["optimizer"].items() if k != "class"})
    data.load_state_dict(state["data"])
    _set_rng_state(state["rng"])
    return step, TrainResult.from_state(state["history"])


def _shape(value):
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _mismatches(state: dict, net, optimizer, data) -> list:
    """Every way ``state`` differs from this model, optimizer and data stream (empty: it loads cleanly)."""
    problems = []
    problems += _dict_mismatches("model", state["model"], net.state_dict())
    problems += _dict_mismatches("data", state["data"], data.state_dict())
    saved = state["optimizer"]
    if "class" in saved and saved["class"] != _class_name(optimizer):
        return problems + [f"optimizer: the checkpoint's is {saved['class']}, this run's is {_class_name(optimizer)}"]
    groups, saved_groups = optimizer.param_groups, saved.get("param_groups", [])
    if len(groups) != len(saved_groups):
        return problems + [f"optimizer: {len(saved_groups)} parameter groups in the checkpoint, {len(groups)} here"]
    params = []
    for i, (g, sg) in enumerate(zip(groups, saved_groups)):
        if len(g["params"]) != len(sg["params"]):
            problems.append(f"optimizer group {i}: {len(sg['params'])} parameters in the checkpoint, "
                            f"{len(g['params'])} here")
        if set(g) != set(sg):
            problems.append(f"optimizer group {i}: settings {sorted(set(sg) ^ set(g))} are in only one of them "
                            "(another optimizer class?)")
        params += list(zip(sg["params"], g["params"]))
    wrong = [f"{key} of parameter {saved_id} is {_shape(value)}, the parameter here {tuple(param.shape)}"
             for saved_id, param in params for key, value in saved.get("state", {}).get(saved_id, {}).items()
             if _shape(value) not in (None, (), tuple(param.shape))]
    if wrong:
        problems.append(f"optimizer state: {len(wrong)} tensors do not fit their parameter (first: {wrong[0]})")
    return problems


def _dict_mismatches(what: str, saved, own: dict) -> list:
    if not isinstance(saved, dict):
        return [f"{what}: the checkpoint holds a {type(saved).__name__}, not a state dict"]
    problems = [f"{what} {k}: missing from the checkpoint" for k in own if k not in saved]
    problems += [f"{what} {k}: in the checkpoint, not in this run" for k in saved if k not in own]
    problems += [f"{what} {k}: {_shape(saved[k])} in the checkpoint, {_shape(own[k])} here"
                 for k in own if k in saved and _shape(own[k]) is not None and _shape(saved[k]) != _shape(own[k])]
    return problems


def evaluate_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable = mse,
                  batch_size: int = 64) -> float:
    """Mean ``loss_fn`` over fixed ``(inputs, targets)`` in eval mode, batch by batch (weighted by size)."""
    if len(inputs) != len(targets) or len(inputs) == 0:
        raise ValueError(f"evaluate_loss needs as many inputs as targets, at least one: got {len(inputs)} inputs "
                         f"and {len(targets)} targets")
    _count("batch_size", batch_size, minimum=1)
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
