"""Put this core beside real fastmoe (``fmoe``, CUDA only) on shared weights. (Used in chapter 01.)

fastmoe has stored ``FMoETransformerMLP``'s experts two ways: fused (``experts.htoh4.weight`` of shape
``(E, h, d)``, as here) and, in recent versions, one ``_Expert(1, ...)`` per expert
(``experts.<i>.htoh4.weight`` of shape ``(1, h, d)``). :func:`copy_moe_weights` maps either way.
"""
from __future__ import annotations

import re
from typing import Any

import torch

_PER_EXPERT = re.compile(r"^experts\.(\d+)\.(.+)$")


def _fused_view(module: torch.nn.Module) -> dict:
    """``name -> tensor`` with per-expert ``experts.<i>.x`` entries stacked into fused ``experts.x``."""
    fused, parts = {}, {}
    for name, p in module.named_parameters():
        m = _PER_EXPERT.match(name)
        if m:
            parts.setdefault(m.group(2), {})[int(m.group(1))] = p
        else:
            fused[name] = p
    for rest, by_idx in parts.items():
        fused[f"experts.{rest}"] = [by_idx[i] for i in sorted(by_idx)]
    return fused


@torch.no_grad()
def copy_moe_weights(src: torch.nn.Module, dst: torch.nn.Module) -> list:
    """Copy every parameter of ``src`` into ``dst``, converting fused <-> per-expert expert layouts.

    Returns the list of fused names copied; raises KeyError/ValueError when the two models do not match.
    """
    s, d = _fused_view(src), _fused_view(dst)
    if set(s) != set(d):
        raise KeyError(f"parameters differ: only in src {sorted(set(s) - set(d))}, "
                       f"only in dst {sorted(set(d) - set(s))}")
    for name in s:
        value = torch.cat(list(s[name])) if isinstance(s[name], list) else s[name]
        target = d[name]
        if isinstance(target, list):
            chunks = value.reshape(len(target), *target[0].shape)
            for t, v in zip(target, chunks):
                t.copy_(v)
        else:
            if target.numel() != value.numel():
                raise ValueError(f"{name}: {tuple(value.shape)} does not fit {tuple(target.shape)}")
            target.copy_(value.reshape(target.shape))
    return sorted(s)


def fused_grads(module: torch.nn.Module) -> dict:
    """Gradients by fused name (per-expert gradients concatenated), to compare two layouts."""
    out = {}
    for name, p in _fused_view(module).items():
        if isinstance(p, list):
            out[name] = torch.cat([q.grad for q in p]) if all(q.grad is not None for q in p) else None
        else:
            out[name] = p.grad
    return out


def compare_with_fastmoe(num_expert: int = 4, d_model: int = 16, d_hidden: int = 32, top_k: int = 2,
                         tokens: int = 64, seed: int = 0, device: str = "cuda"):
    """Run ours and ``fmoe.FMoETransformerMLP`` (NaiveGate) on the same weights and input.

    Returns a :class:`labutils.compare.ParityReport` over the output, the input gradient and every
    parameter gradient (fp32, rtol=atol=1e-5). Needs fastmoe and CUDA.
    """
    from labutils.compare import ParityReport, compare_tensors
    from labutils.moe.transformer import FMoETransformerMLP
    from labutils.optional import require

    fmoe = require("fmoe", "the comparison with real fastmoe")
    torch.manual_seed(seed)
    ours = FMoETransformerMLP(num_expert, d_model, d_hidden, top_k=top_k).to(device)
    theirs = fmoe.FMoETransformerMLP(num_expert=num_expert, d_model=d_model, d_hidden=d_hidden, top_k=top_k).to(device)
    with torch.no_grad():  # fastmoe leaves biases at zero; give them values so their gradients matter
        for p in ours.parameters():
            p.add_(0.1 * torch.randn_like(p))
    copy_moe_weights(ours, theirs)
    x = torch.randn(tokens, d_model, device=device)
    grad = torch.randn(tokens, d_model, device=device)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ours(x1), theirs(x2)
    y1.backward(grad)
    y2.backward(grad)
    report = ParityReport("ours vs fastmoe")
    assert x1.grad is not None and x2.grad is not None, "both inputs require grad"
    report.diffs += [compare_tensors("output", y1, y2), compare_tensors("input grad", x1.grad, x2.grad)]
    g1, g2 = fused_grads(ours), fused_grads(theirs)
    report.diffs += [compare_tensors(f"grad {n}", g1[n], g2[n]) for n in sorted(g1)]
    return report


