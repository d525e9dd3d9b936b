"""Parameter counts by category; works on the meta device, so a 273M model costs no memory.
(Taught in chapters 00 and 03.)

    with torch.device("meta"):
        model = build_book_model()
    count_params(model)        # table: embeddings, attention, moe experts, router/gate, norms, other
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

CATEGORIES = ("embeddings", "attention", "moe experts", "router/gate", "norms", "other")
NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.RMSNorm)


def categorize(path: list, modules: list) -> str:
    """Category of a parameter from the module chain that owns it (outermost first).

    The innermost module that says something decides: a norm layer, a gate/router, an expert,
    attention, an embedding. Names are matched as path segments (``gate``, ``router``, ``experts``,
    ``attn``/``attention``) and classes by name (``*Gate``, ``FMoELinear``, ``MultiheadAttention``).
    """
    for name, module in zip(reversed(path), reversed(modules)):
        cls = type(module).__name__.lower()
        lname = name.lower()
        if isinstance(module, NORM_TYPES) or "norm" in cls or lname.startswith(("norm", "ln")):
            return "norms"
        if "gate" in cls or "router" in cls or lname in ("gate", "router", "wg", "gating"):
            return "router/gate"
        if "expert" in cls or "expert" in lname or cls == "fmoelinear":
            return "moe experts"
        if isinstance(module, nn.MultiheadAttention) or "attention" in cls or lname in ("attn", "attention",
                                                                                          "self_attn"):
            return "attention"
        if isinstance(module, nn.Embedding) or "embed" in lname:
            return "embeddings"
    return "other"


@dataclass
class ParamCounts:
    """Parameter counts per category, in model order; ``total`` counts shared parameters once."""
    by_category: dict = field(default_factory=dict)
    by_name: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.by_category.values())

    def __getitem__(self, category: str) -> int:
        return self.by_category.get(category, 0)

    def table(self) -> str:
        lines = [f"{'category':<14} {'parameters':>14} {'millions':>10} {'share':>7}"]
        for cat, n in self.by_category.items():
            lines.append(f"{cat:<14} {n:>14,} {n / 1e6:>9.2f}M {n / max(self.total, 1):>7.1%}")
        lines.append(f"{'total':<14} {self.total:>14,} {self.total / 1e6:>9.2f}M {1:>7.1%}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.table()


def count_params(model: nn.Module, trainable_only: bool = False) -> ParamCounts:
    """Count ``model``'s parameters by category (see :func:`categorize`). Meta-device safe."""
    if not isinstance(model, nn.Module):
        hint = (" (a state_dict? it has no modules to categorise: build the model, e.g. on the meta device, "
                "load_state_dict into it and count that; or sum(t.numel() for t in sd.values()) for the total)"
                if isinstance(model, dict) else "")
        raise TypeError(f"count_params(model): model must be a torch.nn.Module, got {type(model).__name__}{hint}")
    if not isinstance(trainable_only, bool):
        raise TypeError(f"count_params(trainable_only=...): must be True or False, got {trainable_only!r}")
    counts = {c: 0 for c in CATEGORIES}
    by_name = {}
    seen = set()
    for full_name, param in model.named_parameters():
        if id(param) in seen or (trainable_only and not param.requires_grad):
            continue
        seen.add(id(param))
        path = full_name.split(".")[:-1]
        modules, m = [], model
        for part in path:
            m = getattr(m, part)
            modules.append(m)
        cat = categorize(path, modules) if path else "other"
        counts[cat] += param.numel()
        by_name[full_name] = (cat, param.numel())
    return ParamCounts({c: n for c, n in counts.items() if n}, by_name)
