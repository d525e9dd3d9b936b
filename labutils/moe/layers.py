"""FMoE: fastmoe's core layer in plain PyTorch. (Taught in chapter 01.)

Same constructor, attribute names and data flow as ``fmoe.FMoE``; the forward is the six named steps of
``functions.py``. With ``world_size > 1`` the gate picks among ``world_size * num_expert`` global experts and
the token exchange is done by ``labutils.moe.parallel.exchange_and_run`` (chapter 06), which calls back
:meth:`FMoE.run_experts` for the experts that live on this rank.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from .functions import check_gate_output, combine, count_by_gate, gather, scatter
from .gates import NaiveGate


def _require_process_group(world_size: int, group) -> None:
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"FMoE(world_size={world_size}) spreads its experts over {world_size} processes, but "
                           "torch.distributed is not initialised: call torch.distributed.init_process_group "
                           "first (labutils.launch does it for you), or use world_size=1")
    size = dist.get_world_size(group)
    if size != world_size:
        raise ValueError(f"FMoE(world_size={world_size}) but the expert-parallel process group has {size} ranks")


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
        if mp_group is not None or slice_group is not None or mask is not None or mask_dict is not None:
            raise NotImplementedError("slice_group/mp_group and mask/mask_dict are fastmoe features this core "
                                      "leaves out")
        if isinstance(expert, (list, tuple)):
            num_expert = len(expert)
        self.num_expert, self.d_model, self.world_size, self.top_k = num_expert, d_model, world_size, top_k
        self.tot_expert = num_expert * world_size
        if not 1 <= top_k <= self.tot_expert:
            raise ValueError(f"top_k={top_k} must be between 1 and the number of experts "
                             f"(world_size * num_expert = {self.tot_expert})")
        self.moe_group = moe_group
        if world_size > 1:
            _require_process_group(world_size, moe_group)
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
        if not self.experts_fused:
            self._expert_takes_count = [_takes_count(e) for e in self.experts]

    # ---- the forward, step by step -------------------------------------------------------------
    def forward(self, moe_inp: torch.Tensor) -> torch.Tensor:
        x = self.flatten_input(moe_inp)                                        # (T, d)
        gate_idx, gate_score = self.route(x)                                   # (T, k), (T, k)
        pos, counts = count_by_gate(gate_idx, self.num_expert, self.world_size)  # (N,), (world*E,)
        x_sorted = scatter(x, pos, self.top_k)                                 # (N, d) expert-contiguous
        y_sorted = self.expert_exchange(x_sorted, counts)                      # (N, d)
        y = combine(gather(y_sorted, pos, x.shape[0] * self.top_k), gate_score)  # (T, d)
        return y.reshape(moe_inp.shape)

    def flatten_input(self, moe_inp: torch.Tensor) -> torch.Tensor:
        """Check the input and view it as ``(T, d_model)``."""
        if not torch.is_tensor(moe_inp):
            raise TypeError(f"FMoE expects a tensor, got {type(moe_inp).__name__}")
        if not moe_inp.is_floating_point():
            raise TypeError(f"FMoE expects a floating-point input, got dtype {moe_inp.dtype}")
        if moe_inp.dim() == 0 or moe_inp.shape[-1] != self.d_model:
            raise ValueError(f"FMoE(d_model={self.d_model}) got input of shape {tuple(moe_inp.shape)}; "
                             f"the last dimension must be d_model")
        return moe_inp.reshape(-1, self.d_model)

    def route(self, x: torch.Tensor):
        """Run the gate (and ``gate_hook``) and check what it returned."""
        gate_idx, gate_score = self.gate(x)
        gate_idx, gate_score = check_gate_output(gate_idx, gate_score, x.shape[0], self.top_k, self.tot_expert)
        if self.gate_hook is not None:
            self.gate_hook(gate_idx, gate_score, None)
        return gate_idx, gate_score

    def expert_exchange(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by global expert -> expert outputs in the same order (across ranks when world_size > 1)."""
        if self.world_size == 1:
            return self.run_experts(x_sorted, counts)
        from .parallel import exchange_and_run  # chapter 06: all-to-all, run_experts, all-to-all back
        return exchange_and_run(self, x_sorted, counts)

    def run_experts(self, x: torch.Tensor, counts) -> torch.Tensor:
        """Apply this rank's ``num_expert`` experts to an expert-contiguous ``(N, d)`` buffer.

        ``counts``: ``(num_expert,)`` rows per LOCAL expert (tensor or list), summing to ``N``.
        """
        counts = counts.tolist() if torch.is_tensor(counts) else [int(c) for c in counts]
        if len(counts) != self.num_expert or sum(counts) != x.shape[0]:
            raise ValueError(f"run_experts needs {self.num_expert} per-expert counts summing to {x.shape[0]} "
                             f"rows, got {counts}")
        if self.experts_fused:
            y = self.experts(x, counts)
        else:
            y = torch.cat([self._one_expert(i, part, n) for i, (part, n) in
                           enumerate(zip(x.split(counts), counts))]) if counts else x[:0]
        if y.shape != (x.shape[0], self.d_model):
            raise ValueError(f"experts must map d_model -> d_model ({self.d_model}); got output of shape "
                             f"{tuple(y.shape)} for input {tuple(x.shape)}")
        return y

    expert_fn = run_experts  # fastmoe's name

    def _one_expert(self, i: int, part: torch.Tensor, n: int) -> torch.Tensor:
        expert = self.experts[i]
        try:
            y = expert(part, torch.tensor([n])) if self._expert_takes_count[i] else expert(part)
        except RuntimeError as exc:
            raise ValueError(f"expert {i} failed on a ({n}, {self.d_model}) input: experts must map "
                             f"d_model -> d_model ({exc})") from exc
        if y.shape != part.shape:
            raise ValueError(f"experts must map d_model -> d_model ({self.d_model}); expert {i} returned "
                             f"{tuple(y.shape)} for input {tuple(part.shape)}")
        return y

    def mark_parallel_comm(self, expert_dp_comm: str = "none") -> None:
        """Tag parameters with ``dp_comm`` as fastmoe does: experts ``expert_dp_comm``, gate ``"gate"``."""
        if self.experts is not None:
            for p in self.experts.parameters():
                p.dp_comm = expert_dp_comm
        for p in self.gate.parameters():
            p.dp_comm = "gate"
