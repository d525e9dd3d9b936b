"""FMoE: fastmoe's core layer in plain PyTorch. (Taught in chapter 01.)

Same constructor, attribute names and data flow as ``fmoe.FMoE``; the forward is the six named steps of
``functions.py``. With ``world_size > 1`` the gate picks among ``world_size * num_expert`` global experts and
the token exchange is done by ``labutils.moe.expert_parallel.exchange_and_run`` (chapter 06), which calls back
:meth:`FMoE.run_experts` for the experts that live on this rank.
"""
from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn

from ..collectives import require_process_group
from .fastmoe.api import AllGather, Slice, mark_module_parallel_comm, slice_sizes
from .functions import (
    check_gate_output,
    check_top_k,
    combine,
    count_by_gate,
    counts_list,
    gather,
    gather_combine,
    scatter,
)
from .gates import NaiveGate
from .tree import tree_flatten, tree_map, tree_unflatten


def _takes_count(module: nn.Module) -> bool:
    """fastmoe calls an expert as ``expert(x, count)``; plain modules such as nn.Sequential take ``x`` only."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


class FMoE(nn.Module):
    """A mixture-of-experts layer with any module as the expert (fastmoe's ``FMoE``).

    * ``num_expert``: experts on EACH worker; ``world_size``: workers holding different experts.
    * ``top_k``: experts per token; ``gate``: a gate class from ``labutils.moe.gates``.
    * ``expert``: a callable ``expert(d_model) -> nn.Module`` (called ``num_expert`` times), a list of such
      callables (one expert each), or ``None`` when a subclass sets ``self.experts`` (fused experts that take
      ``(x, counts)``, as :class:`FMoETransformerMLP` does).
    * ``gate_hook(gate_top_k_idx, gate_score, None)`` is called after the gate.

    ``forward`` accepts any leading dims ``(..., d_model)`` and returns the same shape.
    """

    def __init__(self, num_expert: int = 32, d_model: int = 1024, world_size: int = 1, mp_group=None,
                 slice_group=None, moe_group=None, top_k: int = 2, gate=NaiveGate, expert=None, gate_hook=None,
                 mask=None, mask_dict=None, gate_bias: bool = True):
        super().__init__()
        if isinstance(expert, (list, tuple)):
            num_expert = len(expert)
        self.num_expert, self.d_model, self.world_size, self.top_k = num_expert, d_model, world_size, top_k
        self.tot_expert = num_expert * world_size
        check_top_k(top_k, self.tot_expert)
        self.moe_group = moe_group
        if world_size > 1:
            require_process_group(moe_group, world_size, f"FMoE(world_size={world_size}) spreads its experts over "
                                  f"{world_size} processes")
        # slice_group (mp_group: fastmoe's older name): ranks holding the same batch; each runs its slice
        if mp_group is not None and slice_group is not None and mp_group is not slice_group:
            raise ValueError("pass slice_group or mp_group (its deprecated alias), not two different groups")
        self.slice_group = slice_group if slice_group is not None else mp_group
        self.slice_size, self.slice_rank = 1, 0
        if self.slice_group is not None:
            require_process_group(self.slice_group, what="FMoE(slice_group=...)")
            self.slice_size = dist.get_world_size(self.slice_group)
            self.slice_rank = dist.get_rank(self.slice_group)
        if (mask is None) != (mask_dict is None):
            raise ValueError("mask and mask_dict go together: mask marks rows (0 = run the experts, key = take "
                             "mask_dict[key]); fastmoe silently ignores one without the other")
        self.mask, self.mask_dict = mask, mask_dict
        self.experts: nn.Module | None
        self.experts_fused = expert is None
        if isinstance(expert, (list, tuple)):
            self.experts = nn.ModuleList([e(d_model) for e in expert])
        elif expert is not None:
            self.experts = nn.ModuleList([expert(d_model) for _ in range(num_expert)])
        else:
            self.experts = None  # a subclass sets a fused module taking (x, counts)
        if isinstance(gate, type) and issubclass(gate, NaiveGate):
            self.gate = gate(d_model, num_expert, world_size, top_k, gate_bias=gate_bias)
        else:
            self.gate = gate(d_model, num_expert, world_size, top_k)
        self.gate_hook = gate_hook
        self._expert_takes_count = [_takes_count(e) for e in self.experts] if self.experts is not None else []

    # ---- the forward, step by step -------------------------------------------------------------
    def forward(self, moe_inp):
        """``moe_inp``: ``(..., d_model)``, or a tree (list/tuple/dict) of ``(..., d)`` tensors with the same
        leading dims, routed together by one gate decision (fastmoe's MIMO). Returns the same structure."""
        leaves, spec = tree_flatten(moe_inp)
        lead = self.check_input(leaves)
        xs = [t.reshape(-1, t.shape[-1]) for t in leaves]                    # each (T, d_leaf)
        keep = self._mask_rows(xs[0].shape[0])                               # (T,) bool or None
        if self.slice_size > 1:                                              # my slice of the shared batch
            xs = [Slice.apply(x, self.slice_rank, self.slice_size, self.slice_group) for x in xs]
            if keep is not None:
                start = sum(slice_sizes(keep.numel(), self.slice_size)[:self.slice_rank])
                keep = keep[start:start + xs[0].shape[0]]
        x_tree = tree_unflatten(xs, spec)
        gate_idx, gate_score = self.route(x_tree, xs[0].shape[0])            # (T, k), (T, k)
        ys = tree_flatten(self.moe_steps(x_tree, gate_idx, gate_score, keep))[0]  # each (T, d_out)
        if self.slice_size > 1:                                              # everyone's slices, in order
            ys = [AllGather.apply(y, self.slice_rank, self.slice_size, self.slice_group) for y in ys]
        return tree_unflatten([y.reshape(*lead, y.shape[-1]) for y in ys], spec)

    def moe_steps(self, x, gate_idx: torch.Tensor, gate_score: torch.Tensor, keep=None):
        """count -> scatter -> experts -> gather -> combine on ``(T, d)`` rows (or a tree of them, every leaf
        with the same routing). ``keep``: ``(T,)`` bool, rows that run the experts (``None``: all)."""
        T, k = gate_score.shape
        if keep is not None:                                                 # masked rows skip the experts
            x, gate_idx = tree_map(lambda t: t[keep], x), gate_idx[keep]
        pos, counts = count_by_gate(gate_idx, self.num_expert, self.world_size)  # (N,), (world*E,)
        x_sorted = tree_map(lambda t: scatter(t, pos, k), x)                 # (N, d) expert-contiguous
        y_sorted = self.expert_exchange(x_sorted, counts)                    # (N, d_out)
        if keep is None:  # gather + combine in one pass (no (T*k, d) buffer): see MOEGatherCombine
            return tree_map(lambda t: gather_combine(t, pos, gate_score), y_sorted)  # (T, d_out)
        y = tree_map(lambda t: gather(t, pos, gate_idx.shape[0] * k), y_sorted)  # (T_kept*k, d_out)
        y = tree_map(lambda t: self._unmask(t, keep, T, k), y)              # (T*k, d_out)
        return tree_map(lambda t: combine(t, gate_score), y)                 # (T, d_out)

    def check_input(self, leaves: list) -> tuple:
        """Every leaf a floating tensor of the layer's dtype, the same leading dims; returns those dims."""
        want = self.param_dtype()
        for t in leaves:
            if not t.is_floating_point():
                raise TypeError(f"FMoE expects a floating-point input, got dtype {t.dtype}")
            if t.dim() == 0:
                raise ValueError(f"FMoE(d_model={self.d_model}) got a 0-d input; expected (..., d_model)")
            if want is not None and t.dtype != want and not torch.is_autocast_enabled(t.device.type):
                raise TypeError(f"FMoE input is {t.dtype} but the layer's parameters are {want}: cast the input "
                                f"(x.to({want})) or the layer (layer.to({t.dtype}))")
        if len(leaves) == 1 and leaves[0].shape[-1] != self.d_model:
            raise ValueError(f"FMoE(d_model={self.d_model}) got input of shape {tuple(leaves[0].shape)}; "
                             f"the last dimension must be d_model={self.d_model}")
        lead = tuple(leaves[0].shape[:-1])
        for t in leaves[1:]:
            if tuple(t.shape[:-1]) != lead:
                raise ValueError(f"FMoE inputs routed together need the same leading dims; got "
                                 f"{[tuple(x.shape) for x in leaves]}")
        return lead

    def param_dtype(self):
        """The dtype of the layer's first floating parameter (``None`` when it has none)."""
        return next((p.dtype for p in self.parameters() if p.is_floating_point()), None)

    def flatten_input(self, moe_inp: torch.Tensor) -> torch.Tensor:
        """Check one input tensor and view it as ``(T, d_model)``."""
        if not torch.is_tensor(moe_inp):
            raise TypeError(f"FMoE expects a tensor, got {type(moe_inp).__name__}")
        self.check_input([moe_inp])
        return moe_inp.reshape(-1, self.d_model)

    def route(self, x, num_tokens: int | None = None):
        """Run the gate (and ``gate_hook``, with what the gate returned) and return ``(T, k)`` ids and scores."""
        gate_idx, gate_score = self.gate(x)
        if self.gate_hook is not None:
            self.gate_hook(gate_idx, gate_score, None)
        T = x.shape[0] if num_tokens is None else num_tokens
        return check_gate_output(gate_idx, gate_score, T, self.top_k, self.tot_expert)

    # ---- mask / mask_dict (fastmoe's) ------------------------------------------------------------
    def _mask_rows(self, num_tokens: int):
        """``(T,)`` bool: rows whose mask is 0 run the experts; ``None`` without a mask."""
        if self.mask is None:
            return None
        mask = torch.as_tensor(self.mask).reshape(-1)
        if mask.numel() != num_tokens:
            raise ValueError(f"mask has {mask.numel()} entries but the input has {num_tokens} rows (tokens)")
        keys = list(self.mask_dict or {})
        known = {k.item() if torch.is_tensor(k) else k for k in keys}
        missing = sorted({v.item() for v in mask.unique()} - {0} - known)
        if missing:  # fastmoe leaves such rows at zero, silently
            raise ValueError(f"mask holds value(s) {missing} that mask_dict has no entry for (its keys: {keys}): "
                             "each nonzero mask value must be a key of mask_dict, whose value replaces the "
                             "experts' output for those rows; 0 marks the rows that run the experts")
        return mask == 0

    def _unmask(self, y: torch.Tensor, keep: torch.Tensor, T: int, k: int) -> torch.Tensor:
        """``(T_kept*k, d)`` expert outputs -> ``(T*k, d)``: masked rows take ``mask_dict[mask value]``
        (a ``(d,)`` or ``(k, d)`` tensor, weighted by the gate score like an expert output), others zero."""
        assert self.mask_dict is not None
        full = y.new_zeros(T, k, y.shape[-1])                                # (T, k, d)
        full[keep] = y.view(-1, k, y.shape[-1])
        mask = torch.as_tensor(self.mask).reshape(-1).to(keep.device)
        if self.slice_size > 1:
            start = sum(slice_sizes(mask.numel(), self.slice_size)[:self.slice_rank])
            mask = mask[start:start + T]
        for key, value in self.mask_dict.items():
            full[mask == key] = torch.as_tensor(value, dtype=y.dtype, device=y.device)
        return full.view(T * k, -1)

    def expert_exchange(self, x_sorted, counts: torch.Tensor):
        """Rows sorted by global expert -> expert outputs in the same order (across ranks when world_size > 1).

        ``x_sorted``: an ``(N, d)`` tensor or a tree of them; the result has the structure ``expert_fn`` returns.
        """
        if self.world_size == 1:
            return self.run_experts(x_sorted, counts)
        from .expert_parallel import exchange_and_run  # chapter 06: all-to-all, run_experts, all-to-all back
        leaves, spec = tree_flatten(x_sorted)
        if spec is None:
            return exchange_and_run(self, x_sorted, counts)
        # a tree crosses the wire as one (N, sum d) tensor: one exchange instead of one per leaf
        widths, out_spec = [t.shape[-1] for t in leaves], []

        def run(x, fwd_expert_count):
            y_leaves, y_spec = tree_flatten(self.run_experts(tree_unflatten(list(x.split(widths, -1)), spec),
                                                             fwd_expert_count))
            out_spec[:] = [y_spec, [t.shape[-1] for t in y_leaves]]
            return torch.cat(y_leaves, -1)

        y = exchange_and_run(self, torch.cat(leaves, -1), counts, run=run)
        return tree_unflatten(list(y.split(out_spec[1], -1)), out_spec[0])

    def run_experts(self, x, counts):
        """Apply this rank's ``num_expert`` experts to an expert-contiguous ``(N, d)`` buffer (or a tree of
        them), through ``self.expert_fn`` (so a subclass that overrides ``expert_fn`` is used, as in fastmoe).

        ``counts``: ``(num_expert,)`` rows per LOCAL expert (tensor or list), summing to ``N``.
        """
        counts = counts_list(counts)
        leaves, spec = tree_flatten(x)
        rows = leaves[0].shape[0]
        if len(counts) != self.num_expert or sum(counts) != rows:
            raise ValueError(f"run_experts needs {self.num_expert} per-expert counts summing to {rows} "
                             f"rows, got {counts}")
        y = self.expert_fn(x, torch.tensor(counts, dtype=torch.int64))      # counts on the CPU, as fastmoe
        if spec is None and torch.is_tensor(y) and y.shape != (rows, self.d_model):
            raise ValueError(f"experts must map d_model -> d_model ({self.d_model}); got output of shape "
                             f"{tuple(y.shape)} for input {tuple(leaves[0].shape)}")
        bad = [tuple(t.shape) for t in tree_flatten(y)[0] if t.shape[0] != rows]
        if bad:
            raise ValueError(f"expert_fn must return {rows} rows per output (one per input row), got {bad}")
        return y

    def expert_fn(self, inp, fwd_expert_count: torch.Tensor):
        """fastmoe's expert step: a fused expert module gets ``(inp, fwd_expert_count)`` whole; a list of
        experts runs one slice each (``fwd_expert_count``: CPU int64 ``(num_expert,)``). ``inp`` may be a
        tree of tensors (each expert then gets its rows of every leaf, in the same structure)."""
        if self.experts_fused:
            assert self.experts is not None, "FMoE(expert=None) needs the subclass to set self.experts"
            return self.experts(inp, fwd_expert_count)
        counts = fwd_expert_count.tolist()
        leaves, spec = tree_flatten(inp)
        if spec is None:
            outs = [self._one_expert(i, part, n) for i, (part, n) in enumerate(zip(inp.split(counts), counts))]
            return torch.cat(outs) if outs else inp[:0]
        parts = list(zip(*[t.split(counts) for t in leaves]))                # per expert: its rows of each leaf
        outs = [tree_flatten(self._one_expert(i, tree_unflatten(list(p), spec), n))
                for i, (p, n) in enumerate(zip(parts, counts))]                # num_expert >= 1 entries
        return tree_unflatten([torch.cat(col) for col in zip(*[o[0] for o in outs])], outs[0][1])

    def expert_fn_single(self, inp, fwd_expert_count: torch.Tensor, idx: int):
        """fastmoe's per-expert call: expert ``idx`` on its slice."""
        return self._one_expert(idx, inp, int(fwd_expert_count[idx]))

    def _one_expert(self, i: int, part, n: int):
        assert isinstance(self.experts, nn.ModuleList)
        expert = self.experts[i]
        takes_count = self._expert_takes_count[i] if i < len(self._expert_takes_count) else _takes_count(expert)
        try:
            y = expert(part, torch.tensor([n])) if takes_count else expert(part)
        except RuntimeError as exc:
            raise ValueError(f"expert {i} failed on a ({n}, {self.d_model}) input: experts must map "
                             f"d_model -> d_model ({exc})") from exc
        if torch.is_tensor(part) and y.shape != part.shape:
            raise ValueError(f"experts must map d_model -> d_model ({self.d_model}); expert {i} returned "
                             f"{tuple(y.shape)} for input {tuple(part.shape)}")
        return y

    def mark_parallel_comm(self, expert_dp_comm: str = "none") -> None:
        """Tag parameters with ``dp_comm`` as fastmoe does: experts ``expert_dp_comm``, gate ``"gate"``."""
        if self.experts is not None:
            mark_module_parallel_comm(self.experts, expert_dp_comm)
        mark_module_parallel_comm(self.gate, "gate")
