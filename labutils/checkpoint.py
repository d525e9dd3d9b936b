"""Checkpoints of :func:`labutils.train.train`: atomic, weights-only, checked before anything is loaded.
(Taught in chapter 03.)

Checkpoints hold only tensors, numbers, strings, lists and dicts, so they load with
``torch.load(path, weights_only=True)``. They are written to ``path + ".tmp"`` and moved into place with
``os.replace`` (atomic on one file system): a crash mid-write never leaves a torn checkpoint. Resuming
restores model, optimizer, step, the global RNG states and the data stream's position, so a run stopped at
step k and resumed produces the same losses, bit for bit, as one that never stopped.

A file that is not a readable checkpoint (empty, truncated, another format) raises a :class:`CheckpointError`
naming the path and the cause; a checkpoint of another configuration is compared with the model, the optimizer
(its class is stored next to its state, under ``"class"``) and the data stream *before anything is loaded*,
and the error lists every mismatch. A save that fails mid-run raises :class:`CheckpointSaveError` with the
history in ``err.result``; the previous checkpoint stays intact.
"""
from __future__ import annotations

import errno
import os
import pickle
import random
import warnings

import torch

from ._checkpoint_failures import load_failure, save_failure, what_dict

CHECKPOINT_VERSION = 1
CHECKPOINT_KEYS = ("version", "step", "model", "optimizer", "rng", "data", "history")

class CheckpointError(ValueError):
    """A checkpoint that cannot be read, does not fit this run, or cannot be written where asked."""


class CheckpointSaveError(OSError):
    """Writing the checkpoint failed mid-run; ``result`` (a ``TrainResult``) holds the history up to ``step``."""

    def __init__(self, message: str, *, path: str, step: int, result):
        super().__init__(message)
        self.path, self.step, self.result = path, step, result

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

def save_checkpoint(path, *, model, optimizer, step: int, data, history) -> None:
    """Write everything needed to resume to ``path`` atomically (tmp file + ``os.replace``); ``history``: the
    run's ``TrainResult`` so far.

    Every part is required, ``optimizer`` too (resuming restores its state): ``optimizer=None`` is a TypeError
    naming it (to keep only the weights, ``torch.save(model.state_dict(), path)``). A directory that is missing
    or not writable raises an ``OSError`` naming ``path`` before anything is written; a disk that fills up
    mid-write raises ``OSError(ENOSPC)`` "no space left on the device holding ..." (torch itself says only
    "unexpected pos"). Either way the previous checkpoint at ``path`` is unchanged and no ``path.tmp`` is left.
    """
    _check_parts(model=model, optimizer=optimizer, data=data, history=history)
    optimizer_state = {**optimizer.state_dict(), "class": _class_name(optimizer)}
    state = {"version": CHECKPOINT_VERSION, "step": step, "model": model.state_dict(),
             "optimizer": optimizer_state, "rng": _rng_state(), "data": data.state_dict(),
             "history": history.state()}
    path = os.fspath(path)
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb"):  # a directory that is missing or not writable fails here, before torch writes
            pass
        torch.save(state, tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.lexists(tmp):  # never leave half a file behind
            os.remove(tmp)
        clear = save_failure(path, exc)
        if clear is not None:
            raise clear from exc
        raise


# what each part of a checkpoint must be, and the method save_checkpoint calls on it
_PARTS = {"model": ("the torch.nn.Module being trained", "state_dict"),
          "optimizer": ("the run's torch.optim.Optimizer (resuming restores its state)", "state_dict"),
          "data": ("the run's batch stream (labutils.data: RandomPairs, CharBatches, ...)", "state_dict"),
          "history": ("the run's TrainResult so far", "state")}


def _check_parts(**parts) -> None:
    for name, value in parts.items():
        what, method = _PARTS[name]
        if not callable(getattr(value, method, None)):
            hint = (" To save only the weights, use torch.save(model.state_dict(), path) (and load them with "
                    "model.load_state_dict)." if name == "optimizer" and value is None else "")
            raise TypeError(f"save_checkpoint({name}={value!r}): needs {what}, an object with a .{method}() "
                            f"method, got {type(value).__name__}; nothing was written.{hint}")


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
        raise CheckpointError(f"{path}: not a readable checkpoint: {load_failure(path, exc)}") from (
            None if isinstance(exc, pickle.UnpicklingError) else exc)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not a labutils checkpoint (it holds a {type(state).__name__}, "
                              "not a dict of model, optimizer, ...)")
    if "version" not in state:
        raise CheckpointError(f"{path}: {what_dict(state)}")
    if state.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path}: checkpoint version {state.get('version')} is not {CHECKPOINT_VERSION}")
    missing = [k for k in CHECKPOINT_KEYS if k not in state]
    if missing:
        raise CheckpointError(f"{path}: not a complete labutils checkpoint, missing {missing}")
    return state


def _class_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"

def check_writable(path: str) -> None:
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
    if os.path.isdir(probe):  # the folder is writable, but the save's temporary file cannot be made
        raise CheckpointError(f"checkpoint={path!r}: {probe!r} is a directory, and a save writes that file first "
                              "(then renames it to the checkpoint); remove or rename that directory")
    try:
        with open(probe, "wb"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise CheckpointError(f"checkpoint={path!r} cannot be written in {folder!r} ({exc.strerror or exc}); "
                              "pick a writable directory (checked before the first step)") from exc

def save_or_raise(path, net, optimizer, step, data, history) -> None:
    """:func:`save_checkpoint` during training: a failure is a :class:`CheckpointSaveError` holding the history."""
    try:
        save_checkpoint(path, model=net, optimizer=optimizer, step=step, data=data, history=history)
    except (OSError, RuntimeError) as exc:
        raise CheckpointSaveError(f"step {step}: writing checkpoint {os.fspath(path)!r} failed "
                                  f"({type(exc).__name__}: {exc}); the previous checkpoint file is unchanged and "
                                  f"err.result holds the history of all {history.steps} steps",
                                  path=os.fspath(path), step=step, result=history) from exc

def restore(path, net, optimizer, data, steps):
    """Load ``path`` into the model, optimizer and data stream, after checking that every part of it fits;
    returns ``(step, the history's state)`` (``TrainResult.from_state`` rebuilds it)."""
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
    return step, state["history"]


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
