"""A pre-norm Transformer block with a pluggable feed-forward, and two small models built from it.
(Taught in chapters 03-05, the book's sections 6.4.3 and 6.4.4.)

The feed-forward ("FFN") of every block is one of

* ``"dense"``: :class:`DenseMLP`, Linear -> GELU -> Linear;
* ``"fmoe"``: the lab's FastMoE-compatible :class:`labutils.moe.FMoETransformerMLP` (chapter 01);
* ``"fastmoe"``: the real ``fmoe.FMoETransformerMLP`` (needs CUDA and a fastmoe build);
* ``"deepspeed"``: DeepSpeed's ``deepspeed.moe.layer.MoE`` behind :class:`DeepSpeedFFN`, a small adapter that
  returns only the output and keeps ``l_aux`` and ``exp_counts`` for the trainer.

Auxiliary (load-balancing) loss: :func:`labutils.moe.collect_aux_loss` sums every gate's loss in a model
(DeepSpeed's ``l_aux`` included); the trainer adds ``AUX_COEF * collect_aux_loss(model, clear=True)`` to the
task loss. ``AUX_COEF = 0.01`` is the Switch Transformer paper's
alpha = 1e-2: large enough to keep experts busy, small enough not to dominate the task loss. Pass
``aux_coef=`` to ``labutils.train.train`` to change it. Gates without a balancing loss (NaiveGate) contribute 0.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ._deprecate import deprecated
from .moe.gates import collect_aux_loss

AUX_COEF = 0.01  # weight of the summed gate losses in the training loss (Switch Transformer's alpha)
FFN_KINDS = ("dense", "fmoe", "fastmoe", "deepspeed")


class DenseMLP(nn.Module):
    """The dense feed-forward: ``(..., d) -> (..., d)`` through a hidden layer of ``d_hidden``."""

    def __init__(self, d_model: int, d_hidden: int, activation: nn.Module | None = None, bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_hidden, bias=bias)
        self.act = activation if activation is not None else nn.GELU()
        self.fc2 = nn.Linear(d_hidden, d_model, bias=bias)

    def forward(self, x):  # (..., d)
        return self.fc2(self.act(self.fc1(x)))  # (..., d)


class SelfAttention(nn.Module):
    """Multi-head self-attention written out: fused Q/K/V projection, scaled dot-product, output projection.

    Same parameters as ``nn.MultiheadAttention(d, heads, bias=bias)`` (4 d^2 weights, 4 d biases).
    ``extra_proj=True`` adds a fifth d x d projection after the output one: the configuration whose count,
    5 x 1024^2 = 5.24M at d=1024 without biases, is the book's "attention about 5.24M" (chapter 03).
    """

    def __init__(self, d_model: int, n_heads: int, *, bias: bool = True, causal: bool = False,
                 extra_proj: bool = False):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads, self.causal = n_heads, causal
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.out = nn.Linear(d_model, d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias) if extra_proj else None

    def split_heads(self, x):  # (B, T, d) -> (B, h, T, d/h)
        B, T, d = x.shape
        return x.view(B, T, self.n_heads, d // self.n_heads).transpose(1, 2)

    def forward(self, x):  # (B, T, d)
        q, k, v = self.qkv(x).chunk(3, dim=-1)                           # 3 x (B, T, d)
        q, k, v = self.split_heads(q), self.split_heads(k), self.split_heads(v)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # (B, h, T, d/h)
        y = self.out(y.transpose(1, 2).reshape(x.shape))                 # (B, T, d)
        return self.proj(y) if self.proj is not None else y


class Block(nn.Module):
    """Pre-norm Transformer block: ``x + attn(ln1(x))``, then ``+ ffn(ln2(.))``. ``ffn`` maps (..., d) to (..., d)."""

    def __init__(self, d_model: int, n_heads: int, ffn: nn.Module, *, causal: bool = False,
                 attn_bias: bool = True, attn_extra_proj: bool = False):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads, bias=attn_bias, causal=causal, extra_proj=attn_extra_proj)
        self.ln2 = nn.LayerNorm(d_model)
        self.ffn = ffn

    def forward(self, x):  # (B, T, d)
        x = x + self.attn(self.ln1(x))     # (B, T, d)
        return x + self.ffn(self.ln2(x))   # (B, T, d)


class DeepSpeedFFN(nn.Module):
    """DeepSpeed's ``MoE`` as a plain feed-forward: returns the output, keeps ``l_aux`` and ``exp_counts``.

    DeepSpeed's layer returns ``(out, l_aux, exp_counts)``; a block wants just ``out``. Call
    ``labutils.ds.init_deepspeed()`` first (DeepSpeed needs torch.distributed even on one process). (Chapter 04.)
    """

    def __init__(self, d_model: int, d_hidden: int, num_experts: int, *, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 4, drop_tokens: bool = True,
                 ep_size: int = 1, **moe_kwargs):
        super().__init__()
        from .ds.runtime import import_deepspeed
        import_deepspeed()
        from deepspeed.moe.layer import MoE
        self.moe = MoE(d_model, DenseMLP(d_model, d_hidden), num_experts=num_experts, ep_size=ep_size, k=k,
                       capacity_factor=capacity_factor, eval_capacity_factor=eval_capacity_factor,
                       min_capacity=min_capacity, drop_tokens=drop_tokens, **moe_kwargs)
        self.num_experts = num_experts
        self.l_aux = None        # () balancing loss of the last forward
        self.exp_counts = None   # (E,) tokens routed to each expert in the last forward

    def forward(self, x):  # (..., d)
        out, self.l_aux, self.exp_counts = self.moe(x)
        return out  # (..., d)

    # fastmoe's gate interface, so that labutils.moe.collect_aux_loss finds DeepSpeed's l_aux too
    @property
    def has_loss(self) -> bool:
        return self.l_aux is not None

    def get_loss(self, clear: bool = True):
        loss = self.l_aux
        if clear:
            self.l_aux = None
        return loss


def make_ffn(kind: str, d_model: int, d_hidden: int, *, num_expert: int = 4, top_k: int = 2, gate=None,
             **kwargs) -> nn.Module:
    """Build one feed-forward of ``kind`` in ``FFN_KINDS``. ``d_hidden`` is per expert for the MoE kinds.

    ``"fmoe"`` layers start with ``init="linear"`` (``nn.Linear``'s bound, as the dense MLP they are compared
    with) unless ``init="fastmoe"`` is passed.
    """
    if kind == "dense":
        return DenseMLP(d_model, d_hidden, **kwargs)
    if kind == "fmoe":
        from .moe import FMoETransformerMLP, NaiveGate
        kwargs.setdefault("init", "linear")
        return FMoETransformerMLP(num_expert=num_expert, d_model=d_model, d_hidden=d_hidden, top_k=top_k,
                                  gate=gate or NaiveGate, **kwargs)
    if kind == "fastmoe":
        from .optional import require
        fmoe = require("fmoe", "the real fastmoe feed-forward")
        gate_kw = {"gate": gate} if gate is not None else {}
        return fmoe.FMoETransformerMLP(num_expert=num_expert, d_model=d_model, d_hidden=d_hidden, top_k=top_k,
                                       **gate_kw, **kwargs)
    if kind == "deepspeed":
        if gate is not None:
            raise ValueError("DeepSpeed's MoE has its own TopKGate; pass k/capacity_factor instead of gate")
        return DeepSpeedFFN(d_model, d_hidden, num_expert, k=top_k, **kwargs)
    raise ValueError(f"unknown feed-forward kind {kind!r}; use one of {FFN_KINDS}")


FFNFactory = Callable[[], nn.Module]


class SeqRegressor(nn.Module):
    """The book's 6.4.3/6.4.4 model: ``(B, T, d) -> (B, T, d)``, a stack of pre-norm blocks, no head.

    Because every block is residual, the untrained model passes its input through; with independent
    N(0, 1) input and target the starting MSE is about Var(x) + Var(y) = 2 (the book's 2.04). (Chapter 03.)
    """

    def __init__(self, d_model: int, n_heads: int, ffn: FFNFactory, *, n_layers: int = 1, attn_bias: bool = True,
                 attn_extra_proj: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, ffn(), attn_bias=attn_bias, attn_extra_proj=attn_extra_proj)
            for _ in range(n_layers))

    def forward(self, x):  # (B, T, d)
        for block in self.blocks:
            x = block(x)
        return x  # (B, T, d)


class CharLM(nn.Module):
    """A causal character-level language model: ``(B, T)`` token ids -> ``(B, T, vocab)`` logits. (Chapter 05.)"""

    def __init__(self, vocab_size: int, d_model: int, n_heads: int, n_layers: int, block_size: int,
                 ffn: FFNFactory):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, ffn(), causal=True) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, idx):  # (B, T) int64
        T = idx.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.block_size}")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))  # (B, T, d)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)


def book_model(*, attention: str = "5d2", ffn: str = "fmoe", device="meta", num_expert: int = 32,
               d_model: int = 1024, d_hidden: int = 4096, top_k: int = 2, n_heads: int = 16, gate=None) -> SeqRegressor:
    """The book's one-layer model (FMoETransformerMLP defaults: 32 experts, d 1024, hidden 4096), on ``device``.

    ``attention="5d2"``: five bias-free d x d projections (5 x 1024^2 = 5,242,880, the book's 5.24M);
    ``attention="mha"``: the standard ``nn.MultiheadAttention(1024, 16)`` count (4 d^2 + 4 d = 4,198,400).
    Build it on ``device="meta"`` to count parameters without allocating them; smaller sizes give the same
    architecture shrunk (the tiny preset). (Chapter 03.)
    """
    variants = {"5d2": dict(attn_bias=False, attn_extra_proj=True), "mha": dict(attn_bias=True, attn_extra_proj=False)}
    if attention not in variants:
        raise ValueError(f"attention must be one of {sorted(variants)}, got {attention!r}")
    with torch.device(device):
        return SeqRegressor(d_model, n_heads, lambda: make_ffn(ffn, d_model, d_hidden, num_expert=num_expert,
                                                               top_k=top_k, gate=gate),
                            n_layers=1, **variants[attention])


def _read_and_clear_aux_loss(model: nn.Module) -> torch.Tensor:
    """``collect_aux_loss(model, clear=True)``: what 0.1.0's ``aux_loss`` did."""
    return collect_aux_loss(model, clear=True)


aux_loss = deprecated("aux_loss", _read_and_clear_aux_loss)  # versions: the table in _deprecate.py


def _is_gate(m: nn.Module) -> bool:
    """A fastmoe-style gate (the lab's or the real one): has ``tot_expert`` and ``get_loss``."""
    return hasattr(m, "tot_expert") and callable(getattr(m, "get_loss", None))


class ExpertLoadRecorder:
    """Counts the tokens each expert receives, per MoE layer, while enabled. (Chapter 05.)

    Hooks every fastmoe-style gate (its output ``(top_k_idx, score)``; ``-1`` marks a dropped choice) and reads
    DeepSpeed layers' ``exp_counts``. :meth:`pop` returns ``(layers, experts)`` counts since the last pop.
    """

    def __init__(self, model: nn.Module):
        self.gates = [m for m in model.modules() if _is_gate(m)]
        self.ds_layers = [m for m in model.modules() if isinstance(m, DeepSpeedFFN)]
        self.enabled = True
        self.counts: list[torch.Tensor | None] = [None] * (len(self.gates) + len(self.ds_layers))
        self.handles = [g.register_forward_hook(self._hook(i)) for i, g in enumerate(self.gates)]

    @property
    def num_layers(self) -> int:
        return len(self.counts)

    def _hook(self, i: int):
        def hook(module, inputs, output):
            if not self.enabled:
                return
            idx = output[0].detach().reshape(-1)
            c = torch.bincount(idx[idx >= 0].cpu(), minlength=module.tot_expert)
            before = self.counts[i]
            self.counts[i] = c if before is None else before + c
        return hook

    def pop(self) -> torch.Tensor | None:
        """``(layers, experts)`` int64 counts since the last call, or None for a model without MoE layers."""
        for j, layer in enumerate(self.ds_layers, start=len(self.gates)):
            if layer.exp_counts is not None:
                self.counts[j] = torch.as_tensor(layer.exp_counts).detach().cpu().long()
        counts = [c for c in self.counts if c is not None]
        if not counts or len(counts) != len(self.counts):
            self.counts = [None] * len(self.counts)
            return None
        widths = {c.numel() for c in counts}
        if len(widths) != 1:
            raise ValueError(f"MoE layers have different expert counts {sorted(widths)}; record them separately")
        out = torch.stack(counts)  # (layers, experts)
        self.counts = [None] * len(self.counts)
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


__all__ = ["AUX_COEF", "FFN_KINDS", "DenseMLP", "SelfAttention", "Block", "DeepSpeedFFN", "make_ffn", "SeqRegressor",
           "CharLM", "book_model", "aux_loss", "ExpertLoadRecorder"]
