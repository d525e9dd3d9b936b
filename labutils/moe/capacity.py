"""Expert capacity: every formula for how many choices an expert accepts, each once, and which are dropped.
(Taught in chapter 01; DeepSpeed's formulas in chapter 02, token and expert choice in chapter 09.)

* DeepSpeed: :func:`deepspeed_capacity` (its float32 ``_capacity``), :func:`exact_capacity` (the same, exact),
  :func:`deepspeed_dropless_capacity` (``drop_tokens=False``: the largest per-expert count);
* :func:`token_choice_capacity` (GShard's ``ceil(cf * T * k / E)``), :func:`expert_capacity` (expert choice);
* fastmoe's gates: :func:`fastmoe_gshard_capacity`, :func:`fastmoe_switch_capacity`, :func:`fastmoe_dc_capacity`.

Over-capacity choices become ``-1`` (dropped: the token gets nothing from that expert; in a transformer the
residual connection carries it). fastmoe drops in the order its CUDA atomics happen to run; here the drops are
deterministic (:func:`position_in_expert`): all first choices in token order, then all second choices (GShard's
Algorithm 1), and across workers rank 0's tokens first. :func:`limit_by_capacity` is fastmoe's (each LOCAL
expert takes at most ``capacity`` tokens from ALL workers), :func:`drop_over_capacity` the one-worker form.
:func:`capacity_factors` / :class:`CapacityFactors` / :func:`warn_small_capacity` check the gates' factors.
"""
from __future__ import annotations

import math
import numbers
import warnings
from fractions import Fraction
from typing import Any, overload

import torch
import torch.distributed as dist

from .._deprecate import deprecated
from ..agreement import require_process_group
from ..data import _size
from .device_path import bincount

# ---- the formulas -------------------------------------------------------------------------------------
# Every formula checks its arguments first, with one helper (the int checks are labutils.data's ``_size``):
# token counts are ints >= 0 (``T = 0``, an empty batch, is legitimate: capacity 0, or ``min_capacity``), numbers
# of experts and ``k`` ints >= 1, factors finite numbers >= 0 (expert choice: > 0), counts tensors of whole
# numbers >= 0. A factor of -1, NaN or inf, E = -8 or a negative T gave 0, 1 or a negative capacity, silently.
_MINIMUM = {"num_tokens": 0, "num_experts": 1, "num_expert": 1, "tot_expert": 1, "world_size": 1, "k": 1,
            "top_k": 1, "min_capacity": 0}
_FACTORS = ("capacity_factor", "factor")


def _check_args(where: str, *, positive_factor: bool = False, **args) -> None:
    """THE argument check of this module's formulas: each keyword is checked by its name (see the comment above)
    and a ValueError names ``where``, the argument, its value and what is accepted."""
    for name, value in args.items():
        if name in _FACTORS:
            bound = "> 0" if positive_factor else ">= 0"
            ok = (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
                  and (float(value) > 0 if positive_factor else float(value) >= 0))
            if not ok:
                raise ValueError(f"{where}: {name} must be a finite number {bound}, got {value!r}")
        elif name == "local_expert_counts":
            counts = torch.as_tensor(value)
            if (counts.numel() == 0 or counts.dtype == torch.bool or counts.is_complex()
                    or not bool(torch.isfinite(counts).all()) or bool((counts < 0).any())
                    or bool((counts != counts.floor()).any())):
                raise ValueError(f"{where}: {name} must be a non-empty (W, E) or (E,) tensor of counts (whole "
                                 f"numbers >= 0), got {value!r}")
        else:
            _size(f"{where}: {name}", value, _MINIMUM[name])


def deepspeed_capacity(num_tokens: int, num_experts: int, capacity_factor: float, k: int = 1,
                       min_capacity: int = 0) -> int:
    """DeepSpeed's ``max(ceil(cf * k * S / E), min_capacity)`` for a rank's LOCAL ``num_tokens`` ``S``, computed as
    its ``_capacity`` (``deepspeed/moe/sharded_moe.py``) does: ``(S / E) * float32(cf * k)``. (Chapter 02.)

    The float32 product can land just above an integer (S=100, E=4, cf=1.2: exact 30, DeepSpeed 31; see
    :func:`exact_capacity`). ``min_capacity`` 0 is no floor (``_capacity`` has no default); DeepSpeed's ``MoE``
    layer passes its default 4: pass ``min_capacity=4`` to model a layer built with defaults.

    ``S = 0`` (an empty batch) gives ``min_capacity``. Refuses, naming the argument and the value: ``num_tokens``
    not an int >= 0, ``num_experts`` or ``k`` not an int >= 1, ``capacity_factor`` not a finite number >= 0 (NaN,
    inf or -1 gave 0), ``min_capacity`` not an int >= 0."""
    _check_args("deepspeed_capacity", num_tokens=num_tokens, num_experts=num_experts,
                capacity_factor=capacity_factor, k=k, min_capacity=min_capacity)
    factor = torch.tensor(capacity_factor * k)                                # float32, as in DeepSpeed
    capacity = torch.ceil((num_tokens / num_experts) * factor).to(torch.int64)
    return max(int(capacity), int(min_capacity))


