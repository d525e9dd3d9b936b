"""FMoETransformerMLP: the MoE feed-forward block of a transformer. (Taught in chapter 01.)

As in fastmoe >= 1.0.1, each expert is its own ``_Expert`` module (``experts.<i>.htoh4.weight`` of shape
``(1, d_hidden, d_model)``), so a fastmoe checkpoint loads with ``load_state_dict`` and back. The older fused
layout (``experts.htoh4.weight`` of shape ``(E, d_hidden, d_model)``, labutils 0.1 and fastmoe < 1.0.1) is
still read. fastmoe's defaults (32 experts, d_model 1024, d_hidden 4096) give about 268M parameters.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .backends import pick_backend
from .expert_mlp import expert_mlps, fusable_activation, grouped_expert_mlps
from .layers import FMoE
from .linear import FMoELinear

INITS = ("fastmoe", "linear")


class _Expert(nn.Module):
    """``num_expert`` two-layer MLPs in two FMoELinear: d_model -> d_hidden -> activation -> d_model."""

    def __init__(self, num_expert: int, d_model: int, d_hidden: int, activation, rank: int = 0):
        super().__init__()
        self.htoh4 = FMoELinear(num_expert, d_model, d_hidden, bias=True, rank=rank)
        self.h4toh = FMoELinear(num_expert, d_hidden, d_model, bias=True, rank=rank)
        self.activation = activation

    def forward(self, inp, fwd_expert_count):                                # (N, d), (num_expert,)
        x = self.htoh4(inp, fwd_expert_count)                                 # (N, d_hidden)
        x = self.activation(x)
        return self.h4toh(x, fwd_expert_count)                                # (N, d_model)


class FMoETransformerMLP(FMoE):
    """An MoE MLP: ``FMoE`` whose experts are two-layer MLPs, one ``_Expert`` module per expert.

    ``init``: ``"fastmoe"`` (default: fastmoe's ``kaiming_uniform_(a=sqrt(5))`` over each ``(1, out, in)``
    weight, i.e. bound ``1/sqrt(out*in)``) or ``"linear"`` (``nn.Linear``'s bound ``1/sqrt(in)`` per expert,
    what a dense MLP it is compared with gets). Biases start at zero either way, as in fastmoe.
    ``backend``: ``"auto"`` (default: the per-expert loop on the CPU, one grouped GEMM per linear on CUDA),
    ``"loop"`` or ``"grouped"`` (:mod:`labutils.moe.backends`); on ``"grouped"`` a one-rank layer reads nothing
    on the host (``device_path.py``).
    Keyword arguments of :class:`FMoE` (``top_k``, ``gate``, ``world_size``, ``gate_hook``, ...) pass through.
    """

    def __init__(self, num_expert: int = 32, d_model: int = 1024, d_hidden: int = 4096,
                 activation=None, expert_dp_comm: str = "none", expert_rank: int = 0, init: str = "fastmoe",
                 backend: str = "auto", **kwargs):
        if init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {init!r}")
        pick_backend(backend, "cpu")                                          # refuses an unknown backend
        self.backend = backend
        activation = nn.GELU() if activation is None else activation          # fastmoe's default
        self.d_hidden = d_hidden

        def one_expert(d):
            return _Expert(1, d, d_hidden, activation, rank=expert_rank)

        super().__init__(num_expert=num_expert, d_model=d_model, expert=one_expert, **kwargs)
        self.activation = activation
        if init == "linear":
            self.reset_expert_parameters_like_linear()
        self.mark_parallel_comm(expert_dp_comm)

    def reset_expert_parameters_like_linear(self) -> None:
        """Every expert weight uniform in ``+-1/sqrt(in_features)`` (``nn.Linear``'s bound), biases zero."""
        with torch.no_grad():
            for expert in self.expert_modules():
                for lin in (expert.htoh4, expert.h4toh):
                    bound = 1.0 / math.sqrt(lin.in_feat)
                    lin.weight.uniform_(-bound, bound)
                    if lin.bias is not None:
                        lin.bias.zero_()

    def expert_backend(self, x: torch.Tensor) -> str:
        """``"grouped"`` or ``"loop"``: ``backend`` on ``x``'s device. ``"grouped"`` needs untouched one-expert
        ``_Expert`` modules with biases (stacked each call); asked for with other experts, a ValueError."""
        backend = pick_backend(self.backend, x.device)
        if backend == "grouped" and not self._groupable():
            if self.backend == "grouped":
                raise ValueError("FMoETransformerMLP(backend='grouped') needs its own one-expert _Expert modules "
                                 "with biases (they were replaced or changed); use backend='loop'")
            return "loop"
        return backend

    def expert_fn(self, inp, fwd_expert_count):
        """Every local expert on an expert-contiguous buffer: two grouped GEMMs on the grouped backend, else one
        fused Function (see ``expert_mlp.py``) when every expert is an untouched ``_Expert`` with a
        parameter-free activation, else fastmoe's loop."""
        if torch.is_tensor(inp) and self.expert_backend(inp) == "grouped":
            return grouped_expert_mlps(inp, fwd_expert_count, self.expert_modules(), self.activation)
        if torch.is_tensor(inp) and self._fusable():
            return expert_mlps(inp, fwd_expert_count.tolist(), self.expert_modules(), self.activation)
        return super().expert_fn(inp, fwd_expert_count)

    def expert_modules(self) -> list[_Expert]:
        """The ``_Expert`` modules among the experts (``[]`` when a subclass replaced them with a fused module)."""
        experts = self.experts if isinstance(self.experts, nn.ModuleList) else []
        return [e for e in experts if isinstance(e, _Expert)]

    def _groupable(self) -> bool:
        """Every expert an untouched one-expert ``_Expert`` with both biases (what :func:`grouped_expert_mlps`
        stacks); any activation (it runs through autograd)."""
        experts = self.expert_modules()
        return (isinstance(self.experts, nn.ModuleList) and len(experts) == len(self.experts) > 0
                and all(type(e) is _Expert and e.htoh4.num_expert == 1 and e.htoh4.bias is not None
                        and e.h4toh.bias is not None for e in experts))

    def _fusable(self) -> bool:
        """The fast path applies when every expert is an untouched one-expert ``_Expert`` and the activation
        is deterministic elementwise (see ``expert_mlp.fusable_activation``)."""
        experts = self.expert_modules()
        return (isinstance(self.experts, nn.ModuleList) and len(experts) == len(self.experts) > 0
                and fusable_activation(self.activation)
                and all(type(e) is _Expert and e.activation is self.activation and e.htoh4.num_expert == 1
                        and e.htoh4.bias is not None and e.h4toh.bias is not None for e in experts))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        _split_fused_experts(state_dict, prefix, self.num_expert)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _split_fused_experts(state_dict: dict, prefix: str, num_expert: int) -> None:
    """Rewrite the fused layout ``experts.htoh4.weight (E, h, d)`` into ``experts.<i>.htoh4.weight (1, h, d)``
    in place (labutils 0.1 and fastmoe < 1.0.1 checkpoints)."""
    for name in ("htoh4.weight", "htoh4.bias", "h4toh.weight", "h4toh.bias"):
        key = f"{prefix}experts.{name}"
        if key not in state_dict:
            continue
        fused = state_dict.pop(key)
        if fused.shape[0] != num_expert:
            raise ValueError(f"{key} holds {fused.shape[0]} experts; this layer has num_expert={num_expert}")
        for i in range(num_expert):
            state_dict[f"{prefix}experts.{i}.{name}"] = fused[i:i + 1].clone()