def compare_api_with_fastmoe(num_expert: int = 4, top_k: int = 2, tokens: int = 12, d_model: int = 8,
                             seed: int = 0, device: str = "cuda"):
    """fastmoe's functional API and ``mask``/``mask_dict`` beside ours on the same gate ids, weights and input.

    Checks ``count_by_gate``'s counts (and ``pos`` up to the order within an expert, which fastmoe's CUDA
    atomics leave open), ``MOEScatter`` then ``MOEGather`` (values and input gradient) and a masked
    ``FMoETransformerMLP`` (same ids from a constant gate). Returns a :class:`labutils.compare.ParityReport`.
    Needs fastmoe and CUDA.
    """
    from labutils.compare import ParityReport, compare_tensors
    from labutils.moe.fastmoe import api as ours
    from labutils.moe.transformer import FMoETransformerMLP
    from labutils.optional import require

    require("fmoe", "the comparison with real fastmoe")
    import fmoe
    import fmoe.functions as theirs

    report = ParityReport("fastmoe API: ours vs fastmoe")
    torch.manual_seed(seed)
    gate = (torch.randint(num_expert + 1, (tokens, top_k)) - 1).to(device)           # -1 = dropped
    (p1, l1, g1), (p2, l2, g2) = ours.count_by_gate(gate, num_expert, 1), theirs.count_by_gate(gate, num_expert, 1)
    assert p1 is not None and p2 is not None  # require_pos=True
    report.diffs += [compare_tensors("local_expert_count", l1.cpu(), l2.cpu()),
                     compare_tensors("global_expert_count", g1.cpu(), g2.cpu())]
    key = gate.reshape(-1)                                                           # pos sorted within experts
    report.diffs.append(compare_tensors("pos (sorted per expert)",
                                        (key[p1] * p1.numel() + p1).sort().values.cpu(),
                                        (key[p2] * p2.numel() + p2).sort().values.cpu()))
    x = torch.randn(tokens, d_model, device=device)
    outs = []
    for api, pos in ((ours, p1), (theirs, p2)):
        xi = x.clone().requires_grad_()
        fbs = int(pos.numel())
        buf = api.MOEScatter.apply(xi, torch.div(pos, top_k, rounding_mode="floor"), l1.cpu(), g1.cpu(), fbs, 1)
        out = api.MOEGather.apply(buf * 2, pos, l1.cpu(), g1.cpu(), tokens * top_k, 1)
        out.pow(2).sum().backward()
        outs.append((out, xi.grad))
    report.diffs += [compare_tensors("MOEScatter -> MOEGather", outs[0][0], outs[1][0]),
                     compare_tensors("... input grad", outs[0][1], outs[1][1])]

    class ConstantGate(torch.nn.Module):
        def __init__(self, d_model, num_expert, world_size, top_k=2):
            super().__init__()
            self.top_k = top_k

        def forward(self, inp):
            idx = torch.arange(inp.shape[0] * self.top_k, device=inp.device).view(-1, self.top_k) % 2
            return idx, torch.full((inp.shape[0], 1, self.top_k), 0.5, device=inp.device)

    mask = torch.zeros(tokens, dtype=torch.long, device=device)
    mask[1], mask[3] = 1, 2
    mask_dict = {1: torch.zeros(d_model, device=device), 2: torch.ones(d_model, device=device)}
    kw: dict[str, Any] = dict(num_expert=num_expert, d_model=d_model, d_hidden=2 * d_model, gate=ConstantGate,
                              mask=mask, mask_dict=mask_dict, top_k=top_k)
    a, b = FMoETransformerMLP(**kw).to(device), fmoe.FMoETransformerMLP(**kw).to(device)
    copy_moe_weights(a, b)
    report.diffs.append(compare_tensors("masked FMoETransformerMLP", a(x), b(x)))
    return report