def exact_capacity(num_tokens: int, num_experts: int, capacity_factor: float, k: int = 1,
                   min_capacity: int = 0) -> int:
    """:func:`deepspeed_capacity` in exact rational arithmetic (``capacity_factor`` read as its decimal string).
    Refuses what :func:`deepspeed_capacity` refuses (a factor of -1 gave 0)."""
    _check_args("exact_capacity", num_tokens=num_tokens, num_experts=num_experts, capacity_factor=capacity_factor,
                k=k, min_capacity=min_capacity)
    exact = Fraction(str(capacity_factor)) * k * num_tokens / num_experts
    return max(math.ceil(exact), int(min_capacity))


def deepspeed_dropless_capacity(local_expert_counts) -> int:
    """DeepSpeed's ``C`` with ``drop_tokens=False`` (0.19.8): the largest per-expert count of ``(W, E)`` or ``(E,)``
    counts (``torch.max(exp_counts)``, MAX-all-reduced over the expert group); no floor (top-1 caps it at S).
    All-zero counts (an empty batch) give 0. Refuses empty counts and counts that are not whole numbers >= 0
    (negative counts gave -1)."""
    _check_args("deepspeed_dropless_capacity", local_expert_counts=local_expert_counts)
    return int(torch.as_tensor(local_expert_counts).max())


def token_choice_capacity(num_tokens: int, num_experts: int, capacity_factor: float, k: int) -> int:
    """GShard's token-choice ``ceil(cf * T * k / E)``: ``T`` tokens choose ``k`` of ``E`` experts. (Chapter 09.)
    ``T = 0`` gives 0. Refuses ``num_tokens`` not an int >= 0, ``num_experts`` or ``k`` not an int >= 1 and
    ``capacity_factor`` not a finite number >= 0, naming the argument and the value."""
    _check_args("token_choice_capacity", num_tokens=num_tokens, num_experts=num_experts,
                capacity_factor=capacity_factor, k=k)
    return math.ceil(capacity_factor * num_tokens * k / num_experts)


