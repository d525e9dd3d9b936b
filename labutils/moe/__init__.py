"""FastMoE-compatible MoE core in plain PyTorch (chapter 01).

Same names, signatures and data flow as fastmoe (``fmoe``), runnable anywhere:

    from . import FMoETransformerMLP, GShardGate, collect_aux_loss
    layer = FMoETransformerMLP(num_expert=8, d_model=64, d_hidden=256, top_k=2, gate=GShardGate)
    y = layer(x)                      # (..., 64) -> (..., 64)
    loss = task_loss + 0.01 * collect_aux_loss(model)

``labutils.moe.expert_parallel`` (chapter 06) adds the expert-parallel exchange used when ``world_size > 1``.
fastmoe's functional API (``fmoe.functions``: ``count_by_gate`` -> ``(pos, lec, gec)``, ``MOEScatter``, ...) is
``labutils.moe.fastmoe.api``; fastmoe's ``DistributedGroupedDataParallel`` is in ``labutils.data_parallel``.
"""
from .balance_gates import DCGate, SwipeGate, ZeroGate
from .capacity import drop_over_capacity, limit_by_capacity, position_in_expert
from .capacity_gates import GShardGate, SwitchGate
from .functions import check_gate_output, combine, count_by_gate, gather, gather_combine, scatter
from .gates import BaseGate, NaiveGate, NoisyGate, collect_aux_loss, cv_squared
from .layers import FMoE
from .linear import FMoELinear, MOELinear
from .transformer import FMoETransformerMLP

__all__ = [
    "FMoE", "FMoELinear", "FMoETransformerMLP", "MOELinear",
    "BaseGate", "NaiveGate", "NoisyGate", "GShardGate", "SwitchGate", "ZeroGate", "DCGate", "SwipeGate",
    "collect_aux_loss", "cv_squared", "limit_by_capacity", "drop_over_capacity", "position_in_expert",
    "count_by_gate", "scatter", "gather", "combine", "gather_combine", "check_gate_output",
]
