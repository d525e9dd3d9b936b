"""FMoE: fastmoe's core layer in plain PyTorch. (Taught in chapter 01.)

Same constructor, attribute names and data flow as ``fmoe.FMoE``: the gate routes, then the lab's one dispatcher
(``dispatch.py``: the six named steps of ``functions.py``) runs the experts. With ``world_size > 1`` the gate
picks among ``world_size * num_expert`` global experts and the dispatcher's expert-parallel transport
(``labutils.moe.expert_parallel.exchange_and_run``, chapter 06) calls back :meth:`FMoE.run_experts` for the
experts that live on this rank. A nested input (a list, tuple or dict of
tensors routed together) is handled by ``tree.py``'s helpers; a plain tensor never goes through them.
"""
from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn

from ..agreement import require_process_group
from ..collectives import Slice, all_gather, rank_slice
from .device_path import device_path, on_device_path
from .dispatch import ExpertParallel, dispatch, local
from .functions import check_gate_output, check_top_k, counts_list
from .gates import NaiveGate
from .mask import check_mask, check_mask_pair, fill_masked
from .tree import exchange_packed, tree_cat, tree_flatten, tree_split, tree_unflatten

DP_COMM = "dp_comm"  # the parameter attribute fastmoe's DistributedGroupedDataParallel reads


def mark_module_parallel_comm(module: nn.Module, comm: str) -> None:
    """Tag every parameter of ``module`` with ``dp_comm = comm`` (read by ``DistributedGroupedDataParallel``)."""
    for p in module.parameters():
        setattr(p, DP_COMM, comm)