def expert_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Expert choice's ``C = ceil(T * cf / E)`` in ``[1, T]``: every expert takes exactly ``C`` tokens. (Ch. 09.)
    ``T = 0`` (an empty batch) gives 0: every expert takes no token (it gave 1, a token that does not exist).
    Refuses ``num_tokens`` not an int >= 0, ``num_experts`` not an int >= 1 and ``capacity_factor`` not a finite
    number > 0, naming the argument and the value."""
    _check_args("expert_capacity", positive_factor=True, num_tokens=num_tokens, num_experts=num_experts,
                capacity_factor=capacity_factor)
    return max(min(1, num_tokens), min(num_tokens, math.ceil(num_tokens * capacity_factor / num_experts)))


def fastmoe_gshard_capacity(num_tokens: int, factor: float, top_k: int, tot_expert: int) -> int:
    """fastmoe's ``GShardGate``: ``floor(ceil(factor * T) * k / tot_expert)`` for this worker's T (can be 0).
    Refuses ``num_tokens`` not an int >= 0, ``top_k`` or ``tot_expert`` not an int >= 1 and ``factor`` not a
    finite number >= 0, naming the argument and the value."""
    _check_args("fastmoe_gshard_capacity", num_tokens=num_tokens, factor=factor, top_k=top_k, tot_expert=tot_expert)
    return math.ceil(factor * num_tokens) * top_k // tot_expert


def fastmoe_switch_capacity(num_tokens: int, factor: float, num_expert: int) -> int:
    """fastmoe's ``SwitchGate``: ``ceil(factor * T / num_expert)`` per LOCAL expert, over all workers' tokens.
    ``T = 0`` gives 0. Refuses ``num_tokens`` not an int >= 0, ``num_expert`` not an int >= 1 and ``factor`` not
    a finite number >= 0, naming the argument and the value."""
    _check_args("fastmoe_switch_capacity", num_tokens=num_tokens, factor=factor, num_expert=num_expert)
    return math.ceil(factor * num_tokens / num_expert)


def fastmoe_dc_capacity(num_tokens: int, factor: float) -> int:
    """fastmoe's ``DCGate``: ``ceil(factor * T)`` per LOCAL expert, over all workers' tokens. ``T = 0`` gives 0.
    Refuses ``num_tokens`` not an int >= 0 and ``factor`` not a finite number >= 0, naming them and the value."""
    _check_args("fastmoe_dc_capacity", num_tokens=num_tokens, factor=factor)
    return math.ceil(factor * num_tokens)


# ---- the gates' capacity factors -----------------------------------------------------------------------
def capacity_factors(capacity, name: str) -> tuple:
    """``capacity`` as a ``(train, eval)`` pair of finite factors > 0; a scalar is used for both."""
    pair = (capacity, capacity) if isinstance(capacity, (int, float)) else capacity
    ok = isinstance(pair, (tuple, list)) and len(pair) == 2 and all(
        isinstance(c, (int, float)) and not isinstance(c, bool) for c in pair)
    if not ok:
        raise TypeError(f"{name}: capacity must be a number or a (train, eval) pair of numbers, got {capacity!r}")
    if not all(math.isfinite(c) and c > 0 for c in pair):
        raise ValueError(f"{name}: capacity factors must be finite and > 0, got {capacity!r} (fastmoe's default "
                         f"is (1.2, 2.4); 0 or less would drop every token)")
    return float(pair[0]), float(pair[1])


class CapacityFactors:
    """The ``capacity`` attribute of a capacity gate: every assignment, in the constructor or later
    (``gate.capacity = (0, 0)``), goes through :func:`capacity_factors`, so a factor that would drop every token
    is refused when it is set, not found later as an all-dropped batch."""

    def __set_name__(self, owner, name):
        self.slot = "_" + name

    @overload
    def __get__(self, gate: None, owner=None) -> CapacityFactors: ...

    @overload
    def __get__(self, gate: object, owner=None) -> tuple[float, float]: ...

    def __get__(self, gate, owner=None):
        return self if gate is None else gate.__dict__[self.slot]

    def __set__(self, gate, value):
        gate.__dict__[self.slot] = capacity_factors(value, f"{type(gate).__name__}.capacity")


def warn_small_capacity(name: str, capacity: int, factor: float, num_tokens: int) -> None:
    if capacity < 1 and num_tokens > 0:
        warnings.warn(f"{name}: capacity factor {factor} with {num_tokens} tokens gives {capacity} tokens per "
                      f"expert (< 1): every choice is dropped; raise the factor or the batch", stacklevel=3)


def position_in_expert(gate_idx: torch.Tensor, tot_expert: int) -> torch.Tensor:
    """Each choice's arrival rank at its expert, in priority order (choice column first, then token).

    ``gate_idx`` is ``(T, k)``; the result is ``(T, k)`` int64, ``-1`` where ``gate_idx`` is ``-1``.
    """
    flat = gate_idx.t().reshape(-1)                                     # (k*T,) all 1st choices, then 2nd...
    key = torch.where(flat >= 0, flat, torch.full_like(flat, tot_expert))
    order = torch.argsort(key, stable=True)                             # expert-major, priority within
    counts = bincount(key, tot_expert + 1)                              # (E+1,)
    starts = torch.cumsum(counts, 0) - counts                           # (E+1,) first slot of each expert
    rank = torch.empty_like(flat)
    rank[order] = torch.arange(flat.numel(), device=flat.device) - starts[key[order]]
    rank = torch.where(flat >= 0, rank, torch.full_like(rank, -1))
    return rank.reshape(gate_idx.shape[1], -1).t()                      # (T, k)


def _token_counts(capacity, size: int, what: str) -> torch.Tensor:
    """A capacity (int, or a tensor of ``size`` entries) as a ``(size,)`` int64 tensor of counts >= 0."""
    if isinstance(capacity, bool) or not (isinstance(capacity, (int, float)) or torch.is_tensor(capacity)):
        raise TypeError(f"{what}: capacity must be an int or a tensor of {size} ints, got {capacity!r}")
    cap = torch.as_tensor(capacity)
    if cap.dim() > 1 or (cap.dim() == 1 and cap.numel() != size):
        raise ValueError(f"{what}: capacity must be a scalar or have {size} entries, got shape {tuple(cap.shape)}")
    if not bool(torch.isfinite(cap).all()) or bool((cap < 0).any()) or bool((cap != cap.floor()).any()):
        raise ValueError(f"{what}: capacity must hold whole numbers of tokens >= 0, got {capacity!r}")
    return cap.to(torch.int64).expand(size).clone()


def drop_over_capacity(gate_idx: torch.Tensor, tot_expert: int, capacity) -> torch.Tensor:
    """Return a copy of ``gate_idx`` (``(T, k)``) with every choice beyond its expert's ``capacity`` set to -1.

    ``capacity``: an int or a ``(tot_expert,)`` tensor of counts. Deterministic: first choices have priority
    over second choices, earlier tokens over later ones. (One worker; taught in chapter 01.)
    Refuses ``tot_expert`` not an int >= 1 and a ``capacity`` that is not whole numbers of tokens >= 0.
    """
    _check_args("drop_over_capacity", tot_expert=tot_expert)
    cap = _token_counts(capacity, tot_expert, "drop_over_capacity")
    with torch.no_grad():
        idx = gate_idx if gate_idx.dim() == 2 else gate_idx.reshape(-1, 1)  # (T, k)
        rank = position_in_expert(idx, tot_expert)
        room = cap.to(idx.device)[idx.clamp_min(0)]
        out = torch.where((idx >= 0) & (rank < room), idx, torch.full_like(idx, -1))
        return out.reshape(gate_idx.shape)


def exchange_counts(counts: torch.Tensor, world_size: int, group=None) -> torch.Tensor:
    """fastmoe's ``expert_exchange``: ``counts`` holds ``world_size`` equal blocks; block ``w`` goes to rank ``w``,
    and block ``w`` of the result is what rank ``w`` sent here."""
    if world_size == 1:
        return counts.clone()
    require_process_group(group, world_size, f"exchanging expert counts over world_size={world_size} workers")
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


# the 0.2.0 call limit_by_capacity(gate_idx, tot_expert, capacity): drop_over_capacity's result, with the warning
# and versions of labutils._deprecate's table
_limit_by_capacity_020: Any = deprecated("limit_by_capacity", drop_over_capacity)  # -> a (T, k) tensor


def limit_by_capacity(topk_idx: torch.Tensor, num_expert: int, _old_capacity=None, /, *, world_size: int | None = None,
                      capacity=None, group=None):
    """fastmoe's ``limit_by_capacity``: each of this worker's ``num_expert`` experts accepts at most
    ``capacity`` tokens from ALL ``world_size`` workers together (earlier ranks first).

        new_lec, new_gec, topk_idx = limit_by_capacity(topk_idx, num_expert, world_size=W, capacity=C)

    Returns ``(new_lec, new_gec, topk_idx)``: ``new_lec`` ``(world_size*num_expert,)`` how many of MY choices
    each global expert accepts, ``new_gec`` how many each worker's choices MY experts accept (block ``w`` =
    worker ``w``), and ``topk_idx`` with the refused choices set to -1. With ``world_size > 1`` every rank of
    ``group`` must call it (two small all-to-alls). (Taught in chapter 01.)

    ``world_size`` and ``capacity`` are keyword-only: a third positional argument is the 0.2.0 call
    ``limit_by_capacity(gate_idx, tot_expert, capacity)``, which returns :func:`drop_over_capacity`'s result with
    a deprecation warning. fastmoe's positional form is ``labutils.moe.fastmoe.api.limit_by_capacity``.

    Refuses, before any count or exchange, naming the argument and the value: ``num_expert`` or ``world_size``
    not an int >= 1 (``num_expert=0`` failed inside torch's ``view``), a missing ``world_size=``/``capacity=``
    and a ``capacity`` that is not whole numbers of tokens >= 0.
    """
    _check_args("limit_by_capacity", num_expert=num_expert)
    if _old_capacity is not None:
        if (world_size, capacity, group) != (None, None, None):
            raise TypeError("limit_by_capacity: a third positional argument is the 0.2.0 call (gate_idx, tot_expert, "
                            "capacity); pass world_size= and capacity= as keywords only")
        return _limit_by_capacity_020(topk_idx, num_expert, _old_capacity)
    if world_size is None or capacity is None:
        raise TypeError("limit_by_capacity(topk_idx, num_expert, *, world_size, capacity, group=None) needs "
                        f"world_size= and capacity=, got world_size={world_size!r}, capacity={capacity!r}")
    _check_args("limit_by_capacity", world_size=world_size)
    cap = _token_counts(capacity, num_expert, "limit_by_capacity")     # (ne,) per local expert
    tot = num_expert * world_size
    with torch.no_grad():
        flat = topk_idx.reshape(-1)
        lec = torch.bincount(flat[flat >= 0], minlength=tot)           # (W*ne,) my choices per global expert
        gec = exchange_counts(lec, world_size, group).view(world_size, num_expert)  # (W, ne) sent to my experts
        before = torch.cumsum(gec, 0) - gec                            # taken by earlier ranks
        new_gec = torch.minimum(gec, (cap.to(gec.device) - before).clamp_min(0)).reshape(-1)
        new_lec = exchange_counts(new_gec, world_size, group)
        return new_lec, new_gec, drop_over_capacity(topk_idx, tot, new_lec)