def _takes_count(module: nn.Module) -> bool:
    """fastmoe calls an expert as ``expert(x, count)``; plain modules such as nn.Sequential take ``x`` only."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


def _make_experts(expert, num_expert: int, d_model: int):
    """``expert``: a callable ``d_model -> nn.Module`` (``num_expert`` copies), a list of them, or ``None``."""
    if expert is None:
        return None  # a subclass sets a fused module taking (x, counts)
    makers = expert if isinstance(expert, (list, tuple)) else [expert] * num_expert
    return nn.ModuleList([make(d_model) for make in makers])


def _slice_group(slice_group, mp_group) -> tuple:
    """``(group, its size, my rank in it)`` of ranks sharing a batch (``mp_group``: fastmoe's older name)."""
    if mp_group is not None and slice_group is not None and mp_group is not slice_group:
        raise ValueError("pass slice_group or mp_group (its deprecated alias), not two different groups")
    group = slice_group if slice_group is not None else mp_group
    if group is None:
        return None, 1, 0
    require_process_group(group, what="FMoE(slice_group=...)")
    return group, dist.get_world_size(group), dist.get_rank(group)


def check_input(leaves: list, d_model: int, dtype) -> tuple:
    """Every leaf a floating tensor of the layer's ``dtype``, the same leading dims; returns those dims."""
    for t in leaves:
        if not t.is_floating_point():
            raise TypeError(f"FMoE expects a floating-point input, got dtype {t.dtype}")
        if t.dim() == 0:
            raise ValueError(f"FMoE(d_model={d_model}) got a 0-d input; expected (..., d_model)")
        if dtype is not None and t.dtype != dtype and not torch.is_autocast_enabled(t.device.type):
            raise TypeError(f"FMoE input is {t.dtype} but the layer's parameters are {dtype}: cast the input "
                            f"(x.to({dtype})) or the layer (layer.to({t.dtype}))")
    if len(leaves) == 1 and leaves[0].shape[-1] != d_model:
        raise ValueError(f"FMoE(d_model={d_model}) got input of shape {tuple(leaves[0].shape)}; "
                         f"the last dimension must be d_model={d_model}")
    lead = tuple(leaves[0].shape[:-1])
    if any(tuple(t.shape[:-1]) != lead for t in leaves[1:]):
        raise ValueError(f"FMoE inputs routed together need the same leading dims; got "
                         f"{[tuple(x.shape) for x in leaves]}")
    return lead


def _check_expert_output(x, y, rows: int, d_model: int) -> None:
    """The experts' output: ``(rows, d_model)`` for a tensor input, ``rows`` rows per leaf for a tree."""
    if torch.is_tensor(x) and (not torch.is_tensor(y) or y.shape != (rows, d_model)):
        raise ValueError(f"experts must map d_model -> d_model ({d_model}); got output of shape "
                         f"{tuple(getattr(y, 'shape', ()))} for input {tuple(x.shape)}")
    bad = [] if torch.is_tensor(x) else [tuple(t.shape) for t in tree_flatten(y)[0] if t.shape[0] != rows]
    if bad:
        raise ValueError(f"expert_fn must return {rows} rows per output (one per input row), got {bad}")


def _call_expert(layer, i: int, part, n: int):
    """Local expert ``i`` of ``layer`` on its ``n`` rows ``part`` (``expert(x, count)`` if it takes a count)."""
    assert isinstance(layer.experts, nn.ModuleList)
    expert = layer.experts[i]
    takes_count = layer._expert_takes_count[i] if i < len(layer._expert_takes_count) else _takes_count(expert)
    try:
        y = expert(part, torch.tensor([n])) if takes_count else expert(part)
    except RuntimeError as exc:
        raise ValueError(f"expert {i} failed on a ({n}, {layer.d_model}) input: experts must map "
                         f"d_model -> d_model ({exc})") from exc
    if torch.is_tensor(part) and y.shape != part.shape:
        raise ValueError(f"experts must map d_model -> d_model ({layer.d_model}); expert {i} returned "
                         f"{tuple(y.shape)} for input {tuple(part.shape)}")
    return y


class FMoE(nn.Module):
    """A mixture-of-experts layer with any module as the expert (fastmoe's ``FMoE``).

    * ``num_expert``: experts on EACH worker; ``world_size``: workers holding different experts.
    * ``top_k``: experts per token; ``gate``: a gate class from ``labutils.moe.gates``.
    * ``expert``: a callable ``expert(d_model) -> nn.Module`` (called ``num_expert`` times), a list of such
      callables (one expert each), or ``None`` when a subclass sets ``self.experts`` (fused experts that take
      ``(x, counts)``, as :class:`FMoETransformerMLP` does).
    * ``gate_hook(gate_top_k_idx, gate_score, None)`` is called after the gate.
    * ``slice_group`` (``mp_group``: fastmoe's older name): ranks holding the same batch; each runs its slice.
    * ``mask`` / ``mask_dict``: rows whose mask is nonzero skip the experts (see ``mask.py``).

    ``forward`` accepts any leading dims ``(..., d_model)`` and returns the same shape.
    """

    def __init__(self, num_expert: int = 32, d_model: int = 1024, world_size: int = 1, mp_group=None,
                 slice_group=None, moe_group=None, top_k: int = 2, gate=NaiveGate, expert=None, gate_hook=None,
                 mask=None, mask_dict=None, gate_bias: bool = True):
        super().__init__()
        num_expert = len(expert) if isinstance(expert, (list, tuple)) else num_expert
        self.num_expert, self.d_model, self.world_size, self.top_k = num_expert, d_model, world_size, top_k
        self.tot_expert = num_expert * world_size
        check_top_k(top_k, self.tot_expert)
        self.moe_group = moe_group
        if world_size > 1:
            require_process_group(moe_group, world_size, f"FMoE(world_size={world_size}) spreads its experts over "
                                  f"{world_size} processes")
        self.slice_group, self.slice_size, self.slice_rank = _slice_group(slice_group, mp_group)
        check_mask_pair(mask, mask_dict)
        self.mask, self.mask_dict = mask, mask_dict
        self.experts: nn.Module | None = _make_experts(expert, num_expert, d_model)
        self.experts_fused = expert is None
        gate_kw = dict(gate_bias=gate_bias) if isinstance(gate, type) and issubclass(gate, NaiveGate) else {}
        self.gate = gate(d_model, num_expert, world_size, top_k, **gate_kw)
        self.gate_hook = gate_hook
        self._expert_takes_count = [_takes_count(e) for e in self.experts] if self.experts is not None else []

    # ---- the forward, step by step -------------------------------------------------------------
    def forward(self, moe_inp):
        """``moe_inp``: ``(..., d_model)``, or a tree (list/tuple/dict) of ``(..., d)`` tensors with the same
        leading dims, routed together by one gate decision (fastmoe's MIMO). Returns the same structure."""
        leaves, spec = ([moe_inp], None) if torch.is_tensor(moe_inp) else tree_flatten(moe_inp)
        lead = check_input(leaves, self.d_model, self.param_dtype())
        xs = [t.reshape(-1, t.shape[-1]) for t in leaves]                    # each (T, d_leaf)
        mask = check_mask(self.mask, self.mask_dict, xs[0].shape[0])         # (T,) or None: 0 = run the experts
        if self.slice_size > 1:                                              # my slice of the shared batch
            xs = [Slice.apply(x, self.slice_rank, self.slice_size, self.slice_group) for x in xs]
            mask = None if mask is None else rank_slice(mask, self.slice_rank, self.slice_size)
        gate_in = xs[0] if spec is None else tree_unflatten(xs, spec)        # what the gate sees
        with device_path(self.runs_on_device_path(xs[0], spec, mask)):
            gate_idx, gate_score = self.route(gate_in, xs[0].shape[0])       # (T, k), (T, k)
            ys = self.moe_steps(xs, spec, gate_idx, gate_score, mask)        # each (T, d_leaf)
        if self.slice_size > 1:                                              # everyone's slices, in order
            ys = [all_gather(y, group=self.slice_group)[0] for y in ys]
        ys = [y.reshape(*lead, y.shape[-1]) for y in ys]
        return ys[0] if spec is None else tree_unflatten(ys, spec)

    def moe_steps(self, xs: list, spec, gate_idx: torch.Tensor, gate_score: torch.Tensor, mask=None) -> list:
        """count -> scatter -> experts -> gather -> combine (:func:`~labutils.moe.dispatch.dispatch`) on the leaves
        ``xs`` (each ``(T, d)``, one routing for all; ``spec``: their tree, ``None`` for one tensor).
        ``mask``: ``(T,)``, rows with 0 run the experts, the others take ``mask_dict``'s rows (``mask.py``)."""
        fill = None
        if mask is not None:                                                 # masked rows skip the experts
            keep, k = mask == 0, gate_score.shape[1]
            xs, gate_idx = [x[keep] for x in xs], gate_idx[keep]
            fill = lambda y: fill_masked(y, mask, self.mask_dict, k)         # noqa: E731  (T_kept*k, d) -> (T*k, d)
        return dispatch(xs, gate_idx, gate_score, lambda x_sorted, counts: self.expert_exchange(x_sorted, spec, counts),
                        num_expert=self.num_expert, world_size=self.world_size, fill=fill)  # each (T, d_out)

    def expert_backend(self, x: torch.Tensor) -> str:
        """``"loop"``: expert modules run one by one (``FMoETransformerMLP`` may say ``"grouped"``)."""
        return "loop"

    def runs_on_device_path(self, x: torch.Tensor, spec, mask) -> bool:
        """No host read in this forward (``device_path.py``): grouped experts, one rank, one tensor, no mask."""
        return (self.expert_backend(x) == "grouped" and self.world_size == 1 and self.slice_size == 1
                and spec is None and mask is None)

    def param_dtype(self):
        """The dtype of the layer's first floating parameter (``None`` when it has none)."""
        return next((p.dtype for p in self.parameters() if p.is_floating_point()), None)

    def flatten_input(self, moe_inp: torch.Tensor) -> torch.Tensor:
        """Check one input tensor and view it as ``(T, d_model)``."""
        if not torch.is_tensor(moe_inp):
            raise TypeError(f"FMoE expects a tensor, got {type(moe_inp).__name__}")
        check_input([moe_inp], self.d_model, self.param_dtype())
        return moe_inp.reshape(-1, self.d_model)

    def route(self, x, num_tokens: int | None = None):
        """Run the gate (and ``gate_hook``, with what the gate returned) and return ``(T, k)`` ids and scores."""
        gate_idx, gate_score = self.gate(x)
        if self.gate_hook is not None:
            self.gate_hook(gate_idx, gate_score, None)
        T = x.shape[0] if num_tokens is None else num_tokens
        return check_gate_output(gate_idx, gate_score, T, self.top_k, self.tot_expert)

    # ---- the experts ------------------------------------------------------------------------------
    def expert_exchange(self, xs: list, spec, counts: torch.Tensor) -> list:
        """Rows sorted by global expert -> expert outputs in the same order (across ranks when world_size > 1).
        ``xs``: the leaves, each ``(N, d)``, of the tree ``spec`` (``None``: one tensor); returns the outputs'."""
        move = ExpertParallel(self) if self.world_size > 1 else local     # chapter 06: all-to-all and back
        if spec is None:
            return [move(xs[0], counts, self.run_experts)]
        if self.world_size > 1:
            return exchange_packed(lambda x, run: move(x, counts, run), xs, spec, self.run_experts)
        return tree_flatten(self.run_experts(tree_unflatten(xs, spec), counts))[0]

    def run_experts(self, x, counts):
        """Apply this rank's ``num_expert`` experts to an expert-contiguous ``(N, d)`` buffer (or a tree of
        them), through ``self.expert_fn`` (so a subclass that overrides ``expert_fn`` is used, as in fastmoe).

        ``counts``: ``(num_expert,)`` rows per LOCAL expert (tensor or list), summing to ``N``. On the device path
        (``device_path.py``) they stay a device tensor, unread, and may sum to less (dropped choices at the end).
        """
        rows = (x if torch.is_tensor(x) else tree_flatten(x)[0][0]).shape[0]
        if not on_device_path():
            counts = counts_list(counts)
            if len(counts) != self.num_expert or sum(counts) != rows:
                raise ValueError(f"run_experts needs {self.num_expert} per-expert counts summing to {rows} "
                                 f"rows, got {counts}")
            counts = torch.tensor(counts, dtype=torch.int64)                # counts on the CPU, as fastmoe
        y = self.expert_fn(x, counts)
        _check_expert_output(x, y, rows, self.d_model)
        return y

    def expert_fn(self, inp, fwd_expert_count: torch.Tensor):
        """fastmoe's expert step: a fused expert module gets ``(inp, fwd_expert_count)`` whole; a list of
        experts runs one slice each (``fwd_expert_count``: CPU int64 ``(num_expert,)``). ``inp`` may be a
        tree of tensors (each expert then gets its rows of every leaf, in the same structure)."""
        if self.experts_fused:
            assert self.experts is not None, "FMoE(expert=None) needs the subclass to set self.experts"
            return self.experts(inp, fwd_expert_count)
        counts = fwd_expert_count.tolist()
        parts = inp.split(counts) if torch.is_tensor(inp) else tree_split(inp, counts)   # per expert: its rows
        outs = [_call_expert(self, i, part, n) for i, (part, n) in enumerate(zip(parts, counts))]
        if torch.is_tensor(inp):
            return torch.cat(outs) if outs else inp[:0]
        return tree_cat(outs)

    def expert_fn_single(self, inp, fwd_expert_count: torch.Tensor, idx: int):
        """fastmoe's per-expert call: expert ``idx`` on its slice."""
        return _call_expert(self, idx, inp, int(fwd_expert_count[idx]))

    def mark_parallel_comm(self, expert_dp_comm: str = "none") -> None:
        """Tag parameters with ``dp_comm`` as fastmoe does: experts ``expert_dp_comm``, gate ``"gate"``."""
        if self.experts is not None:
            mark_module_parallel_comm(self.experts, expert_dp_comm)
        mark_module_parallel_comm(self.gate, "gate")
